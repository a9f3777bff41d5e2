"""The bundled workflows in a real browser: Debian's chromium, driven by Playwright, on the
frontend the real ComfyUI server (tests/harness) serves.

Each workflow is opened from the templates menu as a user opens it (Templates -> qwen_turbo ->
the workflow's card; the frontend then fetches it and calls app.loadGraphData, which validates
it against its zod schema). One then runs on the tiny models and the pack's badges must show
on its nodes, drawn on the canvas; the screenshot is kept (under $QWEN_TURBO_ARTIFACTS if set,
as .ci/run sets it, else in the test's tmp_path) and its path printed.

Skipped, with the reason, without playwright or chromium; but where QWEN_TURBO_BROWSER is
"required" (.ci/run sets it once chromium is installed) they must be there and it fails instead.
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from qwen_turbo.cli import convert
from qwen_turbo.cli.stock import stock_graph
from qwen_turbo.cli.workflow import ui_to_api
from tests.harness.templates import scaled_template, template
from tests.harness.workflows import WORKFLOWS, scaled_for_cpu

REQUIRED = os.environ.get("QWEN_TURBO_BROWSER") == "required"


def _unavailable(reason: str):
    if REQUIRED:
        raise RuntimeError(f"QWEN_TURBO_BROWSER=required, but {reason}")
    pytest.skip(reason, allow_module_level=True)


try:
    from playwright import sync_api
except ImportError:
    _unavailable("playwright is not installed (pip install playwright)")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    _unavailable(f"no chromium at {CHROMIUM} (as root: apt-get install chromium)")

# Playwright's own browser download is out of reach; Debian's chromium runs headless instead.
# --disable-dev-shm-usage: containers often have a small /dev/shm, which crashes the renderer.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-dev-shm-usage"]  # fmt: skip
TIMEOUT_MS = 60_000  # for each wait and click: two slow cores, the frontend's first load
RUN = "qwen_image_2512_t2i_1328px"  # the one queued on the tiny models (the fastest on CPU)
BADGE = re.compile(r"^\d+\.\d\d s · peak VRAM (\d+\.\d\d GiB|n/a \(no CUDA\))")
# Records what the canvas draws that looks like a badge, to check it is on screen.
RECORD_BADGES = """
const fillText = CanvasRenderingContext2D.prototype.fillText;
window.qwenTurboDrawn = new Set();
CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
  if (typeof text === "string" && text.includes(" s · ")) window.qwenTurboDrawn.add(text);
  return fillText.call(this, text, ...rest);
};
"""

# Pairs of nodes whose boxes (title bar included), at the size the frontend gives them, overlap.
OVERLAPS = """() => {
  const h = LiteGraph.NODE_TITLE_HEIGHT, nodes = app.graph.nodes, found = [];
  const box = (n) => [n.pos[0], n.pos[1] - h, n.pos[0] + n.size[0], n.pos[1] + n.size[1]];
  nodes.forEach((n, i) => nodes.slice(i + 1).forEach((m) => {
    const [a, b] = [box(n), box(m)];
    const hit = a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];
    if (hit) found.push(`${n.title} / ${m.title}`);
  }));
  return found;
}"""


def _from_pack_js(*texts: str) -> bool:
    """An error raised in js/qwen_turbo.js, or one the frontend logs for its extensions."""
    return any("qwen_turbo.js" in t or "QwenTurbo." in t for t in texts)


@pytest.fixture(scope="module")
def page(comfy_server):
    """The ComfyUI frontend, loaded; page.pack_errors collects errors from the pack's JS."""
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=TIMEOUT_MS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        sync_api.expect.set_options(timeout=TIMEOUT_MS)
        page.pack_errors = []
        # window.alert/confirm: Playwright would dismiss them unseen; record them as errors.
        page.alerts = []
        page.on("dialog", lambda d: (page.alerts.append(f"{d.type}: {d.message}"), d.dismiss()))
        page.on("console", lambda m: m.type == "error" and _from_pack_js(
            m.text, m.location.get("url", "")) and page.pack_errors.append(m.text))  # fmt: skip
        page.on("pageerror", lambda e: _from_pack_js(e.stack or "", str(e))
                and page.pack_errors.append(e.stack))  # fmt: skip
        page.add_init_script(RECORD_BADGES)
        # A returning user: no first-run templates dialog (frontend 1.49) racing the clicks.
        comfy_server.post("/settings/Comfy.TutorialCompleted", True)
        page.goto(comfy_server.url)
        page.wait_for_function("window.app?.graph && window.LiteGraph")
        assert not page.pack_errors, page.pack_errors
        assert not page.alerts, page.alerts
        yield page
        browser.close()


