"""Index operands like a real call's for the DLRM ops' compile-time tuning (fx_passes/decide.py materializes a
site's operands: integers as zeros, i.e. every index in one bag of row 0, where atomics and one-bag programs
would make any choice look slow): bags of equal length over uniformly random rows."""

from __future__ import annotations

import torch
from torch import Tensor

_SEED = 57


def even_bags(indices: Tensor, offsets: Tensor, rows: int, bags: int) -> None:
    """In place: ``bags`` bags of ``indices.numel() // bags`` positions (the last takes the rest), ``offsets`` their
    starts (and the index count after them where it has ``bags + 1`` entries), ``indices`` random rows."""
    n = indices.numel()
    g = torch.Generator(device=indices.device).manual_seed(_SEED)
    indices.copy_(torch.randint(0, max(rows, 1), (n,), generator=g, device=indices.device))
    step = n // max(bags, 1)
    starts = torch.arange(offsets.numel(), device=offsets.device) * step
    if offsets.numel() > bags:
        starts[bags:] = n
    offsets.copy_(starts)


def bag_of_positions(n: int, bags: int, device: torch.device) -> Tensor:
    """Each position's bag under :func:`even_bags` (int64)."""
    step = max(n // max(bags, 1), 1)
    return (torch.arange(n, device=device) // step).clamp_max(max(bags - 1, 0))


def bag_sizes(n: int, bags: int, device: torch.device) -> Tensor:
    """Each bag's size under :func:`even_bags` (int64)."""
    step = n // max(bags, 1)
    sizes = torch.full((bags,), step, dtype=torch.int64, device=device)
    if bags:
        sizes[-1] += n - step * bags
    return sizes
