"""matmul_all_reduce and all_reduce_rmsnorm, ``torch_symm_mem:one_shot`` / ``:two_shot``: cuBLAS writes the product
straight into a symmetric buffer (``mm(out=)``), then PyTorch's ``symm_mem.one_shot_all_reduce_out`` /
``two_shot_all_reduce_out``; the RMSNorm tail, if any, in PyTorch ops after it. Both are family
``torch_symm_mem``; the two-shot choice runs only while family ``decode`` is enabled too."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import ops
from ...config import config
from ...symm_mem import comm_for, group_size


def product_dtype(x, As, Bs) -> torch.dtype:
    return x.dtype if x is not None else torch.result_type(As[0], Bs[0])


def supports(two_shot: bool, x, As, Bs, bias, out_shape, reduce_op, group_name) -> str | None:
    if two_shot and (why := config.family_declines("decode")):
        return f"the two-shot choice follows family 'decode': {why}"
    first = x if x is not None else As[0]
    if not first.is_cuda:
        return "needs CUDA tensors"
    if reduce_op != "sum":
        return f"reduce_op {reduce_op!r} (PyTorch's symm_mem all-reduces only sum)"
    name = "two_shot_all_reduce_out" if two_shot else "one_shot_all_reduce_out"
    if two_shot and group_size(group_name) < 2:
        return "PyTorch's two-shot all-reduce needs 2+ ranks (it raises 'Not implemented for world_size=1')"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, name):
        return f"torch.ops.symm_mem.{name} is not available"
    dtype = product_dtype(x, As, Bs)
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype} (PyTorch's symm_mem all-reduce takes bfloat16 and float32)"
    nbytes = math.prod(out_shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or nbytes % 16:
        return "the output's size is not a multiple of 16 bytes (the kernels' vector width)"
    return None


def all_reduce(two_shot: bool, x, As, Bs, bias, out_shape, group_name) -> Tensor:
    """all_reduce(x or P) through a symmetric buffer that cuBLAS (or a copy of x) wrote directly."""
    dtype = product_dtype(x, As, Bs)
    shape = list(out_shape)
    numel = math.prod(shape)
    first = x if x is not None else As[0]
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    ws = comm_for(group_name, "matmul_all_reduce.torch_symm_mem", data_bytes=nbytes).data
    # A view of the rendezvoused allocation from its start: PyTorch's op finds it by the storage.
    buf = ws.buffer[:nbytes].view(dtype)
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
