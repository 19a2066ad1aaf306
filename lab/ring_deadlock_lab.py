"""The reduce-scatter ring's hang, reproduced between ranks simulated on one GPU (fluxcompile/testing/one_gpu_ranks.py)
beside the CPU schedule model's prediction (fluxcompile/testing/ring_schedule.py), case by case.

Each case calls the protocol (``matmul_reduce_scatter_on``) directly, past the choice's ``supports``, so the
variants and shapes that the choice now declines run as they did before: every rank's calls in turn on one set of
workspaces, the waits bounded by ``--timeout`` s. Per call: the model's verdict for the calls so far, each rank's
error words (a timed-out wait: rank, peer, sub-chunk) and, where no wait timed out, the outputs against the ring's
own order and rounding (``ring_reference``). A case whose wait timed out leaves stale flags in its workspaces, so
every case has its own, and a call after a timed-out one is not run.

Cases (``--cases``):
  h8      8 ranks, [2048, 768] scattered by rows, k 512, 256x128x64_c2x1 (a 256-row chunk: one tile, half a
          cluster): the harness's failing case (test_cutlass_ranks.py's "rows" at 8, before the chunk rule)
  h8-ok   the same with 128x256x64_c2x1 (a 256-row chunk: one cluster of two tiles)
  alt4    4 ranks, [1024, 12288], k 12288 (GPT-3's first reduce-scatter at TP=4, the shape that hung between four
          GPUs): 128x256x64_c2x1 then 256x128x64_c2x1 on the same workspaces, as the autotuner alternated them
  alt4-ok 4 ranks, [2048, 12288], k 12288: the two variants alternating, four calls (512-row chunks: whole clusters
          of both)

    CUDA_DEVICE_MAX_CONNECTIONS=32 python lab/ring_deadlock_lab.py --cases h8,alt4   (scripts/gpu-check ring-lab)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from fluxcompile import config
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import cutlass_gemm, sequencer
from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as rs
from fluxcompile.testing import launches
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks
from fluxcompile.testing.ring_schedule import RingCall, simulate

A, B = "256x128x64_c2x1", "128x256x64_c2x1"
CASES = {
    # name: (world, m, n, k, variants of the calls in order)
    "h8": (8, 2048, 768, 512, [A, A]),
    "h8-ok": (8, 2048, 768, 512, [B, B]),
    "alt4": (4, 1024, 12288, 12288, [B, A]),
    "alt4-ok": (4, 2048, 12288, 12288, [B, A, B, A]),
}


def run_case(name: str, timeout_s: float) -> list[str]:
    world, m, n, k, variants = CASES[name]
    dtype = torch.bfloat16
    As = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(world)]
    Bs = [(torch.randn(k, n, device="cuda") / k**0.5).to(dtype) for _ in range(world)]
    for v in sorted(set(variants)):
        launches.load_cutlass_reduce_scatter(v, [Bs[0]])
    ranks = OneGpuRanks(world, rs.data_bytes(m, n, world, 0, dtype), rs.FLAG_BYTES, tag=f"ring-lab-{name}",
                        launches=launches.CUTLASS_REDUCE_SCATTER)  # fmt: skip
    products = None
    rows = []
    for i, v in enumerate(variants):
        model = simulate(world, [RingCall(u, m, n, 0) for u in variants[: i + 1]], ranks.sm_count)
        verdict = "ok" if model.ok else f"deadlock ({len(model.deadlock)} agents blocked)"
        declines = rs.chunk_declines(v, m, n, world, 0)

        def fn(r, comm, v=v):
            return rs.matmul_reduce_scatter_on(comm, [As[r]], [Bs[r]], None, [m, n], 0, "sum", variant=v)

        try:
            outs = ranks.run(fn, timeout_s=120.0)
        except TimeoutError as e:  # streams blocked on a flag cannot be cancelled: end the process
            print(f"{name} call {i} {v}: {e}", flush=True)
            os._exit(1)
        errors = ranks.errors()
        failed = [w for w in errors if w[0]]
        if failed:
            gpu = "wait errors: " + "; ".join(f"rank {w[1]} <- rank {w[2]} sub-chunk {w[3]}" for w in failed)
        else:
            if products is None:
                products = [a.float() @ b.float() for a, b in zip(As, Bs)]
            want = rs.ring_reference(products, [None] * world, world, 0, 1.0, dtype)
            worst = max(float((o.float() - w.float()).norm() / w.float().norm()) for o, w in zip(outs, want))
            gpu = f"no wait error; rel. error vs the ring's order {worst:.1e}"
        rows.append(f"{name:8s} call {i} {v:16s} supports: {declines or 'yes'}\n    model: {verdict}\n    GPU:   {gpu}")
        print(rows[-1], flush=True)
        if failed:
            print(f"    (model's first blocked agents: {model.deadlock[:3]})", flush=True)
            break
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=float, default=2.0, help="bound of every kernel wait (s)")
    args = parser.parse_args()
    why = cutlass_gemm.unavailable() or sequencer.unavailable()
    if why:
        sys.exit(f"ring lab: {why}")
    cutlass_gemm.load()
    rows = []
    with config.patch(implementations=IMPLEMENTATIONS, wait_timeout_s=args.timeout, check_signals=False,
                      sequence_graphs=0):  # fmt: skip
        for name in args.cases.split(","):
            rows += run_case(name, args.timeout)
    print(f"== ring lab table ({torch.cuda.get_device_name()}, SMs {torch.cuda.get_device_properties(0).multi_processor_count})")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
