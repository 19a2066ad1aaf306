"""fluxcompile for Megatron-core's tensor-parallel layers: ``enable()`` before building or compiling the model.

Megatron-core's ``ColumnParallelLinear`` and ``RowParallelLinear`` communicate through their own autograd
functions, which call ``torch.distributed`` in place, some asynchronously (``async_op=True`` handles), into
buffers allocated with ``torch.cuda.current_device()`` (the sequence-parallel gather buffer of
``GlobalMemoryBuffer``). Dynamo cannot trace those: the layers break the graph, and their collectives never
reach the rewrite pass. :func:`enable` replaces exactly these functions, with the same arguments and the same
results, by code that communicates through ``torch.distributed._functional_collectives`` on the same
process group, so the compiled forward and backward graphs hold ``_c10d_functional`` collectives next to the
matmuls:

``megatron.core.tensor_parallel.mappings``
  * ``_reduce`` (all-reduce of ``_ReduceFromModelParallelRegion``'s forward and
    ``_CopyToModelParallelRegion``'s backward): funcol's ``all_reduce(sum)``, into a new tensor instead of
    in place (every caller uses the result);
  * ``_gather_along_first_dim`` (sequence-parallel gathers): funcol's all-gather on dim 0
    (``all_gather_single``, or ``all_gather_tensor`` where torch lacks it), into a new tensor instead of the
    global buffer (``use_global_buffer`` is ignored);
  * ``_reduce_scatter_along_first_dim`` (sequence-parallel reduce-scatters): funcol's reduce-scatter (sum)
    on dim 0, likewise (``_reduce_scatter_along_last_dim`` calls it and is covered);
  * ``_gather_along_last_dim`` (``gather_output`` and the tensor-parallel gathers): the all-gather on dim 0,
    then the chunks concatenated on the last dim, as Megatron does.
  With uneven splits (``output_split_sizes``/``input_split_sizes``, the MoE token dispatcher) the gather and
  the reduce-scatter call Megatron's own functions.
  Megatron's autograd functions around them (``_GatherFromSequenceParallelRegion`` and the others) stay: their
  forward and backward call the functions above, so their gradients are Megatron's.

``megatron.core.tensor_parallel.layers`` (and its re-export in ``megatron.core.tensor_parallel``)
  * ``linear_with_grad_accumulation_and_async_allreduce``, which the linear layers' ``_forward_impl`` calls:
    :class:`LinearWithFunctionalCollectives`, the computation of Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication`` with blocking functional collectives. Forward: with
    sequence parallelism, the input is all-gathered on dim 0; ``matmul(input, weight.t()) (+ bias)``.
    Backward: ``grad_input = grad_output @ weight``, all-reduced (``allreduce_dgrad``) or reduce-scattered on
    dim 0 (sequence parallelism); ``grad_weight = grad_output.t() @ input``, the input all-gathered again on
    dim 0 under sequence parallelism (Megatron saves the shard, not the gathered input);
    ``grad_bias = grad_output.sum(0)``. Calls with ``gradient_accumulation_fusion`` (Apex's fused
    weight-gradient accumulation into ``main_grad``), a ``grad_output_buffer`` (deferred embedding
    weight gradients) or GTP-sharded weights (``gtp_remat_size > 1``, megatron-core 0.19) go to Megatron's
    function unchanged.
  * ``linear_with_frozen_weight`` (weights that do not require grad): the same class with ``frozen``, i.e.
    Megatron's ``LinearWithFrozenWeight`` (no weight or bias gradient, only the weight saved) after its
    sequence-parallel gather.
  The tensor-parallel group comes from ``parallel_state`` when the call passes none (the row-parallel layer
  does), without Megatron's deprecation warning: only rank 0 issues it, and Dynamo breaks the graph there.

Nothing else changes: the all-to-all of the MoE token dispatcher and Transformer Engine's layers keep their
code. Compiled, the gathered input of a sequence-parallel column-parallel layer is saved for its weight
gradient: AOTAutograd does not recompute collectives, so Megatron's second gather moves into the forward graph,
where it is the first one. The backward then has one all-gather less per such layer, and keeps an
``[s, b, h]`` activation where Megatron's eager code keeps ``[s / tp, b, h]``.

What fuses then (the rewrite report says it for every collective): column-parallel layers with sequence
parallelism — all-gather + GEMM in the forward, GEMM + reduce-scatter of the input gradient; row-parallel
layers with sequence parallelism — GEMM + reduce-scatter in the forward, all-gather + GEMM of the input
gradient; without sequence parallelism, GEMM + all-reduce (row-parallel forward, column-parallel input
gradient). The weight gradients contract over the gathered rows, which no fused op computes: they read the
gathered tensor the fused ops return.

Uncompiled calls run the same code while enabled: blocking collectives, so the overlap Megatron's eager code gets
from its asynchronous handles (the input-gradient collective beside the weight-gradient GEMM) is gone there; the
fused ops are where the compiled layers overlap.

Releases: tested with megatron-core 0.16.1 and 0.19.2 (0.19 dropped the linear functions'
``async_grad_allreduce`` and added ``gtp_remat_size`` after ``tp_group``: the replacements read those arguments by
name). Before it replaces anything, ``enable()`` checks that every function above exists and takes the parameters
its replacement understands; where one does not, it raises one ``RuntimeError`` line naming the release and each
function that is missing or changed, and replaces nothing.

``enable()`` also installs the rewrite pass into plain Inductor (``fluxcompile.enable()``), so
``torch.compile(model)`` fuses as ``torch.compile(model, backend="fluxcompile")`` does;
``enable(inductor=False)`` replaces Megatron's functions only. :func:`disable` restores everything
:func:`enable` changed. Both are idempotent.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from .. import backend
from ..fx_passes import FluxcompilePass

# The releases tests/test_megatron.py runs on; enable() accepts any release whose functions match.
TESTED_MEGATRON = ("0.16.1", "0.19.2")
MAPPINGS = "megatron.core.tensor_parallel.mappings"
LAYERS = "megatron.core.tensor_parallel.layers"
PACKAGE = "megatron.core.tensor_parallel"
LINEAR = "linear_with_grad_accumulation_and_async_allreduce"
FROZEN = "linear_with_frozen_weight"

# (module, name) -> Megatron's original, while enabled.
_originals: dict[tuple[str, str], Any] = {}
_inductor_enabled = False


# torch 2.13 names them *_single (the *_tensor names warn outside compile); an older torch may have only *_tensor.
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """The collective's result as a plain tensor (eager funcol returns an ``AsyncCollectiveTensor``)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_reduce(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``input_`` over ``group`` (Megatron's ``_reduce``)."""
    if group.size() == 1:
        return input_
    return _waited(funcol.all_reduce(input_.contiguous(), "sum", group))


def gather_along_first_dim(
    input_: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Concatenate every rank's ``input_`` on dim 0 (Megatron's ``_gather_along_first_dim``)."""
    if group.size() == 1:
        return input_
    if output_split_sizes is not None:
        return _originals[(MAPPINGS, "_gather_along_first_dim")](input_, group, output_split_sizes, use_global_buffer)
    return _waited(_all_gather(input_.contiguous(), 0, group))


