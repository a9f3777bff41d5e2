import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const PACK = (node) => node.comfyClass?.startsWith("QwenTurbo");

// Give the pack's nodes one colour, so they stand out in a shared workflow.
app.registerExtension({
  name: "QwenTurbo.nodeColors",
  nodeCreated(node) {
    if (PACK(node)) {
      node.color = "#24465a";
      node.bgcolor = "#1a3342";
    }
  },
});

// After a run, each of the pack's nodes shows what it did: time, peak VRAM, and for the
// sampler the CUDA graph status. The server sends "qwen_turbo.node_stats" (nodes/report.py).
export function badgeText(stats) {
  const parts = [`${stats.seconds.toFixed(2)} s`];
  const vram = stats.peak_vram_gib;
  parts.push(vram == null ? "peak VRAM n/a (no CUDA)" : `peak VRAM ${vram.toFixed(2)} GiB`);
  if (stats.graphs) parts.push(`graphs: ${stats.graphs}`);
  if (stats.weights) parts.push(stats.weights);
  if (stats.patched != null) parts.push(`${stats.patched} modules patched`);
  if (stats.note) parts.push(stats.note);
  if (stats.fallback) parts.push(`ComfyUI's decode: ${stats.fallback}`);
  return parts.join(" · ");
}

app.registerExtension({
  name: "QwenTurbo.nodeStats",
  setup() {
    api.addEventListener("qwen_turbo.node_stats", ({ detail }) => {
      const node = app.graph?.getNodeById(Number(detail.node));
      if (!node) return;
      node.qwenTurboBadge = badgeText(detail);
      node.setDirtyCanvas?.(true, true);
    });
  },
  nodeCreated(node) {
    if (!PACK(node)) return;
    const draw = node.onDrawForeground;
    node.onDrawForeground = function (ctx) {
      draw?.apply(this, arguments);
      if (!this.qwenTurboBadge || this.flags?.collapsed) return;
      ctx.save();
      ctx.font = "11px sans-serif";
      const w = ctx.measureText(this.qwenTurboBadge).width + 12;
      ctx.fillStyle = "#0b6e4f";
      // Under the node: the frontend draws its own badges (the pack's name, the node id)
      // right-aligned above the title, where a wide badge would cover them.
      const y = this.size[1] + 4;
      ctx.beginPath();
      ctx.roundRect?.(0, y, w, 18, 4);
      ctx.fill();
      ctx.fillStyle = "#fff";
      ctx.fillText(this.qwenTurboBadge, 6, y + 13);
      ctx.restore();
    };
  },
});

// Sharing: "accelerate this workflow" swaps each stock node that has a pack twin for it where
// it serves a Qwen-Image model, in place (ids, links, widget values, titles, groups and
// positions kept; one undo step), as the frontend's own node replacement does; "save a stock
// copy" downloads the workflow with ComfyUI's nodes for teammates without the pack.
// `python -m qwen_turbo convert` does the same; the table is cli/stock.py's.
const TO_PACK = {
  UNETLoader: "QwenTurboLoader",
  KSampler: "QwenTurboCUDAGraphSampler",
  VAEDecode: "QwenTurboVAEDecodeTiled",
  VAEEncode: "QwenTurboVAEEncodeTiled",
  SaveImage: "QwenTurboSaveImage",
};
const TO_STOCK = Object.fromEntries(Object.entries(TO_PACK).map(([s, p]) => [p, s]));
const STASH = "qwen_turbo"; // as cli/swap.py keeps what a swap leaves out
const STOCK_VALUES = { weight_dtype: "default" }; // what a stock twin takes whatever was set
const PASSTHROUGH = { QwenTurboFusedNormPatch: "vae", QwenTurboTextureUpsample: "vae",
  QwenTurboMultiGPU: "model" }; // pack nodes a stock twin leaves out: users take this input

export class Unfit extends Error {}

