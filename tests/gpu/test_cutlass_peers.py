"""The CUTLASS choices (lowerings/*/cutlass.py) between the GPUs of this machine, one process per GPU: each
registered ``cutlass:<variant>`` against the op's reference (NCCL + cuBLAS) on fresh inputs in poisoned memory,
repeatedly, with shapes alternating without synchronization, in CUDA graphs and on a second group. Every wait
error is checked after every call (``config.check_signals``), so a timed-out wait fails the call that had it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import assert_on_every_rank, poison_allocator, shared_seed

from fluxcompile import config, ops
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import cutlass_gemm, sequencer
from fluxcompile.lowerings.choices import choice_named
from fluxcompile.testing.numerics import assert_close

BF16 = torch.bfloat16
pytestmark = [
    pytest.mark.peers,
    pytest.mark.skipif(cutlass_gemm.unavailable() is not None, reason=f"CUTLASS: {cutlass_gemm.unavailable()}"),
]
DATA_PARALLEL = [name for name, v in cutlass_gemm.VARIANTS.items() if not v.stream_k]
STREAM_K = [name for name, v in cutlass_gemm.VARIANTS.items() if v.stream_k]
PING_PONG = [name for name, v in cutlass_gemm.VARIANTS.items() if v.schedule == "pp"]
AG_VARIANTS = [DATA_PARALLEL[0], PING_PONG[0], STREAM_K[0]]
RS_VARIANTS = [cutlass_gemm.ring_variants()[0], cutlass_gemm.ring_variants()[-1]]  # built with the ring's source

# shard shape, gather dim, weight widths, bias
AG_CASES = {
    "plain": ((512, 256), 0, (384,), False),
    "qkv-ragged-bias": ((333, 200), 0, (96, 40, 264), True),  # rows not a multiple of any tile, three weights
    "sp": ((1, 77, 128), 1, (128, 64), True),  # sequence parallel: [1, S/w, K] gathered on the sequence dim
    "large": ((2048, 1024), 0, (1536,), False),  # several chunks of several tiles each
}
# rows per rank (or all rows for "columns"), out form, N (per rank for "columns"), K, bias, reduce op; a rank's
# chunk is whole clusters of tiles of every ring variant (512 rows, 256 columns: lowerings' rs.chunk_declines)
RS_CASES = {
    "rows-bias": (512, "2d", 264, 256, True, "sum"),
    "sp-avg": (512, "sp", 128, 128, True, "avg"),
    "columns": (200, "cols", 256, 192, True, "sum"),  # last-dim reduce-scatter
    "large": (1024, "2d", 1536, 1024, False, "sum"),
}


@pytest.fixture(autouse=True)
def _enabled():
    cutlass_gemm.load()  # built before any rank waits on another
    sequencer.sequencer()  # the pipelined module: the all-gather's sequence
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=True, wait_timeout_s=10.0):
        yield


def _choice(op: str, variant: str):
    choice = choice_named(op, f"cutlass:{variant}")
    assert choice is not None, f"no launch cutlass:{variant} of {op}"
    return choice


def _ag_args(case: str, group, seed: int):
    shape, dim, ns, bias = AG_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
    A = torch.randn(shape, device="cuda", dtype=BF16, generator=g)
    k = shape[-1]
    Bs = [torch.randn(k, n, device="cuda", dtype=BF16, generator=g) / k**0.5 for n in ns]
    Bs = [b.t().contiguous().t() if i % 2 else b for i, b in enumerate(Bs)]  # nn.Linear layout too
    biases = [torch.randn(n, device="cuda", dtype=BF16, generator=g) if bias else None for n in ns]
    return (A, Bs, biases, dim, group.size(), group.group_name)


def _rs_args(case: str, group, seed: int):
    rows, form, n, k, bias, reduce_op = RS_CASES[case]
    w = group.size()
    out_shape, dim = {"2d": ([w * rows, n], 0), "sp": ([1, w * rows, n], 1), "cols": ([rows, w * n], 1)}[form]
    m = out_shape[-2]
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
    A = torch.randn(m, k, device="cuda", dtype=BF16, generator=g)
    B = torch.randn(k, out_shape[-1], device="cuda", dtype=BF16, generator=g) / k**0.5
    if dist.get_rank() % 2:
        B = B.t().contiguous().t()  # rank 1 an nn.Linear-style weight
    b = torch.randn(out_shape[-1], device="cuda", dtype=BF16, generator=g) if bias else None
    return ([A], [B], b, out_shape, dim, reduce_op, w, group.group_name)


def _operands(args) -> list[torch.Tensor]:
    """The call's activation operands: A (all-gather) or the list of As (reduce-scatter)."""
    return args[0] if isinstance(args[0], list) else [args[0]]


