"""Small helpers over post-grad FX graphs: recognizing ops, following data-preserving views, node metadata."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
prims = torch.ops.prims

# Ops whose result holds the same elements in the same row-major logical order: a chain of them is one
# reshape, which is all the fused ops' contract needs (``P.reshape(out_shape)``, ``A.reshape(-1, K)``).
RESHAPES = {
    aten.reshape.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.alias.default,
    aten.clone.default,
}


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def val(node: Node) -> Any:
    """The node's example value (a FakeTensor in post-grad graphs), or None."""
    return node.meta.get("val") if isinstance(node, Node) else None


def shape(node: Node) -> tuple[Any, ...] | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Node) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def op_name(node: Node) -> str:
    """A short readable name of what a node does: 'aten.relu', 'getitem', 'output'."""
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return "getitem"
    name = getattr(node.target, "name", None)
    if callable(name):
        return name().replace("::", ".").removesuffix(".default")
    return getattr(node.target, "__name__", str(node.target))


def is_same_dtype_convert(node: Node) -> bool:
    return (
        is_call(node, prims.convert_element_type.default)
        and isinstance(node.args[0], Node)
        and dtype(node.args[0]) is not None
        and dtype(node.args[0]) == node.args[1]
    )


def is_reshape(node: Node) -> bool:
    """A data-preserving op: a reshape/view kind, or a convert_element_type to the same dtype."""
    if is_call(node, aten.clone.default) and node.kwargs.get("memory_format") not in (
        None,
        torch.contiguous_format,
        torch.preserve_format,
    ):
        return False
    return (is_call(node, *RESHAPES) and isinstance(node.args[0], Node)) or is_same_dtype_convert(node)


def is_dtype_change(node: Node) -> bool:
    return is_call(node, prims.convert_element_type.default) and not is_same_dtype_convert(node)


def single_wait(collective: Node) -> Node | None:
    """The wait_tensor that completes an async functional collective, if it is the only user."""
    users = list(collective.users)
    if len(users) == 1 and is_call(users[0], c10d.wait_tensor.default):
        return users[0]
    return None


def static_int(x: Any) -> int | None:
    """x as an int when it is one (or a SymInt with a known value), else None."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        try:
            return int(x.node.maybe_as_int()) if x.node.maybe_as_int() is not None else None
        except Exception:
            return None
    return None


def group_size_of(group_name: str) -> int | None:
    try:
        from ..symm_mem.groups import group_size

        return group_size(group_name)
    except Exception:
        return None


def set_fake_meta(node: Node) -> None:
    """Compute node.meta['val'] by running its target on its inputs' fake values."""
    from torch._guards import detect_fake_mode

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    fake_inputs = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(fake_inputs)
    if mode is None:
        node.meta["val"] = node.target(*args, **kwargs)
    else:
        with mode:
            node.meta["val"] = node.target(*args, **kwargs)


def symint_nodes(graph: Graph, tree: Any) -> Any:
    """``tree`` with every symbolic integer leaf replaced by the FX node that computes it at the insertion point,
    so a new node's arguments name the values they depend on instead of holding raw SymInts (which FX warns
    about). A SymInt with a known value becomes that int; the others are rebuilt from the nodes that define their
    symbols (``Graph.materialize_symints``, or, where its bindings do not name a symbol, the first node whose value
    is that symbol). Where a symbol has no defining node, the SymInt stays as it is (Inductor reads it from the
    arguments either way)."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    if not any(isinstance(v, torch.SymInt) for v in leaves):
        return tree
    for i, v in enumerate(leaves):
        if isinstance(v, torch.SymInt):
            known = static_int(v)
            leaves[i] = known if known is not None else _symint_node(graph, v)
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _symint_node(graph: Graph, value: torch.SymInt) -> Node | torch.SymInt:
    """The node computing ``value`` at the insertion point (``symint_nodes``), or ``value`` where none is found."""
    if hasattr(graph, "materialize_symints"):
        try:
            return graph.materialize_symints([value])[0]
        except AssertionError:  # a symbol its bindings do not name (one renamed by the shape environment)
            pass
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    expr = value.node.expr
    defined: dict[Any, Node] = {}
    for node in graph.nodes:  # a symbol's first node precedes every use of a size made from it
        v = val(node)
        if isinstance(v, torch.SymInt) and v.node.expr in expr.free_symbols:
            defined.setdefault(v.node.expr, node)
    if set(defined) != expr.free_symbols:
        return value
    before = set(graph.nodes)
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)
    env = {sym: torch.fx.Proxy(node, tracer) for sym, node in defined.items()}
    result = sympy_interp(PythonReferenceAnalysis, env, expr)
    for node in graph.nodes:
        if node not in before:
            set_fake_meta(node)
    return result.node if isinstance(result, torch.fx.Proxy) else result


def call(graph: Graph, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Node:
    """A ``call_function`` node of ``target`` at the insertion point, with its fake value; symbolic sizes in the
    arguments become the nodes that compute them (``symint_nodes``)."""
    args, kwargs = symint_nodes(graph, (tuple(args), dict(kwargs or {})))
    node = graph.call_function(target, args, kwargs)
    set_fake_meta(node)
    return node


def erase_dead(graph: Graph, nodes: Iterable[Node]) -> None:
    """Erase the given nodes once they have no users, walking up through reshapes that become dead too."""
    pending = list(nodes)
    erased: set[Node] = set()
    progress = True
    while pending and progress:
        progress = False
        for node in list(pending):
            if node in erased:
                pending.remove(node)
                continue
            if node.users:
                continue
            inputs = [a for a in node.all_input_nodes]
            graph.erase_node(node)
            erased.add(node)
            pending.remove(node)
            progress = True
            # A reshape feeding only the erased node is dead now as well.
            pending.extend(a for a in inputs if a not in erased and is_reshape(a) and not a.users)
    leftover = [n for n in pending if n not in erased and (n.op != "call_function" or not is_reshape(n))]
    if leftover:
        raise RuntimeError(f"fluxcompile: rewrite left nodes that still have users: {leftover}")
