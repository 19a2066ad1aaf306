"""GEMM + reduce-scatter rows of the op-level benchmark (benchmarks/ops.py runs this with ``--ops rs``).

Shapes (Flux paper's GPT-3 and Llama-3-8B's down projection), weights row-sharded: each rank holds the
``[m, k / world]`` columns of A and the ``[k / world, n]`` rows of B, and gets the sum over ranks of its
``[m / world, n]`` row block. Methods, timed in interleaved rounds (slowest rank, median): the local GEMM
(cuBLAS, and Inductor's best Triton GEMM), NCCL + cuBLAS (mm, then ``reduce_scatter_tensor``), PyTorch
async-TP (``symm_mem.fused_matmul_reduce_scatter``) and fluxcompile (the fused op, autotuned); plus the
zero-copy cuBLAS choice alone ("pipelined": median/min/max, and replayed from a CUDA graph). The rows have
the same keys as ops.py's all-gather rows (both made by overlap.py), so one table and one plot hold both.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from overlap import check_numerics, overlap_row, run_shapes

OP = "matmul_reduce_scatter"

# (model, m, n, k) with the whole k; each rank holds k / world of it.
RS_SHAPES = [
    ("GPT-3 (Flux)", 1024, 12288, 49152),
    ("GPT-3 (Flux)", 4096, 12288, 49152),
    ("GPT-3 (Flux)", 8192, 12288, 49152),
    ("Llama-3-8B down", 2048, 4096, 14336),
    ("Llama-3-8B down", 8192, 4096, 14336),
]


def bench(args: argparse.Namespace) -> list[dict]:
    return run_shapes(RS_SHAPES, _rs_shape, args)


def _rs_shape(args: argparse.Namespace, group: str, model: str, m: int, n: int, k: int) -> dict:
    from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined

    world, rank = dist.get_world_size(), dist.get_rank()
    if m % world or k % world:
        raise ValueError(f"m={m} and k={k} must split over {world} ranks")
    torch.manual_seed(rank * 1000 + int.from_bytes(os.urandom(2), "little"))  # fresh inputs every run
    a = torch.randn(m, k // world, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k // world, n, device="cuda", dtype=torch.bfloat16) / k**0.5
    fused_args = ([a], [b], None, [m, n], 0, "sum", world, group)

    def nccl_cublas():
        out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out, a @ b)
        return out

    def async_tp():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)

    def pipelined_only():
        return cublas_pipelined.matmul_reduce_scatter(*fused_args)

    def ours():  # what a compiled model runs: the fused op, autotuned across its choices
        return torch.ops.fluxcompile.matmul_reduce_scatter(*fused_args)

    # Numerics first: every method against the reduce-scattered product in fp32.
    partial = a.float() @ b.float()
    ref = torch.empty(m // world, n, device="cuda", dtype=torch.float32)
    dist.reduce_scatter_tensor(ref, partial)
    del partial
    check_numerics(
        {"nccl": nccl_cublas, "async_tp": async_tp, "pipelined": pipelined_only, "fluxcompile": ours},
        ref,
        f"m={m} n={n} k={k}",
    )
    del ref
    methods = {"nccl_cublas": nccl_cublas, "async_tp": async_tp, "fluxcompile": ours}
    return overlap_row(args, OP, group, model, (m, n, k), (a, b), methods, pipelined_only, fused_args)
