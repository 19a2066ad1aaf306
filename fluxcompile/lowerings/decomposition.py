"""The original ops of a matched site as Inductor's generated code issues them, for the compile-time choice.

A site that keeps its collective and matmuls runs what Inductor compiles for them: the functional collective's
raw op and its wait (``torch.ops._c10d_functional.*.default``, the all-reduce in place) and cuBLAS's matmuls,
called from the generated wrapper with no Python around them. The op's reference choice (ops.py) computes the
same, but through the checks and wrappers of a Python call, whose host time the generated code does not pay;
timed as the site's alternative at compile time, it would make the fused choices look better than they are where
the host paces the step. ``FUNCTIONS[op]`` takes the fused op's arguments and returns its results from the calls
Inductor makes (what fx_passes/decide.py times against the fused choices), ``_scaled_mm`` for scaled matmuls
(``FUNCTIONS[scaled(op)]``); arguments it does not cover (a row-wise scale of gathered rows) go to the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import ops
from .choices import scaled

_c10d = torch.ops._c10d_functional


def _waited(t: Tensor) -> Tensor:
    return _c10d.wait_tensor.default(t)


def _products(a: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], *scaling: Any) -> list[Tensor]:
    if not scaling:
        return [torch.mm(a, b) if bias is None else torch.addmm(bias, a, b) for b, bias in zip(Bs, biases)]
    A_scale, B_scales, out_dtype, fast = scaling
    return [
        torch._scaled_mm(a, b, A_scale, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast)
        for b, bias, sb in zip(Bs, biases, B_scales)
    ]


def _scaled_sum(As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, *scaling: Any) -> Tensor:
    """The sum of matmuls, as ``ops.matmul_sum`` (scaled where ``scaling`` is given)."""
    if not scaling:
        return ops.matmul_sum(As, Bs, bias)
    A_scales, B_scales, out_dtype, fast = scaling
    out = None
    for i, (a, b, sa, sb) in enumerate(zip(As, Bs, A_scales, B_scales)):
        term = torch._scaled_mm(a, b, sa, sb, bias=bias if i == 0 else None, out_dtype=out_dtype, use_fast_accum=fast)
        out = term if out is None else out + term
    return out


def all_gather_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int,
    group_name: str, *rest: Any, return_A: bool = True, **kwargs: Any,
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """all_gather_into_tensor + wait (+ the cat of a gather along another dim), then a matmul per weight (scaled,
    with one A scale, where ``rest`` holds the scaling arguments)."""
    if kwargs or (rest and (len(rest) != 4 or rest[0] is None or rest[0].numel() != 1)):
        return ops.REFERENCES["all_gather_matmul"](
            A, Bs, biases, gather_dim, group_size, group_name, *rest, return_A=return_A, **kwargs
        )
    with torch._C._AutoDispatchBelowAutograd():
        gathered = _waited(_c10d.all_gather_into_tensor.default(A.contiguous(), group_size, group_name))
    if gather_dim % A.dim():
        gathered = torch.cat(gathered.chunk(group_size, dim=0), dim=gather_dim)
    outs = _products(gathered.reshape(-1, gathered.shape[-1]), Bs, biases, *rest)
    return (gathered if return_A else None), outs


def matmul_reduce_scatter(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], scatter_dim: int,
    reduce_op: str, group_size: int, group_name: str, *rest: Any, **kwargs: Any,
) -> Tensor:  # fmt: skip
    """The matmuls (summed; scaled where ``rest`` holds the scaling arguments), the cat of a scatter along another
    dim, then reduce_scatter_tensor + wait."""
    if kwargs or (rest and len(rest) != 4):
        return ops.REFERENCES["matmul_reduce_scatter"](
            As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, *rest, **kwargs
        )
    P = _scaled_sum(As, Bs, bias, *rest).reshape(out_shape)
    if scatter_dim % len(out_shape):
        P = torch.cat(P.chunk(group_size, dim=scatter_dim), dim=0)
    with torch._C._AutoDispatchBelowAutograd():
        return _waited(_c10d.reduce_scatter_tensor.default(P.contiguous(), reduce_op, group_size, group_name))


def matmul_all_reduce(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], reduce_op: str,
    group_name: str, *rest: Any, **kwargs: Any,
) -> Tensor:  # fmt: skip
    """The matmuls (summed; scaled where ``rest`` holds the scaling arguments), then all_reduce_ in place + wait, as
    Inductor reuses the product's buffer."""
    if kwargs or (rest and len(rest) != 4):
        return ops.REFERENCES["matmul_all_reduce"](As, Bs, bias, out_shape, reduce_op, group_name, *rest, **kwargs)
    P = _scaled_sum(As, Bs, bias, *rest).reshape(out_shape).contiguous()
    with torch._C._AutoDispatchBelowAutograd():
        return _waited(_c10d.all_reduce_.default(P, reduce_op, group_name))


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "all_gather_matmul": all_gather_matmul,
    "matmul_reduce_scatter": matmul_reduce_scatter,
    "matmul_all_reduce": matmul_all_reduce,
}
FUNCTIONS.update({scaled(op): fn for op, fn in list(FUNCTIONS.items())})