def reduce_scatter_along_first_dim(
    input_: torch.Tensor,
    group: dist.ProcessGroup,
    input_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Sum ``input_`` over ``group`` and keep this rank's block of dim 0 (Megatron's
    ``_reduce_scatter_along_first_dim``)."""
    if group.size() == 1:
        return input_
    if input_split_sizes is not None:
        original = _originals[(MAPPINGS, "_reduce_scatter_along_first_dim")]
        return original(input_, group, input_split_sizes, use_global_buffer)
    if input_.size(0) % group.size():
        raise ValueError("First dimension of the tensor should be divisible by tensor parallel size")
    return _waited(_reduce_scatter(input_.contiguous(), "sum", 0, group))


def gather_along_last_dim(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``input_`` on the last dim (Megatron's ``_gather_along_last_dim``)."""
    world = group.size()
    if world == 1:
        return input_
    gathered = _waited(_all_gather(input_.contiguous(), 0, group))
    # cat of the contiguous dim-0 blocks is a new contiguous tensor already. No trailing ``.contiguous()``:
    # compiled by torch 2.11, an autograd.Function forward (Megatron's _GatherFromModelParallelRegion) that
    # returns ``t.contiguous()`` of a contiguous ``t`` gets a zero output gradient, so every gradient is zero.
    return torch.cat(gathered.chunk(world, dim=0), dim=-1)


