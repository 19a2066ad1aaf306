"""vLLM's collectives (``torch.ops.vllm.all_reduce/all_gather/reduce_scatter``) next to matmuls.

vLLM traces its tensor-parallel collectives as its own custom ops, synchronous and out-of-place (no
``wait_tensor``), named by vLLM group (``'tp:0'``), not by c10d group:

  * ``vllm.all_reduce(tensor, group_name)``
  * ``vllm.all_gather(tensor, dim, world_size, group_name)`` — concatenated along ``dim``
  * ``vllm.reduce_scatter(tensor, dim, world_size, group_name)`` — scattered along ``dim``

They are rewritten into the same fused ops as the c10d functional ones; the fused ops get the c10d group
name of the vLLM group's ``device_group``. The handlers are registered into ``HANDLERS`` only when vLLM
is importable (:func:`register`), so fluxcompile itself never imports vLLM.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from .. import ops
from ..config import Config
from . import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from .graph_utils import aten, call, shape, static_int
from .matmuls import find_consumers
from .report import Entry
from .rewrite import describe_sum, disabled_reason, matmul_sum, rewrite_consumers, rewrite_producers, rows, size_reason


def c10d_group_name(vllm_group: str) -> str | None:
    """The c10d group name behind a vLLM group name ('tp:0'), or None if vLLM has no such live group."""
    try:
        from vllm.distributed import parallel_state
    except Exception:
        return None
    ref = parallel_state._groups.get(vllm_group)
    coordinator = ref() if ref is not None else None
    group = getattr(coordinator, "device_group", None)
    return getattr(group, "group_name", None)


def _group(vllm_group: str) -> tuple[str, str | None]:
    """(the report's group label, the c10d group name or None)."""
    name = c10d_group_name(vllm_group)
    return (f"vllm {vllm_group} = c10d {name}" if name else f"vllm {vllm_group}"), name


def _args(node: Node, names: tuple[str, ...]) -> list:
    """The node's arguments by schema position, whether traced positionally or as keywords."""
    return [node.args[i] if i < len(node.args) else node.kwargs[n] for i, n in enumerate(names)]


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else dim


def fuse_all_reduce(graph: Graph, node: Node, cfg: Config) -> Entry:
    source, vgroup = _args(node, ("tensor", "group_name"))
    label, group_name = _group(vgroup)

    def kept(why: str) -> Entry:
        return Entry(node.name, "vllm.all_reduce", label, None, why)

    if why := disabled_reason(cfg, matmul_all_reduce.PATTERN):
        return kept(why)
    if group_name is None:
        return kept(f"no live vLLM group {vgroup!r} (no c10d group to run the fused op on)")
    sshape = shape(source)
    if sshape is None or len(sshape) < 2:
        return kept("all-reduced tensor is not at least 2-D")
    producers = matmul_sum(source, "all_reduce", cfg)
    if isinstance(producers, str):
        return kept(producers)
    terms = producers.terms
    args = ([t.a for t in terms], [t.b for t in terms], producers.bias, list(sshape), "sum", group_name)
    rewrite_producers(graph, node, ops.op(matmul_all_reduce.PATTERN), args, node, producers, [])
    return Entry(node.name, "vllm.all_reduce", label, matmul_all_reduce.PATTERN, describe_sum(producers))


def fuse_reduce_scatter(graph: Graph, node: Node, cfg: Config) -> Entry:
    source, dim, world_size, vgroup = _args(node, ("tensor", "dim", "world_size", "group_name"))
    label, group_name = _group(vgroup)

    def kept(why: str) -> Entry:
        return Entry(node.name, "vllm.reduce_scatter", label, None, why)

    if why := disabled_reason(cfg, matmul_reduce_scatter.PATTERN):
        return kept(why)
    if group_name is None:
        return kept(f"no live vLLM group {vgroup!r} (no c10d group to run the fused op on)")
    sshape = shape(source)
    if sshape is None or len(sshape) < 2:
        return kept("reduce-scattered tensor is not at least 2-D")
    dim = _norm_dim(dim, len(sshape))
    if dim == len(sshape) - 1:
        return kept("scatter dim is the matmul's output-feature (last) dim")
    producers = matmul_sum(source, "reduce_scatter", cfg)
    if isinstance(producers, str):
        return kept(producers)
    terms = producers.terms
    args = (
        [t.a for t in terms],
        [t.b for t in terms],
        producers.bias,
        list(sshape),
        dim,
        "sum",
        world_size,
        group_name,
    )
    rewrite_producers(graph, node, ops.op(matmul_reduce_scatter.PATTERN), args, node, producers, [])
    return Entry(
        node.name,
        "vllm.reduce_scatter",
        label,
        matmul_reduce_scatter.PATTERN,
        f"scatter dim {dim}, {describe_sum(producers)}",
    )


def fuse_all_gather(graph: Graph, node: Node, cfg: Config) -> Entry:
    shard, dim, world_size, vgroup = _args(node, ("tensor", "dim", "world_size", "group_name"))
    label, group_name = _group(vgroup)

    def kept(why: str) -> Entry:
        return Entry(node.name, "vllm.all_gather", label, None, why)

    if why := disabled_reason(cfg, all_gather_matmul.PATTERN):
        return kept(why)
    if group_name is None:
        return kept(f"no live vLLM group {vgroup!r} (no c10d group to run the fused op on)")
    gathered, layout = node, []
    gshape = shape(gathered)
    if gshape is None or len(gshape) < 2:
        return kept("gathered tensor is not at least 2-D")
    dim = _norm_dim(dim, len(gshape))
    perm = all_gather_matmul.leading_permute(gathered)
    shard_perm = None
    if perm is not None:
        shard_perm = [d % len(gshape) for d in perm.args[1]]
        gathered, layout = perm, [perm]
        dim = shard_perm.index(dim)
        gshape = shape(gathered)
    if dim == len(gshape) - 1:
        return kept("gather dim is the matmul's contraction (last) dim")
    consumers = find_consumers(gathered)
    if not consumers.matmuls:
        reasons = "; ".join(r for _, r in consumers.others) or "no users"
        return kept(f"no mm consumes the gathered tensor as its left operand ({reasons})")
    m, k = rows(gshape), gshape[-1]
    for mm in consumers.matmuls:
        if why := size_reason(cfg, m, (shape(mm.b) or (0, 0))[-1], k):
            return kept(why)
    if shard_perm is not None:
        with graph.inserting_before(node):
            shard = call(graph, aten.permute.default, (shard, shard_perm))
    args = (
        shard,
        [mm.b for mm in consumers.matmuls],
        [mm.bias for mm in consumers.matmuls],
        dim,
        world_size,
        group_name,
    )
    reads_gathered = bool(consumers.others)  # else the fused op need not return it (return_A False)
    rewrite_consumers(
        graph, node, ops.op(all_gather_matmul.PATTERN), args, gathered, consumers, layout,
        None if reads_gathered else {"return_A": False}, reads_result=reads_gathered,
    )  # fmt: skip
    mms = ", ".join(mm.node.name for mm in consumers.matmuls)
    others = f"; gathered tensor also kept for {len(consumers.others)} other user(s)" if consumers.others else ""
    return Entry(
        node.name,
        "vllm.all_gather",
        label,
        all_gather_matmul.PATTERN,
        f"gather dim {dim}, {len(consumers.matmuls)} matmul(s) [{mms}], M={static_int(m)}{others}",
    )


def register(handlers: dict) -> bool:
    """Add the vLLM handlers to ``handlers`` (the pass's HANDLERS) if vLLM's ops are registered."""
    import torch

    try:
        import vllm.distributed.parallel_state  # noqa: F401  (registers torch.ops.vllm.*)

        vllm_ops = torch.ops.vllm
        targets = {
            vllm_ops.all_reduce.default: fuse_all_reduce,
            vllm_ops.all_gather.default: fuse_all_gather,
            vllm_ops.reduce_scatter.default: fuse_reduce_scatter,
        }
    except Exception:
        return False
    handlers.update(targets)
    return True
