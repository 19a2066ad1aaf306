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
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Graph, Node

from .graph_utils import aten, call, is_call, is_reshape, prims, shape, val

GROUPED = aten._grouped_mm.default
BMM = aten.bmm.default
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)
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
class LoopTerms:
    """One ``mm`` per expert on the splits of the experts' operand: ``mm(split[e], W[e])`` (or ``W[e].t()``)."""

    split: Node
    sizes: list[Any]  # rows per expert (ints or SymInt nodes)
    weights: list[tuple[Node, bool]]  # (the stacked [E, K, N] weight, whether each expert's matrix is transposed)
    mms: list[list[Node]]  # per weight, per expert


@dataclasses.dataclass
class ExpertConsumers:
    x: Node  # the experts' operand
    permutation: Permutation
    terms: list[ExpertTerm]
    offs: Node | None
    loop: LoopTerms | None = None  # the one-mm-per-expert form (then ``terms`` is empty)


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


def _expert_matrix(w: Node) -> tuple[Node, int, bool] | None:
    """``W[e]`` (``select(W, 0, e)``) or its transpose, as (W, e, transposed)."""
    transposed = is_call(w, aten.permute.default) and list(w.args[1]) == [1, 0]
    if transposed:
        w = w.args[0]
    if is_call(w, aten.select.int) and w.args[1] == 0 and len(shape(w.args[0]) or ()) == 3:
        return w.args[0], w.args[2], transposed
    return None


