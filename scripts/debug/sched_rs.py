"""Debug: ring_reduce_scatter through the schedule interpreter against NCCL, every rank prints (no asserts,
so no rank leaves early). torchrun --nproc-per-node 4 scripts/debug/sched_rs.py"""

import os

import torch
import torch.distributed as dist

from fluxcompile.schedules import gpu_executor
from fluxcompile.schedules.collectives import library_plan

lr = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(lr)
dist.init_process_group("nccl", device_id=torch.device("cuda", lr))
R, r = dist.get_world_size(), dist.get_rank()
for name in ("ring_reduce_scatter", "direct_reduce_scatter", "ring_all_reduce"):
    plan = library_plan(name, R)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 7, 1000):
            torch.manual_seed(r + 1)
            x = torch.randn(plan.in_chunks * rows, device="cuda").to(dtype)
            msg = ""
            try:
                ref = x.float().clone()
                if plan.collective == "reduce_scatter":
                    y = ref.new_empty(ref.numel() // R)
                    dist.reduce_scatter_tensor(y, ref)
                    ref = y
                else:
                    dist.all_reduce(ref)
                out = torch.full((plan.out_chunks * rows,), float("nan"), device="cuda", dtype=dtype)
                got = gpu_executor.run_plan(plan, x, None, out).float()
                torch.cuda.synchronize()
                err = (got - ref).abs()
                bad = (err > 0.1 + 0.02 * ref.abs()) | got.isnan()
                idx = bad.nonzero().flatten()[:6].tolist()
                msg = f"nan {int(got.isnan().sum())} maxerr {float(err.nan_to_num(9e9).max()):.3g} bad {int(bad.sum())}/{got.numel()} at {idx}"
                if idx:
                    msg += f" got {got[idx].tolist()} want {ref[idx].tolist()}"
                gpu_executor.check_errors()
            except Exception as e:
                msg += f" EXC {type(e).__name__}: {str(e)[:300]}"
            print(f"rank {r} {name} {dtype} rows={rows}: {msg}", flush=True)
            dist.barrier()
dist.destroy_process_group()