export function loaderFileProblem(name) {
  if (typeof name !== "string") return "its file is chosen by a link";
  if (/\.gguf$/i.test(name)) {
    return `${name} is a GGUF file; the Optimized Loader reads safetensors`;
  }
  return /qwen|newbie/i.test(name) ? null : `${name}: its name does not say Qwen-Image or NewBie`;
}

// For an API prompt (ids "238:226" inside subgraphs): {todo: id -> pack node, left: id -> why}.
export function plan(api, fileProblem = loaderFileProblem) {
  const memo = new Map();
  const of = (id) => {
    if (!memo.has(id)) {
      const found = new Set();
      memo.set(id, found);
      for (const v of Object.values(api[id].inputs ?? {})) {
        if (Array.isArray(v) && v.length === 2 && v[0] in api) {
          found.add(v[0]);
          of(v[0]).forEach((a) => found.add(a));
        }
      }
    }
    return memo.get(id);
  };
  const models = new Set(), left = new Map(), todo = new Map();
  const nodes = Object.entries(api);
  for (const [id, n] of nodes) {
    if (n.class_type === "UNETLoader") {
      const why = fileProblem(n.inputs.unet_name);
      if (why) {
        left.set(id, why);
        continue;
      }
      todo.set(id, TO_PACK.UNETLoader);
    }
    if (n.class_type === "UNETLoader" || n.class_type === "QwenTurboLoader") models.add(id);
  }
  if (!models.size) {
    const why = left.size ? `: ${[...left.values()][0]}` : "";
    throw new Unfit(`no Qwen-Image or NewBie model: no UNETLoader loads one${why}`);
  }
  const fed = (id) => [...of(id)].some((a) => models.has(a));
  const samplers = new Set();
  for (const [id, n] of nodes) if (n.class_type === TO_PACK.KSampler) samplers.add(id);
  for (const [id, n] of nodes) {
    if (n.class_type !== "KSampler") continue;
    const m = n.inputs.model;
    if (Array.isArray(m) && (models.has(m[0]) || fed(m[0]))) samplers.add(id);
    else left.set(id, "its model is not a Qwen-Image model");
  }
  for (const [id, n] of nodes) {
    const kind = n.class_type;
    if ((kind === "VAEDecode" || kind === "SaveImage") && !fed(id)) {
      left.set(id, "it does not come from a Qwen-Image model");
    } else if (kind === "VAEEncode" && ![...samplers].some((s) => of(s).has(id))) {
      left.set(id, "it feeds no Qwen-Image sampler");
    } else if (kind in TO_PACK && kind !== "UNETLoader" && !left.has(id)) {
      todo.set(id, TO_PACK[kind]);
    }
  }
  return { todo, left };
}

// The new node's widgets take the old one's values by name; an option of the old combo that
// the new one lacks is Unfit, except "default" (the new default).
function mapWidgets(values, options, fresh, toStock) {
  const mapped = {};
  for (const w of fresh.widgets ?? []) {
    if (!(w.name in values)) continue;
    let v = toStock && w.name in STOCK_VALUES ? STOCK_VALUES[w.name] : values[w.name];
    const offered = optionsOf(w);
    if (offered && !offered.includes(v)) {
      if (v === "default") v = w.value;
      else if ((options[w.name] ?? []).includes(v)) {
        throw new Unfit(`${w.name} "${v}": ${fresh.type} offers ${offered.join(", ")}`);
      }
    }
    mapped[w.name] = v;
  }
  return mapped;
}

// Set after the node has its id: under frontend 1.49 a widget's value lives in a store keyed
// by the node's id, which the old node's widget of the same name holds until then.
function setWidgets(node, values) {
  for (const w of node.widgets ?? []) {
    if (!(w.name in values)) continue;
    w.value = values[w.name];
    w.callback?.(w.value);
  }
}

// A combo widget's options (a list, or a function giving one), else null.
function optionsOf(widget) {
  const values = widget.options?.values;
  try {
    const list = typeof values === "function" ? values() : values;
    return Array.isArray(list) ? list : null;
  } catch {
    return null;
  }
}

