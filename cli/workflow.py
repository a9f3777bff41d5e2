"""UI-format workflow JSON -> API-format prompt, using /object_info (or the same built from
the loaded node classes); subgraphs expanded as the frontend expands them (`subgraphs`).
Pure Python."""

import json
from pathlib import Path

from .subgraphs import Resolver, Value, WorkflowError, flatten

SEED_NAMES = ("seed", "noise_seed")
VIRTUAL = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SWITCH = "ComfySwitchNode"  # v0.33's If/Else Switch, in ComfyUI's own Qwen-Image templates


UPLOAD = ("image_upload", "video_upload", "animated_image_upload")
UPLOAD_WIDGET = "upload"  # the frontend's upload button: a saved value, no input


def _widget_inputs(info: dict, upload: bool = True) -> list[tuple[str, bool, bool]]:
    """(name, has a control_after_generate widget, optional) for each widget input, in widget
    order; with `upload`, the upload button the frontend adds after the required widgets of a
    node with a media combo (its value saved as `upload`)."""
    spec = info["input"]
    order = info.get("input_order") or {k: list(v) for k, v in spec.items() if k != "hidden"}
    out = []
    for group in ("required", "optional"):
        media = False
        for name in order.get(group, []):
            kind, *opts = spec[group][name]
            if isinstance(kind, list) or kind in WIDGET_TYPES:
                opts = opts[0] if opts else {}
                control = opts.get("control_after_generate") or (
                    kind == "INT" and name in SEED_NAMES
                )
                out.append((name, bool(control), group == "optional"))
                media |= any(opts.get(k) is True for k in UPLOAD)
        if media and upload and group == "required":
            out.append((UPLOAD_WIDGET, False, False))
    return out


def widget_names(info: dict) -> list[str]:
    """The inputs that are widgets, in order."""
    return [name for name, _, _ in _widget_inputs(info, upload=False)]


def widget_default(info: dict, name: str):
    """Widget `name`'s default as the frontend sets it (a combo's first option)."""
    spec = info["input"]
    kind, *opts = (spec.get("required", {}) | spec.get("optional", {}))[name]
    opts = opts[0] if opts else {}
    if "default" in opts:
        return opts["default"]
    if isinstance(kind, list) or kind == "COMBO":
        options = kind if isinstance(kind, list) else opts.get("options", [])
        return options[0] if options else None
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(kind)


def combo_options(info: dict, name: str) -> list | None:
    """Widget `name`'s options, None where it is not a combo."""
    spec = info["input"]
    kind, *opts = (spec.get("required", {}) | spec.get("optional", {}))[name]
    if isinstance(kind, list):
        return kind
    return (opts[0] if opts else {}).get("options") if kind == "COMBO" else None


def read_widgets(node: dict, info: dict, where: str) -> dict[str, tuple]:
    """Widget name -> (value, control_after_generate value or None), from a UI node's
    `widgets_values`. A workflow saved before a node gained optional widgets lacks their
    values: they are left out (their defaults apply); one saved by an older frontend may
    lack the upload button's."""
    values = node.get("widgets_values") or []
    if isinstance(values, dict):  # saved with named values
        return {k: (v, None) for k, v in values.items()}
    for upload in (True, False):
        widgets = _widget_inputs(info, upload)
        counts = [sum(2 if c else 1 for _, c, _ in widgets[:n]) for n in range(len(widgets) + 1)]
        if len(values) in counts[_required(widgets) :]:
            break
    else:
        newer = " (saved by a newer ComfyUI? update ComfyUI)" if len(values) > counts[-1] else ""
        raise WorkflowError(f"node {where} ({node['type']}): {len(values)} widget values, "
                            f"expected {counts[-1]}{newer}")  # fmt: skip
    values, out = list(values), {}
    for name, control, _ in widgets[: counts.index(len(values))]:
        out[name] = (values.pop(0), values.pop(0) if control else None)
    return out


def _required(widgets: list) -> int:
    """How many of `_widget_inputs`' widgets are required (they come first)."""
    return sum(1 for *_, optional in widgets if not optional)


def write_widgets(named: dict[str, tuple], info: dict) -> list:
    """`widgets_values` for a node of schema `info` from `read_widgets`' form; widgets not
    named take their defaults, a control widget "fixed"."""
    values = []
    for name, control, _ in _widget_inputs(info):
        default = "image" if name == UPLOAD_WIDGET else widget_default(info, name)
        value, how = named.get(name, (default, None))
        values += [value, how or "fixed"] if control else [value]
    return values


def unknown_type(where: str, kind: str) -> WorkflowError:
    return WorkflowError(
        f"node {where}: unknown node type {kind!r}: this ComfyUI does not have it (install the "
        "custom nodes that provide it, or update ComfyUI)"
    )