def _refresh(args) -> None:
    """Fresh values in the same tensors (what a CUDA graph replays on)."""
    for t in _operands(args):
        t.normal_()


def _snapshot(args) -> tuple:
    """The call's arguments with copies of its activation operands (the next refresh overwrites them in place)."""
    copies = [t.clone() for t in _operands(args)]
    return (copies if isinstance(args[0], list) else copies[0], *args[1:])


def _supported(choice, args) -> None:
    why = choice.supports(*args)
    assert_on_every_rank(None if why is None else f"{choice.name} declines: {why}")


def _check(op: str, got, args, what: str) -> None:
    ref = ops.REFERENCES[op](*args)
    error = None
    try:
        if op == "all_gather_matmul":
            assert torch.equal(got[0], ref[0]), f"{what}: the gathered A"
            for i, (o, r) in enumerate(zip(got[1], ref[1])):
                assert o.shape == r.shape and o.stride() == r.stride(), f"{what}: output {i}'s layout"
                assert_close(o, r, 1e-2, f"{what}: output {i}")
        else:
            assert got.shape == ref.shape and got.stride() == ref.stride(), f"{what}: layout"
            assert_close(got, ref, 1e-2, what)
    except AssertionError as e:
        error = str(e)
    assert_on_every_rank(error)


OP_CASES = [("all_gather_matmul", v, c) for v in AG_VARIANTS for c in AG_CASES] + [
    ("matmul_reduce_scatter", v, c) for v in RS_VARIANTS for c in RS_CASES
]


@pytest.mark.parametrize(("op", "variant", "case"), OP_CASES)
def test_choice_matches_reference(op, variant, case):
    choice = _choice(op, variant)
    args = (_ag_args if op == "all_gather_matmul" else _rs_args)(case, dist.group.WORLD, shared_seed())
    _supported(choice, args)
    for call in range(4):  # repeated calls reuse the workspace and flags: stale data must never show
        poison_allocator(1 << 28)
        if call == 2 and dist.get_rank() == 1:
            torch.cuda._sleep(20_000_000)  # a late peer: the waits must hold, not read early
        got = choice.fn(*args)
        _check(op, got, args, f"{choice.name} {case} call {call}")
        _refresh(args)


@pytest.mark.parametrize(
    ("op", "variant"), [("all_gather_matmul", AG_VARIANTS[0]), ("matmul_reduce_scatter", RS_VARIANTS[0])]
)
def test_alternating_shapes_without_sync(op, variant):
    """Calls of two shapes back to back, no host synchronization between them: the done handshake must keep a
    fast rank off slots its peer still reads."""
    choice = _choice(op, variant)
    make, cases = (
        (_ag_args, ("qkv-ragged-bias", "large")) if op == "all_gather_matmul" else (_rs_args, ("rows-bias", "large"))
    )
    seed = shared_seed()
    both = [make(c, dist.group.WORLD, seed + i) for i, c in enumerate(cases)]
    for args in both:
        _supported(choice, args)
        choice.fn(*args)  # the workspace at its largest
    torch.cuda.synchronize()
    with config.patch(check_signals=False):  # no synchronization between the calls
        outs = []
        for i in range(6):
            args = both[i % 2]
            _refresh(args)
            snapshot = _snapshot(args)
            outs.append((choice.fn(*args), snapshot))
    torch.cuda.synchronize()
    for i, (got, snapshot) in enumerate(outs):
        _check(op, got, snapshot, f"{choice.name} call {i}")


@pytest.mark.parametrize(
    ("op", "variant"),
    [("all_gather_matmul", v) for v in AG_VARIANTS] + [("matmul_reduce_scatter", v) for v in RS_VARIANTS],
)
def test_in_cuda_graph(op, variant):
    choice = _choice(op, variant)
    args = (_ag_args("qkv-ragged-bias", dist.group.WORLD, shared_seed()) if op == "all_gather_matmul"
            else _rs_args("rows-bias", dist.group.WORLD, shared_seed()))  # fmt: skip
    _supported(choice, args)
    choice.fn(*args)  # outside capture: workspaces, flags, error buffers
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = choice.fn(*args)
    outs = [*static[1], static[0]] if op == "all_gather_matmul" else [static]
    for replay in range(5):
        _refresh(args)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        _check(op, static, args, f"{choice.name} replay {replay}")
    _refresh(args)
    _check(op, choice.fn(*args), args, f"{choice.name} eager after the replays")


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_second_group(op):
    """A second group over the same ranks has workspaces and flags of its own; calls alternate between them."""
    variant = AG_VARIANTS[0] if op == "all_gather_matmul" else RS_VARIANTS[0]
    choice = _choice(op, variant)
    other = dist.new_group(list(range(dist.get_world_size())))
    seed = shared_seed()
    for i, g in enumerate((dist.group.WORLD, other, dist.group.WORLD, other)):
        args = _ag_args("sp", g, seed + i) if op == "all_gather_matmul" else _rs_args("sp-avg", g, seed + i)
        _supported(choice, args)
        _check(op, choice.fn(*args), args, f"{choice.name} group {g.group_name}")


