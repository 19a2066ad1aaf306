"""Choices for fluxcompile.matmul_reduce_scatter, and its CUDA implementation: the rank-synchronized
autotuner picks one choice per call signature (identically on every rank) and runs it.

Choices: ``cublas_pipelined`` (zero-copy: cuBLAS stores each peer's row block straight into its symmetric
slot), ``cublas_pipelined:push`` (staged locally, pushed by the copy engine) and ``cublas_pipelined:unsplit``
(one GEMM over all rows, then the copy engine: no split for small M) and ``cublas_pipelined:tail<d>`` (as
unsplit, with 1/d of our rows computed beside the pushes), all in rs_cublas_pipelined.py; ``:stages<g>``
(rs_stages.py, experimental: one GEMM per group of peers, each group pushed beside the next);
``torch_symm_mem`` (PyTorch's ``symm_mem.fused_matmul_reduce_scatter``: one product, no bias); ``reference``
(NCCL + cuBLAS, registered by choices.py). ``triton:<tile>`` (rs_triton.py, the persistent kernel of
kernels/gemm_rs.py) is registered but declines until it is validated on a GPU
(FLUXCOMPILE_EXPERIMENTAL_TRITON_RS=1 enables it).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from . import rs_cublas_pipelined, rs_stages, rs_triton
from .autotune import pick
from .choices import Choice, register_choice, register_variants
from .direct_calls import cuda_impl

OP = "matmul_reduce_scatter"


def _torch_symm_mem_supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
    if bias is not None:
        return "PyTorch's fused_matmul_reduce_scatter takes no bias"
    if len(As) != 1 or len(Bs) != 1:
        return "PyTorch's fused_matmul_reduce_scatter takes one product"
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
    if A.dtype != B.dtype:
        return "mixed dtypes"
    if not (A.is_cuda and B.is_cuda):
        return "needs CUDA tensors"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter"):
        return "torch.ops.symm_mem.fused_matmul_reduce_scatter is not available"
    return None


def _torch_symm_mem(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> Tensor:
    from torch.distributed import _symmetric_memory as symm

    if not symm.is_symm_mem_enabled_for_group(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in newer torch, still required by 2.11
            symm.enable_symm_mem_for_group(group_name)
    # PyTorch's op scatters the N-D A @ B along a dim of A's leading dims: give A the output's row shape.
    A = As[0].reshape(*out_shape[:-1], As[0].shape[-1])
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(A, Bs[0], reduce_op, scatter_dim % len(out_shape), group_name)
    return out.contiguous()  # the contract: a new contiguous tensor (its reduction may leave other strides)


register_choice(
    OP, Choice(rs_cublas_pipelined.NAME, rs_cublas_pipelined.matmul_reduce_scatter, rs_cublas_pipelined.supports)
)
register_choice(
    OP,
    Choice(
        f"{rs_cublas_pipelined.NAME}:push",
        functools.partial(rs_cublas_pipelined.matmul_reduce_scatter, push=True),
        rs_cublas_pipelined.supports,
    ),
)
register_choice(
    OP,
    Choice(
        f"{rs_cublas_pipelined.NAME}:unsplit",
        functools.partial(rs_cublas_pipelined.matmul_reduce_scatter, unsplit=True),
        rs_cublas_pipelined.supports,
    ),
)
_PIPELINED = rs_cublas_pipelined.NAME
register_variants(
    OP, f"{_PIPELINED}:tail", rs_cublas_pipelined.matmul_reduce_scatter, "tail", rs_cublas_pipelined.TAILS,
    rs_cublas_pipelined.tail_supports,
)  # fmt: skip
# experimental: they decline every call unless enabled
register_variants(
    OP, f"{_PIPELINED}:stages", rs_stages.matmul_reduce_scatter, "groups", rs_stages.GROUPS, rs_stages.supports
)
register_choice(OP, Choice("torch_symm_mem", _torch_symm_mem, _torch_symm_mem_supports))
for _variant in rs_triton.VARIANTS:  # experimental: they decline every call unless enabled
    register_choice(OP, Choice(f"triton:{_variant}", *rs_triton.make(_variant)))


@cuda_impl(OP, probe=lambda args: args[0][0])
def _cuda_matmul_reduce_scatter(
    As: Sequence[Tensor],
    Bs: Sequence[Tensor],
    bias: Tensor | None,
    out_shape: Sequence[int],
    scatter_dim: int,
    reduce_op: str,
    group_size: int,
    group_name: str,
) -> Tensor:
    args = (list(As), list(Bs), bias, [int(s) for s in out_shape], scatter_dim, reduce_op, group_size, group_name)
    return pick(OP, args, group_name).fn(*args)
