"""Memory over mixed runs of the pack's turbo workflow through ComfyUI's executor on a card.

Issue 14's target: memory stays flat over 20 mixed runs at 24 GiB (sizes, batch sizes, a LoRA
on and off). The bundled qwen_image_2512_turbo_2512px as shipped (pack nodes; random full-size
weights and test conditioning as in card_workflow.py), one executor, on a card of --card GiB
(the GPU filled until `mem_get_info` reports card - 1 GiB free). Run i (from 1) makes
SIZES[(i - 1) % 3] with the LoRA on odd runs (on even runs its node is removed and the loader
wired straight to ModelSamplingAuraFlow), batch 1 in the first three runs of every six and
batch 2 in the next three (at 2512², --batch-2512). The cases repeat every 6 runs, so run 2 and
run 20 are the same case. After each run, as main.py does between prompts, gc.collect() and
ComfyUI's soft_empty_cache().

Per run: seconds, peak VRAM above the filler, and after the run torch's allocated and reserved
memory above the filler and ComfyUI's view (`get_free_memory()`, what it would hand out).
Prints a table, a verdict line (allocated after the last run of run 2's case minus after run 2)
and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI-v0.33 python benchmarks/soak.py --card 24
"""

import argparse
import copy
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from card_workflow import (  # noqa: E402
    GiB,
    Recorder,
    fill_to,
    prompts,
    run_once,
    start,
    without_lora,
    write_models,
)

from tests.harness.comfyui import ROOT  # noqa: E402

WORKFLOW = "qwen_image_2512_turbo_2512px"
SIZES = [(1328, 1328), (1664, 928), (2512, 2512)]  # (width, height)
CYCLE = 6


def case(run: int, batch_2512: int) -> tuple[int, int, int, bool]:
    """(width, height, batch, lora) of run `run` (from 1)."""
    i = run - 1
    width, height = SIZES[i % len(SIZES)]
    batch = 1 if i % CYCLE < CYCLE // 2 else batch_2512 if width == 2512 else 2
    return width, height, batch, i % 2 == 0


def variant(api: dict, width: int, height: int, batch: int, lora: bool) -> dict:
    """`api` at this size and batch; without `lora`, its LoRA node bypassed."""
    out = copy.deepcopy(api) if lora else without_lora(api)
    for node in out.values():
        if node["class_type"] == "EmptySD3LatentImage":
            node["inputs"].update(width=width, height=height, batch_size=batch)
    return out


def report(rows: list[dict]) -> dict | None:
    """Print the table and the verdict line; the verdict (None with fewer than 8 runs)."""
    print(f"{'run':>3} {'size':>9} {'batch':>5} {'lora':4} {'ok':3} {'s':>6} {'peak':>6} "
          f"{'alloc':>6} {'reserv':>6} {'comfy free':>10}  (GiB after the run)")  # fmt: skip
    for r in rows:
        print(f"{r['run']:3d} {r['width']:>4}x{r['height']:<4} {r['batch']:5d} "
              f"{'on' if r['lora'] else 'off':4} {'yes' if r['ok'] else 'NO':3} "
              f"{r['seconds']:6.2f} {r['peak_gib']:6.2f} {r['allocated_gib']:6.2f} "
              f"{r['reserved_gib']:6.2f} {r['comfy_free_gib']:10.2f}"
              + (f"  ERROR {r['error']}" if r["error"] else ""))  # fmt: skip
    same = [r for r in rows if r["run"] % CYCLE == 2 % CYCLE]  # run 2's case
    if len(same) < 2:
        return None
    first, last = same[0], same[-1]
    verdict = {
        "from_run": first["run"], "to_run": last["run"],
        "drift_gib": round(last["allocated_gib"] - first["allocated_gib"], 3),
        "comfy_free_drift_gib": round(last["comfy_free_gib"] - first["comfy_free_gib"], 3),
        "allocated_gib_same_case": {r["run"]: r["allocated_gib"] for r in same},
        "failed_runs": [r["run"] for r in rows if not r["ok"]],
    }  # fmt: skip
    failed = ", ".join(map(str, verdict["failed_runs"])) or "none"
    print(f"verdict: allocated after run {last['run']} minus after run {first['run']} (same "
          f"case): {verdict['drift_gib']:+.3f} GiB (ComfyUI's free memory "
          f"{verdict['comfy_free_drift_gib']:+.3f} GiB); failed runs: {failed}")  # fmt: skip
    return verdict


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--card", type=float, default=24, help="GiB; 0 = the whole GPU")
    p.add_argument("--runs", type=int, default=20, help="0: write the model files and stop")
    p.add_argument("--batch-2512", type=int, choices=[1, 2], default=1,
                   help="batch at 2512² in the batch-2 runs (2 where the card fits)")  # fmt: skip
    p.add_argument("--models", default="/tmp/qwen-turbo-models")
    p.add_argument("--dynamic-vram", action="store_true", help="v0.33: as main.py enables it")
    a = p.parse_args()
    models = Path(a.models)
    dynamic = start(models, a.dynamic_vram)
    import comfy.model_management as mm
    import execution
    import torch

    from qwen_turbo.cli import headless

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    api = prompts(ROOT / "workflows" / f"{WORKFLOW}.json")["pack"]
    write_models(models, api)
    if not a.runs:
        return
    filler = fill_to(a.card - 1) if a.card else None
    filler_bytes = filler.numel() if filler is not None else 0
    free = torch.cuda.mem_get_info()[0] / GiB
    server = Recorder()
    executor = headless._executor(execution, server)
    rows = []
    for run in range(1, a.runs + 1):
        width, height, batch, lora = case(run, a.batch_2512)
        r = run_once(executor, server, variant(api, width, height, batch, lora), run, filler_bytes)
        gc.collect()
        mm.soft_empty_cache()
        rows.append({
            "run": run, "width": width, "height": height, "batch": batch, "lora": lora, **r,
            "allocated_gib": round((torch.cuda.memory_allocated() - filler_bytes) / GiB, 3),
            "reserved_gib": round((torch.cuda.memory_reserved() - filler_bytes) / GiB, 3),
            "comfy_free_gib": round(mm.get_free_memory() / GiB, 3),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    import comfyui_version

    version = getattr(comfyui_version, "__version__", "?")
    card = (f"{a.card:g} GiB card" if a.card else "whole GPU") + f", {free:.1f} GiB free"
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, ComfyUI {version}"
          f"{', dynamic VRAM' if dynamic else ''}, {WORKFLOW}, {card}")  # fmt: skip
    verdict = report(rows)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "comfyui": version, "dynamic_vram": dynamic, "workflow": WORKFLOW,
                      "card_gib": a.card or None, "free_gib": round(free, 2),
                      "verdict": verdict, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
