"""Host time per call of the fused ops and their choices (the time to enqueue one call, not the GPU's).

Small shapes are host-bound when the host needs longer to enqueue a call than the GPU needs to run it; this
measures the host side alone. Shapes are tiny, so the GPU always keeps up and a loop of N calls costs N
times the host time. Prints one table (rank 0; max over ranks) and a cProfile of the op path.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/host_cost.py

The CUTLASS choice of both ops (``cutlass:<variant>``, ``--cutlass-variant``, default the first of
kernels/cutlass_build.VARIANTS; the reduce-scatter's where that variant has a ring build) has rows of its own in
the op path's layers, whatever the autotuner picks: its
registered fn (as the op's CUDA implementation calls it), the op's direct entry with it as the compiled choice,
each with the C++ sequences' replays on and off, and its whole call captured by hand and replayed (the floor);
profiled like the winners. Where the choice declines (no CUTLASS headers, not Hopper, ...) or under
``--loopback`` (which loops back the cuBLAS-pipelined choices' workspaces only: the CUTLASS protocol's pushes
and waits need a real peer), one line says why and its rows are left out.

``--loopback`` (one process, one GPU: ``python benchmarks/host_cost.py --loopback``) runs the fused ops'
2-rank host sequence against this rank itself: the peer's slots are views of our own buffer and its flags
alias ours (``addr(peer, i) == addr(rank, i + 1)``), so each wait is satisfied by our own write and the
host enqueues exactly what it would with a real peer. The NCCL rows then run on a 1-rank group, which
may enqueue less than a 2-rank one; read them as a lower bound on the baseline's host cost. For
machines with one GPU (torch's symmetric memory refuses two ranks on one device); host times only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
from collections.abc import Callable

import timing
import torch
import torch.distributed as dist


def loopback_peers() -> None:
    """Make the cuBLAS-pipelined choices' workspaces and their handshake flags (this process, from now on)
    2-rank loopbacks of this 1-rank group: ``workspace`` as ``symm_mem.comm_for`` calls it for the two
    cublas_pipelined choices' data (their tags; every other workspace stays as it is), and the exchange's
    ``ready_done_flags`` (symm_mem/exchange.py's handshake takes its flags from there)."""
    import dataclasses

    from fluxcompile.symm_mem import LocalHandle, exchange
    from fluxcompile.symm_mem import comm as comm_module

    looped = ("all_gather_matmul", "matmul_reduce_scatter")  # the cublas_pipelined choices' data workspaces
    real_workspace, real_flags = comm_module.workspace, exchange.ready_done_flags
    seen: dict[int, tuple[object, object]] = {}

    def loop(ws):
        """One loopback object per real workspace, as the real function returns one (the real one is kept
        beside it, so its id is not reused by a later workspace while the entry lives). Rank 1's buffer is ours,
        and its pointer is ours plus 4 bytes, so flag ``i`` of rank 1 is our flag ``i + 1``."""
        if id(ws) not in seen:
            base = int(ws.handle.buffer_ptrs[0])
            handle = LocalHandle([ws.buffer, ws.buffer], ptrs=[base, base + 4])
            seen[id(ws)] = (ws, dataclasses.replace(ws, handle=handle, rank=0, world_size=2))
        return seen[id(ws)][1]

    def workspace(group_name: str, nbytes: int, tag: str = "default", world: int | None = None):
        if tag not in looped:
            return real_workspace(group_name, nbytes, tag=tag, world=world)
        # ``world``: the caller's group size, checked against the loopback's two ranks (not the real group's one).
        if world is not None and world != 2:
            raise ValueError(f"host_cost --loopback: group_size={world}, but the loopback has 2 ranks")
        return loop(real_workspace(group_name, nbytes, tag))

    def ready_done_flags(group_name: str, tag: str, world: int):
        # Made (``world`` of each, set to their start values) in our own buffer, then read through the
        # loopback: flag i of the peer is our flag i + 1.
        ready, done = real_flags(group_name, tag, world)
        ws = loop(ready.ws)
        return dataclasses.replace(ready, ws=ws), dataclasses.replace(done, ws=ws)

    comm_module.workspace = workspace
    exchange.ready_done_flags = ready_done_flags


def without_replays(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the C++ sequences' replays off (config.sequence_graphs = 0) for its call; the flip skips
    Config.__setattr__'s field check, so it costs next to nothing."""
    import fluxcompile

    cfg = fluxcompile.config

    def run() -> object:
        limit = cfg.sequence_graphs
        object.__setattr__(cfg, "sequence_graphs", 0)
        try:
            return fn()
        finally:
            object.__setattr__(cfg, "sequence_graphs", limit)

    return run


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median over 5 loops of the host µs per call (enqueue time), the slowest rank."""
    return host_us_interleaved({"fn": fn}, calls, 5)["fn"]


def host_us_interleaved(fns: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Host µs per call of each of ``fns``, timed in turn within each round (so a drift of the host's speed
    hits them all alike): the median over rounds, the slowest rank."""
    s = timing.sample_rounds(fns, 3, rounds, calls, batch=True)
    return timing.slowest_rank(timing.medians(s.host_us))


def host_us_by_position(fn: Callable[[], object], rounds: int, per_round: int) -> list[float]:
    """Host µs of the 1st, 2nd, ... call after a synchronize + barrier (the pattern of benchmarks/ops.py's
    rounds, CUDA events around each call included), median over ``rounds``, slowest rank: shows whether calls
    right after an idle wait are slower."""
    per_call = timing.sample_rounds({"fn": fn}, 3, rounds, per_round).host_us["fn"]  # round by round
    by_position = {str(i): per_call[i::per_round] for i in range(per_round)}
    return list(timing.slowest_rank(timing.medians(by_position)).values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", dest="m", type=int, default=512)
    p.add_argument("--cols", dest="n", type=int, default=1024)
    p.add_argument("--inner", dest="k", type=int, default=1024)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--profile-calls", type=int, default=300)
    p.add_argument("--loopback", action="store_true", help="one process, two ranks' host sequence (see above)")
    p.add_argument(
        "--cutlass-variant",
        help="the CUTLASS all-gather choice's variant timed beside the winners (default: the first of "
        "fluxcompile.kernels.cutlass_build.VARIANTS)",
    )
    args = p.parse_args()

    if args.loopback:
        os.environ.setdefault("RANK", "0"), os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1"), os.environ.setdefault("MASTER_PORT", "29511")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    # The device named, so NCCL does not guess it from the rank (its barriers and teardown use it).
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    import fluxcompile  # registers the ops and their CUDA implementations
    from fluxcompile.kernels.cutlass_build import VARIANTS as CUTLASS_VARIANTS
    from fluxcompile.lowerings import choices_for, direct_calls, pick
    from fluxcompile.lowerings.all_gather_matmul import cutlass as ag_cutlass
    from fluxcompile.lowerings.choices import choice_named

    variant = args.cutlass_variant or next(iter(CUTLASS_VARIANTS))
    if variant not in CUTLASS_VARIANTS:
        p.error(f"--cutlass-variant {variant}: not one of {', '.join(CUTLASS_VARIANTS)}")
    cutlass_name = f"{ag_cutlass.NAME}:{variant}"
    # Both ops' CUTLASS choices (family "cutlass") take workspaces of their own, which --loopback leaves as they are.
    loopback_declines = (
        "--loopback loops back the cuBLAS-pipelined choices' workspaces only: "
        "the CUTLASS protocol's pushes and waits need a real peer"
    )

    world = dist.get_world_size()
    if args.loopback:
        loopback_peers()
        fluxcompile.config.autotune = False  # its reference candidate cannot run 2 ranks' NCCL on 1
        world = 2
    from fluxcompile.symm_mem import stream_wait, stream_write, workspace

    group = dist.group.WORLD.group_name
    m, n, k = args.m, args.n, args.k
    bf = torch.bfloat16
    rows: list[tuple[str, float]] = []

    def row(name: str, fn: Callable[[], object], calls: int = args.calls) -> None:
        rows.append((name, host_us(fn, calls)))

    a = torch.randn(m, k // world, device=device, dtype=bf)
    b = torch.randn(k // world, n, device=device, dtype=bf)
    out = torch.empty(m, n, device=device, dtype=bf)
    rs_out = torch.empty(m // dist.get_world_size(), n, device=device, dtype=bf)
    row("torch.mm", lambda: torch.mm(a, b))
    row("torch.mm(out=)", lambda: torch.mm(a, b, out=out))
    row("mm + dist.reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs_out, torch.mm(a, b)))
    funcol = torch.ops._c10d_functional

    group_ranks = dist.get_world_size()  # 1 under --loopback: NCCL's own group

    def funcol_rs():
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.mm(a, b), "sum", group_ranks, group))

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
            looped_out = args.loopback and choice.family == ag_cutlass.NAME  # see loopback_declines
            if not looped_out and choice.declines(*op_args) is None:
                try:
                    row(f"{op} {choice.name} (direct)", lambda c=choice, x=op_args: c.fn(*x))
                except Exception as e:  # a table row, not a crash
                    if rank == 0:
                        print(f"{op} {choice.name}: {type(e).__name__}: {e}")
        fused = getattr(torch.ops.fluxcompile, op).default  # as Inductor's generated code calls it
        fused(*op_args)  # tunes (a collective) before anything is timed
        row(f"{op} pick (memo hit)", lambda o=op, x=op_args: pick(o, x, group), 200)
        # The body of the op's CUDA implementation (lowerings/<op>/__init__.py), without the dispatcher around it.
        row(f"{op} pick + winner, no dispatcher", lambda o=op, x=op_args: pick(o, x, group).fn(*x))
        row(f"{op} via torch.ops (winner {pick(op, op_args, group).name})", lambda f=fused, x=op_args: f(*x))

    # The op path's layers, interleaved: what the dispatcher and the autotuner's lookup add to the winner.
    layers: dict[str, Callable[[], object]] = {"torch.mm": lambda: torch.mm(a, b)}
    # What Inductor emits for the unfused pairs (under --loopback over NCCL's 1-rank group: a lower bound).
    layers["Inductor's RS: mm + funcol reduce_scatter + wait"] = funcol_rs
    layers["Inductor's AG: funcol all_gather + wait + mm"] = lambda: torch.mm(
        funcol.wait_tensor(funcol.all_gather_into_tensor(ag_a, group_ranks, group)), ag_b
    )
    for op, op_args in (("matmul_reduce_scatter", rs_args), ("all_gather_matmul", ag_args)):
        fused, winner = getattr(torch.ops.fluxcompile, op).default, pick(op, op_args, group)
        layers[f"{op} {winner.name} (direct)"] = lambda c=winner, x=op_args: c.fn(*x)
        layers[f"{op} pick + winner, no dispatcher"] = lambda o=op, x=op_args: pick(o, x, group).fn(*x)
        layers[f"{op} via torch.ops (.default)"] = lambda f=fused, x=op_args: f(*x)
        direct = direct_calls.registered().get(op)
        if direct is not None:  # what Inductor's generated code calls (lowerings/direct_calls.py)
            layers[f"{op} via its direct entry"] = lambda f=direct, x=op_args: f(*x)
            layers[f"{op} via its direct entry, replays off"] = without_replays(lambda f=direct, x=op_args: f(*x))
            # As the generated code calls a site decided at compile time: the winner's name in ``choice``.
            compiled = (*op_args, None, None, None, False, winner.name)
            layers[f"{op} via its direct entry, compiled choice"] = lambda f=direct, x=compiled: f(*x)
        packet = getattr(torch.ops.fluxcompile, op)
        layers[f"{op} via the overload packet"] = lambda f=packet, x=op_args: f(*x)
        # The winner's whole stream sequence captured by hand and replayed: the floor of the C++ sequences' own
        # replays (config.sequence_graphs), which add the key and the output allocations.
        winner.fn(*op_args)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            winner.fn(*op_args)
        graph.replay()
        torch.cuda.synchronize(device)
        layers[f"{op} {winner.name} captured by hand: graph.replay()"] = graph.replay
    # Both ops' CUTLASS choice of ``--cutlass-variant`` (the reduce-scatter's where the variant has a ring build),
    # whatever the autotuner picked: as the op's CUDA implementation runs a choice (its registered fn), and as
    # Inductor's generated code calls a site compiled to it (the direct entry, ``choice``).
    cutlass_runs: dict[str, Callable[[], object]] = {}  # "<op> <choice> (direct)" -> its call
    for op, op_args in (("all_gather_matmul", ag_args), ("matmul_reduce_scatter", rs_args)):
        cutlass_choice = choice_named(op, cutlass_name)
        if args.loopback:
            cutlass_why = loopback_declines
        elif cutlass_choice is None:
            cutlass_why = "not offered: config.implementations leaves its family out, or no such build"
        else:
            cutlass_why = cutlass_choice.declines(*op_args)
        if cutlass_why is None:
            try:
                cutlass_choice.fn(*op_args)  # the extension and the workspaces, before anything is timed or captured
                torch.cuda.synchronize(device)
            except Exception as e:  # the rows left out, not a crash
                cutlass_why = f"{type(e).__name__}: {e}"
        if cutlass_why is not None:
            if rank == 0:
                print(f"{op} {cutlass_name}: rows left out: {cutlass_why}")
            continue
        cutlass_direct = f"{op} {cutlass_name} (direct)"
        run_cutlass = lambda c=cutlass_choice, x=op_args: c.fn(*x)  # noqa: E731
        cutlass_runs[cutlass_direct] = run_cutlass
        layers[cutlass_direct] = run_cutlass
        layers[f"{cutlass_direct}, replays off"] = without_replays(run_cutlass)
        direct = direct_calls.registered().get(op)
        if direct is not None:
            compiled = (*op_args, None, None, None, False, cutlass_name)
            layers[f"{op} via its direct entry, compiled choice {cutlass_name}"] = lambda f=direct, x=compiled: f(*x)
            layers[f"{op} via its direct entry, compiled choice {cutlass_name}, replays off"] = without_replays(
                lambda f=direct, x=compiled: f(*x)
            )
        # Its whole call captured by hand and replayed: the floor of its host time.
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                run_cutlass()
            graph.replay()
            torch.cuda.synchronize(device)
            layers[f"{op} {cutlass_name} captured by hand: graph.replay()"] = graph.replay
        except Exception as e:
            if rank == 0:
                print(f"{op} {cutlass_name} captured by hand: {type(e).__name__}: {e}")
    out_like = torch.empty(m, n, device=device, dtype=bf)
    layers["torch.empty_like (an output)"] = lambda: torch.empty_like(out_like)
    # Pieces of the winners' Python side (the entries of the two cublas_pipelined modules), each as the entry
    # calls it: the plan lookup, the shard's layout (all-gather), the built sequencer, the replay limit (a
    # config read), the side stream, the watchdog note after the call.
    from fluxcompile.kernels import sequencer
    from fluxcompile.lowerings.all_gather_matmul import cublas_pipelined as agp
    from fluxcompile.lowerings.all_gather_matmul import layout as ag_layout
    from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined as rsp
    from fluxcompile.symm_mem import side_stream

    rs_plan = lambda: rsp.plan([m, n], 0, world, group, bf, False, False)  # noqa: E731
    ag_plan = lambda: agp.plan(m // world, k, bf, world, group)  # noqa: E731
    layers["matmul_reduce_scatter plan lookup"] = rs_plan
    layers["all_gather_matmul plan lookup"] = ag_plan
    layers["all_gather_matmul shard_layout"] = lambda: ag_layout.shard_layout(ag_a, 0, world)
    hs = rs_plan().hs
    layers["handshake note (watchdog event)"] = hs.note
    layers["side_stream()"] = side_stream
    layers["graph_limit() (config read)"] = sequencer.graph_limit
    layers["torch.cuda.current_device()"] = torch.cuda.current_device
    why = sequencer.unavailable()
    if why is None:
        layers["sequencer() (the built module)"] = sequencer.sequencer
        seq = sequencer.sequencer()
        p = rs_plan()
        # The zero-copy reduce-scatter's C++ sequence alone, with the arguments its entry passes.
        layers["matmul_reduce_scatter C++ sequence alone (zero-copy)"] = lambda: seq.rs_pipelined(
            [a], [b], None, p.peer_slots, p.stage_slots, p.own_slot, p.own_slots, *p.hs.lists, p.shape,
            p.rank, p.rows, False, 0, 0, [], [], None, False,
        )  # fmt: skip
        layers["matmul_reduce_scatter C++ sequence alone, replayed"] = lambda: seq.rs_pipelined(
            [a], [b], None, p.peer_slots, p.stage_slots, p.own_slot, p.own_slots, *p.hs.lists, p.shape,
            p.rank, p.rows, False, 0, 64, [], [], None, False,
        )  # fmt: skip
    elif rank == 0:
        print(f"no C++ sequence rows: {why}")
    layers["torch.cuda.current_stream()"] = torch.cuda.current_stream
    interleaved = host_us_interleaved(layers, args.calls, 9)

    by_position = {
        "torch.mm": host_us_by_position(lambda: torch.mm(a, b), 8, 8),
        "mm + dist.reduce_scatter_tensor": host_us_by_position(
            lambda: dist.reduce_scatter_tensor(rs_out, torch.mm(a, b)), 8, 8
        ),
        "matmul_reduce_scatter via torch.ops": host_us_by_position(
            lambda: torch.ops.fluxcompile.matmul_reduce_scatter.default(*rs_args), 8, 8
        ),
    }
    for name, fn in cutlass_runs.items():
        by_position[name] = host_us_by_position(fn, 8, 8)
    torch.cuda.synchronize(device)
    stats = sequencer.replay_stats() if why is None else {}
    if rank == 0:
        print(f"== C++ sequence replays over the whole run: {stats}")
        print(f"== host table: µs per call, slowest of {dist.get_world_size()} processes, m={m} n={n} k={k}")
        for name, t in rows:
            print(f"  {name:<64} {t:8.1f}")
        print("== the op path's layers, interleaved (median of 9 rounds)")
        for name, t in interleaved.items():
            print(f"  {name:<64} {t:8.1f}")
        print("== host µs of the 1st..8th call after a synchronize + barrier (benchmarks/ops.py's rounds)")
        for name, ts in by_position.items():
            print(f"  {name:<64} " + " ".join(f"{t:8.1f}" for t in ts))
    # (what, how it is called, the call): both ops via torch.ops, and the CUTLASS choices' fns.
    profiled: list[tuple[str, str, Callable[[], object]]] = []
    for op, op_args in (("matmul_reduce_scatter", rs_args), ("all_gather_matmul", ag_args)):
        fused = getattr(torch.ops.fluxcompile, op).default
        profiled.append((op, " via torch.ops", lambda f=fused, x=op_args: f(*x)))
    profiled += [(name, "", fn) for name, fn in cutlass_runs.items()]
    for op, via, fused in profiled:
        # What the host spends inside the C++ sequence: aten ops and CUDA runtime calls (torch.profiler).
        calls = 50
        dist.barrier()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as kprof:
            for _ in range(calls):
                fused()
            torch.cuda.synchronize(device)
        if rank == 0:
            print(f"== torch.profiler of {calls} calls of {op}{via} (host µs per call)")
            for e in sorted(kprof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:24]:
                print(f"  {e.key[:60]:<60} {e.count / calls:6.1f}x {e.self_cpu_time_total / calls:8.1f} self "
                      f"{e.cpu_time_total / calls:8.1f} total")  # fmt: skip
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for i in range(args.profile_calls):
            fused()
            if i % 50 == 49:
                torch.cuda.synchronize(device)
        prof.disable()
        torch.cuda.synchronize(device)
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            print(f"== cProfile of {args.profile_calls} calls of {op} (tottime)")
            print("\n".join(s.getvalue().splitlines()[:60]))
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
