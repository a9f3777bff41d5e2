"""python -m qwen_turbo {bench,run,compare,convert}: the speed-up on this GPU, a workflow run
headless, its pictures and time against stock ComfyUI's, or a workflow accelerated (or its
stock twin). Run from the folder holding the pack (ComfyUI/custom_nodes)."""

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
    v = sub.add_parser(
        "convert",
        help="a workflow with the pack's nodes (--to pack) or ComfyUI's own (--to stock)",
        description="--to pack swaps UNETLoader, KSampler, VAEDecode, VAEEncode and SaveImage "
        "for the pack's nodes where they serve a Qwen-Image model (inside subgraphs too), "
        "keeping links, widget values, titles and positions; --to stock writes the stock twin "
        "for teammates without the pack. UI or API JSON. Prints what changed and what was "
        "left, and why.",
    )
    v.add_argument("workflow", type=Path, help="a workflow (UI or API JSON)")
    v.add_argument("--to", choices=("pack", "stock"), required=True)
    v.add_argument("--out", type=Path, help="where to write (default: beside the workflow, "
                   "its name ending _qwen_turbo.json or _stock.json)")  # fmt: skip
    a = p.parse_args(argv)

    from .cli.workflow import workflow_problem

    def error(problem: str) -> int:
        print(f"{p.prog} {a.command}: error: {a.workflow}: {problem}", file=sys.stderr)
        return 2

    if a.command != "bench" and (problem := workflow_problem(a.workflow, a.command == "convert")):
        return error(problem)
    if a.command == "convert":
        from .cli.convert import output_problem

        if problem := output_problem(a.workflow, a.to, a.out):
            return error(problem)

    from .cli import bench, headless
    from .cli.subgraphs import WorkflowError

    headless.start_comfyui(a.out if a.command in ("run", "compare") else None)
    try:
        if a.command == "run":
            return headless.run(a.workflow, a.prompt, a.seed)
        if a.command == "compare":
            from .cli import compare

            return compare.compare(a.workflow, a.prompt, a.seed)
        if a.command == "convert":
            import nodes

            from .cli import convert
            from .cli.workflow import object_info

            info = object_info(nodes.NODE_CLASS_MAPPINGS)
            return convert.run(a.workflow, a.to, a.out, info)
    except WorkflowError as e:  # convert.Refused is one too
        return error(str(e))
    bench.bench(a.size, a.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
