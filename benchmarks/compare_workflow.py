"""`python -m qwen_turbo compare` on a bundled workflow with random full-size weights: the
files `card_workflow.py` writes (the DiT as Comfy-Org's fp8_e4m3fn file, the real text
encoder's layout), ComfyUI set up as `main.py` does, then the command's own code. On random
weights the pictures are noise-like: this shows the command and the times on this GPU, not the
fidelity on trained weights. Prints compare's table and JSON.

    COMFYUI_PATH=~/comfy/ComfyUI-v0.33 python benchmarks/compare_workflow.py --dynamic-vram
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from card_workflow import prompts, start, write_models, write_pictures  # noqa: E402

from tests.harness.comfyui import ROOT  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workflow", default="qwen_image_2512_turbo_2512px")
    p.add_argument("--models", default="/tmp/qwen-turbo-models")
    p.add_argument("--dynamic-vram", action="store_true", help="v0.33: as main.py enables it")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--prompt", default="a red fox in the snow")
    a = p.parse_args()
    models = Path(a.models)
    start(models, a.dynamic_vram)
    from qwen_turbo.cli import compare

    workflow = ROOT / "workflows" / f"{a.workflow}.json"
    api = prompts(workflow, text_encoder=True)["pack"]
    write_models(models, api)
    write_pictures(models / "input", api)
    return compare.compare(workflow, a.prompt, a.seed)


if __name__ == "__main__":
    sys.exit(main())
