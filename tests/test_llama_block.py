"""End to end: the torchtitan-style TP Llama block compiled with backend="fluxcompile" on 2 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close, assert_grads_close, fresh_compiles
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fluxcompile
from fluxcompile.models.llama import Block, BlockArgs, parallelize_block

FUSED = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def run_block(
    mesh: DeviceMesh, sequence_parallel: bool, bias: bool = False, seq: int = 16, tol: float = 1e-5
) -> dict[str, dict[str, int]]:
    """Compile a TP block, compare output and all gradients with eager, return fused-op counts per graph kind."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    torch.manual_seed(0)
    eager = Block(BlockArgs(dim=64, n_heads=4, ffn_dim=96, bias=bias))
    model = copy.deepcopy(eager)
    parallelize_block(eager, mesh, sequence_parallel)
    parallelize_block(model, mesh, sequence_parallel)

    torch.manual_seed(1234 + int(torch.randint(0, 1000, ()).item()))  # fresh inputs, equal on all ranks
    x = torch.randn(2, seq, 64)
    grad = torch.randn(2, seq, 64)
    if sequence_parallel:
        x, grad = x.chunk(tp, dim=1)[rank], grad.chunk(tp, dim=1)[rank]
    x_eager, x_model = x.clone().requires_grad_(), x.clone().requires_grad_()

    with fresh_compiles(), fluxcompile.collect_reports() as rep:
        out = torch.compile(model, backend="fluxcompile")(x_model)
        out.backward(grad)
    ref = eager(x_eager)
    ref.backward(grad)

    assert_close(out, ref, tol, "output")
    assert_close(x_model.grad, x_eager.grad, tol, "input grad")
    pairs = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters())]
    assert_grads_close(pairs, tol)
    return {kind: {op: rep.count(op, kind) for op in FUSED} for kind in ("forward", "backward")}


def block_on_world(sequence_parallel: bool, bias: bool) -> dict[str, dict[str, int]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return run_block(mesh, sequence_parallel, bias)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_sequence_parallel_block(ranks, bias):
    counts = ranks(2).run(block_on_world, True, bias)
    assert counts[0] == counts[1], "ranks rewrote differently"
    fwd, bwd = counts[0]["forward"], counts[0]["backward"]
    assert fwd == {"all_gather_matmul": 2, "matmul_reduce_scatter": 2, "matmul_all_reduce": 0}
    # Backward mirrors it: the output grads are gathered into the wo/w2 input-grad matmuls, and the
    # input grads of (q,k,v) and (w1,w3) are sums of matmuls reduce-scattered.
    assert bwd == {"all_gather_matmul": 2, "matmul_reduce_scatter": 2, "matmul_all_reduce": 0}


def test_block_without_sequence_parallel(ranks):
    counts = ranks(2).run(block_on_world, False, True)
    assert counts[0] == counts[1]
    assert counts[0]["forward"] == {"all_gather_matmul": 0, "matmul_reduce_scatter": 0, "matmul_all_reduce": 2}
    assert counts[0]["backward"]["matmul_all_reduce"] >= 2
