"""What may be captured in a graph.

A replay skips the Python inside the captured region, so only code known to hold no per-step
Python state may sit there: the pack's own and `SAFE_WRAPPERS`. Any other wrapper at a level
inside the region, model patch, callable transformer option, object patch (other than
ComfyUI's model sampling, and a wrapped diffusion-model forward for the innermost runner) or,
for a whole step, CFG function or per-step callback keeps that region out of a graph
(`foreign_code`); the call goes on to the next runner inside, or runs eagerly.

A block graph (`blocks`) holds one transformer block's forward alone: a model patch that runs
between the blocks (a ControlNet's, adding its residual to a block's output) runs eagerly
around it at every call. What it must not do is keep the tensors it is handed past its call:
a replayed block's output is a graph's buffer, which a later block overwrites. The patches
known not to (`BETWEEN_BLOCKS`) leave block graphs on (`block_patches`); any other keeps them
off.
"""

import inspect
from pathlib import Path

import comfy.patcher_extension

# The pack's package, as ComfyUI names it (after its folder), and the prefixes of its own modules.
# Not every module under that name is the pack's: the tests import as `<pack>.tests.…` from a
# clone at custom_nodes/qwen_turbo, and a user's code may take the same name.
PACK = __name__.removesuffix(".runtime.graphs.policy")
OWN = tuple(f"{PACK}.{folder}." for folder in ("runtime", "kernels", "nodes", "cli"))
# ComfyUI's wrapper levels, outermost first, from a guided step (PREDICT_NOISE) inward.
STEP_LEVELS = ("predict_noise", "calc_cond_batch", "apply_model", "diffusion_model")
# Foreign wrapper keys that hold no per-step state: ComfyUI's torch.compile wrapper swaps the
# compiled modules in and back the same way on every call (tests prove the replay exact).
SAFE_WRAPPERS = ("torch.compile",)
# ModelPatcher callbacks that run inside a guided step (in calc_cond_batch).
STEP_CALLBACKS = ("on_prepare_state", "on_apply_hooks")
# Keys of a cond (after ComfyUI's process_conds) whose effect depends on the step's data or
# runs extra Python per step; a step with any of them is not captured whole.
PER_STEP_CONDS = ("timestep_start", "timestep_end", "mask", "control", "hooks", "gligen", "default")
# model_options entries that run Python around the model calls of a step.
PER_STEP_OPTIONS = (
    "sampler_cfg_function", "sampler_pre_cfg_function", "sampler_post_cfg_function",
    "sampler_calc_cond_batch_function", "model_function_wrapper", "context_handler",
)  # fmt: skip


# Model patches that run between the transformer blocks and keep none of the tensors they are
# given: their kind in transformer_options["patches"], and their classes as ComfyUI's file
# (under its folder) and name. DiffSynth's ControlNet patch (QwenImageDiffsynthControlnet)
# adds its control block's output into the block's output in place, re-encoding its picture
# where the latent's size changed, and returns the same tensors.
BETWEEN_BLOCKS = {
    "double_block": {(("comfy_extras", "nodes_model_patch.py"), "DiffSynthCnetPatch")}
}
COMFY_ROOT = Path(comfy.patcher_extension.__file__).resolve().parents[1]


def region(options: dict, level: str) -> tuple:
    """The wrappers at `level` and the levels inside it, by key and name: part of a graph's
    key, so that a graph captured without a wrapper (or with another) is never replayed for a
    model clone that has it."""
    wrappers = options.get("wrappers", {})
    return tuple((lvl, key, getattr(fn, "__qualname__", type(fn).__qualname__))
                 for lvl in STEP_LEVELS[STEP_LEVELS.index(level) :]
                 for key, fns in wrappers.get(lvl, {}).items() for fn in fns)  # fmt: skip


def own(obj) -> bool:
    """Whether `obj` (a function, a method or a callable object) is this pack's code: defined in
    the package itself or in its runtime, kernels, nodes or cli."""
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return module == PACK or f"{module}.".startswith(OWN)


def model_patches(options: dict) -> str | None:
    """Why the model patches in transformer `options` (a ControlNet's block patches, say) keep
    every call out of a graph: they run Python inside the transformer, at every level."""
    patches = [*options.get("patches", {}), *options.get("patches_replace", {})]
    return f"model patches ({', '.join(patches)}) run Python per step" if patches else None


