"""MoE pull lab (several GPUs, under torchrun): how fast the dispatch's copy tiles (kernels/grouped_gemm.py's pull)
move an expert-parallel layer's rows between the GPUs, against NCCL's all_to_all_single, for copy-tile shapes set
through the module's COPY_M / COPY_K (its lab knobs: read at every launch).

Per layer of benchmarks/moe.py (balanced routing) and copy shape, the slowest rank's median of:
  nccl a2a      all_to_all_single of the rows alone;
  send copy     all the rows into this rank's symmetric send buffer (a copy-engine yardstick);
  pull          the dispatch's protocol without a GEMM: ``stage_rows`` (steps 1-3: the peers' rows into the send
                buffer) and the copy tiles' launch;
  fused         the registered dispatch choice (pull and grouped GEMM in one launch), and NCCL's dispatch;
  pull on P     the pull with only P programs (``--programs``): what a few copying programs move;
  ordered C     the ordered dispatch with C copying programs (``--copiers``; COPIER_K set to the shape's K);
  gemm only     the grouped GEMM of the fused variant's tiles on the exchanged rows, no pull.
Every pulled result is first checked equal to NCCL's.

    torchrun --nproc-per-node 2 lab/moe_pull_lab.py [--layers fine] [--copies 32x256,64x256,32x512]
        [--programs 16,32] [--copiers 16,32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import moe as bench
from timing import time_us

from fluxcompile import config, ops
from fluxcompile.kernels import grouped_gemm as gg
from fluxcompile.lowerings.all_to_all import triton as moe

FUSED = "128x256x64-w8s3"


def slowest_median(samples: list[float]) -> float:
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_layer(L, args, rank: int, world: int, group: str) -> list[str]:
    """The table's lines of one layer."""
    A, send, recv = L.A, L.send, L.recv
    rows, k = sum(recv), A.shape[-1]
    dargs = bench._dispatch_args(L, group)
    ref = ops.REFERENCES["all_to_all_matmul"](*dargs)
    comm = moe.group_comm(group, world, moe.dispatch_bytes(A, world), "lab.pull")
    sig = moe.signals(comm)
    out = torch.empty(rows, k, dtype=A.dtype, device="cuda")
    a2a = torch.empty_like(out)

    def pull(programs: int | None = None):
        moe.stage_rows(comm, sig, A, send, "lab pull")
        pl = gg.Pull(A, moe.data_bases(comm), out, rows)
        gg.grouped_gemm(out, L.w, pull=pl, gemm=False, sig=sig, num_programs=programs)

    def gemm_only():
        gg.grouped_gemm(out, L.w, offs=L.offs, row_index=L.row_index, variant=FUSED)

    fused, _ = moe.make_dispatch(FUSED)
    ordered = {c: moe.make_dispatch(f"{FUSED}{moe.ORDERED}{c}")[0] for c in args.copiers}
    methods = {
        "nccl a2a": lambda: dist.all_to_all_single(a2a, A, recv, send),
        "send copy": lambda: comm.data.view(rank, tuple(A.shape), A.dtype).copy_(A),
        "nccl dispatch": lambda: ops.REFERENCES["all_to_all_matmul"](*dargs),
    }
    mb = A.numel() * A.element_size() / 1e6
    lines = []
    copies = args.copies.split(",")
    for copy in copies:
        gg.COPY_M, gg.COPY_K = map(int, copy.split("x"))
        gg.COPIER_K = gg.COPY_K
        found = {**methods, f"pull {copy}": pull, f"fused {copy}": lambda: fused(*dargs)}
        if copy == copies[0]:
            found["gemm only"] = gemm_only
        for n in args.programs:
            found[f"pull {copy} on {n}"] = lambda n=n: pull(n)
        for c in args.copiers:
            found[f"ordered {copy} {c}"] = lambda c=c: ordered[c](*dargs)
        pull()
        bad = [] if torch.equal(out, ref[0]) else ["pull"]
        if not torch.equal(fused(*dargs)[0], ref[0]):
            bad.append("fused")
        for c, fn in ordered.items():
            a_ex, outs = fn(*dargs)
            if not torch.equal(a_ex, ref[0]) or any(not torch.equal(o, r) for o, r in zip(outs, ref[1])):
                bad.append(f"ordered {c}")
        comm.errors.check_previous("lab pull", lambda words, what: gg.check_error(words, group, what))
        if bad:
            raise RuntimeError(f"rank {rank}: {bad} differ from NCCL's exchange")
        times = {name: [] for name in found}
        for _ in range(args.rounds):
            for name, fn in found.items():
                dist.barrier()
                times[name].append(time_us(fn, args.iters))
        for name in found:
            if name in methods and copy != copies[0]:
                continue  # the copy shape does not change these
            us = slowest_median(times[name])
            line = f"{L.layer:8s} {name:22s} {us:9.1f} us  ({mb:.0f} MB of rows per rank, {mb / us * 1e3:.0f} GB/s)"
            lines.append(line)
            if rank == 0:
                print(line, flush=True)
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="fine")
    p.add_argument("--copies", default="32x256,64x256,32x512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--programs", default="16,32", help="pull-only launches on this many programs")
    p.add_argument("--copiers", default="16,32", help="ordered dispatches with this many copying programs")
    args = p.parse_args()
    args.programs = [int(x) for x in args.programs.split(",") if x]
    args.copiers = [int(x) for x in args.copiers.split(",") if x]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    lines = []
    with config.patch(implementations=("+moe",)):
        for L in bench.ep_layers(args.layers.split(","), rank, world, ("balanced",)):
            lines += run_layer(L, args, rank, world, group)
    if rank == 0:
        print("== pull table")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
