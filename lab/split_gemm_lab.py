"""The compute floor of each way to cut a TP=2 op-level GEMM into pieces, on one GPU with no communication.

A pipelined all-gather+GEMM or GEMM+reduce-scatter runs its rank's GEMM as several cuBLAS calls (so that the
exchange travels beside them); their sum can exceed the one GEMM that NCCL+cuBLAS runs, and that excess bounds the
overlap efficiency from above whatever the exchange costs. This lab times each cut (a list of blocks, each a
cuBLAS ``mm`` of a row range of A by a column range of B into the same block of C) against the whole GEMM,
interleaved round by round, and checks every cut's output against the whole GEMM's.

Cuts, on rank 0 of two (own rows first; rank 1 mirrors them):
  AG  halves      own rows, then the peer's rows (``cublas_pipelined``)
      lead<d>     1/d of own rows, then all other rows (``:lead<d>``)
      col<c>      own rows x the first c columns (beside the shard's flight), all rows x the other columns, the
                  peer's rows x the first c columns
  RS  halves      the peer's rows, then own rows (``:push``)
      tail<d>     all rows but 1/d of own rows, then those (``:tail<d>``)
      col<c>      all rows x the first c columns, the peer's rows x the rest, own rows x the rest (the last block
                  hides the push of the peer's last columns)

Usage: python lab/split_gemm_lab.py [--ops ag,rs] [--cols 1024,2048,...] [--rounds 8 --iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ops import AG_SHAPES  # (model, m, n, k): at two ranks, AG weights hold n / 2 columns
from ops_rs import RS_SHAPES  # (model, m, n, k): at two ranks, RS partials hold k / 2
from timing import time_us

Block = tuple[int, int, int, int]  # rows lo..hi, columns lo..hi


def ag_cuts(m: int, n: int, cols: list[int]) -> dict[str, list[Block]]:
    r = m // 2
    cuts = {"whole": [(0, m, 0, n)], "halves": [(0, r, 0, n), (r, m, 0, n)]}
    for d in (2, 4, 8):
        if r // d >= 64:
            cuts[f"lead{d}"] = [(0, r // d, 0, n), (r // d, m, 0, n)]
    for c in cols:
        if c < n:
            cuts[f"col{c}"] = [(0, r, 0, c), (0, m, c, n), (r, m, 0, c)]
    return cuts


def rs_cuts(m: int, n: int, cols: list[int]) -> dict[str, list[Block]]:
    r = m // 2
    cuts = {"whole": [(0, m, 0, n)], "halves": [(r, m, 0, n), (0, r, 0, n)]}
    for d in (2, 4, 8):
        if r // d >= 64:
            cuts[f"tail{d}"] = [(r // d, m, 0, n), (0, r // d, 0, n)]
    for c in cols:
        if c < n:
            cuts[f"col{c}"] = [(0, m, 0, c), (r, m, c, n), (0, r, c, n)]
    return cuts


def run_cut(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, blocks: list[Block]) -> None:
    for r0, r1, c0, c1 in blocks:
        torch.mm(a[r0:r1], b[:, c0:c1], out=c[r0:r1, c0:c1])


def time_cuts(m: int, n: int, k: int, cuts: dict[str, list[Block]], rounds: int, iters: int) -> dict[str, float]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
    want = a @ b
    outs = {}
    for name, blocks in cuts.items():  # correctness first, on a poisoned output
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        run_cut(a, b, c, blocks)
        err = ((c.float() - want.float()).norm() / want.float().norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"cut {name} of {m}x{n}x{k}: relative error {err}")
        outs[name] = c
    times: dict[str, list[float]] = {name: [] for name in cuts}
    for _ in range(rounds):
        for name, blocks in cuts.items():
            c = outs[name]
            run_cut(a, b, c, blocks)  # warm
            times[name].append(time_us(lambda: run_cut(a, b, c, blocks), iters))  # noqa: B023 (called at once)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="ag,rs")
    p.add_argument("--cols", default="512,1024,2048,3072,4096,6144,8192")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    cols = [int(x) for x in args.cols.split(",")]
    print(torch.cuda.get_device_name(), torch.__version__)
    rows = []
    for op in args.ops.split(","):
        for _, m, n, k in AG_SHAPES if op == "ag" else RS_SHAPES:
            gm, gn, gk = (m, n // 2, k) if op == "ag" else (m, n, k // 2)
            cuts = ag_cuts(gm, gn, cols) if op == "ag" else rs_cuts(gm, gn, cols)
            t = time_cuts(gm, gn, gk, cuts, args.rounds, args.iters)
            best = min((x for x in t if x != "whole"), key=t.get)
            rows.append((op, m, n, k, t, best))
            print(op, m, n, k, {x: round(v, 1) for x, v in t.items()}, flush=True)
    print("== lab table (µs; each cut's excess over the whole GEMM in %)")
    for op, m, n, k, t, best in rows:
        w = t["whole"]
        cells = ", ".join(f"{x} {v / w * 100 - 100:+.1f}" for x, v in t.items() if x != "whole")
        print(f"{op} {m}x{n}x{k}: whole {w:.1f}; best {best} {t[best]:.1f} ({t[best] / w * 100 - 100:+.1f}%); {cells}")


if __name__ == "__main__":
    main()
