"""``python -m fluxcompile demo``: a reference model compiled with fluxcompile, checked against eager.

Starts its own ranks (gloo on CPU, NCCL when enough GPUs are visible), builds the model on every rank,
compiles it with ``backend="fluxcompile"``, prints the rewrite report and the largest relative error of the
output and of every gradient. ``--model``:

- ``llama`` (default): a Llama block parallelized with PyTorch's TP API as torchtitan does;
- ``moe``: an expert-parallel MoE layer (all-to-all dispatch and combine; dropless or with a capacity), also
  checked against the same layer computed in one process (fluxcompile/models/moe.py);
- ``dlrm``: a small DLRM with model-parallel embedding tables (an all-to-all of the pooled embeddings) and a
  data-parallel dense part, also checked against one process (fluxcompile/models/dlrm.py).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class DemoArgs:
    world_size: int = 2
    dim: int = 256
    heads: int = 8
    ffn: int = 688
    batch: int = 2
    seq: int = 64
    dtype: str = "float32"
    sequence_parallel: bool = True
    bias: bool = False
    seed: int | None = None  # None: fresh inputs each run
    dynamic: bool | None = None  # torch.compile(dynamic=...): True compiles with symbolic shapes
    model: str = "llama"  # "llama" | "moe" | "dlrm"
    # moe
    tokens: int = 32  # tokens per rank
    experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    expert_form: str = "grouped"  # "grouped" | "bmm" | "loop"
    # dlrm (also dim: embedding dim, ffn: MLP width, batch: samples per rank)
    tables: int = 8
    rows: int = 1000
    bag_size: int = 4
    dense_in: int = 13
    pooling: str = "sum"  # "sum" | "mean"
    interaction: str = "dot"  # "dot" | "cat"
    inference: bool = False  # dlrm: the forward alone, without gradients (its inference form)
    padding_idx: int | None = None  # dlrm: the tables' padding index (nn.EmbeddingBag's)


@dataclasses.dataclass
class BlockResult:
    report: str
    counts: dict[str, dict[str, int]]  # graph kind -> fused op -> count
    output_error: float
    input_grad_error: float
    grad_errors: dict[str, float]
    tolerance: float

    @property
    def ok(self) -> bool:
        errs = [self.output_error, self.input_grad_error, *self.grad_errors.values()]
        return all(e <= self.tolerance for e in errs)


FUSED = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
MODELS = ("llama", "moe", "dlrm")


@dataclasses.dataclass
class ModelResult:
    """One rank's check of an MoE or DLRM model: compiled vs eager of the same sharded model (``output_error``,
    ``input_grad_error``, ``grad_errors``) and eager vs the single-process reference (``reference_errors``:
    ``output``, ``input grad`` and every parameter's gradient)."""

    report: str
    counts: dict[str, dict[str, int]]  # graph kind -> fused op (fluxcompile.ops.FUSED_OPS) -> count
    output_error: float
    input_grad_error: float
    grad_errors: dict[str, float]
    reference_errors: dict[str, float]
    tolerance: float
    graphs: dict[str, int] = dataclasses.field(default_factory=dict)  # graph kind -> graphs compiled
    dropped: int = 0  # token copies this rank's MoE dropped (beyond an expert's capacity)

    @property
    def ok(self) -> bool:
        errs = [self.output_error, self.input_grad_error, *self.grad_errors.values(), *self.reference_errors.values()]
        return all(e <= self.tolerance for e in errs)


def _counts(rep) -> dict[str, dict[str, int]]:
    from fluxcompile.ops import FUSED_OPS

    return {k: {op: rep.count(op, k) for op in FUSED_OPS} for k in ("forward", "backward")}


def _shared_seed(a: DemoArgs, device, group) -> int:
    """``a.seed``, or a fresh one that rank 0 of ``group`` sends to the others."""
    seed = a.seed if a.seed is not None else int(time.time_ns() % 2**31)
    seed_t = torch.tensor([seed], device=device)
    torch.distributed.broadcast(seed_t, group_src=0, group=group)
    return int(seed_t.item())


def _compile_and_run(model, inputs: tuple, grad: torch.Tensor | None, a: DemoArgs, scalars: bool = False):
    """Compile ``model`` with fluxcompile (caches off, so every graph is rewritten), run it forward and backward
    (``grad`` None: forward alone, without gradients). ``scalars``: keep ``.tolist()`` in the graph (data-dependent
    split sizes). Returns (output, report)."""
    import fluxcompile

    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._dynamo.config.patch(capture_scalar_outputs=scalars),
        torch.set_grad_enabled(grad is not None),
        fluxcompile.collect_reports() as rep,
    ):
        out = torch.compile(model, backend="fluxcompile", dynamic=a.dynamic)(*inputs)
        if grad is not None:
            out.backward(grad)
    return out, rep


