"""mm (or a sum of mms) -> all_reduce => fluxcompile.matmul_all_reduce (row-parallel layers without SP)."""

from __future__ import annotations

import dataclasses

from torch.fx import Graph, Node

from .. import ops
from ..config import Config
from .graph_utils import shape, single_wait
from .matmuls import Producers, find_producers
from .report import Entry
from .rewrite import disabled_reason, rewrite_producers, rows, size_reason

PATTERN = "matmul_all_reduce"


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
    producers = find_producers(source, "all_reduce")
    if isinstance(producers, str):
        return producers
    k = (shape(producers.terms[0].a) or (0, 0))[-1]
    if why := size_reason(cfg, rows(sshape), sshape[-1], k):
        return why
    return MatmulAllReduceMatch(node, wait, source, reduce_op, group_name, producers)


def fuse(graph: Graph, node: Node, cfg: Config) -> Entry:
    found = match(node, cfg)
    group = str(node.args[2])
    if isinstance(found, str):
        return Entry(node.name, "all_reduce", group, None, found)
    rewrite_producers(graph, node, ops.op(PATTERN), found.fused_args(), found.wait, found.producers, [])
    terms = found.producers.terms
    bias = ", with bias" if found.producers.bias is not None else ""
    return Entry(
        node.name,
        "all_reduce",
        group,
        PATTERN,
        f"sum of {len(terms)} matmul(s) [{', '.join(t.node.name for t in terms)}]{bias}",
    )
