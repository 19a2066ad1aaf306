"""The watchdog on GPUs: a rank whose peer is late past the timeout gets a report naming it, the op and the
signal it waits for; once the peer calls, both finish and agree with the reference (nothing was lost)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fluxcompile import ops
from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined
from fluxcompile.symm_mem import watchdog
from fluxcompile.testing.numerics import assert_close


@pytest.mark.parametrize("unsplit", [False, True])
def test_late_peer_is_reported_then_both_finish(monkeypatch, unsplit):
    reports: list[str] = []
    monkeypatch.setattr(watchdog, "_dog", watchdog.Watchdog(2.0, 0.1, on_timeout=reports.append))
    group = dist.new_group(list(range(dist.get_world_size())))  # fresh plans, watched by the short dog
    rank, world = group.rank(), group.size()
    torch.manual_seed(1234 + rank)
    a = torch.randn(64 * world, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16)
    args = ([a], [b], None, [64 * world, 96], 0, "sum", world, group.group_name)
    call = lambda: cublas_pipelined.matmul_reduce_scatter(*args, unsplit=unsplit)  # noqa: E731
    call()  # warm-up on every rank: plans, flags, workspace
    torch.cuda.synchronize()
    dist.barrier(group)
    if rank == world - 1:
        time.sleep(4.0)  # late: the others' streams wait on this rank's signal meanwhile
    out = call()
    if rank != world - 1:
        time.sleep(4.0)  # the host idles (GIL free) while the stream waits; the watchdog looks
    torch.cuda.synchronize()
    assert_close(out, ops.REFERENCES["matmul_reduce_scatter"](*args), 1e-2, "after the late peer")
    if rank != world - 1:
        assert reports, "no report while the stream waited past the timeout"
        assert f"rank {rank}" in reports[0] and "matmul_reduce_scatter" in reports[0]
        assert f"from rank {world - 1}: ready=0" in reports[0] or "ready=0" in reports[0], reports[0]
    dist.barrier(group)


def test_watchdog_queries_do_not_break_a_global_capture(monkeypatch):
    """The watchdog's thread queries events every millisecond here while this thread captures a CUDA graph in
    torch's default (global) capture mode, as vLLM's decode graphs do: the capture completes and replays right."""
    dog = watchdog.Watchdog(600.0, 0.001)
    monkeypatch.setattr(watchdog, "_dog", dog)
    w = watchdog.watch("a probe", dist.get_rank(), lambda: "")
    w.note()  # a pending watch: every look queries its event
    try:
        x = torch.zeros(256, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        t0 = time.monotonic()
        with torch.cuda.graph(graph):  # capture_error_mode="global"
            while time.monotonic() - t0 < 0.3:  # long enough for hundreds of the watchdog's looks
                x.add_(1)
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert dog._thread is not None and dog._thread.is_alive(), "the watchdog stopped (a CUDA call failed)"
        assert x.min().item() == x.max().item() > 0
    finally:
        dog.watches.clear()
        dog._timeout_s = 0.0  # the thread idles from now on