def _loop_terms(split: Node) -> LoopTerms | str:
    """The per-expert mms on the pieces of ``split`` (along dim 0), grouped by stacked weight."""
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim != 0:
        return "the experts' rows are split along another dim than 0"
    pieces = {u.args[1]: u for u in split.users if is_call(u, operator.getitem)}
    count = len(val(split)) if isinstance(val(split), (list, tuple)) else 0
    if is_call(split, aten.split_with_sizes.default):
        sizes = list(split.args[1])
    else:
        size, rows = split.args[1], shape(split.args[0])[0]
        if not isinstance(size, int) or not isinstance(rows, int) or rows % size:
            return "a split into pieces of unequal or symbolic size"
        sizes = [size] * (rows // size)
    groups: dict[tuple[Node, bool], dict[int, Node]] = {}
    for e, piece in pieces.items():
        for user in piece.users:
            if is_call(user, aten.mm.default) and user.args[0] is piece:
                matrix = _expert_matrix(user.args[1])
                if matrix is not None and matrix[1] == e:
                    groups.setdefault((matrix[0], matrix[2]), {})[e] = user
    weights, mms = [], []
    for (w, transposed), by_expert in groups.items():
        if shape(w)[0] == count == len(sizes) and sorted(by_expert) == list(range(count)):
            weights.append((w, transposed))
            mms.append([by_expert[e] for e in range(count)])
    if not weights:
        return "no weight has one mm per expert (mm(x_e, W[e])) on the split rows"
    return LoopTerms(split, sizes, weights, mms)


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


def _appends_zero_row(cat: Node, node: Node, k: Any) -> bool:
    parts = list(cat.args[0])
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return dim == 0 and len(parts) == 2 and parts[0] is node and _zero_row(parts[1], k)


def _into_zero_rows(scatter: Node, node: Node) -> bool:
    """``slice_scatter(zeros[R + 1, K], node, 0, 0, R)``: ``node`` with a zero row appended (the backward of
    dropping the padding row)."""
    base, src = scatter.args[:2]
    dim, start = (scatter.args[2] if len(scatter.args) > 2 else 0), (scatter.args[3] if len(scatter.args) > 3 else 0)
    rows, base_rows = (shape(node) or (None,))[0], (shape(base) or (None,))[0]
    return (
        src is node and dim == 0 and start in (0, None) and is_call(base, aten.full.default) and base.args[1] == 0
        and rows is not None and base_rows is not None and _same(base_rows, rows + 1)
    )


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
            if (_expert_term(user) is not None or is_call(user, *_SPLITS)) and user.args[0] is node:
                found.append((node, Permutation(index, layout, nodes)))
            elif index is None and not layout and is_call(user, aten.index.Tensor) and user.args[0] is node:
                idx = user.args[1]
                if len(idx) == 1 and isinstance(idx[0], Node) and len(shape(idx[0]) or ()) == 1:
                    visit(user, [], idx[0], [*nodes, user])
            elif index is None and not layout and (
                (is_call(user, aten.cat.default) and _appends_zero_row(user, node, k))
                or (is_call(user, aten.slice_scatter.default) and _into_zero_rows(user, node))
            ):
                padded = [u for u in user.users if is_call(u, aten.index.Tensor) and u.args[0] is user]
                for u in padded:  # the padding row reads zeros, as the fused op's index == rows does
                    idx = u.args[1]
                    if len(idx) == 1 and isinstance(idx[0], Node) and len(shape(idx[0]) or ()) == 1:
                        visit(u, [], idx[0], [*nodes, user, u])
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
    splits = [u for u in x.users if is_call(u, *_SPLITS) and u.args[0] is x]
    if splits:
        loop = _loop_terms(splits[0])
        if isinstance(loop, str):
            return loop
        return ExpertConsumers(x, permutation, [], None, loop)
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
    if is_call(node, aten.cat.default) and any(is_call(p, aten.mm.default) for p in node.args[0]):
        return "the experts' outputs are concatenated from one mm per expert (of that form only the dispatch fuses)"
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


def _same(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are known to be equal, without guarding on them."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def _padding_slice(node: Node) -> Node | None:
    """``x[:-1]`` dropping the padding row of an index_put's result (torchtitan's ``_unpermute``): ``x``."""
    if not is_call(node, aten.slice.Tensor) or len(node.users) != 1:
        return None
    src = node.args[0]
    dim, start = (node.args[1] if len(node.args) > 1 else 0), (node.args[2] if len(node.args) > 2 else 0)
    end = node.args[3] if len(node.args) > 3 else None
    end = val(end) if isinstance(end, Node) else end
    rows = (shape(src) or (None,))[0]
    if dim != 0 or start not in (0, None) or not is_call(src, aten.index_put.default) or len(src.users) != 1:
        return None
    return src if end == -1 or (rows is not None and _same(end, rows - 1)) else None


def _zero_row(node: Node, k: Any) -> bool:
    """A tensor of one row of zeros (``x.new_zeros(k)``, maybe viewed as ``[1, k]``)."""
    while is_reshape(node):
        node = node.args[0]
    return is_call(node, aten.full.default) and node.args[1] == 0 and math.prod(shape(node) or (0,)) == k


def find_expert_producers(source: Node) -> ExpertProducers | str:
    """The expert matmuls whose rows, permuted, make ``source`` (the exchange's input)."""
    sshape = shape(source)
    if sshape is None or len(sshape) < 2:
        return "the exchanged tensor is not at least 2-D"
    node, chain = _strip_reshapes(source)
    padded = _padding_slice(node)
    if padded is not None:
        chain.append(node)
        node = padded
    if is_call(node, aten.index_put.default) and len(node.users) == 1:
        base, indices, values = node.args[:3]
        accumulate = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))
        if len(indices) != 1 or not isinstance(indices[0], Node) or len(shape(indices[0]) or ()) != 1:
            return "an index_put that is not by one row index"
        if not _empty_base(base, accumulate) or len(shape(base) or ()) != 2 or len(base.users) != 1:
            return "an index_put into a tensor that is not new (empty, or zeros when adding)"
        if len(sshape) != 2 or not _same(shape(base)[0], sshape[0] + int(padded is not None)):
            return "the rows are put into a tensor of another row count than the exchanged one"
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


def loop_operands(graph: Graph, loop: LoopTerms, device: torch.device) -> tuple[list[Node], Node]:
    """The fused consumer's stacked weights (transposed per expert where the mms were) and ``offs`` (the
    cumulative split sizes, int32), made in the graph."""
    weights = [
        call(graph, aten.permute.default, (w, [0, 2, 1])) if transposed else w for w, transposed in loop.weights
    ]
    sizes = [call(graph, aten.full.default, ([1], s), {"dtype": torch.int64, "device": device}) for s in loop.sizes]
    ends = call(graph, aten.cumsum.default, (call(graph, aten.cat.default, (sizes,)), 0))
    return weights, call(graph, prims.convert_element_type.default, (ends, torch.int32))


def loop_results(graph: Graph, loop: LoopTerms, outs: Node) -> None:
    """Each per-expert mm replaced by its rows of the fused op's output for its weight."""
    for j, mms in enumerate(loop.mms):
        out = call(graph, operator.getitem, (outs, j))
        pieces = call(graph, aten.split_with_sizes.default, (out, list(loop.sizes)))
        for e, mm in enumerate(mms):
            mm.replace_all_uses_with(call(graph, operator.getitem, (pieces, e)))


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