def _graphs(rep) -> dict[str, int]:
    return {k: len(rep.of_kind(k)) for k in ("forward", "backward")}


def moe_args(a: DemoArgs):
    from fluxcompile.models.moe import MoEArgs

    return MoEArgs(a.dim, a.ffn, a.experts, a.top_k, a.capacity_factor, a.expert_form)


def moe_case(group, a: DemoArgs):
    """The seeded MoE case, the same on every rank of ``group``: ``(MoEArgs, full params, xs, grads)`` with every
    rank's tokens ``xs [world, tokens, dim]`` and output gradients ``grads`` alike."""
    from fluxcompile.models.moe import full_params

    dist = torch.distributed
    dtype = DTYPES[a.dtype]
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    ma = moe_args(a)
    seed = _shared_seed(a, device, group)
    params = full_params(ma, seed, dtype, device)
    g = torch.Generator().manual_seed(seed + 1)
    world = dist.get_world_size(group)
    xs = torch.randn(world, a.tokens, a.dim, generator=g).to(device, dtype)
    grads = torch.randn(world, a.tokens, a.dim, generator=g).to(device, dtype)
    return ma, params, xs, grads


def moe_reference_errors(layer, params, xs, grads, out, x_grad) -> dict[str, float]:
    """Errors of ``layer`` (this rank's ExpertParallelMoE, run on ``xs[rank]`` with output ``out``, then backward
    with ``grads[rank]`` giving ``x_grad``) against the layer in one process: ``output``, ``input grad`` and
    every parameter's gradient. The experts' gradients come from every rank's tokens, the router's (replicated)
    from this rank's alone."""
    from fluxcompile.models.moe import moe_reference
    from fluxcompile.testing.numerics import grad_errors, rel_err

    rank = layer.rank
    full = {k: v.clone().requires_grad_() for k, v in params.items()}
    xs_full = xs.clone().requires_grad_()
    single = moe_reference(full, xs_full, layer.a)
    single.backward(grads)
    own = {k: v.clone().requires_grad_(k == "router") for k, v in params.items()}
    moe_reference(own, xs[rank : rank + 1], layer.a).backward(grads[rank : rank + 1])
    mine = slice(rank * layer.local_experts, (rank + 1) * layer.local_experts)
    expected = {"router": own["router"].grad, **{k: full[k].grad[mine] for k in ("w1", "w3", "w2")}}
    return {
        "output": rel_err(out, single[rank]),
        "input grad": rel_err(x_grad, xs_full.grad[rank]),
        **grad_errors([(n, p.grad, expected[n]) for n, p in layer.named_parameters()]),
    }