def comfy_class(obj, file: tuple[str, ...], name: str) -> bool:
    """Whether `obj` is an instance of ComfyUI's class `name` defined in its file `file` (its
    path under ComfyUI's folder), its call not replaced. ComfyUI's node loader names the
    modules of comfy_extras after their paths, so the module's name says nothing."""
    cls = type(obj)
    call = getattr(vars(cls).get("__call__"), "__code__", None)  # its own, not inherited
    try:
        where = Path(inspect.getfile(cls)).resolve()
    except (TypeError, OSError):
        return False
    want = COMFY_ROOT.joinpath(*file)
    return cls.__qualname__ == name and where == want and call is not None and (
        Path(call.co_filename).resolve() == want
    )  # fmt: skip


def block_patches(options: dict) -> str | None:
    """Why the model patches in transformer `options` keep the transformer blocks out of block
    graphs: a patch that runs inside a block (attention patches), replaces one, or runs
    between blocks and is not known to keep none of the block's outputs (`BETWEEN_BLOCKS`);
    None where every patch runs between blocks and is known."""
    for kind, fns in options.get("patches", {}).items():
        known = BETWEEN_BLOCKS.get(kind, ())
        for fn in fns:
            if not any(comfy_class(fn, file, name) for file, name in known):
                what = getattr(fn, "__qualname__", type(fn).__qualname__)
                return f"model patch {what} ({kind}) runs Python per step"
    replaced = [*options.get("patches_replace", {})]
    return f"model patches ({', '.join(replaced)}) run Python per step" if replaced else None


def foreign_code(options: dict, level: str, inner: list, blocks: bool = False) -> str | None:
    """Why Python that a replay would skip runs inside a graph captured at `level`: a wrapper
    among `inner` (those inside the runner's own at `level`) or at a level below it, a model
    patch or a callable transformer option, none of them the pack's; None if there is none.
    `options`: the transformer_options of the call. `blocks`: for a block graph, where model
    patches between the blocks may run outside it (`block_patches`)."""
    wrappers = options.get("wrappers", {})
    for lvl in STEP_LEVELS[STEP_LEVELS.index(level) :]:
        for key, fns in wrappers.get(lvl, {}).items():
            for fn in fns:
                inside = lvl != level or any(fn is f for f in inner)
                foreign = not own(fn) or getattr(fn, "runs_python_per_call", False)
                if inside and key not in SAFE_WRAPPERS and foreign:
                    return f"{key!r} {lvl} wrapper runs Python per step"
    why = block_patches(options) if blocks else model_patches(options)
    if why is not None:
        return why
    for key, value in options.items():
        if key not in ("wrappers", "callbacks") and callable(value) and not own(value):
            return f"transformer option {key!r} runs Python per step"
        if getattr(value, "collective", False):  # its peers run eagerly: never in a graph
            return f"transformer option {key!r} talks to other processes"
    return None


def comfy_model_sampling(obj) -> bool:
    """Whether every method of `obj`'s class is ComfyUI's own model sampling (tensor math on
    the step's sigma, in comfy.model_sampling). The ModelSampling* nodes patch in a subclass
    with no methods of its own, defined in a module that ComfyUI's node loader names after
    the file's path, so the module of the class itself says nothing."""
    for cls in type(obj).__mro__:
        if cls.__module__ == "comfy.model_sampling" or cls.__module__.split(".")[0] in (
            "torch", "builtins",
        ):  # fmt: skip
            continue
        kinds = (staticmethod, classmethod, property)
        if any(inspect.isfunction(v) or isinstance(v, kinds) for v in vars(cls).values()):
            return False
    return True


def foreign_object_patch(object_patches: dict, outside: tuple[str, ...] = ()) -> str | None:
    """Why a ModelPatcher's object patches run Python a replay would skip: one that is neither
    the pack's nor ComfyUI's own model sampling, nor on a key in `outside` (what wraps the
    captured region from outside)."""
    for key, obj in object_patches.items():
        comfy_sampling = key == "model_sampling" and comfy_model_sampling(obj)
        if not (comfy_sampling or key in outside or own(obj)):
            return f"object patch on {key!r} runs Python per step"
    return None
