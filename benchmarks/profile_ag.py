"""GPU timeline of one all_gather_matmul call per method (which stream runs what, when, for how long).

python -m torch.distributed.run --nproc-per-node 2 benchmarks/profile_ag.py --rows 1024 --n 49152 --k 12288
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--n", type=int, default=49152)
    p.add_argument("--k", type=int, default=12288)
    args = p.parse_args()
    lr = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr)
    dist.init_process_group("nccl", device_id=torch.device("cuda", lr))
    from torch.distributed import _symmetric_memory as symm

    from fluxcompile.lowerings import ag_cublas_pipelined as pipelined

    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        symm.enable_symm_mem_for_group(group)
    for m in args.rows:
        a = torch.randn(m // world, args.k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(args.k, args.n // world, device="cuda", dtype=torch.bfloat16)
        fns = {
            "ours": lambda a=a, b=b: pipelined.all_gather_matmul(a, [b], [None], 0, world, group),
            "async_tp": lambda a=a, b=b: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group),
        }
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
            if dist.get_rank() == 0:
                evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                evs.sort(key=lambda e: e.time_range.start)
                half = evs[len(evs) // 2 :]  # the second call
                t0 = half[0].time_range.start
                print(f"== {name} m={m}: {len(half)} GPU events, span {half[-1].time_range.end - t0:.0f} us")
                for e in half:
                    print(f"  {e.time_range.start - t0:8.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:90]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