_custom_fwd = torch.amp.custom_fwd(device_type="cuda")
_custom_bwd = torch.amp.custom_bwd(device_type="cuda")


class LinearWithFunctionalCollectives(torch.autograd.Function):
    """Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` (without its Apex and deferred-wgrad
    paths), or with ``frozen`` its ``LinearWithFrozenWeight`` (no weight or bias gradient, the input not
    saved), with functional collectives: see the module's docstring."""

    @staticmethod
    @_custom_fwd
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        group: dist.ProcessGroup | None,
        frozen: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(*((weight,) if frozen else (input, weight)))
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.group = group
        ctx.frozen = frozen
        total_input = gather_along_first_dim(input, group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group = ctx.group
        weight = ctx.saved_tensors[-1]
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            grad_input = all_reduce(grad_input, group)
        if ctx.sequence_parallel:
            grad_input = reduce_scatter_along_first_dim(grad_input, group)
        if ctx.frozen:
            return grad_input, None, None, None, None, None, None
        input = ctx.saved_tensors[0]
        total_input = gather_along_first_dim(input, group) if ctx.sequence_parallel else input
        # Megatron's prepare_input_tensors_for_wgrad_compute: contiguous, [s, b, h] as [s * b, h].
        grad_output = grad_output.contiguous()
        total_input = total_input.contiguous()
        if grad_output.dim() == 3:
            grad_output = grad_output.view(-1, grad_output.shape[2])
            total_input = total_input.view(-1, total_input.shape[2])
        grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _tp_group(tp_group: dist.ProcessGroup | None, communicates: bool) -> dist.ProcessGroup | None:
    """Megatron's ``get_tensor_model_parallel_group_if_none`` without its warning, which Dynamo cannot trace (and
    which rank 0 alone issues, so the ranks would compile different graphs). A call that does not communicate
    needs no group."""
    if tp_group is not None or not communicates:
        return tp_group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _trailing_arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a linear function after :data:`LEADING`, by name: positional ones in the order of the
    installed Megatron's parameters (it differs between releases), keyword ones as given."""
    named = dict(zip(_trailing[name], args))
    named.update(kwargs)
    return named


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """Megatron's function of the same name (the same arguments in every supported release: ``grad_output_buffer``,
    ``wgrad_deferral_limit``, ``tp_group``, and ``async_grad_allreduce`` (0.16) or ``gtp_remat_size`` (0.19)),
    through :class:`LinearWithFunctionalCollectives`. Apex's weight-gradient fusion, deferred weight gradients and
    GTP-sharded weights (``gtp_remat_size > 1``) go to Megatron's function unchanged."""
    rest = _trailing_arguments(LINEAR, args, kwargs)
    if gradient_accumulation_fusion or rest.get("grad_output_buffer") is not None or rest.get("gtp_remat_size", 1) > 1:
        original = _originals[(LAYERS, LINEAR)]
        return original(
            input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, *args, **kwargs
        )
    group = _tp_group(rest.get("tp_group"), allreduce_dgrad or sequence_parallel)
    return LinearWithFunctionalCollectives.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, group, False)


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """Megatron's function of the same name (same arguments), through :class:`LinearWithFunctionalCollectives`.
    What Megatron's refuses (``grad_output_buffer``, ``wgrad_deferral_limit``) and GTP-sharded weights go to it."""
    rest = _trailing_arguments(FROZEN, args, kwargs)
    if (
        rest.get("grad_output_buffer") is not None
        or rest.get("wgrad_deferral_limit") is not None
        or rest.get("gtp_remat_size", 1) > 1
    ):
        original = _originals[(LAYERS, FROZEN)]
        return original(
            input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, *args, **kwargs
        )
    group = _tp_group(rest.get("tp_group"), allreduce_dgrad or sequence_parallel)
    return LinearWithFunctionalCollectives.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, group, True)