def ui_to_api(ui: dict, object_info: dict, execution: bool = True, origins=None) -> dict:
    """Convert; raises WorkflowError (a ValueError) for unknown node types, widget counts
    that do not match, broken links. Node ids are the frontend's (`238:226` inside subgraph
    instance 238). Where this ComfyUI lacks ComfySwitchNode, each one whose switch the
    workflow fixes is replaced by the input it selects. With `execution` False, muted and
    bypassed nodes are kept as they are (the graph as drawn) and `origins`, a dict, gets
    each id's (graph or subgraph definition, node)."""

    def widget_value(node, name):
        info = object_info.get(node["type"])
        return read_widgets(node, info, str(node["id"])).get(name, (None,))[0] if info else None

    resolver = Resolver(widget_value, execution)
    prompt = {}
    for node_id, node, scope in flatten(ui, execution):
        kind = node["type"]
        if kind in VIRTUAL:
            continue
        if kind not in object_info and not (kind == SWITCH and node.get("inputs")):
            raise unknown_type(node_id, kind)
        inputs = {}
        if kind in object_info:
            widgets = read_widgets(node, object_info[kind], node_id)
            inputs = {k: v for k, (v, _) in widgets.items() if k != UPLOAD_WIDGET}
        else:  # a switch on a host without one: its widget is `switch`
            inputs["switch"] = (node.get("widgets_values") or [False])[0]
        for inp in node.get("inputs", []):
            if inp.get("link") is None:
                continue
            src = resolver.link(scope, inp["link"])
            if src is not None:
                inputs[inp["name"]] = src.value if isinstance(src, Value) else [src[0], src[1]]
        prompt[node_id] = {"class_type": kind, "inputs": inputs}
        if origins is not None:
            origins[node_id] = (scope.graph, node)
    for node in prompt.values():  # as the frontend: inputs from nodes that do not run go
        for name, value in list(node["inputs"].items()):
            if isinstance(value, list) and len(value) == 2 and value[0] not in prompt:
                del node["inputs"][name]
    if execution and SWITCH not in object_info:
        fold_switches(prompt)
    return prompt


def fold_switches(prompt: dict) -> None:
    """Each ComfySwitchNode replaced by the input its switch selects, where the switch is a
    value or a PrimitiveBoolean's (ComfyUI evaluates only that input: it is lazy)."""
    for node_id in [k for k, n in prompt.items() if n["class_type"] == SWITCH]:
        inputs = prompt.pop(node_id)["inputs"]
        flag = inputs.get("switch")
        source = prompt.get(flag[0]) if isinstance(flag, list) else None
        if source and source["class_type"] == "PrimitiveBoolean":
            flag = source["inputs"].get("value")
        if not isinstance(flag, bool):
            raise WorkflowError(
                f"node {node_id}: this ComfyUI lacks {SWITCH} (If/Else Switch) and the "
                "workflow does not fix its switch: update ComfyUI"
            )
        chosen = inputs.get("on_true" if flag else "on_false")
        for node in prompt.values():
            for name, value in list(node["inputs"].items()):
                if isinstance(value, list) and value[:1] == [node_id]:
                    if chosen is None:
                        del node["inputs"][name]
                    else:
                        node["inputs"][name] = chosen


def object_info(node_classes: dict) -> dict:
    """The parts of /object_info that `ui_to_api` reads, from NODE_CLASS_MAPPINGS."""
    info = {}
    for name, cls in node_classes.items():
        spec = cls.INPUT_TYPES()
        info[name] = {"input": spec, "input_order": {k: list(v) for k, v in spec.items()}}
    return info


def is_api(data) -> bool:
    """Whether `data` is an API-format prompt: node id -> {"class_type", "inputs"}."""
    return (
        isinstance(data, dict)
        and bool(data)
        and all(isinstance(n, dict) and "class_type" in n for n in data.values())
    )


def read_json(path: Path) -> tuple[object, str | None]:
    """(the JSON, None), or (None, why it cannot be read: one line)."""
    if not path.is_file():
        return None, "no such file" if not path.exists() else "not a file"
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except UnicodeDecodeError:
        return None, "not JSON (a binary file); a workflow is ComfyUI's UI-format .json"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    except OSError as e:
        return None, e.strerror


def workflow_problem(path: Path, api_ok: bool = False) -> str | None:
    """Why `path` cannot be run (or, with `api_ok`, converted) as a workflow (one line), or
    None when it is UI-format JSON (or an API-format prompt, with `api_ok`)."""
    data, problem = read_json(path)
    if problem:
        return problem
    if is_api(data):
        if api_ok:
            return None
        return "an API-format prompt; run takes the UI format (Workflow -> Save, not Export (API))"
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        return 'JSON, but not a ComfyUI workflow (no "nodes" list)'
    return None
