"""A Megatron-core harness: its real tensor-parallel layers on gloo ranks, compiled with fluxcompile.

Runs inside a rank process that already has the default (gloo) process group (``fluxcompile.testing
.RankPool``). :func:`check` sets up Megatron's model-parallel state once per process
(``initialize_model_parallel(tensor_model_parallel_size=world)`` on the default group), builds a module of the
local (Transformer-Engine-free) GPT layer spec, ``get_gpt_layer_local_spec()``, and runs it three ways on the
same weights and inputs:

1. the reference: Megatron's own functions, eagerly, with fluxcompile's integration off;
2. eagerly with :func:`fluxcompile.integrations.megatron.enable` (Megatron's collectives through functional
   collectives): equal to the reference;
3. compiled, forward and backward, with fluxcompile (``backend="fluxcompile"``, or ``enable()`` and plain
   ``torch.compile``): equal to the reference, with the rewrite report of every graph.

The modules (:func:`build`): Megatron's ``MLP`` (``linear_fc1`` column-parallel, ``linear_fc2`` row-parallel);
the ``linear_qkv`` / ``linear_proj`` of a ``SelfAttention`` built from the spec, joined by a token-local stand-in
for the core attention (``q * sigmoid(k) + v``: Megatron's ``DotProductAttention`` allocates its score buffer
and forks its RNG on CUDA; ``gpt_layer.py`` runs the whole layer); a ``ColumnParallelLinear`` with
``gather_output``.

What the harness changes to run Megatron on CPU, and only where it runs Megatron's own code:
``torch.cuda.current_device`` answers ``"cpu"`` while the reference runs (:func:`megatron_on_cpu`), since
Megatron allocates its collective buffers (``GlobalMemoryBuffer``, the reduce-scatter outputs) with it. The
configuration
switches off what needs CUDA extensions (``gradient_accumulation_fusion``, the bias-activation, bias-dropout,
softmax and RoPE fusions) and initializes weights on the CPU (``use_cpu_initialization``: every rank builds the
same full weight from the CPU generator and keeps its shard, so ``model_parallel_cuda_manual_seed`` is not
needed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fluxcompile
from fluxcompile.integrations import megatron as flux_megatron
from fluxcompile.testing import fresh_compiles
from fluxcompile.testing.numerics import TOLERANCE, grad_errors, rel_err

TESTED_MEGATRON = flux_megatron.TESTED_MEGATRON
SIZES = {"hidden": 64, "ffn": 128, "heads": 4, "seq": 16, "batch": 2}


def setup_parallel_state() -> None:
    """Megatron's model-parallel groups on this rank (once per process): TP over every rank of the default group."""
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == world:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, create_gloo_process_groups=False)


def transformer_config(sequence_parallel: bool, **overrides: Any) -> Any:
    """A small ``TransformerConfig`` with the CUDA-extension fusions off and CPU weight initialization."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=SIZES["hidden"],
        ffn_hidden_size=SIZES["ffn"],
        num_attention_heads=SIZES["heads"],
        tensor_model_parallel_size=dist.get_world_size(),
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """``torch.cuda.current_device()`` answers ``"cpu"`` inside the block: Megatron allocates its collective
    buffers (``GlobalMemoryBuffer``, the reduce-scatter outputs) and its core attention's score buffer there."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


class SequenceParallelTorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch's ``LayerNorm`` or ``RMSNorm``, by ``config.normalization``) that
    also takes sequence parallelism: its parameters are marked ``sequence_parallel`` as Apex's and Transformer
    Engine's norms mark theirs, so Megatron's ``finalize_model_grads`` sums their gradients over the
    tensor-parallel ranks. The local spec's own norm refuses sequence parallelism without Apex."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> nn.Module:
        norm_cls = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def gpt_layer_spec() -> Any:
    """``get_gpt_layer_local_spec()`` with :class:`SequenceParallelTorchNorm` as its two layer norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return spec


class WithBias(nn.Module):
    """A Megatron module returning ``(output, bias)`` (``skip_bias_add``), with the bias added."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.inner(x)
        return out if bias is None else out + bias


