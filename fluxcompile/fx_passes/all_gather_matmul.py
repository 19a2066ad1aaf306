"""all_gather -> mm (one gather feeding one or more matmuls) => fluxcompile.all_gather_matmul.

Matched forms, after ``wait_tensor(all_gather_into_tensor(shard))``:
  * gather on dim 0: the waited tensor itself;
  * gather on dim d > 0: ``cat(split(waited, rows, dim=0), dim=d)`` — what DTensor and
    ``all_gather_tensor`` emit — or the chunks taken by ``slice``s on dim 0 (torchtitan's ``spmd_types``
    backend), with the chunks in rank order; an fp8 tensor's chunks may be viewed as bytes around the ``cat``
    and the result viewed back (``all_gather_tensor``'s type-erased cat of torchao's float8 gathers);
then optionally a permute that keeps the last dim last (moved onto the shard: gathering the permuted
shard gives the permuted gathered tensor), then zero or more reshapes flattening the leading dims (``[B, S, K] -> [B*S, K]``) into ``mm``/``addmm``, or into fp8 ``_scaled_mm``s that share one tensor-wise scale of the
gathered operand (its ``A_scale``; torchao's ``Float8ColwiseParallel`` gathers fp8 bytes with a scale agreed by
an amax all-reduce before the gather).

The fused op returns the gathered tensor only where something besides the fused matmuls reads it (another op, or
the graph's output: a training forward saves it for the backward's weight gradients); elsewhere ``return_A`` is
False, so its implementation need not produce it.
"""

from __future__ import annotations

import dataclasses
import operator

from torch.fx import Graph, Node

from .. import ops
from ..config import Config
from . import quantize_first
from .decide import decide
from .graph_utils import aten, call, dtype, erase_dead, is_call, shape, single_wait, static_int, val
from .matmuls import (
    MATMULS,
    ConsumerMatmul,
    Consumers,
    Scaling,
    find_consumers,
    matmul_ancestor,
    scaled_descendant,
    scaled_mm_args,
)
from .report import Entry
from .rewrite import disabled_reason, rewrite_consumers, rows, size_reason

PATTERN = "all_gather_matmul"


@dataclasses.dataclass
class AllGatherMatmulMatch:
    collective: Node
    shard: Node
    gathered: Node  # the full N-D gathered tensor (the wait, or the cat of the dim>0 form)
    layout_nodes: list[Node]  # wait, split, getitems, cat: erased on rewrite
    gather_dim: int
    group_size: int
    group_name: str
    consumers: Consumers
    shard_perm: list[int] | None = None  # a permute between gather and mm, moved onto the shard
    quantized: quantize_first.QuantizedGather | None = None  # a row-wise fp8 quantization moved onto the shard

    def flags(self) -> dict[str, bool]:
        """The fused op's ``return_A``, where it is not the default: False when only the fused matmuls read the
        gathered tensor (no other op, no graph output: in a training forward, what the backward saves is one)."""
        return {} if self.consumers.others else {"return_A": False}

    def fused_args(self, shard: Node | None = None) -> tuple:
        mms = self.consumers.matmuls
        return (
            shard if shard is not None else self.shard,
            [mm.b for mm in mms],
            [mm.bias for mm in mms],
            self.gather_dim,
            self.group_size,
            self.group_name,
        )


