"""The CUTLASS choices' protocols (lowerings/*/cutlass.py) between ranks simulated on one GPU
(fluxcompile/testing/one_gpu_ranks.py: each rank its own streams and SM share, symmetric workspaces as slices
of one allocation), and the launcher alone (kernels/cutlass_gemm.py) against torch.

Per world size and variant: fresh random inputs per call, outputs never written before (a poisoned allocator;
NaN-filled before each replay), rows not a multiple of the tile, fp32 references; several eager calls, one with
a rank's launch delayed, then a CUDA graph of every rank's call replayed with new inputs copied into the captured
ones. Every process of scripts/gpu-check runs them on its own GPU (nothing here talks between processes)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from gpu_helpers import poison_allocator

from fluxcompile import config
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import cutlass_gemm, sequencer
from fluxcompile.lowerings.all_gather_matmul import cutlass as ag
from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as rs
from fluxcompile.testing import launches
from fluxcompile.testing.numerics import TOLERANCE, assert_close
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks
from fluxcompile.testing.ring_schedule import RingCall, simulate

pytestmark = pytest.mark.skipif(
    cutlass_gemm.unavailable() is not None, reason=f"CUTLASS kernels: {cutlass_gemm.unavailable()}"
)

BF16 = torch.bfloat16
TOL = TOLERANCE[BF16]
ROWS, K, N, N2 = 200, 512, 768, 256  # rows per rank not a multiple of any tile
IN_PLACE_ROWS = 256  # a multiple of every tile's M: the all-gather's GEMMs read our rows where they are
WORLDS = (2, 4, 8)
DATA_PARALLEL = [name for name in cutlass_gemm.variants() if not cutlass_gemm.VARIANTS[name].stream_k]
STREAM_K = [name for name in cutlass_gemm.variants() if cutlass_gemm.VARIANTS[name].stream_k]
AG_VARIANTS = [DATA_PARALLEL[0], *STREAM_K[:1]]  # one persistent, one stream-K
RS_VARIANTS = [cutlass_gemm.ring_variants()[0], cutlass_gemm.ring_variants()[-1]]  # built with the ring's source
# rows per rank: whole clusters of tiles of every ring variant (the ring's chunks are: rs.chunk_declines); at 8 ranks
# each rank's GEMM takes several tiles per CTA on its share of the SMs, as between GPUs
RS_ROWS = 512
EAGER_CALLS, REPLAYS = 3, 3


def _queues(world: int) -> None:
    """Each simulated rank's two streams need hardware queues of their own: streams sharing one wait for each
    other's kernels, so a rank's pushes would queue behind a peer's GEMM that waits for them."""
    if int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")) < 2 * world + 4:
        pytest.skip(f"CUDA_DEVICE_MAX_CONNECTIONS < {2 * world + 4} (scripts/gpu-check sets 32)")


@pytest.fixture(autouse=True)
def _bounded():
    """Kernel waits give up after 5 s (an error, not a hang); the flags stay as in production. The extensions are
    built first (the GEMM's, and the pipelined module, whose sequence issues the all-gather's calls): the
    simulated ranks' host calls run on threads, which would build them while a peer waits.

    The all-gather's C++ sequence runs directly, never captured as a graph of its own (``sequence_graphs=0``):
    on one GPU a capture at a signature's second sight may wait for the device, where the peers' queued GEMMs
    wait for this rank's pushes, which come after it (with replays on, 2 of 12 all-gather cases here timed out
    so). Between GPUs no rank's device holds another's work: the replays run in tests/gpu/test_cutlass_peers.py
    and test_sequence_replays.py; the graphs of every rank's call below are torch's captures."""
    cutlass_gemm.load()
    sequencer.sequencer()
    with config.patch(
        implementations=IMPLEMENTATIONS, wait_timeout_s=5.0, check_signals=False, sequence_graphs=0
    ):
        yield


def _run(ranks: OneGpuRanks, fn, describe=None, **kwargs):
    """``ranks.run``; a hang ends the process after printing every rank's flags (``describe(comm)``, read on a
    stream of their own)."""
    try:
        return ranks.run(fn, timeout_s=90.0, **kwargs)
    except TimeoutError as e:  # streams blocked on a flag cannot be cancelled: end the process
        sys.stderr.write(f"\n{e}\n")
        for r in range(ranks.world) if describe is not None else ():
            try:
                sys.stderr.write(f"rank {r}: {describe(ranks.comm(r))}\n")
            except Exception as why:
                sys.stderr.write(f"rank {r}: no report ({why})\n")
        sys.stderr.flush()
        os._exit(1)


