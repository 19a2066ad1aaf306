"""all_to_all_single <-> matmuls => fluxcompile.all_to_all_matmul / fluxcompile.matmul_all_to_all,
embedding_bag -> all_to_all_single => fluxcompile.embedding_bag_all_to_all, and its backward,
all_to_all_single -> embedding_bag backwards => fluxcompile.all_to_all_embedding_bag_backward.

The exchange is along dim 0 (tokens or samples), as in MoE dispatch and combine, Ulysses-style sequence
parallelism and DLRM's embeddings. A collective whose result feeds matmuls is fused with them (consumer side:
the MoE experts, fx_passes/experts.py, or dense ``mm``s); otherwise one whose input is made of matmuls is fused
with those (producer side: the experts, or a sum of ``mm``s), or with the embedding bags that pool it, or with
the embedding-bag backwards that read it (fx_passes/embedding_bag.py).
"""

from __future__ import annotations

import dataclasses
import operator

from torch.fx import Graph, Node

from .. import ops
from ..config import Config
from . import embedding_bag, experts
from .decide import decide
from .graph_utils import aten, c10d, call, is_call, shape, single_wait, val
from .matmuls import Consumers, Producers, find_consumers
from .report import Entry
from .rewrite import describe_sum, disabled_reason, matmul_sum, rewrite_consumers, rewrite_producers, rows, size_reason

CONSUMER = "all_to_all_matmul"
PRODUCER = "matmul_all_to_all"
POOLED = "embedding_bag_all_to_all"
POOLED_BACKWARD = "all_to_all_embedding_bag_backward"
_NO_SCALES = (None, None, None, False)  # A_scale(s), B_scales, out_dtype, use_fast_accum


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


def _expert_consumer(graph: Graph, node: Node, wait: Node, cfg: Config) -> Entry | str:
    if why := disabled_reason(cfg, CONSUMER):
        return why
    found = experts.find_expert_consumers(wait)
    if isinstance(found, str):
        return found
    source, out_splits, in_splits, group_name = node.args[:4]
    if found.loop is not None:
        return _loop_consumer(graph, node, wait, found, cfg)
    weights = [t.w for t in found.terms]
    args = [source, weights, [None] * len(weights), out_splits, in_splits, group_name, *_NO_SCALES, found.offs,
            found.permutation.index]  # fmt: skip
    flags = _exchanged_flags(wait, [t.node for t in found.terms], found.permutation.nodes)
    # Tuned with the index form's index only: a layout's row index is made below, once the site is rewritten.
    decision = decide(CONSUMER, args, group_name, cfg, flags)
    if decision.keep:
        return decision.keep
    with graph.inserting_before(node):
        args[-1] = experts.gather_index(graph, wait, found.permutation)
        fused = call(graph, ops.op(CONSUMER), tuple(args), {**flags, **decision.kwargs()})
        exchanged = call(graph, operator.getitem, (fused, 0))
        outs = call(graph, operator.getitem, (fused, 1))
        for i, t in enumerate(found.terms):
            t.node.replace_all_uses_with(call(graph, operator.getitem, (outs, i)))
    wait.replace_all_uses_with(exchanged)
    experts.erase_unused(graph, [*(t.node for t in found.terms), *reversed(found.permutation.nodes), wait, node])
    unread = _settle_exchanged(graph, fused, exchanged)
    kind = "grouped_mm" if found.offs is not None else "bmm"
    how = _how(found.permutation)
    note = f"; {decision.note}" if decision.note else ""
    return Entry(node.name, "all_to_all_single", str(group_name), CONSUMER,
                 f"{len(found.terms)} expert {kind}(s) [{', '.join(t.node.name for t in found.terms)}], "
                 f"permutation {how}{unread}{note}")  # fmt: skip


