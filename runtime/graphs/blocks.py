"""Transformer blocks replayed from CUDA graphs in model calls that run eagerly.

A model call that no graph runner captures (KSampler on the Optimized Loader's model, a DiT
partly offloaded, a call the capture policy leaves eager) issues each kernel from Python: at
1328² a block's host time is about its GPU time on an H100, and at 1024² twice it. Here a
block whose weights are on the GPU (loaded, or staged there by the weight streamer at the same
addresses at every call) is captured once per call signature and then replayed
(`BlockGraphs.forward`, the block's forward as an object patch, inside the weight streamer's):
its host time is a few copies and one launch. Blocks with a layer that copies or patches its
weights in the call (ComfyUI's own copies, a LoRA on an offloaded layer), and calls with Python
that a replay would skip, run eagerly. Python between the blocks runs at every call: ComfyUI adds
a ControlNet's residuals (the transformer's `control` argument) into a replayed block's output,
in place, and model patches known to keep none of the outputs (`policy.block_patches`: DiffSynth's
ControlNet) do the same; the next block reads that buffer as it is.

Each call signature (the shapes, strides and dtypes of the block's tensor arguments, its other
arguments, `call_key()`: the lockstep call, the fp8 compute mode) has a `Chain`: static inputs
and two pairs of hidden-state buffers (image and text tokens) used in turn, block i reading
pair i % 2 and writing pair (i + 1) % 2, so consecutive replayed blocks hand over without a
copy. A block's graph is keyed on its index, its chain, its weights' data pointers, its
attention override and `block_key(i, kwargs)`. Every allocation inside a graph is freed by its
end, so all graphs share one memory pool and may replay in any order.

The first call of a key runs eagerly (kernels compile, cuDNN builds its plans), the next one
captures. An out-of-memory error in a block, captured or not, drops every block graph and
turns them off for the model until its next sampling run (`retry`), after a second such error
until it is unloaded: the block runs again eagerly.
"""

import contextlib
import contextvars
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from .. import host, log_once, memory
from .capture import capturing_call, end_failed_capture, pool_bytes, side_stream
from .policy import foreign_code

log = logging.getLogger(__name__)
STATES = ("hidden_states", "encoder_hidden_states")  # handed from block to block
MAX_CHAINS = 4  # call signatures kept, least recently used out
# a block's graphs kept per chain, oldest out: its weights before and after a LoRA, say (the
# weights' addresses are in the key, and the streamer's slabs may move when made again)
GRAPHS_PER_BLOCK = 2
MAX_SEEN = 4096  # graph keys remembered as run once
# A block's activations at their peak, as a multiple of its image tokens' bytes: room asked
# before a new chain's first capture, and held by the lockstep's load. The fused block's pool
# at 1328², batch 1, fp8_cudnn came to about 16 (benchmarks/RESULTS.md 3.11).
PEAK_PER_STATE = 16
# A chain's bytes as a multiple of its hidden states' (two pairs, and the other inputs)
CHAIN_PER_STATES = 5
# Out-of-memory errors after which the graphs stay off until the model unloads
MAX_OUT_OF_MEMORY = 2
# Calls of more image tokens get no room held for their graphs at a load: their GPU time hides
# the host's (a 30-layer forward eager took 1.46x its replay at 1328², 6,889 tokens, and 1.01x
# at 2512², 24,649: RESULTS 3.5, 3.11), so the weights the room would push to the host buy
# nothing.
ROOM_TOKENS = 16384

_off = contextvars.ContextVar("qwen_turbo_block_graphs_off", default=False)


@contextlib.contextmanager
def off():
    """Every block runs eagerly inside (a run again after running out of memory)."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


class CudaBlockCapture:
    """The real backend: each block's graph captured on the side stream into one pool."""

    def __init__(self):
        self.pools = []  # the last one captures; one more after each failed capture

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.is_cuda and not torch.cuda.is_current_stream_capturing()

    def capture(self, run: Callable[[], None], need: int) -> Callable[[], None]:
        """`run` captured into the pool; `need`: bytes it may allocate. The allocator cannot
        free cached memory during a capture, so where the driver has less free it is freed
        first (what torch.cuda.graph does before every capture, with a synchronize)."""
        if not self.pools:
            self.pools.append(torch.cuda.graph_pool_handle())
        pool = self.pools[-1]
        if torch.cuda.mem_get_info()[0] < need:
            torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        side = side_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                run()
                graph.capture_end()
            except BaseException:
                with contextlib.suppress(Exception):  # the stream's capture ended
                    graph.capture_end()
                end_failed_capture(pool)
                # where torch's allocator still counts the pool as capturing (seen on an
                # H200, torch 2.11), every later capture into it would fail: a new one
                self.pools.append(torch.cuda.graph_pool_handle())
                raise
        torch.cuda.current_stream().wait_stream(side)
        return graph.replay

    def pool_bytes(self) -> int:
        return pool_bytes(*self.pools) or 0

    def reset(self) -> None:
        self.pools = []  # each freed with the last graph that uses it