def _replay(ranks: OneGpuRanks, graph: torch.cuda.CUDAGraph) -> None:
    graph.replay()
    try:
        ranks.wait(90.0)
    except TimeoutError as e:
        sys.stderr.write(f"\n{e}\n")
        sys.stderr.flush()
        os._exit(1)


def _no_errors(ranks: OneGpuRanks, what: str = "") -> None:
    errors = ranks.errors()
    assert all(not w[0] for w in errors), f"{what}: wait errors (per rank: failed, rank, peer, chunk, _, kind): {errors}"


# --- all_gather_matmul --------------------------------------------------------------------------------------


class AgCase:
    """Every rank's inputs (kept: a graph reads them), refreshed in place."""

    def __init__(self, world: int, rows: int = ROWS):
        self.world, self.rows = world, rows
        self.A = [torch.empty(rows, K, device="cuda", dtype=BF16) for _ in range(world)]
        # each rank its own weights: one [K, N] with a bias, one nn.Linear-style (an [N2, K] weight's transpose)
        self.Bs = [[_weight("kn", BF16), _weight("nk", BF16, N2)] for _ in range(world)]
        self.biases = [[torch.randn(N, device="cuda", dtype=BF16), None] for _ in range(world)]
        self.refresh()

    def refresh(self) -> None:
        for a in self.A:
            a.copy_(torch.randn_like(a))

    def check(self, results, what: str, return_A: bool = True) -> None:
        gathered = torch.cat(self.A)
        for r, (A_gathered, outs) in enumerate(results):
            if not return_A:
                assert A_gathered is None, f"{what}: rank {r} returned the gathered A unasked"
            else:
                assert torch.equal(A_gathered, gathered), f"{what}: rank {r}'s gathered A"
            for i, (out, b, bias) in enumerate(zip(outs, self.Bs[r], self.biases[r])):
                want = gathered.float() @ b.float() + (bias.float() if bias is not None else 0)
                assert_close(out, want, TOL, f"{what}: rank {r}'s output {i}")


@pytest.mark.parametrize("rows", (ROWS, IN_PLACE_ROWS))
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", AG_VARIANTS)
def test_all_gather_matmul_between_simulated_ranks(world, variant, rows):
    """Rows per rank ragged (our rows copied into our slot) and a multiple of the tile (read where they are; our
    slot keeps the harness's 0xFF poison); the second eager call without the gathered operand."""
    _queues(world)
    case = AgCase(world, rows)
    launches.load_cutlass_all_gather(variant, case.Bs[0])
    ranks = OneGpuRanks(
        world,
        ag.data_bytes(rows, K, world, BF16),
        ag.FLAG_BYTES,
        tag=f"ag{world}",
        launches=launches.CUTLASS_ALL_GATHER,
    )
    return_A = True

    def fn(r, comm):
        return ag.all_gather_matmul_on(
            comm, case.A[r], case.Bs[r], case.biases[r], 0, variant=variant, return_A=return_A
        )

    for call in range(EAGER_CALLS):
        case.refresh()
        poison_allocator(1 << 28)
        delay = {"delay_rank": call % world, "delay_ms": 20.0} if call == 1 else {}
        return_A = call != 1
        results = _run(ranks, fn, **delay)
        _no_errors(ranks, f"{variant} world {world} rows {rows} eager call {call}")
        case.check(results, f"{variant} world {world} rows {rows} eager call {call}", return_A)
    return_A = True

    graph, results = ranks.capture(fn)
    for replay in range(REPLAYS):
        case.refresh()
        for A_gathered, outs in results:
            A_gathered.fill_(float("nan"))
            for out in outs:
                out.fill_(float("nan"))
        _replay(ranks, graph)
        case.check(results, f"{variant} world {world} rows {rows} replay {replay}")
    _no_errors(ranks)
    # an eager call after the replays (flags left as the graph found them)
    case.refresh()
    case.check(_run(ranks, fn), f"{variant} world {world} rows {rows} eager after replays")