class AttentionLinears(nn.Module):
    """A ``SelfAttention``'s ``linear_qkv`` and ``linear_proj`` with a token-local stand-in for the core attention."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.linear_qkv = attention.linear_qkv
        self.linear_proj = attention.linear_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.linear_qkv(x)
        q, k, v = qkv.chunk(3, dim=-1)
        out, bias = self.linear_proj(q * torch.sigmoid(k) + v)
        return out if bias is None else out + bias


def build(module: str, cfg: Any) -> nn.Module:
    """``mlp`` or ``attention`` from ``get_gpt_layer_local_spec()``; ``gather_output``: a ``ColumnParallelLinear``
    that all-gathers its output (as the GPT output layer does without ``parallel_output``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import build_module

    if module == "gather_output":
        h = cfg.hidden_size
        return WithBias(ColumnParallelLinear(h, h, config=cfg, init_method=cfg.init_method, gather_output=True))

    spec = get_gpt_layer_local_spec()
    if module == "mlp":
        return WithBias(build_mlp(spec.submodules.mlp, cfg))
    if module == "attention":
        return AttentionLinears(build_module(spec.submodules.self_attention, config=cfg, layer_number=1))
    raise ValueError(f"unknown module {module!r} (mlp or attention)")


def build_mlp(mlp_spec: Any, cfg: Any) -> nn.Module:
    """Megatron's ``MLP`` from the layer spec's ``mlp``: a ``ModuleSpec`` (megatron-core 0.16), or a
    ``functools.partial`` of ``MLP.as_mlp_submodule`` with its ``submodules`` (0.19)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(mlp_spec, ModuleSpec):
        return build_module(mlp_spec, config=cfg)
    return MLP(config=cfg, submodules=mlp_spec.keywords["submodules"])


@dataclasses.dataclass
class Site:
    """One collective of one compiled graph, from the rewrite report."""

    graph: str  # forward / backward
    collective: str
    fused_op: str | None
    detail: str


@dataclasses.dataclass
class Result:
    megatron_version: str
    module: str
    sequence_parallel: bool
    world: int
    route: str
    tolerance: float
    eager_errors: dict[str, float]  # eager with enable() vs Megatron's own functions
    compiled_errors: dict[str, float]  # compiled vs Megatron's own functions
    graphs: dict[str, int]  # compiled graphs per kind (1 forward + 1 backward: no graph break)
    sites: list[Site]
    report: str

    def fused(self, graph: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.sites:
            if s.graph == graph and s.fused_op:
                counts[s.fused_op] = counts.get(s.fused_op, 0) + 1
        return counts

    def kept(self) -> list[Site]:
        return [s for s in self.sites if s.fused_op is None]


def forward_backward(model: Any, params: list[tuple[str, nn.Parameter]], x: torch.Tensor, grad: torch.Tensor) -> dict:
    """Forward and backward; the output and every gradient (input and parameters), by name."""
    for _, p in params:
        p.grad = None
    xin = x.clone().requires_grad_()
    out = model(xin)
    out.backward(grad)
    values = {"output": out.detach(), "grad input": xin.grad}
    values.update({f"grad {name}": p.grad for name, p in params})
    return values


def compare(got: dict, want: dict) -> dict[str, float]:
    """Relative error of each value; a gradient that one side has and the other lacks counts as infinite."""
    errors = {"output": rel_err(got["output"], want["output"])}
    both = [(k, got[k], want[k]) for k in want if k != "output" and got[k] is not None and want[k] is not None]
    errors.update(grad_errors(both))
    errors.update({k: float("inf") for k in want if (got[k] is None) != (want[k] is None)})
    return errors


def three_ways(
    model: Any,
    params: list[tuple[str, nn.Parameter]],
    x: torch.Tensor,
    grad: torch.Tensor,
    route: str = "backend",
    reference_context: Any = contextlib.nullcontext,
) -> tuple[dict[str, float], dict[str, float], Any]:
    """Forward and backward with Megatron's own functions (the reference, inside ``reference_context()``), eagerly
    with the integration on, and compiled (``route``: ``backend="fluxcompile"``, or ``enable`` and plain
    ``torch.compile``): (eager errors, compiled errors, the compiled graphs' report)."""
    flux_megatron.disable()
    with reference_context():
        want = forward_backward(model, params, x, grad)
    try:
        flux_megatron.enable(inductor=route == "enable")
        eager = compare(forward_backward(model, params, x, grad), want)
        torch._dynamo.reset()
        compiled_model = torch.compile(model, backend="fluxcompile") if route == "backend" else torch.compile(model)
        with fresh_compiles(), fluxcompile.collect_reports() as rep:
            got = forward_backward(compiled_model, params, x, grad)
    finally:
        flux_megatron.disable()
    return eager, compare(got, want), rep


def check(
    module: str, sequence_parallel: bool, route: str = "backend", frozen_weights: bool = False, seed: int = 0
) -> Result:
    """Build ``module``, run it as Megatron does, eagerly with the integration on, and compiled; compare.

    ``frozen_weights``: the linear layers' weights do not require grad (Megatron's ``linear_with_frozen_weight``
    path, as in adapter fine-tuning)."""
    version = flux_megatron.check_layout()
    warnings.filterwarnings("ignore", module="megatron")
    setup_parallel_state()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = transformer_config(sequence_parallel)
    torch.manual_seed(seed)
    model = build(module, cfg)
    if frozen_weights:
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                p.requires_grad_(False)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    # The same full batch on every rank; with sequence parallelism each rank holds its block of the sequence.
    s, b, h = SIZES["seq"], SIZES["batch"], SIZES["hidden"]
    torch.manual_seed(seed + 1)
    x, grad = torch.randn(s, b, h), torch.randn(s, b, h)
    if sequence_parallel:
        x, grad = x.chunk(world)[rank].contiguous(), grad.chunk(world)[rank].contiguous()

    # Only the reference runs Megatron's own code, which allocates its buffers on the "current CUDA device".
    eager, compiled, rep = three_ways(model, params, x, grad, route, megatron_on_cpu)
    return Result(
        version,
        module,
        sequence_parallel,
        world,
        route,
        TOLERANCE[torch.float32],
        eager,
        compiled,
        graphs_of(rep),
        sites_of(rep),
        rep.format(),
    )


def graphs_of(report: Any) -> dict[str, int]:
    """How many graphs of each kind a ``fluxcompile`` report covers."""
    graphs: dict[str, int] = {}
    for g in report.graphs:
        graphs[g.kind] = graphs.get(g.kind, 0) + 1
    return graphs


def sites_of(report: Any) -> list[Site]:
    """Every collective of a ``fluxcompile`` report, in graph order."""
    return [Site(g.kind, e.collective, e.fused_op, e.detail) for g in report.graphs for e in g.entries]