def check_moe(group, a: DemoArgs) -> ModelResult:
    """Compile the expert-parallel MoE layer over ``group`` with fluxcompile; compare forward and backward with
    eager, and eager with the layer computed in one process. (``expert_form="grouped"`` compiles in bfloat16
    only: torch._grouped_mm's meta function rejects other dtypes.)"""
    from fluxcompile.models.moe import ExpertParallelMoE, dropped_copies, route
    from fluxcompile.testing.numerics import TOLERANCE, grad_errors, rel_err

    ma, params, xs, grads = moe_case(group, a)
    eager = ExpertParallelMoE(ma, group, params)
    model = ExpertParallelMoE(ma, group, params)
    rank = eager.rank
    x_eager, x_model = xs[rank].clone().requires_grad_(), xs[rank].clone().requires_grad_()

    out, rep = _compile_and_run(model, (x_model,), grads[rank], a, scalars=ma.capacity_factor is None)
    ref = eager(x_eager)
    ref.backward(grads[rank])

    pairs = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters())]
    return ModelResult(
        report=rep.format(),
        counts=_counts(rep),
        output_error=rel_err(out, ref),
        input_grad_error=rel_err(x_model.grad, x_eager.grad),
        grad_errors=grad_errors(pairs),
        reference_errors=moe_reference_errors(eager, params, xs, grads, ref, x_eager.grad),
        tolerance=TOLERANCE[xs.dtype],
        graphs=_graphs(rep),
        dropped=dropped_copies(route(xs[rank], params["router"], ma.top_k)[1], ma),
    )