def test_all_gather_timeout_raised_by_the_next_call():
    """Rank 0 calls alone: its GEMM's bounded wait for rank 1 gives up; the sequence copies the error words to the
    host and records the event itself, and the next call raises naming rank, peer and chunk."""
    variant, rows = AG_VARIANTS[0], IN_PLACE_ROWS
    case = AgCase(2, rows)
    launches.load_cutlass_all_gather(variant, case.Bs[0])
    ranks = OneGpuRanks(2, ag.data_bytes(rows, K, 2, BF16), ag.FLAG_BYTES, tag="ag-timeout")
    comm = ranks.comm(0)
    ag.flag_arrays(comm)
    with config.patch(wait_timeout_s=0.2):
        ag.all_gather_matmul_on(comm, case.A[0], case.Bs[0], case.biases[0], 0, variant=variant)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=r"rank 0 timed out waiting for rank 1's chunk \d"):
            ag.all_gather_matmul_on(comm, case.A[0], case.Bs[0], case.biases[0], 0, variant=variant)
    torch.cuda.synchronize()
    comm.errors.clear()


def test_all_gather_matmul_sequence_parallel_shard():
    """A [1, S/w, K] shard gathered on dim 1 (the gathered output keeps its 3-D shape), fp16."""
    _queues(2)
    world, variant = 2, DATA_PARALLEL[0]
    A = [torch.randn(1, 77, K, device="cuda", dtype=torch.float16) for _ in range(world)]
    B = torch.randn(K, N, device="cuda", dtype=torch.float16) / K**0.5
    launches.load_cutlass_all_gather(variant, [B])
    ranks = OneGpuRanks(
        world,
        ag.data_bytes(77, K, world, torch.float16),
        ag.FLAG_BYTES,
        tag="ag-sp",
        launches=launches.CUTLASS_ALL_GATHER,
    )
    results = _run(ranks, lambda r, comm: ag.all_gather_matmul_on(comm, A[r], [B], [None], 1, variant=variant))
    gathered = torch.cat(A, dim=1)
    for A_gathered, (out,) in results:
        assert torch.equal(A_gathered, gathered)
        assert_close(out, gathered.view(-1, K).float() @ B.float(), TOLERANCE[torch.float16], "sp output")


# --- matmul_reduce_scatter ----------------------------------------------------------------------------------


class RsCase:
    def __init__(self, world: int, out_shape: list[int], scatter_dim: int, reduce_op: str, bias: bool):
        self.world, self.out_shape, self.scatter_dim, self.reduce_op = world, out_shape, scatter_dim, reduce_op
        m, n = math.prod(out_shape[:-1]), out_shape[-1]
        self.m, self.n = m, n
        self.A = [torch.empty(m, K, device="cuda", dtype=BF16) for _ in range(world)]
        # rank 0 an nn.Linear-style weight (K-major), the others [K, N]
        self.B = [
            ((torch.randn(n, K, device="cuda") / K**0.5).to(BF16).t() if r == 0 else _weight("kn", BF16, n))
            for r in range(world)
        ]
        self.bias = [torch.randn(n, device="cuda", dtype=BF16) if bias else None for _ in range(world)]
        self.refresh()

    def refresh(self) -> None:
        for a in self.A:
            a.copy_(torch.randn_like(a))

    def check(self, results, what: str) -> None:
        """Against the fp32 sum (the op's contract), and against the ring's own order and rounding
        (rs.ring_reference: the same order, so closer)."""
        total = sum(
            a.float() @ b.float() + (x.float() if x is not None else 0) for a, b, x in zip(self.A, self.B, self.bias)
        )
        scale = 1.0 / self.world if self.reduce_op == "avg" else 1.0
        parts = (total * scale).reshape(self.out_shape).chunk(self.world, dim=self.scatter_dim)
        axis = rs.scatter_axis(self.out_shape, self.scatter_dim)
        ring = rs.ring_reference(
            [a.float() @ b.float() for a, b in zip(self.A, self.B)], self.bias, self.world, axis, scale, BF16
        )
        for r, out in enumerate(results):
            assert_close(out, parts[r].contiguous(), TOL, f"{what}: rank {r}")
            assert_close(out.reshape(ring[r].shape), ring[r].float(), TOL / 4, f"{what}: rank {r} (ring order)")


