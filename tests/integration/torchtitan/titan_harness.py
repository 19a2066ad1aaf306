"""torchtitan's own Llama3 debug model and ``parallelize_llama`` on gloo ranks, compiled with fluxcompile on.

``check(case)`` runs on every rank what torchtitan's trainer does to build and train a model (``Trainer.__init__``
and ``forward_backward_step``, without its data loader, checkpointer and metrics): the SPMD backend set, the
device meshes of ``ParallelDims``, the debug model's config with its sharding (``update_from_config``), built on
the meta device, ``parallelize_llama`` (tensor parallel, activation checkpointing, per-block ``torch.compile`` and
FSDP2), ``init_weights``, then one forward and backward with torchtitan's cross-entropy loss. It builds the model
twice, without compile (the reference) and with compile after ``fluxcompile.enable()`` (as a torchtitan user turns
fluxcompile on: its ``apply_compile`` compiles each block with Inductor), copies the reference's weights into the
compiled one, and compares the logits, the loss and every parameter's gradient; the rewrite reports of the
compiled graphs come back with the numbers.

What differs from a torchtitan run, and why:
  * the attention is ``ScaledDotProductAttention`` (causal), as torchtitan's own graph_trainer tests swap in:
    FlexAttention, its default, has no backward on CPU. Both run inside the same ``local_map`` (q, k, v and the
    output ``Shard`` on the heads), so the swap changes no placement: ``wo``'s input is ``Shard`` on its features
    under either;
  * the debug model keeps its first layer only (the blocks are identical; each costs a compile);
  * ``ParallelDims`` builds its meshes on ``cpu`` (torchtitan picks ``cuda`` where no accelerator is found);
  * FSDP2's gradient reduction uses sum-only collectives (``set_force_sum_reduction_for_comms``, which torchtitan
    sets for symmetric-memory FSDP): gloo has no PREMUL_SUM.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

SEQ, BATCH, VOCAB = 32, 2, 2048


@dataclasses.dataclass(frozen=True)
class Case:
    spmd_backend: str = "spmd_types"  # torchtitan's default; or "partial_dtensor"
    sequence_parallel: bool = True  # torchtitan's default
    activation_checkpoint: bool = True  # torchtitan's default: selective AC
    tp: int = 2  # the data-parallel (FSDP) degree is the rest of the world
    dtype: str = "float32"  # training.mixed_precision_param: torchtitan's default is bfloat16

    @property
    def name(self) -> str:
        return (
            f"{self.spmd_backend}, {'sequence parallel' if self.sequence_parallel else 'no sequence parallel'}, "
            f"{'selective AC' if self.activation_checkpoint else 'no AC'}, tp={self.tp}, {self.dtype}"
        )


@dataclasses.dataclass
class Site:
    graph: str  # "forward" or "backward"
    collective: str
    group: str  # "tp", "dp" or the group name when it is neither
    fused_op: str | None
    detail: str


@dataclasses.dataclass
class Result:
    case: str
    dp: int
    errors: dict[str, float]  # relative error of the compiled run against the reference, per output/gradient
    tolerance: float
    sites: list[Site]
    graphs: dict[str, int]
    report: str

    def fused(self, graph: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sites:
            if s.graph == graph and s.fused_op:
                out[s.fused_op] = out.get(s.fused_op, 0) + 1
        return out

    def kept(self) -> list[Site]:
        return [s for s in self.sites if s.fused_op is None]


_DIMS: dict[tuple[str, int], Any] = {}


def parallel_dims(backend: str, tp: int) -> Any:
    """One ``ParallelDims`` (and its meshes) per backend and TP degree in this process, as in one trainer."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import ParallelismConfig

    key = (backend, tp)
    if key not in _DIMS:
        titan_dims.device_type = "cpu"
        parallelism = ParallelismConfig(tensor_parallel_degree=tp, spmd_backend=backend)
        dims = titan_dims.ParallelDims.from_config(parallelism, dist.get_world_size())
        dims.build_mesh()
        _DIMS[key] = dims
    return _DIMS[key]


