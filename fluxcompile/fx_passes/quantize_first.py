"""Row-wise fp8 quantization moved before an all-gather: ``quantize(gather(x))`` becomes ``gather(quantize(x))``.

torchao's row-wise float8 recipe with PyTorch's plain TP styles gathers the high-precision activations and then
quantizes each row (its amax over the row, a power-of-two scale, the clamped fp8 cast) for every scaled matmul that
reads them. Every step of that is row-local: a row's fp8 values and its scale depend on that row alone. So the
same ops applied to this rank's shard, before the gather, give bit for bit the same rows and scales, and the fused
op gathers fp8 rows with their scales (``all_gather_matmul``'s row-wise ``A_scale``): half the bytes of a bf16
gather. The rewrite applies where nothing else reads the gathered high-precision tensor (an inference or prefill
graph: a training forward saves it for the weight gradients) and every scaled matmul quantizes it alike.

Row-local here: element-wise ops whose other operands are Python scalars or values of the same subgraph, reductions
over the last dim that keep it (``amax``, ``amin``, ``sum``, ``mean``), and reshapes that keep the last dim. The
gathered rows must be rank-major (no leading dims before the gather dim), so the shard's rows are one block of
every such regrouping: on the shard a reshape takes 1/world of its first dim beyond leading 1s.
"""

from __future__ import annotations

import dataclasses
import math

from torch.fx import Graph, Node

from .graph_utils import aten, call, is_call, prims, shape
from .matmuls import SCALED_MM, same_value, scaled_mm_args

_ELEMENTWISE = {
    aten.abs.default, aten.neg.default, aten.reciprocal.default, aten.log2.default, aten.floor.default,
    aten.exp2.default, aten.sqrt.default, aten.rsqrt.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.clamp.default, aten.pow.Tensor_Scalar, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor,
    aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, prims.convert_element_type.default,
}  # fmt: skip
_REDUCTIONS = {aten.amax.default, aten.amin.default, aten.sum.dim_IntList, aten.mean.dim}
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


@dataclasses.dataclass
class QuantizedGather:
    """The scaled matmuls reading ``gathered`` through one row-wise quantization: ``data`` (the fp8 rows, N-D, as
    the gathered tensor's shape) and ``scale`` (their scale as ``_scaled_mm`` takes it, ``[M, 1]``) are computed
    from ``gathered`` by ``nodes`` (in graph order)."""

    consumers: list[Node]
    data: Node
    scale: Node
    nodes: list[Node]
    gather_dim: int  # the dim of the fp8 rows (data's shape before any reshape) to gather the shard's along


def _row_local(node: Node, ndim: int) -> bool:
    if is_call(node, *_ELEMENTWISE):
        return True
    if is_call(node, *_REDUCTIONS):
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return bool(keep) and list(dims or []) in ([-1], [ndim - 1])
    if is_call(node, *_RESHAPES):  # regrouping the rows, each row kept whole
        target, src = list(node.args[1]), shape(node.args[0])
        return src is not None and len(target) >= 2 and target[-1] == src[-1]
    return False


