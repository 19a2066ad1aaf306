"""matmul_all_reduce and all_reduce_rmsnorm, ``schedules:one_shot`` / ``:two_shot``: cuBLAS (or the bare input),
then the schedule language's library all-reduce run by its plan-interpreter kernel (fluxcompile/schedules,
gpu_executor.py); family ``schedules``."""

from __future__ import annotations

import math

from torch import Tensor

from ... import ops
from ...symm_mem import group_size
from .torch_symm_mem import product_dtype


def supports(program: str, x, As, Bs, bias, out_shape, reduce_op, group_name) -> str | None:
    first = x if x is not None else As[0]
    if not first.is_cuda:
        return "needs CUDA tensors"
    if reduce_op != "sum":
        return f"reduce_op {reduce_op!r} (only sum)"
    from ...schedules.gpu_executor import DTYPES

    dtype = product_dtype(x, As, Bs)
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    world = group_size(group_name)
    numel = math.prod(out_shape)
    if numel == 0 or (program == "two_shot" and numel % world):
        return f"{numel} elements do not split into {world} chunks"
    return None


def all_reduce(program: str, x, As, Bs, bias, out_shape, group_name) -> Tensor:
    from ... import schedules

    p = (x if x is not None else ops.matmul_sum(As, Bs, bias)).contiguous()
    return schedules.all_reduce(p.reshape(list(out_shape)), group_name, program=program)