const linkOf = (graph, id) => graph.links?.get?.(id) ?? graph.links?.[id];

// Swap a node of the live graph in place, as the frontend's node replacement does.
function swapLive(node, newType, toStock) {
  const graph = node.graph, at = graph._nodes.indexOf(node);
  const fresh = LiteGraph.createNode(newType);
  if (!fresh || at < 0) throw new Unfit(`${newType} is not available in this ComfyUI`);
  const values = {}, options = {};
  for (const w of node.widgets ?? []) {
    values[w.name] = w.value;
    options[w.name] = optionsOf(w);
  }
  const mapped = mapWidgets(values, options, fresh, toStock);
  const saved = node.serialize();
  node.onRemoved?.();
  fresh.id = node.id;
  fresh.pos = [...node.pos];
  fresh.size = [Math.max(node.size[0], fresh.size[0]), Math.max(node.size[1], fresh.size[1])];
  fresh.order = node.order;
  fresh.mode = node.mode;
  if (node.flags) fresh.flags = { ...node.flags };
  graph._nodes[at] = fresh;
  fresh.graph = graph;
  graph._nodes_by_id[fresh.id] = fresh;
  for (const w of fresh.widgets ?? []) w.setNodeId?.(fresh.id);
  setWidgets(fresh, mapped);
  if (saved.title != null) fresh.title = saved.title;
  fresh.properties = { ...saved.properties };
  if ("Node name for S&R" in fresh.properties) fresh.properties["Node name for S&R"] = newType;
  for (const input of node.inputs ?? []) {
    const link = input.link == null ? null : linkOf(graph, input.link);
    const slot = fresh.inputs?.findIndex((i) => i.name === input.name) ?? -1;
    if (!link) continue;
    if (slot < 0) {
      graph.removeLink?.(input.link);
      continue;
    }
    link.target_id = fresh.id;
    link.target_slot = slot;
    fresh.inputs[slot].link = input.link;
  }
  for (const [i, output] of (node.outputs ?? []).entries()) {
    if (!output.links?.length || !fresh.outputs?.[i]) continue;
    for (const id of output.links) {
      Object.assign(linkOf(graph, id) ?? {}, { origin_id: fresh.id, origin_slot: i });
    }
    fresh.outputs[i].links = [...output.links];
  }
  graph.onNodeAdded?.(fresh);
}

// The same on a workflow's JSON (root links are arrays, a subgraph's are objects).
const FIELDS = ["id", "origin_id", "origin_slot", "target_id", "target_slot", "type"];
const get = (l, k) => (Array.isArray(l) ? l[FIELDS.indexOf(k)] : l[k]);
const set = (l, k, v) => (Array.isArray(l) ? (l[FIELDS.indexOf(k)] = v) : (l[k] = v));
const jsonLink = (graph, id) => (graph.links ?? []).find((l) => get(l, "id") === id);

function swapJson(graph, node, newType, toStock) {
  const old = LiteGraph.createNode(node.type), fresh = LiteGraph.createNode(newType);
  if (!old || !fresh) throw new Unfit(`${newType} is not available in this ComfyUI`);
  const values = {}, options = {};
  (old.widgets ?? []).forEach((w, i) => {
    const saved = node.widgets_values;
    if (Array.isArray(saved) && i < saved.length) values[w.name] = saved[i];
    options[w.name] = optionsOf(w);
  });
  setWidgets(fresh, mapWidgets(values, options, fresh, toStock));
  // What the node was, where `python -m qwen_turbo convert --to pack` looks to put it back.
  const was = structuredClone({ type: node.type, widgets_values: node.widgets_values,
    inputs: node.inputs ?? [], properties: node.properties ?? {} });
  delete was.properties[STASH];
  const names = new Set((fresh.inputs ?? []).map((i) => i.name));
  const inputs = [];
  for (const input of node.inputs ?? []) {
    if (names.has(input.name)) inputs.push(input);
    else if (input.link != null) dropLink(graph, input.link);
  }
  inputs.forEach((input, slot) => {
    if (input.link != null) set(jsonLink(graph, input.link), "target_slot", slot);
  });
  node.inputs = inputs;
  node.type = newType;
  node.widgets_values = (fresh.widgets ?? []).map((w) => (w.serialize === false ? null : w.value));
  const props = { ...node.properties };
  if ("Node name for S&R" in props) props["Node name for S&R"] = newType;
  delete props.cnr_id;
  delete props.ver;
  node.properties = { ...props, [STASH]: was };
  delete node.color;
  delete node.bgcolor;
}

