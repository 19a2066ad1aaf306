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
    methods.update(_cutlass_methods(args, a, b, fused_args, group))
    return overlap_row(args, OP, group, model, (m, n, k), (a, b), methods, pipelined_only, fused_args)


def _cutlass_methods(args: argparse.Namespace, a, b, fused_args, group: str) -> dict:
    """The CUTLASS ring ``cutlass:<variant>`` (the variant of ``--cutlass-variant``, its all-gather launch option
    left off) forced (``cutlass``), and the same GEMM alone (``cutlass_alone``): the ring's epilogue over running
    sums already there (every arrival flag preset), counting its tiles, no pushes. Their difference is the
    protocol's cost. Empty where the choice declines."""
    from fluxcompile.kernels import cutlass_gemm
    from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as rs_cutlass

    variant = args.cutlass_variant.partition(":")[0]
    world, rank = dist.get_world_size(), dist.get_rank()
    run, supports = rs_cutlass.make(variant) if variant in cutlass_gemm.ring_variants() else (None, None)
    why = supports(*fused_args) if supports is not None else f"{variant!r} is not a ring variant"
    if why is not None:
        if rank == 0:
            print(f"cutlass:{variant} (reduce-scatter) left out: {why}", flush=True)
        return {}
    m, n = a.shape[0], b.shape[1]
    tm = cutlass_gemm.VARIANTS[variant].tile[0]
    chunk = m // world
    sub = rs_cutlass.sub_chunk(chunk, tm)
    nxt = (rank + 1) % world
    like = dict(device="cuda", dtype=a.dtype)
    partial, c, zero = torch.empty(m, n, **like), torch.randn(m, n, **like), torch.zeros(tm, n, **like)
    out = torch.empty(chunk, n, **like)
    flags = torch.ones(m // sub, dtype=torch.int32, device="cuda")
    counters = torch.zeros(m // sub, dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    ring = cutlass_gemm.Ring(c, flags, 0, chunk, sub, nxt, nxt, rank, zero, out)

    def alone():
        return cutlass_gemm.gemm(a, b, partial, variant=variant, rotate=(0, nxt * chunk), signal=(counters, sub, 0),
                                 err=err, rank=rank, ring=ring)  # fmt: skip

    return {"cutlass": lambda: run(*fused_args), "cutlass_alone": alone}
