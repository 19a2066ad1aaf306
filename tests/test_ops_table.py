"""benchmarks/ops.py's table on made-up rows (the benchmark itself runs on GPUs only): its summary line gives
the mean overlap efficiency and the median over the rows where it is defined."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import ops


def _row(m: int, oe: float, oe_async: float = 0.5) -> dict:
    return {
        "op": "all_gather_matmul", "m": m, "n": 4096, "k": 4096, "cublas": 100.0, "triton": 110.0,
        "nccl_cublas": 120.0, "async_tp": 115.0, "fluxcompile": 105.0, "oe_async_tp": oe_async,
        "oe_fluxcompile": oe, "choice": "cublas_pipelined", "pipelined": 105.0, "pipelined_min": 104.0,
        "pipelined_max": 107.0, "pipelined_graph": 105.0,
    }  # fmt: skip


def test_summary_gives_mean_and_median():
    text = ops.table([_row(1024, 0.5), _row(2048, 0.8), _row(4096, 1.4)])
    summary = text.splitlines()[-1]
    assert "mean overlap efficiency fluxcompile 90% (median 80%)" in summary
    assert "async-TP 50% (median 50%)" in summary
    assert "slower than NCCL+cuBLAS: 0 of 3" in summary


def test_median_skips_undefined_rows():
    text = ops.table([_row(1024, 0.5), _row(2048, float("nan")), _row(4096, 0.7)])
    summary = text.splitlines()[-1]
    assert "fluxcompile nan% (median 60% of 2 defined)" in summary