function linksFrom(graph, src, slot) {
  if (src === -10) return (graph.inputs[slot].linkIds ??= []);
  const out = graph.nodes.find((n) => n.id === src).outputs[slot];
  return (out.links ??= []);
}

function dropLink(graph, id) {
  const link = jsonLink(graph, id);
  const from = linksFrom(graph, get(link, "origin_id"), get(link, "origin_slot"));
  from.splice(from.indexOf(id), 1);
  graph.links.splice(graph.links.indexOf(link), 1);
}

function removeJson(graph, node, via) {
  const entry = (node.inputs ?? []).find((i) => i.name === via);
  if (entry?.link == null) return false;
  const into = jsonLink(graph, entry.link);
  const src = get(into, "origin_id"), slot = get(into, "origin_slot");
  const users = (node.outputs ?? []).flatMap((o) => o.links ?? []);
  const from = linksFrom(graph, src, slot);
  ((graph.extra ??= {})[`${STASH}_removed`] ??= []).push({ node,
    index: graph.nodes.indexOf(node), link: structuredClone(into),
    link_index: graph.links.indexOf(into), source_links: [...from] });
  for (const id of users) {
    set(jsonLink(graph, id), "origin_id", src);
    set(jsonLink(graph, id), "origin_slot", slot);
  }
  from.splice(from.indexOf(entry.link), 1, ...users);
  graph.links.splice(graph.links.indexOf(into), 1);
  graph.nodes.splice(graph.nodes.indexOf(node), 1);
  return true;
}

export function stockCopy(data) {
  const changed = [], left = [];
  for (const graph of [data, ...(data.definitions?.subgraphs ?? [])]) {
    const where = graph === data ? "" : ` in subgraph "${graph.name}"`;
    for (const node of [...graph.nodes]) {
      const label = `node ${node.id} (${node.type})${where}`;
      try {
        if (node.type in TO_STOCK) {
          const type = TO_STOCK[node.type];
          swapJson(graph, node, type, true);
          changed.push(`${label} → ${type}`);
        } else if (node.type in PASSTHROUGH) {
          if (removeJson(graph, node, PASSTHROUGH[node.type])) changed.push(`${label} taken out`);
          else left.push(`${label}: its ${PASSTHROUGH[node.type]} is not connected`);
        } else if (node.type.startsWith("QwenTurbo")) {
          left.push(`${label}: no stock twin`);
        }
      } catch (e) {
        if (!(e instanceof Unfit)) throw e;
        left.push(`${label}: ${e.message}`);
      }
    }
  }
  return { changed, left };
}

function nodeAt(root, id) {
  const path = String(id).split(":");
  let graph = root;
  for (const outer of path.slice(0, -1)) {
    graph = graph?.getNodeById(Number(outer))?.subgraph;
  }
  return graph?.getNodeById(Number(path.at(-1)));
}

function showSummary(title, changed, left) {
  document.getElementById("qwen-turbo-summary")?.remove();
  const box = document.createElement("div");
  box.id = "qwen-turbo-summary";
  Object.assign(box.style, { position: "fixed", top: "72px", right: "16px", zIndex: 10000,
    maxWidth: "620px", maxHeight: "70vh", overflow: "auto", background: "#1a3342", color: "#fff",
    border: "1px solid #3d6f8c", borderRadius: "6px", padding: "12px 16px", font: "13px sans-serif",
    boxShadow: "0 4px 18px #000a" });
  const line = (text, color) => {
    const div = document.createElement("div");
    div.textContent = text;
    div.style.color = color ?? "";
    div.style.margin = "3px 0";
    box.append(div);
  };
  line(title, "#9fe3c3");
  changed.forEach((c) => line(`changed: ${c}`));
  left.forEach((l) => line(`left: ${l}`, "#f3c98b"));
  const close = document.createElement("button");
  close.textContent = "Close";
  close.onclick = () => box.remove();
  close.style.marginTop = "8px";
  box.append(close);
  document.body.append(box);
}

