"""UI-format workflow JSON -> API-format prompt, using /object_info (or the same built from
the loaded node classes). Pure Python."""

import json
from pathlib import Path

SEED_NAMES = ("seed", "noise_seed")
VIRTUAL = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _widget_inputs(info: dict) -> list[tuple[str, bool, bool]]:
    """(name, has a control_after_generate widget, optional) for each widget input, in widget
    order."""
    spec = info["input"]
    order = info.get("input_order") or {k: list(v) for k, v in spec.items() if k != "hidden"}
    out = []
    for group in ("required", "optional"):
        for name in order.get(group, []):
            kind, *opts = spec[group][name]
            if isinstance(kind, list) or kind in WIDGET_TYPES:
                opts = opts[0] if opts else {}
                control = opts.get("control_after_generate") or (
                    kind == "INT" and name in SEED_NAMES
                )
                out.append((name, bool(control), group == "optional"))
    return out


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """Convert; raises ValueError for unknown node types or widget counts that do not match."""
    links = {link[0]: link for link in ui.get("links", [])}
    prompt = {}
    for node in ui["nodes"]:
        kind = node["type"]
        if kind in VIRTUAL or node.get("mode", 0) in (2, 4):  # muted or bypassed
            continue
        if kind not in object_info:
            raise ValueError(f"node {node['id']}: unknown node type {kind!r}")
        inputs = {}
        values = list(node.get("widgets_values") or [])
        widgets = _widget_inputs(object_info[kind])
        # a workflow saved before a node gained optional widgets lacks their values: defaults
        counts = [sum(2 if c else 1 for _, c, _ in widgets[:n]) for n in range(len(widgets) + 1)]
        fewest = counts[sum(1 for *_, optional in widgets if not optional)]
        if len(values) not in counts or len(values) < fewest:
            raise ValueError(
                f"node {node['id']} ({kind}): {len(values)} widget values, expected {counts[-1]}"
            )
        for name, control, _ in widgets[: counts.index(len(values))]:
            inputs[name] = values.pop(0)
            if control:
                values.pop(0)
        for inp in node.get("inputs", []):
            link = inp.get("link")
            if link is not None:
                _, src, slot, *_ = links[link]
                inputs[inp["name"]] = [str(src), slot]
        prompt[str(node["id"])] = {"class_type": kind, "inputs": inputs}
    return prompt


def object_info(node_classes: dict) -> dict:
    """The parts of /object_info that `ui_to_api` reads, from NODE_CLASS_MAPPINGS."""
    info = {}
    for name, cls in node_classes.items():
        spec = cls.INPUT_TYPES()
        info[name] = {"input": spec, "input_order": {k: list(v) for k, v in spec.items()}}
    return info


def workflow_problem(path: Path) -> str | None:
    """Why `path` cannot be run as a workflow (one line), or None when it is UI-format JSON."""
    if not path.is_file():
        return "no such file" if not path.exists() else "not a file"
    try:
        ui = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return "not JSON (a binary file); a workflow is ComfyUI's UI-format .json"
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    except OSError as e:
        return e.strerror
    if (
        isinstance(ui, dict)
        and ui
        and all(isinstance(n, dict) and "class_type" in n for n in ui.values())
    ):
        return "an API-format prompt; run takes the UI format (Workflow -> Save, not Export (API))"
    if not isinstance(ui, dict) or not isinstance(ui.get("nodes"), list):
        return 'JSON, but not a ComfyUI workflow (no "nodes" list)'
    return None