RS_CASES = {
    # out_shape (as a function of world), scatter dim, reduce op, bias
    "rows": (lambda w: [w * RS_ROWS, N], 0, "sum", True),
    "rows-3d-avg": (lambda w: [1, w * RS_ROWS, N], 1, "avg", True),
    "columns": (lambda w: [ROWS, w * 256], 1, "sum", True),
    "columns-3d-avg": (lambda w: [2, 100, w * 256], -1, "avg", False),
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", RS_VARIANTS)
@pytest.mark.parametrize("layout", list(RS_CASES))
def test_matmul_reduce_scatter_between_simulated_ranks(world, variant, layout):
    _queues(world)
    shape_of, scatter_dim, reduce_op, bias = RS_CASES[layout]
    case = RsCase(world, shape_of(world), scatter_dim, reduce_op, bias)
    axis = rs.scatter_axis(case.out_shape, scatter_dim)
    assert rs.chunk_declines(variant, case.m, case.n, world, axis) is None
    ranks = OneGpuRanks(
        world,
        rs.data_bytes(case.m, case.n, world, axis, BF16),
        rs.FLAG_BYTES,
        tag=f"rs{world}",
        launches=launches.CUTLASS_REDUCE_SCATTER,
    )
    tag = f"{variant} {layout} world {world}"
    launches.load_cutlass_reduce_scatter(variant, [case.B[0], case.B[-1]])

    def fn(r, comm):
        return rs.matmul_reduce_scatter_on(
            comm, [case.A[r]], [case.B[r]], case.bias[r], case.out_shape, scatter_dim, reduce_op, variant=variant
        )

    for call in range(EAGER_CALLS):
        case.refresh()
        poison_allocator(1 << 28)
        delay = {"delay_rank": (call + 1) % world, "delay_ms": 20.0} if call == 1 else {}
        results = _run(ranks, fn, rs.describe, **delay)
        _no_errors(ranks, f"{tag} eager call {call}")
        case.check(results, f"{tag} eager call {call}")
    again = _run(ranks, fn, rs.describe)  # the same inputs: the same bits (a fixed order, one rounding per step)
    for r, (x, y) in enumerate(zip(results, again)):
        assert torch.equal(x, y), f"{tag}: rank {r} differs run to run"

    graph, results = ranks.capture(fn)
    for replay in range(REPLAYS):
        case.refresh()
        for out in results:
            out.fill_(float("nan"))
        _replay(ranks, graph)
        case.check(results, f"{tag} replay {replay}")
    _no_errors(ranks)
    # the counters, arrival and done flags are back where they started
    counters, arrived, done = rs.flag_arrays(ranks.comm(0))
    for r in range(world):
        comm = ranks.comm(r)
        assert comm.flags.view(r, (rs.MAX_SUBS,), torch.int32, counters.offset).eq(0).all(), f"rank {r}'s counters"
        assert comm.flags.view(r, (rs.MAX_SUBS,), torch.int32, arrived.offset).eq(0).all(), f"rank {r}'s arrivals"
        assert comm.flags.view(r, (1,), torch.int32, done.offset).eq(1).all(), f"rank {r}'s done flag"


@pytest.mark.parametrize("world", (4, 8))
def test_reduce_scatter_variants_alternate_on_shared_workspaces(world):
    """The autotuner's pattern between four GPUs that hung: both ring variants alternating call to call on one set
    of workspaces (other tiles, sub-chunks and counters each call), every CTA taking several tiles, a rank delayed
    in one call; the schedule model finds no deadlock in the same calls (fluxcompile/testing/ring_schedule.py)."""
    _queues(world)
    m, n = world * RS_ROWS, 4096
    variants = [RS_VARIANTS[i % 2] for i in range(4)]
    case = RsCase(world, [m, n], 0, "sum", False)
    ranks = OneGpuRanks(world, rs.data_bytes(m, n, world, 0, BF16), rs.FLAG_BYTES, tag=f"rs-alt{world}",
                        launches=launches.CUTLASS_REDUCE_SCATTER)  # fmt: skip
    assert simulate(world, [RingCall(v, m, n, 0) for v in variants], ranks.sm_count).ok
    for v in RS_VARIANTS:
        assert rs.chunk_declines(v, m, n, world, 0) is None
        launches.load_cutlass_reduce_scatter(v, [case.B[0], case.B[-1]])
    for call, variant in enumerate(variants):
        case.refresh()
        poison_allocator(1 << 28)
        delay = {"delay_rank": call % world, "delay_ms": 20.0} if call == 2 else {}

        def fn(r, comm, variant=variant):
            return rs.matmul_reduce_scatter_on(comm, [case.A[r]], [case.B[r]], None, [m, n], 0, "sum", variant=variant)

        results = _run(ranks, fn, rs.describe, **delay)
        _no_errors(ranks, f"{variant} world {world} call {call}")
        case.check(results, f"{variant} world {world} call {call}")


def test_reduce_scatter_timeout_names_the_sub_chunk():
    """A rank that never pushes: its predecessor's epilogue gives up after the bound and the next call raises,
    naming the rank, the peer and the sub-chunk."""
    variant = RS_VARIANTS[0]
    world, m, n = 2, 2 * RS_ROWS, N
    A = [torch.randn(m, K, device="cuda", dtype=BF16) for _ in range(world)]
    B = [_weight("kn", BF16) for _ in range(world)]
    ranks = OneGpuRanks(world, rs.data_bytes(m, n, world, 0, BF16), rs.FLAG_BYTES, tag="rs-timeout",
                        launches=launches.CUTLASS_REDUCE_SCATTER)  # fmt: skip
    launches.load_cutlass_reduce_scatter(variant, [B[0]])
    comm = ranks.comm(0)
    rs.flag_arrays(comm)
    with config.patch(wait_timeout_s=0.5):
        rs.matmul_reduce_scatter_on(comm, [A[0]], [B[0]], None, [m, n], 0, "sum", variant=variant)  # rank 1 absent
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=r"rank 0 timed out waiting for rank 1's running sums of sub-chunk"):
            rs.matmul_reduce_scatter_on(comm, [A[0]], [B[0]], None, [m, n], 0, "sum", variant=variant)
    torch.cuda.synchronize()
    comm.errors.clear()