class Chain:
    """The static tensors of one call signature: the inputs other than the hidden states
    (`inputs`), and two pairs of hidden-state buffers (`states`)."""

    def __init__(self, kwargs: dict):
        self.inputs = {k: torch.empty_like(v) for k, v in kwargs.items()
                       if isinstance(v, torch.Tensor) and k not in STATES}  # fmt: skip
        self.states = [{k: torch.empty_like(kwargs[k]) for k in STATES} for _ in range(2)]
        self.graphs: dict[Hashable, Callable[[], None]] = {}

    def add(self, key: tuple, replay: Callable[[], None]) -> None:
        """A graph of block key[0]; the oldest of that block's graphs goes past
        GRAPHS_PER_BLOCK."""
        same = [k for k in self.graphs if k[0] == key[0]]
        for k in same[: len(same) + 1 - GRAPHS_PER_BLOCK]:
            del self.graphs[k]
        self.graphs[key] = replay

    def nbytes(self) -> int:
        tensors = [*self.inputs.values(), *(t for pair in self.states for t in pair.values())]
        return sum(t.nbytes for t in tensors)

    def load(self, i: int, kwargs: dict) -> dict:
        """Block i's arguments with every tensor in its static buffer (copied there unless it
        is that buffer: the previous block's output)."""
        static = dict(kwargs)
        for k, t in (*self.inputs.items(), *self.states[i % 2].items()):
            if kwargs[k] is not t:
                t.copy_(kwargs[k])
            static[k] = t
        return static


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def parameters_read(m: torch.nn.Module, device: torch.device) -> list | None:
    """The tensors a module's call reads on `device`: its parameters; None where the call
    would copy or patch them (ComfyUI's partial load left it on the host, or patches apply
    per call). A module with `device_tensors` (the pack's fp8 Linear) names its own."""
    if hasattr(m, "device_tensors"):
        return m.device_tensors(device)
    tensors = [p for p in m._parameters.values() if p is not None]
    if tensors and (
        "prev_comfy_cast_weights" in m.__dict__
        or getattr(m, "weight_function", None) or getattr(m, "bias_function", None)
        or any(p.device != device for p in tensors)
    ):  # fmt: skip
        return None
    return tensors


def signature(kwargs: dict) -> tuple | None:
    """The call signature of a block's keyword arguments, transformer_options aside; None
    where one cannot be captured (an argument that is neither a tensor nor a plain value)."""
    sig = []
    for k, v in sorted(kwargs.items()):
        if k == "transformer_options":
            continue
        if isinstance(v, torch.Tensor):
            sig.append((k, tuple(v.shape), v.stride(), v.dtype, v.device))
        elif v is None or type(v) in (bool, int, float, str):
            sig.append((k, v))
        else:
            return None
    return tuple(sig)


