"""matmul_reduce_scatter, ``torch_symm_mem``: PyTorch's own ``symm_mem.fused_matmul_reduce_scatter`` (one product,
no bias)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...symm_mem import backend
from ...symm_mem.workspace import enable_group

NAME = "torch_symm_mem"


def _one_product(As, Bs, out_shape, scatter_dim, reduce_op, group_size, op: str) -> str | None:
    """The layout both of PyTorch's reduce-scatter ops take: one product, scattered on a row dim in equal parts."""
    if len(As) != 1 or len(Bs) != 1:
        return f"PyTorch's {op} takes one product"
    if reduce_op not in ("sum", "avg"):
        return f"reduce_op {reduce_op!r} (PyTorch's op does 'sum' and 'avg')"
    if group_size < 2:
        return "nothing to overlap with one rank"
    ndim = len(out_shape)
    if ndim < 2 or not -ndim <= scatter_dim < ndim or scatter_dim % ndim == ndim - 1:
        return f"scatter dim {scatter_dim} is not a row dim of a {ndim}-D output"
    if out_shape[scatter_dim] % group_size:
        return f"dim {scatter_dim} of size {out_shape[scatter_dim]} does not split over {group_size} ranks"
    A, B = As[0], Bs[0]
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != math.prod(out_shape[:-1]) or B.shape[1] != out_shape[-1]:
        return "operand shapes do not match out_shape"
    return None


def _on_cuda_with(A: Tensor, B: Tensor, op: str) -> str | None:
    if not (A.is_cuda and B.is_cuda):
        return "needs CUDA tensors"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, op):
        return f"torch.ops.symm_mem.{op} is not available"
    return backend.torch_fused_ops_problem()


def supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
    op = "fused_matmul_reduce_scatter"
    if bias is not None:
        return f"PyTorch's {op} takes no bias"
    if why := _one_product(As, Bs, out_shape, scatter_dim, reduce_op, group_size, op):
        return why
    if As[0].dtype != Bs[0].dtype:
        return "mixed dtypes"
    return _on_cuda_with(As[0], Bs[0], op)


def matmul_reduce_scatter(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> Tensor:
    enable_group(group_name)
    # PyTorch's op scatters the N-D A @ B along a dim of A's leading dims: give A the output's row shape.
    A = As[0].reshape(*out_shape[:-1], As[0].shape[-1])
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(A, Bs[0], reduce_op, scatter_dim % len(out_shape), group_name)
    return out.contiguous()  # the contract: a new contiguous tensor (its reduction may leave other strides)


def supports_scaled(
    As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, A_scales, B_scales, out_dtype,
    use_fast_accum,
) -> str | None:  # fmt: skip
    """``supports`` of the scaled calls: PyTorch's ``fused_scaled_matmul_reduce_scatter`` (async-TP's fp8 scatter;
    one product, a bias allowed)."""
    op = "fused_scaled_matmul_reduce_scatter"
    return _one_product(As, Bs, out_shape, scatter_dim, reduce_op, group_size, op) or _on_cuda_with(As[0], Bs[0], op)


def scaled_matmul_reduce_scatter(
    As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, A_scales, B_scales, out_dtype,
    use_fast_accum,
) -> Tensor:  # fmt: skip
    enable_group(group_name)
    d = scatter_dim % len(out_shape)
    A = As[0].reshape(*out_shape[:-1], As[0].shape[-1])
    A_scale = A_scales[0]
    if A_scale.numel() > 1:  # row-wise: with A's leading dims
        A_scale = A_scale.reshape(*out_shape[:-1], 1)
    out = torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
        A, Bs[0], A_scale, B_scales[0], reduce_op, d, d, group_name, list(out_shape), bias, None, out_dtype,
        use_fast_accum,
    )  # fmt: skip
    return out.contiguous()
