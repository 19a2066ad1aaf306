"""all_to_all_single <-> mm => fluxcompile.all_to_all_matmul / fluxcompile.matmul_all_to_all.

The exchange is along dim 0 (tokens), as in MoE dispatch and combine or Ulysses-style sequence
parallelism. A collective whose result feeds matmuls is fused with them (consumer side); otherwise one
whose input is a sum of matmuls is fused with those (producer side).
"""

from __future__ import annotations

import dataclasses

from torch.fx import Graph, Node

from .. import ops
from ..config import Config
from .graph_utils import shape, single_wait
from .matmuls import Consumers, Producers, find_consumers
from .report import Entry
from .rewrite import describe_sum, disabled_reason, matmul_sum, rewrite_consumers, rewrite_producers, rows, size_reason

CONSUMER = "all_to_all_matmul"
PRODUCER = "matmul_all_to_all"


@dataclasses.dataclass
class AllToAllMatmulMatch:
    collective: Node
    wait: Node
    consumers: Consumers

    def fused_args(self) -> tuple:
        source, out_splits, in_splits, group_name = self.collective.args[:4]
        mms = self.consumers.matmuls
        return (source, [mm.b for mm in mms], [mm.bias for mm in mms], out_splits, in_splits, group_name)


@dataclasses.dataclass
class MatmulAllToAllMatch:
    collective: Node
    wait: Node
    producers: Producers

    def fused_args(self) -> tuple:
        source, out_splits, in_splits, group_name = self.collective.args[:4]
        terms = self.producers.terms
        return (
            [t.a for t in terms],
            [t.b for t in terms],
            self.producers.bias,
            list(shape(source)),
            out_splits,
            in_splits,
            group_name,
        )


def match_consumer(node: Node, wait: Node, cfg: Config) -> AllToAllMatmulMatch | str:
    if why := disabled_reason(cfg, CONSUMER):
        return why
    wshape = shape(wait)
    if wshape is None or len(wshape) < 2:
        return "exchanged tensor is not at least 2-D"
    consumers = find_consumers(wait)
    if not consumers.matmuls:
        reasons = "; ".join(r for _, r in consumers.others) or "no users"
        return f"no mm consumes the exchanged tensor ({reasons})"
    for mm in consumers.matmuls:
        if why := size_reason(cfg, rows(wshape), (shape(mm.b) or (0, 0))[-1], wshape[-1]):
            return why
    return AllToAllMatmulMatch(node, wait, consumers)


def match_producer(node: Node, wait: Node, cfg: Config) -> MatmulAllToAllMatch | str:
    if why := disabled_reason(cfg, PRODUCER):
        return why
    source = node.args[0]
    sshape = shape(source)
    if sshape is None or len(sshape) < 2:
        return "exchanged tensor is not at least 2-D"
    producers = matmul_sum(source, "all_to_all", cfg)
    if isinstance(producers, str):
        return producers
    return MatmulAllToAllMatch(node, wait, producers)


def fuse(graph: Graph, node: Node, cfg: Config) -> Entry:
    group = str(node.args[3])
    wait = single_wait(node)
    if wait is None:
        return Entry(node.name, "all_to_all_single", group, None, "not waited on by a single wait_tensor")
    consumer = match_consumer(node, wait, cfg)
    if not isinstance(consumer, str):
        rewrite_consumers(graph, node, ops.op(CONSUMER), consumer.fused_args(), wait, consumer.consumers, [wait])
        names = ", ".join(mm.node.name for mm in consumer.consumers.matmuls)
        return Entry(
            node.name, "all_to_all_single", group, CONSUMER, f"{len(consumer.consumers.matmuls)} matmul(s) [{names}]"
        )
    producer = match_producer(node, wait, cfg)
    if not isinstance(producer, str):
        rewrite_producers(graph, node, ops.op(PRODUCER), producer.fused_args(), wait, producer.producers, [])
        return Entry(node.name, "all_to_all_single", group, PRODUCER, describe_sum(producer.producers))
    return Entry(node.name, "all_to_all_single", group, None, f"consumer side: {consumer}; producer side: {producer}")
