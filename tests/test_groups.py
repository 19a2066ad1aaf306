"""Bad or unusual process-group set-ups: a TP group that is not the default group, two TP groups in one
model, TP x DP on 4 ranks, world size 1. All must compile, rewrite consistently and match eager."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fluxcompile
from fluxcompile.demo import DemoArgs, check_block
from fluxcompile.models.llama import Block, BlockArgs, parallelize_block
from fluxcompile.testing.numerics import assert_close, assert_grads_close

SMALL = DemoArgs(dim=64, heads=4, ffn=96, batch=2, seq=16)


def block_on_new_group() -> tuple[bool, dict]:
    # DTensor may run a mesh made from a group that spans the whole world on the world group's
    # collectives (mesh equality ignores the group); what matters here is that it compiles and matches.
    group = dist.new_group(list(range(dist.get_world_size())))
    r = check_block(DeviceMesh.from_group(group, "cpu"), SMALL)
    return r.ok, r.counts


def test_tp_group_made_with_new_group(ranks):
    for ok, counts in ranks(2).run(block_on_new_group):
        assert ok
        assert counts["forward"]["all_gather_matmul"] == 2 and counts["forward"]["matmul_reduce_scatter"] == 2


def two_groups_in_one_model() -> tuple[dict, list[str]]:
    """4 ranks as a 2x2 mesh: block 0 is TP over the mesh's rows, block 1 over its columns."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    mesh_a, mesh_b = mesh["a"], mesh["b"]
    torch.manual_seed(0)
    eager = nn.Sequential(Block(BlockArgs(64, 4, 96)), Block(BlockArgs(64, 4, 96)))
    model = copy.deepcopy(eager)
    for m in (eager, model):
        parallelize_block(m[0], mesh_b, sequence_parallel=False)
        parallelize_block(m[1], mesh_a, sequence_parallel=False)
    torch.manual_seed(1)
    x = torch.randn(2, 16, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        fluxcompile.collect_reports() as rep,
    ):
        out = torch.compile(model, backend="fluxcompile")(xb)
        out.sum().backward()
    ref = eager(xa)
    ref.sum().backward()
    assert_close(out, ref, 1e-5, "output")
    assert_close(xb.grad, xa.grad, 1e-5, "input grad")
    assert_grads_close(
        [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters())], 1e-5
    )
    groups = sorted({e.group_name for e in rep.entries() if e.fused})
    counts = {k: rep.count("matmul_all_reduce", k) for k in ("forward", "backward")}
    return counts, [groups, mesh_a.get_group().group_name, mesh_b.get_group().group_name]


def test_two_tp_groups_in_one_model(ranks):
    for counts, (groups, a, b) in ranks(4).run(two_groups_in_one_model):
        assert counts == {"forward": 4, "backward": 10}
        assert a != b and groups == sorted([a, b]), "each block's collectives must keep their own group"


def tp_times_dp() -> tuple[bool, dict, bool]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = check_block(mesh["tp"], SMALL)
    tp_group = mesh["tp"].get_group().group_name
    used = {line.split("(group ")[1].split(")")[0] for line in r.report.splitlines() if "(group " in line}
    return r.ok, r.counts, used == {tp_group}


def test_tp_and_dp_on_four_ranks(ranks):
    results = ranks(4).run(tp_times_dp)
    for ok, counts, right_group in results:
        assert ok and right_group
        assert counts["forward"] == {"all_gather_matmul": 2, "matmul_reduce_scatter": 2, "matmul_all_reduce": 0}
    assert all(c == results[0][1] for _, c, _ in results)


def world_of_one(sequence_parallel: bool) -> bool:
    mesh = init_device_mesh("cpu", (1,))
    return check_block(mesh, DemoArgs(dim=64, heads=4, ffn=96, seq=16, sequence_parallel=sequence_parallel)).ok


def test_world_size_one(ranks):
    assert ranks(1).run(world_of_one, True) == [True]
    assert ranks(1).run(world_of_one, False) == [True]
