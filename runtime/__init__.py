"""Runtime machinery between kernels/ and nodes/: planning, patching, tiling."""
