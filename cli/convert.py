"""`python -m qwen_turbo convert`: a workflow (UI or API JSON, subgraphs too) accelerated, the
pack's nodes in place of ComfyUI's where they feed a Qwen-Image model (`--to pack`), or its
stock twin for teammates without the pack (`--to stock`), with a summary of what changed and
what was left, and why. Call `headless.start_comfyui` first (for the host's node schemas)."""

import json
import os
import struct
from functools import partial
from pathlib import Path

from . import swap
from .stock import PACK_OF, PASSTHROUGH, STOCK_OF
from .subgraphs import WorkflowError, definitions, malformed
from .workflow import is_api, ui_to_api, unknown_type

SUFFIX = {"pack": "_qwen_turbo", "stock": "_stock"}
NORM_Q = "transformer_blocks.0.attn.norm_q.weight"


class Refused(WorkflowError):
    """The workflow is not converted; the message is one line saying why."""


def target(source: Path, to: str) -> Path:
    """The default output: the source's name, any earlier suffix replaced by `to`'s."""
    stem = source.stem
    for suffix in SUFFIX.values():
        stem = stem.removesuffix(suffix)
    return source.with_name(f"{stem}{SUFFIX[to]}.json")


def output_problem(source: Path, to: str, out: Path | None) -> str | None:
    """Why the default output cannot be written without --out (one line), or None."""
    if out is not None:
        return None
    path = target(source, to)
    if path.resolve() == source.resolve():
        return f"the {to} copy would overwrite the source; pass --out PATH"
    if path.exists():
        return f"{path} exists; pass --out {path} to replace it"
    return None


def _header_keys(path: str) -> list[str]:
    """A safetensors file's tensor names, from its header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100_000_000:
            raise ValueError("header too large")
        return [k for k in json.loads(f.read(size)) if k != "__metadata__"]


def loader_file_problem(name) -> str | None:
    """Why the Optimized Loader cannot take UNETLoader's file `name` (one line), or None: the
    file's tensor names where it is in models/diffusion_models, else its name."""
    import folder_paths

    from ..runtime.dit import nextdit
    from ..runtime.dit.config import REQUIRED, describe
    from ..runtime.dit.convert import strip_prefix

    if not isinstance(name, str):
        return "its file is chosen by a link"
    if name.lower().endswith(".gguf"):
        return f"{name} is a GGUF file; the Optimized Loader reads safetensors"
    path = folder_paths.get_full_path("diffusion_models", name)
    if path is None:
        if any(word in name.lower() for word in ("qwen", "newbie")):
            return None
        return (f"{name} is not in models/diffusion_models and its name does not say Qwen-Image "
                "or NewBie")  # fmt: skip
    try:
        keys = strip_prefix(dict.fromkeys(_header_keys(path)))
    except (OSError, ValueError, struct.error) as e:
        return f"{name} cannot be read as safetensors ({e})"
    if nextdit.is_nextdit(keys) and nextdit.Z_IMAGE not in keys:
        return None
    if any(k not in keys for k in (*REQUIRED, NORM_Q)):
        return f"{name} is not a Qwen-Image or NewBie DiT: {describe(keys)}"
    return None


def _ancestors(api: dict):
    """id -> the ids it depends on, through any input."""
    memo: dict[str, set] = {}

    def of(node_id: str) -> set:
        if node_id not in memo:
            memo[node_id] = set()
            for value in api[node_id]["inputs"].values():
                if isinstance(value, list) and len(value) == 2 and value[0] in api:
                    memo[node_id] |= {value[0]} | of(value[0])
        return memo[node_id]

    return of


def plan(api: dict, file_problem, known=()) -> tuple[dict[str, str], dict[str, str]]:
    """(id -> the pack node to swap it for, id -> why a stock node is left) for `--to pack`;
    the UNETLoaders in `known` were Optimized Loaders (their files go unchecked). Refused
    where no node loads a Qwen-Image model."""
    of = _ancestors(api)
    models, left, todo = set(), {}, {}
    for node_id, node in api.items():
        kind = node["class_type"]
        if kind == "UNETLoader":
            why = None if node_id in known else file_problem(node["inputs"].get("unet_name"))
            if why:
                left[node_id] = why
                continue
            todo[node_id] = PACK_OF[kind]["new_node_id"]
        if kind in ("UNETLoader", "QwenTurboLoader"):
            models.add(node_id)
    if not models:
        reason = f": {next(iter(left.values()))}" if left else ""
        raise Refused(f"no Qwen-Image or NewBie model: no UNETLoader loads one{reason}")
    samplers = {k for k, n in api.items() if n["class_type"] == "QwenTurboCUDAGraphSampler"}
    for node_id, node in api.items():
        model = node["inputs"].get("model")
        if node["class_type"] == "KSampler":
            if isinstance(model, list) and ({model[0]} | of(model[0])) & models:
                samplers.add(node_id)
            else:
                left[node_id] = "its model is not a Qwen-Image model"
    for node_id, node in api.items():
        kind = node["class_type"]
        if kind in ("VAEDecode", "SaveImage") and not of(node_id) & models:
            left[node_id] = "it does not come from a Qwen-Image model"
        elif kind == "VAEEncode" and not any(node_id in of(s) for s in samplers):
            left[node_id] = "it feeds no Qwen-Image sampler"
        elif kind in PACK_OF and kind != "UNETLoader" and node_id not in left:
            todo[node_id] = PACK_OF[kind]["new_node_id"]
    return todo, left