@pytest.mark.parametrize("variant", [DATA_PARALLEL[0], "128x256x64_c2x1_sk"])
def test_without_the_gathered_operand(variant):
    """``return_A=False``: no gathered operand, the same products; rows a multiple of the tile (ours read in place)
    and ragged."""
    choice = _choice("all_gather_matmul", variant)
    for case in ("plain", "qkv-ragged-bias"):
        args = _ag_args(case, dist.group.WORLD, shared_seed())
        _supported(choice, args)
        poison_allocator(1 << 28)
        got = choice.fn(*args, return_A=False)
        assert_on_every_rank(None if got[0] is None else f"{choice.name}: a gathered operand returned unasked")
        _check("all_gather_matmul", (ops.REFERENCES["all_gather_matmul"](*args)[0], got[1]), args, f"{case} no A")


class _SequenceParallelMlp(torch.nn.Module):
    """all-gather of the sequence -> column-parallel matmul -> GELU -> row-parallel matmul -> reduce-scatter of
    the sequence, as torch's funcol collectives (what the graph pass matches)."""

    def __init__(self, k: int, hidden: int, group, seed: int):
        super().__init__()
        w = group.size()
        g = torch.Generator(device="cuda").manual_seed(seed)
        up = torch.randn(k, hidden, device="cuda", dtype=BF16, generator=g) / k**0.5
        down = torch.randn(hidden, k, device="cuda", dtype=BF16, generator=g) / hidden**0.5
        r = group.rank()
        self.up = torch.nn.Parameter(up.chunk(w, dim=1)[r].contiguous())
        self.down = torch.nn.Parameter(down.chunk(w, dim=0)[r].contiguous())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        full = funcol.all_gather_tensor(x, 0, self.group)
        h = torch.nn.functional.gelu(full @ self.up)
        return funcol.reduce_scatter_tensor(h @ self.down, "sum", 0, self.group)


@pytest.mark.parametrize("rows", [256, 200])
def test_compiled_model_with_the_cutlass_choices(rows, tmp_path, monkeypatch):
    """A sequence-parallel MLP compiled with every site's fused op on its first CUTLASS choice (no autotuning, no
    compile-time choice): under ``mode="reduce-overhead"`` replayed with fresh inputs (no gathered operand kept:
    inference), then a training step's forward and backward against eager (the backward reads the gathered
    operand)."""
    import fluxcompile

    monkeypatch.setattr(fluxcompile.config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(fluxcompile.config, "implementations", ("cutlass",))
    monkeypatch.setattr(fluxcompile.config, "autotune", False)
    monkeypatch.setattr(fluxcompile.config, "choose_at_compile", "never")
    group = dist.group.WORLD
    seed = shared_seed()
    model = _SequenceParallelMlp(512, 1024, group, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1 + dist.get_rank())
    x = torch.randn(rows, 512, device="cuda", dtype=BF16, generator=g)
    errors = []
    torch._dynamo.reset()
    try:
        with fluxcompile.collect_reports() as rep:
            compiled = torch.compile(model, backend="fluxcompile", mode="reduce-overhead", dynamic=False)
            with torch.no_grad():
                for step in range(6):
                    x.copy_(torch.randn(x.shape, device="cuda", dtype=BF16, generator=g))
                    out = compiled(x).clone()
                    err = float((out.float() - model(x).float()).norm() / model(x).float().norm())
                    if not err <= 1e-2:
                        errors.append(f"rows {rows} inference step {step}: relative error {err:.3e}")
        fused = [e for e in rep.entries() if e.fused]
        if len(fused) != 2:
            errors.append(f"{len(fused)} fused sites, expected 2:\n{rep.format()}")
        torch._dynamo.reset()
        trained = torch.compile(model, backend="fluxcompile", dynamic=False)
        xm, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        gy = torch.randn(x.shape, device="cuda", dtype=BF16, generator=g)
        trained(xm).backward(gy)
        grads = [xm.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(xe).backward(gy)
        for name, a, b in zip(["x", "up", "down"], grads, [xe.grad, model.up.grad, model.down.grad]):
            err = float((a.float() - b.float()).norm() / b.float().norm())
            if not err <= 1e-2:
                errors.append(f"rows {rows} training: grad of {name} relative error {err:.3e}")
    finally:
        torch._dynamo.reset()
    assert_on_every_rank("\n".join(errors) or None)
