"""MoE expert matmuls next to an all_to_all_single: the dispatch (exchange -> experts) and the combine
(experts -> exchange), as torchtitan and GShard-style layers write them.

Between the exchange, whose rows are ordered by source rank, and the experts, the rows are permuted:
  * by an index (dropless, torchtitan's ``_permute``/``_unpermute``): ``x = routed[perm]`` before the experts,
    ``out = empty(...); out[perm] = y`` (``index_put``) after them, and ``index_put(zeros, [perm], g,
    accumulate=True)`` in the backward of the gather;
  * by a layout (capacity, GShard): ``routed.view(world, E, C, d).transpose(0, 1).reshape(E, world * C, d)``
    and its inverse: reshapes, permutes and contiguous clones that keep the feature dim. Its row index is
    computed in the graph from an ``iota`` put through the same ops;
  * not at all.
The experts are ``torch._grouped_mm(x, W, offs)`` (one offsets tensor shared by all of them) or ``torch.bmm(x,
W)`` with 3-D weights, as ``ops.py`` ("Expert matmuls") defines the fused ops' arguments.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Graph, Node

from .graph_utils import aten, call, is_call, is_reshape, prims, shape, val

GROUPED = aten._grouped_mm.default
BMM = aten.bmm.default
_LAYOUT = (aten.permute.default, aten.clone.default)


@dataclasses.dataclass
class Permutation:
    """How rows move between the exchanged tensor and the experts' operand."""

    index: Node | None  # an index tensor of the graph (gather/scatter form)
    layout: list[Node]  # the layout ops, in order (capacity form)
    nodes: list[Node]  # the nodes between the two tensors, to erase when unused


@dataclasses.dataclass
class ExpertTerm:
    node: Node  # the grouped_mm / bmm
    a: Node
    w: Node


@dataclasses.dataclass
class ExpertConsumers:
    x: Node  # the experts' operand
    permutation: Permutation
    terms: list[ExpertTerm]
    offs: Node | None


@dataclasses.dataclass
class ExpertProducers:
    terms: list[ExpertTerm]
    offs: Node | None
    permutation: Permutation
    accumulate: bool
    chain: list[Node]  # adds, reshapes and index_put between the experts and the exchange's input


def _expert_term(node: Node) -> ExpertTerm | str | None:
    """The node as an expert matmul (None: not one at all)."""
    if is_call(node, GROUPED):
        w, offs = node.args[1], (node.args[2] if len(node.args) > 2 else node.kwargs.get("offs"))
        extra = [*node.args[3:], *(v for k, v in node.kwargs.items() if k != "offs")]
        if offs is None or any(e is not None for e in extra):
            return "a grouped_mm without offsets or with a bias/out_dtype"
        if len(shape(w) or ()) != 3 or len(shape(node.args[0]) or ()) != 2:
            return "a grouped_mm that is not [R, K] x [E, K, N]"
        return ExpertTerm(node, node.args[0], w)
    if is_call(node, BMM):
        return ExpertTerm(node, node.args[0], node.args[1])
    return None


