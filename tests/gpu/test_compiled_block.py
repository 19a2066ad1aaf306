"""The fused ops through their CUDA dispatch (autotuned choice), eagerly, in CUDA graphs, and inside the
DTensor Llama block compiled with backend="fluxcompile" (every matched site rewritten: the fused ops and
their kernels are under test here; tests/gpu/test_compile_choices.py covers the choices made while compiling)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import poison_allocator, shared_seed
from torch.distributed.device_mesh import init_device_mesh

from fluxcompile import config, ops
from fluxcompile.demo import DemoArgs, check_block
from fluxcompile.testing.numerics import assert_close


def test_dispatch_picks_a_choice_and_matches_reference():
    group = dist.group.WORLD
    g = torch.Generator(device="cuda").manual_seed(shared_seed() + dist.get_rank())
    A = torch.randn(1, 200, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    Bs = [torch.randn(256, n, device="cuda", dtype=torch.bfloat16, generator=g) / 16 for n in (384, 128)]
    args = (A, Bs, [None, None], 1, group.size(), group.group_name)
    poison_allocator()
    got_A, got = torch.ops.fluxcompile.all_gather_matmul(*args)
    ref_A, ref = ops.REFERENCES["all_gather_matmul"](*args)
    assert_close(got_A, ref_A, 0.0, "gathered A")
    for o, r in zip(got, ref):
        assert_close(o, r, 1e-2, "out")
    # A caller that does not read the gathered operand: its own call signature (tuned apart), no first result.
    no_A, got = torch.ops.fluxcompile.all_gather_matmul(*args, return_A=False)
    assert no_A is None, "the gathered operand returned with return_A=False"
    for o, r in zip(got, ref):
        assert_close(o, r, 1e-2, "out (return_A=False)")
    # Captured after that warm-up call: the choice is memoized, the workspace exists.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap_A, cap = torch.ops.fluxcompile.all_gather_matmul(*args)
    for _ in range(3):
        A.copy_(torch.randn_like(A))
        graph.replay()
        ref_A, ref = ops.REFERENCES["all_gather_matmul"](*args)
        assert_close(cap_A, ref_A, 0.0, "gathered A (graph)")
        assert_close(cap[0], ref[0], 1e-2, "out (graph)")


@pytest.mark.peers  # one rank has no collectives to fuse
@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_llama_block_matches_eager(batch, monkeypatch):
    # batch 1: the gather along the sequence dim is contiguous rows (the pipelined choice applies);
    # batch 2: interleaved rows (it declines, another choice runs).
    # Every matched site rewritten into its fused op (not kept where the unfused ops time faster while
    # compiling), so the counts below pin the rewrite and the fused ops run in the block.
    monkeypatch.setattr(config, "choose_at_compile", "never")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    r = check_block(mesh, DemoArgs(dim=1024, heads=16, ffn=2816, batch=batch, seq=512, dtype="bfloat16"))
    assert r.ok, r
    assert r.counts["forward"]["all_gather_matmul"] == 2 and r.counts["forward"]["matmul_reduce_scatter"] == 2
    # The backward mirrors it (as tests/test_llama_block.py pins on CPU): every collective fused there too.
    assert r.counts["backward"]["all_gather_matmul"] == 2 and r.counts["backward"]["matmul_reduce_scatter"] == 2