def _graphs(ui: dict) -> list[dict]:
    return [ui, *definitions(ui).values()]


def _label(node_id, kind: str) -> str:
    return f"node {node_id} ({kind})"


def convert(data: dict, to: str, info: dict, file_problem=loader_file_problem):
    """Convert `data` (UI or API form) in place; returns (changed, left): a line for each
    node. Raises Refused or WorkflowError."""
    changed, left = [], []
    (_convert_api if is_api(data) else _convert_ui)(data, to, info, file_problem, changed, left)
    if not changed:
        if to == "stock":
            raise Refused("no Qwen Turbo node: nothing to convert to stock")
        raise Refused("nothing to accelerate: " + ("; ".join(left) or "already the pack's"))
    return changed, left


def _swap(do, table: dict, node_id, kind: str, info: dict, changed: list, left: list) -> bool:
    """`do(replace, schema of kind, schema of the new node)`, its line in the summary."""
    new = table[kind]["new_node_id"]
    try:
        notes = do(table[kind], info[kind], info[new]) or []
    except swap.Unfit as e:
        left.append(f"{_label(node_id, kind)}: the {new} cannot take {e}")
        return False
    changed.append(f"{_label(node_id, kind)} -> {new}" + "".join(f"; {n}" for n in notes))
    return True


def _taken_out(node_id, kind: str) -> str:
    return f"{_label(node_id, kind)} taken out (its users take its {PASSTHROUGH[kind]})"


def _convert_api(api: dict, to: str, info: dict, file_problem, changed: list, left: list):
    for node_id, node in api.items():
        if node["class_type"] not in info:
            raise unknown_type(node_id, node["class_type"])
    if to == "stock":
        for node_id, node in api.items():
            if node["class_type"] in STOCK_OF:
                do = partial(swap.swap_api, node)
                _swap(do, STOCK_OF, node_id, node["class_type"], info, changed, left)
        changed += [_taken_out(k, n["class_type"]) for k, n in api.items()
                    if n["class_type"] in PASSTHROUGH]  # fmt: skip
        swap.remove_passthrough_api(api)
        return
    changed += [f"{_label(k, api[k]['class_type'])} put back"
                for k in swap.restore_passthrough_api(api)]  # fmt: skip
    stashed = {k for k, n in api.items()
               if n.get("_meta", {}).get(swap.STASH, {}).get("class_type") in STOCK_OF}  # fmt: skip
    todo, why = plan(api, file_problem, stashed)
    todo |= dict.fromkeys(stashed)
    for node_id in todo:
        if api[node_id]["class_type"] in PACK_OF:
            do = partial(swap.swap_api, api[node_id])
            _swap(do, PACK_OF, node_id, api[node_id]["class_type"], info, changed, left)
    left += [f"{_label(k, api[k]['class_type'])}: {w}" for k, w in why.items()]


def _convert_ui(ui: dict, to: str, info: dict, file_problem, changed: list, left: list):
    if to == "pack":
        for graph in _graphs(ui):
            changed += [f"{_label(n['id'], n['type'])} put back"
                        for n in swap.restore_passthrough_ui(graph)]  # fmt: skip
    origins: dict = {}
    api = ui_to_api(ui, info, execution=False, origins=origins)  # unknown types: refused
    where = {}  # a node of a subgraph used twice: its first id
    for node_id, (_, node) in origins.items():
        where.setdefault(id(node), node_id)
    if to == "pack":
        was = {k: n.get("properties", {}).get(swap.STASH, {}) for k, (_, n) in origins.items()}
        stashed = {k for k, stash in was.items() if stash.get("type") in STOCK_OF}
        todo, why = plan(api, file_problem, stashed)
        done = set()
        for node_id in [k for k in origins if k in todo or k in stashed]:
            graph, node = origins[node_id]
            if id(node) in done or node["type"] not in PACK_OF:
                continue
            done.add(id(node))
            do = partial(swap.swap_ui, graph, node)
            _swap(do, PACK_OF, node_id, node["type"], info, changed, left)
        left += [
            f"{_label(k, api[k]['class_type'])}: {w}"
            for k, w in why.items()
            if id(origins[k][1]) not in done and where[id(origins[k][1])] == k
        ]
        return
    for graph in _graphs(ui):
        for node in list(graph.get("nodes", [])):
            kind, node_id = node["type"], where.get(id(node), node["id"])
            if kind in STOCK_OF:
                do = partial(swap.swap_ui, graph, node)
                _swap(do, STOCK_OF, node_id, kind, info, changed, left)
            elif kind in PASSTHROUGH:
                if swap.remove_passthrough_ui(graph, node, PASSTHROUGH[kind]):
                    changed.append(_taken_out(node_id, kind))
                else:
                    left.append(f"{_label(node_id, kind)}: its {PASSTHROUGH[kind]} is unconnected")
            elif kind.startswith("QwenTurbo"):
                left.append(f"{_label(node_id, kind)}: no stock twin")


def run(source: Path, to: str, out: Path | None, info: dict) -> int:
    """The command: convert, print the summary, write the file. Raises Refused or
    WorkflowError (nothing written)."""
    data = json.loads(source.read_text(encoding="utf-8"))
    with malformed():
        changed, left = convert(data, to, info)
    path = out or target(source, to)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    for line in changed:
        print(f"changed  {line}")
    for line in left:
        print(f"left     {line}")
    print(f"wrote {path} ({len(changed)} changed, {len(left)} left)")
    return 0
