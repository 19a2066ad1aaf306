"""The reduce-scatter ring's schedule on CPU (fluxcompile/testing/ring_schedule.py): the model finds the hang seen
between four GPUs and in the one-GPU harness at 8 ranks, names its cycle, and finds none in any call the choice
takes (lowerings/matmul_reduce_scatter/cutlass.py's ``chunk_declines``), variants alternating call to call on
the same workspaces, at 2 to 8 ranks, on a whole GPU (132 SMs) and on the harness's share of one."""

from __future__ import annotations

import itertools

import pytest

from fluxcompile.kernels import cutlass_gemm
from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as rs
from fluxcompile.testing.ring_schedule import RingCall, cta_tiles, grid_clusters, harness_sm_count, simulate

A, B = "256x128x64_c2x1", "128x256x64_c2x1"  # the ring's variants: 256- and 128-row tiles, 2x1 clusters
SMS = 132  # H100 and H200 (SXM)
# (m, n) of each rank's partial in benchmarks/ops_rs.py's shapes (GPT-3's and Llama-3-8B's down projections)
OP_SHAPES = [(1024, 12288), (4096, 12288), (8192, 12288), (2048, 4096), (8192, 4096)]


def test_ring_variants_are_the_models():
    assert set(cutlass_gemm.ring_variants()) == {A, B}


def test_the_hang_between_four_gpus():
    """GPT-3's first reduce-scatter at TP=4 (1024 x 12288, 256 rows a rank) with 256x128x64_c2x1 on 132 SMs: every
    rank's step-1 tiles wait for the next rank's step 0, whose last tiles queue behind clusters tied to such a
    step-1 tile; the cycle is the one the GPUs reported (rank 0 waiting for rank 1's sub-chunk 2, rank 2 for rank
    3's sub-chunk 0, rank 3 for rank 0's sub-chunk 1: benchmarks/results/logs/bench-ring-4xh200-2026-11-28-timeout.log)."""
    out = simulate(4, [RingCall(A, 1024, 12288, 0)], SMS)
    assert out.deadlock and not out.hazards
    cycle = "\n".join(out.cycle)
    for r, peer, sub in ((0, 1, 2), (2, 3, 0), (3, 0, 1)):
        assert f"rank {r} call 0 CTA 1 waits for the epilogue of tile" in cycle
        assert f"rank {peer}'s running sums of sub-chunk {sub}" in cycle
    assert "its cluster's CTA 1 is in the epilogue of the tile before" in cycle
    # the same with the autotuner's alternation: the other variant first, then this one
    assert not simulate(4, [RingCall(B, 1024, 12288, 0), RingCall(A, 1024, 12288, 0)], SMS).ok
    # the cause: the cluster's shared pipeline ties its two steps together; without it nothing waits in a circle
    assert simulate(4, [RingCall(A, 1024, 12288, 0)], SMS, coupled=False).ok
    # the choice declines it now, and takes the other variant
    assert "not whole clusters" in rs.chunk_declines(A, 1024, 12288, 4, 0)
    assert rs.chunk_declines(B, 1024, 12288, 4, 0) is None


@pytest.mark.parametrize("world", (2, 4, 8))
def test_the_harness_at_one_gpu(world):
    """test_cutlass_ranks.py's "rows" case with 256 rows a rank on the harness's SMs: 256x128x64_c2x1 deadlocks at 8
    ranks only (a CTA takes several tiles there) and 128x256x64_c2x1 nowhere, as on the H100 (issue 69). At 8
    ranks the cycle also needs the deferred count: a tile's count waits for the CTA's next tile's mainloop."""
    sms = harness_sm_count(world)
    calls = [RingCall(A, world * 256, 768, 0)] * 2
    assert simulate(world, calls, sms).ok == (world != 8)
    assert simulate(world, [RingCall(B, world * 256, 768, 0)] * 2, sms).ok
    if world == 8:
        assert simulate(world, calls, sms, deferred=False).ok
        assert "not whole clusters" in rs.chunk_declines(A, world * 256, 768, world, 0)


def _accepted_sequences():
    """Calls the choice takes: per world size and shape, both variants alternating (or the one taken, twice), by
    rows and by columns, on a whole GPU and on the harness's share."""
    shapes = [(m, n, 0) for m, n in OP_SHAPES] + [(1024, 12288, 1), (200 * 8, 8 * 512, 1), (4096, 768, 0)]
    for world, (m, n, axis) in itertools.product(range(2, 9), shapes):
        if (m if axis == 0 else n) % world:
            continue
        taken = [v for v in (B, A) if rs.chunk_declines(v, m, n, world, axis) is None]
        if taken:
            calls = [RingCall(taken[i % len(taken)], m, n, axis) for i in range(2 if len(taken) == 1 else 3)]
            yield world, calls


@pytest.mark.parametrize("sms", ("gpu", "harness"))
def test_no_deadlock_in_what_the_choice_takes(sms):
    """On the harness's share, the last rank as late as it can be (its peers run ahead as far as the flags
    allow)."""
    seen = 0
    for world, calls in _accepted_sequences():
        if sms == "gpu":
            out = simulate(world, calls, SMS)
        else:
            out = simulate(world, calls, harness_sm_count(world), slow=world - 1)
        assert out.ok, (world, calls, out.cycle[:6], out.hazards[:3])
        seen += 1
    assert seen >= 20


def test_order_of_steps_changes_nothing():
    """Every wait of the model stays true until its own waiter resets it: shuffled orders end alike."""
    for seed in range(4):
        assert not simulate(4, [RingCall(A, 1024, 12288, 0)], SMS, seed=seed).ok
        assert simulate(4, [RingCall(B, 2048, 4096, 0), RingCall(A, 2048, 4096, 0)], 26, seed=seed).ok


def test_the_models_tile_order():
    """Every tile once, each cluster's CTAs on one cluster tile at a time, clusters in the grid's order."""
    for (tm, tn), cluster, raster in itertools.product(((8, 6), (5, 7), (4, 96)), ((2, 1), (1, 2)), ("n", "m")):
        total = -(-tm // cluster[0]) * -(-tn // cluster[1])
        for sms in (12, 26, 132):
            clusters = grid_clusters(sms, cluster, total)
            tiles = cta_tiles(tm, tn, cluster, clusters, raster)
            assert len(tiles) == clusters * cluster[0] * cluster[1] <= sms
            flat = sorted(t for cta in tiles for t in cta)
            assert flat == sorted(itertools.product(range(-(-tm // cluster[0]) * cluster[0]),
                                                    range(-(-tn // cluster[1]) * cluster[1])))  # fmt: skip
    assert grid_clusters(132, (2, 1), 10**6) == 66 and grid_clusters(12, (2, 1), 10**6) == 6


def test_a_broken_protocol_shows():
    """The model's data checks catch a protocol whose order is broken: done flags that never hold a push back let
    a rank's pushes of the next call land while its predecessor's GEMM still reads the running sums."""
    from fluxcompile.testing import ring_schedule

    class Set(list):
        def __getitem__(self, i):
            return 1

    calls = [RingCall(B, 2048, 4096, 0)] * 3
    assert simulate(4, calls, 26, slow=3).ok  # the protocol: rank 3 as late as it can be
    model = ring_schedule._Model(4, calls, 26, True, True)
    model.done = Set(model.done)
    hazards = model.run(None, slow=3).hazards
    assert any("rank 0 call" in h and "into rank 3's running sums while its GEMM" in h for h in hazards), hazards[:3]
