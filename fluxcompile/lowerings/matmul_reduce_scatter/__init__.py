"""fluxcompile.matmul_reduce_scatter: its choices and its CUDA implementation, which asks the rank-synchronized
autotuner for one choice per call signature (identically on every rank) and runs it.

Choices, in registration order (the autotuner's tie-break order within a family):
* ``cublas_pipelined`` (zero-copy stores into the owners' slots) and its ``:push``, ``:unsplit``, ``:addmm``
  and ``:pushadd`` (two ranks), ``:tail<d>`` (``:tail4``: scaled calls only) and experimental ``:stages<g>`` variants
  (cublas_pipelined.py);
* ``torch_symm_mem`` (torch_symm_mem.py): PyTorch's ``symm_mem.fused_matmul_reduce_scatter``;
* ``triton:<variant>`` (triton.py, experimental): the persistent Triton kernel of kernels/gemm_rs.py, one tile
  variant (``triton.PORTABLE``, the portable path);
* ``cutlass`` (cutlass.py, family ``rs_ring``, off by default): a ring in one Flux-style CUTLASS GEMM
  (kernels/cutlass_gemm.py) whose epilogue adds the running sums the next rank pushed, sub-chunk by sub-chunk; its
  launch (``cutlass:<variant>``, a variant built with the ring's source) from its shipped tuning table;
* ``reference`` (NCCL + cuBLAS, registered by lowerings/choices.py).

Scaled calls (fp8, ``scaled(OP)``) choose among ``cublas_pipelined`` and its ``:push``, ``:unsplit`` and ``:tail<d>``
variants with ``_scaled_mm`` (cuBLASLt's fp8 GEMM) per block, PyTorch's ``fused_scaled_matmul_reduce_scatter``
(``torch_symm_mem``) and the reference (NCCL + ``_scaled_mm``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from ... import ops
from ..autotune import pick
from ..choices import Choice, register_choice, scaled
from ..direct_calls import cuda_impl
from . import cublas_pipelined, cutlass, torch_symm_mem, triton

OP = "matmul_reduce_scatter"
# ``:tail4`` is offered to scaled calls only: no plain row picked it (benchmarks/choice_wins.py).
PLAIN_TAILS = tuple(d for d in cublas_pipelined.TAILS if d != 4)

_pipelined = cublas_pipelined.matmul_reduce_scatter
_CHOICES = [
    Choice(cublas_pipelined.NAME, _pipelined, cublas_pipelined.supports),
    Choice(f"{cublas_pipelined.NAME}:push", functools.partial(_pipelined, push=True), cublas_pipelined.supports),
    Choice(f"{cublas_pipelined.NAME}:unsplit", functools.partial(_pipelined, unsplit=True), cublas_pipelined.supports),
    Choice(f"{cublas_pipelined.NAME}:addmm", functools.partial(_pipelined, addmm=True), cublas_pipelined.addmm_supports),
    Choice(f"{cublas_pipelined.NAME}:pushadd", functools.partial(_pipelined, push=True, addmm=True), cublas_pipelined.pushadd_supports),
    *(
        Choice(f"{cublas_pipelined.NAME}:tail{d}", functools.partial(_pipelined, tail=d), cublas_pipelined.tail_supports(d))
        for d in PLAIN_TAILS
    ),
    *(
        Choice(f"{cublas_pipelined.NAME}:stages{g}", functools.partial(_pipelined, groups=g), cublas_pipelined.stages_supports(g), family="rs_stages")
        for g in cublas_pipelined.STAGES
    ),
    Choice(torch_symm_mem.NAME, torch_symm_mem.matmul_reduce_scatter, torch_symm_mem.supports),
    *(Choice(f"triton:{name}", *triton.make(name), family="triton_rs") for name in [triton.PORTABLE] if name),
    Choice(cutlass.NAME, *cutlass.make(cutlass.table().candidates[0]), family="rs_ring", launches=cutlass.launches()),
]  # fmt: skip
for _choice in _CHOICES:
    register_choice(OP, _choice)

# The scaled calls' choices (fp8, ``scaled(OP)``): cuBLASLt's fp8 GEMM (``_scaled_mm``) per block of rows, and
# PyTorch's async-TP fp8 op.
_scaled_supports = cublas_pipelined.supports_scaled
_SCALED_CHOICES = [
    Choice(cublas_pipelined.NAME, _pipelined, _scaled_supports),
    Choice(f"{cublas_pipelined.NAME}:push", functools.partial(_pipelined, push=True), _scaled_supports),
    Choice(f"{cublas_pipelined.NAME}:unsplit", functools.partial(_pipelined, unsplit=True), _scaled_supports),
    *(
        Choice(f"{cublas_pipelined.NAME}:tail{d}", functools.partial(_pipelined, tail=d), cublas_pipelined.tail_supports(d, scaled=True))
        for d in cublas_pipelined.TAILS
    ),
    Choice(torch_symm_mem.NAME, torch_symm_mem.scaled_matmul_reduce_scatter, torch_symm_mem.supports_scaled),
]  # fmt: skip
for _choice in _SCALED_CHOICES:
    register_choice(scaled(OP), _choice)


@cuda_impl(OP, probe=lambda args: args[0][0])
def matmul_reduce_scatter_cuda(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], scatter_dim: int,
    reduce_op: str, group_size: int, group_name: str,
    A_scales: Sequence[Tensor] | None = None, B_scales: Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None, use_fast_accum: bool = False, choice: str = "",
) -> Tensor:  # fmt: skip
    """The op's CUDA implementation: the compiled choice, else the autotuner's for this call signature. Scaled
    matmuls are chosen among the op's scaled choices (``scaled(OP)``), called with the scaling arguments after the
    others."""
    args = (list(As), list(Bs), bias, [int(s) for s in out_shape], scatter_dim, reduce_op, group_size, group_name)
    if A_scales is not None or B_scales is not None:
        ops.check_scales(len(As), A_scales, B_scales, out_dtype)
        args = (*args, list(A_scales), list(B_scales), out_dtype, use_fast_accum)
        return pick(scaled(OP), args, group_name, compiled=choice).fn(*args)
    return pick(OP, args, group_name, compiled=choice).fn(*args)
