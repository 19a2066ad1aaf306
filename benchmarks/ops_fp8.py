"""fp8 rows of the op-level benchmark (benchmarks/ops.py runs this with ``--ops fp8``): the all-gather and
reduce-scatter shapes of ops.py and ops_rs.py with e4m3 operands, tensor-wise scales and bf16 products, as
torchao's float8 training with its TP styles runs them (plus the reduce-scatter with row-wise scales, which stay
with the partial).

Methods, timed in interleaved rounds (slowest rank, median): the local GEMM (``torch._scaled_mm``, the "cuBLAS"
column), NCCL + ``_scaled_mm`` (the fp8 gather moves bytes; the reduce-scatter moves the bf16 partial), PyTorch
async-TP's fp8 ops (``symm_mem.fused_all_gather_scaled_matmul``, ``fused_scaled_matmul_reduce_scatter``) and
fluxcompile (the fused op with scales, autotuned among its scaled choices); plus the zero-copy cuBLAS choice
alone. The rows have ops.py's keys; ``bytes`` is what each rank receives, for the row's bandwidth floor (fp8
halves the gather's bytes and the GEMM's time; the reduce-scatter's bf16 partials keep theirs).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from overlap import check_numerics, overlap_row, run_shapes

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


def bench(args: argparse.Namespace, ag_shapes: list[tuple], rs_shapes: list[tuple]) -> list[dict]:
    """The fp8 rows of ops.py's all-gather shapes and ops_rs.py's reduce-scatter shapes (row-wise: the last two)."""
    rows = run_shapes(ag_shapes, _ag_shape, args)
    rows += run_shapes(rs_shapes, _rs_shape, args)
    rows += run_shapes(rs_shapes[-2:], lambda *a: _rs_shape(*a, rowwise=True), args)
    return rows


def _fp8(shape, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda") * scale).to(E4M3)


def _scale(shape=()) -> torch.Tensor:
    return torch.rand(shape, device="cuda") * 0.5 + 0.75


def _ag_shape(args: argparse.Namespace, group: str, model: str, m: int, n: int, k: int) -> dict:
    from fluxcompile.lowerings.all_gather_matmul import cublas_pipelined as pipelined
    from fluxcompile.lowerings.choices import scaled

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank * 1000 + int.from_bytes(os.urandom(2), "little"))  # fresh inputs every run
    a_shard = _fp8((m // world, k))
    b = _fp8((n // world, k), 0.5).t()  # column-major, as _scaled_mm takes it
    sa, sb = _scale(), _scale()
    a_full = torch.empty(m, k, device="cuda", dtype=E4M3)
    dist.all_gather_into_tensor(a_full.view(torch.uint8), a_shard.view(torch.uint8))
    call = (a_shard, [b], [None], 0, world, group, sa, [sb], BF16, True)

    def gemm():
        return torch._scaled_mm(a_full, b, sa, sb, out_dtype=BF16, use_fast_accum=True)

    def nccl_scaled_mm():
        buf = torch.empty(m, k, device="cuda", dtype=E4M3)
        dist.all_gather_into_tensor(buf.view(torch.uint8), a_shard.view(torch.uint8))
        return torch._scaled_mm(buf, b, sa, sb, out_dtype=BF16, use_fast_accum=True)

    def async_tp():
        return torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            a_shard, [b], sa, [sb], 0, group, [None], [None], [BF16], [True]
        )

    def pipelined_only():
        return pipelined.all_gather_matmul(*call)

    def ours():
        return torch.ops.fluxcompile.all_gather_matmul(
            a_shard, [b], [None], 0, world, group, A_scale=sa, B_scales=[sb], out_dtype=BF16, use_fast_accum=True
        )

    ref = (a_full.float() * sa) @ (b.float() * sb)
    check_numerics(
        {"nccl": nccl_scaled_mm, "async_tp": lambda: async_tp()[1][0].reshape(m, -1),
         "pipelined": lambda: pipelined_only()[1][0], "fluxcompile": lambda: ours()[1][0]},
        ref, f"fp8 m={m} n={n} k={k}",
    )  # fmt: skip
    methods = {"nccl_cublas": nccl_scaled_mm, "async_tp": async_tp, "fluxcompile": ours}
    row = overlap_row(
        args, "all_gather_matmul fp8", group, model, (m, n, k), (a_full, b), methods, pipelined_only, call,
        gemm=gemm, tune_op=scaled("all_gather_matmul"),
    )  # fmt: skip
    row["bytes"] = (world - 1) * (m // world) * k  # fp8 rows received
    return row


def _rs_shape(args: argparse.Namespace, group: str, model: str, m: int, n: int, k: int, rowwise: bool = False) -> dict:
    from fluxcompile.lowerings.choices import scaled
    from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank * 1000 + int.from_bytes(os.urandom(2), "little"))
    a = _fp8((m, k // world))
    b = _fp8((n, k // world), 0.5).t()
    sa, sb = (_scale((m, 1)), _scale((1, n))) if rowwise else (_scale(), _scale())
    fast = True
    call = ([a], [b], None, [m, n], 0, "sum", world, group, [sa], [sb], BF16, fast)

    def gemm():
        return torch._scaled_mm(a, b, sa, sb, out_dtype=BF16, use_fast_accum=fast)

    def nccl_scaled_mm():
        out = torch.empty(m // world, n, device="cuda", dtype=BF16)
        dist.reduce_scatter_tensor(out, gemm())
        return out

    def async_tp():
        return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
            a, b, sa, sb, "sum", 0, 0, group, [m, n], None, None, BF16, fast
        )

    def pipelined_only():
        return cublas_pipelined.matmul_reduce_scatter(*call)

    def ours():
        return torch.ops.fluxcompile.matmul_reduce_scatter(
            [a], [b], None, [m, n], 0, "sum", world, group, A_scales=[sa], B_scales=[sb], out_dtype=BF16,
            use_fast_accum=fast,
        )  # fmt: skip

    partial = (a.float() * sa) @ (b.float() * sb)
    ref = torch.empty(m // world, n, device="cuda", dtype=torch.float32)
    dist.reduce_scatter_tensor(ref, partial)
    del partial
    check_numerics(
        {"nccl": nccl_scaled_mm, "async_tp": async_tp, "pipelined": pipelined_only, "fluxcompile": ours},
        ref, f"fp8 m={m} n={n} k={k}",
    )  # fmt: skip
    del ref
    methods = {"nccl_cublas": nccl_scaled_mm, "async_tp": async_tp, "fluxcompile": ours}
    op = "matmul_reduce_scatter fp8" + (" rowwise" if rowwise else "")
    row = overlap_row(
        args, op, group, model, (m, n, k), (a, b), methods, pipelined_only, call, gemm=gemm,
        tune_op=scaled("matmul_reduce_scatter"),
    )  # fmt: skip
    row["bytes"] = (world - 1) * (m // world) * n * 2  # bf16 partials received
    return row
