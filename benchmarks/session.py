"""An artist's whole session through ComfyUI's executor on a simulated card: stock and the pack.

Each variant runs in a process of its own, on a card of C GiB (the GPU filled until
`mem_get_info` reports C - 1 GiB free, and its total reported as C GiB to ComfyUI and the pack)
with R GiB of host RAM (a ballast process holds the rest), the real text-encoder nodes by
default (random Qwen2.5-VL 7B weights in the layout of `qwen_2.5_vl_7b_fp8_scaled.safetensors`)
and random full-size DiT, LoRA and VAE weights in the layouts users download
(`card_workflow.write_models`). One executor goes through the session, in order:

- the first run on a new install: Triton's, the CUDA driver's and Inductor's caches and the
  fidelity probe's result (ComfyUI's user folder) empty;
- a new seed; three new prompts (texts of different lengths);
- new sizes (of 1328², 1664×928 and 2512², for NewBie-image of 1024², 1024×1536 and 2048²,
  the others, then back to the workflow's own);
- the LoRA's strength changed, the LoRA removed, then back (where the workflow has one);
- each other bundled workflow asked for (`--others`) in the same process, then the first again;
- ComfyUI's "free model memory" (`/free` with unload_models and free_memory, as main.py does
  it between prompts), then a run;
- an interrupt in the middle of sampling (at its second step), then a run;
- a new prompt again.

Per action: done or not (an interrupted run counts as done when it stops cleanly), seconds,
VRAM peak above the filler, host RAM peak of the process (its ballast not counted), error.
Prints the table, stock | pack, then JSON on the last line; `--markdown` also prints the
table as markdown for docs/PERFORMANCE.md.

    COMFYUI_PATH=~/comfy/ComfyUI-v0.33 python benchmarks/session.py --dynamic-vram \
        --cards 24 12 --ram 32 --workflow qwen_image_2512_turbo_2512px \
        --others qwen_image_2512_t2i_1328px
"""

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
import card_workflow as card  # noqa: E402

from tests.harness.comfyui import ROOT  # noqa: E402

GiB = card.GiB
SIZES = [(1328, 1328), (1664, 928), (2512, 2512)]  # (width, height)
NEWBIE_SIZES = [(1024, 1024), (1024, 1536), (2048, 2048)]  # NewBie-image's
PROMPTS = [  # new prompts of different lengths (tokens), as an artist types them
    "a red fox in snow",
    "a lighthouse on a cliff at dusk, waves breaking below, warm light in the windows, "
    "gulls in the wind, painted in thick oil strokes",
    "an old market street in the rain at night: lanterns in red and gold hang over stalls of "
    "fruit, fish and spices; people under umbrellas; puddles mirror the signs; a cat sleeps "
    "on a crate; steam rises from a noodle stand; the cobblestones shine; in the distance a "
    "tram crosses the street and a clock tower shows a quarter past ten; cinematic, detailed, "
    "35 mm film, soft grain",
]


def sizes_after(api: dict) -> list[tuple[int, int]]:
    """The session's new sizes: SIZES (NEWBIE_SIZES in a NewBie workflow) other than the
    workflow's own, then its own; [] where the workflow has no empty latent (Edit takes the
    picture's size)."""
    latent = next((n["inputs"] for n in api.values() if n["class_type"].startswith("Empty")
                   and "width" in n["inputs"]), None)  # fmt: skip
    if latent is None:
        return []
    own = (latent["width"], latent["height"])
    sizes = NEWBIE_SIZES if card.is_newbie(api) else SIZES
    return [s for s in sizes if s != own] + [own]


def set_size(api: dict, size: tuple[int, int]) -> None:
    for node in api.values():
        if node["class_type"].startswith("Empty") and "width" in node["inputs"]:
            node["inputs"].update(width=size[0], height=size[1])


def set_prompt(api: dict, n: int) -> None:
    """Each sampler's positive prompt: PROMPTS[n % 3] (a variation of it after the first
    three), or the seed of the test conditioning that stands in for the text encoder."""
    text = PROMPTS[n % len(PROMPTS)] + (f", variation {n}" if n >= len(PROMPTS) else "")
    card.new_prompt(api, n + 1, text)


