"""Whether a tensor lies in symmetric memory, where this torch tells so (``is_symm_mem_tensor``, which torch 2.11
lacks); where it cannot, nothing is taken for symmetric (a choice copies the tensor instead of reading it in place)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor


@functools.cache
def _symm_mem_check() -> Callable[[Tensor], bool] | None:
    from torch.distributed import _symmetric_memory as symm

    check = getattr(symm, "is_symm_mem_tensor", None)
    return check or getattr(torch._C._distributed_c10d._SymmetricMemory, "is_symm_mem_tensor", None)


def can_tell_symmetric() -> bool:
    """Whether this torch tells symmetric tensors apart (``is_symm_mem_tensor``); without it every shard is
    copied."""
    return _symm_mem_check() is not None


def is_symm_mem_tensor(t: Tensor) -> bool:
    """Whether ``t`` lies in a symmetric-memory allocation (False where this torch cannot tell)."""
    check = _symm_mem_check()
    return bool(check is not None and check(t))
