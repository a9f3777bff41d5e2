"""CUDA graphs for sampling: capture a model's forward, or a whole guided step, once per static
shape, and replay it.

- `sampling`: the CUDA Graph Sampler's run: installing the runners, the rerun as KSampler
  after an out-of-memory error, trimming the graphs after a run.
- `runners`: the ComfyUI wrappers that capture and replay.
- `inputs`: how a call's arguments become a graph's static inputs and its key.
- `policy`: what may be captured: a replay skips the Python inside the captured region.
- `cache`: the graphs of a model and their counters, held through `runtime.memory`.
- `blocks`: in calls no runner captures, each transformer block replayed from a graph of its
  own (the Optimized Loader installs it).
- `capture`: the CUDA backend.
"""