def set_lora_strength(api: dict, strength: float) -> None:
    for node in api.values():
        if node["class_type"] == "LoraLoaderModelOnly":
            node["inputs"]["strength_model"] = strength


def actions(workflows: dict[str, dict]) -> list[tuple[str, dict]]:
    """The session: (action, API graph) in order; `workflows` maps names to the variant's API
    graphs, the first the session's own. An action named "interrupt" is interrupted at its
    sampler's second step; "free" is ComfyUI's /free before its run."""
    name, api = next(iter(workflows.items()))
    api = copy.deepcopy(api)
    seed = 1
    out = []

    def step(action: str, graph: dict | None = None) -> None:
        nonlocal seed
        graph = copy.deepcopy(graph if graph is not None else api)
        for node in graph.values():
            if "seed" in node["inputs"] and "steps" in node["inputs"]:
                node["inputs"]["seed"] = seed
        out.append((action, graph))

    step("first run, new install")
    seed += 1
    step("new seed")
    for n in range(3):
        set_prompt(api, n)
        step(f"new prompt ({len(PROMPTS[n].split())} words)")
    for size in sizes_after(api):
        set_size(api, size)
        step(f"new size {size[0]}x{size[1]}")
    if any(n["class_type"] == "LoraLoaderModelOnly" for n in api.values()):
        set_lora_strength(api, 0.6)
        step("LoRA strength 0.6")
        step("LoRA removed", card.without_lora(api))
        set_lora_strength(api, 1.0)
        step("LoRA back")
    others = list(workflows.items())[1:]
    for other, graph in others:
        step(f"workflow {other}", graph)
    if others:
        step(f"workflow {name}")
    step("free", api)
    seed += 1
    step("interrupt", api)
    seed += 1
    step("after interrupt")
    set_prompt(api, 3)
    step("new prompt")
    return out