def _offs(term: ExpertTerm) -> Node | None:
    n = term.node
    return (n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")) if is_call(n, GROUPED) else None


def _keeps_features(node: Node, k: Any) -> bool:
    """A layout op that moves whole rows: the last dim stays last and of size ``k``."""
    s = shape(node)
    if not s or s[-1] != k:
        return False
    if is_call(node, aten.permute.default):
        dims = list(node.args[1])
        return dims[-1] % len(dims) == len(dims) - 1
    if is_call(node, aten.clone.default):
        return True
    return is_reshape(node)


def _layout_path(start: Node, end: Node) -> list[Node] | None:
    """The ops from ``start`` to ``end`` (exclusive of start), each taking the previous as its first argument."""
    path, node = [], end
    while node is not start:
        if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
            return None
        path.append(node)
        node = node.args[0]
        if len(path) > 16:
            return None
    return path[::-1]


def find_expert_consumers(result: Node) -> ExpertConsumers | str:
    """The expert matmuls reading the exchanged tensor ``result`` ([R, K]) after a permutation, if any."""
    rshape = shape(result)
    if rshape is None or len(rshape) != 2:
        return "the exchanged tensor is not 2-D"
    k = rshape[-1]
    # Walk down single chains of layout ops and one gather; collect the nodes that feed expert matmuls.
    found: list[tuple[Node, Permutation]] = []

    def visit(node: Node, layout: list[Node], index: Node | None, nodes: list[Node]) -> None:
        for user in node.users:
            if _expert_term(user) is not None and user.args[0] is node:
                found.append((node, Permutation(index, layout, nodes)))
            elif index is None and not layout and is_call(user, aten.index.Tensor) and user.args[0] is node:
                idx = user.args[1]
                if len(idx) == 1 and isinstance(idx[0], Node) and len(shape(idx[0]) or ()) == 1:
                    visit(user, [], idx[0], [*nodes, user])
            elif index is None and (is_reshape(user) or is_call(user, *_LAYOUT)) and user.args[0] is node:
                if _keeps_features(user, k):
                    visit(user, [*layout, user], None, [*nodes, user])

    visit(result, [], None, [])
    xs = {x for x, _ in found}
    if not found:
        return "no grouped_mm or bmm reads the exchanged rows"
    if len(xs) > 1:
        return "expert matmuls read the exchanged rows through different permutations"
    x, permutation = found[0]
    terms = []
    for user in x.users:
        term = _expert_term(user)
        if term is None or user.args[0] is not x:
            continue
        if isinstance(term, str):
            return term
        terms.append(term)
    offs = {_offs(t) for t in terms}
    kinds = {t.node.target for t in terms}
    if len(offs) > 1 or len(kinds) > 1:
        return "the expert matmuls disagree on their offsets or kind"
    if kinds == {BMM} and any(len(shape(t.w) or ()) != 3 or shape(t.w)[0] != shape(x)[0] for t in terms):
        return "a bmm whose weight is not [E, K, N]"
    return ExpertConsumers(x, permutation, terms, offs.pop())


def _strip_reshapes(node: Node) -> tuple[Node, list[Node]]:
    chain = []
    while is_reshape(node) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return node, chain


def _terms_of(node: Node) -> tuple[list[ExpertTerm], list[Node]] | str:
    """The expert matmuls whose sum is ``node`` (through adds and reshapes), and the adds/reshapes."""
    node, chain = _strip_reshapes(node)
    if is_call(node, aten.add.Tensor) and len(node.users) == 1 and len(node.args) == 2 and not node.kwargs:
        parts = [_terms_of(a) if isinstance(a, Node) else "an add of a non-tensor" for a in node.args]
        for p in parts:
            if isinstance(p, str):
                return p
        return [t for p in parts for t in p[0]], [*chain, node, *(c for p in parts for c in p[1])]
    term = _expert_term(node)
    if term is None:
        return f"{node.name} is not a grouped_mm or bmm"
    if isinstance(term, str):
        return term
    if len(node.users) != 1:
        return f"{node.name} has other users"
    return [term], chain


def _empty_base(base: Node, accumulate: bool) -> bool:
    """The base of an index_put that the rows not written may take any value of (or zeros, when adding)."""
    if is_call(base, aten.full.default):
        return base.args[1] == 0
    return not accumulate and is_call(base, aten.empty.memory_format, aten.empty_like.default)


def find_expert_producers(source: Node) -> ExpertProducers | str:
    """The expert matmuls whose rows, permuted, make ``source`` (the exchange's input)."""
    sshape = shape(source)
    if sshape is None or len(sshape) < 2:
        return "the exchanged tensor is not at least 2-D"
    node, chain = _strip_reshapes(source)
    if is_call(node, aten.index_put.default) and len(node.users) == 1:
        base, indices, values = node.args[:3]
        accumulate = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))
        if len(indices) != 1 or not isinstance(indices[0], Node) or len(shape(indices[0]) or ()) != 1:
            return "an index_put that is not by one row index"
        if not _empty_base(base, accumulate) or len(shape(base) or ()) != 2 or len(base.users) != 1:
            return "an index_put into a tensor that is not new (empty, or zeros when adding)"
        found = _terms_of(values)
        if isinstance(found, str):
            return found
        terms, inner = found
        permutation = Permutation(indices[0], [], [node, base])
        return _producers(terms, permutation, accumulate, [*chain, *inner])
    # A layout permutation ending in a contiguous clone, or none.
    layout: list[Node] = []
    cur = node
    while (is_call(cur, *_LAYOUT) or is_reshape(cur)) and len(cur.users) == 1 and _keeps_features(cur, sshape[-1]):
        layout.append(cur)
        cur = cur.args[0]
    layout.reverse()
    found = _terms_of(cur)
    if isinstance(found, str):
        return found
    terms, inner = found
    has_permute = any(is_call(n, aten.permute.default) for n in layout)
    permutation = Permutation(None, layout if has_permute else [], layout)
    return _producers(terms, permutation, False, [*chain, *inner])