def dlrm_args(a: DemoArgs):
    from fluxcompile.models.dlrm import DLRMArgs

    return DLRMArgs(
        num_tables=a.tables,
        rows_per_table=a.rows,
        dim=a.dim,
        bag_size=a.bag_size,
        dense_in=a.dense_in,
        bottom_mlp=(a.ffn,),
        top_mlp=(a.ffn, max(1, a.ffn // 2)),
        mode=a.pooling,
        interaction=a.interaction,
        padding_idx=a.padding_idx,
    )


def dlrm_case(group, a: DemoArgs):
    """The seeded DLRM case, the same on every rank of ``group``: ``(DLRMArgs, full params, dense, sparse, grads)``
    for the global batch of ``a.batch`` samples per rank (``sparse [tables, B_global, bag]``)."""
    from fluxcompile.models.dlrm import full_params, make_inputs

    dist = torch.distributed
    dtype = DTYPES[a.dtype]
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    da = dlrm_args(a)
    seed = _shared_seed(a, device, group)
    params = full_params(da, seed, dtype, device)
    batch = a.batch * dist.get_world_size(group)
    dense, sparse = make_inputs(da, batch, seed + 1, dtype, device)
    grads = torch.randn(batch, 1, generator=torch.Generator().manual_seed(seed + 2)).to(device, dtype)
    return da, params, dense, sparse, grads


def dlrm_reference_errors(model, params, dense, sparse, grads, out, dense_grad) -> dict[str, float]:
    """Errors of ``model`` (this rank's ModelParallelDLRM, run on its samples and tables with output ``out``, then
    backward with its rows of ``grads`` giving ``dense_grad``) against the model in one process: ``output``,
    ``input grad`` (of the dense features) and every parameter's gradient. The tables' gradients come from the
    whole batch, the dense part's from this rank's samples."""
    from fluxcompile.models.dlrm import dlrm_reference
    from fluxcompile.testing.numerics import grad_errors, rel_err

    rows = slice(model.rank * dense.shape[0] // model.world, (model.rank + 1) * dense.shape[0] // model.world)
    full = {k: v.clone().requires_grad_() for k, v in params.items()}
    dense_full = dense.clone().requires_grad_()
    single = dlrm_reference(full, dense_full, sparse, model.a)
    single.backward(grads)
    own = {k: v.clone().requires_grad_(k != "tables") for k, v in params.items()}
    dlrm_reference(own, dense[rows], sparse[:, rows], model.a).backward(grads[rows])
    first = model.rank * model.local_tables
    expected = {f"tables.{t}.weight": full["tables"].grad[first + t] for t in range(model.local_tables)}
    expected.update({k: v.grad for k, v in own.items() if k != "tables"})
    return {
        "output": rel_err(out, single[rows]),
        "input grad": rel_err(dense_grad, dense_full.grad[rows]),
        **grad_errors([(n, p.grad, expected[n]) for n, p in model.named_parameters()]),
    }


def check_dlrm(group, a: DemoArgs) -> ModelResult:
    """Compile the DLRM (tables sharded over ``group``) with fluxcompile; compare forward and backward with eager,
    and eager with the model computed in one process. ``a.batch`` samples per rank."""
    from fluxcompile.models.dlrm import ModelParallelDLRM
    from fluxcompile.testing.numerics import TOLERANCE, grad_errors, rel_err

    da, params, dense, sparse, grads = dlrm_case(group, a)
    eager = ModelParallelDLRM(da, group, params)
    model = ModelParallelDLRM(da, group, params)
    rank = eager.rank
    rows = slice(rank * a.batch, (rank + 1) * a.batch)
    my_sparse = sparse[rank * eager.local_tables : (rank + 1) * eager.local_tables].contiguous()
    if a.inference:
        return _dlrm_inference(model, eager, params, dense, sparse, my_sparse, rows, a)
    d_eager, d_model = dense[rows].clone().requires_grad_(), dense[rows].clone().requires_grad_()

    out, rep = _compile_and_run(model, (d_model, my_sparse), grads[rows], a)
    ref = eager(d_eager, my_sparse)
    ref.backward(grads[rows])

    pairs = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters())]
    return ModelResult(
        report=rep.format(),
        counts=_counts(rep),
        output_error=rel_err(out, ref),
        input_grad_error=rel_err(d_model.grad, d_eager.grad),
        grad_errors=grad_errors(pairs),
        reference_errors=dlrm_reference_errors(eager, params, dense, sparse, grads, ref, d_eager.grad),
        tolerance=TOLERANCE[dense.dtype],
        graphs=_graphs(rep),
    )


def _dlrm_inference(model, eager, params, dense, sparse, my_sparse, rows, a: DemoArgs) -> ModelResult:
    """check_dlrm's inference form: the forward alone under ``torch.no_grad()``, compiled vs eager and eager vs the
    model in one process (outputs only)."""
    from fluxcompile.models.dlrm import dlrm_reference
    from fluxcompile.testing.numerics import TOLERANCE, rel_err

    out, rep = _compile_and_run(model, (dense[rows], my_sparse), None, a)
    with torch.no_grad():
        ref = eager(dense[rows], my_sparse)
        single = dlrm_reference(params, dense, sparse, eager.a)
    return ModelResult(
        report=rep.format(),
        counts=_counts(rep),
        output_error=rel_err(out, ref),
        input_grad_error=0.0,
        grad_errors={},
        reference_errors={"output": rel_err(ref, single[rows])},
        tolerance=TOLERANCE[dense.dtype],
        graphs=_graphs(rep),
    )


def check_block(mesh, a: DemoArgs) -> BlockResult:
    """Compile a TP block with fluxcompile on ``mesh`` (1-D) and compare forward and backward with eager."""
    import fluxcompile
    from fluxcompile.models.llama import Block, BlockArgs, parallelize_block
    from fluxcompile.testing.numerics import TOLERANCE, grad_errors, rel_err

    dtype, device = DTYPES[a.dtype], mesh.device_type
    tp, rank = mesh.size(), mesh.get_local_rank()
    if a.sequence_parallel and a.seq % tp:
        raise ValueError(f"--seq {a.seq} must divide over {tp} ranks")
    # Same weights and inputs on every rank; fresh ones each run unless a seed is given.
    seed = a.seed if a.seed is not None else int(time.time_ns() % 2**31)
    seed_t = torch.tensor([seed], device=device)
    torch.distributed.broadcast(seed_t, src=mesh.mesh.flatten()[0].item(), group=mesh.get_group())
    torch.manual_seed(int(seed_t.item()))

    eager = Block(BlockArgs(dim=a.dim, n_heads=a.heads, ffn_dim=a.ffn, bias=a.bias)).to(device, dtype)
    model = copy.deepcopy(eager)
    parallelize_block(eager, mesh, a.sequence_parallel)
    parallelize_block(model, mesh, a.sequence_parallel)
    x = torch.randn(a.batch, a.seq, a.dim, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    if a.sequence_parallel:
        x, grad = x.chunk(tp, dim=1)[rank], grad.chunk(tp, dim=1)[rank]
    x_eager, x_model = x.clone().requires_grad_(), x.clone().requires_grad_()

    with (
        torch._inductor.config.patch(fx_graph_cache=False),  # rewrite for real, so the report is complete
        torch._functorch.config.patch(enable_autograd_cache=False),
        fluxcompile.collect_reports() as rep,
    ):
        out = torch.compile(model, backend="fluxcompile", dynamic=a.dynamic)(x_model)
        out.backward(grad)
    ref = eager(x_eager)
    ref.backward(grad)

    pairs = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters())]
    return BlockResult(
        report=rep.format(),
        counts={k: {op: rep.count(op, k) for op in FUSED} for k in ("forward", "backward")},
        output_error=rel_err(out, ref),
        input_grad_error=rel_err(x_model.grad, x_eager.grad),
        grad_errors=grad_errors(pairs),
        tolerance=TOLERANCE[dtype],
    )


