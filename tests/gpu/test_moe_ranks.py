"""The MoE dispatch and combine choices (lowerings/all_to_all/triton.py, kernels/grouped_gemm.py) on GPUs.

* The grouped GEMM alone against ``torch._grouped_mm`` / ``torch.bmm``: every variant, bf16 and fp16, both weight
  layouts, gathered rows with padding, one to three weights, empty groups, poisoned outputs.
* Both protocols between ranks simulated on one GPU (fluxcompile/testing/one_gpu_ranks.py: each rank its own
  streams and SM share, symmetric workspaces as slices of one allocation, 0xFF-filled) at 1, 2, 4 and 8 ranks: a
  MoE layer's dispatch (w1 and w3), SwiGLU, combine (w2) per rank, against the ops' reference math over an exchange
  computed by hand; eager calls whose routing changes (one with a rank's launch delayed), then one CUDA graph of
  every rank's layer replayed with new tokens, permutations and group sizes written into the captured inputs
  (the splits, host ints, stay those of the capture), outputs NaN-filled before each replay; the split and
  ordered variants, three weights, accumulate with repeated rows, bmm with equal splits; a rank whose peer never
  calls gets an error naming the rank and the signal. The CUTLASS dispatch (lowerings/all_to_all/cutlass.py: the
  permuted pull beside the CUTLASS grouped GEMM that waits per block of rows) in the same layer, with and without
  the exchanged rows, eager and replayed.
* The registered choices (``group_comm``, group resolution; the CUTLASS dispatch's too) on a group of one rank
  and, between the GPUs of scripts/gpu-check, against ``ops.REFERENCES`` (NCCL ``all_to_all_single`` + grouped_mm): calls whose splits
  change from one to the next, the fused, split and ordered dispatch in turn over the same workspaces.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_helpers import assert_on_every_rank, poison_allocator, shared_seed

from fluxcompile import config, ops
from fluxcompile.kernels import cutlass_grouped
from fluxcompile.kernels import grouped_gemm as gg
from fluxcompile.lowerings.all_to_all import cutlass as cutlass_moe
from fluxcompile.lowerings.all_to_all import triton as moe
from fluxcompile.symm_mem import Comm
from fluxcompile.testing import launches
from fluxcompile.testing.numerics import TOLERANCE, assert_close
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks

BF16, FP16 = torch.bfloat16, torch.float16
D, FFN, E = 512, 768, 3  # model dim, expert FFN dim, local experts
WORLDS = (1, 2, 4, 8)
EAGER_CALLS, REPLAYS = 3, 3
SPIN = 5_000_000  # microseconds: a missing flag is an error after 5 s, not a hang
DEVICE = "cuda"  # the Layer's tensors (a CPU smoke run of this file's logic sets "cpu")
CUTLASS = "cutlass:"


def _queues(world: int) -> None:
    if int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")) < world + 4:
        pytest.skip(f"CUDA_DEVICE_MAX_CONNECTIONS < {world + 4} (scripts/gpu-check sets 32)")


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def _run(ranks: OneGpuRanks, fn, **kwargs):
    try:
        return ranks.run(fn, timeout_s=90.0, **kwargs)
    except TimeoutError as e:  # streams blocked on a flag cannot be cancelled: end the process
        sys.stderr.write(f"\n{e}\n")
        sys.stderr.flush()
        os._exit(1)


def _prefix(xs):
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out


def _exchange(parts, sends, r):
    """all_to_all_single by hand: what rank r receives, rank s's rows for r in source order."""
    return torch.cat([parts[s][_prefix(sends[s])[r] : _prefix(sends[s])[r] + sends[s][r]] for s in range(len(parts))])


def _ragged_ends(g: torch.Generator, R: int, groups: int) -> list[int]:
    cuts = sorted(torch.randint(0, R + 1, (groups - 1,), generator=g).tolist())
    if groups > 2:
        cuts[1] = cuts[0]  # an empty group
    return [*cuts, R]


# --- the grouped GEMM alone --------------------------------------------------------------------------------------


