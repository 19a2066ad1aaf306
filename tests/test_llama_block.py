"""End to end: the torchtitan-style TP Llama block compiled with backend="fluxcompile", vs eager."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fluxcompile.demo import BlockResult, DemoArgs, check_block


def block_on_world(a: DemoArgs) -> BlockResult:
    return check_block(init_device_mesh("cpu", (dist.get_world_size(),)), a)


def run(ranks, **kw) -> BlockResult:
    a = DemoArgs(**{"dim": 64, "heads": 4, "ffn": 96, "batch": 2, "seq": 16, **kw})
    results = ranks(2).run(block_on_world, a)
    for rank, r in enumerate(results):
        assert r.ok, f"rank {rank}: {r}"
    assert results[0].counts == results[1].counts, "ranks rewrote their graphs differently"
    return results[0]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_sequence_parallel_block(ranks, bias):
    r = run(ranks, bias=bias)
    assert r.counts["forward"] == {"all_gather_matmul": 2, "matmul_reduce_scatter": 2, "matmul_all_reduce": 0}, r.report
    # The backward mirrors it: output grads are gathered into the wo/w2 input-grad matmuls, and the
    # input grads of (q,k,v) and (w1,w3) — sums of 3 and 2 matmuls — are reduce-scattered.
    assert r.counts["backward"] == {"all_gather_matmul": 2, "matmul_reduce_scatter": 2, "matmul_all_reduce": 0}, (
        r.report
    )
    assert "sum of 2 matmul(s)" in r.report and "sum of 3 matmul(s)" in r.report


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_block_without_sequence_parallel(ranks, bias):
    r = run(ranks, sequence_parallel=False, bias=bias)
    assert r.counts["forward"] == {"all_gather_matmul": 0, "matmul_reduce_scatter": 0, "matmul_all_reduce": 2}, r.report
    # One all-reduce per input gradient of the column-parallel layers (q, k, v, w1, w3).
    assert r.counts["backward"]["matmul_all_reduce"] == 5, r.report


def test_block_ragged_sequence(ranks):
    # 2 x 7 tokens per rank: M = 14 local / 28 gathered rows, no power of two anywhere.
    r = run(ranks, seq=14)
    assert r.counts["forward"]["all_gather_matmul"] == 2


def test_block_with_dynamic_shapes(ranks):
    # Symbolic batch and sequence sizes reach the matchers as SymInts (as after a recompilation).
    # Only the SP block: with dynamic=True the non-SP DTensor block fails inside AOTAutograd
    # (RecursionError) with plain backend="inductor" too, on torch 2.13.
    r = run(ranks, dynamic=True)
    assert sum(r.counts["forward"].values()) == 4, r.report
    assert sum(r.counts["backward"].values()) == 4, r.report


def inference_block(dtype_name: str) -> tuple[dict[str, int], float, float]:
    """Decode-like: no grad, no SP. The attention all-reduce takes the residual add and ffn_norm along."""
    import copy

    import torch

    import fluxcompile
    from fluxcompile.models.llama import Block, BlockArgs, parallelize_block
    from fluxcompile.testing.numerics import TOLERANCE, rel_err

    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    eager = Block(BlockArgs(dim=64, n_heads=4, ffn_dim=96)).to(dtype)
    model = copy.deepcopy(eager)
    parallelize_block(eager, mesh, False)
    parallelize_block(model, mesh, False)
    x = torch.randn(2, 6, 64, dtype=dtype)
    with (
        torch.no_grad(),
        torch._inductor.config.patch(fx_graph_cache=False),
        fluxcompile.collect_reports() as rep,
    ):
        out = torch.compile(model, backend="fluxcompile")(x)
        ref = eager(x)
    counts = {op: rep.count(op) for op in ("all_reduce_rmsnorm", "matmul_all_reduce")}
    return counts, rel_err(out, ref), TOLERANCE[dtype]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_inference_block_fuses_the_rmsnorm_tail(ranks, dtype_name):
    for counts, err, tol in ranks(2).run(inference_block, dtype_name):
        assert counts == {"all_reduce_rmsnorm": 1, "matmul_all_reduce": 1}, counts
        assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