def gathered_form(wait: Node, group_size: int) -> tuple[Node, int, list[Node]] | str:
    """(gathered tensor, gather dim, nodes between) for the dim-0 and the split/cat forms."""
    users = list(wait.users)
    if users and all(is_call(u, aten.slice.Tensor) for u in users):
        return _sliced_form(wait, group_size)
    if not (len(users) == 1 and is_call(users[0], aten.split.Tensor, aten.split_with_sizes.default)):
        return wait, 0, [wait]
    split = users[0]
    split_dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if split_dim != 0:
        return wait, 0, [wait]
    getitems = sorted(split.users, key=lambda n: n.args[1] if is_call(n, operator.getitem) else -1)
    if not all(is_call(g, operator.getitem) and len(g.users) == 1 for g in getitems):
        return wait, 0, [wait]
    views = [next(iter(g.users)) for g in getitems]
    if not all(is_call(v, aten.view.dtype) and len(v.users) == 1 for v in views):
        views = []  # else: fp8 chunks viewed as bytes for the cat, the result viewed back (the same bits)
    cats = {u for c in (views or getitems) for u in c.users}
    if len(cats) != 1:
        return wait, 0, [wait]
    (cat,) = cats
    if not is_call(cat, aten.cat.default):
        return wait, 0, [wait]
    gathered, layout = cat, [wait, split, *getitems, *views, cat]
    if views:
        back = next(iter(cat.users), None)
        if len(cat.users) != 1 or not is_call(back, aten.view.dtype) or back.args[1] != dtype(wait):
            return wait, 0, [wait]
        gathered = back
        layout.append(back)
    if len(getitems) != group_size:
        return f"gathered tensor split into {len(getitems)} chunks but the group has {group_size} ranks"
    if list(cat.args[0]) != (views or getitems):
        return "cat reorders the gathered chunks"
    ndim = len(shape(cat) or ())
    dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % max(ndim, 1)
    return gathered, dim, layout


def _sliced_form(wait: Node, group_size: int) -> tuple[Node, int, list[Node]] | str:
    """The dim>0 form with the chunks taken by one ``slice`` each: ``cat([waited[0:r], waited[r:2r], ...], d)``."""
    slices = list(wait.users)
    cats = {u for s in slices for u in s.users}
    total = static_int((shape(wait) or (None,))[0])
    if total is None or len(cats) != 1 or any(len(s.users) != 1 for s in slices):
        return wait, 0, [wait]
    (cat,) = cats
    if not is_call(cat, aten.cat.default) or set(cat.args[0]) != set(slices) or len(cat.args[0]) != len(slices):
        return wait, 0, [wait]
    if len(slices) != group_size:
        return f"gathered tensor sliced into {len(slices)} chunks but the group has {group_size} ranks"
    rows_per_rank = total // group_size
    expected = [(0, r * rows_per_rank, (r + 1) * rows_per_rank, 1) for r in range(group_size)]
    if [_slice_bounds(s, total) for s in cat.args[0]] != expected:
        return "the slices of the gathered tensor are not its rank chunks in order"
    ndim = len(shape(cat) or ())
    dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % max(ndim, 1)
    return cat, dim, [wait, *slices, cat]


def _slice_bounds(node: Node, size: int) -> tuple[int | None, ...]:
    """(dim, start, end, step) of an ``aten.slice`` on a dim of ``size`` elements, None where not static."""
    args = [*node.args[1:], *([None] * 4)][:4]
    dim, start, end, step = (node.kwargs.get(k, a) for k, a in zip(("dim", "start", "end", "step"), args))
    dim, step = static_int(0 if dim is None else dim), static_int(1 if step is None else step)
    start, end = static_int(0 if start is None else start), static_int(size if end is None else end)
    if start is not None and start < 0:
        start += size
    if end is not None:
        end = min(end + size if end < 0 else end, size)
    return dim, start, end, step