def _weights(n: int, count: int, dtype, layout: str, g) -> list[torch.Tensor]:
    ws = []
    for _ in range(count):
        w = torch.randn(E, D, n, generator=g) / D**0.5
        if layout == "nk":  # stored [E, N, K] (torchtitan), used transposed
            w = w.transpose(1, 2).contiguous().transpose(1, 2)
        ws.append(w.to(device=DEVICE, dtype=dtype))
    return ws


@pytest.mark.parametrize("variant", list(gg.VARIANTS))
def test_grouped_gemm_matches_torch(variant):
    g = torch.Generator().manual_seed(1)
    for dtype in (BF16, FP16):
        tol = TOLERANCE[dtype]
        for layout, weights, gather, grouped in (
            ("kn", 2, False, True), ("nk", 2, True, True), ("nk", 1, False, True), ("kn", 3, True, True),
            ("nk", 2, False, False),
        ):  # fmt: skip
            R = 999 if grouped else 3 * 333
            n_a = R + 7 if gather else R
            a = torch.randn(n_a, D, generator=g).to(device="cuda", dtype=dtype)
            Bs = _weights(FFN, weights, dtype, layout, g)
            offs = torch.tensor(_ragged_ends(g, R, E), dtype=torch.int32, device="cuda") if grouped else None
            row_index = None
            x = a
            if gather:
                row_index = torch.randint(0, n_a, (R,), generator=g)
                row_index[::50] = n_a  # padding rows
                row_index = row_index.cuda()
                x = ops.gather_rows(a, row_index)
            poison_allocator(1 << 28)
            outs = gg.grouped_gemm(a, Bs, offs=offs, row_index=row_index, variant=variant, tma=_hopper())
            for i, (out, b) in enumerate(zip(outs, Bs)):
                want = ops.expert_matmul(x.float(), b.float(), None, offs)
                assert_close(out.view(want.shape), want, tol, f"{variant} {dtype} {layout} w{i} gather={gather}")
                if grouped and dtype == BF16:  # torch's own grouped GEMM agrees (bf16: what it takes on CUDA)
                    tg = torch._grouped_mm(x, b, offs=offs)
                    assert_close(out, tg.float(), tol, f"{variant} vs torch._grouped_mm")


# --- both protocols between ranks simulated on one GPU -----------------------------------------------------------