# --- the launcher alone --------------------------------------------------------------------------------------


def _weight(layout: str, dtype: torch.dtype, n: int = N) -> torch.Tensor:
    """A [K, n] weight: row-major ("kn") or the transpose of a row-major [n, K] ("nk", an nn.Linear weight)."""
    if layout == "kn":
        return (torch.randn(K, n, device="cuda") / K**0.5).to(dtype)
    return (torch.randn(n, K, device="cuda") / K**0.5).to(dtype).t()


@pytest.mark.parametrize("variant", cutlass_gemm.variants())
def test_gemm_matches_torch(variant):
    """bf16 and fp16, both weight layouts, with and without bias, ragged M, eager and replayed from a graph with
    new inputs; rotations change the tile order, never the result."""
    for dtype in (BF16, torch.float16):
        for layout in ("kn", "nk"):
            for m in (200, 1000):
                a = torch.randn(m, K, device="cuda", dtype=dtype)
                b = _weight(layout, dtype)
                assert cutlass_gemm.weight_layout(b) == layout
                bias = torch.randn(N, device="cuda", dtype=dtype)
                for x in (None, bias):
                    out = torch.full((m, N), float("nan"), device="cuda", dtype=dtype)
                    cutlass_gemm.gemm(a, b, out, x, variant=variant)
                    want = a.float() @ b.float() + (x.float() if x is not None else 0)
                    assert_close(out, want, TOLERANCE[dtype], f"{variant} {dtype} {layout} m={m} bias={x is not None}")
                for rotate in ((0, 333), (1, 500)):
                    out = torch.full((m, N), float("nan"), device="cuda", dtype=dtype)
                    cutlass_gemm.gemm(a, b, out, bias, variant=variant, rotate=rotate, sm_count=16)
                    assert_close(out, a.float() @ b.float() + bias.float(), TOLERANCE[dtype], f"rotate {rotate}")
    # a CUDA graph (after the eager calls above: stream-K's scratch exists), replayed with new inputs
    a = torch.randn(200, K, device="cuda", dtype=BF16)
    b = _weight("nk", BF16)
    bias = torch.randn(N, device="cuda", dtype=BF16)
    out = torch.empty(200, N, device="cuda", dtype=BF16)
    cutlass_gemm.gemm(a, b, out, bias, variant=variant)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cutlass_gemm.gemm(a, b, out, bias, variant=variant)
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        b.copy_(torch.randn_like(b))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, a.float() @ b.float() + bias.float(), TOL, f"{variant} replay")


