"""One node swapped for its twin (`stock.TO_PACK`, `stock.TO_STOCK`) in a UI-format graph (root
or subgraph definition) or an API-format prompt, keeping its id, links, title, position, group
and widget values (mapped by name between the two schemas); and the pack's pass-through nodes
(VAE patches, Multi-GPU) taken out with their users rewired, or put back. What a swap leaves
out (the pack's own settings, the removed nodes) is kept beside it, under `qwen_turbo` keys
that ComfyUI ignores, so converting back gives the same graph. Pure Python."""

import copy

from .stock import PACK_OF, PASSTHROUGH, STOCK_OF, passthrough_chain
from .subgraphs import IN
from .workflow import combo_options, read_widgets, widget_default, widget_names, write_widgets

STASH = "qwen_turbo"  # node properties (UI) / _meta (API): what the other form had
REMOVED = "qwen_turbo_removed"  # graph extra (UI): the pass-through nodes taken out


class Unfit(ValueError):
    """The node cannot take the swap; the message says why."""


def mapped_values(replace: dict, named: dict, info_old: dict, info_new: dict) -> dict:
    """The new node's widget values from the old node's (name -> (value, control)). An option
    of the old node's combo that the new one lacks is Unfit, except "default": the new
    node's default. A value neither offers (a file not on this machine) stays."""
    out = {}
    widgets = info_new["input"].get("required", {}) | info_new["input"].get("optional", {})
    for m in replace["input_mapping"]:
        new = m["new_id"]
        if new not in widgets:
            continue
        if "set_value" in m:
            out[new] = (m["set_value"], None)
        elif m["old_id"] in named:
            value, control = named[m["old_id"]]
            options = combo_options(info_new, new)
            if (
                options is not None
                and not isinstance(value, list)
                and value not in options
                and value in (_options(info_old, m["old_id"]) or [])
            ):
                if value != "default":
                    raise Unfit(f"{new} {value!r}: {replace['new_node_id']} offers "
                                f"{', '.join(map(str, options))}")  # fmt: skip
                value = widget_default(info_new, new)
            out[new] = (value, control)
    return out


def _options(info: dict, name: str) -> list | None:
    spec = info["input"].get("required", {}) | info["input"].get("optional", {})
    return combo_options(info, name) if name in spec else None


def _links(graph: dict) -> dict:
    """The graph's links by id, as the mutable entries (lists at the root, dicts in subgraphs)."""
    return {(li[0] if isinstance(li, list) else li["id"]): li for li in graph.get("links") or []}


def _set(link, **fields) -> None:
    order = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
    for key, value in fields.items():
        if isinstance(link, list):
            link[order.index(key)] = value
        else:
            link[key] = value


def _get(link, key):
    order = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
    return link[order.index(key)] if isinstance(link, list) else link[key]


def _values(replace: dict, named: dict, was: dict | None, info_old: dict, info_new: dict):
    """`mapped_values` of `named`; with `was` (what the node had before it was swapped the
    other way), those values, with the ones changed since (and the links) from `named`."""
    if was is None:
        return mapped_values(replace, named, info_old, info_new)
    then = mapped_values((PACK_OF | STOCK_OF)[replace["new_node_id"]], was, info_new, info_old)
    changed = {k: v for k, v in named.items() if isinstance(v[0], list) or then.get(k) != v}
    kept = {k: v for k, v in was.items() if not isinstance(v[0], list)}
    return kept | mapped_values(replace, changed, info_old, info_new)


def swap_ui(graph: dict, node: dict, replace: dict, info_old: dict, info_new: dict) -> list[str]:
    """Swap `node` of `graph` in place; returns notes (links dropped). Raises Unfit."""
    stash = node.get("properties", {}).get(STASH)
    back = stash if stash and stash.get("type") == replace["new_node_id"] else None
    named = read_widgets(node, info_old, str(node["id"]))
    was = read_widgets(back, info_new, str(node["id"])) if back else None
    values = _values(replace, named, was, info_old, info_new)
    old = {
        "type": node["type"],
        "widgets_values": copy.deepcopy(node.get("widgets_values")),
        "inputs": copy.deepcopy(node.get("inputs", [])),
        "properties": {k: v for k, v in node.get("properties", {}).items() if k != STASH},
    }
    names = {m["old_id"]: m["new_id"] for m in replace["input_mapping"] if "old_id" in m}
    schema = info_new["input"].get("required", {}) | info_new["input"].get("optional", {})
    current = {names.get(i["name"], i["name"]): i for i in node.get("inputs", [])}
    links, notes, inputs = _links(graph), [], []
    for entry in back["inputs"] if back else node.get("inputs", []):
        name = names.get(entry["name"], entry["name"]) if not back else entry["name"]
        if name not in schema:
            if entry.get("link") is not None:
                notes.append(f"its link into {entry['name']} was dropped")
                graph["links"].remove(links.pop(entry["link"]))
            continue
        now = current.get(name)
        inputs.append({**entry, "name": name, "link": now.get("link") if now else None})
    for slot, entry in enumerate(inputs):
        if entry["link"] is not None:
            _set(links[entry["link"]], target_slot=slot)
    node["type"] = replace["new_node_id"]
    node["inputs"] = inputs
    node["widgets_values"] = write_widgets(values, info_new)
    if back:
        node["properties"] = back["properties"]
    else:
        props = {k: v for k, v in old["properties"].items() if k not in ("cnr_id", "ver")}
        if "Node name for S&R" in props:
            props["Node name for S&R"] = replace["new_node_id"]
        node["properties"] = props | {STASH: old}
    return notes