class Layer:
    """Every rank's MoE layer inputs (kept: a graph reads them), routing changed in place on the device.

    ``counts[s][d]``: rows rank s sends rank d in the dispatch (fixed per Layer: the splits are host ints).
    Rank r's received rows (``[source][...]``) are permuted by ``row_index`` (plus ``pad`` padding rows) into
    ``E`` groups ending at ``offs``; the combine sends each product row back where it came from."""

    def __init__(self, world: int, counts: list[list[int]], g: torch.Generator, *, weights: int = 2, pad: int = 1,
                 bmm: bool = False, accumulate: bool = False, dtype=BF16):  # fmt: skip
        self.world, self.counts, self.g, self.bmm = world, counts, g, bmm
        self.accumulate, self.dtype = accumulate, dtype
        self.pad = 0 if bmm else pad
        self.recv = [[counts[s][r] for s in range(world)] for r in range(world)]
        self.A = [torch.empty(sum(counts[r]), D, device=DEVICE, dtype=dtype) for r in range(world)]
        self.w = [_weights(FFN, weights, dtype, "nk", g) for _ in range(world)]
        self.w2 = [
            (torch.randn(E, FFN, D, generator=g) / FFN**0.5).to(device=DEVICE, dtype=dtype) for _ in range(world)
        ]
        self.row_index = [None] * world
        self.offs = [None] * world
        if not bmm:
            self.row_index = [torch.empty(sum(self.recv[r]) + self.pad, dtype=torch.int64, device=DEVICE)
                              for r in range(world)]  # fmt: skip
            self.offs = [torch.empty(E, dtype=torch.int32, device=DEVICE) for _ in range(world)]
        self.refresh()

    def refresh(self) -> None:
        for r in range(self.world):
            self.A[r].copy_(torch.randn(self.A[r].shape, generator=self.g).to(self.dtype))
            if self.bmm:
                continue
            n = sum(self.recv[r])
            idx = torch.cat([torch.randperm(n, generator=self.g), torch.full((self.pad,), n)])
            if self.accumulate and n > 1:
                idx[-1] = idx[0]  # a row the combine adds twice (the padding row's place)
            self.row_index[r].copy_(idx)
            self.offs[r].copy_(torch.tensor(_ragged_ends(self.g, n + self.pad, E), dtype=torch.int32))

    def call(self, r: int, dcomm: Comm, ccomm: Comm, dispatch_variant: str, combine_variant: str, return_A=True):
        """One rank's layer: dispatch (w1, w3 [, a third]; ``cutlass:<variant>-pull<N>`` the CUTLASS dispatch, which
        returns the exchanged rows only with ``return_A``), SwiGLU, combine (w2)."""
        A, send, recv = self.A[r], self.counts[r], self.recv[r]
        if self.bmm:  # equal splits (empty lists), A as [world, rows per rank, D]
            A, send, recv = A.view(self.world, -1, D), [], []
        if dispatch_variant.startswith(CUTLASS):
            variant, copiers = cutlass_moe.parse(dispatch_variant[len(CUTLASS) :])
            A_ex, outs = cutlass_moe.all_to_all_matmul_on(
                dcomm, A, self.w[r], recv, send, self.offs[r], self.row_index[r], variant=variant, copiers=copiers,
                return_A=return_A,
            )  # fmt: skip
        else:
            A_ex, outs = moe.all_to_all_matmul_on(
                dcomm, A, self.w[r], recv, send, self.offs[r], self.row_index[r], variant=dispatch_variant
            )
        h = (F.silu(outs[0].float()) * outs[1].float()).to(self.dtype)
        y_rows = sum(self.recv[r])
        out = moe.matmul_all_to_all_on(
            ccomm, h, self.w2[r], [y_rows, D], self.counts[r], self.recv[r], self.offs[r], self.row_index[r],
            self.accumulate, variant=combine_variant,
        )  # fmt: skip
        return A_ex, outs, h, out

    def check(self, results, what: str) -> None:
        tol = TOLERANCE[self.dtype]
        Ys = []
        for r in range(self.world):
            A_ex, outs, h, _ = results[r]
            want = _exchange(self.A, self.counts, r)
            if A_ex is not None:  # None: not asked for (return_A False)
                assert torch.equal(A_ex.reshape(-1, D), want), f"{what}: rank {r}'s exchanged rows"
            x = ops.gather_rows(want, self.row_index[r])
            for i, (o, w) in enumerate(zip(outs, self.w[r])):
                ref = ops.expert_matmul(x.float(), w.float(), None, self.offs[r])
                assert_close(o.view(ref.shape), ref, tol, f"{what}: rank {r}'s product {i}")
            P = ops.expert_matmul(h.float(), self.w2[r].float(), None, self.offs[r]).reshape(-1, D)
            Ys.append(ops.scatter_rows(P, self.row_index[r], sum(self.recv[r]), self.accumulate))
        back = [[self.counts[d][s] for d in range(self.world)] for s in range(self.world)]
        for r in range(self.world):
            assert_close(results[r][3], _exchange(Ys, back, r), tol, f"{what}: rank {r}'s combined rows")


def _counts(world: int, g: torch.Generator, hi: int = 160) -> list[list[int]]:
    c = torch.randint(0, hi, (world, world), generator=g)
    if world > 1:
        c[0, world - 1] = 0  # an empty exchange
    return c.tolist()


def _equal_counts(world: int, g: torch.Generator, rows: int) -> list[list[int]]:
    """``counts[s][d]`` with ``rows`` rows per source (every rank has as many token copies, as in training: the
    symmetric buffers are sized by them and grow alike on every rank), split at random, some empty."""
    out = []
    for _ in range(world):
        cuts = sorted(torch.randint(0, rows + 1, (world - 1,), generator=g).tolist())
        out.append([b - a for a, b in zip([0, *cuts], [*cuts, rows])])
    return out


