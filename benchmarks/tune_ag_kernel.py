"""The persistent all-gather GEMM kernel's math alone, against cuBLAS: is its GEMM within a few percent?

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/tune_ag_kernel.py [--out DIR]

No communication: every chunk flag is preset to 1 and the peers' slots hold data, so the kernel runs as
a plain GEMM over the gathered rows (local shard + slots) — the floor of the fused op's time. Each rank
times its share of the tile configurations on every local shape of benchmarks/ops.py (both ranks run at
once, each on its own GPU); cuBLAS on the same operands is timed by both. Prints a table (µs, and the
ratio to cuBLAS) and writes tune_ag_kernel.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import timing
import torch
import torch.distributed as dist

from fluxcompile.kernels.ag_gemm import ag_gemm

SHAPES = [(1024, 49152, 12288), (4096, 49152, 12288), (8192, 49152, 12288), (2048, 28672, 4096), (8192, 28672, 4096)]
# name -> (block, tma, num_warps, num_stages, group_m, weight layout)
CONFIGS = {
    "tma 256x128x64 w8 s3": ((256, 128, 64), True, 8, 3, 8, "kn"),
    "tma 256x128x64 w8 s4": ((256, 128, 64), True, 8, 4, 8, "kn"),
    "tma 256x128x64 w8 s3 g16": ((256, 128, 64), True, 8, 3, 16, "kn"),
    "tma 256x128x64 w8 s3 [N,K]": ((256, 128, 64), True, 8, 3, 8, "nk"),
    "tma 128x128x64 w8 s4": ((128, 128, 64), True, 8, 4, 8, "kn"),
    "tma 128x128x128 w8 s3": ((128, 128, 128), True, 8, 3, 8, "kn"),
    "tma 128x256x64 w8 s3 (wrong in run 2)": ((128, 256, 64), True, 8, 3, 8, "kn"),
    "tma 256x128x64 w8 s3 [N,K] g4": ((256, 128, 64), True, 8, 3, 4, "nk"),
}


def time_us(fn, warmup: int = 3, iters: int = 20) -> float:
    """This rank's median µs per call (the ranks time different configurations: no barrier, no reduction)."""
    return timing.interleaved_us({"fn": fn}, warmup, 1, iters, together=False)["fn"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(CONFIGS)[rank::world]
    results: dict[str, dict[str, float]] = {}
    for m, n, k in SHAPES:
        rows, n_local = m // world, n // world
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        slots = torch.randn(world, rows, k, device="cuda", dtype=torch.bfloat16)
        b_kn = torch.randn(k, n_local, device="cuda", dtype=torch.bfloat16) / k**0.5
        b_nk = b_kn.t().contiguous().t()
        full = torch.cat([a if s == 0 else slots[s] for s in range(world)])  # the rows the kernel sees (rank 0)
        shape = f"{m}x{n}x{k}"
        row = results.setdefault(shape, {})
        row["cublas"] = time_us(functools.partial(torch.mm, full, b_kn))
        row["cublas [N,K]"] = time_us(functools.partial(torch.mm, full, b_nk))
        ref = full.float() @ b_kn.float()
        for name in mine:
            block, tma, warps, stages, group_m, layout = CONFIGS[name]
            b = b_kn if layout == "kn" else b_nk
            flags = torch.ones(world, 1, dtype=torch.int32, device="cuda")
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            out = torch.full((m, n_local), float("nan"), device="cuda", dtype=torch.bfloat16)
            a_out = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)

            run = functools.partial(
                ag_gemm, a, slots, flags, [b], [None], 0, world, rows, err, outs=[out], a_out=a_out,
                block=block, tma=tma, num_warps=warps, num_stages=stages, group_m=group_m,
            )  # fmt: skip

            try:
                run()
                # Worst element against the largest: a single wrong tile shows (a norm would average it away).
                rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                row[name] = time_us(run) if rel < 1e-2 and torch.equal(a_out, full) else float("nan")
                if not rel < 1e-2:
                    print(f"rank {rank} {name} {shape}: relative error {rel:.2e}", flush=True)
            except Exception as e:  # a config that does not compile or fit
                print(f"rank {rank} {name} {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                row[name] = float("nan")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged: dict[str, dict[str, float]] = {}
        for r in gathered:
            for shape, row in r.items():
                merged.setdefault(shape, {}).update({k: v for k, v in row.items() if k not in merged.get(shape, {})})
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_ag_kernel.json"), "w") as f:
            json.dump(merged, f, indent=1)
        print("== tune table (µs; x = time / cuBLAS on rank 0) ==")
        for shape, row in merged.items():
            cb = row["cublas"]
            cells = [f"{name}: {t:.0f} ({t / cb:.3f}x)" for name, t in row.items()]
            print(shape + "\n  " + "\n  ".join(cells))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