@pytest.mark.parametrize("variant", cutlass_gemm.variants(fp8=True))
def test_gemm_fp8_matches_scaled_mm(variant):
    """e4m3 x e4m3 into bf16 against torch._scaled_mm on the same operands (and an fp32 reference): tensor-wise and
    row-wise scales, fast accumulation or not, with and without bias, ragged M, a rotated tile order, the waits'
    path, and a CUDA graph replayed with new operands and scales; the output poisoned before every call."""
    e4m3 = torch.float8_e4m3fn
    fp8_tol = 2 * TOL  # bf16 rounding of the same fp32 sums, accumulated in another order
    for scaling in ("tensor", "row"):
        for m in (200, 1000):
            a = (torch.randn(m, K, device="cuda") * 4).to(e4m3)
            b = (torch.randn(N, K, device="cuda") * 4).to(e4m3).t()
            rows, cols = (m, N) if scaling == "row" else (1, 1)
            sa = torch.rand(rows, 1, device="cuda") / 8 + 0.01
            sb = torch.rand(1, cols, device="cuda") / 64 + 0.001
            if scaling == "tensor":
                sa, sb = sa.reshape(()), sb.reshape(())
            assert cutlass_gemm.scales_unsupported(a, b, sa, sb, BF16) is None
            bias = torch.randn(N, device="cuda", dtype=BF16)
            for fast in (True, False) if cutlass_gemm.VARIANTS[variant].promotes else (True,):
                for x in (None, bias):
                    for kw in ({}, {"rotate": (0, 333), "sm_count": 16}):
                        out = torch.full((m, N), float("nan"), device="cuda", dtype=BF16)
                        cutlass_gemm.gemm(a, b, out, x, variant=variant, scales=(sa, sb), fast_accum=fast, **kw)
                        want = torch._scaled_mm(a, b, sa, sb, x, out_dtype=BF16, use_fast_accum=fast)
                        what = f"{variant} {scaling} m={m} fast={fast} bias={x is not None} {kw}"
                        assert_close(out, want.float(), fp8_tol, what)
                        exact = (a.float() @ b.float()) * sa * sb + (x.float() if x is not None else 0)
                        assert_close(out, exact, fp8_tol, what + " (fp32)")
    # the all-gather's wait path: flags preset, every chunk there
    flags = torch.ones(2 * 4, dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    out = torch.full((1000, N), float("nan"), device="cuda", dtype=BF16)
    cutlass_gemm.gemm(a, b, out, bias, variant=variant, scales=(sa, sb), fast_accum=True,
                      wait=(flags, 500, 125, 0), rotate=(0, 0), err=err)  # fmt: skip
    want = torch._scaled_mm(a, b, sa, sb, bias, out_dtype=BF16, use_fast_accum=True)
    assert_close(out, want.float(), fp8_tol, f"{variant} waits")
    assert int(err[0]) == 0
    # 16-bit operands or an unscaled call do not reach an fp8 kernel, nor fp8 a 16-bit one
    with pytest.raises(ValueError, match="scaled e4m3"):
        cutlass_gemm.gemm(a.to(BF16), b.to(BF16), out, variant=variant)
    with pytest.raises(ValueError, match="16-bit"):
        cutlass_gemm.gemm(a, b, out, variant=cutlass_gemm.variants()[0], scales=(sa, sb))
    if not cutlass_gemm.VARIANTS[variant].promotes:
        with pytest.raises(ValueError, match="fast accumulation only"):
            cutlass_gemm.gemm(a, b, out, variant=variant, scales=(sa, sb), fast_accum=False)
    # a CUDA graph, replayed with new operands and scales copied in
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        cutlass_gemm.gemm(a, b, out, bias, variant=variant, scales=(sa, sb), fast_accum=True)
    for _ in range(2):
        a.copy_((torch.randn(a.shape, device="cuda") * 4).to(e4m3))
        sa.copy_(torch.rand_like(sa) / 8 + 0.01)
        sb.copy_(torch.rand_like(sb) / 64 + 0.001)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = torch._scaled_mm(a, b, sa, sb, bias, out_dtype=BF16, use_fast_accum=True)
        assert_close(out, want.float(), fp8_tol, f"{variant} replay")


@pytest.mark.parametrize("variant", cutlass_gemm.ring_variants())
@pytest.mark.parametrize("axis", (0, 1))
@pytest.mark.parametrize("layout", ("kn", "nk"))
@pytest.mark.parametrize("sm_count", (0, 4))
def test_gemm_ring_epilogue(variant, axis, layout, sm_count):
    """The ring's epilogue alone, 4 chunks: the zero chunk's tiles add nothing, the others add C (every arrival
    flag set), our own chunk's tiles go to the output and nowhere else, the rest into D, counted per sub-chunk;
    alpha scales the product and the bias (pre-scaled by the caller) is added once. On 4 SMs each CTA takes
    several tiles, some of each kind."""
    tm, tn, _ = cutlass_gemm.VARIANTS[variant].tile
    world, tile = 4, (tm if axis == 0 else tn)
    chunk, sub = 2 * tile, tile
    m, n = (world * chunk, 384) if axis == 0 else (300, world * chunk)
    for zero_chunk, own, alpha in ((1, 0, 1.0), (3, 2, 0.25)):
        a = torch.randn(m, K, device="cuda", dtype=BF16)
        b = _weight(layout, BF16, n)
        bias = torch.randn(n, device="cuda", dtype=BF16)
        c = torch.randn(m, n, device="cuda", dtype=BF16)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=BF16)
        out = torch.full((chunk, n) if axis == 0 else (m, chunk), float("nan"), device="cuda", dtype=BF16)
        zero = torch.zeros((tm, n) if axis == 0 else (m, tn), device="cuda", dtype=BF16)
        subs = world * chunk // sub
        flags = torch.ones(subs, dtype=torch.int32, device="cuda")
        counters = torch.zeros(subs, dtype=torch.int32, device="cuda")
        err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
        ring = cutlass_gemm.Ring(c, flags, axis, chunk, sub, 1, zero_chunk, own, zero, out, alpha)
        cutlass_gemm.gemm(a, b, d, bias, variant=variant, rotate=(axis, zero_chunk * chunk), signal=(counters, sub, axis),
                          err=err, ring=ring, sm_count=sm_count)  # fmt: skip
        torch.cuda.synchronize()
        assert err[0].item() == 0
        want = alpha * (a.float() @ b.float()) + bias.float()
        for q in range(world):
            got = (d if q != own else out).narrow(axis, q * chunk if q != own else 0, chunk)
            ref = want.narrow(axis, q * chunk, chunk) + (0 if q == zero_chunk else c.float().narrow(axis, q * chunk, chunk))
            assert_close(got, ref, TOL, f"{variant} axis {axis} chunk {q}")
        assert d.narrow(axis, own * chunk, chunk).isnan().all(), "our own chunk was stored into D"
        counts = cutlass_gemm.tiles_per_chunk(variant, m, n, sub, axis)
        per = chunk // sub
        want_counts = [0 if j // per == own else t for j, t in enumerate(counts)]
        assert counters.tolist() == want_counts


@pytest.mark.parametrize("variant", DATA_PARALLEL[:1] + DATA_PARALLEL[-1:])
@pytest.mark.parametrize("axis", (0, 1))
def test_gemm_signals_count_tiles(variant, axis):
    m, chunk = 1000, (250 if axis == 0 else 192)
    a = torch.randn(m, K, device="cuda", dtype=BF16)
    b = _weight("kn", BF16)
    out = torch.empty(m, N, device="cuda", dtype=BF16)
    counters = torch.zeros(8, dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    cutlass_gemm.gemm(a, b, out, variant=variant, signal=(counters, chunk, axis), err=err, rotate=(axis, chunk))
    want = cutlass_gemm.tiles_per_chunk(variant, m, N, chunk, axis)
    assert counters[: len(want)].tolist() == want
    assert counters[len(want) :].eq(0).all()
    assert_close(out, a.float() @ b.float(), TOL, "signalling GEMM")


@pytest.mark.parametrize(
    "variant", [*AG_VARIANTS, next(n for n, v in cutlass_gemm.VARIANTS.items() if v.schedule == "pp")]
)
def test_gemm_reads_our_rows_where_they_are(variant):
    """``local=``: the m-tiles of our rows load from our shard (their own TMA descriptor), never from the poisoned
    rows of ``a``; a second shard at another address (the descriptor's address replaced, the cached parameters
    reused) and a call without ``local`` after it."""
    world, rank, rows, chunk_rows = 4, 2, IN_PLACE_ROWS, 128
    flags = torch.ones(world * (rows // chunk_rows), dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    a = torch.randn(world * rows, K, device="cuda", dtype=BF16)
    ours = slice(rank * rows, (rank + 1) * rows)
    for b in (_weight("kn", BF16), _weight("nk", BF16, N2)):
        for i in range(2):
            shard = torch.randn(rows, K, device="cuda", dtype=BF16)
            a[ours] = float("nan")
            out = torch.full((world * rows, b.shape[1]), float("nan"), device="cuda", dtype=BF16)
            wait = (flags, rows, chunk_rows, rank)
            cutlass_gemm.gemm(a, b, out, variant=variant, wait=wait, err=err, rank=rank, rotate=(0, rank * rows),
                              local=(shard, rank * rows))  # fmt: skip
            want = a.float()
            want[ours] = shard.float()
            assert_close(out, want @ b.float(), TOL, f"{variant}: our rows read where they are, shard {i}")
        a[ours] = shard
        out = torch.full((world * rows, b.shape[1]), float("nan"), device="cuda", dtype=BF16)
        cutlass_gemm.gemm(a, b, out, variant=variant, wait=wait, err=err, rank=rank)
        assert_close(out, a.float() @ b.float(), TOL, f"{variant}: every row from a")
    torch.cuda.synchronize()
    assert err.tolist() == [0] * cutlass_gemm.ERR_WORDS
    with pytest.raises(ValueError, match="tile boundary"):
        cutlass_gemm.gemm(a, b, out, variant=variant, wait=(flags, rows, chunk_rows, rank), err=err, rank=rank,
                          local=(shard[: rows - 8], rank * rows))  # fmt: skip


@pytest.mark.parametrize("variant", cutlass_gemm.variants())
def test_gemm_grouped_tile_order(variant):
    """``group_m``: every tile computed once whatever the group, the rotation and the cluster (ragged M and N,
    poisoned output), with waits and our rows in place."""
    world, rank, rows, chunk_rows = 4, 1, IN_PLACE_ROWS, 128
    flags = torch.ones(world * (rows // chunk_rows), dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    for m, n, group_m in ((world * rows, N, 8), (1000, N2 + 8, 4), (world * rows, N2, 16)):
        a = torch.randn(m, K, device="cuda", dtype=BF16)
        b = _weight("nk", BF16, n)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=BF16)
        in_place = m == world * rows
        kw = {"wait": (flags, rows, chunk_rows, rank), "err": err, "rank": rank} if in_place else {}
        if in_place:
            kw["local"] = (a[rank * rows : (rank + 1) * rows].clone(), rank * rows)
        cutlass_gemm.gemm(a, b, out, variant=variant, rotate=(0, rank * rows), group_m=group_m, **kw)
        assert_close(out, a.float() @ b.float(), TOL, f"{variant} m={m} n={n} group_m={group_m}")
    torch.cuda.synchronize()
    assert err.tolist() == [0] * cutlass_gemm.ERR_WORDS


@pytest.mark.parametrize("variant", AG_VARIANTS)
def test_gemm_waits_for_chunks(variant):
    """Flags set: the result; one chunk's flag missing: the bounded wait gives up, naming rank, peer and chunk."""
    world, rows, chunk_rows = 4, 200, 128
    chunks = -(-rows // chunk_rows)
    a = torch.randn(world * rows, K, device="cuda", dtype=BF16)
    b = _weight("kn", BF16)
    out = torch.empty(world * rows, N, device="cuda", dtype=BF16)
    flags = torch.ones(world * chunks, dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    flags[1 * chunks : 2 * chunks] = 0  # rank 1's rows: skipped (its own), never awaited
    cutlass_gemm.gemm(a, b, out, variant=variant, wait=(flags, rows, chunk_rows, 1), err=err, rank=1, rotate=(0, 200))
    torch.cuda.synchronize()
    assert err.tolist() == [0] * cutlass_gemm.ERR_WORDS
    assert_close(out, a.float() @ b.float(), TOL, "waiting GEMM")
    flags[3 * chunks + 1] = 0  # rank 3's second chunk never arrives
    with config.patch(wait_timeout_s=0.2):
        cutlass_gemm.gemm(a, b, out, variant=variant, wait=(flags, rows, chunk_rows, 1), err=err, rank=1)
    torch.cuda.synchronize()
    assert err.tolist()[:4] == [1, 1, 3, 1]
    with pytest.raises(RuntimeError, match="rank 1 timed out waiting for rank 3's chunk 1"):
        cutlass_gemm.check_error(err, "test")
