"""fluxcompile.matmul_all_reduce and fluxcompile.all_reduce_rmsnorm (decode's row-parallel projections and the
decoder layer's tail after them): their choices, registered for both ops, and each op's CUDA implementation,
which asks the rank-synchronized autotuner for one choice per call signature and runs it.

Choices (each capturable in a CUDA graph once a first eager call made its workspaces), in the autotuner's order:
* ``triton`` (family ``decode``): kernels/gemm_ar.py, a tiled GEMM for any m with the CUDA kernel's protocol
  (next); one choice whose launches (``triton:<oneshot|twoshot>-<tile>``) are the tiles whose m range holds the
  call's rows;
* ``cuda:gemv-oneshot`` / ``:gemv-twoshot`` / ``:gemv-oneshot-ll`` / ``:gemv-oneshot-ll128``: csrc/gemv_ar.cu (kernels/gemv_ar.py), a GEMV kernel (m <= 64)
  whose epilogue stores each output tile into the peers' symmetric memory (fused_kernels.py; family ``decode``,
  and between GPUs ``gemv_peers`` too);
* ``torch_symm_mem:one_shot`` / ``:two_shot`` (torch_symm_mem.py): cuBLAS into a symmetric buffer, then
  PyTorch's all-reduce (the two-shot one only with family ``decode`` too);
* ``schedules:one_shot`` / ``:two_shot`` (schedules.py): cuBLAS, then the schedule language's all-reduce;
* ``reference``: cuBLAS then NCCL (registered by lowerings/choices.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ...kernels import gemv_ar
from ...ops import check_scales
from ..autotune import pick, time_in_cuda_graphs
from ..choices import Choice, Launches, register_choice, scaled
from ..direct_calls import cuda_impl
from . import fused_kernels, schedules, torch_symm_mem
from .pairs import fused_pair, unfused_pair

OPS = ("matmul_all_reduce", "all_reduce_rmsnorm")


def _register(name: str, pair_mar, pair_arn, family: str = "") -> None:
    register_choice("matmul_all_reduce", Choice(name, *pair_mar, family=family))
    register_choice("all_reduce_rmsnorm", Choice(name, *pair_arn, family=family))


def _triton_launches(op_index: int) -> Launches:
    """The Triton kernel's tile variants as launch data (``choices.Launches``): a call times the one- and two-shot
    variants whose m range holds its rows (no table picked any of them over the others: one choice, the portable
    path, with the tile its rows need)."""

    def make(variant: str):
        if variant not in fused_kernels.TRITON_VARIANTS:
            raise ValueError(f"fluxcompile: no Triton decode launch {variant!r}")
        return fused_pair(fused_kernels.run_triton, fused_kernels.triton_supports, variant)[op_index]

    ranges = repr(sorted(fused_kernels.TRITON_VARIANTS.items()))
    return Launches.timed(list(fused_kernels.TRITON_VARIANTS), make, salt=ranges)


# Both kernels are family "decode"; the Triton one first, the candidates' order within the family.
if fused_kernels.TRITON_VARIANTS:
    _first = next(iter(fused_kernels.TRITON_VARIANTS))
    for _i, _op in enumerate(OPS):
        _launches = _triton_launches(_i)
        register_choice(_op, Choice("triton", *_launches.make(_first), family="decode", launches=_launches))
for _mode in gemv_ar.MODES:
    _pairs = fused_pair(fused_kernels.run_cuda, fused_kernels.cuda_supports, _mode)
    _register(f"cuda:gemv-{_mode}", *_pairs, family="decode")
for _shot, _two_shot in (("one_shot", False), ("two_shot", True)):
    _register(f"torch_symm_mem:{_shot}", *unfused_pair(torch_symm_mem.all_reduce, torch_symm_mem.supports, _two_shot))
    _register(f"schedules:{_shot}", *unfused_pair(schedules.all_reduce, schedules.supports, _shot))

# Decode-sized calls (vLLM captures batches up to 512 tokens in CUDA graphs) are tuned as graph replays.
GRAPH_TUNED_MAX_ROWS = 512
time_in_cuda_graphs("matmul_all_reduce", lambda args: math.prod(args[3][:-1]) <= GRAPH_TUNED_MAX_ROWS)
time_in_cuda_graphs("all_reduce_rmsnorm", lambda args: math.prod(args[4][:-1]) <= GRAPH_TUNED_MAX_ROWS)


@cuda_impl("matmul_all_reduce", probe=lambda args: args[0][0])
def matmul_all_reduce_cuda(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], reduce_op: str,
    group_name: str, A_scales: Sequence[Tensor] | None = None, B_scales: Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None, use_fast_accum: bool = False, choice: str = "",
) -> Tensor:  # fmt: skip
    """matmul_all_reduce's CUDA implementation: the compiled choice, else the autotuner's for this call
    signature. Scaled matmuls are chosen among its scaled choices (``scaled``), called with the scaling arguments
    after the others."""
    args = (list(As), list(Bs), bias, [int(s) for s in out_shape], reduce_op, group_name)
    if A_scales is not None or B_scales is not None:
        check_scales(len(As), A_scales, B_scales, out_dtype)
        args = (*args, list(A_scales), list(B_scales), out_dtype, use_fast_accum)
        return pick(scaled("matmul_all_reduce"), args, group_name, compiled=choice).fn(*args)
    return pick("matmul_all_reduce", args, group_name, compiled=choice).fn(*args)


@cuda_impl("all_reduce_rmsnorm", probe=lambda args: args[5])  # the residual
def all_reduce_rmsnorm_cuda(
    x: Tensor | None, As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int],
    residual: Tensor, weight: Tensor, eps: float, upcast: bool, weight_after_cast: bool, reduce_op: str,
    group_name: str, A_scales: Sequence[Tensor] | None = None, B_scales: Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None, use_fast_accum: bool = False, choice: str = "",
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """all_reduce_rmsnorm's CUDA implementation: the compiled choice, else the autotuner's for this call
    signature. Scaled matmuls are chosen among its scaled choices (``scaled``), called with the scaling arguments
    after the others."""
    args = (
        x, list(As), list(Bs), bias, [int(s) for s in out_shape], residual, weight, eps, upcast, weight_after_cast,
        reduce_op, group_name,
    )  # fmt: skip
    if A_scales is not None or B_scales is not None:
        check_scales(len(As), A_scales, B_scales, out_dtype)
        args = (*args, list(A_scales), list(B_scales), out_dtype, use_fast_accum)
        return pick(scaled("all_reduce_rmsnorm"), args, group_name, compiled=choice).fn(*args)
    return pick("all_reduce_rmsnorm", args, group_name, compiled=choice).fn(*args)
