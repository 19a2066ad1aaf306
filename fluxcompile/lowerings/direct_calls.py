"""Inductor's generated code calls the fused ops' implementations directly instead of through ``torch.ops``.

A fused op is a ``torch.library`` op with a Python CUDA implementation. Called through the dispatcher, its
list arguments are boxed into IValues and unboxed back into Python objects on every call, a sizeable share
of a call's host time (BENCHMARKS.md, host time per fused-op call). Where a step is host-bound (a 2048-token
training step, vLLM's prefill, which runs outside CUDA graphs) that is time the GPU waits.

So each op's fallback line in Inductor's Python wrapper, ``bufN = torch.ops.fluxcompile.<op>.default(...)``,
becomes ``bufN = extern_kernels.fluxcompile_<op>(...)``: an entry that runs the CUDA implementation itself
for CUDA operands and otherwise calls the op through the dispatcher (so CPU graphs, and this module's tests,
take the same line). The hook is Inductor's registry of custom extern-kernel codegen (torch 2.11 and 2.13);
where a torch lacks it, nothing changes. ``config.direct_calls`` (``FLUXCOMPILE_DIRECT_CALLS=0``) turns it off.
The C++ wrapper (AOTInductor) is untouched. Under the profiler the entry opens a ``fluxcompile::<op>``
range, as the dispatcher would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..config import config

log = logging.getLogger("fluxcompile.direct_calls")

PREFIX = "fluxcompile_"
_registered: dict[str, Callable[..., Any]] = {}


def entry_name(op_name: str) -> str:
    """The entry's attribute name in ``torch._inductor.select_algorithm.extern_kernels``."""
    return PREFIX + op_name


def _make_entry(op_name: str, impl: Callable[..., Any], probe: Callable[[tuple], torch.Tensor]):
    overload = getattr(torch.ops.fluxcompile, op_name).default
    label = f"fluxcompile::{op_name}"
    profiler = torch.autograd.profiler

    def entry(*args: Any) -> Any:
        if not probe(args).is_cuda:
            return overload(*args)
        if profiler._is_profiler_enabled:  # a module flag, read per call: as the dispatcher, name the range
            with torch.profiler.record_function(label):
                return impl(*args)
        return impl(*args)

    entry.__name__ = entry_name(op_name)
    entry.__qualname__ = entry.__name__
    return entry


def _python_codegen(op_name: str) -> Callable[[Any, Callable[[Any], None]], None]:
    def codegen(node: Any, writeline: Callable[[Any], None]) -> None:
        from torch._inductor.codegen.wrapper import ExternKernelAllocLine
        from torch._inductor.virtualized import V

        args = _positional(node) if config.direct_calls else None
        if args is None:
            writeline(ExternKernelAllocLine(V.graph.wrapper_code, node))
            return
        writeline(f"{node.get_name()} = extern_kernels.{entry_name(op_name)}({', '.join(args)})")

    return codegen


def _positional(node: Any) -> list[str] | None:
    """The call's arguments, all positional (the entries take no keywords): the node's keyword arguments (the
    compiled ``choice``) go to their places, with the schema's defaults before them; None where that cannot be
    done (a keyword-only argument)."""
    from torch._inductor.virtualized import V

    args = list(node.codegen_args())
    kwargs = dict(node.kwargs)
    for arg in node.op_overload._schema.arguments[len(args) :]:
        if not kwargs:
            break
        if arg.kwarg_only:
            return None
        value = kwargs.pop(arg.name) if arg.name in kwargs else arg.default_value
        args.append(V.graph.wrapper_code.val_to_arg_str(value))
    return None if kwargs else args


def register(op_name: str, impl: Callable[..., Any], probe: Callable[[tuple], torch.Tensor]) -> None:
    """Make Inductor's Python wrapper call ``impl`` (the op's CUDA implementation) for ``fluxcompile::op_name``;
    ``probe(args)`` is an operand whose device decides between ``impl`` and the dispatcher."""
    try:
        from torch._inductor.codegen.custom_extern_kernel_codegen import CUSTOM_EXTERN_KERNEL_CODEGEN, CustomCodegen
        from torch._inductor.select_algorithm import extern_kernels
    except ImportError as e:  # an older or newer torch without the hook: the dispatcher it is
        log.info("fluxcompile: direct calls of the fused ops are unavailable (%s)", e)
        return
    entry = _make_entry(op_name, impl, probe)
    setattr(extern_kernels, entry_name(op_name), entry)
    CUSTOM_EXTERN_KERNEL_CODEGEN[f"torch.ops.fluxcompile.{op_name}.default"] = CustomCodegen(
        python=_python_codegen(op_name)
    )
    _registered[op_name] = entry


def cuda_impl(op_name: str, probe: Callable[[tuple], torch.Tensor]) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is ``fluxcompile::op_name``'s CUDA implementation, for the dispatcher and for
    Inductor's generated code alike (``register``). Returns ``fn`` (``torch.library.impl`` does not)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.impl(f"fluxcompile::{op_name}", "CUDA")(fn)
        register(op_name, fn, probe)
        return fn

    return decorate


def registered() -> dict[str, Callable[..., Any]]:
    """The ops whose generated calls go straight to their entries, with the entries."""
    return dict(_registered)
