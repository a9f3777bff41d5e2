"""python -m qwen_turbo {bench,run,compare}: the speed-up on this GPU, a workflow run headless,
or its pictures and time against stock ComfyUI's. Run from the folder holding the pack
(ComfyUI/custom_nodes)."""

import argparse
import sys
from pathlib import Path


def workflow_arguments(parser, what: str) -> None:
    """The arguments of the commands that run a workflow."""
    parser.add_argument("workflow", type=Path, help=what)
    parser.add_argument("--prompt", help="replaces the positive prompt")
    parser.add_argument("--seed", type=int, help="replaces every sampler's seed")
    parser.add_argument("--out", type=Path, help="output folder (default: ComfyUI's output/)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_turbo", description=__doc__.split(". Run")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="stock vs pack on random full-size weights: one DiT forward and one VAE decode",
        description="Random full-size Qwen-Image weights (nothing to download): one DiT forward "
        "and one VAE decode, stock ComfyUI and this pack side by side. Without CUDA it runs a "
        "small CPU demonstration.",
    )
    b.add_argument("--size", type=int, default=1328, help="image side in pixels (multiple of 16)")
    b.add_argument("--layers", type=int, default=60,
                   help="DiT layers (60 = the real model; fewer fit smaller GPUs)")  # fmt: skip
    r = sub.add_parser(
        "run",
        help="run a workflow (UI JSON) through ComfyUI's executor and save the PNG",
        description="Runs a workflow through ComfyUI's executor with a progress bar, saves the "
        "images and prints per-node timings. Missing model files are listed with where to "
        "put them and where to download them.",
    )
    workflow_arguments(r, "e.g. workflows/qwen_image_2512_turbo_2512px.json")
    c = sub.add_parser(
        "compare",
        help="run a workflow with stock nodes and with the pack's: PSNR, SSIM, times, pictures",
        description="Runs the workflow twice, same seed and prompt: with ComfyUI's own nodes "
        "in place of the pack's, then as it is. Saves both pictures and their difference "
        "(amplified) under ComfyUI's output/qwen_turbo_compare/, prints PSNR, SSIM and times.",
    )
    workflow_arguments(c, "a workflow (UI JSON) with Qwen Turbo nodes")
    a = p.parse_args(argv)

    from .cli.workflow import workflow_problem

    if a.command in ("run", "compare") and (problem := workflow_problem(a.workflow)):
        print(f"{p.prog} {a.command}: error: {a.workflow}: {problem}", file=sys.stderr)
        return 2

    from .cli import bench, headless

    if a.command == "run":
        headless.start_comfyui(a.out)
        return headless.run(a.workflow, a.prompt, a.seed)
    if a.command == "compare":
        from .cli import compare

        headless.start_comfyui(a.out)
        return compare.compare(a.workflow, a.prompt, a.seed)
    headless.start_comfyui()
    bench.bench(a.size, a.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