def swap_api(node: dict, replace: dict, info_old: dict, info_new: dict) -> None:
    """Swap API-format `node` in place (inputs by name). Raises Unfit."""
    meta = node.get("_meta", {})
    stash = meta.get(STASH)
    back = stash if stash and stash.get("class_type") == replace["new_node_id"] else None
    named = {k: (v, None) for k, v in node["inputs"].items()}
    was = {k: (v, None) for k, v in back["inputs"].items()} if back else None
    values = _values(replace, named, was, info_old, info_new)
    if not back:
        values = {n: (widget_default(info_new, n), None) for n in widget_names(info_new)} | values
    old = {"class_type": node["class_type"], "inputs": copy.deepcopy(node["inputs"])}
    node["class_type"] = replace["new_node_id"]
    node["inputs"] = {k: v for k, (v, _) in values.items()}
    node["_meta"] = {k: v for k, v in meta.items() if k != STASH} | ({} if back else {STASH: old})
    if not node["_meta"]:
        del node["_meta"]


def remove_passthrough_ui(graph: dict, node: dict, via: str) -> bool:
    """Take pass-through `node` out of `graph`: its users' links start where its input `via`
    starts. False (nothing done) where that input is not connected."""
    links = _links(graph)
    entry = next((i for i in node.get("inputs", []) if i["name"] == via), None)
    if entry is None or entry.get("link") is None:
        return False
    into = links[entry["link"]]
    src, slot = _get(into, "origin_id"), _get(into, "origin_slot")
    users = [li for out in node.get("outputs") or [] for li in out.get("links") or []]
    holder = _source_links(graph, src, slot)
    graph.setdefault("extra", {}).setdefault(REMOVED, []).append({
        "node": node, "index": graph["nodes"].index(node), "link": copy.deepcopy(into),
        "link_index": graph["links"].index(into), "source_links": list(holder),
    })  # fmt: skip
    for li in users:
        _set(links[li], origin_id=src, origin_slot=slot)
    at = holder.index(entry["link"]) if entry["link"] in holder else len(holder)
    holder[at : at + 1] = users
    graph["links"].remove(into)
    graph["nodes"].remove(node)
    return True


def restore_passthrough_ui(graph: dict) -> list[dict]:
    """Put back what `remove_passthrough_ui` took out of `graph`, last first; returns the
    nodes put back."""
    removed = graph.get("extra", {}).pop(REMOVED, [])
    for item in reversed(removed):
        node, into = item["node"], item["link"]
        graph["nodes"].insert(item["index"], node)
        graph["links"].insert(item["link_index"], into)
        links = _links(graph)
        for li in (li for out in node.get("outputs") or [] for li in out.get("links") or []):
            _set(links[li], origin_id=node["id"], origin_slot=0)
        src, slot = _get(into, "origin_id"), _get(into, "origin_slot")
        _source_links(graph, src, slot)[:] = item["source_links"]
    if "extra" in graph and not graph["extra"] and removed:
        del graph["extra"]
    return [item["node"] for item in removed]


def _source_links(graph: dict, src, slot: int) -> list:
    """The mutable list of link ids leaving output `slot` of node `src` (or of the subgraph's
    input `slot`)."""
    if src == IN:
        return graph["inputs"][slot].setdefault("linkIds", [])
    node = next(n for n in graph["nodes"] if n["id"] == src)
    out = node["outputs"][slot]
    if out.get("links") is None:
        out["links"] = []
    return out["links"]


def remove_passthrough_api(api: dict) -> None:
    """Take the pass-through nodes out of `api`: each user takes what they took; the nodes
    and the user's links are kept in the user's `_meta` to put back."""
    for node in api.values():
        if node["class_type"] in PASSTHROUGH:
            continue
        for name, value in node["inputs"].items():
            source, ids = passthrough_chain(api, value)
            if ids:
                meta = node.setdefault("_meta", {}).setdefault(REMOVED, {"links": {}, "nodes": {}})
                meta["links"][name] = value
                meta["nodes"].update({i: copy.deepcopy(api[i]) for i in ids})
                node["inputs"][name] = source
    for node_id in [k for k, n in api.items() if n["class_type"] in PASSTHROUGH]:
        del api[node_id]


def restore_passthrough_api(api: dict) -> list[str]:
    """Put back what `remove_passthrough_api` took out; returns the ids put back."""
    back = []
    for node in list(api.values()):
        meta = node.get("_meta", {}).pop(REMOVED, None)
        if meta is None:
            continue
        node["inputs"].update(meta["links"])
        for node_id, removed in meta["nodes"].items():
            if node_id not in api:
                api[node_id] = removed
                back.append(node_id)
        if not node["_meta"]:
            del node["_meta"]
    return back
