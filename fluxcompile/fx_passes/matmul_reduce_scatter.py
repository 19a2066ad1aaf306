"""mm (or a sum of mms) -> reduce_scatter => fluxcompile.matmul_reduce_scatter.

Matched forms of the collective's input:
  * scatter on dim 0: the (reshaped) matmul output itself;
  * scatter on dim d > 0: ``cat(split(x, rows, dim=d), dim=0)`` — what DTensor emits for a
    sequence-parallel ``RowwiseParallel(output_layouts=Shard(1))`` — with the chunks in order;
  * scatter on dim d = perm[0]: ``permute(x, perm)`` (made contiguous by a ``clone``) scattered on dim 0, its
    result permuted back by the graph — what torchtitan's ``spmd_types`` backend emits; the fused op's result is
    permuted by ``perm`` in place of the collective's;
and ``x`` made of ``mm``/``addmm`` outputs through reshapes and ``add`` (the backward's ``add(mm, mm)``), or of fp8
``_scaled_mm`` outputs scaled alike (tensor-wise or row-wise: the scales stay with the partial).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Graph, Node

from .. import ops
from ..config import Config
from .decide import decide
from .graph_utils import aten, c10d, call, is_call, shape, single_wait
from .matmuls import Producers
from .report import Entry
from .rewrite import describe_sum, disabled_reason, matmul_sum, rewrite_producers

PATTERN = "matmul_reduce_scatter"


@dataclasses.dataclass
class MatmulReduceScatterMatch:
    collective: Node
    wait: Node
    source: Node  # the N-D tensor whose scatter dim is reduce-scattered
    layout_nodes: list[Node]  # cat, getitems, split of the dim>0 form
    scatter_dim: int
    reduce_op: str
    group_size: int
    group_name: str
    producers: Producers
    result_perm: list[int] | None = None  # the permuted form's perm, applied to the fused op's result

    def fused_args(self) -> tuple:
        terms = self.producers.terms
        return (
            [t.a for t in terms],
            [t.b for t in terms],
            self.producers.bias,
            list(shape(self.source)),
            self.scatter_dim,
            self.reduce_op,
            self.group_size,
            self.group_name,
        )


def permuted_form(inp: Node) -> tuple[Node, list[int], list[Node]] | None:
    """(tensor being permuted, perm, nodes between) when ``inp`` is ``x`` permuted (and made contiguous) alone."""
    layout = []
    if is_call(inp, aten.clone.default) and len(inp.users) == 1 and set(inp.kwargs) <= {"memory_format"}:
        layout.append(inp)
        inp = inp.args[0]
    if not (is_call(inp, aten.permute.default) and len(inp.users) == 1):
        return None
    ndim = len(shape(inp) or ())
    perm = [d % ndim for d in inp.args[1]] if ndim else []
    if ndim < 2 or perm == list(range(ndim)):
        return None
    return inp.args[0], perm, [*layout, inp]


def scattered_form(inp: Node, group_size: int) -> tuple[Node, int, list[Node]] | str:
    """(tensor being scattered, scatter dim, nodes between) for the dim-0 and split/cat forms."""
    if not (is_call(inp, aten.cat.default) and len(inp.users) == 1):
        return inp, 0, []
    cat_dim = inp.args[1] if len(inp.args) > 1 else inp.kwargs.get("dim", 0)
    parts = list(inp.args[0])
    if cat_dim != 0 or not all(is_call(p, operator.getitem) for p in parts):
        return inp, 0, []
    split = parts[0].args[0]
    if not is_call(split, aten.split.Tensor, aten.split_with_sizes.default):
        return inp, 0, []
    if any(p.args[0] is not split or len(p.users) != 1 for p in parts) or len(split.users) != len(parts):
        return inp, 0, []
    if len(parts) != group_size:
        return f"input split into {len(parts)} chunks but the group has {group_size} ranks"
    if [p.args[1] for p in parts] != list(range(len(parts))):
        return "cat reorders the chunks before the reduce_scatter"
    source = split.args[0]
    ndim = len(shape(source) or ())
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % max(ndim, 1)
    return source, dim, [inp, *parts, split]


def saved_and_waited(collective: Node) -> Node | None:
    """The collective's one wait_tensor when its other users are the graph's output alone: the un-waited result
    saved for the backward, as activation checkpointing's policies that save collectives' outputs do."""
    waits = [u for u in collective.users if is_call(u, c10d.wait_tensor.default)]
    others = [u for u in collective.users if u.op != "output" and u not in waits]
    return waits[0] if len(waits) == 1 and not others else None


def match(node: Node, cfg: Config) -> MatmulReduceScatterMatch | str:
    if why := disabled_reason(cfg, PATTERN):
        return why
    inp, reduce_op, group_size, group_name = node.args[:4]
    wait = single_wait(node) or saved_and_waited(node)
    if wait is None:
        return "the reduce_scatter is not waited on by a single wait_tensor"
    permuted = permuted_form(inp)
    if permuted is not None:
        source, perm, layout = permuted
        form: tuple[Node, int, list[Node]] | str = (source, perm[0], layout)
    else:
        perm, form = None, scattered_form(inp, group_size)
    if isinstance(form, str):
        return form
    source, dim, layout = form
    sshape = shape(source)
    if sshape is None or len(sshape) < 2:
        return "reduce-scattered tensor is not at least 2-D"
    producers = matmul_sum(source, "reduce_scatter", cfg, scaled=True)
    if isinstance(producers, str):
        return producers
    return MatmulReduceScatterMatch(node, wait, source, layout, dim, reduce_op, group_size, group_name, producers, perm)


def fuse(graph: Graph, node: Node, cfg: Config) -> Entry:
    found = match(node, cfg)
    group = str(node.args[3])
    if isinstance(found, str):
        return Entry(node.name, "reduce_scatter_tensor", group, None, found)
    scaling = found.producers.scaling_kwargs()
    decision = decide(PATTERN, found.fused_args(), found.group_name, cfg, scaling=scaling)
    if decision.keep:
        return Entry(node.name, "reduce_scatter_tensor", group, None, decision.keep)
    # The saved result (wait_tensor returns the tensor it is given) is the waited one.
    node.replace_all_uses_with(found.wait, delete_user_cb=lambda user: user is not found.wait)
    fused = rewrite_producers(
        graph, node, ops.op(PATTERN), found.fused_args(), found.wait, found.producers, found.layout_nodes,
        {**scaling, **decision.kwargs()},
    )  # fmt: skip
    if found.result_perm is not None:
        # Scattering permute(x, perm) on dim 0 gives x scattered on dim perm[0], permuted by perm; made contiguous
        # as the collective's result was (a copy of the scattered part only, where the graph copied all of x).
        with graph.inserting_after(fused):
            permuted = call(graph, aten.permute.default, (fused, found.result_perm))
        with graph.inserting_after(permuted):
            result = call(graph, aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
        fused.replace_all_uses_with(result, delete_user_cb=lambda user: user is not permuted)
    permuted_note = f" (of the input permuted by {found.result_perm})" if found.result_perm is not None else ""
    return Entry(
        node.name,
        "reduce_scatter_tensor",
        group,
        PATTERN,
        f"scatter dim {found.scatter_dim}{permuted_note}, {describe_sum(found.producers)}"
        + (f"; {decision.note}" if decision.note else ""),
    )
