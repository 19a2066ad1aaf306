"""benchmarks/moe.py's expert-parallel layers (b) on CPU: every rank builds the same routing, so the ranks' split
lists describe one exchange in every layer of the run, the skewed layers after the balanced ones included; the
benchmark's own check of that (split_mismatch) names the pairs that differ."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="benchmarks/moe.py imports the Triton kernels")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    """benchmarks/moe.py as module ``bench_moe`` (benchmarks/ on the path: it imports ``timing``)."""
    if "bench_moe" not in sys.modules:
        bench = os.path.join(ROOT, "benchmarks")
        if bench not in sys.path:
            sys.path.append(bench)
        spec = importlib.util.spec_from_file_location("bench_moe", os.path.join(bench, "moe.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_moe"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_moe"]


@pytest.mark.parametrize("world", (2, 4))
def test_every_layer_splits_agree_across_ranks(world, monkeypatch):
    m = _load()
    monkeypatch.setattr(m, "DEVICE", "cpu")
    monkeypatch.setattr(m, "DTYPE", torch.float16)
    layers = list(m.SMOKE_LAYERS)
    per_rank = [list(m.ep_layers(layers, r, world)) for r in range(world)]  # each rank's run, on its own
    kinds = [(L.layer, L.kind) for L in per_rank[0]]
    assert kinds == [(name, kind) for name in layers for kind in ("balanced", "skewed")]
    layer_ranks = [[per_rank[r][i] for r in range(world)] for i in range(len(kinds))]
    verdicts = {
        kind: m.split_mismatch([L.send for L in Ls], [L.recv for L in Ls]) for kind, Ls in zip(kinds, layer_ranks)
    }
    assert verdicts == dict.fromkeys(kinds), f"world {world}: {verdicts}"
    for Ls in layer_ranks:  # every rank's rows are its own: a row from the wrong source shows in the exchange
        assert not torch.equal(Ls[0].A, Ls[1].A)


def test_split_mismatch_names_the_pairs():
    m = _load()
    assert m.split_mismatch([[3, 5], [2, 7]], [[3, 2], [5, 7]]) is None
    why = m.split_mismatch([[3, 5], [2, 7]], [[3, 2], [6, 7]])
    assert why == "rank 0 sends rank 1 5 rows, rank 1 expects 6"


def test_a_routing_run_alone_draws_the_same_layer(monkeypatch):
    m = _load()
    monkeypatch.setattr(m, "DEVICE", "cpu")
    monkeypatch.setattr(m, "DTYPE", torch.float16)
    layers = list(m.SMOKE_LAYERS)
    every = [L for L in m.ep_layers(layers, 1, 2) if L.kind == "skewed"]
    alone = list(m.ep_layers(layers, 1, 2, ("skewed",)))
    assert [(L.layer, L.kind) for L in alone] == [(L.layer, L.kind) for L in every]
    for a, b in zip(alone, every):
        assert (a.send, a.recv) == (b.send, b.recv)
        assert torch.equal(a.A, b.A) and torch.equal(a.row_index, b.row_index)


def test_every_rank_times_as_many_iterations(monkeypatch):
    """Each timed iteration is a collective call: ranks that receive different row counts (skewed routing) must
    still time the same number, or the ones with more wait for peers that have stopped."""
    from types import SimpleNamespace

    m = _load()
    monkeypatch.setattr(m, "DEVICE", "cuda")  # iters_for counts only for the GPU
    d, ffn = m.LAYERS["fine"][:2]
    recvs = [[40585, 40678], [8567, 8481]]  # the fine layer's skewed routing at two ranks
    ranks = [SimpleNamespace(recv=r, flops_d=4.0 * sum(r) * d * ffn, flops_c=2.0 * sum(r) * d * ffn) for r in recvs]
    assert m.iters_for(ranks[0].flops_d) != m.iters_for(ranks[1].flops_d)  # each rank's own count differs
    assert m.layer_iters(ranks[0], recvs) == m.layer_iters(ranks[1], recvs)


def compute_only_on_rank(world: int) -> list[tuple[str, str, bool, bool]]:
    """On one gloo rank: the compute-only bound's outputs, with NCCL's exchange added back, are the references'."""
    import torch.distributed as dist

    from fluxcompile import ops

    m = _load()
    m.DEVICE, m.DTYPE = "cpu", torch.float16
    group = dist.group.WORLD.group_name
    rank = dist.get_rank()
    out = []
    for L in m.ep_layers(list(m.SMOKE_LAYERS), rank, world):
        ref_d = ops.REFERENCES["all_to_all_matmul"](*m._dispatch_args(L, group))
        ref_c = ops.REFERENCES["matmul_all_to_all"](*m._combine_args(L, group))
        dispatch, combine = m.compute_only(L, ref_d[0])
        same_d = all(torch.equal(a, b) for a, b in zip(dispatch()[1], ref_d[1]))
        exchanged = torch.empty_like(ref_c)
        dist.all_to_all_single(exchanged, combine(), L.send, L.recv)
        out.append((L.layer, L.kind, same_d, torch.equal(exchanged, ref_c)))
    return out


def test_compute_only_is_the_reference_without_its_exchange(ranks):
    for rank, rows in enumerate(ranks(2).run(compute_only_on_rank, 2)):
        assert rows and all(d and c for *_, d, c in rows), f"rank {rank}: {rows}"


def test_layer_sums_take_the_faster_choice_per_op():
    m = _load()
    rows = [
        dict(layer="fine", routing="balanced", op=op, candidate=c, us=us)
        for c, op, us in (
            ("nccl", "dispatch", 10.0), ("nccl", "combine", 10.0), ("triton:v", "dispatch", 12.0),
            ("triton:v", "combine", 5.0), (m.COMPUTE, "dispatch", 1.0), (m.COMPUTE, "combine", 1.0),
            ("vdev", "dispatch", 2.0), ("vdev", "combine", 2.0),
        )
    ]  # fmt: skip
    sums = {s["candidate"]: (s["us"], s["ratio"]) for s in m.layer_sums(rows)}
    assert sums["nccl"] == (20.0, 1.0)
    assert sums["triton:v"] == (17.0, 0.85)
    assert sums[m.COMPUTE] == (2.0, 0.1)
    assert sums["vdev"] == (4.0, 0.2)
    # NCCL's dispatch, the fused combine; never the compute-only bound or all_to_all_vdev (no choice of the op)
    assert sums[m.BEST] == (15.0, 0.75)
