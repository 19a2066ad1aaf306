"""mm (or a sum of mms) -> all_reduce => fluxcompile.matmul_all_reduce (row-parallel layers without SP);
with the residual add + RMSNorm that follow it (rmsnorm_tail.py) => fluxcompile.all_reduce_rmsnorm, also
for a bare all-reduce."""

from __future__ import annotations

import dataclasses
import operator

from torch.fx import Graph, Node

from .. import ops
from ..config import Config
from .decide import decide
from .graph_utils import call, erase_dead, shape, single_wait
from .matmuls import Producers
from .report import Entry
from .rewrite import describe_sum, disabled_reason, matmul_sum, rewrite_producers
from .rmsnorm_tail import RMSNormTail, match_tail

PATTERN = "matmul_all_reduce"
TAIL = "all_reduce_rmsnorm"


@dataclasses.dataclass
class MatmulAllReduceMatch:
    collective: Node
    wait: Node
    source: Node
    reduce_op: str
    group_name: str
    producers: Producers

    def fused_args(self) -> tuple:
        terms = self.producers.terms
        return (
            [t.a for t in terms],
            [t.b for t in terms],
            self.producers.bias,
            list(shape(self.source)),
            self.reduce_op,
            self.group_name,
        )


def match(node: Node, cfg: Config) -> MatmulAllReduceMatch | str:
    if why := disabled_reason(cfg, PATTERN):
        return why
    source, reduce_op, group_name = node.args[:3]
    wait = single_wait(node)
    if wait is None:
        return "the all_reduce is not waited on by a single wait_tensor"
    sshape = shape(source)
    if sshape is None or len(sshape) < 2:
        return "all-reduced tensor is not at least 2-D"
    producers = matmul_sum(source, "all_reduce", cfg, scaled=True)
    if isinstance(producers, str):
        return producers
    return MatmulAllReduceMatch(node, wait, source, reduce_op, group_name, producers)


def fuse(graph: Graph, node: Node, cfg: Config) -> Entry:
    found = match(node, cfg)
    group = str(node.args[2])
    wait = single_wait(node)
    tail = match_tail(wait) if wait is not None and cfg.all_reduce_rmsnorm else None
    if isinstance(tail, RMSNormTail):
        return _fuse_with_tail(graph, node, found, tail, group, cfg)
    if isinstance(found, str):
        return Entry(node.name, "all_reduce", group, None, found)
    scaling = found.producers.scaling_kwargs()
    decision = decide(PATTERN, found.fused_args(), found.group_name, cfg, scaling=scaling)
    if decision.keep:
        return Entry(node.name, "all_reduce", group, None, decision.keep)
    rewrite_producers(
        graph, node, ops.op(PATTERN), found.fused_args(), found.wait, found.producers, [],
        {**scaling, **decision.kwargs()},
    )  # fmt: skip
    note = f"; {decision.note}" if decision.note else ""
    return Entry(node.name, "all_reduce", group, PATTERN, _describe(found) + note)


def _describe(found: MatmulAllReduceMatch) -> str:
    return describe_sum(found.producers)


def _fuse_with_tail(
    graph: Graph, node: Node, found: MatmulAllReduceMatch | str, tail: RMSNormTail, group: str, cfg: Config
) -> Entry:
    source, reduce_op, group_name = node.args[:3]
    if isinstance(found, MatmulAllReduceMatch):
        As, Bs, bias, out_shape = found.fused_args()[:4]
        x, what, producers = None, _describe(found), found.producers
    else:
        As, Bs, bias, out_shape = [], [], None, list(shape(source))
        x, what, producers = source, f"bare all_reduce ({found})", None
    args = (
        x,
        As,
        Bs,
        bias,
        out_shape,
        tail.residual,
        tail.weight,
        tail.eps,
        tail.upcast,
        tail.weight_after_cast,
        reduce_op,
        group_name,
    )
    scaling = producers.scaling_kwargs() if producers is not None else {}
    decision = decide(TAIL, args, group_name, cfg, scaling=scaling)
    if decision.keep:
        return Entry(node.name, "all_reduce", group, None, decision.keep)
    with graph.inserting_before(node):
        fused = call(graph, ops.op(TAIL), args, {**scaling, **decision.kwargs()})
        h = call(graph, operator.getitem, (fused, 0))
        normed = call(graph, operator.getitem, (fused, 1))
    tail.normed.replace_all_uses_with(normed)
    tail.add.replace_all_uses_with(h)
    dead = [*reversed(tail.chain), tail.add, single_wait(node), node]
    if producers is not None:
        dead += [*producers.chain, *(t.node for t in producers.terms)]
    erase_dead(graph, dead)
    order = "weight after the cast" if tail.weight_after_cast else "weight before the cast"
    note = f"; {decision.note}" if decision.note else ""
    return Entry(
        node.name, "all_reduce", group, TAIL, f"{what}; + residual add + RMSNorm (eps {tail.eps:g}, {order}){note}"
    )
