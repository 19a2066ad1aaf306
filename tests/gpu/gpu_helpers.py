"""Helpers for the GPU tests."""

from __future__ import annotations

import torch


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill free cached memory with NaN, so outputs a kernel forgets to write show up as NaN."""
    t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    t.fill_(float("nan"))
    del t