def _harness(world: int, rows: int, tag: str) -> tuple[list[Comm], list[Comm], OneGpuRanks]:
    """Each rank's dispatch and combine ``Comm`` over the harness's workspaces (``rows``: the most rows a rank
    sends or gets back)."""
    rd = OneGpuRanks(world, rows * D * 2, gg.FLAG_BYTES, tag=f"{tag}-d", launches=launches.MOE)
    rc = OneGpuRanks(world, rows * D * 4, gg.FLAG_BYTES, tag=f"{tag}-c")
    dev = torch.device("cuda", torch.cuda.current_device())

    def comms(ranks: OneGpuRanks) -> list[Comm]:
        out = [
            Comm(
                data=ranks.data.ranks[r], flags=ranks.flags.ranks[r], errors=moe.make_errors(dev),
                group_name=f"sim{world}", sm_count=ranks.sm_count, init_flags=ranks.init_flags, max_spin=SPIN,
                side=ranks.streams(r)[1],
            )
            for r in range(world)
        ]  # fmt: skip
        for c in out:
            moe.signals(c)  # every rank's flags set before any rank runs
        return out

    return comms(rd), comms(rc), rd


def _no_errors(*comm_lists) -> None:
    words = [c.errors.err.tolist() for comms in comm_lists for c in comms]
    assert all(not w[0] for w in words), f"wait errors: {words}"


def _replayed(ranks: OneGpuRanks, layer: Layer, fn, dcomms, ccomms, what: str) -> None:
    """One CUDA graph of every rank's layer ``fn`` (the splits are the capture's), replayed with new tokens and
    routing, the outputs NaN-filled before each replay and checked after."""
    graph, results = ranks.capture(fn)
    for replay in range(REPLAYS):
        layer.refresh()
        for A_ex, outs, h, out in results:
            for t in (A_ex, *outs, h, out):
                t.fill_(float("nan"))
        graph.replay()
        try:
            ranks.wait(90.0)
        except TimeoutError as e:
            sys.stderr.write(f"\n{e}\n")
            os._exit(1)
        _no_errors(dcomms, ccomms)
        layer.check(results, f"{what} replay {replay}")


# The dispatch's ways: fused, split, ordered (four programs of a rank's share copy).
_MODES = {"fused": "", "split": moe.SPLIT, "ordered": f"{moe.ORDERED}4"}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", list(_MODES))
def test_layer_between_simulated_ranks(world, mode):
    _queues(world)
    g = torch.Generator().manual_seed(world * 10 + list(_MODES).index(mode))
    dvar = gg.DEFAULT + _MODES[mode]
    dcomms, ccomms, ranks = _harness(world, world * 160 + 64, f"moe{world}{mode[0]}")
    for call in range(EAGER_CALLS):
        layer = Layer(world, _counts(world, g), g)
        poison_allocator(1 << 28)
        delay = {"delay_rank": call % world, "delay_ms": 20.0} if call == 1 else {}
        results = _run(ranks, lambda r, _c, layer=layer: layer.call(r, dcomms[r], ccomms[r], dvar, gg.DEFAULT), **delay)
        _no_errors(dcomms, ccomms)
        layer.check(results, f"{dvar} world {world} eager call {call}")

    # One CUDA graph of every rank's layer: the splits are the capture's, tokens and routing change per replay.
    layer = Layer(world, _counts(world, g), g)
    fn = lambda r, _c: layer.call(r, dcomms[r], ccomms[r], dvar, gg.DEFAULT)  # noqa: E731
    layer.check(_run(ranks, fn), f"{dvar} world {world} before capture")  # compiles every kernel it captures
    _replayed(ranks, layer, fn, dcomms, ccomms, f"{dvar} world {world}")
    layer.refresh()
    layer.check(_run(ranks, fn), f"{dvar} world {world} eager after replays")  # epochs continue from the graph's


