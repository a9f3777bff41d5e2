"""The swaps between ComfyUI's own nodes and the pack's, and a workflow's stock twin: the same
API-format graph with ComfyUI's nodes in place of the pack's (UNETLoader at its default dtype,
KSampler, VAEDecode, VAEEncode, SaveImage), the VAE patch nodes and Multi-GPU taken out. What
`compare` and the benchmarks run as "stock" and `convert --to stock` writes. Pure Python."""


def _same(*names: str) -> list[dict]:
    return [{"new_id": name, "old_id": name} for name in names]


# Stock node -> pack node, in the form of ComfyUI's node replacements (v0.33's
# `comfy_api.latest.io.NodeReplace.as_dict()`, applied as `app/node_replace_manager.py` does):
# the new node's inputs from the old node's by name, or set to a value; outputs keep their
# index (each pair has the same outputs). Inputs the new node has and the mapping does not
# name take their defaults.
TO_PACK = [
    {"old_node_id": "UNETLoader", "new_node_id": "QwenTurboLoader",
     "input_mapping": _same("unet_name", "weight_dtype")},
    {"old_node_id": "KSampler", "new_node_id": "QwenTurboCUDAGraphSampler",
     "input_mapping": _same("model", "seed", "steps", "cfg", "sampler_name", "scheduler",
                            "positive", "negative", "latent_image", "denoise")},
    {"old_node_id": "VAEDecode", "new_node_id": "QwenTurboVAEDecodeTiled",
     "input_mapping": _same("samples", "vae")},
    {"old_node_id": "VAEEncode", "new_node_id": "QwenTurboVAEEncodeTiled",
     "input_mapping": _same("pixels", "vae")},
    {"old_node_id": "SaveImage", "new_node_id": "QwenTurboSaveImage",
     "input_mapping": _same("images", "filename_prefix")},
]  # fmt: skip
# Values a stock node takes whatever the pack node had: stock's reference, the dtype the file
# has. The other way, "default" becomes the pack node's default (`auto`).
STOCK_VALUES = {"weight_dtype": "default"}
TO_STOCK = [
    {"old_node_id": r["new_node_id"], "new_node_id": r["old_node_id"],
     "input_mapping": [{"new_id": m["old_id"], "set_value": STOCK_VALUES[m["old_id"]]}
                       if m["old_id"] in STOCK_VALUES else {"new_id": m["old_id"],
                                                             "old_id": m["new_id"]}
                       for m in r["input_mapping"]]}
    for r in TO_PACK
]  # fmt: skip
# Pack nodes a stock twin leaves out, each with the input it passes on: its users take that.
PASSTHROUGH = {
    "QwenTurboFusedNormPatch": "vae",
    "QwenTurboTextureUpsample": "vae",
    "QwenTurboMultiGPU": "model",
}
PATCHES = ("QwenTurboFusedNormPatch", "QwenTurboTextureUpsample")
SAVES = ("SaveImage", "QwenTurboSaveImage")


def replaced(replace: dict, inputs: dict) -> dict:
    """The new node's inputs from the old node's (API form: name -> value or link)."""
    out = {}
    for m in replace["input_mapping"]:
        if "set_value" in m:
            out[m["new_id"]] = m["set_value"]
        elif m["old_id"] in inputs:
            out[m["new_id"]] = inputs[m["old_id"]]
    return out


def _by_old(replacements: list[dict]) -> dict[str, dict]:
    return {r["old_node_id"]: r for r in replacements}


PACK_OF, STOCK_OF = _by_old(TO_PACK), _by_old(TO_STOCK)
# pack node -> (stock node, its inputs from the pack node's)
STOCK = {
    kind: (r["new_node_id"], lambda inputs, r=r: replaced(r, inputs))
    for kind, r in STOCK_OF.items()
}


def passthrough_chain(api: dict, link) -> tuple[object, list[str]]:
    """Where `link` really comes from, past the nodes a stock twin leaves out, and their ids."""
    ids = []
    while isinstance(link, list) and api.get(link[0], {}).get("class_type") in PASSTHROUGH:
        ids.append(link[0])
        node = api[link[0]]
        link = node["inputs"].get(PASSTHROUGH[node["class_type"]])
    return link, ids


def stock_graph(api: dict) -> dict:
    """`api` with stock nodes; each node keeps its id, the patch and Multi-GPU nodes go and
    their users take what those took."""
    stock = {}
    for node_id, node in api.items():
        kind, inputs = node["class_type"], node["inputs"]
        if kind in PASSTHROUGH:
            continue
        if kind in STOCK:
            kind, inputs = STOCK[kind][0], STOCK[kind][1](inputs)
        inputs = {k: passthrough_chain(api, v)[0] for k, v in inputs.items()}
        stock[node_id] = {"class_type": kind, "inputs": inputs}
    return stock
