"""The two rewrites every pattern is made of: a collective feeding matmuls, or matmuls feeding a collective."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from torch.fx import Graph, Node

from ..config import Config
from .graph_utils import call, erase_dead, shape, static_int
from .matmuls import Consumers, Producers, find_producers


def rewrite_consumers(
    graph: Graph,
    collective: Node,
    target: Any,
    args: tuple[Any, ...],
    result: Node,
    consumers: Consumers,
    layout_nodes: Sequence[Node],
    kwargs: dict[str, Any] | None = None,
    reads_result: bool = True,
) -> Node:
    """Replace ``collective -> ... -> result`` and the consuming matmuls with one fused op.

    The fused op returns ``(result, [mm outputs])``; users of ``result`` that are not fused matmuls (saved
    activations, weight-gradient matmuls) read its first output. With ``reads_result`` False there are none
    (``consumers.others`` is empty: the op was told not to return it), and nothing reads the first output.
    """
    if not reads_result and consumers.others:
        raise ValueError(f"fluxcompile: {result.name} is read by {[n.name for n, _ in consumers.others]}")
    with graph.inserting_before(collective):
        fused = call(graph, target, args, kwargs)
        new_result = call(graph, operator.getitem, (fused, 0)) if reads_result else None
        outs = call(graph, operator.getitem, (fused, 1))
        for i, mm in enumerate(consumers.matmuls):
            mm.node.replace_all_uses_with(call(graph, operator.getitem, (outs, i)))
    if new_result is not None:
        result.replace_all_uses_with(new_result)
    dead = [*(mm.node for mm in consumers.matmuls), *layout_nodes, collective]
    erase_dead(graph, dead if reads_result else [*dead, result])
    return fused


def rewrite_producers(
    graph: Graph,
    collective: Node,
    target: Any,
    args: tuple[Any, ...],
    result: Node,
    producers: Producers,
    layout_nodes: Sequence[Node],
    kwargs: dict[str, Any] | None = None,
) -> Node:
    """Replace the matmuls, the adds and reshapes after them, and ``collective -> ... -> result``."""
    with graph.inserting_before(collective):
        fused = call(graph, target, args, kwargs)
    result.replace_all_uses_with(fused)
    erase_dead(graph, [result, collective, *layout_nodes, *producers.chain, *(t.node for t in producers.terms)])
    return fused


def matmul_sum(source: Node, collective: str, cfg: Config, scaled: bool = False) -> Producers | str:
    """The sum of matmuls that ``source`` (a collective's N-D input) is made of, within the size bounds, or
    why not: the producer side of every matmul -> collective pattern (``scaled``: its terms may be fp8
    ``_scaled_mm``s)."""
    sshape = shape(source)
    producers = find_producers(source, collective, scaled)
    if isinstance(producers, str):
        return producers
    k = (shape(producers.terms[0].a) or (0, 0))[-1]
    return size_reason(cfg, rows(sshape), sshape[-1], k) or producers


def describe_sum(producers: Producers) -> str:
    """'sum of 2 matmul(s) [mm_1, mm_2], with bias' for the report ('scaled matmul(s)' for fp8)."""
    terms = producers.terms
    bias = ", with bias" if producers.bias is not None else ""
    kind = "scaled matmul(s)" if producers.scaling is not None else "matmul(s)"
    return f"sum of {len(terms)} {kind} [{', '.join(t.node.name for t in terms)}]{bias}"


def size_reason(cfg: Config, m: Any, n: Any, k: Any) -> str | None:
    """Why the local matmul is below the configured minimum size, if it is (symbolic sizes pass)."""
    for name, size, bound in (("M", m, cfg.min_m), ("N", n, cfg.min_n), ("K", k, cfg.min_k)):
        size = static_int(size)
        if size is not None and size < bound:
            return f"{name} = {size} < min_{name.lower()} = {bound} ({cfg.env_name('min_' + name.lower())})"
    return None


def rows(shape: Sequence[Any]) -> Any:
    """Product of all but the last dim (the M of the flattened 2-D matmul)."""
    return math.prod(shape[:-1]) if len(shape) > 1 else 1


def disabled_reason(cfg: Config, pattern: str) -> str | None:
    if getattr(cfg, pattern):
        return None
    return f"{pattern} disabled by config ({cfg.env_name(pattern)}=0)"
