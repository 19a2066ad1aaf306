"""all_gather_matmul, ``torch_symm_mem``: PyTorch's own ``symm_mem.fused_all_gather_matmul``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...symm_mem import backend
from ...symm_mem.workspace import enable_group

NAME = "torch_symm_mem"


def _unavailable(op: str) -> str | None:
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, op):
        return f"torch.ops.symm_mem.{op} is not available"
    return backend.torch_fused_ops_problem()


def supports(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> str | None:
    if not A.is_cuda:
        return "needs CUDA tensors"
    if any(b is not None for b in biases):
        return "PyTorch's fused_all_gather_matmul takes no bias"
    return _unavailable("fused_all_gather_matmul")


def all_gather_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    enable_group(group_name)
    A_gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(A, list(Bs), gather_dim, group_name, return_A=return_A)
    return A_gathered, [o.reshape(-1, o.shape[-1]) for o in outs]


def supports_scaled(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    A_scale: Tensor, B_scales: Sequence[Tensor], out_dtype: torch.dtype | None, use_fast_accum: bool,
) -> str | None:  # fmt: skip
    """``supports`` of the scaled calls: PyTorch's ``fused_all_gather_scaled_matmul`` (async-TP's fp8 gather)."""
    return "needs CUDA tensors" if not A.is_cuda else _unavailable("fused_all_gather_scaled_matmul")


def all_gather_scaled_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    A_scale: Tensor, B_scales: Sequence[Tensor], out_dtype: torch.dtype | None, use_fast_accum: bool,
    return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """The scaled call by PyTorch's op (a tensor-wise scale, or the shard's row-wise one, which it gathers)."""
    enable_group(group_name)
    n = len(Bs)
    A_gathered, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
        A, list(Bs), A_scale, list(B_scales), gather_dim, group_name, list(biases), [None] * n, [out_dtype] * n,
        [use_fast_accum] * n,
    )  # fmt: skip
    return (A_gathered if return_A else None), [o.reshape(-1, o.shape[-1]) for o in outs]