def _closure(gathered: Node, roots: list[Node]) -> list[Node] | str:
    """The nodes that ``roots`` are computed from, up to ``gathered``, or why they are not all row-local."""
    ndim = len(shape(gathered) or ())
    found: dict[Node, None] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is gathered or node in found:
            continue
        if not _row_local(node, ndim):
            return f"{node.name} ({node.target}) is not row-local"
        found[node] = None
        for a in node.all_input_nodes:
            if a is not gathered and gathered not in _ancestors(a):
                return f"{node.name} reads {a.name}, which is not computed from the gathered rows"
            stack.append(a)
    order = {n: i for i, n in enumerate(gathered.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _ancestors(node: Node, limit: int = 64) -> set[Node]:
    seen, stack = {node}, [node]
    while stack and len(seen) <= limit:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _unreshaped(node: Node) -> Node:
    while is_call(node, *_RESHAPES):
        node = node.args[0]
    return node


def find(gathered: Node, gather_dim: int) -> QuantizedGather | str:
    """The row-wise quantization of ``gathered`` (gathered along ``gather_dim``) by every scaled matmul that reads
    it, or why it cannot move."""
    consumers: list[Node] = []
    stack, seen = [gathered], {gathered}
    while stack:
        for user in stack.pop().users:
            if is_call(user, SCALED_MM):
                if user not in consumers:
                    consumers.append(user)
            elif user not in seen:
                seen.add(user)
                stack.append(user)
    if not consumers:
        return "no scaled matmul reads the gathered tensor"
    first = scaled_mm_args(consumers[0])
    data, scale = first["self"], first["scale_a"]
    for c in consumers[1:]:
        a = scaled_mm_args(c)
        if not (same_value(a["self"], data, depth=32) and same_value(a["scale_a"], scale, depth=32)):
            return f"{c.name} quantizes the gathered rows differently from {consumers[0].name}"
    roots = [scaled_mm_args(c)[k] for c in consumers for k in ("self", "scale_a")]
    nodes = _closure(gathered, roots)
    if isinstance(nodes, str):
        return nodes
    allowed = set(nodes) | set(consumers)
    for n in [gathered, *nodes]:
        others = [u for u in n.users if u not in allowed]
        if others:
            return f"{others[0].name} also reads {n.name} (the gathered high-precision rows are needed as they are)"
    if any(scaled_mm_args(c)["scale_result"] is not None for c in consumers):
        return "a scaled matmul with a result scale"
    core, gshape = _unreshaped(data), shape(gathered)
    if core is gathered:
        return "the scaled matmul reads the gathered tensor itself"
    if shape(core) == gshape and not any(is_call(n, *_RESHAPES) and -1 not in list(n.args[1]) for n in nodes):
        dim = gather_dim  # quantized in the gathered shape: the shard's, gathered as the original was
    elif math.prod(gshape[:gather_dim]) != 1:
        return "the quantized rows are regrouped, and the gathered rows interleave the ranks (leading dims > 1)"
    else:
        cshape = list(shape(core) or ())
        dim = next((i for i, n in enumerate(cshape[:-1]) if n != 1), None)
        if dim is None:
            return "the quantized rows are one row"
    sshape = shape(scale)
    if sshape is None or len(sshape) != 2 or sshape[-1] != 1:
        return "the A scale is not one per row"
    return QuantizedGather(consumers, data, scale, nodes, dim)


def quantize_shard(graph: Graph, q: QuantizedGather, gathered: Node, shard: Node, world: int) -> tuple[Node, Node]:
    """The quantization's nodes applied to ``shard`` (inserted at the insertion point): this rank's fp8 rows, which
    gathered along ``q.gather_dim`` are the quantized rows of the original graph, and their scales
    (``[*rows.shape[:-1], 1]``)."""
    env: dict[Node, Node] = {gathered: shard}
    # Only what the fused op reads: the other scaled matmuls' copies of the quantization are alike (find checked).
    needed = _closure(gathered, [_unreshaped(q.data), q.scale])
    for n in needed:
        args = tuple(env.get(a, a) if isinstance(a, Node) else a for a in n.args)
        if is_call(n, *_RESHAPES):  # the shard's rows are a rank-major block: 1/world of the first dim beyond 1s
            target = list(n.args[1])
            if -1 not in target:
                i = next(i for i, d in enumerate(target[:-1]) if d != 1)
                target[i] //= world
            args = (args[0], target)
        kwargs = {k: env.get(v, v) if isinstance(v, Node) else v for k, v in n.kwargs.items()}
        env[n] = call(graph, n.target, args, kwargs)
    data = env[_unreshaped(q.data)]
    scale = call(graph, aten.reshape.default, (env[q.scale], [*shape(data)[:-1], 1]))
    return data, scale