def demo_rank(a: DemoArgs) -> BlockResult | ModelResult:
    """Runs on every rank of the pool."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if a.model == "moe":
        return check_moe(dist.group.WORLD, a)
    if a.model == "dlrm":
        return check_dlrm(dist.group.WORLD, a)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return check_block(init_device_mesh(device, (dist.get_world_size(),)), a)


DESCRIPTION = (
    "Compile a sharded model with fluxcompile and check it against eager. The demo starts its own ranks (gloo on "
    "CPU, NCCL when there is one GPU per rank), builds the model on every rank, compiles it with "
    "backend='fluxcompile', and prints the rewrite report and the largest relative error of the output and of "
    "every gradient. The models: a Llama block sharded with PyTorch's tensor-parallel API (llama), an "
    "expert-parallel MoE layer with all-to-all dispatch and combine (moe), and a DLRM whose embedding tables are "
    "sharded over the ranks (dlrm); moe and dlrm are also checked against the same model computed in one process."
)

DLRM_BATCH = 16  # --batch's default for dlrm: samples per rank


def parser() -> argparse.ArgumentParser:
    """The demo's command line; every option says what it sets and its default."""
    d = DemoArgs()
    p = argparse.ArgumentParser(prog="python -m fluxcompile demo", description=DESCRIPTION)
    p.add_argument(
        "--model",
        choices=MODELS,
        default=d.model,
        help="the model: a TP Llama block, an expert-parallel MoE layer or a DLRM with sharded tables "
        "(default: %(default)s)",
    )
    p.add_argument("--world-size", type=int, default=d.world_size, help="number of ranks (default: %(default)s)")
    p.add_argument(
        "--dim", type=int, default=d.dim, help="model dimension; for dlrm the embedding dim (default: %(default)s)"
    )
    p.add_argument(
        "--heads",
        type=int,
        default=d.heads,
        help="attention heads, a multiple of the world size (llama; default: %(default)s)",
    )
    p.add_argument(
        "--ffn",
        type=int,
        default=d.ffn,
        help="feed-forward hidden size; for moe each expert's, for dlrm the MLPs' width (default: %(default)s)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"batch size; for dlrm samples per rank (default: {d.batch}, dlrm: {DLRM_BATCH})",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=d.seq,
        help="sequence length before sharding, a multiple of the world size (llama; default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="dtype of weights and inputs (default: float32 over gloo, bfloat16 over NCCL and for moe's grouped "
        "experts, whose torch._grouped_mm compiles in bfloat16 only)",
    )
    p.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="pass replicated activations between the block's parts, so its collectives are all-reduces "
        "(llama; default: activations sharded along the sequence, with all-gathers and reduce-scatters)",
    )
    p.add_argument("--bias", action="store_true", help="give the linear layers a bias (llama; default: no bias)")
    moe = p.add_argument_group("moe", "options of the expert-parallel MoE layer (--model moe)")
    moe.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank (default: %(default)s)")
    moe.add_argument(
        "--experts",
        type=int,
        default=d.experts,
        help="experts in all, a multiple of the world size (default: %(default)s)",
    )
    moe.add_argument("--top-k", type=int, default=d.top_k, help="experts per token (default: %(default)s)")
    moe.add_argument(
        "--capacity-factor",
        type=float,
        default=d.capacity_factor,
        help="give each expert ceil(factor * tokens * top-k / experts) slots per rank and drop the copies beyond "
        "them, with equal all-to-all splits (GShard); without it the layer is dropless, with split sizes read from "
        "the routing (torchtitan) (default: dropless)",
    )
    moe.add_argument(
        "--expert-form",
        choices=("grouped", "bmm", "loop"),
        default=d.expert_form,
        help="how the experts' matmuls are written: torch._grouped_mm, torch.bmm (with --capacity-factor only) or "
        "one mm per expert (default: %(default)s)",
    )
    dlrm = p.add_argument_group("dlrm", "options of the DLRM (--model dlrm)")
    dlrm.add_argument(
        "--tables", type=int, default=d.tables, help="embedding tables, a multiple of the world size (default: %(default)s)"
    )
    dlrm.add_argument("--rows", type=int, default=d.rows, help="rows of each table (default: %(default)s)")
    dlrm.add_argument(
        "--bag-size", type=int, default=d.bag_size, help="indices pooled per sample and table (default: %(default)s)"
    )
    dlrm.add_argument("--dense-in", type=int, default=d.dense_in, help="dense features (default: %(default)s)")
    dlrm.add_argument(
        "--pooling", choices=("sum", "mean"), default=d.pooling, help="embedding bag pooling (default: %(default)s)"
    )
    dlrm.add_argument(
        "--padding-idx", type=int, default=d.padding_idx, help="the tables' padding index (default: none)"
    )
    dlrm.add_argument(
        "--inference",
        action="store_true",
        help="run the forward alone, without gradients: the inference form (default: a training step)",
    )
    dlrm.add_argument(
        "--interaction",
        choices=("dot", "cat"),
        default=d.interaction,
        help="feature interaction: pairwise dot products or concatenation (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the weights and inputs, the same on every rank (default: a fresh one each run)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="process-group backend; auto picks nccl when there is one GPU per rank, else gloo (default: auto)",
    )
    return p


