"""The choices of matmul_all_reduce and all_reduce_rmsnorm come in pairs: one implementation, called with each
op's signature. These build the pair of ``(fn, supports)`` for both ops from one function of each kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import ops

Pair = tuple[Callable[..., Any], Callable[..., str | None]]


def fused_pair(run: Callable[..., Any], supports: Callable[..., str | None], variant: Any) -> tuple[Pair, Pair]:
    """Both ops' pairs for a kernel that fuses the RMSNorm tail: ``run(variant, As, Bs, bias, out_shape, group,
    tail)`` and ``supports(variant, As, Bs, bias, out_shape, reduce_op, group, x=None, tail=None)``."""

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


def unfused_pair(
    all_reduce: Callable[..., Any], supports: Callable[..., str | None], param: Any
) -> tuple[Pair, Pair]:
    """Both ops' pairs for a choice that all-reduces ``x`` or the product, ``all_reduce(param, x, As, Bs, bias,
    out_shape, group)``, with the residual add and RMSNorm in PyTorch ops after it; ``supports(param, x, As, Bs,
    bias, out_shape, reduce_op, group)``."""

    def mar(As, Bs, bias, out_shape, reduce_op, group_name):
        return all_reduce(param, None, As, Bs, bias, out_shape, group_name)

    def mar_supports(As, Bs, bias, out_shape, reduce_op, group_name):
        return supports(param, None, As, Bs, bias, out_shape, reduce_op, group_name)

    def arn(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name):
        h = residual + all_reduce(param, x, As, Bs, bias, out_shape, group_name)
        return h, ops.rms_norm(h, weight, eps, upcast, weight_after_cast)

    def arn_supports(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group):
        return supports(param, x, As, Bs, bias, out_shape, reduce_op, group)

    return (mar, mar_supports), (arn, arn_supports)
