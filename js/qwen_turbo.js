import { app } from "../../scripts/app.js";

// Give the pack's nodes one colour, so they stand out in a shared workflow.
app.registerExtension({
  name: "QwenTurbo.nodeColors",
  nodeCreated(node) {
    if (node.comfyClass?.startsWith("QwenTurbo")) {
      node.color = "#24465a";
      node.bgcolor = "#1a3342";
    }
  },
});
