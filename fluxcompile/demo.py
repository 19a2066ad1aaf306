"""``python -m fluxcompile demo``: a TP Llama block compiled with fluxcompile, checked against eager.

Starts its own ranks (gloo on CPU, NCCL when enough GPUs are visible), parallelizes the block with
PyTorch's TP API as torchtitan does, compiles it with ``backend="fluxcompile"``, prints the rewrite
report and the largest relative error of the output and of every gradient.
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


def check_block(mesh, a: DemoArgs) -> BlockResult:
    """Compile a TP block with fluxcompile on ``mesh`` (1-D) and compare forward and backward with eager."""
    import fluxcompile
    from fluxcompile.models.llama import Block, BlockArgs, parallelize_block
    from fluxcompile.testing.numerics import TOLERANCE, grad_errors, rel_err

    dtype, device = DTYPES[a.dtype], mesh.device_type
    tp, rank = mesh.size(), mesh.get_local_rank()
    if a.seq % tp:
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


def demo_rank(a: DemoArgs) -> BlockResult:
    """Runs on every rank of the pool."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return check_block(init_device_mesh(device, (dist.get_world_size(),)), a)


DESCRIPTION = (
    "Compile a tensor-parallel Llama block with fluxcompile and check it against eager. The demo starts its "
    "own ranks (gloo on CPU, NCCL when there is one GPU per rank), shards the block with PyTorch's tensor-parallel "
    "API, compiles it with backend='fluxcompile', and prints the rewrite report and the largest relative error "
    "of the output and of every gradient."
)


def parser() -> argparse.ArgumentParser:
    """The demo's command line; every option says what it sets and its default."""
    d = DemoArgs()
    p = argparse.ArgumentParser(prog="python -m fluxcompile demo", description=DESCRIPTION)
    p.add_argument("--world-size", type=int, default=d.world_size, help="number of ranks (default: %(default)s)")
    p.add_argument("--dim", type=int, default=d.dim, help="model dimension (default: %(default)s)")
    p.add_argument(
        "--heads",
        type=int,
        default=d.heads,
        help="attention heads, a multiple of the world size (default: %(default)s)",
    )
    p.add_argument("--ffn", type=int, default=d.ffn, help="feed-forward hidden size (default: %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="batch size (default: %(default)s)")
    p.add_argument(
        "--seq",
        type=int,
        default=d.seq,
        help="sequence length before sharding, a multiple of the world size (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="dtype of weights and inputs (default: float32 over gloo, bfloat16 over NCCL)",
    )
    p.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="pass replicated activations between the block's parts, so its collectives are all-reduces "
        "(default: activations sharded along the sequence, with all-gathers and reduce-scatters)",
    )
    p.add_argument("--bias", action="store_true", help="give the linear layers a bias (default: no bias)")
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
    dtype = ns.dtype or ("bfloat16" if backend == "nccl" else "float32")
    args = DemoArgs(
        ns.world_size, ns.dim, ns.heads, ns.ffn, ns.batch, ns.seq, dtype, ns.sequence_parallel, ns.bias, ns.seed
    )
    return args, backend


def backend_error(backend: str, world_size: int) -> str | None:
    """Why the ranks cannot start over ``backend`` on this machine, checked before any rank starts."""
    if world_size < 1:
        return f"--world-size must be at least 1, not {world_size}"
    gpus = torch.cuda.device_count()
    if backend == "nccl" and gpus < world_size:
        return f"--backend nccl needs one GPU per rank: {world_size} ranks, {gpus} GPU(s) visible"
    return None


def launch(a: DemoArgs, backend: str) -> list[BlockResult]:
    """Run the check on ``a.world_size`` new ranks; a rank that dies ends it at once with RankDied."""
    from fluxcompile.testing import RankPool

    with RankPool(a.world_size, backend, timeout_s=900) as pool:
        return pool.run(demo_rank, a)


def main(argv: list[str]) -> int:
    from fluxcompile.testing.ranks import RankDied

    a, backend = parse(argv)
    error = backend_error(backend, a.world_size)
    if error:
        print(f"fluxcompile demo: {error}", file=sys.stderr)
        return 2
    sp = "with" if a.sequence_parallel else "without"
    print(
        f"fluxcompile demo: Llama block dim={a.dim} heads={a.heads} ffn={a.ffn} batch={a.batch} seq={a.seq} "
        f"{a.dtype}, TP={a.world_size} over {backend}, {sp} sequence parallelism",
        flush=True,
    )
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
        worst = max(r.grad_errors.items(), key=lambda kv: kv[1])
        print(f"{rank:>4} {r.output_error:10.2e} {r.input_grad_error:10.2e} {worst[1]:10.2e} ({worst[0]})")
    ok = all(r.ok for r in results)
    print(
        f"\n{'OK' if ok else 'MISMATCH'}: compiled output and gradients {'match' if ok else 'differ from'} eager "
        f"({time.time() - start:.0f} s)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