def build(case: Case, compiled: bool) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dist_utils.set_spmd_backend(case.spmd_backend)
    dims = parallel_dims(case.spmd_backend, case.tp)
    parallelism = ParallelismConfig(
        tensor_parallel_degree=case.tp,
        enable_sequence_parallel=case.sequence_parallel,
        spmd_backend=case.spmd_backend,
    )
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param=case.dtype)
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:1]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    set_llama3_sharding_config(config, enable_sp=case.sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(enable=compiled, components=["model"]),
        ac_config=SelectiveAC.Config() if case.activation_checkpoint else None,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, dims


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = _local(got).detach().double(), _local(want).detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _step(model: torch.nn.Module, dims: Any, case: Case, tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    with dist_utils.get_spmd_context(parallel_dims=dims)():
        kwargs: dict[str, Any] = {}
        if case.spmd_backend == "spmd_types":
            tokens, labels, kwargs = annotate_input_spmd_types(dims, tokens, labels, kwargs)
        pred = model(tokens, **kwargs)
        loss = cross_entropy_loss(pred, labels, global_vocab_size=VOCAB)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return pred, loss, grads


def _group_role(name: str, tp: int) -> str:
    """The role ("tp" or "dp") of a group of torchtitan's layout (TP innermost: ranks ``r // tp`` share a TP group, ranks
    ``r % tp`` a data-parallel one), read from the group's members; the group's name otherwise."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        members = dist.get_process_group_ranks(_resolve_process_group(name))
    except Exception:
        return name
    rank, world = dist.get_rank(), dist.get_world_size()
    if sorted(members) == [r for r in range(world) if r // tp == rank // tp]:
        return "tp"
    if sorted(members) == [r for r in range(world) if r % tp == rank % tp]:
        return "dp"
    return name


@contextlib.contextmanager
def _titan_compile_settings():
    """torchtitan's ``apply_compile`` sets two Dynamo flags for the process: restored afterwards, so other work in
    the same rank process compiles as before."""
    cfg = torch._dynamo.config
    saved = (cfg.capture_scalar_outputs, cfg.skip_fwd_side_effects_in_bwd_under_checkpoint)
    try:
        yield
    finally:
        cfg.capture_scalar_outputs, cfg.skip_fwd_side_effects_in_bwd_under_checkpoint = saved


def check(case: Case) -> Result:
    """One training step of the reference and of the compiled model (see the module's docstring)."""
    import fluxcompile
    from fluxcompile.testing.numerics import TOLERANCE

    torch._dynamo.reset()
    with _titan_compile_settings():
        torch.manual_seed(0)
        reference, dims = build(case, compiled=False)
        model, _ = build(case, compiled=True)
        with torch.no_grad():
            for want, got in zip(reference.parameters(), model.parameters(), strict=True):
                _local(got).copy_(_local(want))
        # Each data-parallel rank reads its own batch; the ranks of one TP group read the same.
        gen = torch.Generator().manual_seed(1 + dist.get_rank() // case.tp)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        want = _step(reference, dims, case, tokens, labels)
        fluxcompile.enable()
        try:
            with (
                torch._inductor.config.patch(fx_graph_cache=False),
                torch._functorch.config.patch(enable_autograd_cache=False),
                fluxcompile.collect_reports() as report,
            ):
                got = _step(model, dims, case, tokens, labels)
        finally:
            fluxcompile.disable()
    errors = {"logits": _rel(got[0], want[0]), "loss": _rel(got[1], want[1])}
    errors.update({f"grad {n}": _rel(got[2][n], want[2][n]) for n in want[2]})
    sites = [
        Site(g.kind, e.collective, _group_role(e.group_name, case.tp), e.fused_op, e.detail)
        for g in report.graphs
        for e in g.entries
    ]
    graphs = {k: len(report.of_kind(k)) for k in ("forward", "backward")}
    tolerance = TOLERANCE[getattr(torch, case.dtype)]
    return Result(case.name, dims.dp_shard, errors, tolerance, sites, graphs, report.format())
