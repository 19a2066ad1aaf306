"""Triton's global scratch for device-side TMA tensor descriptors (``tl.make_tensor_descriptor``), which the kernels
that make them (ag_gemm.py, grouped_gemm.py) need set before they launch."""

from __future__ import annotations

import torch
import triton


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter
    return torch.empty(size, dtype=torch.int8, device=device)


def set_allocator() -> None:
    """Device-side tensor descriptors need global scratch, which Triton asks its allocator for at launch
    (inside a CUDA graph capture the allocation comes from the graph's pool, like any other). Triton keeps the
    allocator in a context variable, which a new thread starts without: set it on every launch that needs it."""
    triton.set_allocator(_scratch)