def _producers(
    terms: list[ExpertTerm], permutation: Permutation, accumulate: bool, chain: list[Node]
) -> ExpertProducers | str:
    offs = {_offs(t) for t in terms}
    if len(offs) > 1 or len({t.node.target for t in terms}) > 1:
        return "the expert matmuls disagree on their offsets or kind"
    if any(val(t.a) is None or val(t.w) is None for t in terms):
        return "operands without example values"
    if any(len(shape(t.w) or ()) != 3 for t in terms):
        return "an expert weight that is not [E, K, N]"
    return ExpertProducers(terms, offs.pop(), permutation, accumulate, chain)


def _replay(graph: Graph, layout: Sequence[Node], rows_shape: Sequence[Any], device: torch.device) -> Node:
    """``iota`` over the rows of ``rows_shape`` (all but its last dim), put through ``layout`` with a feature dim
    of 1, flattened: for each row of the layout's output, the row of its input it holds."""
    rows = 1
    for s in rows_shape[:-1]:
        rows = rows * s
    idx = call(graph, prims.iota.default, (rows,), {"start": 0, "step": 1, "dtype": torch.int64, "device": device,
                                                   "requires_grad": False})  # fmt: skip
    idx = call(graph, aten.reshape.default, (idx, [*rows_shape[:-1], 1]))
    for op in layout:
        if is_call(op, aten.permute.default):
            idx = call(graph, aten.permute.default, (idx, list(op.args[1])))
        elif is_call(op, aten.clone.default):
            idx = call(graph, aten.clone.default, (idx,), {"memory_format": torch.contiguous_format})
        else:
            idx = call(graph, aten.reshape.default, (idx, [*shape(op)[:-1], 1]))
    return call(graph, aten.reshape.default, (idx, [-1]))


def gather_index(graph: Graph, result: Node, permutation: Permutation) -> Node | None:
    """The fused consumer's ``row_index`` (inserted before the current insertion point where it is computed)."""
    if permutation.index is not None or not permutation.layout:
        return permutation.index
    return _replay(graph, permutation.layout, shape(result), val(result).device)


def scatter_index(graph: Graph, terms_out: Node, permutation: Permutation) -> Node | None:
    """The fused producer's ``row_index``: the inverse of the layout's gather (``index_put`` of an iota)."""
    if permutation.index is not None or not permutation.layout:
        return permutation.index
    start = permutation.layout[0].args[0]
    device = val(start).device
    g = _replay(graph, permutation.layout, shape(start), device)
    rows = val(g).shape[0]
    iota = call(graph, prims.iota.default, (rows,), {"start": 0, "step": 1, "dtype": torch.int64, "device": device,
                                                    "requires_grad": False})  # fmt: skip
    empty = call(graph, aten.empty.memory_format, ([rows],), {"dtype": torch.int64, "device": device})
    return call(graph, aten.index_put.default, (empty, [g], iota))


def erase_unused(graph: Graph, nodes: Sequence[Node]) -> None:
    """Erase those of ``nodes`` that end up without users (latest first); the others stay."""
    pending = list(dict.fromkeys(nodes))
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users and node.op == "call_function":
                graph.erase_node(node)
                pending.remove(node)
                changed = True
            elif node.users and all(is_call(u, operator.getitem) and not u.users for u in node.users):
                for u in list(node.users):
                    graph.erase_node(u)
                changed = True
