"""embedding_bag (this rank's tables) -> all_to_all_single => fluxcompile.embedding_bag_all_to_all.

DLRM's model-parallel embeddings: every rank pools the global batch for its own tables, stacks the pooled rows
(``stack(dim=1)`` or ``cat(dim=1)``: ``[B, T * D]`` either way) and sends each sample's row to the rank that owns
the sample. Matched where the pooled output is all that is read of every ``embedding_bag``: a training graph
saves the bag bookkeeping (``offset2bag``, ``bag_size``) for the backward, which the fused op does not produce,
so there the original ops stay and the report says so.
"""

from __future__ import annotations

import dataclasses
import operator

from torch.fx import Node

from .graph_utils import aten, is_call, is_reshape, shape

BAGS = (aten._embedding_bag.default, aten._embedding_bag_forward_only.default)


@dataclasses.dataclass
class EmbeddingBagMatch:
    bags: list[Node]  # the _embedding_bag nodes, in column order
    pooled: list[Node]  # their getitem 0
    stacked: Node  # the stack / cat
    chain: list[Node]  # reshapes between the stack and the exchange's input
    mode: int
    include_last_offset: bool


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
    for b in bags:
        if _arg(b, 6, "per_sample_weights", None) is not None:
            return "an embedding_bag with per_sample_weights"
        if _arg(b, 8, "padding_idx", -1) not in (None, -1):
            return "an embedding_bag with a padding_idx"
        if any(u.args[1] != 0 and u.users for u in b.users):
            return "the embedding_bag's offset2bag/bag_size are saved for its backward (training)"
    if len({shape(p)[-1] for p in parts}) > 1 and node.target is aten.stack.default:
        return "stacked tables of different widths"
    if any(len(p.users) != 1 for p in parts):
        return "a pooled output that other ops read too"
    return EmbeddingBagMatch(bags, parts, node, chain, modes.pop(), last.pop())