def parse(argv: list[str]) -> tuple[DemoArgs, str]:
    """The demo's arguments and the process-group backend it runs over."""
    ns = parser().parse_args(argv)
    backend = ns.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= max(ns.world_size, 2) else "gloo"
    grouped = ns.model == "moe" and ns.expert_form == "grouped"
    dtype = ns.dtype or ("bfloat16" if backend == "nccl" or grouped else "float32")
    batch = ns.batch if ns.batch is not None else (DLRM_BATCH if ns.model == "dlrm" else DemoArgs.batch)
    args = DemoArgs(
        ns.world_size, ns.dim, ns.heads, ns.ffn, batch, ns.seq, dtype, ns.sequence_parallel, ns.bias, ns.seed
    )
    args.model = ns.model
    args.tokens, args.experts, args.top_k = ns.tokens, ns.experts, ns.top_k
    args.capacity_factor, args.expert_form = ns.capacity_factor, ns.expert_form
    args.tables, args.rows, args.bag_size, args.dense_in = ns.tables, ns.rows, ns.bag_size, ns.dense_in
    args.pooling, args.interaction, args.inference = ns.pooling, ns.interaction, ns.inference
    args.padding_idx = ns.padding_idx
    return args, backend


def backend_error(backend: str, world_size: int) -> str | None:
    """Why the ranks cannot start over ``backend`` on this machine, checked before any rank starts."""
    if world_size < 1:
        return f"--world-size must be at least 1, not {world_size}"
    gpus = torch.cuda.device_count()
    if backend == "nccl" and gpus < world_size:
        return f"--backend nccl needs one GPU per rank: {world_size} ranks, {gpus} GPU(s) visible"
    return None


