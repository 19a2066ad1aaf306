"""Choices for fluxcompile.matmul_all_reduce and fluxcompile.all_reduce_rmsnorm (decode's row-parallel
projections and the decoder layer's tail after them), and the CUDA implementation of each op: the
rank-synchronized autotuner picks one choice per call signature and runs it.

Choices (every one capturable in a CUDA graph once a first eager call made its workspaces):

* ``cuda:gemv-oneshot`` / ``cuda:gemv-twoshot``: csrc/gemv_ar.cu, a tensor-core GEMV kernel (m <= 64) whose epilogue
  stores each output tile into the peers' symmetric memory (decode_ar.py); built on first use;
* ``triton:<oneshot|twoshot>-<tile>``: kernels/gemm_ar.py, the same protocol with a tiled GEMM for larger m;
* ``torch_symm_mem:one_shot`` / ``torch_symm_mem:two_shot``: cuBLAS writes the product straight into a
  symmetric buffer (``mm(out=)``), then PyTorch's ``symm_mem.one_shot_all_reduce_out`` /
  ``two_shot_all_reduce_out``; the RMSNorm tail, if any, in PyTorch ops after it;
* ``schedules:one_shot`` / ``schedules:two_shot``: cuBLAS (or x), then the schedule language's library
  all-reduce run by its plan-interpreter kernel (fluxcompile/schedules, gpu_executor.py);
* ``reference``: cuBLAS then NCCL (registered by choices.py).

The cuda and triton kernels, the two-shot PyTorch choice and the schedules choices are on by default since
their GPU tests passed on 2xH200; ``FLUXCOMPILE_EXPERIMENTAL_DECODE=0`` / ``FLUXCOMPILE_EXPERIMENTAL_SCHEDULES=0``
switch them off. The one-shot PyTorch choice is always on (PyTorch's own kernel; no multicast).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import ops
from ..symm_mem import workspace
from . import decode_ar
from .autotune import pick, time_in_cuda_graphs
from .choices import Choice, register_choice
from .direct_calls import cuda_impl

OPS = ("matmul_all_reduce", "all_reduce_rmsnorm")


# ---------------------------------------------------------------------------------------------
# PyTorch's symmetric-memory all-reduce after cuBLAS.


def _product_dtype(x, As, Bs) -> torch.dtype:
    return x.dtype if x is not None else torch.result_type(As[0], Bs[0])


def _symm_supports(two_shot: bool, x, As, Bs, bias, out_shape, reduce_op, group_name) -> str | None:
    if two_shot and not decode_ar.ENABLED:
        return "experimental, not yet validated on GPUs (FLUXCOMPILE_EXPERIMENTAL_DECODE=1 enables it)"
    first = x if x is not None else As[0]
    if not first.is_cuda:
        return "needs CUDA tensors"
    if reduce_op != "sum":
        return f"reduce_op {reduce_op!r} (PyTorch's symm_mem all-reduces only sum)"
    name = "two_shot_all_reduce_out" if two_shot else "one_shot_all_reduce_out"
    if two_shot and decode_ar._group(group_name).size() < 2:
        return "PyTorch's two-shot all-reduce needs 2+ ranks (it raises 'Not implemented for world_size=1')"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, name):
        return f"torch.ops.symm_mem.{name} is not available"
    dtype = _product_dtype(x, As, Bs)
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype} (PyTorch's symm_mem all-reduce takes bfloat16 and float32)"
    nbytes = math.prod(out_shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or nbytes % 16:
        return "the output's size is not a multiple of 16 bytes (the kernels' vector width)"
    return None


def _symm_all_reduce(two_shot: bool, x, As, Bs, bias, out_shape, group_name) -> Tensor:
    """all_reduce(x or P) through a symmetric buffer that cuBLAS (or a copy of x) wrote directly."""
    dtype = _product_dtype(x, As, Bs)
    shape = list(out_shape)
    numel = math.prod(shape)
    first = x if x is not None else As[0]
    ws = workspace(group_name, numel * torch.empty((), dtype=dtype).element_size(), tag="decode_ar.torch_symm_mem")
    # A view of the rendezvoused allocation from its start: PyTorch's op finds it by the storage.
    buf = ws.buffer[: numel * torch.empty((), dtype=dtype).element_size()].view(dtype)
    if x is not None:
        buf.view(x.shape).copy_(x)
    elif len(As) == 1:
        a, b = As[0], Bs[0]
        target = buf.view(a.shape[0], b.shape[1])
        if bias is None:
            torch.mm(a, b, out=target)
        else:
            torch.addmm(bias, a, b, out=target)
    else:
        buf.view(-1, shape[-1]).copy_(ops.matmul_sum(As, Bs, bias))
    out = torch.empty(shape, dtype=dtype, device=first.device)
    if two_shot:
        torch.ops.symm_mem.two_shot_all_reduce_out(buf.view(shape), "sum", group_name, out)
    else:
        torch.ops.symm_mem.one_shot_all_reduce_out(buf.view(shape), "sum", group_name, out)
    return out


def _symm_choices(two_shot: bool):
    def mar(As, Bs, bias, out_shape, reduce_op, group_name):
        return _symm_all_reduce(two_shot, None, As, Bs, bias, out_shape, group_name)

    def mar_supports(As, Bs, bias, out_shape, reduce_op, group_name):
        return _symm_supports(two_shot, None, As, Bs, bias, out_shape, reduce_op, group_name)

    def arn(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name):
        r = _symm_all_reduce(two_shot, x, As, Bs, bias, out_shape, group_name)
        h = residual + r
        return h, ops.rms_norm(h, weight, eps, upcast, weight_after_cast)

    def arn_supports(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group):
        return _symm_supports(two_shot, x, As, Bs, bias, out_shape, reduce_op, group)

    return (mar, mar_supports), (arn, arn_supports)


# ---------------------------------------------------------------------------------------------
# The schedule language's all-reduce (fluxcompile.schedules) after cuBLAS.

SCHEDULES_ENABLED = os.environ.get("FLUXCOMPILE_EXPERIMENTAL_SCHEDULES", "1") == "1"  # GPU tests passed on 2x H200


def _sched_supports(program: str, x, As, Bs, bias, out_shape, reduce_op, group_name) -> str | None:
    first = x if x is not None else As[0]
    if not first.is_cuda:
        return "needs CUDA tensors"
    if not SCHEDULES_ENABLED:
        return "experimental, not yet validated on GPUs (FLUXCOMPILE_EXPERIMENTAL_SCHEDULES=1 enables it)"
    if reduce_op != "sum":
        return f"reduce_op {reduce_op!r} (only sum)"
    from ..schedules.gpu_executor import DTYPES

    dtype = _product_dtype(x, As, Bs)
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    world = decode_ar._group(group_name).size()
    numel = math.prod(out_shape)
    if numel == 0 or (program == "two_shot" and numel % world):
        return f"{numel} elements do not split into {world} chunks"
    return None


def _sched_all_reduce(program: str, x, As, Bs, bias, out_shape, group_name) -> Tensor:
    from .. import schedules

    p = (x if x is not None else ops.matmul_sum(As, Bs, bias)).contiguous()
    return schedules.all_reduce(p.reshape(list(out_shape)), group_name, program=program)


def _sched_choices(program: str):
    def mar(As, Bs, bias, out_shape, reduce_op, group_name):
        return _sched_all_reduce(program, None, As, Bs, bias, out_shape, group_name)

    def mar_supports(As, Bs, bias, out_shape, reduce_op, group_name):
        return _sched_supports(program, None, As, Bs, bias, out_shape, reduce_op, group_name)

    def arn(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name):
        h = residual + _sched_all_reduce(program, x, As, Bs, bias, out_shape, group_name)
        return h, ops.rms_norm(h, weight, eps, upcast, weight_after_cast)

    def arn_supports(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group):
        return _sched_supports(program, x, As, Bs, bias, out_shape, reduce_op, group)

    return (mar, mar_supports), (arn, arn_supports)


# ---------------------------------------------------------------------------------------------
# The fused kernels (decode_ar.py).


def _fused_choices(run, supports, variant):
    """(fn, supports) for both ops around ``run(variant, As, Bs, bias, out_shape, group, tail)``."""

    def mar(As, Bs, bias, out_shape, reduce_op, group_name):
        return run(variant, As, Bs, bias, out_shape, group_name)

    def mar_supports(As, Bs, bias, out_shape, reduce_op, group_name):
        return supports(variant, As, Bs, bias, out_shape, reduce_op, group_name)

    def arn(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name):
        return run(variant, As, Bs, bias, out_shape, group_name, (residual, weight, eps, weight_after_cast))

    def arn_supports(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group):
        tail = (residual, weight, eps, weight_after_cast)
        return supports(variant, As, Bs, bias, out_shape, reduce_op, group, x, tail)

    return (mar, mar_supports), (arn, arn_supports)


def _register(name: str, pair_mar, pair_arn) -> None:
    register_choice("matmul_all_reduce", Choice(name, *pair_mar))
    register_choice("all_reduce_rmsnorm", Choice(name, *pair_arn))


for _mode in decode_ar.CUDA_MODES:
    _register(f"cuda:gemv-{_mode}", *_fused_choices(decode_ar.run_cuda, decode_ar.cuda_supports, _mode))
for _variant in decode_ar.TRITON_VARIANTS:
    _register(f"triton:{_variant}", *_fused_choices(decode_ar.run_triton, decode_ar.triton_supports, _variant))
_register("torch_symm_mem:one_shot", *_symm_choices(False))
_register("torch_symm_mem:two_shot", *_symm_choices(True))
for _program in ("one_shot", "two_shot"):
    _register(f"schedules:{_program}", *_sched_choices(_program))

# Decode-sized calls (vLLM captures batches up to 512 tokens in CUDA graphs) are tuned as graph replays.
GRAPH_TUNED_MAX_ROWS = 512
time_in_cuda_graphs("matmul_all_reduce", lambda args: math.prod(args[3][:-1]) <= GRAPH_TUNED_MAX_ROWS)
time_in_cuda_graphs("all_reduce_rmsnorm", lambda args: math.prod(args[4][:-1]) <= GRAPH_TUNED_MAX_ROWS)


# ---------------------------------------------------------------------------------------------
# The CUDA implementations of the ops.


@cuda_impl("matmul_all_reduce", probe=lambda args: args[0][0])
def _cuda_matmul_all_reduce(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], reduce_op: str,
    group_name: str,
) -> Tensor:  # fmt: skip
    args = (list(As), list(Bs), bias, [int(s) for s in out_shape], reduce_op, group_name)
    return pick("matmul_all_reduce", args, group_name).fn(*args)


@cuda_impl("all_reduce_rmsnorm", probe=lambda args: args[5])  # the residual
def _cuda_all_reduce_rmsnorm(
    x: Tensor | None, As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int],
    residual: Tensor, weight: Tensor, eps: float, upcast: bool, weight_after_cast: bool, reduce_op: str,
    group_name: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    args = (
        x, list(As), list(Bs), bias, [int(s) for s in out_shape], residual, weight, eps, upcast, weight_after_cast,
        reduce_op, group_name,
    )  # fmt: skip
    return pick("all_reduce_rmsnorm", args, group_name).fn(*args)
