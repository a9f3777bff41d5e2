"""Every cuDNN execution plan for the fp8 attention graph, each timed: is the plan the pack
takes (heuristics mode A's first) cuDNN's fastest?

The graph is `kernels/attention_fp8._Plan`'s: (1, 24, L, 128) fp8 q, k, v in the DiT's
(B, L, H, D) layout, fp8 O. For each L and heuristics mode every plan is built, run 3 times,
then timed over 10 runs (CUDA events). Prints one line per plan.

    python benchmarks/cudnn_plans.py --lengths 7145 24905
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness import pack  # noqa: E402


def graph(cudnn, handle, seq: int, heads: int = 24, d: int = 128):
    """The fp8 SDPA graph of `_Plan`, validated; returns (graph, tensors in execution order)."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, handle=handle,
                      intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip
    fp8 = dict(dim=[1, heads, seq, d], stride=[seq * heads * d, d, heads * d, 1],
               data_type=cudnn.data_type.FP8_E4M3)  # fmt: skip
    one = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
    q, k, v = g.tensor(**fp8), g.tensor(**fp8), g.tensor(**fp8)
    scales = [g.tensor(**one) for _ in range(6)]
    dq, dk, dv, so, ss, ds = scales
    o, _, amax_s, amax_o = g.sdpa_fp8(
        q=q, k=k, v=v, descale_q=dq, descale_k=dk, descale_v=dv, descale_s=ds, scale_s=ss,
        scale_o=so, is_inference=True, attn_scale=d**-0.5, use_causal_mask=False,
    )  # fmt: skip
    o.set_output(True).set_dim(fp8["dim"]).set_stride(fp8["stride"])
    o.set_data_type(cudnn.data_type.FP8_E4M3)
    for t in (amax_s, amax_o):
        t.set_output(True).set_dim(one["dim"]).set_stride(one["stride"])
        t.set_data_type(cudnn.data_type.FLOAT)
    g.validate()
    g.build_operation_graph()
    return g, (q, k, v, o, amax_s, amax_o, *scales)


def time_plans(cudnn, seq: int, modes, name: str) -> None:
    import torch

    handle = cudnn.create_handle()
    g, (q, k, v, o, amax_s, amax_o, *scales) = graph(cudnn, handle, seq)
    g.create_execution_plans(modes)
    g.check_support()
    t0 = time.perf_counter()
    g.build_plans(cudnn.build_plan_policy.ALL)
    count = g.get_execution_plan_count()
    print(f"L={seq} heuristics {name}: {count} plans, built in {time.perf_counter() - t0:.2f} s")
    x = torch.randn(1, seq, 24, 128, device="cuda").to(torch.float8_e4m3fn)
    out = torch.empty_like(x)
    values = torch.tensor([1, 1, 1, 1, 448, 1 / 448], device="cuda")
    amax = torch.empty(2, device="cuda")
    tensors = {q: x, k: x, v: x, o: out, amax_s: amax[0:1], amax_o: amax[1:2]}
    tensors.update({t: values[i : i + 1] for i, t in enumerate(scales)})
    for i in range(count):
        ws = torch.empty(g.get_workspace_size_plan_at_index(i), dtype=torch.uint8, device="cuda")
        for _ in range(3):
            g.execute_plan_at_index(tensors, ws, i, handle=handle)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            g.execute_plan_at_index(tensors, ws, i, handle=handle)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"  plan {i}: {ms:.3f} ms, {4 * seq * seq * 24 * 128 / ms / 1e9:.0f} TFLOP/s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[7145, 24905])
    a = p.parse_args()
    pack.register()
    import cudnn

    modes = {"A + FALLBACK": [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK],
             "B": [cudnn.heur_mode.B]}  # fmt: skip
    for seq in a.lengths:
        for name, mode in modes.items():
            time_plans(cudnn, seq, mode, name)


if __name__ == "__main__":
    main()