def _multiple(name: str, value: int, by: int, by_name: str, why: str) -> list[str]:
    """``[sentence]`` when ``value`` (option ``name``) is not a multiple of ``by`` (option ``by_name``), else []."""
    if by < 1 or value % by == 0:
        return []
    return [f"{name} {value} must be a multiple of {f'{by_name} ' if by_name else ''}{by} ({why})"]


def size_errors(a: DemoArgs) -> list[str]:
    """Every size the chosen model's sharding cannot take, one sentence each (checked before any rank starts)."""
    world = a.world_size
    sizes = {"--dim": a.dim, "--ffn": a.ffn, "--batch": a.batch}
    if a.model == "llama":
        sizes.update({"--heads": a.heads, "--seq": a.seq})
    if a.model == "moe":
        sizes.update({"--tokens": a.tokens, "--experts": a.experts})
    if a.model == "dlrm":
        sizes.update({"--tables": a.tables, "--rows": a.rows, "--bag-size": a.bag_size, "--dense-in": a.dense_in})
    errors = [f"{name} must be at least 1, not {value}" for name, value in sizes.items() if value < 1]
    if errors:
        return errors
    if a.model == "llama":
        errors += _multiple("--dim", a.dim, a.heads, "--heads", "every head has dim / heads features")
        errors += _multiple("--heads", a.heads, world, "--world-size", "tensor parallelism gives each rank whole heads")
        errors += _multiple("--ffn", a.ffn, world, "--world-size", "the feed-forward layers are sharded on it")
        if a.sequence_parallel:
            errors += _multiple("--seq", a.seq, world, "--world-size", "sequence parallelism shards it")
    if a.model == "moe":
        errors += _multiple("--experts", a.experts, world, "--world-size", "each rank holds experts / world-size")
        if not 1 <= a.top_k <= a.experts:
            errors.append(f"--top-k {a.top_k} must be between 1 and --experts {a.experts}")
        if a.expert_form == "grouped":
            # torch._grouped_mm takes rows whose stride is a multiple of 16 bytes.
            align = 16 // DTYPES[a.dtype].itemsize
            errors += _multiple("--dim", a.dim, align, "", f"torch._grouped_mm's 16-byte rows in {a.dtype}")
            errors += _multiple("--ffn", a.ffn, align, "", f"torch._grouped_mm's 16-byte rows in {a.dtype}")
    if a.model == "dlrm":
        errors += _multiple("--tables", a.tables, world, "--world-size", "each rank holds tables / world-size")
    return errors


def model_error(a: DemoArgs) -> str | None:
    """Why the model cannot be built with these options, in one line, checked before any rank starts."""
    errors = size_errors(a)
    if a.model == "moe":
        if a.expert_form == "bmm" and a.capacity_factor is None:
            errors.append("--expert-form bmm needs --capacity-factor (a dropless layer's experts get uneven groups)")
        if a.capacity_factor is not None and a.capacity_factor <= 0:
            errors.append(f"--capacity-factor must be positive, not {a.capacity_factor}")
        if a.expert_form == "grouped" and a.dtype != "bfloat16":
            errors.append(f"--expert-form grouped compiles in bfloat16 only (torch._grouped_mm), not {a.dtype}")
    return "; ".join(errors) or None