def open_template(page, name: str) -> dict:
    """Open a bundled workflow from the templates menu; returns its JSON. Clears
    page.pack_errors and page.alerts, so that each test sees its own."""
    page.pack_errors.clear()
    page.alerts.clear()
    ui = json.loads(next(p for p in WORKFLOWS if p.stem == name).read_text())
    dialog = page.get_by_role("dialog")
    if dialog.count():
        page.keyboard.press("Escape")  # the missing-models dialog of frontend 1.27
        sync_api.expect(dialog).to_have_count(0)
    page.get_by_text("Templates", exact=True).first.click()  # the sidebar's button
    dialog.get_by_text("qwen_turbo", exact=True).click()
    dialog.get_by_text(name, exact=True).click()
    types = sorted(n["type"] for n in ui["nodes"])
    page.wait_for_function(
        "types => JSON.stringify(app.graph.nodes.map(n => n.type).sort()) === types",
        arg=json.dumps(types, separators=(",", ":")),
    )
    page.wait_for_timeout(500)  # let toasts and dialogs render
    return ui


@pytest.mark.parametrize("name", [p.stem for p in WORKFLOWS])
def test_template_opens_cleanly(page, name):
    open_template(page, name)
    toasts = page.locator(".p-toast-message").all_inner_texts()
    assert not toasts, toasts  # e.g. "Invalid workflow against zod schema"
    assert not page.alerts, page.alerts
    overlaps = page.evaluate(OVERLAPS)
    assert not overlaps, f"nodes drawn over each other: {overlaps}"
    missing = page.evaluate(
        "app.graph.nodes.map(n => n.type).filter(t => !(t in LiteGraph.registered_node_types))"
    )
    assert not missing, f"node types the frontend lacks: {missing}"
    dialogs = [d for d in page.get_by_role("dialog").all_inner_texts() if d.strip()]
    # The full-size model files are absent here; the frontend offers their downloads.
    assert all(d.startswith("Missing Models") for d in dialogs), dialogs
    assert not page.pack_errors


