"""`python -m qwen_turbo run`: a bundled (UI-format) workflow through ComfyUI's own executor,
in this process, with a progress bar and per-node timings. Call `start_comfyui` first."""

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

from .comfy_home import HOW_TO_PROVIDE, PACK, find_comfyui
from .subgraphs import flatten, malformed
from .workflow import SEED_NAMES, object_info, ui_to_api


def start_comfyui(output_dir: Path | None = None) -> Path:
    """ComfyUI importable and initialised (CPU when there is no CUDA), with this pack loaded."""
    comfy = find_comfyui()
    if comfy is None:
        sys.exit(HOW_TO_PROVIDE)
    sys.path.insert(0, str(comfy))
    import torch
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    if output_dir is not None:
        args.output_directory = str(output_dir)
    import folder_paths

    import nodes

    if output_dir is not None:
        folder_paths.set_output_directory(str(output_dir))
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
    if "QwenTurboLoader" not in nodes.NODE_CLASS_MAPPINGS:  # pack not in custom_nodes/
        asyncio.run(nodes.load_custom_node(str(PACK)))
    return comfy


def missing_models(ui: dict) -> list[str]:
    """One line per model file a workflow's loaders (in subgraphs too) need and the folders
    lack."""
    import folder_paths

    lines, seen = [], set()
    for _, node, _ in flatten(ui):
        for model in node.get("properties", {}).get("models", []):
            if (model["directory"], model["name"]) in seen:
                continue
            seen.add((model["directory"], model["name"]))
            if folder_paths.get_full_path(model["directory"], model["name"]) is None:
                where = folder_paths.get_folder_paths(model["directory"])
                folder = where[0] if where else model["directory"]
                lines.append(f"{model['name']} ({node['type']}): put it in {folder}\n"
                             f"    download: {model['url']}")  # fmt: skip
    return lines


def set_prompt_and_seed(api: dict, prompt: str | None, seed: int | None) -> None:
    """The positive CLIPTextEncode of every sampler gets `prompt`; every sampler gets `seed`
    (KSampler's `seed`, KSamplerAdvanced's and SamplerCustom's `noise_seed`)."""
    for node in api.values():
        inputs = node["inputs"]
        for name in SEED_NAMES:
            if seed is not None and name in inputs:
                inputs[name] = seed
        positive = inputs.get("positive")
        if prompt is not None and isinstance(positive, list):
            source = api[positive[0]]
            if "text" in source["inputs"]:
                source["inputs"]["text"] = prompt


class _Console:
    """The `server` PromptExecutor reports to: prints node timings and a progress bar."""

    client_id = "qwen-turbo-cli"
    last_node_id = last_prompt_id = None

    def __init__(self, api: dict):
        self.api, self.timings, self._node, self._t0 = api, {}, None, None

    def _close(self):
        if self._node is not None:
            self.timings[self._node] = time.perf_counter() - self._t0
            print(file=sys.stderr)

    def send_sync(self, event, data, sid=None):
        if event == "executing":
            self._close()
            self._node = data.get("node")
            self._t0 = time.perf_counter()
            if self._node is not None:
                kind = self.api[self._node]["class_type"]
                print(f"[{self._node}] {kind}", end="", file=sys.stderr, flush=True)
        elif event == "execution_error":
            self._close()
            self._node = None
            print(f"error in node {data.get('node_id')} ({data.get('node_type')}): "
                  f"{data.get('exception_message')}", file=sys.stderr)  # fmt: skip

    def progress(self, value, total, preview=None, prompt_id=None, node_id=None):
        width = 30
        done = int(width * value / max(total, 1))
        bar = "#" * done + "-" * (width - done)
        print(f"\r[{self._node}] {bar} {value}/{total}", end="", file=sys.stderr, flush=True)

    def send_progress_text(self, *args, **kwargs):
        pass


def _executor(execution, server):
    """A PromptExecutor with classic caching on either host (newer ones also take the RAM
    thresholds that main.py passes, read even when unused)."""
    import inspect

    if "cache_args" in inspect.signature(execution.PromptExecutor).parameters:
        args = {"lru": 0, "ram": 0, "ram_inactive": 0}
        return execution.PromptExecutor(server, cache_args=args)
    return execution.PromptExecutor(server)


def load_workflow(workflow: Path) -> dict | None:
    """The API-format prompt of a UI-format workflow; None (the missing files listed) where
    model files are missing. Raises WorkflowError where it cannot be read."""
    import nodes

    ui = json.loads(workflow.read_text())
    with malformed():
        missing = missing_models(ui)
        if missing:
            print(f"{workflow.name} needs these model files:\n" + "\n".join(missing),
                  file=sys.stderr)  # fmt: skip
            return None
        return ui_to_api(ui, object_info(nodes.NODE_CLASS_MAPPINGS))


def execute(api: dict):
    """Run `api` through ComfyUI's executor with a progress bar: (executor, per-node seconds,
    total seconds); the executor is None where the prompt does not validate."""
    import comfy.utils
    import execution

    console = _Console(api)
    comfy.utils.set_progress_bar_global_hook(console.progress)
    valid = asyncio.run(execution.validate_prompt(str(uuid.uuid4()), api, None))
    if not valid[0]:
        print(f"invalid workflow: {valid[1]}\n{json.dumps(valid[3], indent=1)}", file=sys.stderr)
        return None, {}, 0.0
    executor = _executor(execution, console)
    t0 = time.perf_counter()
    executor.execute(api, str(uuid.uuid4()), {"client_id": console.client_id}, valid[2])
    console._close()
    return executor, console.timings, time.perf_counter() - t0


def saved_images(executor) -> dict[str, list[Path]]:
    """The files each output node of the last run saved, by node id."""
    import folder_paths

    out_dir = Path(folder_paths.get_output_directory())
    return {
        node: [out_dir / i["subfolder"] / i["filename"] for i in out.get("images", [])]
        for node, out in executor.history_result.get("outputs", {}).items()
    }


def run(workflow: Path, prompt: str | None, seed: int | None) -> int:
    """Run it; 0 on success, 2 when model files are missing, 1 on a node error."""
    api = load_workflow(workflow)
    if api is None:
        return 2
    set_prompt_and_seed(api, prompt, seed)
    executor, timings, total = execute(api)
    if executor is None:
        return 1
    print(f"{'node':>6}  {'type':32} {'seconds':>8}")
    for node, seconds in timings.items():
        print(f"{node:>6}  {api[node]['class_type']:32} {seconds:8.2f}")
    print(f"{'':>6}  {'total':32} {total:8.2f}")
    for paths in saved_images(executor).values():
        for path in paths:
            print(f"saved {path}")
    return 0 if executor.success else 1