# What enable() replaces: (module, name) -> the replacement.
REPLACEMENTS: dict[tuple[str, str], Any] = {
    (MAPPINGS, "_reduce"): all_reduce,
    (MAPPINGS, "_gather_along_first_dim"): gather_along_first_dim,
    (MAPPINGS, "_reduce_scatter_along_first_dim"): reduce_scatter_along_first_dim,
    (MAPPINGS, "_gather_along_last_dim"): gather_along_last_dim,
    (LAYERS, LINEAR): linear_with_grad_accumulation_and_async_allreduce,
    (PACKAGE, LINEAR): linear_with_grad_accumulation_and_async_allreduce,
    (LAYERS, FROZEN): linear_with_frozen_weight,
}


# The parameters the two linear functions take first, in this order, in every supported release.
LEADING = ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel")
# The two linear functions, whose parameters after LEADING the replacements read by name.
LINEARS = (LINEAR, FROZEN)
# The parameters after LEADING that the replacements understand, in any order (0.16: ..., async_grad_allreduce,
# tp_group; 0.19: ..., tp_group, gtp_remat_size).
TRAILING = {"grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce", "tp_group", "gtp_remat_size"}
# name -> the installed function's parameters after LEADING, in its order (set by enable()).
_trailing: dict[str, tuple[str, ...]] = {}


def megatron_version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"


def _parameters(fn: Any) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _differs(module: str, name: str, original: Any) -> str | None:
    """How Megatron's ``module.name`` differs from what its replacement takes, or None."""
    where = f"{module}.{name}"
    if not callable(original):
        return f"{where} (not found)"
    params = _parameters(original)
    if params is None:
        return f"{where} (no signature to check)"
    if name in LINEARS:
        unknown = [p for p in params[len(LEADING) :] if p not in TRAILING]
        if params[: len(LEADING)] != list(LEADING):
            return f"{where}({', '.join(params)}) (expected it to begin with {', '.join(LEADING)})"
        if unknown:
            return f"{where} (unknown parameters: {', '.join(unknown)})"
        return None
    expected = _parameters(REPLACEMENTS[(module, name)])
    return None if params == expected else f"{where}({', '.join(params)}) (expected ({', '.join(expected)}))"


def check_layout() -> str:
    """Megatron-core's version; raises one line naming the version and every function that is missing or takes
    other parameters than its replacement understands."""
    version = megatron_version()
    missing = []
    for module, name in REPLACEMENTS:
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            missing.append(f"{module} ({type(e).__name__}: {e})")
            continue
        problem = _differs(module, name, getattr(mod, name, None))
        if problem:
            missing.append(problem)
    if missing:
        raise RuntimeError(
            f"fluxcompile's Megatron integration (tested with megatron-core {', '.join(TESTED_MEGATRON)}) cannot "
            f"replace the collectives of megatron-core {version}: " + "; ".join(missing)
        )
    return version


def enable(inductor: bool = True) -> None:
    """Route Megatron-core's tensor-parallel collectives through functional collectives (see the module's
    docstring); with ``inductor``, also install the rewrite pass into plain Inductor (``fluxcompile.enable()``)."""
    global _inductor_enabled
    if not _originals:
        check_layout()
        for (module, name), replacement in REPLACEMENTS.items():
            mod = importlib.import_module(module)
            _originals[(module, name)] = getattr(mod, name)
            if name in LINEARS:
                _trailing[name] = tuple(_parameters(_originals[(module, name)])[len(LEADING) :])
            setattr(mod, name, replacement)
    if inductor and not _inductor_enabled:
        from torch._inductor import config as inductor_config

        # A pass the user installed stays theirs: disable() removes only what enable() installed.
        if not isinstance(inductor_config.post_grad_custom_pre_pass, FluxcompilePass):
            backend.enable()
            _inductor_enabled = True


def disable() -> None:
    """Restore what :func:`enable` replaced (and the Inductor pass, if it installed it)."""
    global _inductor_enabled
    for (module, name), original in list(_originals.items()):
        setattr(importlib.import_module(module), name, original)
    _originals.clear()
    _trailing.clear()
    if _inductor_enabled:
        backend.disable()
        _inductor_enabled = False


def enabled() -> bool:
    """Whether Megatron's functions are replaced now."""
    return bool(_originals)