def match(node: Node, cfg: Config) -> AllGatherMatmulMatch | str:
    if why := disabled_reason(cfg, PATTERN):
        return why
    shard, group_size, group_name = node.args[0], node.args[1], node.args[2]
    wait = single_wait(node)
    if wait is None:
        return "the gather is not waited on by a single wait_tensor"
    form = gathered_form(wait, group_size)
    if isinstance(form, str):
        return form
    gathered, dim, layout = form
    perm = leading_permute(gathered)
    if perm is not None:
        # Gathering the permuted shard gives the permuted gathered tensor, contiguous: the permute moves
        # onto the (smaller) shard and the gather dim moves with it.
        gathered, perm_dims = perm, list(perm.args[1])
        layout = [*layout, gathered]
        dim = perm_dims.index(dim)
    gshape = shape(gathered)
    if gshape is None or len(gshape) < 2:
        return "gathered tensor is not at least 2-D"
    consumers = find_consumers(gathered, scaled=True)
    if dim == len(gshape) - 1:
        mm = None if consumers.matmuls else (shard if is_call(shard, *MATMULS) else matmul_ancestor(shard))
        if mm is not None:
            # Megatron's gather_output: a column-parallel layer's output gathered on its features.
            return f"gathers on its last dim a tensor computed by {mm.name}: no fused op for matmul -> all_gather"
        return "gather dim is the matmul's contraction (last) dim"
    if not consumers.matmuls:
        if (scaled := scaled_descendant(gathered)) is not None:
            q = quantize_first.find(gathered, dim) if perm is None else "a permute between the gather and the quantization"
            if isinstance(q, str):
                return (
                    f"the gathered tensor is quantized to fp8 after the gather (for {scaled.name}, with scales "
                    f"computed from the gathered rows), and the quantization cannot move before it: {q}"
                )
            quantized = _quantized_consumers(q)
            if isinstance(quantized, str):
                return quantized
            return AllGatherMatmulMatch(
                node, shard, gathered, layout, dim, group_size, group_name, quantized, None, q
            )  # fmt: skip
        reasons = "; ".join(r for _, r in consumers.others) or "no users"
        return f"no mm consumes the gathered tensor as its left operand ({reasons})"
    m, k = rows(gshape), gshape[-1]
    for mm in consumers.matmuls:
        if why := size_reason(cfg, m, (shape(mm.b) or (0, 0))[-1], k):
            return why
    shard_perm = [d % len(gshape) for d in perm.args[1]] if perm is not None else None
    return AllGatherMatmulMatch(node, shard, gathered, layout, dim, group_size, group_name, consumers, shard_perm)


def _quantized_consumers(q: quantize_first.QuantizedGather) -> Consumers | str:
    """The scaled matmuls of a quantization moved before the gather, as the fused op's consumers (their A scale
    being the quantization's, gathered with the rows)."""
    found = Consumers([], [])
    for c in q.consumers:
        a = scaled_mm_args(c)
        scaling = Scaling(a["out_dtype"], bool(a["use_fast_accum"]))
        if found.scaling is not None and scaling != found.scaling:
            return f"{c.name} is scaled differently from {q.consumers[0].name} (out_dtype or fast accumulation)"
        found.scaling = scaling
        found.matmuls.append(ConsumerMatmul(c, a["mat2"], a["bias"], q.scale, a["scale_b"]))
    return found


def _fuse_quantized(graph: Graph, node: Node, found: AllGatherMatmulMatch, cfg: Config, group: str) -> Entry:
    """The rewrite of a gather whose row-wise quantization moves onto the shard: quantize the shard, then gather
    its fp8 rows and scales into the scaled matmuls; the high-precision gather and its quantization go."""
    q = found.quantized
    with graph.inserting_before(node):
        data, scale = quantize_first.quantize_shard(graph, q, found.gathered, found.shard, found.group_size)
    consumers = found.consumers
    scaling = {**consumers.scaling_kwargs(), "A_scale": scale}
    args = (data, [mm.b for mm in consumers.matmuls], [mm.bias for mm in consumers.matmuls], q.gather_dim,
            found.group_size, found.group_name)  # fmt: skip
    decision = decide(PATTERN, args, found.group_name, cfg, {"return_A": False}, scaling)
    if decision.keep:
        _erase_unused(graph, [data, scale])
        return Entry(node.name, "all_gather_into_tensor", group, None, decision.keep)
    with graph.inserting_before(node):
        fused = call(graph, ops.op(PATTERN), args, {**scaling, "return_A": False, **decision.kwargs()})
        outs = call(graph, operator.getitem, (fused, 1))
        for i, mm in enumerate(consumers.matmuls):
            mm.node.replace_all_uses_with(call(graph, operator.getitem, (outs, i)))
    for n in [*(mm.node for mm in consumers.matmuls), *reversed(q.nodes)]:  # users before what they read
        if not n.users:
            graph.erase_node(n)
    erase_dead(graph, [found.gathered, *reversed(found.layout_nodes), node])
    _erase_unused(graph, [data, scale])
    mms = ", ".join(mm.node.name for mm in consumers.matmuls)
    return Entry(
        node.name, "all_gather_into_tensor", group, PATTERN,
        f"gather dim {q.gather_dim}, {len(consumers.matmuls)} scaled matmul(s) [{mms}], row-wise fp8 "
        "quantization moved before the gather (fp8 rows and their scales gathered)"
        + (f"; {decision.note}" if decision.note else ""),
    )  # fmt: skip


