"""Host time per call of the fused ops and their choices (the time to enqueue one call, not the GPU's).

Small shapes are host-bound when the host needs longer to enqueue a call than the GPU needs to run it; this
measures the host side alone. Shapes are tiny, so the GPU always keeps up and a loop of N calls costs N
times the host time. Prints one table (rank 0; max over ranks) and a cProfile of the op path.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/host_cost.py
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def host_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Median over 5 loops of the host µs per call (enqueue time), the slowest rank."""
    for _ in range(3):
        fn()
    per: list[float] = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize(device)
    t = torch.tensor([sorted(per)[2]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def host_us_by_position(fn: Callable[[], object], rounds: int, per_round: int, device: torch.device) -> list[float]:
    """Host µs of the 1st, 2nd, ... call after a synchronize + barrier (the pattern of benchmarks/ops.py's
    rounds), median over ``rounds``, slowest rank: shows whether calls right after an idle wait are slower."""
    for _ in range(3):
        fn()
    per: list[list[float]] = [[] for _ in range(per_round)]
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        dist.barrier()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in per]
        for i, (start, end) in enumerate(events):
            t0 = time.perf_counter()
            start.record()  # as ops.py's rounds do
            fn()
            end.record()
            per[i].append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(device)
    t = torch.tensor([sorted(x)[len(x) // 2] for x in per], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", dest="m", type=int, default=512)
    p.add_argument("--cols", dest="n", type=int, default=1024)
    p.add_argument("--inner", dest="k", type=int, default=1024)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--profile-calls", type=int, default=300)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    import fluxcompile  # noqa: F401  (registers the ops and their CUDA implementations)
    from fluxcompile.lowerings import choices_for, pick
    from fluxcompile.symm_mem import stream_wait, stream_write, workspace

    group = dist.group.WORLD.group_name
    m, n, k = args.m, args.n, args.k
    bf = torch.bfloat16
    rows: list[tuple[str, float]] = []

    def row(name: str, fn: Callable[[], object], calls: int = args.calls) -> None:
        rows.append((name, host_us(fn, calls, device)))

    a = torch.randn(m, k // world, device=device, dtype=bf)
    b = torch.randn(k // world, n, device=device, dtype=bf)
    out = torch.empty(m, n, device=device, dtype=bf)
    rs_out = torch.empty(m // world, n, device=device, dtype=bf)
    row("torch.mm", lambda: torch.mm(a, b))
    row("torch.mm(out=)", lambda: torch.mm(a, b, out=out))
    row("mm + dist.reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs_out, torch.mm(a, b)))
    funcol = torch.ops._c10d_functional

    def funcol_rs():
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.mm(a, b), "sum", world, group))

    row("mm + funcol reduce_scatter + wait", funcol_rs)

    ws = workspace(group, 1 << 20, tag="host_cost.scratch")
    main_stream = torch.cuda.current_stream()
    addr = int(ws.handle.buffer_ptrs[rank])
    ws.buffer[:4].zero_()
    row("stream_write", lambda: stream_write(main_stream, addr, 0), 200)
    row("stream_wait (satisfied)", lambda: stream_wait(main_stream, addr, 0), 200)
    row("ws.view", lambda: ws.view(rank, (64, 64), bf, 0), 200)
    row("buffer_ptrs[rank]", lambda: int(ws.handle.buffer_ptrs[rank]), 200)
    ev = torch.cuda.Event()
    row("event record + wait_event", lambda: (ev.record(main_stream), main_stream.wait_event(ev)), 200)

    rs_args = ([a], [b], None, [m, n], 0, "sum", world, group)
    ag_a = torch.randn(m // world, k, device=device, dtype=bf)
    ag_b = torch.randn(k, n // world, device=device, dtype=bf)
    ag_args = (ag_a, [ag_b], [None], 0, world, group)
    for op, op_args in (("matmul_reduce_scatter", rs_args), ("all_gather_matmul", ag_args)):
        for choice in choices_for(op):
            if choice.declines(*op_args) is None:
                try:
                    row(f"{op} {choice.name} (direct)", lambda c=choice, x=op_args: c.fn(*x))
                except Exception as e:  # a table row, not a crash
                    if rank == 0:
                        print(f"{op} {choice.name}: {type(e).__name__}: {e}")
        fused = getattr(torch.ops.fluxcompile, op)
        fused(*op_args)  # tunes (a collective) before anything is timed
        row(f"{op} pick (memo hit)", lambda o=op, x=op_args: pick(o, x, group), 200)
        row(f"{op} via torch.ops (winner {pick(op, op_args, group).name})", lambda f=fused, x=op_args: f(*x))

    by_position = {
        "torch.mm": host_us_by_position(lambda: torch.mm(a, b), 8, 8, device),
        "mm + dist.reduce_scatter_tensor": host_us_by_position(
            lambda: dist.reduce_scatter_tensor(rs_out, torch.mm(a, b)), 8, 8, device
        ),
        "matmul_reduce_scatter via torch.ops": host_us_by_position(
            lambda: torch.ops.fluxcompile.matmul_reduce_scatter(*rs_args), 8, 8, device
        ),
    }
    torch.cuda.synchronize(device)
    if rank == 0:
        print(f"== host table: µs per call, max over {world} ranks, m={m} n={n} k={k}")
        for name, t in rows:
            print(f"  {name:<64} {t:8.1f}")
        print("== host µs of the 1st..8th call after a synchronize + barrier (benchmarks/ops.py's rounds)")
        for name, ts in by_position.items():
            print(f"  {name:<64} " + " ".join(f"{t:8.1f}" for t in ts))
    for op, op_args in (("matmul_reduce_scatter", rs_args), ("all_gather_matmul", ag_args)):
        fused = getattr(torch.ops.fluxcompile, op)
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for i in range(args.profile_calls):
            fused(*op_args)
            if i % 50 == 49:
                torch.cuda.synchronize(device)
        prof.disable()
        torch.cuda.synchronize(device)
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            print(f"== cProfile of {args.profile_calls} calls of {op} (tottime)")
            print("\n".join(s.getvalue().splitlines()[:60]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