def headline(a: DemoArgs, backend: str) -> str:
    if a.model == "moe":
        drops = f"capacity factor {a.capacity_factor:g}" if a.capacity_factor is not None else "dropless"
        return (
            f"MoE layer dim={a.dim} ffn={a.ffn} experts={a.experts} top-k={a.top_k} {drops}, {a.expert_form} experts, "
            f"{a.tokens} tokens per rank, {a.dtype}, EP={a.world_size} over {backend}"
        )
    if a.model == "dlrm":
        return (
            f"DLRM tables={a.tables}x{a.rows} dim={a.dim} bag={a.bag_size} ({a.pooling}) dense-in={a.dense_in} "
            f"mlp={a.ffn} {a.interaction} interaction, batch {a.batch} per rank, {a.dtype}, tables over "
            f"{a.world_size} ranks over {backend}"
        )
    sp = "with" if a.sequence_parallel else "without"
    return (
        f"Llama block dim={a.dim} heads={a.heads} ffn={a.ffn} batch={a.batch} seq={a.seq} "
        f"{a.dtype}, TP={a.world_size} over {backend}, {sp} sequence parallelism"
    )


def launch(a: DemoArgs, backend: str) -> list[BlockResult | ModelResult]:
    """Run the check on ``a.world_size`` new ranks; a rank that dies ends it at once with RankDied."""
    from fluxcompile.testing import RankPool

    with RankPool(a.world_size, backend, timeout_s=900) as pool:
        return pool.run(demo_rank, a)


def main(argv: list[str]) -> int:
    from fluxcompile.testing.ranks import RankDied

    a, backend = parse(argv)
    error = backend_error(backend, a.world_size) or model_error(a)
    if error:
        print(f"fluxcompile demo: {error}", file=sys.stderr)
        return 2
    print(f"fluxcompile demo: {headline(a, backend)}", flush=True)
    start = time.time()
    try:
        results = launch(a, backend)
    except RankDied as e:
        print(f"fluxcompile demo: {e.summary}", file=sys.stderr)
        return 1
    r0 = results[0]
    print("\nrewrite report (rank 0):")
    print(r0.report)
    if any(r.counts != r0.counts for r in results):
        print("ERROR: ranks rewrote their graphs differently:", [r.counts for r in results])
        return 1
    print(f"\nnumerics vs eager (relative error, bound {r0.tolerance:.0e}):")
    print(f"{'rank':>4} {'output':>10} {'input grad':>10} {'worst param grad':>28}")
    for rank, r in enumerate(results):
        worst = max(r.grad_errors.items(), key=lambda kv: kv[1], default=("no gradients: --inference", 0.0))
        print(f"{rank:>4} {r.output_error:10.2e} {r.input_grad_error:10.2e} {worst[1]:10.2e} ({worst[0]})")
    if isinstance(r0, ModelResult):
        print(f"\neager vs the model in one process (relative error, bound {r0.tolerance:.0e}):")
        print(f"{'rank':>4} {'output':>10} {'input grad':>10} {'worst param grad':>28}")
        for rank, r in enumerate(results):
            e = dict(r.reference_errors)
            out, inp = e.pop("output"), e.pop("input grad", 0.0)
            worst = max(e.items(), key=lambda kv: kv[1], default=("no gradients: --inference", 0.0))
            dropped = f"  {r.dropped} token copies dropped" if a.capacity_factor is not None and a.model == "moe" else ""
            print(f"{rank:>4} {out:10.2e} {inp:10.2e} {worst[1]:10.2e} ({worst[0]}){dropped}")
    ok = all(r.ok for r in results)
    what = f"compiled output and gradients {'match' if ok else 'differ from'} eager"
    if isinstance(r0, ModelResult):
        what = f"compiled output and gradients vs eager, eager vs one process: {'all match' if ok else 'a mismatch'}"
    print(f"\n{'OK' if ok else 'MISMATCH'}: {what} ({time.time() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
