"""Kernel tests: Triton through its interpreter on CPU, compiled on a GPU."""
