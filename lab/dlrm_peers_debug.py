"""Where the DLRM exchange faults between processes: the registered choice's protocol stepped launch by launch
(a device synchronize after each), with the addresses it computes printed beside the symmetric buffers' extents.

Run under torchrun, one process per GPU (scripts/gpu-check dlrm-debug); ``--host-tables`` writes the device
tables with host copies instead of the fill kernel (the hypothesis that separates MoE, which passes, from DLRM)."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from fluxcompile import config, ops
from fluxcompile.kernels import embedding_bag as eb
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo


def say(*a: object) -> None:
    print(f"[rank {dist.get_rank()}]", *a, flush=True)


def operands(g: torch.Generator, tables: int, bags: int, dim: int, dtype: torch.dtype, rank: int):
    rows = [500 + rank + 37 * t for t in range(tables)]
    weights = [torch.randn(n, dim, generator=g).to(device="cuda", dtype=dtype) for n in rows]
    n_idx = [bags * 4 + t for t in range(tables)]
    indices = [torch.randint(0, rows[t], (n,), generator=g).cuda() for t, n in enumerate(n_idx)]
    offsets = []
    for n in n_idx:
        cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), cuts]).cuda())
    return weights, indices, offsets


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host-tables", action="store_true")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    if args.host_tables:

        def host_table(values, device, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        lo.device_table = host_table
    g = torch.Generator().manual_seed(1234 + rank)
    bags_local, tables, dim = 64, 3, 128
    with config.patch(check_signals=False):  # family dlrm is on by default
        for dtype in (torch.float32, torch.bfloat16):
            w, i, o = operands(g, tables, bags_local * world, dim, dtype, rank)
            out_shape = [bags_local * world, tables * dim]
            nbytes = lo.data_bytes(w, o, False, out_shape, [], [], world)
            comm = lo.group_comm(group, world, nbytes)
            data, flags = comm.data, comm.flags
            say(dtype, "data bytes needed", nbytes, "have", data.nbytes, "flags", flags.nbytes)
            say(
                "own buffer", hex(data.buffer.data_ptr()), "buffer_ptrs", [hex(int(x)) for x in data.handle.buffer_ptrs]
            )
            say(
                "get_buffer(rank)",
                hex(data.view(rank, (1,), torch.uint8).data_ptr()),
                "flags own",
                hex(flags.buffer.data_ptr()),
                "flags ptrs",
                [hex(int(x)) for x in flags.handle.buffer_ptrs],
            )
            for variant in (eb.DEFAULT, list(eb.VARIANTS)[-1]):
                for call in range(args.calls):
                    steps = lo.protocol(comm, w, i, o, 0, False, out_shape, [], [], variant=variant)
                    while True:
                        try:
                            name = next(steps)
                        except StopIteration as done:
                            got = done.value
                            break
                        try:
                            torch.cuda.synchronize()
                        except Exception as e:
                            say(f"FAULT after launch '{name}' ({dtype}, {variant}, call {call}): {e}".splitlines()[0])
                            sys.stdout.flush()
                            os._exit(3)
                    dist.barrier()
                    want = ops.REFERENCES["embedding_bag_all_to_all"](w, i, o, 0, False, out_shape, [], [], group)
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
                    say(f"{dtype} {variant} call {call}: ok, rel err {err:.2e}")
                    for t in i:
                        t.random_(0, 500)
    dist.barrier()
    say("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