const rootGraph = () => app.rootGraph ?? app.graph;

export async function accelerate() {
  const { output } = await app.graphToPrompt();
  let todo, why;
  try {
    ({ todo, left: why } = plan(output));
  } catch (e) {
    if (!(e instanceof Unfit)) throw e;
    return showSummary("Qwen Turbo: nothing accelerated", [], [e.message]);
  }
  const changed = [];
  const left = [...why].map(([id, w]) => `node ${id} (${output[id].class_type}): ${w}`);
  const tracker = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
  const done = new Set();
  tracker ? tracker.beforeChange() : app.canvas?.emitBeforeChange?.();
  try {
    for (const [id, type] of todo) {
      const node = nodeAt(rootGraph(), id);
      if (!node || done.has(node)) continue;
      done.add(node);
      const label = `node ${id} (${node.type})`;
      try {
        swapLive(node, type, false);
        changed.push(`${label} → ${type}`);
      } catch (e) {
        if (!(e instanceof Unfit)) throw e;
        left.push(`${label}: ${e.message}`);
      }
    }
    const graphs = [rootGraph(), ...(rootGraph().subgraphs?.values?.() ?? [])];
    graphs.forEach((g) => g._nodes?.forEach((n) => n.rebuildInputWidgetBindings?.()));
  } finally {
    tracker ? tracker.afterChange() : app.canvas?.emitAfterChange?.();
  }
  app.canvas?.setDirty?.(true, true);
  const title = `Qwen Turbo: ${changed.length} nodes accelerated (one undo takes it back)`;
  showSummary(title, changed, left);
}

export async function saveStockCopy() {
  const data = structuredClone(rootGraph().serialize());
  const { changed, left } = stockCopy(data);
  if (!changed.length) return showSummary("Qwen Turbo: no pack node, nothing to save", [], left);
  const workflow = app.extensionManager?.workflow?.activeWorkflow;
  const name = (workflow?.filename ?? "workflow").replace(/\.json$/, "");
  const a = document.createElement("a");
  const json = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  a.href = URL.createObjectURL(json);
  a.download = `${name}_stock.json`;
  document.body.append(a);
  a.click();
  a.remove();
  showSummary(`Qwen Turbo: stock copy saved as ${a.download}`, changed, left);
}

const COMMANDS = [
  { id: "QwenTurbo.accelerate", label: "Qwen Turbo: accelerate this workflow",
    function: accelerate },
  { id: "QwenTurbo.stockCopy", label: "Qwen Turbo: save a stock copy", function: saveStockCopy },
];
const menuItems = () => [
  null,
  ...COMMANDS.map((c) => ({ content: c.label, callback: () => c.function() })),
];

app.registerExtension({
  name: "QwenTurbo.sharing",
  commands: COMMANDS,
  menuCommands: [{ path: ["Qwen Turbo"], commands: COMMANDS.map((c) => c.id) }],
  getCanvasMenuItems: menuItems,
  setup() {
    // Frontends before the getCanvasMenuItems hook (1.27) extend the canvas menu this way,
    // as their own extensions do.
    if (typeof app.collectCanvasMenuItems === "function") return;
    const Canvas = window.LGraphCanvas ?? LiteGraph.LGraphCanvas;
    const original = Canvas.prototype.getCanvasMenuOptions;
    Canvas.prototype.getCanvasMenuOptions = function () {
      return [...original.apply(this, arguments), ...menuItems()];
    };
  },
});
