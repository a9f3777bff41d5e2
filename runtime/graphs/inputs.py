"""How a call's arguments become a graph's static inputs and the hashable rest of its key."""

import torch

from .policy import PER_STEP_CONDS

SCALARS = (int, float, str, bool, type(None))


def is_options(value) -> bool:
    """ComfyUI's transformer_options: it carries the wrapper list this runner came from."""
    return isinstance(value, dict) and "wrappers" in value


def flatten(args, kwargs):
    """Tensor leaves with their paths ((name,) or, inside a list such as Edit's reference
    latents, (name, index)) and a hashable description of everything else; (None, reason) if
    not capturable.

    transformer_options (positional or not) stays out of the key: it changes every step
    (sigmas) and the model reads nothing from it unless patches are set, which the runner
    refuses.
    """
    tensors, desc = [], []
    items = [(i, a) for i, a in enumerate(args)] + sorted(kwargs.items())
    for name, value in items:
        if name == "transformer_options" or is_options(value):
            continue
        listed = isinstance(value, (list, tuple))
        for j, v in enumerate(value if listed else [value]):
            path = (name, j) if listed else (name,)
            if isinstance(v, torch.Tensor):
                tensors.append((path, v))
                desc.append((path, tuple(v.shape), v.dtype, v.device))
            elif isinstance(v, SCALARS) and not listed:
                desc.append((path, v))
            else:
                return None, f"argument {name!r} of type {type(v).__name__}"
        if listed:
            desc.append((name, type(value).__name__, len(value)))
    return tensors, tuple(desc)


def with_buffers(args, kwargs, tensors, buffers):
    """`args` and `kwargs` with the tensors at `tensors`' paths replaced by `buffers`."""
    args, kwargs = list(args), dict(kwargs)
    for ((name, *j), _), buf in zip(tensors, buffers, strict=True):
        where = args if isinstance(name, int) else kwargs
        if j:
            items = list(where[name])
            items[j[0]] = buf
            where[name] = type(where[name])(items)
        else:
            where[name] = buf
    return args, kwargs


def cond_inputs(conds: dict) -> tuple[list | None, tuple | str]:
    """The tensors a guided step reads from a guider's processed conds, with their paths, and
    a hashable description of the rest; (None, reason) when the step cannot be captured."""
    tensors, desc = [], []
    for name in sorted(conds):
        for i, c in enumerate(conds[name] or ()):
            found = [k for k in PER_STEP_CONDS if k in c]
            if found:
                return None, f"conditioning with {found[0]!r}"
            desc.append((name, i, tuple(c.get("area", ())), c.get("strength", 1.0)))
            for k in sorted(c["model_conds"]):
                value = c["model_conds"][k].cond
                for j, v in enumerate(value if isinstance(value, list) else [value]):
                    if isinstance(v, torch.Tensor):
                        tensors.append(((name, i, k, j), v))
                        desc.append((k, j, tuple(v.shape), v.dtype, v.device))
                    elif isinstance(v, SCALARS):
                        desc.append((k, j, v))
                    else:
                        return None, f"conditioning {k!r} of type {type(v).__name__}"
    return tensors, tuple(desc)


def with_cond_buffers(conds: dict, buffers: dict) -> dict:
    """A copy of `conds` whose tensors at the paths in `buffers` are replaced by them."""
    out = {}
    for name, items in conds.items():
        if items is None:
            out[name] = None
            continue
        out[name] = []
        for i, c in enumerate(items):
            model_conds = {}
            for k, cond in c["model_conds"].items():
                if isinstance(cond.cond, list):
                    value = [buffers.get((name, i, k, j), v) for j, v in enumerate(cond.cond)]
                else:
                    value = buffers.get((name, i, k, 0), cond.cond)
                model_conds[k] = cond._copy_with(value)
            out[name].append({**c, "model_conds": model_conds})
    return out
