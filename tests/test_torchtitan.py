"""fluxcompile inside torchtitan: its own Llama3 debug model and ``parallelize_llama`` on gloo ranks.

The harness (``tests/integration/torchtitan/titan_harness.py``) builds the model as torchtitan's trainer does,
compiles it with torchtitan's own per-block ``torch.compile`` after ``fluxcompile.enable()``, runs one training step and
compares the logits, the loss and every gradient with the same model run without compile. The tests assert that
every tensor-parallel collective of the forward and the backward graph became its fused op, that no collective
of the data-parallel (FSDP) group reached the rewrite, and the one site that stays unfused under activation
checkpointing, with its reason.

torchtitan 0.3.0 needs torch 2.15 (its default SPMD backend, ``spmd_types``, relies on FSDP2's support for it):
``scripts/setup-env`` installs it into the newest stack's venv
(``tests/integration/torchtitan/requirements-newest.txt``); where torchtitan is not importable these tests are skipped, with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration", "torchtitan")
)

import titan_harness as harness

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (scripts/setup-env installs it with the newest torch)",
)

AGMM, MMRS, MMAR = "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"
# One Llama3 block: attention (wqkv column-parallel, wo row-parallel) and feed-forward (w1/w3 column, w2 row).
SEQUENCE_PARALLEL = {"forward": {AGMM: 2, MMRS: 2}, "backward": {AGMM: 2, MMRS: 2}}
NO_SEQUENCE_PARALLEL = {"forward": {MMAR: 2}, "backward": {MMAR: 2}}
# Selective AC recomputes the attention input's gather in the backward, where only wqkv's weight gradient reads it
# (contracting over the gathered tokens); the feed-forward's is recomputed with the w3 matmul and fuses.
RECOMPUTED = "no mm consumes the gathered tensor as its left operand (mm_13 takes it as the right operand"


def rank_check(case: harness.Case) -> harness.Result:
    return harness.check(case)


def run(ranks, world: int, case: harness.Case) -> harness.Result:
    results = ranks(world).run(rank_check, case)
    for rank, r in enumerate(results):
        where = f"rank {rank} of {world}, {r.case}"
        assert r.graphs == {"forward": 1, "backward": 1}, f"{where}: graphs compiled: {r.graphs}\n{r.report}"
        bad = {k: v for k, v in r.errors.items() if not v <= r.tolerance}
        assert not bad, f"{where}: compiled differs from eager beyond {r.tolerance:.0e}: {bad}\n{r.report}"
        assert len(r.errors) > 2, f"{where}: no gradient compared"
    sites = [[(s.graph, s.collective, s.group, s.fused_op) for s in r.sites] for r in results]
    assert all(s == sites[0] for s in sites), "ranks rewrote their graphs differently"
    return results[0]


@pytest.mark.parametrize(
    "case",
    [
        harness.Case("partial_dtensor", sequence_parallel=True, activation_checkpoint=False),
        harness.Case("spmd_types", sequence_parallel=True, activation_checkpoint=False),
        harness.Case("spmd_types", sequence_parallel=False, activation_checkpoint=False),
    ],
    ids=lambda c: f"{c.spmd_backend}-{'sp' if c.sequence_parallel else 'tp'}",
)
def test_tensor_parallel(ranks, case):
    """2 ranks of TP (FSDP2 of degree 1, as torchtitan applies it anyway), float32: every collective fused."""
    r = run(ranks, 2, case)
    assert not r.kept(), r.report
    assert all(s.group == "tp" for s in r.sites), r.report
    expected = SEQUENCE_PARALLEL if case.sequence_parallel else NO_SEQUENCE_PARALLEL
    assert {g: r.fused(g) for g in ("forward", "backward")} == expected, r.report
    if case.spmd_backend == "spmd_types" and case.sequence_parallel:
        # spmd_types scatters the tokens (dim 1) as permute -> reduce_scatter on dim 0 -> permute back.
        rs = [s for s in r.sites if s.fused_op == MMRS]
        assert all("scatter dim 1 (of the input permuted by [1, 0, 2])" in s.detail for s in rs), r.report


def test_partial_dtensor_without_sequence_parallel(ranks):
    """DTensor's redistributions without sequence parallelism: both forward all-reduces fuse; three sites stay,
    each with its reason. They are what torchtitan runs, whatever the attention: wo's input is Shard on its
    features (FlexAttention's ``local_map`` and SDPA's alike), and the gradient reaching wo is Partial (DTensor
    carries the residual stream's gradient through the RMSNorm backward unreduced). For wo's weight gradient
    DTensor gathers wo's input on its features: the partitioner computes that gather in the forward and saves
    its result (no matmul reads it there), and the backward keeps the gather it recomputes, unused. The backward's
    one all-reduce reduces that Partial gradient (half the incoming gradient plus the RMSNorm backward of the
    feed-forward's input gradients), not a matmul's output; its one matmul reader is wo's input gradient."""
    r = run(ranks, 2, harness.Case("partial_dtensor", sequence_parallel=False, activation_checkpoint=False))
    assert all(s.group == "tp" for s in r.sites), r.report
    assert r.fused("forward") == {MMAR: 2} and r.fused("backward") == {}, r.report
    kept = sorted((s.graph, s.collective, s.detail) for s in r.kept())
    assert [k[:2] for k in kept] == [
        ("backward", "all_gather_into_tensor"),
        ("backward", "all_reduce"),
        ("forward", "all_gather_into_tensor"),
    ], r.report
    assert kept[0][2] == "no mm consumes the gathered tensor as its left operand (no users)", r.report
    assert kept[1][2].startswith("aten.div") and kept[1][2].endswith("feeds the all_reduce, not a matmul"), r.report
    assert kept[2][2].startswith("gathers on its last dim"), r.report


def test_torchtitan_defaults_fsdp_tp_selective_ac(ranks):
    """torchtitan's defaults on 4 ranks: spmd_types, sequence parallel, selective activation checkpointing, bfloat16
    parameters, FSDP2 over 2 data-parallel ranks x TP 2. FSDP2's all-gathers and reduce-scatters run in its hooks,
    outside the compiled blocks: no data-parallel collective reaches the rewrite, and the sharded gradients equal
    eager's."""
    r = run(ranks, 4, harness.Case(dtype="bfloat16"))
    assert r.dp == 2
    assert all(s.group == "tp" for s in r.sites), r.report
    assert r.fused("forward") == {AGMM: 2, MMRS: 2}, r.report
    # The backward: both reduce-scatters, the two gathers of the output gradients and the recomputed feed-forward
    # gather fuse; the recomputed attention gather stays (see RECOMPUTED).
    assert r.fused("backward") == {AGMM: 3, MMRS: 2}, r.report
    (kept,) = r.kept()
    assert (kept.graph, kept.collective) == ("backward", "all_gather_into_tensor"), r.report
    assert RECOMPUTED in kept.detail, r.report
