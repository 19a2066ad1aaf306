"""fluxcompile.all_gather_matmul: its choices and its CUDA implementation, which asks the rank-synchronized
autotuner for one choice per call signature (identically on every rank) and runs it.

Choices, in registration order (the autotuner's tie-break order within a family):
* ``cublas_pipelined`` and its ``:concurrent``, ``:lead<d>`` and experimental ``:stages<g>`` variants (``:unsplit``
  for scaled calls only: no plain row picked it) (cublas_pipelined.py): cuBLAS GEMMs per block of rows behind
  copy-engine pushes;
* ``torch_symm_mem`` (torch_symm_mem.py): PyTorch's ``symm_mem.fused_all_gather_matmul``;
* ``triton:<variant>`` (triton.py, experimental): the persistent Triton kernel of kernels/ag_gemm.py, one tile
  variant (``triton.PORTABLE``, the portable path);
* ``cutlass`` (cutlass.py): the Flux-style CUTLASS GEMM of kernels/cutlass_gemm.py, whose tiles wait for the chunks
  of the gathered rows, fed by copy-engine pushes; one choice whose launch (``cutlass:<variant>[:<option>]...``)
  comes from its shipped tuning table (cutlass_tuning.json), a few candidates timed where the table has no entry;
* ``reference`` (NCCL + cuBLAS, registered by lowerings/choices.py).

Scaled calls (fp8, ``scaled(OP)``) choose among ``cublas_pipelined`` and its ``:concurrent`` and ``:unsplit``
variants with ``_scaled_mm`` (cuBLASLt's fp8 GEMM) per block (a tensor-wise A scale), PyTorch's
``fused_all_gather_scaled_matmul`` (``torch_symm_mem``, which also gathers a row-wise A scale) and the reference
(NCCL + ``_scaled_mm``).

Every choice is called ``fn(A, Bs, biases, gather_dim, group_size, group_name, return_A=True)`` and returns
``(A_gathered, outs)``, or ``(None, outs)`` with ``return_A`` False (the caller does not read the gathered
operand): a choice that makes the gathered tensor only to return it skips it then.
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

OP = "all_gather_matmul"

_pipelined = cublas_pipelined.all_gather_matmul
_CHOICES = [
    Choice(cublas_pipelined.NAME, _pipelined, cublas_pipelined.supports),
    Choice(f"{cublas_pipelined.NAME}:concurrent", functools.partial(_pipelined, concurrent=True), cublas_pipelined.supports),
    *(
        Choice(f"{cublas_pipelined.NAME}:lead{d}", functools.partial(_pipelined, lead=d), cublas_pipelined.lead_supports(d))
        for d in cublas_pipelined.LEADS
    ),
    *(
        Choice(f"{cublas_pipelined.NAME}:stages{g}", functools.partial(_pipelined, groups=g), cublas_pipelined.stages_supports(g), family="ag_stages")
        for g in cublas_pipelined.STAGES
    ),
    Choice(torch_symm_mem.NAME, torch_symm_mem.all_gather_matmul, torch_symm_mem.supports),
    *(Choice(f"triton:{name}", *triton.make(name), family="triton_ag") for name in [triton.PORTABLE] if name),
    Choice(cutlass.NAME, *cutlass.make(cutlass.table().candidates[0]), launches=cutlass.launches()),
]  # fmt: skip
for _choice in _CHOICES:
    register_choice(OP, _choice)

# The scaled calls' choices (fp8, ``scaled(OP)``): cuBLASLt's fp8 GEMM (``_scaled_mm``) per block of rows, and
# PyTorch's async-TP fp8 op.
_SCALED_CHOICES = [
    Choice(cublas_pipelined.NAME, _pipelined, cublas_pipelined.supports_scaled),
    Choice(f"{cublas_pipelined.NAME}:concurrent", functools.partial(_pipelined, concurrent=True), cublas_pipelined.supports_scaled),
    Choice(f"{cublas_pipelined.NAME}:unsplit", functools.partial(_pipelined, unsplit=True), cublas_pipelined.supports_scaled),
    Choice(torch_symm_mem.NAME, torch_symm_mem.all_gather_scaled_matmul, torch_symm_mem.supports_scaled),
]  # fmt: skip
for _choice in _SCALED_CHOICES:
    register_choice(scaled(OP), _choice)


# The choices' keyword arguments of a call that does not read the gathered operand (its own call signature).
_WITHOUT_A = {"return_A": False}


@cuda_impl(OP, probe=lambda args: args[0])
def all_gather_matmul_cuda(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    A_scale: Tensor | None = None, B_scales: Sequence[Tensor] | None = None, out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False, return_A: bool = True, choice: str = "",
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """The op's CUDA implementation: the compiled choice, else the autotuner's for this call signature (a call
    with ``return_A`` False is tuned apart: a choice may skip producing the gathered operand). Scaled matmuls are
    chosen among the op's scaled choices (``scaled(OP)``), called with the scaling arguments after the others."""
    args = (A, list(Bs), list(biases), gather_dim, group_size, group_name)
    if A_scale is not None or B_scales is not None:
        ops.check_scales(len(Bs), [A_scale] * len(Bs) if A_scale is not None else None, B_scales, out_dtype)
        args = (*args, A_scale, list(B_scales), out_dtype, use_fast_accum)
        flags = {} if return_A else _WITHOUT_A
        return pick(scaled(OP), args, group_name, compiled=choice, kwargs=flags).fn(*args, **flags)
    if return_A:
        return pick(OP, args, group_name, compiled=choice).fn(*args)
    return pick(OP, args, group_name, compiled=choice, kwargs=_WITHOUT_A).fn(*args, **_WITHOUT_A)