def new_install_caches() -> None:
    """Empty caches, as a new install has: Triton's, the CUDA driver's (JIT) and Inductor's
    (ComfyUI's user folder, which holds the fidelity probe's result, is set in `child`)."""
    root = Path(tempfile.mkdtemp(prefix="qwen-turbo-new-install-"))
    for var in ("TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "TORCHINDUCTOR_CACHE_DIR"):
        os.environ[var] = str(root / var.lower())
    return root


class Interrupter:
    """ComfyUI's progress hook: interrupts at the second step of a sampling when armed, as the
    frontend's Cancel does (`interrupt_current_processing`)."""

    def __init__(self, mm):
        self.mm, self.armed = mm, False

    def __call__(self, value, total, preview=None, node_id=None, **kwargs):
        if self.armed and total > 1 and value >= 2:
            self.armed = False
            self.mm.interrupt_current_processing(True)


def free_like_main(executor, mm) -> None:
    """What main.py does after a prompt when /free asks for unload_models and free_memory."""
    mm.unload_all_models()
    executor.reset()
    gc.collect()
    mm.soft_empty_cache()


def run_session(workflows: dict[str, dict], filler_bytes: int = 0):
    """The session's actions (`actions`) through one executor; yields a row per action."""
    import comfy.model_management as mm
    import comfy.utils
    import execution

    from qwen_turbo.cli import headless
    from qwen_turbo.nodes import report

    server = card.Recorder()
    send, report.send = report.send, server.badge
    executor = headless._executor(execution, server)
    interrupter = Interrupter(mm)
    comfy.utils.set_progress_bar_global_hook(interrupter)
    try:
        for i, (action, api) in enumerate(actions(workflows)):
            if action == "free":
                free_like_main(executor, mm)
            interrupter.armed = action == "interrupt"
            r = card.run_once(executor, server, api, None, filler_bytes)
            # an interrupted run stops without an error (ComfyUI's "execution_interrupted")
            r["done"] = r["ok"] or (action == "interrupt" and r["error"] is None)
            mm.interrupt_current_processing(False)
            yield {"i": i, "action": action, **r}
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
        report.send = send


def session_graph(a, name: str, variant: str) -> dict:
    """The API graph of bundled workflow `name` for `variant` (stock or pack), its samplers
    at most `a.steps` steps."""
    api = card.prompts(ROOT / "workflows" / f"{name}.json", a.text_encoder == "real")[variant]
    steps = [n["inputs"]["steps"] for n in api.values() if "steps" in n["inputs"]]
    if a.steps and steps and max(steps) > a.steps:
        card.set_steps(api, a.steps)
    return api


def child(a) -> None:
    """One variant's session in this process; JSON lines, one per action."""
    caches = new_install_caches()
    ballast = card.hold_ram(a.ram) if a.ram and not a.ram_held else None
    try:
        dynamic = card.start(Path(a.models), a.dynamic_vram)
        import folder_paths
        import torch

        folder_paths.set_user_directory(str(caches / "user"))
        workflows = {name: session_graph(a, name, a.variant) for name in [a.workflow, *a.others]}
        filler = card.simulate_card(a.card) if a.card else None
        for row in run_session(workflows, filler.numel() if filler is not None else 0):
            print(json.dumps({"variant": a.variant, "card_gib": a.card, "ram_gib": a.ram,
                              "dynamic_vram": dynamic, "at_once": a.gpus, **row}),
                  flush=True)  # fmt: skip
        del filler
        torch.cuda.empty_cache()
    finally:
        if ballast is not None:
            ballast.kill()


def run_child(a, card_gib: float, variant: str, gpu: int | None = None) -> list[dict]:
    """One variant's session in a new process (on GPU `gpu` alone, where given); its rows (a
    row saying why, if it died)."""
    argv = [sys.executable, __file__, "--child", "--card", str(card_gib), "--variant", variant,
            "--workflow", a.workflow, "--models", a.models, "--text-encoder", a.text_encoder,
            "--gpus", str(a.gpus), "--others", *a.others]  # fmt: skip
    for flag, value in (("--ram", a.ram), ("--steps", a.steps)):
        if value:
            argv += [flag, str(value)]
    if a.dynamic_vram:
        argv.append("--dynamic-vram")
    env = dict(os.environ)
    if gpu is not None:  # the gpu-th of those this process sees
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if visible else str(gpu)
        argv.append("--ram-held")
    rows, t0 = [], time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("{") and '"action"' in line:
            rows.append(json.loads(line))
            if a.jsonl:  # each row as it comes: a run cut short keeps what it measured
                with open(a.jsonl, "a") as f:
                    f.write(line)
            r = rows[-1]
            why = f"  {r['error']}" if r["error"] and not r["done"] else ""
            print(f"  {variant:5} {card_gib:>5} GiB  {r['action']:32} "
                  f"{'done' if r['done'] else 'FAILED'} {r['seconds']:7.2f} s{why}",
                  flush=True)  # fmt: skip
        elif a.verbose:
            print(line, end="")
    rc = proc.wait()
    if rc != 0:
        rows.append({"action": f"process exited with {rc}", "variant": variant, "done": False,
                     "card_gib": card_gib, "seconds": round(time.perf_counter() - t0, 1),
                     "error": "the process died"})  # fmt: skip
    return rows


def run_at_once(a, runs: list[tuple[float, str]]) -> list[dict]:
    """`runs` (card, variant) `a.gpus` at a time, one GPU each; one ballast leaves `a.ram` GiB
    of host RAM per run at once (each run's own peak is in its rows)."""
    from concurrent.futures import ThreadPoolExecutor

    rows = []
    for first in range(0, len(runs), a.gpus):
        wave = runs[first : first + a.gpus]
        ballast = card.hold_ram(a.ram * len(wave)) if a.ram else None
        try:
            with ThreadPoolExecutor(len(wave)) as pool:
                done = pool.map(lambda x: run_child(a, *x[1], gpu=x[0]), enumerate(wave))
                rows += [r for rs in done for r in rs]
        finally:
            if ballast is not None:
                ballast.kill()
    return rows


def table(rows: list[dict], markdown: bool) -> list[str]:
    """Stock | pack per card and action: seconds (or FAILED), VRAM peak, host RAM peak."""

    def cell(r):
        if r is None:
            return "—"
        if not r["done"]:
            return "**fails**" if markdown else "FAILED"
        peak = r.get("peak_gib") or 0
        return f"{r['seconds']:.2f} s, {peak:.1f} / {r['host_gib']['peak']:.1f} GiB"

    by = {(r["card_gib"], r["variant"], r.get("i"), r["action"]): r for r in rows}
    keys = sorted({(r["card_gib"] or 0, r.get("i", 99), r["action"]) for r in rows})
    lines = ["| card | action | stock | pack | pack / stock |", "|---|---|---|---|---:|"]
    for c, i, action in keys:
        s = by.get((c or None, "stock", i, action)) or by.get((c, "stock", i, action))
        p = by.get((c or None, "pack", i, action)) or by.get((c, "pack", i, action))
        ratio = (f"{p['seconds'] / s['seconds']:.2f}×" if s and p and s["done"] and p["done"]
                 and action not in ("interrupt",) else "")  # fmt: skip
        lines.append(f"| {c or 'whole'} GiB | {action} | {cell(s)} | {cell(p)} | {ratio} |")
    if not markdown:
        lines = [ln.replace("**", "") for ln in lines]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = sorted(f.stem for f in (ROOT / "workflows").glob("*.json"))
    p.add_argument("--workflow", default="qwen_image_2512_turbo_2512px", choices=names)
    p.add_argument("--others", nargs="*", default=[], choices=names,
                   help="other bundled workflows the session runs in the same process")  # fmt: skip
    p.add_argument("--cards", type=float, nargs="+", default=[24, 12], help="GiB; 0 = whole")
    p.add_argument("--ram", type=float, help="GiB of host RAM left available")
    p.add_argument("--variants", nargs="+", default=["stock", "pack"])
    p.add_argument("--models", default="/tmp/qwen-turbo-models")
    p.add_argument("--dynamic-vram", action="store_true", help="v0.33: as main.py enables it")
    p.add_argument("--text-encoder", choices=["real", "test"], default="real")
    p.add_argument("--steps", type=int, help="at most this many steps in every sampler")
    p.add_argument("--markdown", action="store_true", help="also the table as markdown")
    p.add_argument("--verbose", action="store_true", help="the children's own output too")
    p.add_argument("--jsonl", help="also append each row to this file as it comes")
    p.add_argument("--gpus", type=int, default=1,
                   help="runs at once, one GPU each; --ram GiB per run")  # fmt: skip
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ram-held", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--card", type=float, help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--table", nargs="+", metavar="JSONL",
                   help="only print the markdown table of rows saved with --jsonl")  # fmt: skip
    a = p.parse_args()
    if a.child:
        return child(a)
    if a.table:
        rows = [json.loads(line) for path in a.table for line in Path(path).read_text().split("\n")
                if line.strip()]  # fmt: skip
        return print("\n".join(table(rows, markdown=True)))
    card.start(Path(a.models))  # the model files, written before any process holds the RAM
    for name in [a.workflow, *a.others]:
        pack = session_graph(a, name, "pack")
        card.write_models(Path(a.models), pack)
        card.write_pictures(Path(a.models) / "input", pack)
    runs = [(card_gib, variant) for card_gib in a.cards for variant in a.variants]
    rows = run_at_once(a, runs) if a.gpus > 1 else [r for c, v in runs for r in run_child(a, c, v)]
    import torch

    comfy = card.comfy_version() + (", dynamic VRAM" if a.dynamic_vram else "")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"GPU {gpu}, torch {torch.__version__}, ComfyUI {comfy}, {a.workflow}, "
          f"host RAM {a.ram or 'all'} GiB, text encoder {a.text_encoder}")  # fmt: skip
    print("\n".join(table(rows, markdown=False)))
    if a.markdown:
        print("\n".join(table(rows, markdown=True)))
    print(json.dumps({"gpu": gpu,
                      "torch": torch.__version__, "comfyui": comfy, "workflow": a.workflow,
                      "others": a.others, "ram_gib": a.ram, "dynamic_vram": a.dynamic_vram,
                      "text_encoder": a.text_encoder, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