@pytest.mark.skipif(cutlass_grouped.unavailable() is not None, reason=f"CUTLASS: {cutlass_grouped.unavailable()}")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["128x128x64_c1x2_pp", "128x256x64_c2x1"])
def test_cutlass_dispatch_between_simulated_ranks(world, variant):
    """The CUTLASS dispatch (the permuted pull on the side stream, the grouped GEMM waiting per block of rows) in
    the layer with the Triton combine: eager calls with changing routing (one rank delayed, one call without the
    exchanged rows), then one CUDA graph replayed with new tokens and routing, outputs NaN-filled."""
    _queues(2 * world)
    g = torch.Generator().manual_seed(300 + world)
    dvar = f"{CUTLASS}{variant}{cutlass_moe.PULL}4"
    dcomms, ccomms, ranks = _harness(world, world * 160 + 64, f"moe-c{world}{variant[:7]}")
    for call in range(EAGER_CALLS):
        layer = Layer(world, _counts(world, g), g)
        poison_allocator(1 << 28)
        delay = {"delay_rank": call % world, "delay_ms": 20.0} if call == 1 else {}
        ret = call != 2
        results = _run(
            ranks, lambda r, _c, la=layer, ret=ret: la.call(r, dcomms[r], ccomms[r], dvar, gg.DEFAULT, ret), **delay
        )  # fmt: skip
        _no_errors(dcomms, ccomms)
        assert all((res[0] is None) != ret for res in results), "the exchanged rows returned as asked"
        layer.check(results, f"{dvar} world {world} eager call {call}")
    layer = Layer(world, _counts(world, g), g)
    fn = lambda r, _c: layer.call(r, dcomms[r], ccomms[r], dvar, gg.DEFAULT)  # noqa: E731
    layer.check(_run(ranks, fn), f"{dvar} world {world} before capture")
    _replayed(ranks, layer, fn, dcomms, ccomms, f"{dvar} world {world}")


@pytest.mark.parametrize("world", (2, 4))
def test_three_weights_accumulate_bmm_fp16(world):
    _queues(world)
    g = torch.Generator().manual_seed(100 + world)
    dcomms, ccomms, ranks = _harness(world, world * 160 + 64, f"moe-x{world}")
    cases = [
        ("three weights", Layer(world, _counts(world, g), g, weights=3, pad=2)),
        ("accumulate, repeated rows", Layer(world, _counts(world, g), g, accumulate=True)),
        ("bmm, equal splits", Layer(world, [[E * 40] * world for _ in range(world)], g, bmm=True)),
        ("fp16", Layer(world, _counts(world, g), g, dtype=FP16)),
    ]
    for name, layer in cases:
        for variant in (gg.DEFAULT, "64x128x64-w4s5"):
            poison_allocator(1 << 28)
            results = _run(ranks, lambda r, _c, la=layer, v=variant: la.call(r, dcomms[r], ccomms[r], v, v))
            _no_errors(dcomms, ccomms)
            layer.check(results, f"{name} {variant} world {world}")
            layer.refresh()


def test_missing_peer_is_an_error_naming_it():
    """World 2, rank 1 never calls: rank 0's copy tiles give up waiting for rank 1's ready flag."""
    _queues(2)
    dcomms, _, ranks = _harness(2, 256, "moe-missing")
    dcomms[0].max_spin = 200_000  # 0.2 s
    dcomms[0].tables.clear()  # the signals again, with the smaller bound
    A = torch.randn(100, D, device="cuda", dtype=BF16)
    w = _weights(FFN, 2, BF16, "nk", torch.Generator().manual_seed(0))
    offs = torch.tensor([30, 60, 100], dtype=torch.int32, device="cuda")

    def fn(r, _c):
        if r == 0:
            return moe.all_to_all_matmul_on(dcomms[0], A, w, [60, 40], [50, 50], offs, variant=gg.DEFAULT)
        return None

    _run(ranks, fn)
    err = dcomms[0].errors.err
    assert err.tolist()[:6] == [1, 0, 1, -1, 1, 1], err.tolist()
    with pytest.raises(RuntimeError, match="rank 0 of group sim2 timed out waiting for rank 1's ready flag"):
        gg.check_error(err, "sim2")
    err.zero_()


