"""Triton kernels of the fused ops, one kernel family per file with its launcher beside it."""
