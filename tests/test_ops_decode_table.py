"""benchmarks/ops_decode.py's table on made-up rows (the benchmark itself runs on GPUs only)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import ops_decode
import torch

from fluxcompile.lowerings import autotune


def _row(m: int, tail: bool, ours: float, one: float) -> dict:
    us = {"cublas": 10.0, "nccl": 20.0, "torch_one_shot": 10.0 + one, "fluxcompile": 10.0 + ours, "cuda:x": 11.0}
    ect = {k: v - 10.0 for k, v in us.items() if k != "cublas"}
    return {
        "op": "all_reduce_rmsnorm" if tail else "matmul_all_reduce", "proj": "o_proj", "m": m, "n": 8192,
        "k": 8192, "tail": tail, "choice": "cuda:x", "us": us, "ect_us": ect, "failed": {"triton:y": "boom"},
        "declined": {}, "ect_vs_nccl": {k: v / ect["nccl"] for k, v in ect.items()},
    }  # fmt: skip


def test_table_reports_ratios_and_failures():
    text = ops_decode.table([_row(1, False, 2.0, 8.0), _row(64, True, 4.0, 3.0)])
    assert "20%" in text and "40%" in text  # ECT ours / NCCL (2 / 10, 4 / 10)
    assert "25%" in text.splitlines()[1]  # ours / one-shot at m = 1: 2 / 8
    assert "FAILED: {'triton:y': 'boom'}" in text
    assert "below PyTorch one-shot at 1 of 1 shapes" in text  # without tail: 2 < 8
    assert "below PyTorch one-shot at 0 of 1 shapes" in text  # with tail: 4 > 3


def test_table_says_whether_the_weights_were_cold():
    warm = ops_decode.table([_row(1, False, 2.0, 8.0)])
    assert "weights: the same each call" in warm
    cold = _row(1, False, 2.0, 8.0) | {"weight_copies": 3}
    assert "weights: cold (each call reads the next of 3 copies" in ops_decode.table([cold])


def test_methods_take_the_weight_copies_in_turn():
    calls = []
    method = autotune.in_turn(calls.append, [(i,) for i in range(3)])  # the bench's methods on weight copies
    for _ in range(7):
        method()
    assert calls == [0, 1, 2, 0, 1, 2, 0]
    assert len(ops_decode.weight_copies(torch.zeros(4), cold=False)) == 1