def _loop_consumer(graph: Graph, node: Node, wait: Node, found: experts.ExpertConsumers, cfg: Config) -> Entry | str:
    """One mm per expert on the split rows: the fused op runs them as one grouped matmul per weight, whose
    output is split back into the experts' pieces."""
    source, out_splits, in_splits, group_name = node.args[:4]
    loop = found.loop
    if any(shape(w)[0] != len(loop.sizes) for w, _ in loop.weights):
        return "a stacked expert weight with another expert count than the split"
    with graph.inserting_before(node):
        row_index = experts.gather_index(graph, wait, found.permutation)
        weights, offs = experts.loop_operands(graph, loop, val(wait).device)
    args = (source, weights, [None] * len(weights), out_splits, in_splits, group_name, *_NO_SCALES, offs, row_index)
    mms = [mm for per_weight in loop.mms for mm in per_weight]
    flags = _exchanged_flags(wait, [*mms, loop.split], found.permutation.nodes)
    decision = decide(CONSUMER, args, group_name, cfg, flags)
    if decision.keep:
        return decision.keep  # the operands made above are dead and go with Inductor's dead-code elimination
    with graph.inserting_before(node):
        fused = call(graph, ops.op(CONSUMER), args, {**flags, **decision.kwargs()})
        exchanged = call(graph, operator.getitem, (fused, 0))
        experts.loop_results(graph, loop, call(graph, operator.getitem, (fused, 1)))
    wait.replace_all_uses_with(exchanged)
    experts.erase_unused(graph, [*mms, loop.split, *reversed(found.permutation.nodes), wait, node])
    unread = _settle_exchanged(graph, fused, exchanged)
    note = f"; {decision.note}" if decision.note else ""
    return Entry(node.name, "all_to_all_single", str(group_name), CONSUMER,
                 f"one mm per expert ({len(loop.sizes)} experts x {len(weights)} weight(s)) as grouped matmuls, "
                 f"permutation {_how(found.permutation)}{unread}{note}")  # fmt: skip


def _exchanged_flags(wait: Node, replaced: list[Node], between: list[Node]) -> dict:
    """The fused consumer's ``return_A``, where it is not the default: False when nothing but the nodes the rewrite
    replaces (``replaced``, the expert matmuls) and those it then erases (``between``, the permutation, where only
    those read it) reads the exchanged tensor."""
    dead = set(replaced)
    candidates = [*between, *(u for n in between for u in n.users if is_call(u, operator.getitem))]
    changed = True
    while changed:
        changed = False
        for n in candidates:
            if n not in dead and all(u in dead for u in n.users):
                dead.add(n)
                changed = True
    return {} if any(u not in dead for u in wait.users) else {"return_A": False}


def _settle_exchanged(graph: Graph, fused: Node, exchanged: Node) -> str:
    """After the rewrite: the unread exchanged tensor's getitem goes; one still read (where the prediction of
    :func:`_exchanged_flags` missed a reader) makes the op return it after all. The report's words for an op
    that does not return it."""
    if not exchanged.users:
        graph.erase_node(exchanged)
    elif fused.kwargs.get("return_A") is False:
        fused.kwargs = {k: v for k, v in fused.kwargs.items() if k != "return_A"}
    return ", exchanged rows not returned (only the experts read them)" if fused.kwargs.get("return_A") is False else ""


def _how(permutation: experts.Permutation) -> str:
    return "by index" if permutation.index is not None else "by layout" if permutation.layout else "none"


