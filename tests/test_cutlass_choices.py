"""The CUTLASS choices of all_gather_matmul and matmul_reduce_scatter (lowerings/*/cutlass.py) on CPU: their
registration, how they decline (family switched off, no Hopper, dtypes, layouts, pairs, scatter dims), the
launcher's pure-Python parts (tiles per chunk, weight layouts, generated sources), the reduction kernel under
Triton's interpreter and compiled for sm_90, and the one-GPU harness's symmetric-memory stand-in. Their protocol
runs on GPUs: tests/gpu/test_cutlass_ranks.py."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import random
import threading
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fluxcompile import config
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import cutlass_build, cutlass_gemm, sequencer
from fluxcompile.lowerings.all_gather_matmul import cutlass as ag
from fluxcompile.lowerings.choices import _REGISTRY, choice_named
from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as rs
from fluxcompile.symm_mem import Comm, ErrorWords, FlagArray
from fluxcompile.symm_mem.exchange import slot_bytes
from fluxcompile.testing.numerics import assert_close
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks

BF16, FP16 = torch.bfloat16, torch.float16
OPS = ("all_gather_matmul", "matmul_reduce_scatter")
_mode = FakeTensorMode()


def cuda(*shape, dtype=BF16, t: bool = False, view=None) -> torch.Tensor:
    """A tensor that says it is on cuda:0, without a GPU (only its metadata is read by ``supports``); ``t``: the
    transpose of a row-major ``shape[::-1]`` (an nn.Linear weight's ``.t()``); ``view``: applied before."""
    meta = torch.empty(shape[::-1] if t else shape, dtype=dtype, device="meta")
    meta = meta.t() if t else meta
    return FakeTensor(_mode, view(meta) if view else meta, torch.device("cuda", 0))


def _cutlass(op: str):
    return {name: c for name, c in _REGISTRY[op].items() if c.family in ("cutlass", "rs_ring")}


def _launches(op: str):
    """Every launch variant of the op's CUTLASS choice as the choice the autotuner times (``cutlass:<launch>``)."""
    (base,) = _cutlass(op).values()
    names = cutlass_gemm.variants() if op == "all_gather_matmul" else cutlass_gemm.ring_variants()
    return {f"cutlass:{v}": base.variant(v) for v in names}


def _ag_args(A=None, Bs=None, biases=None, gather_dim=0, world=4):
    A = cuda(200, 512) if A is None else A
    Bs = [cuda(512, 768)] if Bs is None else Bs
    biases = [None] * len(Bs) if biases is None else biases
    return (A, Bs, biases, gather_dim, world, "g")


def _rs_args(As=None, Bs=None, bias=None, out_shape=(800, 768), scatter_dim=0, reduce_op="sum", world=4):
    As = [cuda(out_shape[0] if len(out_shape) == 2 else 800, 512)] if As is None else As
    Bs = [cuda(512, out_shape[-1])] if Bs is None else Bs
    return (As, Bs, bias, list(out_shape), scatter_dim, reduce_op, world, "g")


@pytest.fixture
def hopper(monkeypatch):
    """Every family on (cutlass among them, and the reduce-scatter's ring) and the kernels said to be available (the
    checks after that one)."""
    monkeypatch.setattr(cutlass_gemm, "unavailable", lambda device=None: None)
    monkeypatch.setattr(sequencer, "unavailable", lambda: None)
    with config.patch(implementations=IMPLEMENTATIONS):
        yield


# --- registration and the reasons to decline -------------------------------------------------------------


def test_one_choice_per_family_its_launches_from_the_table():
    """Each op registers one CUTLASS choice; its launches (``cutlass:<variant>[:<option>]...``) are data: every
    launch the shipped table names parses, and a launch's name resolves as a compiled choice does."""
    for op, lowering in (("all_gather_matmul", ag), ("matmul_reduce_scatter", rs)):
        (base,) = _cutlass(op).values()
        assert base.name == "cutlass" and base.launches is not None, op
        table = lowering.table()
        assert table.op == op and table.candidates
        for launch in {*table.candidates, *table.entries.values()}:
            lowering.parse(launch)  # raises for a launch the family does not have
            assert base.variant(launch).name == f"cutlass:{launch}"
    assert not set(cutlass_gemm.variants(fp8=True)) & set(_launches("all_gather_matmul"))  # no fp8 launch yet
    with config.patch(implementations=IMPLEMENTATIONS):
        got = choice_named("all_gather_matmul", "cutlass:128x256x64_c2x1:n:g8")
        assert got is not None and got.family == "cutlass" and got.launches is None
        assert choice_named("all_gather_matmul", "cutlass:128x256x64_c2x1:c9") is None
        assert choice_named("matmul_reduce_scatter", "cutlass:128x256x64_c2x1").family == "rs_ring"


def test_on_by_default_and_declined_when_switched_off():
    assert "cutlass" in IMPLEMENTATIONS and config.family_declines("cutlass") is None
    why = "switched off: config.implementations (FLUXCOMPILE_IMPLEMENTATIONS) leaves out 'cutlass'"
    left_out = tuple(f for f in config.implementations if f != "cutlass")
    for off in ({"implementations": left_out}, {"implementations": ("-cutlass",)}):
        with config.patch(**off):
            for c in (*_cutlass("all_gather_matmul").values(), *_launches("all_gather_matmul").values()):
                assert c.declines(*_ag_args()) == why, c.name


def test_reduce_scatter_ring_is_experimental():
    """The reduce-scatter's ring (family rs_ring) is off by default until it passes between real GPUs at 4 and 8
    (it hung between 4 GPUs: csrc/ring_deadlock_freedom.md) and declines while off."""
    assert "rs_ring" in IMPLEMENTATIONS and "rs_ring" not in config.implementations
    for c in (*_cutlass("matmul_reduce_scatter").values(), *_launches("matmul_reduce_scatter").values()):
        assert c.family == "rs_ring"
        assert "FLUXCOMPILE_IMPLEMENTATIONS=+rs_ring) enables it" in c.declines(*_rs_args()), c.name


def test_declined_without_hopper():
    """Where the launcher cannot run (no Hopper GPU, or no CUTLASS headers) every choice declines with its reason."""
    why = cutlass_gemm.unavailable()
    if why is None:
        pytest.skip("the CUTLASS launcher runs here (a Hopper GPU and CUTLASS's headers)")
    with config.patch(implementations=IMPLEMENTATIONS):
        for op, args in (("all_gather_matmul", _ag_args()), ("matmul_reduce_scatter", _rs_args())):
            for c in (*_cutlass(op).values(), *_launches(op).values()):
                assert c.declines(*args) == why, c.name


def test_one_rank_is_declined():
    with config.patch(implementations=IMPLEMENTATIONS):
        assert ag.supports(*_ag_args(world=1)) == "one rank: nothing to overlap"
        assert rs.supports(*_rs_args(world=1)) == "one rank: nothing to overlap"


def test_all_gather_accepts(hopper):
    assert ag.supports(*_ag_args()) is None
    # several weights, both layouts, biases, a sequence-parallel shard gathered on dim 1, fp16
    Bs = [cuda(512, 768), cuda(512, 256, t=True), cuda(512, 64)]
    assert ag.supports(*_ag_args(Bs=Bs, biases=[cuda(768), None, cuda(64)])) is None
    assert ag.supports(*_ag_args(A=cuda(1, 77, 512))) is None
    assert ag.supports(*_ag_args(A=cuda(1, 77, 512), gather_dim=1)) is None
    assert ag.supports(*_ag_args(A=cuda(200, 512, dtype=FP16), Bs=[cuda(512, 768, dtype=FP16)])) is None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (dict(A=cuda(200, 512, dtype=torch.float32), Bs=[cuda(512, 768, dtype=torch.float32)]), "dtype torch.float32"),
        (dict(Bs=[cuda(512, 768, dtype=FP16)]), "mixed dtypes"),
        (dict(Bs=[cuda(512, 768)] * 5), "more than 4 weights"),
        (dict(Bs=[cuda(512, 768)], biases=[cuda(1, 768)]), "a bias that is not [N]"),
        (dict(Bs=[cuda(512, 768)], biases=[cuda(512)]), "a bias that is not [N]"),
        (dict(Bs=[cuda(256, 768)]), "a weight that is not [K, N]"),
        (dict(A=cuda(200, 500), Bs=[cuda(500, 768)]), "A is not row-major with 16-byte aligned rows"),
        (dict(Bs=[cuda(512, 100)]), "weight dims or strides not 16-byte aligned"),
        (dict(Bs=[cuda(512, 1536, view=lambda b: b[:, ::2])]), "a weight that is neither"),
        (dict(A=cuda(2, 77, 512), gather_dim=1), "gather dim has a leading dim of size > 1"),
        (dict(world=65), "more than 64 ranks"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_all_gather_declines(hopper, args, reason):
    why = ag.supports(*_ag_args(**args))
    assert why is not None and why.startswith(reason), why


def test_all_gather_cpu_tensors(monkeypatch):
    monkeypatch.setattr(cutlass_gemm, "unavailable", lambda device=None: None)
    with config.patch(implementations=IMPLEMENTATIONS):
        assert ag.supports(torch.randn(8, 64, dtype=BF16), [torch.randn(64, 32, dtype=BF16)], [None], 0, 2, "g") == (
            "needs CUDA tensors"
        )


def test_reduce_scatter_accepts(hopper):
    assert rs.supports(*_rs_args()) is None
    assert rs.supports(*_rs_args(reduce_op="avg", bias=cuda(768))) is None
    assert rs.supports(*_rs_args(scatter_dim=1)) is None  # columns
    assert rs.supports(*_rs_args(scatter_dim=-1, out_shape=(4, 200, 768), As=[cuda(800, 512)])) is None
    assert rs.supports(*_rs_args(scatter_dim=1, out_shape=(1, 800, 768), As=[cuda(800, 512)])) is None
    assert rs.supports(*_rs_args(Bs=[cuda(512, 768, t=True)])) is None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (dict(As=[cuda(800, 512)] * 2, Bs=[cuda(512, 768)] * 2), "a sum of several products"),
        (dict(reduce_op="max"), "reduce_op 'max'"),
        (dict(As=[cuda(800, 512, dtype=torch.float32)], Bs=[cuda(512, 768, dtype=torch.float32)]), "dtype"),
        (dict(Bs=[cuda(512, 768, dtype=FP16)]), "mixed dtypes"),
        (dict(bias=cuda(1, 768)), "a bias that is not [N]"),
        (dict(out_shape=(802, 768), As=[cuda(802, 512)]), "dim 0 of size 802 does not split over 4 ranks"),
        (dict(out_shape=(800, 770), Bs=[cuda(512, 770)], scatter_dim=1), "dim 1 of size 770 does not split"),
        (dict(out_shape=(800, 48), Bs=[cuda(512, 48)], scatter_dim=1), "column chunks of 12 elements"),
        (
            dict(out_shape=(4, 200, 768), As=[cuda(800, 512)], scatter_dim=1),
            "scatter dim has a leading dim of size > 1",
        ),
        (dict(Bs=[cuda(512, 640)]), "operand shapes do not match out_shape"),
        (dict(As=[cuda(800, 512, t=True)]), "A is not row-major"),
        (dict(world=65), "more than 64 ranks"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_reduce_scatter_declines(hopper, args, reason):
    why = rs.supports(*_rs_args(**args))
    assert why is not None and why.startswith(reason), why


def test_reduce_scatter_choices_are_the_ring_variants(hopper):
    """Only the variants built with the ring's source are reduce-scatter choices; they take chunks of whole
    clusters of tiles along the scatter axis and decline the rest with the reason (a chunk of one 256-row tile, half
    a 2x1 cluster: the hang between four GPUs, csrc/ring_deadlock_freedom.md)."""
    choices = _launches("matmul_reduce_scatter")
    with pytest.raises(ValueError, match="no CUTLASS reduce-scatter launch"):
        rs.parse("128x256x64_c2x1_sk")
    assert cutlass_gemm.ring_variants() and all(not cutlass_gemm.VARIANTS[v].stream_k for v in cutlass_gemm.ring_variants())
    rows = _rs_args(out_shape=(4 * 512, 768), As=[cuda(2048, 512)])  # 512 rows a rank
    cols = _rs_args(out_shape=(800, 4 * 256), Bs=[cuda(512, 1024)], scatter_dim=1)  # 256 columns a rank
    for name, c in choices.items():
        assert c.declines(*rows) is None and c.declines(*cols) is None, name
        v = cutlass_gemm.VARIANTS[name.partition(":")[2]]
        half = _rs_args(out_shape=(4 * 256, 768), As=[cuda(1024, 512)])  # 256 rows a rank
        if v.tile[0] * v.cluster[0] > 256:
            assert c.declines(*half).startswith(f"a rank's 256 rows are not whole clusters of {v.name} (512 rows)")
        else:
            assert c.declines(*half) is None, name
        tm = cutlass_gemm.VARIANTS[name.partition(":")[2]].tile[0]
        why = c.declines(*_rs_args())  # 200 rows a rank
        assert why == f"a rank's 200 rows are not whole {tm}-row tiles of {name.partition(':')[2]}", why
    assert all(c.declines(*_ag_args()) is None for c in _launches("all_gather_matmul").values())


def test_ring_sub_chunks():
    assert rs.sub_chunk(4096, 128) == 512  # 32 tiles: 8 sub-chunks
    assert rs.sub_chunk(512, 128) == 128  # 4 tiles: one each
    assert rs.sub_chunk(6144, 256) == 768  # 24 tiles: 8 sub-chunks
    assert rs.sub_chunk(1280, 128) == 256  # 10 tiles: 5 sub-chunks
    assert rs.sub_chunk(128 * 7, 128) == 128  # 7 tiles: 7 sub-chunks
    assert rs.sub_chunk(128 * 11, 128) == 128 * 11  # 11 tiles: a prime above the cap, one sub-chunk
    for chunk, tile in ((4096, 128), (768, 256), (128 * 9, 128)):
        sub = rs.sub_chunk(chunk, tile)
        assert chunk % sub == 0 and sub % tile == 0 and chunk // sub <= rs.SUBS_PER_CHUNK


def test_ring_reference_order_and_rounding():
    """rs.ring_reference sums chunk q along q-1, q-2, ..., q, rounding each step: the last step's running sum is
    what the owner returns; with exact values it is the plain sum."""
    world = 3
    partials = [torch.full((6, 4), float(r + 1)) for r in range(world)]
    out = rs.ring_reference(partials, [None, torch.ones(4), None], world, 0, 1.0, BF16)
    assert all(torch.equal(o, torch.full((2, 4), 7.0, dtype=BF16)) for o in out)
    # the order shows in the rounding (bf16's spacing at 256 is 2; ties to even): chunk 0 (ranks 2, 1, 0) is
    # 1 + 1 + 256 = 258; chunks 1 (ranks 0, 2, 1) and 2 (ranks 1, 0, 2) round 257 down to 256 at a step
    partials = [torch.full((3, 1), v) for v in (256.0, 1.0, 1.0)]
    got = rs.ring_reference(partials, [None] * 3, 3, 0, 1.0, BF16)
    assert [t.item() for t in got] == [258.0, 256.0, 256.0]


def test_supports_never_raises(hopper):
    assert ag.supports(None, [], [], 0, 4, "g").startswith("supports() raised")
    assert rs.supports([None], [None], None, [8, 8], 0, "sum", 4, "g").startswith("supports() raised")


# --- the launcher's pure-Python parts ---------------------------------------------------------------------


def _brute_force_tiles(variant: str, m: int, n: int, chunk: int, axis: int) -> list[int]:
    tm, tn, _ = cutlass_gemm.VARIANTS[variant].tile
    extent = m if axis == 0 else n
    counts = [0] * -(-extent // chunk)
    for i in range(-(-m // tm)):
        for j in range(-(-n // tn)):
            lo, hi = (i * tm, min(m, (i + 1) * tm)) if axis == 0 else (j * tn, min(n, (j + 1) * tn))
            for c in range(len(counts)):
                if lo < min(extent, (c + 1) * chunk) and c * chunk < hi:
                    counts[c] += 1
    return counts


@pytest.mark.parametrize("variant", list(cutlass_gemm.VARIANTS))
def test_tiles_per_chunk(variant):
    cases = [
        (800, 768, 200, 0), (800, 768, 400, 0), (1000, 768, 125, 0), (200, 768, 96, 1), (200, 768, 192, 1),
        (333, 1000, 250, 1), (64, 64, 16, 0), (4096, 4096, 512, 1), (130, 130, 130, 0), (7, 384, 48, 1),
    ]  # fmt: skip
    for m, n, chunk, axis in cases:
        got = cutlass_gemm.tiles_per_chunk(variant, m, n, chunk, axis)
        assert got == _brute_force_tiles(variant, m, n, chunk, axis), (m, n, chunk, axis)
        # every tile is counted once per chunk it overlaps; a chunk is never left without tiles
        assert all(t > 0 for t in got)


def test_rs_chunk_layout():
    assert rs.layout(800, 768, 4, 0) == (200, 200, 768)
    assert rs.layout(800, 768, 4, 1) == (192, 800, 192)
    assert rs.scatter_axis([800, 768], 0) == 0
    assert rs.scatter_axis([800, 768], -1) == rs.scatter_axis([4, 200, 768], 2) == 1
    assert rs.data_bytes(800, 768, 4, 0, BF16) == slot_bytes(800 * 768 * 2) + 800 * 768 * 2  # running sums, P


def test_ag_launch_options():
    assert ag.parse("128x256x64_c2x1") == ("128x256x64_c2x1", ag.Launch())
    assert ag.parse("128x256x64_c2x1:c8") == ("128x256x64_c2x1", ag.Launch(chunks=8))
    assert ag.parse("256x128x64_c2x1:n")[1].raster == "n" and ag.Launch().raster in cutlass_gemm.RASTERS
    assert ag.parse("128x256x64_c2x1:m:c2:g16")[1] == ag.Launch(raster="m", chunks=2, group_m=16)
    for bad in ("128x256x64_c2x1:c9", "nope", "128x256x64_c2x1:", "128x256x64_c2x1:n:m", "128x256x64_c2x1:g5"):
        with pytest.raises(ValueError, match="no CUTLASS all-gather launch"):
            ag.make(bad)
    assert ag.chunking(4096, 128, 8) == (512, 8) and ag.chunking(4096, 128, 2) == (2048, 2)
    assert ag.parse("128x256x64_c1x2:g8")[1] == ag.Launch(group_m=8)


def _tile_order(group_m, cm, cn, tiles_m, tiles_n, rotate_tile, m, n):
    """csrc/flux_gemm.cuh's tile_order for a grouped order, in Python."""
    mb_count, nb_count = -(-tiles_m // cm), -(-tiles_n // cn)
    mb, nb = m // cm, n // cn
    if mb >= mb_count or nb >= nb_count:
        return m, n
    group = max(1, group_m // cm)
    linear = mb * nb_count + nb
    first = linear // (group * nb_count) * group
    size = min(group, mb_count - first)
    within = linear % (group * nb_count)
    mb2 = (first + within % size + rotate_tile // cm) % mb_count
    return mb2 * cm + m % cm, within // size * cn + n % cn


@pytest.mark.parametrize("cluster", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("group_m", [4, 8, 16])
def test_grouped_tile_order_is_a_bijection_by_clusters(cluster, group_m):
    """Every tile once; a cluster's tiles stay one cluster (the TMA multicast shares A or B within it); the first
    tiles handed out (the scheduler along N) are the rotation's rows."""
    cm, cn = cluster
    for tiles_m, tiles_n, rotate_tile in ((32, 96, 16), (7, 5, 2), (9, 11, 0), (64, 112, 48)):
        grid_m, grid_n = -(-tiles_m // cm) * cm, -(-tiles_n // cn) * cn  # the scheduler's, padded to clusters
        seen = {}
        for m in range(grid_m):
            for n in range(grid_n):
                seen[(m, n)] = _tile_order(group_m, cm, cn, tiles_m, tiles_n, rotate_tile, m, n)
                m0, n0 = seen[(m, n)]
                assert (m0 % cm, n0 % cn) == (m % cm, n % cn)
        assert sorted(seen.values()) == sorted(seen), "not a bijection"
        first = seen[(0, 0)][0]
        assert first // cm == (rotate_tile // cm) % (-(-tiles_m // cm)), (first, rotate_tile)


def test_ag_chunking():
    assert ag.chunking(200, 128) == (128, 2)
    assert ag.chunking(4096, 128) == (1024, 4)
    assert ag.chunking(64, 128) == (64, 1)  # one chunk, smaller than a tile
    assert ag.chunking(1000, 256) == (256, 4)
    for rows in (1, 7, 200, 333, 1024, 5000):
        for tile in (64, 128, 256):
            chunk, n = ag.chunking(rows, tile)
            assert 1 <= n <= ag.CHUNKS and (n - 1) * chunk < rows <= n * chunk


def test_weight_layout_and_operand_checks():
    a = torch.empty(256, 512, dtype=BF16)
    kn = torch.empty(512, 768, dtype=BF16)
    nk = torch.empty(768, 512, dtype=BF16).t()
    assert cutlass_gemm.weight_layout(kn) == "kn"
    assert cutlass_gemm.weight_layout(nk) == "nk"
    assert cutlass_gemm.weight_layout(torch.empty(512, 1536, dtype=BF16)[:, ::2]) is None
    assert cutlass_gemm.weight_layout(torch.empty(512, 768, dtype=BF16)[:, :384]) == "kn"  # padded rows
    assert cutlass_gemm.operand_unsupported(a, kn) is None
    assert cutlass_gemm.operand_unsupported(a, nk) is None
    assert cutlass_gemm.operand_unsupported(a.half(), kn.half()) is None
    assert cutlass_gemm.operand_unsupported(a.float(), kn.float()).startswith("dtype")
    assert cutlass_gemm.operand_unsupported(a, kn.half()) == "mixed dtypes"
    assert cutlass_gemm.operand_unsupported(a, kn, torch.float32) == "mixed dtypes"
    assert cutlass_gemm.operand_unsupported(a[:, :500], kn[:500]).startswith("A is not row-major")
    assert cutlass_gemm.operand_unsupported(a.t(), kn[:256]).startswith("A is not row-major")
    assert cutlass_gemm.operand_unsupported(a, kn[:, :100]).startswith("weight dims")
    assert cutlass_gemm.operand_unsupported(a, kn[:, ::2]).startswith("a weight that is neither")
    assert cutlass_gemm.operand_unsupported(a[None], kn) == "operands that are not matrices"


def test_ring_builds_are_cooperative():
    """The ring's epilogue drains its stores mid-kernel: a ring build of a ping-pong or stream-K variant is
    refused where the variants are declared (and by a static_assert in csrc/flux_gemm.cuh)."""
    assert all(cutlass_gemm.VARIANTS[v].schedule == "coop" for v in cutlass_gemm.ring_variants())
    for schedule in ("pp", "sk"):
        with pytest.raises(ValueError, match="cooperative schedule only"):
            cutlass_build.Variant((128, 128, 64), (2, 1), schedule, ring=True)


def test_generated_sources():
    files = cutlass_build.generated_sources()
    units = {f for f in files if f.endswith(".cu")}
    rings = {f"flux_gemm_ring_{v}.cu" for v in cutlass_gemm.ring_variants()}
    fp8_parts = {
        f"flux_gemm_{v}_s{scale}{fast}.cu"
        for v in cutlass_gemm.variants(fp8=True)
        for scale, fast in cutlass_build.fp8_parts(cutlass_gemm.VARIANTS[v])
    }
    assert units == {f"flux_gemm_{v}.cu" for v in cutlass_gemm.VARIANTS} | rings | fp8_parts
    registry = files["flux_gemm_registry.cpp"]
    assert set(files) == {*units, "flux_gemm_registry.cpp"}
    for name, v in cutlass_gemm.VARIANTS.items():
        if v.fp8:
            assert f"FLUX_GEMM_FP8_PART({name}, {v.tile[0]}, {v.tile[1]}, {v.tile[2]}" in files[f"flux_gemm_{name}_s11.cu"]
        else:
            assert f"FLUX_GEMM_VARIANT({name}, {v.tile[0]}, {v.tile[1]}, {v.tile[2]}" in files[f"flux_gemm_{name}.cu"]
        ring = f"&flux_gemm_ring_{name}" if v.ring else "nullptr"
        assert f'{{"{name}", ' in registry and f"&flux_gemm_{name}, {ring}}}" in registry
        assert f"cudaError_t flux_gemm_{name}(" in registry
        if v.ring:
            assert f"FLUX_GEMM_RING_VARIANT({name}, {v.tile[0]}" in files[f"flux_gemm_ring_{name}.cu"]
            assert f"cudaError_t flux_gemm_ring_{name}(" in registry


# --- the one-GPU harness's symmetric memory ----------------------------------------------------------------


def test_harness_views_alias_one_allocation():
    world = 3
    ranks = OneGpuRanks(world, data_bytes=5000, flag_bytes=256, tag="t", device="cpu")
    stride = ranks.data.stride
    assert stride >= 5000 and stride % 256 == 0
    base = ranks.data.alloc.data_ptr()
    for r in range(world):
        ws = ranks.data.ranks[r]
        assert (ws.rank, ws.world_size) == (r, world)
        assert ws.buffer.data_ptr() == base + r * stride and ws.nbytes == stride
        assert list(ws.handle.buffer_ptrs) == [base + q * stride for q in range(world)]
    # rank 0's view of rank 2's buffer is rank 2's own view, inside the one allocation
    v0 = ranks.data.ranks[0].view(2, (10, 8), BF16, 64)
    v2 = ranks.data.ranks[2].view(2, (10, 8), BF16, 64)
    assert v0.data_ptr() == v2.data_ptr() == base + 2 * stride + 64
    v0.fill_(3.0)
    assert torch.equal(v2, torch.full((10, 8), 3.0, dtype=BF16))
    assert bool(torch.isnan(ranks.data.ranks[1].view(1, (16,), BF16)).all())  # data starts as NaN
    with pytest.raises(ValueError):
        ranks.data.ranks[0].view(1, (stride,), BF16)  # past rank 1's buffer


def test_harness_flags_are_set_on_every_rank_once():
    world = 4
    ranks = OneGpuRanks(world, data_bytes=1024, flag_bytes=ag.FLAG_BYTES, device="cpu")
    flags = [FlagArray(ranks.flags.ranks[r], ag._DONE_OFFSET, ag.MAX_WORLD) for r in range(world)]
    base = ranks.flags.alloc.data_ptr()
    for r in range(world):
        for q in range(world):
            assert flags[r].addr(q, 5) == base + q * ranks.flags.stride + ag._DONE_OFFSET + 20
    ranks.init_flags(flags[0], 1)
    assert all(bool((flags[r].local() == 1).all()) for r in range(world))
    flags[2].local()[3] = 0  # a rank consumed one
    ranks.init_flags(flags[1], 1)  # once per array: no reset
    assert int(flags[2].local()[3]) == 0
    arrived = FlagArray(ranks.flags.ranks[0], ag._ARRIVED_OFFSET, ag.MAX_WORLD * ag.MAX_CHUNKS)
    ranks.init_flags(arrived, 0)
    assert int(flags[2].local()[0]) == 1  # the arrays do not overlap


# --- the protocols, simulated on CPU ----------------------------------------------------------------------
# Each rank is a thread that runs its call's operations as it issues them (streams are not simulated: a wait
# blocks the thread); flags are int32 words in the harness's one allocation, written and awaited through their
# addresses; the GEMM is torch's, waiting for the chunks (all-gather) and counting tiles (reduce-scatter) as the
# kernel does. This checks the protocols' indexing and handshakes (slots, chunk flags, counters, done/ready over
# several calls of changing shapes) with real interleavings; the kernels and streams are checked on GPUs. The
# all-gather's C++ sequence (csrc/sequences_flux.cpp) is stood in for by _ag_sequence, over the plan it is given.


class _Stream:
    cuda_stream = 0

    def wait_stream(self, other) -> None:
        pass


class _Event:
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _word(addr: int) -> ctypes.c_int32:
    return ctypes.c_int32.from_address(addr)


def _spin(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"simulated wait never satisfied: {what}")
        time.sleep(20e-6)


def _write(stream, addr: int, value: int) -> None:
    if random.random() < 0.3:
        time.sleep(random.random() * 2e-4)  # shake the interleavings
    _word(addr).value = value


def _wait(stream, addr: int, value: int) -> None:
    _spin(lambda: _word(addr).value == value, f"word at {addr:#x} == {value}")


def _consume(stream, addr: int) -> None:
    _wait(stream, addr, 1)
    _write(stream, addr, 0)


def _gemm(a, b, out, bias=None, *, variant, wait=None, signal=None, err=None, rank=0, local=None, ring=None, **kw):
    assert err is not None or (wait is None and signal is None)
    if ring is not None:
        return _ring_gemm(a, b, out, bias, variant=variant, signal=signal, rank=rank, ring=ring, **kw)
    if wait is not None:
        flags, rows_per_rank, chunk_rows, skip = wait
        chunks = -(-rows_per_rank // chunk_rows)
        for s in range(a.shape[0] // rows_per_rank):
            for c in range(chunks) if s != skip else ():
                addr = flags.data_ptr() + 4 * (s * chunks + c)
                _spin(lambda addr=addr: _word(addr).value != 0, f"rank {rank}: chunk {c} of rank {s}")
    if local is not None:  # our rows read where the shard is (the kernel's second TMA descriptor)
        shard, row0 = local
        tm = cutlass_gemm.VARIANTS[variant].tile[0]
        assert wait is not None and row0 % tm == 0 and wait[1] % tm == 0 and shard.shape[0] == wait[1]
        a = a.clone()
        a[row0 : row0 + shard.shape[0]] = shard
    out.copy_(a.float() @ b.float() + (bias.float() if bias is not None else 0))
    if signal is not None:
        counters, chunk, axis = signal
        for c, t in enumerate(cutlass_gemm.tiles_per_chunk(variant, a.shape[0], b.shape[1], chunk, axis)):
            _word(counters.data_ptr() + 4 * c).value += t  # only this rank's thread touches its counters
    return out


def _ag_sequence(
    a_local, Bs, biases, gathered_shape, *plan, rank, world, chunk_rows, variant, side, in_place, return_A, **_
):
    """csrc/sequences_flux.cpp's ``ag_flux``, its checks and then its operations in its order (the side stream's
    first, streams not simulated). In place, our slot of the buffer is poisoned: the GEMM must not read it."""
    peer_slots, buffer, chunk_bounds, done_mine, arrived_theirs, done_theirs, arrived, err = plan
    rows, k = a_local.shape
    peers, chunks = len(peer_slots), len(chunk_bounds) // 2
    bounds = list(zip(chunk_bounds[::2], chunk_bounds[1::2]))
    assert peers == world - 1 == len(done_mine) == len(done_theirs) and len(arrived_theirs) == peers * chunks
    assert chunks == -(-rows // chunk_rows) and all(0 <= lo < hi <= rows for lo, hi in bounds)
    assert tuple(buffer.shape) == (world * rows, k) and all(tuple(t.shape) == (rows, k) for t in peer_slots)
    assert arrived.dtype == torch.int32 and arrived.numel() == world * chunks
    for j in range(peers):
        _consume(side, done_mine[j])
        for c, (lo, hi) in enumerate(bounds):
            peer_slots[j][lo:hi].copy_(a_local[lo:hi])
            _write(side, arrived_theirs[j * chunks + c], 1)
    ours = slice(rank * rows, (rank + 1) * rows)
    if in_place:
        buffer[ours].fill_(float("nan"))
    else:
        buffer[ours].copy_(a_local)
    local = (a_local, rank * rows) if in_place else None
    outs = [torch.empty(world * rows, b.shape[1], dtype=a_local.dtype) for b in Bs]
    for b, bias, out in zip(Bs, biases, outs):
        wait = (arrived, rows, chunk_rows, rank)
        _gemm(buffer, b, out, bias, variant=variant, wait=wait, err=err, rank=rank, local=local)
    arrived.zero_()
    gathered = None
    if return_A:
        gathered = torch.empty(gathered_shape, dtype=a_local.dtype)
        gathered.view(world * rows, k).copy_(buffer)
        if in_place:
            gathered.view(world * rows, k)[ours] = a_local
    for addr in done_theirs:
        _write(None, addr, 1)
    return gathered, outs


def _ring_gemm(a, b, out, bias, *, variant, signal, rank, ring, rotate=(0, 0), **_):
    """The ring's GEMM (csrc/flux_gemm.cuh's RingEpilogue) chunk by chunk in the tile rotation's order: the zero
    chunk adds nothing, the others wait for their sub-chunks' flags and add C; our own chunk goes to ring.out,
    the rest into ``out`` (rounded to its dtype), counted per sub-chunk."""
    r = ring
    m, n = a.shape[0], b.shape[1]
    cutlass_gemm.check_ring(r, cutlass_gemm.VARIANTS[variant], m, n, a.dtype, signal)
    full = r.alpha * (a.float() @ b.float()) + (bias.float() if bias is not None else 0)
    chunks = (m if r.axis == 0 else n) // r.chunk
    per = r.chunk // r.sub
    counts = cutlass_gemm.tiles_per_chunk(variant, m, n, r.sub, r.axis)
    assert rotate == (r.axis, r.zero_chunk * r.chunk)  # the first step's chunk first
    for i in range(chunks):
        q = (r.zero_chunk + i) % chunks
        value = full.narrow(r.axis, q * r.chunk, r.chunk)
        if q != r.zero_chunk:
            for j in range(q * per, (q + 1) * per) if r.flags is not None else ():
                addr = r.flags.data_ptr() + 4 * j
                _spin(lambda addr=addr: _word(addr).value != 0, f"rank {rank}: running sums of sub-chunk {j}")
            value = value + r.c.narrow(r.axis, q * r.chunk, r.chunk).float()
        if q == r.own_chunk:
            r.out.copy_(value)
            continue
        out.narrow(r.axis, q * r.chunk, r.chunk).copy_(value)
        if signal is not None:
            for j in range(q * per, (q + 1) * per):
                _word(signal[0].data_ptr() + 4 * j).value += counts[j]  # only this rank's threads touch them
    return out


def _rs_sequence(
    a, b, bias, bias_scratch, partial, incoming, peer_incoming, zero, counters, arrived, tiles, arrived_theirs,
    done_mine, done_theirs, err, out_shape, *, rank, world, axis, chunk, sub, scale, variant, side, **_,
):  # fmt: skip
    """csrc/sequences_flux.cpp's ``rs_ring``: its checks, then its operations, the side stream's on a thread
    beside the GEMM (the ring's steps depend on the peers' pushes while the GEMM runs)."""
    m, n = partial.shape
    subs = chunk // sub
    assert world >= 2 and chunk * world == (m if axis == 0 else n) and chunk % sub == 0
    assert incoming.shape == peer_incoming.shape == partial.shape and len(tiles) == world * subs
    assert counters.dtype == arrived.dtype == torch.int32 and arrived.numel() == world * subs
    out = torch.empty(out_shape, dtype=partial.dtype)
    nxt = (rank + 1) % world
    if bias is not None and scale != 1.0:
        bias_scratch.copy_(bias * scale)
        bias = bias_scratch
    rows, cols = (chunk, n) if axis == 0 else (m, chunk)
    ring = cutlass_gemm.Ring(incoming, arrived, axis, chunk, sub, nxt, nxt, rank, zero, out.view(rows, cols), scale)
    failures = []

    def side_stream() -> None:
        try:
            first = True
            for step in range(world - 1):
                q = (rank + 1 + step) % world
                for j in range(q * subs, (q + 1) * subs):
                    _wait(side, counters.data_ptr() + 4 * j, tiles[j])
                    _write(side, counters.data_ptr() + 4 * j, 0)
                    if first:
                        _consume(side, done_mine)
                        first = False
                    peer_incoming.narrow(axis, j * sub, sub).copy_(partial.narrow(axis, j * sub, sub))
                    _write(side, arrived_theirs + 4 * j, 1)
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=side_stream, daemon=True)
    thread.start()
    _gemm(a, b, partial, bias, variant=variant, rotate=(axis, nxt * chunk), signal=(counters, sub, axis), err=err,
          rank=rank, ring=ring)  # fmt: skip
    thread.join(60)
    assert not thread.is_alive() and not failures, failures
    arrived.zero_()
    _write(None, done_theirs, 1)
    return out


@pytest.fixture
def simulated(monkeypatch):
    from fluxcompile.symm_mem import comm as comm_module
    from fluxcompile.symm_mem import exchange

    monkeypatch.setattr(comm_module, "current_stream", _Stream)  # after_sequence's report on CPU
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(exchange, "stream_write", _write)
    monkeypatch.setattr(exchange, "stream_consume", _consume)
    monkeypatch.setattr(cutlass_gemm, "gemm", _gemm)
    monkeypatch.setattr(cutlass_gemm, "ag_sequence", _ag_sequence)
    monkeypatch.setattr(cutlass_gemm, "rs_sequence", _rs_sequence)


def _simulate(world: int, data_bytes: int, flag_bytes: int, calls: list, init) -> list[list]:
    """``calls[i](rank, comm)`` on every rank, each rank a thread making its calls in order; their results."""
    ranks = OneGpuRanks(world, data_bytes, flag_bytes, device="cpu")
    words = cutlass_gemm.ERR_WORDS
    comms = [
        Comm(
            data=ranks.data.ranks[r],
            flags=ranks.flags.ranks[r],
            side=_Stream(),
            errors=ErrorWords(torch.zeros(words, dtype=torch.int32), torch.zeros(words, dtype=torch.int32)),
            init_flags=ranks.init_flags,
        )
        for r in range(world)
    ]
    init(comms[0])  # every rank's flags, before any rank runs (symm_mem.init_flags has a barrier)
    results = [[None] * world for _ in calls]
    failures = []

    def rank_thread(r: int) -> None:
        try:
            for i, call in enumerate(calls):
                results[i][r] = call(r, comms[r])
        except BaseException as e:
            failures.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_thread, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert not any(t.is_alive() for t in threads), "a simulated rank is still waiting"
    return results


@pytest.mark.parametrize("world", (2, 3, 4))
def test_all_gather_protocol_simulated(simulated, world):
    variant = next(n for n, v in cutlass_gemm.VARIANTS.items() if not v.stream_k)
    g = torch.Generator().manual_seed(world)
    # rows: 2 chunks, 1, 1, 2 chunks in place (rows a multiple of the tile's M), 2 (gathered A not returned)
    shapes = [((200, 64), 0), ((40, 64), 0), ((1, 77, 64), 1), ((256, 64), 0), ((200, 64), 0)]
    return_A = [True, True, True, True, False]
    inputs = [
        [
            (
                torch.randn(shape, generator=g).to(BF16),
                [torch.randn(64, 48, generator=g).to(BF16), torch.randn(32, 64, generator=g).to(BF16).t()],
                [torch.randn(48, generator=g).to(BF16), None],
            )
            for _ in range(world)
        ]
        for shape, _ in shapes
    ]

    launches = [ag.Launch(), ag.Launch(), ag.Launch(), ag.Launch(chunks=8), ag.Launch(raster="n", chunks=2)]

    def call(i, r, comm):
        return ag.all_gather_matmul_on(
            comm, *inputs[i][r], shapes[i][1], variant=variant, launch=launches[i], return_A=return_A[i]
        )

    calls = [functools.partial(call, i) for i in range(len(shapes))]
    nbytes = ag.data_bytes(256, 64, world, BF16)
    results = _simulate(world, nbytes, ag.FLAG_BYTES, calls, ag.flag_arrays)
    for i, (_, dim) in enumerate(shapes):
        gathered = torch.cat([inputs[i][r][0] for r in range(world)], dim=dim)
        for r, (A_gathered, outs) in enumerate(results[i]):
            assert (A_gathered is None) if not return_A[i] else torch.equal(A_gathered, gathered), (i, r)
            _, Bs, biases = inputs[i][r]
            for out, b, bias in zip(outs, Bs, biases):
                want = gathered.reshape(-1, 64).float() @ b.float() + (bias.float() if bias is not None else 0)
                assert_close(out, want, 1e-2, f"call {i} rank {r}")


@pytest.mark.parametrize("world", (2, 3, 4))
def test_reduce_scatter_protocol_simulated(simulated, world):
    variant = cutlass_gemm.ring_variants()[0]
    g = torch.Generator().manual_seed(world)
    cases = [  # out_shape, scatter dim, reduce op, bias; shapes change between calls (the buffers move)
        ([world * 256, 96], 0, "sum", True),
        ([200, world * 512], 1, "sum", True),
        ([1, world * 128, 48], 1, "avg", True),
        ([2, 70, world * 256], -1, "avg", False),
        ([world * 256, 96], 0, "sum", False),
    ]
    inputs = []
    for out_shape, _, _, bias in cases:
        m, n = math.prod(out_shape[:-1]), out_shape[-1]
        inputs.append([
            (torch.randn(m, 64, generator=g).to(BF16), torch.randn(64, n, generator=g).to(BF16),
             torch.randn(n, generator=g).to(BF16) if bias else None)
            for _ in range(world)
        ])  # fmt: skip

    def call(i, r, comm):
        out_shape, dim, op, _ = cases[i]
        a, b, bias = inputs[i][r]
        return rs.matmul_reduce_scatter_on(comm, [a], [b], bias, out_shape, dim, op, variant=variant)

    nbytes = max(rs.data_bytes(math.prod(s[:-1]), s[-1], world, rs.scatter_axis(s, d), BF16) for s, d, _, _ in cases)
    results = _simulate(world, nbytes, rs.FLAG_BYTES, [functools.partial(call, i) for i in range(len(cases))],
                        rs.flag_arrays)  # fmt: skip
    for i, (out_shape, dim, op, _) in enumerate(cases):
        scale = 1.0 / world if op == "avg" else 1.0
        total = sum((a.float() @ b.float() + (x.float() if x is not None else 0)) for a, b, x in inputs[i]) * scale
        parts = total.reshape(out_shape).chunk(world, dim=dim)
        axis = rs.scatter_axis(out_shape, dim)
        ring = rs.ring_reference([a.float() @ b.float() for a, b, _ in inputs[i]], [x for _, _, x in inputs[i]], world,
                                 axis, scale, BF16)  # fmt: skip
        for r, out in enumerate(results[i]):
            assert list(out.shape) == list(parts[r].shape), (i, r)
            assert_close(out, parts[r], 1e-2, f"call {i} rank {r}")
            assert torch.equal(out.reshape(ring[r].shape), ring[r]), f"call {i} rank {r}: not the ring's order"
