"""The all-gather's input produced straight into symmetric memory.

Inductor lowers ``fluxcompile.all_gather_matmul`` as it lowers any custom op without a lowering of its own, into a
``FallbackKernel`` whose wrapper line lowerings/direct_calls.py writes, with one step before it: where the shard A
is a buffer whose allocation Inductor controls (its producer is a kernel Inductor generates), on CUDA, with a
static number of elements, and not also an output of the graph, that buffer becomes a symmetric-memory comm buffer
(``torch._inductor.comm_lowering.realize_as_comm_buffer``), as PyTorch's async-TP lowering does for its own ops.
The generated code then allocates it with ``empty_strided_p2p`` (one persistent allocation, the same memory at
every call), its producer writes into it, and a choice that reads the peers' shards pulls them from there
(all_gather_matmul/async_input_mm.py) instead of publishing a copy of its own shard first.

Left as they are, with the op's choices copying or pushing the shard as before:
* symbolic sizes: a persistent allocation has one size;
* buffers Inductor does not allocate (graph inputs, other ops' outputs): moving them would take a copy;
* buffers that are also outputs of the graph: a persistent buffer may not leave it, so Inductor would copy it out.

The op's node is created exactly as Inductor's implicit fallback creates it: the same realized inputs, the same
layout constraint (decided here as the implicit fallback decides it), the same ``FallbackKernel``. Symmetric
memory is enabled for the group while compiling, before any generated code allocates. Each decision is logged on
``fluxcompile.comm_buffers`` at INFO. Where this torch lacks a name used here, nothing is registered and the
implicit fallback stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch.fx import Node
from torch.fx.operator_schemas import normalize_function

from ..symm_mem.tensors import can_tell_symmetric
from ..symm_mem.topology import no_peer_access
from ..symm_mem.workspace import enable_group

log = logging.getLogger("fluxcompile.comm_buffers")

OP_NAME = "all_gather_matmul"
_registered: list[torch._ops.OpOverload] = []


def op() -> torch._ops.OpOverload:
    return getattr(torch.ops.fluxcompile, OP_NAME).default


def group_name_of(overload: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The ``group_name`` argument of a call of ``overload``, wherever its schema puts it (None: not bound)."""
    if "group_name" in kwargs:
        return kwargs["group_name"]
    bound = normalize_function(overload, tuple(args), kwargs, normalize_to_only_use_kwargs=True)
    return None if bound is None else bound.kwargs.get("group_name")


def is_static(numel: Any) -> bool:
    """Whether an element count from Inductor's IR (an int or a sympy expression) has no symbols."""
    if isinstance(numel, int):
        return True
    return isinstance(numel, sympy.Expr) and not numel.free_symbols


def escapes(node: Node) -> bool:
    """Whether the storage of ``node``, followed through view ops back to its base and on to every view of that
    base, is an output of its graph."""
    base = node
    while _is_view(base) and isinstance(base.args[0], Node):
        base = base.args[0]
    todo, seen = [base], {base}
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                return True
            if _is_view(user) and user.args[0] is n and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def _is_view(node: Node) -> bool:
    return node.op == "call_function" and bool(node.args) and bool(getattr(node.target, "is_view", False))


def why_not_symm_mem(A: Any, node: Node | None) -> str | None:
    """Why the shard ``A`` (an IR node; ``node``: its FX node) stays where Inductor puts it, or None where it is
    realized in symmetric memory. The device comes last: a CPU compile exercises every other check."""
    from torch._inductor import ir
    from torch._inductor.comm_lowering import can_realize_as_comm_buffer

    if not isinstance(A, ir.TensorBox):
        return f"the shard is a {type(A).__name__}, not a tensor of the graph"
    if not is_static(A.get_numel()):
        return "symbolic sizes: the shard is copied, not realized in symmetric memory"
    if not can_realize_as_comm_buffer(A, ir.CommBufferType.SYMM_MEM):
        return "Inductor does not allocate the shard's buffer (a graph input or another op's output)"
    if node is not None and escapes(node):
        return "the shard's buffer is also an output of the graph (Inductor would copy it out)"
    device = A.get_device()
    if device is None or device.type != "cuda":
        return f"the shard is on {device}, not on CUDA"
    if not can_tell_symmetric():
        return "this torch cannot tell a symmetric tensor (no is_symm_mem_tensor): no choice would read it there"
    return None


def realize_shard(A: Any, node: Node | None, group_name: str | None) -> bool:
    """Realize the shard's buffer in symmetric memory where ``why_not_symm_mem`` allows; returns whether it did."""
    from torch._inductor import ir
    from torch._inductor.comm_lowering import realize_as_comm_buffer

    why = "no group_name argument" if not isinstance(group_name, str) else why_not_symm_mem(A, node)
    if why is None:
        why = no_peer_access(group_name)
    if why is None:
        try:
            enable_group(group_name)  # before the generated code allocates with the group's symmetric memory
            realize_as_comm_buffer(A, ir.CommBufferType.SYMM_MEM, group_name)
        except Exception as e:  # e.g. a view whose base has symbolic sizes, or no symmetric memory here
            why = f"{type(e).__name__}: {e}"
    name = node.name if node is not None else "?"
    if why is None:
        log.info("%s (shard %s, group %s): produced in symmetric memory", OP_NAME, name, group_name)
        return True
    log.info("%s (shard %s, group %s): not produced in symmetric memory: %s", OP_NAME, name, group_name, why)
    return False


def _lowering(fallback: Callable[..., Any]) -> Callable[..., Any]:
    overload = op()

    def all_gather_matmul(*args: Any, **kwargs: Any) -> Any:
        from torch._inductor.virtualized import V

        A = args[0] if args else kwargs["A"]
        realize_shard(A, _shard_node(V.graph.current_node, overload), group_name_of(overload, args, kwargs))
        return fallback(*args, **kwargs)

    return all_gather_matmul


def _shard_node(current: Node | None, overload: torch._ops.OpOverload) -> Node | None:
    """The FX node of the shard of ``current``, the op's node being lowered (None when another node is)."""
    if current is None or current.target is not overload:
        return None
    node = current.args[0] if current.args else current.kwargs.get("A")
    return node if isinstance(node, Node) else None


def register() -> bool:
    """Register the lowering (once); False where this torch lacks a name it needs (the implicit fallback stays)."""
    if _registered:
        return True
    try:
        from torch._inductor import ir
        from torch._inductor.comm_lowering import can_realize_as_comm_buffer, realize_as_comm_buffer  # noqa: F401
        from torch._inductor.lowering import (
            add_layout_constraint,
            add_needs_realized_inputs,
            fallback_handler,
            register_lowering,
            tag_to_layout_constraint,
        )
        from torch._library.utils import get_layout_constraint_tag

        ir.CommBufferType.SYMM_MEM  # noqa: B018
        ir.CommBufferLayout  # noqa: B018
        torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p  # noqa: B018 (the generated code's allocator)
    except (ImportError, AttributeError) as e:
        log.info("fluxcompile: the all-gather's shard is not produced in symmetric memory here (%s)", e)
        return False
    overload = op()
    # What Inductor's implicit fallback does for a custom op (GraphLowering.call_function, make_fallback).
    add_needs_realized_inputs(overload)
    constraint = tag_to_layout_constraint(get_layout_constraint_tag(overload, with_default=True))
    if constraint is not None:
        add_layout_constraint(overload, constraint)
    register_lowering(overload, type_promotion_kind=None)(_lowering(fallback_handler(overload)))
    _registered.append(overload)
    return True


def registered() -> bool:
    """Whether the lowering is registered in this process."""
    return bool(_registered)


register()