def _expert_producer(graph: Graph, node: Node, wait: Node, cfg: Config) -> Entry | str:
    if why := disabled_reason(cfg, PRODUCER):
        return why
    source, out_splits, in_splits, group_name = node.args[:4]
    found = experts.find_expert_producers(source)
    if isinstance(found, str):
        return found
    out_shape = list(shape(source))
    args = [[t.a for t in found.terms], [t.w for t in found.terms], None, out_shape, out_splits, in_splits,
            group_name, *_NO_SCALES, found.offs, found.permutation.index, found.accumulate]  # fmt: skip
    decision = decide(PRODUCER, args, group_name, cfg)
    if decision.keep:
        return decision.keep
    with graph.inserting_before(node):
        args[-2] = experts.scatter_index(graph, found.terms[0].node, found.permutation)
        fused = call(graph, ops.op(PRODUCER), tuple(args), decision.kwargs())
    wait.replace_all_uses_with(fused)
    experts.erase_unused(
        graph, [wait, node, source, *found.chain, *found.permutation.nodes, *(t.node for t in found.terms)]
    )
    kind = "grouped_mm" if found.offs is not None else "bmm"
    how = _how(found.permutation)
    acc = ", accumulating" if found.accumulate else ""
    note = f"; {decision.note}" if decision.note else ""
    return Entry(node.name, "all_to_all_single", str(group_name), PRODUCER,
                 f"sum of {len(found.terms)} expert {kind}(s) [{', '.join(t.node.name for t in found.terms)}], "
                 f"permutation {how}{acc}{note}")  # fmt: skip


def _pooled(graph: Graph, node: Node, wait: Node, cfg: Config) -> Entry | str:
    if why := disabled_reason(cfg, POOLED):
        return why
    source, out_splits, in_splits, group_name = node.args[:4]
    found = embedding_bag.find_pooled(source)
    if isinstance(found, str):
        return found
    bags = found.bags
    if found.bookkept and (why := embedding_bag.bookkeeping_problem(bags)):
        return why
    args = ([b.args[0] for b in bags], [b.args[1] for b in bags], [b.args[2] for b in bags], found.mode,
            found.include_last_offset, list(shape(source)), out_splits, in_splits, group_name)  # fmt: skip
    if found.per_sample_weights is not None:  # positional, as the op's implementation passes them to its choices
        args = (*args, found.per_sample_weights)
    flags = {"bookkeeping": True} if found.bookkept else {}
    if found.padding_idx >= 0:
        flags["padding_idx"] = found.padding_idx
    decision = decide(POOLED, args, group_name, cfg, flags or None)
    if decision.keep:
        return decision.keep
    with graph.inserting_before(node):
        fused = call(graph, ops.op(POOLED), args, {**flags, **decision.kwargs()})
        out = call(graph, operator.getitem, (fused, 0))
        if found.bookkept and (why := embedding_bag.take_bookkeeping(graph, fused, bags)):
            return why  # the nodes made so far are dead and go with Inductor's dead-code elimination
    wait.replace_all_uses_with(out)
    experts.erase_unused(graph, [wait, node, source, *found.chain, found.stacked, *found.pooled, *bags])
    note = f"; {decision.note}" if decision.note else ""
    mode = embedding_bag.describe(found.mode, found.padding_idx, found.per_sample_weights is not None)
    kept = f", with the bookkeeping of {len(found.bookkept)} for the backward" if found.bookkept else ""
    return Entry(node.name, "all_to_all_single", str(group_name), POOLED,
                 f"{len(bags)} embedding bag(s) ({mode}) [{', '.join(b.name for b in bags)}]{kept}{note}")  # fmt: skip


