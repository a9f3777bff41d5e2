"""A workflow's stock twin: the same API-format graph with ComfyUI's own nodes in place of the
pack's (UNETLoader at its default dtype, KSampler, VAEDecode, VAEEncode, SaveImage), the VAE
patch nodes taken out. What `compare` and the benchmarks run as "stock". Pure Python."""

# pack node -> (stock node, its inputs from the pack node's)
STOCK = {
    "QwenTurboLoader": ("UNETLoader", lambda i: {"unet_name": i["unet_name"],
                                                 "weight_dtype": "default"}),
    "QwenTurboCUDAGraphSampler": ("KSampler", lambda i: {k: v for k, v in i.items()
                                                         if k != "capture"}),
    "QwenTurboVAEDecodeTiled": ("VAEDecode", lambda i: {"samples": i["samples"],
                                                        "vae": i["vae"]}),
    "QwenTurboVAEEncodeTiled": ("VAEEncode", lambda i: {"pixels": i["pixels"],
                                                        "vae": i["vae"]}),
    "QwenTurboSaveImage": ("SaveImage", dict),
}  # fmt: skip
SAVES = ("SaveImage", "QwenTurboSaveImage")
PATCHES = ("QwenTurboFusedNormPatch", "QwenTurboTextureUpsample")


def stock_graph(api: dict) -> dict:
    """`api` with stock nodes; each node keeps its id, the patch nodes go and their users take
    the VAE they patched."""
    stock = {}
    for node_id, node in api.items():
        kind, inputs = node["class_type"], node["inputs"]
        if kind in PATCHES:
            continue
        if kind in STOCK:
            kind, inputs = STOCK[kind][0], STOCK[kind][1](inputs)
        stock[node_id] = {"class_type": kind, "inputs": dict(inputs)}
    vae_of = {k: n["inputs"]["vae"] for k, n in api.items() if n["class_type"] in PATCHES}
    for node in stock.values():
        src = node["inputs"].get("vae")
        while isinstance(src, list) and src[0] in vae_of:
            src = vae_of[src[0]]
        if src is not None:
            node["inputs"]["vae"] = src
    return stock
