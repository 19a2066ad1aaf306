"""fluxcompile inside Megatron-core: its own tensor-parallel layers on gloo ranks, compiled with the pass on.

The harness (``tests/integration/megatron/megatron_harness.py``) builds Megatron's ``MLP`` and a ``SelfAttention``'s
``linear_qkv`` / ``linear_proj`` from ``get_gpt_layer_local_spec()``, runs them with Megatron's own functions
(the reference), eagerly with ``fluxcompile.integrations.megatron.enable()`` and compiled with fluxcompile, forward
and backward, and compares outputs and every gradient (input and parameters); ``gpt_layer.py`` does the same for
the whole transformer layer. The tests assert which fused op every collective of the forward and the backward
graph became, and the reason of the one Megatron site that cannot fuse. megatron-core is a test dependency on CPU machines (``scripts/setup-env test`` installs it); where
it is not importable these tests are skipped, with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration", "megatron"))

import gpt_layer
import megatron_harness as harness

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (scripts/setup-env test installs it on machines without GPUs)",
)

AGMM, MMRS, MMAR = "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"
# Every layer pair (column-parallel then row-parallel) fuses both of its collectives in each graph.
EXPECTED = {
    True: {"forward": {AGMM: 1, MMRS: 1}, "backward": {AGMM: 1, MMRS: 1}},
    False: {"forward": {MMAR: 1}, "backward": {MMAR: 1}},
}
SAVED = "gathered tensor also kept for 1 other user(s)"


def rank_check(module: str, sp: bool, route: str, frozen: bool) -> harness.Result:
    return harness.check(module, sp, route, frozen)


def rank_layout() -> str:
    return harness.flux_megatron.check_layout()


def run(ranks, world: int, module: str, sp: bool, route: str = "backend", frozen: bool = False) -> harness.Result:
    results = ranks(world).run(rank_check, module, sp, route, frozen)
    for rank, r in enumerate(results):
        where = f"rank {rank} of {world}, {module}, sequence_parallel={sp}"
        # The numbers first: a lost backward (every gradient zero) also leaves no backward graph.
        bad = {k: v for k, v in r.eager_errors.items() if not v <= r.tolerance}
        assert not bad, f"{where}: eager with enable() differs from Megatron's own functions: {bad}"
        bad = {k: v for k, v in r.compiled_errors.items() if not v <= r.tolerance}
        assert not bad, f"{where}: compiled differs from Megatron's own functions: {bad}\n{r.report}"
        assert r.graphs == {"forward": 1, "backward": 1}, f"{where}: graph breaks: {r.graphs}\n{r.report}"
    sites = [[(s.graph, s.collective, s.fused_op) for s in r.sites] for r in results]
    assert all(s == sites[0] for s in sites), "ranks rewrote their graphs differently"
    return results[0]


def assert_fused(r: harness.Result, sp: bool) -> None:
    assert not r.kept(), r.report
    assert {g: r.fused(g) for g in ("forward", "backward")} == EXPECTED[sp], r.report


def test_megatron_version_and_layout(ranks):
    version = ranks(2).run(rank_layout)[0]  # raises naming the version and what is missing
    assert version.startswith(harness.TESTED_MEGATRON), f"expected megatron-core {harness.TESTED_MEGATRON}"


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
@pytest.mark.parametrize("module", ["mlp", "attention"])
def test_layers(ranks, module, sp):
    """MLP: linear_fc1 (column) + linear_fc2 (row); attention: linear_qkv (column) + linear_proj (row)."""
    r = run(ranks, 2, module, sp)
    assert_fused(r, sp)
    if sp:
        # The gathered input feeds the column layer's weight gradient (saved by the forward), the gathered output
        # gradient the row layer's: both read the fused op's gathered tensor.
        ag = {s.graph: s.detail for s in r.sites if s.fused_op == AGMM}
        assert SAVED in ag["forward"] and SAVED in ag["backward"], r.report


@pytest.mark.parametrize("module", ["mlp", "attention"])
def test_four_ranks_through_enable(ranks, module):
    # enable() alone: the pass reaches plain torch.compile(model).
    assert_fused(run(ranks, 4, module, True, route="enable"), True)


def test_frozen_weights(ranks):
    # Megatron's linear_with_frozen_weight (adapter fine-tuning): no weight gradient, so nothing but the matmuls
    # reads the gathered tensors.
    r = run(ranks, 2, "mlp", True, frozen=True)
    assert_fused(r, True)
    assert not any(SAVED in s.detail for s in r.sites), r.report


def test_gather_output_is_kept_with_its_reason(ranks):
    # ColumnParallelLinear(gather_output=True): the output gathered on its features; no fused op for that.
    r = run(ranks, 2, "gather_output", False)
    (kept,) = r.kept()
    assert kept.graph == "forward" and kept.collective == "all_gather_into_tensor"
    assert "a tensor computed by mm: no fused op for matmul -> all_gather" in kept.detail, r.report
    assert r.fused("backward") == {MMAR: 1}, r.report


def rank_gpt_layer() -> tuple[list[str], str]:
    return gpt_layer.run(gpt_layer.parse(["--device", "cpu"]))


def test_whole_gpt_layer(ranks):
    # tests/integration/megatron/gpt_layer.py (the GPU check) on gloo: the real core attention, norms and residuals too.
    for rank, (failures, text) in enumerate(ranks(2).run(rank_gpt_layer)):
        assert not failures, f"rank {rank}: {failures}\n{text}"
        assert "8 collectives, 8 fused" in text, text


def rank_enable_disable() -> dict[str, bool]:
    from megatron.core.tensor_parallel import layers, mappings
    from torch._inductor import config as inductor_config

    import fluxcompile
    from fluxcompile.fx_passes import FluxcompilePass
    from fluxcompile.integrations import megatron as fm

    originals = {n: getattr(mappings, n) for n in ("_reduce", "_gather_along_first_dim")}
    linear = layers.linear_with_grad_accumulation_and_async_allreduce
    facts = {}
    fm.enable()
    fm.enable()
    facts["replaced"] = (
        mappings._reduce is fm.all_reduce
        and layers.linear_with_grad_accumulation_and_async_allreduce
        is (fm.linear_with_grad_accumulation_and_async_allreduce)
    )
    facts["pass installed"] = isinstance(inductor_config.post_grad_custom_pre_pass, FluxcompilePass)
    fm.disable()
    fm.disable()
    facts["restored"] = all(getattr(mappings, n) is f for n, f in originals.items()) and (
        layers.linear_with_grad_accumulation_and_async_allreduce is linear
    )
    facts["pass removed"] = not isinstance(inductor_config.post_grad_custom_pre_pass, FluxcompilePass)
    # A pass the user installed before stays installed after disable().
    fluxcompile.enable()
    fm.enable()
    fm.disable()
    facts["user's pass kept"] = isinstance(inductor_config.post_grad_custom_pre_pass, FluxcompilePass)
    fluxcompile.disable()
    facts["enabled() false"] = not fm.enabled()
    return facts


def test_enable_is_idempotent_and_disable_restores(ranks):
    for facts in ranks(2).run(rank_enable_disable):
        assert all(facts.values()), facts


def test_enable_names_what_it_cannot_find(monkeypatch):
    # A megatron-core whose internals moved: enable() refuses in one line naming each function it cannot replace,
    # and replaces nothing (collectives are not left unfused in silence).
    from megatron.core.tensor_parallel import layers, mappings

    from fluxcompile.integrations import megatron as fm

    reduce, linear = mappings._reduce, layers.linear_with_grad_accumulation_and_async_allreduce

    def moved(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, fp8_meta=None):
        raise AssertionError("not called")

    monkeypatch.delattr(mappings, "_gather_along_first_dim")
    monkeypatch.setattr(layers, "linear_with_grad_accumulation_and_async_allreduce", moved)
    with pytest.raises(RuntimeError) as e:
        fm.enable()
    message = str(e.value)
    assert "\n" not in message, message
    assert "megatron-core " + fm.megatron_version() in message, message
    assert "megatron.core.tensor_parallel.mappings._gather_along_first_dim (not found)" in message, message
    assert (
        "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce "
        "(unknown parameters: fp8_meta)" in message
    ), message
    assert not fm.enabled()
    assert mappings._reduce is reduce and layers.linear_with_grad_accumulation_and_async_allreduce is moved
    monkeypatch.undo()
    assert layers.linear_with_grad_accumulation_and_async_allreduce is linear
    assert fm.check_layout() == fm.megatron_version()