def test_run_shows_badges(page, comfy_server, tmp_path):
    ui = open_template(page, RUN)
    if page.get_by_role("dialog").count():
        page.keyboard.press("Escape")  # the missing-models dialog of frontend 1.27
    api = scaled_for_cpu(ui_to_api(ui, comfy_server.get("/object_info")))
    for node in api.values():
        if "seed" in node["inputs"]:
            node["inputs"]["seed"] = 20260  # not test_workflows' seed: the sampler must run
    entry = comfy_server.run(api, timeout=300, client_id=page.evaluate("app.api.clientId"))
    cached = {n for kind, m in entry["status"]["messages"] if kind == "execution_cached"
              for n in m["nodes"]}  # fmt: skip
    ran = [str(n["id"]) for n in ui["nodes"]
           if n["type"].startswith("QwenTurbo") and str(n["id"]) not in cached]  # fmt: skip
    sampler = next(str(n["id"]) for n in ui["nodes"] if n["type"] == "QwenTurboCUDAGraphSampler")
    assert sampler in ran
    page.wait_for_function(
        "ids => ids.every(id => "
        "window.qwenTurboDrawn.has(app.graph.getNodeById(+id)?.qwenTurboBadge))",
        arg=ran,
        timeout=30_000,
    )
    badges = page.evaluate("ids => ids.map(id => app.graph.getNodeById(+id).qwenTurboBadge)", ran)
    assert all(BADGE.match(b) for b in badges), badges
    artifacts = Path(os.environ.get("QWEN_TURBO_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / f"{RUN}_badges.png"
    page.screenshot(path=shot)
    print(f"screenshot: {shot}")
    assert not page.pack_errors
    assert not page.alerts, page.alerts


TYPES = """() => { const root = app.rootGraph ?? app.graph;
  return [root, ...(root.subgraphs?.values?.() ?? [])].flatMap(g => g.nodes.map(n => n.type)); }"""
MENU = """label => { const items = app.collectCanvasMenuItems?.(app.canvas)
  ?? app.canvas.getCanvasMenuOptions(); items.find(i => i?.content === label).callback(); }"""


def test_accelerate_and_save_a_stock_copy(page, comfy_server, tmp_path):
    """ComfyUI's own Qwen-Image-2512 template (its pipeline in a subgraph), accelerated from
    the canvas menu: one undo takes it back; the frontend's prompt is the command line's and
    runs on the tiny models; the stock copy it downloads holds only ComfyUI's own nodes. The
    change summary's screenshot is kept."""
    ui = json.loads(template("image_qwen_Image_2512").read_text())
    page.pack_errors.clear()
    page.alerts.clear()
    page.evaluate("ui => app.loadGraphData(ui)", ui)
    page.wait_for_function(
        f"() => (app.rootGraph ?? app.graph).nodes.length === {len(ui['nodes'])}"
    )
    if page.get_by_role("dialog").count():
        page.keyboard.press("Escape")  # missing models
    stock = sorted(page.evaluate(TYPES))
    page.evaluate(MENU, "Qwen Turbo: accelerate this workflow")
    summary = page.locator("#qwen-turbo-summary")
    sync_api.expect(summary).to_contain_text("4 nodes accelerated")
    accelerated = page.evaluate(TYPES)
    assert {"QwenTurboLoader", "QwenTurboCUDAGraphSampler", "QwenTurboSaveImage"} <= set(
        accelerated
    ) and not {"UNETLoader", "KSampler", "SaveImage"} & set(accelerated)
    artifacts = Path(os.environ.get("QWEN_TURBO_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    summary.screenshot(path=artifacts / "accelerate_summary.png")
    info = comfy_server.get("/object_info")
    prompt = page.evaluate("async () => { const p = await app.graphToPrompt(); return p; }")
    ours = ui_to_api(prompt["workflow"], info)
    if "ComfySwitchNode" in info:  # the frontend's own prompt is ours
        output = {k: {"class_type": n["class_type"], "inputs": n["inputs"]}
                  for k, n in prompt["output"].items()}  # fmt: skip
        assert output == ours
    api = scaled_template(ours)
    entry = comfy_server.run(api, timeout=300)
    (save,) = [k for k, n in api.items() if n["class_type"] == "QwenTurboSaveImage"]
    assert entry["outputs"][save]["images"]
    with page.expect_download() as download:
        page.evaluate("app.extensionManager.command.execute('QwenTurbo.stockCopy')")
    copy = json.loads(Path(download.value.path()).read_text())
    assert download.value.suggested_filename.endswith("_stock.json")
    kinds = {n["type"] for g in [copy, *copy["definitions"]["subgraphs"]] for n in g["nodes"]}
    modules = {k: info[k]["python_module"] for k in kinds if k in info}
    assert not [k for k, m in modules.items() if m.startswith("custom_nodes")], modules
    convert.convert(copy, "pack", info)  # the command line puts back what the copy left out
    assert ui_to_api(copy, info) == ours
    page.locator("#qwen-turbo-summary button").click()
    page.evaluate("app.extensionManager.command.execute('Comfy.Undo')")
    page.wait_for_function(f"types => JSON.stringify(({TYPES})().sort()) === types",
                           arg=json.dumps(stock, separators=(",", ":")))  # fmt: skip
    assert not page.pack_errors, page.pack_errors
    assert not page.alerts, page.alerts


def test_stock_copy_takes_the_vae_patches_out(page, comfy_server):
    """The stock copy of a bundled workflow with Fused GroupNorm Patch and Texture Upsample:
    both taken out, the decode wired to the VAE loader; the command line puts them back."""
    ui = json.loads(
        next(p for p in WORKFLOWS if p.stem == "qwen_image_2512_t2i_2512px").read_text()
    )
    page.pack_errors.clear()
    page.evaluate("ui => app.loadGraphData(ui)", ui)
    page.wait_for_function(
        f"() => (app.rootGraph ?? app.graph).nodes.length === {len(ui['nodes'])}"
    )
    with page.expect_download() as download:
        page.evaluate(MENU, "Qwen Turbo: save a stock copy")
    copy = json.loads(Path(download.value.path()).read_text())
    assert not [n["type"] for n in copy["nodes"] if n["type"].startswith("QwenTurbo")]
    info = comfy_server.get("/object_info")
    assert ui_to_api(copy, info) == stock_graph(ui_to_api(ui, info))
    convert.convert(copy, "pack", info)
    assert ui_to_api(copy, info) == ui_to_api(ui, info)
    assert not page.pack_errors, page.pack_errors