# --- the registered choices ---------------------------------------------------------------------------------------


def _choice_call(group, world: int, rank: int, g: torch.Generator, counts, dtype=BF16, variant: str = gg.DEFAULT):
    """Every rank's inputs from a generator seeded alike on every rank; this rank's dispatch (choice
    ``triton:<variant>``) and combine through the registered choices and through the references."""
    name = group.group_name
    layer = Layer(world, counts, g, dtype=dtype)  # every rank builds every rank's inputs; keeps its own
    A, w, w2, offs, row_index = layer.A[rank], layer.w[rank], layer.w2[rank], layer.offs[rank], layer.row_index[rank]
    send, recv = counts[rank], layer.recv[rank]
    if variant.startswith(CUTLASS):  # the CUTLASS dispatch, with the default Triton combine
        run_d, sup_d = cutlass_moe.make(variant[len(CUTLASS) :])
        run_c, sup_c = moe.make_combine(gg.DEFAULT)
    else:
        run_d, sup_d = moe.make_dispatch(variant)
        run_c, sup_c = moe.make_combine(moe.tile_variant(variant))
    dargs = (A, w, [None] * len(w), recv, send, name, None, None, None, False, offs, row_index)
    with config.patch(implementations=("+moe",)):
        assert sup_d(*dargs) is None, sup_d(*dargs)
    A_ex, outs = run_d(*dargs)
    ref_A, ref_outs = ops.REFERENCES["all_to_all_matmul"](*dargs)
    problems = []
    if not torch.equal(A_ex, ref_A):
        problems.append("exchanged rows")
    tol = TOLERANCE[dtype]
    for o, ro in zip(outs, ref_outs):
        if not ops_close(o, ro, tol):
            problems.append("dispatch product")
    h = (F.silu(outs[0].float()) * outs[1].float()).to(dtype)
    y_rows = sum(recv)
    cargs = ([h], [w2], None, [y_rows, D], send, recv, name, None, None, None, False, offs, row_index, False)
    with config.patch(implementations=("+moe",)):
        assert sup_c(*cargs) is None, sup_c(*cargs)
    out = run_c(*cargs)
    ref = ops.REFERENCES["matmul_all_to_all"](*cargs)
    if not ops_close(out, ref, tol):
        problems.append("combined rows")
    return problems


def ops_close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    try:
        assert_close(a, b.float(), tol, "")
        return True
    except AssertionError:
        return False


def test_registered_choices_on_a_group_of_one(monkeypatch):
    monkeypatch.setattr(moe, "timeout_s", lambda: 5.0)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    g = torch.Generator().manual_seed(shared_seed())
    variants = [gg.DEFAULT] + ([f"{CUTLASS}{cutlass_moe.NAMES[0]}"] if cutlass_grouped.unavailable() is None else [])
    for variant in variants:
        for call in range(2):
            rows = [[int(torch.randint(50, 300, (1,), generator=g))]]
            problems = _choice_call(groups[rank], 1, 0, g, rows, variant=variant)
            assert not problems, f"{variant} call {call}: {problems}"


@pytest.mark.peers
def test_registered_choices_between_gpus(monkeypatch):
    """The choices between the GPUs of this machine (symmetric memory) against NCCL all_to_all_single + torch."""
    monkeypatch.setattr(moe, "timeout_s", lambda: 10.0)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(shared_seed())
    ways = [gg.DEFAULT, gg.DEFAULT + moe.SPLIT, f"{gg.DEFAULT}{moe.ORDERED}16"]
    if cutlass_grouped.unavailable() is None:
        ways += [f"{CUTLASS}{name}" for name in cutlass_moe.NAMES[:2]]
    for call in range(2 * len(ways)):
        counts = _equal_counts(world, g, 300 * world if call else 40 * world)  # the workspaces grow after call 0
        variant = ways[call % len(ways)]
        problems = _choice_call(dist.group.WORLD, world, rank, g, counts, variant=variant)
        assert_on_every_rank("; ".join(f"call {call} ({variant}): {p}" for p in problems) or None)
