"""The post-grad rewrite pass: every collective next to a matmul becomes a fused op.

Installed as Inductor's ``post_grad_custom_pre_pass`` (by the backend or by ``fluxcompile.enable()``), so it
sees the graph after AOTAutograd (forward and backward separately) and before Inductor's own post-grad
passes and lowering. Its ``uuid()`` covers fluxcompile's version, its config and the source of the pass, so
Inductor's FX graph cache stays on and never reuses a graph rewritten under other settings.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor import custom_graph_pass
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from .. import ops
from ..config import Config, config
from ..version import __version__
from . import all_gather_matmul, all_to_all, matmul_all_reduce, matmul_reduce_scatter
from .graph_utils import c10d, op_name
from .report import Entry, GraphReport, new_graph_report, publish

Handler = Callable[[Graph, Node, Config], Entry]

HANDLERS: dict[object, Handler] = {
    c10d.all_gather_into_tensor.default: all_gather_matmul.fuse,
    c10d.reduce_scatter_tensor.default: matmul_reduce_scatter.fuse,
    c10d.all_reduce.default: matmul_all_reduce.fuse,
    c10d.all_to_all_single.default: all_to_all.fuse,
}


def _is_collective(node: Node) -> bool:
    ns = getattr(node.target, "namespace", None)
    return ns in ("_c10d_functional", "c10d", "_dtensor") and node.target is not c10d.wait_tensor.default


def _group_of(node: Node) -> str:
    strings = [a for a in node.args if isinstance(a, str)]
    return strings[-1] if strings else "?"


def _kind(graph: Graph, is_inference: bool | None) -> str:
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return "backward"
    return "inference" if is_inference else "forward"


def _merge_waits(graph: Graph) -> bool:
    """One ``wait_tensor`` per collective: where a collective's only users are several waits (torch 2.15's
    AOTAutograd keeps the backward's wait of a gather it moved into the forward beside the forward's own), the
    later waits' users take the first one. A wait returns its collective's result, so they are the same tensor."""
    order = {n: i for i, n in enumerate(graph.nodes)}  # erasing waits keeps the others' relative order
    merged = False
    for node in list(graph.nodes):
        waits = list(node.users)
        if len(waits) > 1 and all(w.target is c10d.wait_tensor.default for w in waits):
            first, *later = sorted(waits, key=order.__getitem__)
            for w in later:
                w.replace_all_uses_with(first)
                graph.erase_node(w)
            merged = True
    return merged


def rewrite_graph(graph: Graph, cfg: Config | None = None, is_inference: bool | None = None) -> GraphReport:
    """Fuse what can be fused in ``graph`` (in place) and return the report of its collectives."""
    cfg = cfg or config
    report = new_graph_report(_kind(graph, is_inference))
    changed = _merge_waits(graph)
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or node.op != "call_function":
            continue
        handler = HANDLERS.get(node.target)
        if handler is not None:
            try:
                entry = handler(graph, node, cfg)
            except Exception as e:  # a bug in a rewrite must not pass silently
                raise RuntimeError(f"fluxcompile: rewriting {node.name} ({op_name(node)}) failed: {e}") from e
        elif _is_collective(node):
            entry = Entry(
                node.name, op_name(node).split(".")[-1], _group_of(node), None, f"no fused op for {op_name(node)}"
            )
        else:
            continue
        report.entries.append(entry)
        changed |= entry.fused
    if changed:
        # A fused op sits where its collective was; weights defined later move it down, in order.
        stable_topological_sort(graph)
        graph.lint()
    publish(report, cfg.log_report)
    return report


_PassBase = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", custom_graph_pass.CustomGraphPass)
_SOURCES = tuple(
    [
        *sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.py"))),
        os.path.join(os.path.dirname(os.path.dirname(__file__)), "ops.py"),
    ]
)


class FluxcompilePass(_PassBase):  # type: ignore[misc,valid-type]
    """The pass object Inductor calls; ``previous`` (a user's own pre-pass or list of them) runs first."""

    def __init__(self, previous: Any = None) -> None:
        # Inductor takes one pass or (newer torch) a list of them.
        passes = previous if isinstance(previous, (list, tuple)) else (previous,)
        self.previous: tuple[Any, ...] = tuple(p for p in passes if p is not None)

    def __call__(self, graph: Graph, is_inference: bool | None = None) -> None:
        aware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", ())
        for p in self.previous:
            if aware and isinstance(p, aware):
                p(graph, is_inference=is_inference)
            else:
                p(graph)
        rewrite_graph(graph, config, is_inference)

    def uuid(self) -> bytes | None:
        prev = []
        for p in self.previous:
            u = p.uuid() if hasattr(p, "uuid") else None
            if u is None:
                return None  # a user pass without a uuid: no cache, as Inductor does for it alone
            prev.append(repr(u))
        extra = f"{__version__}|{config.fingerprint()}|{cuda_implementations()}|{registered_choices()}|{'|'.join(prev)}"
        return custom_graph_pass.get_hash_for_files(_SOURCES, extra)


def registered_choices() -> str:
    """Every registered choice by name (lowerings/choices.py, where the lowerings loaded; else none): a graph
    compiled against a choice that is gone or renamed is never replayed from Inductor's cache."""
    choices = sys.modules.get("fluxcompile.lowerings.choices")
    return choices.registered_names() if choices is not None else ""


def cuda_implementations() -> str:
    """The fused ops that have a CUDA implementation registered. Generated code calls those implementations
    directly (lowerings/direct_calls.py); where the lowerings failed to load there are none, and a graph
    compiled elsewhere must not be replayed from Inductor's cache, so the pass's uuid covers this."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return ",".join(op for op in ops.FUSED_OPS if has(f"fluxcompile::{op}", "CUDA"))