def _erase_unused(graph: Graph, roots: list[Node]) -> None:
    """Erase the nodes made for a rewrite that nothing reads, walking up to their inputs."""
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.op == "call_function" and not n.users and n.graph is graph and not getattr(n, "_erased", False):
            inputs = n.all_input_nodes
            graph.erase_node(n)
            stack.extend(inputs)


def leading_permute(gathered: Node) -> Node | None:
    """The gathered tensor's only user, when it is a permute that keeps the last (K) dim last."""
    users = list(gathered.users)
    if len(users) != 1 or not is_call(users[0], aten.permute.default):
        return None
    ndim = len(shape(gathered) or ())
    dims = [d % ndim for d in users[0].args[1]]
    return users[0] if ndim >= 2 and dims[-1] == ndim - 1 else None


def fuse(graph: Graph, node: Node, cfg: Config) -> Entry:
    found = match(node, cfg)
    group = str(node.args[2])
    if isinstance(found, str):
        return Entry(node.name, "all_gather_into_tensor", group, None, found)
    if found.quantized is not None:
        return _fuse_quantized(graph, node, found, cfg, group)
    shard_val = val(found.shard) if found.shard_perm is None else val(found.shard).permute(found.shard_perm)
    scaling = found.consumers.scaling_kwargs()
    decision = decide(PATTERN, found.fused_args(shard_val), found.group_name, cfg, found.flags(), scaling)
    if decision.keep:
        return Entry(node.name, "all_gather_into_tensor", group, None, decision.keep)
    shard = None
    if found.shard_perm is not None:
        with graph.inserting_before(node):
            shard = call(graph, aten.permute.default, (found.shard, found.shard_perm))
    rewrite_consumers(
        graph, node, ops.op(PATTERN), found.fused_args(shard), found.gathered, found.consumers, found.layout_nodes,
        {**scaling, **found.flags(), **decision.kwargs()}, reads_result=bool(found.consumers.others),
    )  # fmt: skip
    mms = ", ".join(mm.node.name for mm in found.consumers.matmuls)
    kind = "scaled matmul(s)" if scaling else "matmul(s)"
    kept = (
        f"; gathered tensor also kept for {len(found.consumers.others)} other user(s)" if found.consumers.others else ""
    )
    m = static_int(rows(shape(found.gathered)))
    kept += "; symbolic sizes: the shard is copied, not produced in symmetric memory" if m is None else ""
    permuted = f" (of the shard permuted by {found.shard_perm})" if found.shard_perm is not None else ""
    return Entry(
        node.name,
        "all_gather_into_tensor",
        group,
        PATTERN,
        f"gather dim {found.gather_dim}{permuted}, {len(found.consumers.matmuls)} {kind} [{mms}], M={m}{kept}"
        + (f"; {decision.note}" if decision.note else ""),
    )