def _pooled_backward(graph: Graph, node: Node, wait: Node, cfg: Config) -> Entry | str:
    if why := disabled_reason(cfg, POOLED_BACKWARD):
        return why
    source, out_splits, in_splits, group_name = node.args[:4]
    found = embedding_bag.find_bag_backwards(wait)
    if isinstance(found, str):
        return found
    bw = found.backwards
    args = (source, [b.args[1] for b in bw], [b.args[2] for b in bw], [b.args[3] for b in bw],
            [b.args[4] for b in bw], [b.args[5] for b in bw], [b.args[6] for b in bw], found.scale_grad_by_freq,
            found.mode, out_splits, in_splits, group_name)  # fmt: skip
    wb = found.weights_backwards or []
    if found.per_sample_weights is not None:  # positional, as the op's implementation passes them to its choices
        args = (*args, found.per_sample_weights, [w.args[1] for w in wb] if wb else None)
    flags = {"padding_idx": found.padding_idx} if found.padding_idx >= 0 else {}
    decision = decide(POOLED_BACKWARD, args, group_name, cfg, flags or None)
    if decision.keep:
        return decision.keep
    with graph.inserting_before(node):
        fused = call(graph, ops.op(POOLED_BACKWARD), args, {**flags, **decision.kwargs()})
        for t, b in enumerate(bw):
            b.replace_all_uses_with(call(graph, operator.getitem, (fused, t)))
        for t, w in enumerate(wb):  # the per-sample weights' gradients follow the tables'
            w.replace_all_uses_with(call(graph, operator.getitem, (fused, len(bw) + t)))
    experts.erase_unused(graph, [*bw, *wb, *found.selects, found.view, wait, node])
    note = f"; {decision.note}" if decision.note else ""
    mode = embedding_bag.describe(found.mode, found.padding_idx, found.per_sample_weights is not None, bool(wb))
    return Entry(node.name, "all_to_all_single", str(group_name), POOLED_BACKWARD,
                 f"{len(bw)} embedding bag backward(s) ({mode}) [{', '.join(b.name for b in bw)}]{note}")  # fmt: skip


def _sizes_from_wait(node: Node) -> None:
    """Point the collective's size reads (``sym_size`` of an exchange with unbacked splits) at its wait, which has
    the same shape, so the wait is the collective's only user."""
    waits = [u for u in node.users if is_call(u, c10d.wait_tensor.default)]
    if len(waits) == 1:
        for u in list(node.users):
            if is_call(u, aten.sym_size.int):
                u.replace_input_with(node, waits[0])


def fuse(graph: Graph, node: Node, cfg: Config) -> Entry:
    group = str(node.args[3])
    _sizes_from_wait(node)
    wait = single_wait(node)
    if wait is None:
        return Entry(node.name, "all_to_all_single", group, None, "not waited on by a single wait_tensor")
    expert_consumer = _expert_consumer(graph, node, wait, cfg)
    if isinstance(expert_consumer, Entry):
        return expert_consumer
    consumer = match_consumer(node, wait, cfg)
    if not isinstance(consumer, str):
        rewrite_consumers(graph, node, ops.op(CONSUMER), consumer.fused_args(), wait, consumer.consumers, [wait])
        names = ", ".join(mm.node.name for mm in consumer.consumers.matmuls)
        return Entry(
            node.name, "all_to_all_single", group, CONSUMER, f"{len(consumer.consumers.matmuls)} matmul(s) [{names}]"
        )
    expert_producer = _expert_producer(graph, node, wait, cfg)
    if isinstance(expert_producer, Entry):
        return expert_producer
    producer = match_producer(node, wait, cfg)
    if not isinstance(producer, str):
        rewrite_producers(graph, node, ops.op(PRODUCER), producer.fused_args(), wait, producer.producers, [])
        return Entry(node.name, "all_to_all_single", group, PRODUCER, describe_sum(producer.producers))
    pooled = _pooled(graph, node, wait, cfg)
    if isinstance(pooled, Entry):
        return pooled
    pooled_backward = _pooled_backward(graph, node, wait, cfg)
    if isinstance(pooled_backward, Entry):
        return pooled_backward
    return Entry(
        node.name, "all_to_all_single", group, None,
        f"consumer side: {_first(expert_consumer, consumer)}; producer side: {_first(expert_producer, producer)}; "
        f"embedding bags: {pooled}; embedding bag backwards: {pooled_backward}",
    )  # fmt: skip


def _first(expert_reason: str, dense_reason: str) -> str:
    """The more telling of the two reasons: the expert one unless it only says there are no experts."""
    generic = ("no grouped_mm or bmm", "is not a grouped_mm or bmm", "the exchanged tensor is not")
    return dense_reason if any(g in expert_reason for g in generic) else expert_reason
