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
