"""embedding_bag (this rank's tables) -> all_to_all_single => fluxcompile.embedding_bag_all_to_all, and its
backward, all_to_all_single -> embedding_bag backward per table => fluxcompile.all_to_all_embedding_bag_backward.

DLRM's model-parallel embeddings: every rank pools the global batch for its own tables, stacks the pooled rows
(``stack(dim=1)`` or ``cat(dim=1)``: ``[B, T * D]`` either way) and sends each sample's row to the rank that owns
the sample. A training graph also saves each bag's bookkeeping (``offset2bag``, ``bag_size``, ``max_indices``) for
its backward: the fused op then makes them too (``bookkeeping``: its reference by aten's own ``_embedding_bag``,
its pooling kernel as it pools, in aten's CUDA conventions), and the backward reads them from it. Max pooling's
``max_indices`` are per column: a training graph with max pooling keeps its ops.
"""

from __future__ import annotations

import dataclasses
import operator

from torch.fx import Graph, Node

from .graph_utils import aten, call, is_call, is_reshape, shape, val

BAGS = (aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
BAG_BACKWARD = aten._embedding_bag_backward.default
WEIGHTS_BACKWARD = aten._embedding_bag_per_sample_weights_backward.default


@dataclasses.dataclass
class EmbeddingBagMatch:
    bags: list[Node]  # the _embedding_bag nodes, in column order
    pooled: list[Node]  # their getitem 0
    stacked: Node  # the stack / cat
    chain: list[Node]  # reshapes between the stack and the exchange's input
    mode: int
    include_last_offset: bool
    bookkept: list[Node]  # the bags whose bookkeeping (getitem 1..3) a backward reads: the fused op makes it
    padding_idx: int = -1
    per_sample_weights: list[Node] | None = None  # one per bag, or none


def mode_name(mode: int) -> str:
    """aten's embedding-bag mode in words (the report's)."""
    return {0: "sum", 1: "mean", 2: "max"}.get(mode, str(mode))


def describe(mode: int, padding_idx: int, weighted: bool, weights_grads: bool = False) -> str:
    """The bags' pooling and options in the report's words: ``sum, padding_idx 3, per-sample weights``."""
    words = [mode_name(mode)]
    if padding_idx >= 0:
        words.append(f"padding_idx {padding_idx}")
    if weighted:
        words.append("per-sample weights and their gradients" if weights_grads else "per-sample weights")
    return ", ".join(words)


def _arg(node: Node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def find_pooled(source: Node) -> EmbeddingBagMatch | str:
    """The embedding bags whose pooled rows, side by side, make ``source`` (the exchange's input)."""
    node, chain = source, []
    while is_reshape(node) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if not is_call(node, aten.cat.default, aten.stack.default) or len(node.users) != 1:
        return "the exchanged tensor is not a stack or cat of pooled rows"
    parts = list(node.args[0])
    dim = _arg(node, 1, "dim", 0)
    if any(not is_call(p, operator.getitem) or p.args[1] != 0 or not is_call(p.args[0], *BAGS) for p in parts):
        return "not every stacked tensor is an embedding_bag's pooled output"
    out_dims = 3 if node.target is aten.stack.default else 2
    if any(len(shape(p) or ()) != 2 for p in parts) or dim % out_dims != 1:
        return "pooled rows stacked along another dim than 1"
    bags = [p.args[0] for p in parts]
    modes = {_arg(b, 4, "mode", 0) for b in bags}
    last = {bool(_arg(b, 7, "include_last_offset", False)) for b in bags}
    if len(modes) > 1 or len(last) > 1:
        return "the embedding bags differ in mode or include_last_offset"
    psw = [_arg(b, 6, "per_sample_weights", None) for b in bags]
    if any(p is None for p in psw) != all(p is None for p in psw):
        return "per_sample_weights on some embedding bags only"
    pads = {_padding(b, 8) for b in bags}
    if len(pads) > 1:
        return "the embedding bags differ in padding_idx"
    if len({shape(p)[-1] for p in parts}) > 1 and node.target is aten.stack.default:
        return "stacked tables of different widths"
    if any(len(p.users) != 1 for p in parts):
        return "a pooled output that other ops read too"
    mode = modes.pop()
    bookkept = [b for b in bags if any(u.args[1] != 0 and u.users for u in b.users)]
    if bookkept and mode == 2:
        return "max pooling whose max_indices a backward reads (training): they are per column"
    return EmbeddingBagMatch(
        bags, parts, node, chain, mode, last.pop(), bookkept, pads.pop(), None if psw[0] is None else psw
    )


def _padding(node: Node, i: int) -> int:
    """The node's padding_idx argument, -1 for none."""
    pad = _arg(node, i, "padding_idx", -1)
    return -1 if pad is None else int(pad)


def bookkeeping_problem(bags: list[Node]) -> str | None:
    """Why the fused op cannot make these bags' bookkeeping (None if it can): aten's CUDA forward promotes mixed
    index and offset dtypes to int64 where its meta function keeps the indices' dtype."""
    for b in bags:
        i, o = val(b.args[1]), val(b.args[2])
        if i is None or o is None or i.dtype != o.dtype:
            return f"a training embedding_bag ({b.name}) with indices and offsets of different dtypes"
    return None


def take_bookkeeping(graph: Graph, fused: Node, bags: list[Node]) -> str | None:
    """The fused op's bookkeeping (outputs 1..3: lists by table) in place of each bag's getitem 1..3 that a backward
    reads (inserted at the insertion point). None when done, else why not (the graph unchanged but for dead nodes,
    which Inductor's dead-code elimination takes)."""
    lists = {k: call(graph, operator.getitem, (fused, k)) for k in (1, 2, 3)}
    swaps = []
    for t, bag in enumerate(bags):
        for u in bag.users:
            if u.args[1] == 0 or not u.users:
                continue
            new = call(graph, operator.getitem, (lists[u.args[1]], t))
            old_val, new_val = val(u), val(new)
            if old_val is None or new_val is None or old_val.shape != new_val.shape or old_val.dtype != new_val.dtype:
                return f"the fused op's bookkeeping of {bag.name} is not shaped as aten's"
            swaps.append((u, new))
    for u, new in swaps:
        u.replace_all_uses_with(new)
    return None


@dataclasses.dataclass
class BagBackwardMatch:
    """The backward's exchanged gradients ``[rows, T * D]``, viewed ``[rows, T, D]`` (``view``), table t's column
    ``select(1, t)`` read by its embedding-bag backward ``backwards[t]`` alone."""

    view: Node
    selects: list[Node]
    backwards: list[Node]
    scale_grad_by_freq: bool
    mode: int
    padding_idx: int = -1
    per_sample_weights: list[Node] | None = None  # the backwards' per-sample weights, one per table, or none
    weights_backwards: list[Node] | None = None  # their gradients' nodes (reading the same column), or none


def find_bag_backwards(wait: Node) -> BagBackwardMatch | str:
    """The tables' embedding-bag backwards that read the exchanged gradients ``wait``, one column of tables each."""
    if len(wait.users) != 1:
        return "the exchanged gradients have several readers"
    (view,) = wait.users
    wshape, vshape = shape(wait), shape(view)
    if not is_reshape(view) or wshape is None or vshape is None or len(wshape) != 2 or len(vshape) != 3:
        return "the exchanged tensor is not viewed as [rows, tables, dim]"
    tables = vshape[1]
    if not isinstance(tables, int) or vshape[0] != wshape[0]:
        return "the exchanged tensor is not viewed as [rows, tables, dim]"
    by_table: dict[int, Node] = {}
    for u in view.users:
        if not is_call(u, aten.select.int) or u.args[1] != 1 or not 1 <= len(u.users) <= 2:
            return "the tables' gradients are not one select(1, t) each"
        by_table[u.args[2] % tables] = u
    if sorted(by_table) != list(range(tables)):
        return "not every table's gradient is read"
    selects = [by_table[t] for t in range(tables)]
    backwards, weights_backwards = [], []
    for sel in selects:
        readers = {("w" if is_call(r, WEIGHTS_BACKWARD) else "b"): r for r in sel.users}
        if len(readers) != len(sel.users) or "b" not in readers:
            return "a table's gradient is not read by an embedding_bag backward (and its per-sample weights')"
        backwards.append(readers["b"])
        if "w" in readers:
            weights_backwards.append(readers["w"])
    if weights_backwards and len(weights_backwards) != tables:
        return "per-sample weights' gradients of some tables only"
    for sel, b in zip(selects, backwards):
        if not is_call(b, BAG_BACKWARD) or b.args[0] is not sel:
            return "a table's gradient is not read by an embedding_bag backward"
        if _arg(b, 9, "sparse", False):
            # The fused op makes them (sparse=True, called directly), but a rewritten node's sparse output breaks
            # Inductor's fake-tensor update after the post-grad passes (it reads every new output's storage).
            return "sparse embedding gradients (Inductor cannot re-derive a rewritten node's sparse output)"
    psw = [_arg(b, 10, "per_sample_weights", None) for b in backwards]
    if any(p is None for p in psw) != all(p is None for p in psw):
        return "per_sample_weights on some embedding bag backwards only"
    flags = {(bool(_arg(b, 7, "scale_grad_by_freq", False)), _arg(b, 8, "mode", 0), _padding(b, 11)) for b in backwards}
    if len(flags) > 1:
        return "the tables' backwards differ in mode, scale_grad_by_freq or padding_idx"
    scale, mode, pad = flags.pop()
    for t, w in enumerate(weights_backwards):  # (grad, weight, indices, offsets, offset2bag, mode, padding_idx)
        b = backwards[t]
        if psw[0] is None or w.args[2] is not b.args[1] or w.args[4] is not b.args[3] or _padding(w, 6) != pad:
            return "a per-sample weights' gradient that does not match its table's embedding_bag backward"
    return BagBackwardMatch(view, selects, backwards, scale, mode, pad, None if psw[0] is None else psw,
                            weights_backwards or None)  # fmt: skip
