"""GPU timeline of one call per method (which stream runs what, when, for how long), all-gather+GEMM and
GEMM+reduce-scatter: where a fused choice's time beyond its GEMM goes. The CUTLASS choices (``--cutlass`` variants,
on Hopper) are profiled too: their own copies, the GEMM, and the peers' pushes beside it.

python -m torch.distributed.run --nproc-per-node 2 benchmarks/profile_ag.py --op ag --rows 1024 --cols 49152 --inner 12288
python -m torch.distributed.run --nproc-per-node 2 benchmarks/profile_ag.py --op rs --rows 2048 --cols 4096 --inner 14336
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def _cutlass(op: str, variants: list[str], args: tuple) -> dict[str, Callable[[], object]]:
    """The registered ``cutlass:<variant>`` choices that take ``args`` (none where the kernels cannot run)."""
    from fluxcompile import config
    from fluxcompile.config import IMPLEMENTATIONS
    from fluxcompile.lowerings.choices import choice_named

    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    with config.patch(implementations=IMPLEMENTATIONS):  # every family, cutlass among them
        picked = [c for v in variants if (c := choice_named(name, f"cutlass:{v}")) is not None]
        return {c.name: c.fn for c in picked if c.declines(*args) is None}


def _methods(
    op: str, m: int, n: int, k: int, world: int, group: str, cutlass: list[str]
) -> dict[str, Callable[[], object]]:
    from fluxcompile.lowerings.all_gather_matmul import cublas_pipelined as ag
    from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined as rs

    bf = torch.bfloat16
    if op == "ag":
        a = torch.randn(m // world, k, device="cuda", dtype=bf)
        b = torch.randn(k, n // world, device="cuda", dtype=bf)
        full = torch.randn(m, k, device="cuda", dtype=bf)
        cut = _cutlass(op, cutlass, (a, [b], [None], 0, world, group))
        return {
            "cublas (whole local GEMM)": lambda: full @ b,
            **{name: (lambda fn=fn: fn(a, [b], [None], 0, world, group)) for name, fn in cut.items()},
            "cublas_pipelined": lambda: ag.all_gather_matmul(a, [b], [None], 0, world, group),
            "cublas_pipelined:concurrent": lambda: ag.all_gather_matmul(
                a, [b], [None], 0, world, group, concurrent=True
            ),
            "cublas_pipelined:lead2": lambda: ag.all_gather_matmul(a, [b], [None], 0, world, group, lead=2),
            "cublas_pipelined:lead4": lambda: ag.all_gather_matmul(a, [b], [None], 0, world, group, lead=4),
            "async_tp": lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group),
        }
    a = torch.randn(m, k // world, device="cuda", dtype=bf)
    b = torch.randn(k // world, n, device="cuda", dtype=bf) / k**0.5
    args = ([a], [b], None, [m, n], 0, "sum", world, group)
    out = torch.empty(m // world, n, device="cuda", dtype=bf)
    cut = _cutlass(op, cutlass, args)
    return {
        "cublas (whole local GEMM)": lambda: a @ b,
        **{name: (lambda fn=fn: fn(*args)) for name, fn in cut.items()},
        "nccl_cublas": lambda: dist.reduce_scatter_tensor(out, a @ b),
        "cublas_pipelined": lambda: rs.matmul_reduce_scatter(*args),
        "cublas_pipelined:push": lambda: rs.matmul_reduce_scatter(*args, push=True),
        "cublas_pipelined:unsplit": lambda: rs.matmul_reduce_scatter(*args, unsplit=True),
        "cublas_pipelined:tail2": lambda: rs.matmul_reduce_scatter(*args, tail=2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=("ag", "rs"), default="ag")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--cols", dest="n", type=int, default=49152)
    p.add_argument("--inner", dest="k", type=int, default=12288)
    p.add_argument(
        "--cutlass", nargs="*", default=["128x256x64_c2x1", "256x128x64_c2x1"], help="CUTLASS variants to profile"
    )
    args = p.parse_args()
    lr = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr)
    dist.init_process_group("nccl", device_id=torch.device("cuda", lr))
    from torch.distributed import _symmetric_memory as symm

    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        symm.enable_symm_mem_for_group(group)
    for m in args.rows:
        for name, fn in _methods(args.op, m, args.n, args.k, world, group, args.cutlass).items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            # A GPU sleep first, so the host enqueues both calls ahead of the GPU: the timeline is the GPU's.
            torch.cuda._sleep(2_000_000)
            calls = 4  # the last one is in steady state: the ranks' start skew is absorbed by the first
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            evs = [e for e in evs if "sleep" not in e.name]
            evs.sort(key=lambda e: e.time_range.start)
            last = evs[len(evs) * (calls - 1) // calls :]  # the last call (every call has as many events)
            lines = []
            if last:
                t0 = last[0].time_range.start
                span = max(e.time_range.end for e in last) - t0
                lines.append(
                    f"== {args.op} {name} m={m} n={args.n} k={args.k} rank {dist.get_rank()}: "
                    f"{len(last)} GPU events, span {span:.0f} us"
                )
                lines += [
                    f"  {e.time_range.start - t0:8.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:90]}" for e in last
                ]
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, lines)
            if dist.get_rank() == 0:
                print("\n".join(line for rank_lines in every for line in rank_lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
