"""A UI-format workflow's nodes with their subgraphs expanded, as ComfyUI's frontend flattens
them for the API (`ExecutableNodeDTO` in its litegraph): a node inside subgraph instance 238
gets the id `238:226`, nested ones `238:12:5`; a link into a subgraph follows the instance's
input outwards, or, where nothing is connected there, takes the value of the widget promoted
onto the instance (its `widgets_values`, else the inner widget's own); a link out of one
follows the subgraph's output inwards; bypassed nodes pass their input of the same type
through; muted ones give nothing. Pure Python."""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

IN, OUT = -10, -20  # the ids of a subgraph's input and output nodes
NEVER, BYPASS = 2, 4  # node modes
MAX_DEPTH = 32


class WorkflowError(ValueError):
    """The workflow cannot be read; the message is one line naming the node or link."""


@contextlib.contextmanager
def malformed():
    """Errors of a workflow's structure (a node without a type, a link of the wrong shape) as
    one WorkflowError line."""
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError, StopIteration) as e:
        raise WorkflowError(f"malformed workflow ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class Value:
    """A resolved input that is a value (a promoted widget's, a legacy PrimitiveNode's)."""

    value: object


def _link(raw) -> dict:
    """A link as a dict, from the root's lists `[id, origin, slot, target, slot, type]` or a
    subgraph's dicts."""
    if isinstance(raw, dict):
        return raw
    keys = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
    return dict(zip(keys, raw, strict=False))


def definitions(ui: dict) -> dict[str, dict]:
    """Subgraph definitions by id: the workflow's and those nested in definitions."""
    found, todo = {}, [ui]
    while todo:
        for sub in todo.pop().get("definitions", {}).get("subgraphs", []):
            if sub["id"] not in found:
                found[sub["id"]] = sub
                todo.append(sub)
    return found


class Scope:
    """One graph as it executes: the root, or a subgraph definition inside one instance."""

    def __init__(self, graph: dict, defs: dict, parent=None, instance=None):
        self.graph, self.defs, self.parent, self.instance = graph, defs, parent, instance
        self.path = (*parent.path, instance["id"]) if parent else ()
        if len(self.path) > MAX_DEPTH:
            raise WorkflowError(f"subgraphs nested deeper than {MAX_DEPTH} (one holds itself?)")
        self.nodes = {n["id"]: n for n in graph.get("nodes", [])}
        self.links = {(li := _link(raw))["id"]: li for raw in graph.get("links") or []}

    def exec_id(self, node: dict) -> str:
        return ":".join(str(i) for i in (*self.path, node["id"]))

    def inner(self, node: dict) -> "Scope":
        """The scope of subgraph instance `node`."""
        return Scope(self.defs[node["type"]], self.defs, self, node)


def instance_inputs(scope: Scope, node: dict) -> list[dict]:
    """A subgraph instance's inputs as the frontend rebuilds them: one per input of its
    definition, in order, each with the link saved on the instance's input of that name."""
    saved = {i.get("name"): i for i in node.get("inputs", [])}
    return [
        {"name": d["name"], "type": d.get("type"), "link": saved.get(d["name"], {}).get("link")}
        for d in scope.defs[node["type"]].get("inputs", [])
    ]


class Resolver:
    """Resolves links across subgraph boundaries. `widget_value(node, name)` is a node's own
    value for widget `name` (it needs the node's schema: see `workflow.ui_to_api`)."""

    def __init__(self, widget_value: Callable[[dict, str], object], execution: bool = True):
        self.widget_value, self.execution = widget_value, execution

    def link(self, scope: Scope, link_id) -> Value | tuple[str, int] | None:
        """Where link `link_id` of `scope` comes from: (exec id, output slot), a Value, or
        None (nothing: a muted node, an unconnected subgraph input without a widget)."""
        link = scope.links.get(link_id)
        if link is None:
            where = f" in subgraph {scope.graph.get('name')!r}" if scope.parent else ""
            raise WorkflowError(f"link {link_id}{where} is missing from the links list")
        if link["origin_id"] == IN:
            return self._subgraph_input(scope, link["origin_slot"])
        node = scope.nodes.get(link["origin_id"])
        if node is None:
            raise WorkflowError(f"link {link_id} starts at node {link['origin_id']}, not there")
        return self.output(scope, node, link["origin_slot"])

    def output(self, scope: Scope, node: dict, slot: int):
        mode = node.get("mode", 0)
        if self.execution and mode == NEVER:
            return None
        if self.execution and mode == BYPASS:
            return self._bypass(scope, node, slot)
        kind = node["type"]
        if kind in scope.defs:
            inner = scope.inner(node)
            outputs = inner.graph.get("outputs", [])
            ids = outputs[slot].get("linkIds") if slot < len(outputs) else None
            return self.link(inner, ids[0]) if ids else None
        if kind == "Reroute":
            return self.input(scope, node, 0)
        if kind == "PrimitiveNode":  # the legacy frontend primitive: its value
            return Value((node.get("widgets_values") or [None])[0])
        if kind in ("Note", "MarkdownNote"):
            return None
        return scope.exec_id(node), slot

    def input(self, scope: Scope, node: dict, index: int):
        inputs = instance_inputs(scope, node) if node["type"] in scope.defs else node["inputs"]
        link = inputs[index].get("link") if index < len(inputs) else None
        return None if link is None else self.link(scope, link)

    def _bypass(self, scope: Scope, node: dict, slot: int):
        """A bypassed node's output `slot` is its input of the output's type (that slot first)."""
        outputs = node.get("outputs") or []
        want = outputs[slot].get("type") if slot < len(outputs) else None
        if node["type"] in scope.defs:
            inputs = instance_inputs(scope, node)
        else:
            inputs = node.get("inputs") or []
        types = [i.get("type") for i in inputs]
        if slot < len(types) and types[slot] == want:
            return self.input(scope, node, slot)
        return self.input(scope, node, types.index(want)) if want in types else None

    def _subgraph_input(self, scope: Scope, index: int):
        if scope.instance is None:
            raise WorkflowError("a link of the root graph starts at a subgraph's input node")
        outer = instance_inputs(scope.parent, scope.instance)
        if index >= len(outer):
            raise WorkflowError(f"subgraph {scope.graph.get('name')!r} has no input {index}")
        if outer[index]["link"] is not None:
            return self.link(scope.parent, outer[index]["link"])
        return self.promoted(scope, index)

    def promoted(self, scope: Scope, index: int) -> Value | None:
        """The value of the widget that subgraph input `index` promotes onto its instance:
        the instance's saved value, else the first inner widget's. None without a widget."""
        promoted = [i for i in range(len(scope.graph.get("inputs", []))) if self._widget(scope, i)]
        if index not in promoted:
            return None
        saved = scope.instance.get("widgets_values") or []
        k = promoted.index(index)
        if isinstance(saved, list) and k < len(saved) and saved[k] is not None:
            return Value(saved[k])
        return self._widget(scope, index)

    def _widget(self, scope: Scope, index: int) -> Value | None:
        """The inner widget subgraph input `index` feeds (the first one), as a Value."""
        for link_id in scope.graph["inputs"][index].get("linkIds") or []:
            link = scope.links.get(link_id)
            node = link and scope.nodes.get(link["target_id"])
            if not node:
                continue
            if node["type"] in scope.defs:  # promoted again from a nested subgraph
                inner = scope.inner(node)
                names = [i["name"] for i in inner.graph.get("inputs", [])]
                slot = next((i for i in node.get("inputs", []) if i.get("link") == link_id), {})
                name = slot.get("name")
                if name in names and (found := self.promoted(inner, names.index(name))):
                    return found
                continue
            for slot in node.get("inputs", []):
                if slot.get("link") == link_id and slot.get("widget"):
                    return Value(self.widget_value(node, slot["widget"]["name"]))
        return None


def flatten(ui: dict, execution: bool = True) -> Iterator[tuple[str, dict, Scope]]:
    """(exec id, node, its scope) for each node that runs, subgraph instances expanded; with
    `execution` False, muted and bypassed nodes too."""
    defs = definitions(ui)

    def walk(scope: Scope):
        for node in scope.graph.get("nodes", []):
            if execution and node.get("mode", 0) in (NEVER, BYPASS):
                continue
            if node["type"] in defs:
                yield from walk(scope.inner(node))
            else:
                yield scope.exec_id(node), node, scope

    yield from walk(Scope(ui, defs))
