"""The DLRM kernel's protocol (lowerings/embedding_bag_all_to_all/triton.py, kernels/embedding_bag.py) on a GPU:
one rank (the pooling kernel writes the output), ranks simulated on one GPU (fluxcompile/testing/one_gpu_ranks.py:
each rank its own streams, symmetric workspaces as slices of one allocation) at 2, 4 and 8 ranks, and the
registered choice between this run's processes (real peers where scripts/gpu-check starts several) against the
reference (embedding_bag + NCCL all_to_all_single).

Per case: each rank its own tables (different row counts), ragged bags with empty ones, fresh random indices per
call, outputs never written before (a poisoned allocator; NaN-filled before each replay), references in fp32
computed per rank by hand (rank s's pooled rows, chunk r to rank r, sources in rank order); several eager calls,
one with a rank's launch delayed, then a CUDA graph of every rank's call replayed with new indices and offsets
copied into the captured ones (fixed shapes), then an eager call after the replays. Waits give up after about 5 s
(an error in the error words, not a hang)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import poison_allocator

from fluxcompile import config, ops
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import embedding_bag as eb
from fluxcompile.kernels import embedding_bag_backward as ebb
from fluxcompile.lowerings import all_to_all_embedding_bag_backward as _registered_bw  # noqa: F401
from fluxcompile.lowerings import embedding_bag_all_to_all as _registered  # noqa: F401  (the CUDA implementation)
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import triton as lo_bw
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo
from fluxcompile.symm_mem.comm import cached_comm
from fluxcompile.testing import launches
from fluxcompile.testing.numerics import assert_close
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WORLDS = (2, 4, 8)
EAGER_CALLS, REPLAYS = 3, 3
# The waits' bound in microseconds: a missing peer is an error after 20 s. A rank's first call of a kernel
# specialization compiles it (seconds) while the ranks launched before it already wait.
SPIN = 20_000_000
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def _queues(world: int) -> None:
    if int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")) < 2 * world + 4:
        pytest.skip(f"CUDA_DEVICE_MAX_CONNECTIONS < {2 * world + 4} (scripts/gpu-check sets 32)")


@pytest.fixture(autouse=True)
def _config():
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=False):
        yield


class Rank:
    """One rank's operands (kept: a graph reads them), refreshed in place."""

    def __init__(self, g, tables, bags, dim, dtype, idx_dtype, last, max_len, row_base):
        self.last, self.max_len, self.bags = last, max_len, bags
        self.rows = [row_base + 37 * t for t in range(tables)]
        self.weights = [torch.randn(n, dim, generator=g).to(device="cuda", dtype=dtype) for n in self.rows]
        self.n_idx = [bags * max_len // 2 + t for t in range(tables)]
        self.indices = [torch.zeros(n, dtype=idx_dtype, device="cuda") for n in self.n_idx]
        self.offsets = [torch.zeros(bags + int(last), dtype=idx_dtype, device="cuda") for _ in self.rows]
        self.g = g
        self.refresh()

    def refresh(self) -> None:
        """New indices and new ragged bags (empty ones included) over the same index counts."""
        for t, n in enumerate(self.n_idx):
            self.indices[t].copy_(torch.randint(0, self.rows[t], (n,), generator=self.g))
            cuts = torch.sort(torch.randint(0, n + 1, (self.bags - 1,), generator=self.g)).values
            cuts[: min(2, len(cuts))] = 0  # bag 0 (and 1) empty
            offs = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
            if self.last:
                offs = torch.cat([offs, torch.tensor([n])])
            self.offsets[t].copy_(offs)

    def pooled(self, mode: int) -> torch.Tensor:
        return ops.pooled_rows(
            [w.float() for w in self.weights], [i.long() for i in self.indices], [o.long() for o in self.offsets],
            mode, self.last,
        )  # fmt: skip


def expected(ranks: list[Rank], mode: int, out_shape, ins_of) -> list[torch.Tensor]:
    world = len(ranks)
    chunks = [list(torch.split(ranks[s].pooled(mode).reshape(out_shape), ins_of(s), dim=0)) for s in range(world)]
    return [torch.cat([chunks[s][r] for s in range(world)], dim=0) for r in range(world)]


def _run(harness: OneGpuRanks, fn, **kwargs):
    try:
        return harness.run(fn, timeout_s=90.0, **kwargs)
    except TimeoutError as e:  # streams blocked on a flag cannot be cancelled: end the process
        sys.stderr.write(f"\n{e}\n")
        sys.stderr.flush()
        os._exit(1)


def _replay(harness: OneGpuRanks, graph: torch.cuda.CUDAGraph) -> None:
    graph.replay()
    try:
        harness.wait(90.0)
    except TimeoutError as e:
        sys.stderr.write(f"\n{e}\n")
        sys.stderr.flush()
        os._exit(1)


def _no_errors(harness: OneGpuRanks) -> None:
    errors = harness.errors()
    assert all(not w[0] for w in errors), [eb.error_message(w, "dlrm") for w in errors]


def _splits(kind: str, world: int, units: int) -> list[list[int]]:
    """sizes[s][r]: what rank s sends rank r (rows of out_shape's dim 0; every rank sends ``units``)."""
    if kind != "unequal":
        return [[units // world] * world for _ in range(world)]
    sizes = []
    for s in range(world):
        row = [(units // world) + ((s + r) % 3 - 1) * (units // (4 * world)) for r in range(world)]
        row[(s + 1) % world] = 0  # an empty chunk
        row[-1] += units - sum(row)
        sizes.append(row)
    return sizes


CASES = {
    # tables per rank, bags per rank, dim, dtype, index dtype, include_last_offset, splits, 3-D out_shape
    "fp32-sum": (3, 40, 64, torch.float32, torch.int64, False, "equal", False, 0),
    "bf16-mean-last-i32": (2, 33, 128, torch.bfloat16, torch.int32, True, "equal", True, 1),
    "fp16-unequal": (2, 48, 32, torch.float16, torch.int64, False, "unequal", False, 0),
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(CASES))
def test_between_simulated_ranks(world, case):
    _queues(world)
    tables, bags_local, dim, dtype, idx_dtype, last, split_kind, three_d, mode = CASES[case]
    variant = list(eb.VARIANTS)[(world + len(case)) % len(eb.VARIANTS)]
    bags = bags_local * world
    out_shape = [world, bags_local, tables * dim] if three_d else [bags, tables * dim]
    units = out_shape[0]
    sizes = _splits(split_kind, world, units)
    uniform = split_kind == "equal"

    def ins_of(s):
        return sizes[s]

    def outs_of(r):
        return [row[r] for row in sizes]

    g = torch.Generator().manual_seed(world * 100 + len(case))
    ranks = [Rank(g, tables, bags, dim, dtype, idx_dtype, last, 6, 50 + 11 * r) for r in range(world)]
    nbytes = lo.data_bytes(ranks[0].weights, ranks[0].offsets, last, out_shape, outs_of(0), ins_of(0), world)
    harness = OneGpuRanks(world, nbytes, lo.FLAG_BYTES, tag=f"dlrm{world}{case}", launches=launches.DLRM)

    def fn(r, comm):
        o, i = ([], []) if uniform and r % 2 == 0 else (outs_of(r), ins_of(r))  # empty lists mean equal splits
        x = ranks[r]
        return lo.embedding_bag_all_to_all_on(
            comm, x.weights, x.indices, x.offsets, mode, last, out_shape, o, i, variant=variant, max_spin=SPIN
        )

    def check(results, what):
        want = expected(ranks, mode, out_shape, ins_of)
        for r, out in enumerate(results):
            assert out.shape == want[r].shape, f"{what}: rank {r}'s shape {tuple(out.shape)}"
            assert_close(out, want[r], TOL[dtype], f"{what}: rank {r}")

    for call in range(EAGER_CALLS):
        for x in ranks:
            x.refresh()
        poison_allocator(1 << 28)
        delay = {"delay_rank": call % world, "delay_ms": 20.0} if call == 1 else {}
        results = _run(harness, fn, **delay)
        _no_errors(harness)
        check(results, f"{case} world {world} eager call {call}")

    graph, results = harness.capture(fn)
    for replay in range(REPLAYS):
        for x in ranks:
            x.refresh()
        for out in results:
            out.fill_(float("nan"))
        _replay(harness, graph)
        check(results, f"{case} world {world} replay {replay}")
    _no_errors(harness)
    for x in ranks:
        x.refresh()
    check(_run(harness, fn), f"{case} world {world} eager after replays")
    _no_errors(harness)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank(dtype):
    """World 1: no workspace, the pooling kernel writes the output; eager calls and graph replays."""
    g = torch.Generator().manual_seed(7)
    x = Rank(g, 4, 300, 128, dtype, torch.int64, False, 9, 1000)
    out_shape = [300, 4 * 128]
    for variant in eb.VARIANTS:
        for mode in (0, 1):
            x.refresh()
            poison_allocator(1 << 26)
            out = lo.embedding_bag_all_to_all_on(None, x.weights, x.indices, x.offsets, mode, False, out_shape, [], [],
                                                 variant=variant)  # fmt: skip
            assert_close(out, x.pooled(mode), TOL[dtype], f"one rank {variant} mode {mode}")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lo.embedding_bag_all_to_all_on(None, x.weights, x.indices, x.offsets, 0, False, out_shape, [], [])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = lo.embedding_bag_all_to_all_on(None, x.weights, x.indices, x.offsets, 0, False, out_shape, [], [])
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(REPLAYS):
        x.refresh()
        out.fill_(float("nan"))
        graph.replay()
        assert_close(out, x.pooled(0), TOL[dtype], f"one rank replay {replay}")


def test_wait_times_out_into_error_words():
    """Rank 1 of 2 never pools: rank 0's wait gives up and names it; the next eager call on rank 0 raises."""
    g = torch.Generator().manual_seed(3)
    world, bags, dim = 2, 16, 32
    x = Rank(g, 2, bags, dim, torch.float32, torch.int64, False, 4, 40)
    out_shape = [bags, 2 * dim]
    harness = OneGpuRanks(world, lo.data_bytes(x.weights, x.offsets, False, out_shape, [], [], world), lo.FLAG_BYTES,
                          tag="dlrm-timeout", launches=launches.DLRM)  # fmt: skip

    def fn(r, comm):
        if r == 1:
            return None
        return lo.embedding_bag_all_to_all_on(comm, x.weights, x.indices, x.offsets, 0, False, out_shape, [], [],
                                              max_spin=20_000)  # fmt: skip

    _run(harness, fn)
    words = harness.errors()[0]
    msg = eb.error_message(words, "test")
    assert msg is not None and "waiting for rank 1's pooled rows" in msg, words
    with pytest.raises(RuntimeError, match="waiting for rank 1's pooled rows"):
        _run(harness, fn)


def _same_bookkeeping(got: list, want: list, bags: int, what: str) -> None:
    """The pooling kernel's offset2bag and bag sizes (the first ``bags``: aten leaves the one of the last offset
    unwritten) equal aten's, table by table; max_indices alike in shape and dtype."""
    assert len(got) == len(want) == 3 and len(got[0]) == len(want[0]), f"{what}: bookkeeping lists"
    for t in range(len(got[0])):
        assert torch.equal(got[0][t], want[0][t]), f"{what}: offset2bag of table {t}"
        assert got[1][t].shape == want[1][t].shape and got[1][t].dtype == want[1][t].dtype, f"{what}: bag_size {t}"
        assert torch.equal(got[1][t][:bags], want[1][t][:bags]), f"{what}: bag_size of table {t}"
        assert got[2][t].shape == want[2][t].shape and got[2][t].dtype == want[2][t].dtype, f"{what}: max_indices {t}"


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("last", "pad"), [(False, -1), (True, -1), (False, 4)])
def test_bookkeeping_one_rank(mode, idx_dtype, last, pad, monkeypatch):
    """A Triton choice with ``bookkeeping`` on a group of one: the pooled rows and aten's CUDA bookkeeping, ragged
    bags with empty ones, and a padding index (row 4 of tables whose indices repeat: it pools nothing, counts in
    no bag's size)."""
    g = torch.Generator().manual_seed(17 + mode)
    x = Rank(g, 3, 200, 64, torch.bfloat16, idx_dtype, last, 9, 700)
    monkeypatch.setitem(lo._group_sizes, "one", 1)
    run, _ = lo.make(eb.DEFAULT)
    for call in range(2):
        x.refresh()
        poison_allocator(1 << 26)
        if pad >= 0:
            for i in x.indices:
                i.remainder_(40)  # indices among 40 rows: row 4 in many bags
        out, *book = run(x.weights, x.indices, x.offsets, mode, last, [200, 3 * 64], [], [], "one", bookkeeping=True,
                         padding_idx=pad)  # fmt: skip
        want = [torch.ops.aten._embedding_bag(w, i, o, False, mode, False, None, last, pad)
                for w, i, o in zip(x.weights, x.indices, x.offsets)]  # fmt: skip
        pooled = torch.cat([w[0].float() for w in want], dim=1)
        assert_close(out, pooled, TOL[torch.bfloat16], f"bookkeeping call {call}")
        _same_bookkeeping(book, [[w[k] for w in want] for k in (1, 2, 3)], 200, f"one rank call {call}")


@pytest.mark.peers
def test_registered_choice_between_processes():
    """The op with the compiled choice ``triton:<variant>`` between this run's processes (one rank per GPU: real
    peers over symmetric memory where there are several) against the op's reference (NCCL); DLRM's layout: every
    rank pools the global batch for its own tables, batch chunk r goes to rank r."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    op = torch.ops.fluxcompile.embedding_bag_all_to_all.default
    g = torch.Generator().manual_seed(1234 + rank)
    bags_local, tables, dim = 64, 3, 128
    for dtype in (torch.float32, torch.bfloat16):
        x = Rank(g, tables, bags_local * world, dim, dtype, torch.int64, False, 8, 500 + rank)
        args = (x.weights, x.indices, x.offsets, 0, False, [bags_local * world, tables * dim], [], [], group.group_name)
        for variant in (eb.DEFAULT, list(eb.VARIANTS)[-1]):
            for call in range(3):
                x.refresh()
                poison_allocator(1 << 26)
                got, *book = op(*args, bookkeeping=call == 1, choice=f"triton:{variant}")
                want, *want_book = op(*args, bookkeeping=call == 1, choice="reference")
                assert_close(got, want, TOL[dtype], f"rank {rank} {dtype} {variant} call {call}")
                _same_bookkeeping(book, want_book, x.bags, f"rank {rank} {dtype} {variant} call {call}")
        torch.cuda.synchronize()
        errors = cached_comm(group.group_name, lo.TAG).errors.err.tolist() if world > 1 else [0] * eb.ERR_WORDS
        assert not errors[0], eb.error_message(errors, "registered choice")


# --- the backward: all_to_all_embedding_bag_backward (lowerings/all_to_all_embedding_bag_backward/triton.py) ------


class Owner:
    """One rank's side of the backward (kept: a graph reads it), refreshed in place: its tables' indices, offsets
    and aten's forward bookkeeping for ``bags`` ragged bags (empty ones, repeated indices), and the pooled rows'
    gradients it holds (``rows`` x ``T * D``)."""

    def __init__(self, g, tables, bags, rows, dim, dtype, idx_dtype, last, mode, row_base, pad=-1):
        self.g, self.bags, self.last, self.mode, self.dim, self.pad = g, bags, last, mode, dim, pad
        self.num_weights = [row_base + 37 * t for t in range(tables)]
        self.n_idx = [bags * 3 + t for t in range(tables)]
        self.indices = [torch.zeros(n, dtype=idx_dtype, device="cuda") for n in self.n_idx]
        self.offsets = [torch.zeros(bags + int(last), dtype=idx_dtype, device="cuda") for _ in range(tables)]
        # aten's CUDA forward: the indices' dtype, one bag size per offset (one more with include_last_offset), no
        # max indices in sum and mean pooling
        self.bag_size = [torch.zeros(bags + int(last), dtype=idx_dtype, device="cuda") for _ in range(tables)]
        self.offset2bag = [torch.zeros(n, dtype=idx_dtype, device="cuda") for n in self.n_idx]
        self.max_indices = [torch.zeros(0, dtype=idx_dtype, device="cuda") for _ in range(tables)]
        self.grad = torch.zeros(rows, tables * dim, dtype=dtype, device="cuda")
        self.refresh()

    def refresh(self) -> None:
        for t, n in enumerate(self.n_idx):
            # a fifth of the rows: indices repeat within and across bags (the adds collide)
            self.indices[t].copy_(torch.randint(0, max(1, self.num_weights[t] // 5), (n,), generator=self.g))
            cuts = torch.sort(torch.randint(0, n + 1, (self.bags - 1,), generator=self.g)).values
            cuts[: min(2, len(cuts))] = 0
            offs = torch.cat([torch.zeros(1, dtype=torch.long), cuts] + ([torch.tensor([n])] if self.last else []))
            self.offsets[t].copy_(offs)
            _, o2b, size, _ = torch.ops.aten._embedding_bag(
                torch.zeros(self.num_weights[t], 1, device="cuda"), self.indices[t], self.offsets[t], False,
                self.mode, False, None, self.last, self.pad,
            )  # fmt: skip
            self.offset2bag[t].copy_(o2b)
            self.bag_size[t].copy_(size)
        self.grad.copy_(torch.randn(self.grad.shape, generator=self.g))

    def args(self):
        return self.indices, self.offsets, self.bag_size, self.num_weights

    def reference(self, G: torch.Tensor, sparse: bool = False, freq: bool = False) -> list[torch.Tensor]:
        per = G.float().view(G.shape[0], len(self.num_weights), -1)
        return [
            torch.ops.aten._embedding_bag_backward(
                per[:, t].contiguous(), self.indices[t], self.offsets[t], self.offset2bag[t], self.bag_size[t],
                self.max_indices[t], n, freq, self.mode, sparse, None, self.pad,
            )
            for t, n in enumerate(self.num_weights)
        ]  # fmt: skip


def expected_grads(owners: list[Owner], sizes) -> list[list[torch.Tensor]]:
    world = len(owners)
    out = []
    for r in range(world):
        chunks = [torch.split(owners[s].grad, sizes[s], dim=0)[r] for s in range(world)]
        out.append(owners[r].reference(torch.cat(chunks, dim=0)))
    return out


BACKWARD_CASES = {
    # tables, bags per rank, dim, dtype, index dtype, include_last_offset, splits, mode, padding index
    "fp32-sum": (3, 40, 64, torch.float32, torch.int64, False, "equal", 0, -1),
    "bf16-mean-last-i32-padding": (2, 33, 128, torch.bfloat16, torch.int32, True, "equal", 1, 5),
    "fp16-unequal": (2, 48, 96, torch.float16, torch.int64, False, "unequal", 0, -1),
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward_between_simulated_ranks(world, case):
    _queues(world)
    tables, bags_local, dim, dtype, idx_dtype, last, split_kind, mode, pad = BACKWARD_CASES[case]
    bags = bags_local * world  # every owner pools the global batch; every rank holds as many gradient rows
    sizes = _splits(split_kind, world, bags)  # sizes[s][r]: rows rank s sends rank r
    recv = [[sizes[s][r] for s in range(world)] for r in range(world)]
    g = torch.Generator().manual_seed(world * 1000 + len(case))
    owners = [
        Owner(g, tables, sum(recv[r]), sum(sizes[r]), dim, dtype, idx_dtype, last, mode, 60 + 7 * r, pad)
        for r in range(world)
    ]
    uniform = split_kind == "equal"
    nbytes = max(lo_bw.data_bytes(o.grad, tables, recv[r], sizes[r], world) for r, o in enumerate(owners))
    harness = OneGpuRanks(world, nbytes, lo_bw.FLAG_BYTES, tag=f"dlrm-bw{world}{case}", launches=launches.DLRM_BACKWARD)

    def fn(r, comm):
        o, i = ([], []) if uniform and r % 2 == 0 else (recv[r], sizes[r])  # empty lists mean equal splits
        x = owners[r]
        return lo_bw.all_to_all_embedding_bag_backward_on(
            comm, x.grad, *x.args(), mode, o, i, max_spin=SPIN, padding_idx=pad
        )

    def check(results, what):
        want = expected_grads(owners, sizes)
        for r, grads in enumerate(results):
            for t, (a, b) in enumerate(zip(grads, want[r])):
                assert a.shape == b.shape and a.dtype == dtype, f"{what}: rank {r} table {t}: {a.shape} {a.dtype}"
                assert_close(a, b, TOL[dtype], f"{what}: rank {r} table {t}")

    for call in range(EAGER_CALLS):
        for x in owners:
            x.refresh()
        poison_allocator(1 << 28)
        delay = {"delay_rank": call % world, "delay_ms": 20.0} if call == 1 else {}
        results = _run(harness, fn, **delay)
        _no_errors(harness)
        check(results, f"backward {case} world {world} eager call {call}")

    graph, results = harness.capture(fn)
    for replay in range(REPLAYS):
        for x in owners:
            x.refresh()
        for grads in results:
            for t in grads:
                t.fill_(float("nan"))
        _replay(harness, graph)
        check(results, f"backward {case} world {world} replay {replay}")
    _no_errors(harness)
    for x in owners:
        x.refresh()
    check(_run(harness, fn), f"backward {case} world {world} eager after replays")
    _no_errors(harness)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_one_rank(dtype):
    """World 1: the scatter reads ``grad`` itself; eager calls (sum and mean) and graph replays."""
    g = torch.Generator().manual_seed(11)
    for mode in (0, 1):
        x = Owner(g, 4, 300, 300, 128, dtype, torch.int64, False, mode, 1000)
        for call in range(2):
            x.refresh()
            poison_allocator(1 << 26)
            got = lo_bw.all_to_all_embedding_bag_backward_on(None, x.grad, *x.args(), mode, [], [])
            for t, (a, b) in enumerate(zip(got, x.reference(x.grad))):
                assert_close(a, b, TOL[dtype], f"one rank mode {mode} call {call} table {t}")
            # scale_grad_by_freq, against aten's CUDA backward (its CPU one divides by another index's count)
            got = lo_bw.all_to_all_embedding_bag_backward_on(
                None, x.grad, *x.args(), mode, [], [], scale_grad_by_freq=True
            )
            for t, (a, b) in enumerate(zip(got, x.reference(x.grad, freq=True))):
                assert_close(a, b, TOL[dtype], f"scale_grad_by_freq mode {mode} call {call} table {t}")
            # sparse gradients: aten's values at aten's indices, uncoalesced
            got = lo_bw.all_to_all_embedding_bag_backward_on(None, x.grad, *x.args(), mode, [], [], sparse=True)
            for t, (a, b) in enumerate(zip(got, x.reference(x.grad, sparse=True))):
                assert a.is_sparse and torch.equal(a._indices(), b._indices()), f"sparse indices of table {t}"
                assert_close(a._values(), b._values(), TOL[dtype], f"sparse values mode {mode} call {call} table {t}")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lo_bw.all_to_all_embedding_bag_backward_on(None, x.grad, *x.args(), 1, [], [])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            got = lo_bw.all_to_all_embedding_bag_backward_on(None, x.grad, *x.args(), 1, [], [])
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(REPLAYS):
        x.refresh()
        for t in got:
            t.fill_(float("nan"))
        graph.replay()
        for t, (a, b) in enumerate(zip(got, x.reference(x.grad))):
            assert_close(a, b, TOL[dtype], f"one rank replay {replay} table {t}")


def test_backward_wait_times_out_into_error_words():
    """Rank 1 of 2 never stages: rank 0's wait gives up and names it; the next eager call on rank 0 raises."""
    g = torch.Generator().manual_seed(5)
    x = Owner(g, 2, 16, 16, 32, torch.float32, torch.int64, False, 0, 40)
    harness = OneGpuRanks(2, lo_bw.data_bytes(x.grad, 2, [], [], 2), lo_bw.FLAG_BYTES, tag="dlrm-bw-timeout",
                          launches=launches.DLRM_BACKWARD)  # fmt: skip

    def fn(r, comm):
        if r == 1:
            return None
        return lo_bw.all_to_all_embedding_bag_backward_on(comm, x.grad, *x.args(), 0, [], [], max_spin=20_000)

    _run(harness, fn)
    words = harness.errors()[0]
    msg = ebb.error_message(words, "test")
    assert msg is not None and "waiting for rank 1's staged gradients" in msg, words
    with pytest.raises(RuntimeError, match="waiting for rank 1's staged gradients"):
        _run(harness, fn)


@pytest.mark.peers
def test_backward_registered_choice_between_processes():
    """The backward op with the compiled choice ``triton`` between this run's processes against its reference
    (NCCL + aten's backward per table)."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    op = torch.ops.fluxcompile.all_to_all_embedding_bag_backward.default
    g = torch.Generator().manual_seed(4321 + rank)
    bags_local, tables, dim = 64, 3, 128
    for dtype in (torch.float32, torch.bfloat16):
        for mode in (0, 1):
            x = Owner(g, tables, bags_local * world, bags_local * world, dim, dtype, torch.int64, False, mode, 500)
            args = (x.grad, x.indices, x.offsets, x.offset2bag, x.bag_size, x.max_indices, x.num_weights, False, mode,
                    [], [], group.group_name)  # fmt: skip
            for call in range(3):
                x.refresh()
                poison_allocator(1 << 26)
                got = op(*args, choice="triton")
                want = op(*args, choice="reference")
                for t, (a, b) in enumerate(zip(got, want)):
                    assert_close(a, b, TOL[dtype], f"rank {rank} {dtype} mode {mode} call {call} table {t}")
        torch.cuda.synchronize()
        errors = cached_comm(group.group_name, lo_bw.TAG).errors.err.tolist() if world > 1 else [0] * ebb.ERR_WORDS
        assert not errors[0], ebb.error_message(errors, "registered choice")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sample_weights_one_rank(dtype, monkeypatch):
    """Per-sample weights (sum pooling) through the Triton choices on a group of one: the pooled rows, the tables'
    gradients and the weights' gradients against aten's CUDA kernels, a padding index among them."""
    g = torch.Generator().manual_seed(23)
    x = Owner(g, 3, 150, 150, 64, dtype, torch.int64, False, 0, 80, pad=2)
    tables = [torch.randn(n, 64, generator=g).to("cuda", dtype) for n in x.num_weights]
    monkeypatch.setitem(lo._group_sizes, "one", 1)
    monkeypatch.setitem(lo_bw._group_sizes, "one", 1)
    forward, _ = lo.make(eb.DEFAULT)
    backward, _ = lo_bw.make()
    for call in range(2):
        x.refresh()
        psw = [torch.rand(i.numel(), generator=g).to("cuda", dtype) for i in x.indices]
        poison_allocator(1 << 26)
        out, *_ = forward(tables, x.indices, x.offsets, 0, False, [150, 3 * 64], [], [], "one", psw, padding_idx=2)
        want = [torch.ops.aten._embedding_bag(w, i, o, False, 0, False, p, False, 2)
                for w, i, o, p in zip(tables, x.indices, x.offsets, psw)]  # fmt: skip
        assert_close(out, torch.cat([w[0].float() for w in want], 1), TOL[dtype], f"pooled call {call}")
        got = backward(x.grad, x.indices, x.offsets, x.offset2bag, x.bag_size, x.max_indices, x.num_weights, False,
                       0, [], [], "one", psw, tables, padding_idx=2)  # fmt: skip
        per = x.grad.view(150, 3, 64)
        for t in range(3):
            ref_w = torch.ops.aten._embedding_bag_backward(
                per[:, t].float().contiguous(), x.indices[t], x.offsets[t], x.offset2bag[t], x.bag_size[t],
                x.max_indices[t], x.num_weights[t], False, 0, False, psw[t].float(), 2,
            )  # fmt: skip
            ref_p = torch.ops.aten._embedding_bag_per_sample_weights_backward(
                per[:, t].float().contiguous(), tables[t].float(), x.indices[t], x.offsets[t], x.offset2bag[t], 0, 2
            )
            assert_close(got[t], ref_w, TOL[dtype], f"table {t}'s gradient, call {call}")
            assert_close(got[3 + t], ref_p, TOL[dtype], f"table {t}'s per-sample weights' gradient, call {call}")