class BlockGraphs:
    """The block graphs of one model (`model`, ComfyUI's BaseModel: what `memory` holds them
    under) whose transformer blocks are `blocks`.

    `call_key()`: the Python state of the whole call that its blocks' computation depends on
    (buffers are per call key, so each call in lockstep needs its own). `block_key(i,
    kwargs)`: block i's, or None where its call cannot be replayed. `reads(module, device)`:
    the tensors a module's call reads on the device, None where it copies or patches them
    (`parameters_read` by default)."""

    def __init__(self, model, blocks, call_key: Callable[[], Hashable],
                 block_key: Callable[[int, dict], Hashable | None], backend=None,
                 reads=None):  # fmt: skip
        self.model = weakref.ref(model)
        self.blocks = list(blocks)
        # the modules holding parameters; read live at each call, as a load or a LoRA swaps
        # the tensors
        self.layers = [[m for m in b.modules() if m._parameters] for b in self.blocks]
        self.call_key = call_key
        self.block_key = block_key
        self.backend = backend or CudaBlockCapture()
        self.reads = reads or parameters_read
        self.chains: OrderedDict[Hashable, Chain] = OrderedDict()
        self.seen: set[Hashable] = set()  # graph keys run eagerly once
        self.failed: set[Hashable] = set()
        self.out_of_memory = False
        self.out_of_memory_errors = 0
        self._pool_bytes: int | None = 0
        self.replays = 0  # for the sampler's badge and tests
        self.refused: dict[str, int] = {}  # block calls kept eager by foreign code, by reason
        self.told_room = False  # logged once that a capture had no room

    # memory.Holder
    def held_bytes(self) -> int:
        if self._pool_bytes is None:
            self._pool_bytes = self.backend.pool_bytes()
        return self._pool_bytes + sum(c.nbytes() for c in self.chains.values())

    def drop(self) -> None:
        self.chains.clear()
        self.backend.reset()
        self._pool_bytes = 0

    def clear(self) -> None:
        self.drop()
        self.seen.clear()
        self.failed.clear()
        self.out_of_memory = False
        self.out_of_memory_errors = 0

    def _weights(self, i: int, device: torch.device) -> tuple | None:
        """The data pointers of what block i's layers read on `device` (`reads`); None where
        a layer would copy or patch a weight in the call."""
        ptrs = []
        for m in self.layers[i]:
            tensors = self.reads(m, device)
            if tensors is None:
                return None
            ptrs.extend(t.data_ptr() for t in tensors)
        return tuple(ptrs)

    def _key(self, i: int, kwargs: dict) -> tuple | None:
        """(chain key, graph key) of block i's call, or None where it runs eagerly."""
        x = kwargs.get("hidden_states")
        block = self.blocks[i]
        if (
            _off.get() or self.out_of_memory or not isinstance(x, torch.Tensor)
            or not self.backend.supports(x) or capturing_call()
            or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
            or torch.compiler.is_compiling()
            or block._forward_hooks or block._forward_pre_hooks
        ):  # fmt: skip
            return None
        options = kwargs.get("transformer_options") or {}
        why = foreign_code(options, "diffusion_model", [], blocks=True)
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            log_once(log, logging.INFO, f"Block graphs: blocks run eagerly: {why}")
            return None
        sig = signature(kwargs)
        weights = self._weights(i, x.device) if sig is not None else None
        state = self.block_key(i, kwargs) if weights is not None else None
        if state is None:
            return None
        chain = (sig, torch.is_inference_mode_enabled(), self.call_key())
        override = options.get("optimized_attention_override")
        return chain, (i, weights, override, state)

    def forward(self, i: int, inner: Callable) -> Callable:
        """Block i's forward (`inner`) replayed from its graph where it can be (called with
        keyword arguments, the hidden states maybe first)."""

        def forward(*args, **kwargs):
            if len(args) == 1 and "hidden_states" not in kwargs:  # as the streamer passes it
                args, kwargs = (), {"hidden_states": args[0], **kwargs}
            key = None if args else self._key(i, kwargs)
            if key is not None:
                why = None
                try:
                    out = self._replay(i, inner, kwargs, *key)
                except Exception as e:
                    if not host.is_oom(e):
                        raise
                    out, why = None, first_line(e)
                if why is not None:
                    self._out_of_memory(why)  # outside the handler: its frames are gone
                if out is not None:
                    return out
            return self._eager(inner, args, kwargs)

        forward.__wrapped__ = inner  # for inspect.unwrap: what this block runs
        return forward

    def _eager(self, inner: Callable, args, kwargs):
        """inner(*args, **kwargs); where it runs out of memory while block graphs hold memory,
        those go and it runs again."""
        try:
            return inner(*args, **kwargs)
        except Exception as e:
            if not host.is_oom(e) or not self.chains:
                raise
            why = first_line(e)
        self._out_of_memory(why)  # outside the handler: the failed call's frames are gone
        return inner(*args, **kwargs)

    def _out_of_memory(self, why: str) -> None:
        self.drop()
        self.out_of_memory = True
        self.out_of_memory_errors += 1
        until = ("its next run" if self.out_of_memory_errors < MAX_OUT_OF_MEMORY
                 else "it is unloaded")  # fmt: skip
        where = ""
        if torch.cuda.is_available():
            cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            where = (f"; {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB free on the driver, "
                     f"{cached / 2**30:.2f} GiB cached")  # fmt: skip
            torch.cuda.empty_cache()
        log.warning("Block graphs: out of memory (%s%s); dropped, and every block of this model "
                    "runs eagerly until %s", why, where, until)  # fmt: skip

    def retry(self) -> None:
        """A new sampling run: graphs turned off by an out-of-memory error are tried again (and
        the load leaves room for them, `room_for`), unless that was the MAX_OUT_OF_MEMORY-th."""
        if self.out_of_memory_errors < MAX_OUT_OF_MEMORY:
            self.out_of_memory = False

    def _replay(self, i: int, inner: Callable, kwargs: dict, chain_key, graph_key):
        """Block i's output from its graph (captured first where this key ran eagerly before);
        None where it runs eagerly."""
        full = (chain_key, graph_key)
        chain = self.chains.get(chain_key)
        replay = chain.graphs.get(graph_key) if chain is not None else None
        if replay is None:
            if full not in self.seen:
                if len(self.seen) >= MAX_SEEN:  # keys of weights long gone
                    self.seen.clear()
                self.seen.add(full)
                return None
            if full in self.failed:
                return None
            if chain is None:
                if not self._room(kwargs):
                    return None
                chain = self.chains[chain_key] = Chain(kwargs)
                while len(self.chains) > MAX_CHAINS:
                    self.chains.popitem(last=False)
            replay = self._capture(i, inner, chain, kwargs, full)  # loads this call's inputs
            if replay is None:
                return None
            chain.add(graph_key, replay)
        else:
            chain.load(i, kwargs)
        self.chains.move_to_end(chain_key)
        replay()
        self.replays += 1
        out = chain.states[(i + 1) % 2]
        return out["encoder_hidden_states"], out["hidden_states"]

    def _room(self, kwargs: dict) -> bool:
        """Whether a new chain's buffers and captures leave room for the blocks that run
        eagerly beside the graphs' pool (their activations need as much again)."""
        x = kwargs["hidden_states"]
        if not x.is_cuda:
            return True
        pool = self.held_bytes() - sum(c.nbytes() for c in self.chains.values())
        states = sum(kwargs[k].nbytes for k in STATES)
        need = max(pool, PEAK_PER_STATE * x.nbytes) * 2 + CHAIN_PER_STATES * states
        free = memory.room(x.device)
        if free >= need:
            return True
        if not self.told_room:
            self.told_room = True
            log.info("Block graphs: too little free memory to capture (%.2f GiB needed, %.2f "
                     "free); blocks run eagerly", need / 2**30, free / 2**30)  # fmt: skip
        return False

    def room_for(self, tokens: int, text_tokens: int, calls: int) -> int:
        """The memory the graphs take beside the eager calls, for `calls` calls of a batch
        with `tokens` image and `text_tokens` text tokens in all: the pool and each call's
        chain; 0 while they are off for this model, or where a call has more than ROOM_TOKENS
        image tokens."""
        if self.out_of_memory or tokens > ROOM_TOKENS:
            return 0
        width, item = self.blocks[0].dim, 2  # bf16 hidden states
        x, txt = tokens * width * item, text_tokens * width * item
        return PEAK_PER_STATE * x + calls * CHAIN_PER_STATES * (x + txt)

    def _capture(self, i: int, inner: Callable, chain: Chain, kwargs: dict, full):
        """Block i's graph reading chain's pair i % 2 and writing pair (i + 1) % 2; None where
        the capture fails (logged once)."""
        static = chain.load(i, kwargs)
        out = chain.states[(i + 1) % 2]

        def run():
            txt, img = inner(**static)
            out["encoder_hidden_states"].copy_(txt)
            out["hidden_states"].copy_(img)

        try:
            # the pool may grow by a block's peak, and the eager work after it takes as much
            # from the driver: the cache freed for the capture is gone
            replay = self.backend.capture(run, 2 * PEAK_PER_STATE * kwargs["hidden_states"].nbytes)
        except Exception as e:
            if host.is_oom(e):
                raise
            self.failed.add(full)
            log_once(log, logging.WARNING, f"Block graphs: capture failed ({type(e).__name__}: "
                     f"{e}); that block runs eagerly")  # fmt: skip
            return None
        self._pool_bytes = None
        model = self.model()
        if model is not None:
            memory.register(model, self, "blocks")
        log_once(log, logging.INFO, "Block graphs: blocks of uncaptured calls replayed from "
                 "CUDA graphs")  # fmt: skip
        return replay
