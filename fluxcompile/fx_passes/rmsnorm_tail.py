"""The tail after a row-parallel all-reduce: ``h = residual + all_reduce(x)``, then ``RMSNorm(h)``.

Matched as post-grad graphs spell ``nn.RMSNorm`` and Hugging Face's Llama RMSNorm:
``[convert to fp32] -> pow 2 -> mean(last dim, keepdim) -> add eps -> rsqrt -> mul``, then the weight
multiplied before (``nn.RMSNorm``) or after (Hugging Face) the cast back. Every node of the norm must
have one user (in training the backward saves ``rsqrt``, so the tail stays in the graph there); ``h``
may have any number of users (it is the residual stream).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from .graph_utils import aten, dtype, is_call, prims, shape


@dataclasses.dataclass
class RMSNormTail:
    add: Node  # h = residual + all_reduce(...)
    residual: Node
    normed: Node  # the norm's last node
    chain: list[Node]  # the norm's nodes, erased on rewrite
    weight: Node
    eps: float
    upcast: bool
    weight_after_cast: bool


def _only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _other(node: Node, one: Node) -> object:
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def match_tail(wait: Node) -> RMSNormTail | str:
    add = _only_user(wait)
    if add is None or not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1:
        return "no residual add right after the all_reduce"
    residual = _other(add, wait)
    if not isinstance(residual, Node) or shape(residual) != shape(wait) or dtype(residual) != dtype(wait):
        return "the residual add broadcasts or changes dtype"
    reasons = []
    for start in add.users:
        tail = _norm(add, start)
        if isinstance(tail, RMSNormTail):
            tail.residual = residual
            return tail
        reasons.append(tail)
    return "no RMSNorm of the residual sum (" + "; ".join(reasons) + ")"


def _norm(h: Node, start: Node) -> RMSNormTail | str:
    chain: list[Node] = []
    x, upcast = h, False
    if (
        is_call(start, prims.convert_element_type.default)
        and start.args[1] == torch.float32
        and dtype(h) != torch.float32
    ):
        x, upcast = start, True
        chain.append(start)
        pow_ = next((u for u in x.users if is_call(u, aten.pow.Tensor_Scalar)), None)
        if len(x.users) != 2:
            return f"{x.name} has {len(x.users)} users"
    else:
        pow_ = start
    if not (is_call(pow_, aten.pow.Tensor_Scalar) and pow_.args[0] is x and pow_.args[1] == 2):
        return f"{start.name} does not start an RMSNorm"
    mean = _only_user(pow_)
    ndim = len(shape(x) or ())
    if not (is_call(mean, aten.mean.dim) and [d % ndim for d in mean.args[1]] == [ndim - 1] and mean.args[2] is True):
        return "no mean over the last dim after pow"
    add_eps = _only_user(mean)
    if not (
        is_call(add_eps, aten.add.Scalar, aten.add.Tensor)
        and add_eps.args[0] is mean
        and isinstance(add_eps.args[1], float)
    ):
        return "no + eps after the mean"
    rsqrt = _only_user(add_eps)
    if not is_call(rsqrt, aten.rsqrt.default):
        return "no rsqrt"
    n = _only_user(rsqrt)
    if n is None:
        return f"rsqrt ({rsqrt.name}) has {len(rsqrt.users)} users (saved for backward?)"
    if not (is_call(n, aten.mul.Tensor) and _other(n, rsqrt) is x):
        return "rsqrt is not multiplied back into the input"
    chain += [pow_, mean, add_eps, rsqrt, n]
    nxt = _only_user(n)
    if nxt is None:
        return f"{n.name} has {len(n.users)} users"
    weight_after_cast = False
    if is_call(nxt, aten.mul.Tensor):  # weight, then cast back (nn.RMSNorm)
        weight, chain, last = _other(nxt, n), [*chain, nxt], nxt
        cast = _only_user(nxt)
        if upcast:
            if not (is_call(cast, prims.convert_element_type.default) and cast.args[1] == dtype(h)):
                return "no cast back after the weight"
            chain, last = [*chain, cast], cast
    elif upcast and is_call(nxt, prims.convert_element_type.default) and nxt.args[1] == dtype(h):
        mul = _only_user(nxt)  # cast back, then weight (Hugging Face)
        if not is_call(mul, aten.mul.Tensor):
            return "no weight after the cast back"
        weight, chain, last, weight_after_cast = _other(mul, nxt), [*chain, nxt, mul], mul, True
    else:
        return "no weight multiply"
    if not isinstance(weight, Node) or shape(weight) != (shape(h) or (None,))[-1:]:
        return "the weight is not a [hidden] tensor"
    for node in chain[:-1]:
        if node is not x and len(node.users) != 1:
            return f"{node.name} has {len(node.users)} users"
    return RMSNormTail(h, h, last, chain, weight, float(add_eps.args[1]), upcast, weight_after_cast)
