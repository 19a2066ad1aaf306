"""The benchmarks' one timer: per-call times of functions on the GPU (CUDA events) or on the host clock (the
benchmarks' CPU smoke runs, and host time), as back-to-back batches or in interleaved rounds, and the medians of
the slowest rank."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def time_us(fn: Callable[[], object], iters: int, cuda: bool = True) -> float:
    """Microseconds per call of ``fn`` over ``iters`` back-to-back calls (``cuda``: GPU time between two events)."""
    if not cuda:
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1e6 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


@dataclasses.dataclass
class Samples:
    """Samples in µs per call of each function, in the order they were taken: ``us`` the GPU's time (CUDA
    events; the host clock on CPU), ``host_us`` the host's (the time to enqueue a call)."""

    us: dict[str, list[float]]
    host_us: dict[str, list[float]]


def sample_rounds(
    fns: dict[str, Callable[[], object]],
    warmup: int,
    rounds: int,
    per_round: int,
    *,
    cuda: bool = True,
    together: bool = True,
    before_round: Callable[[], object] | None = None,
    batch: bool = False,
) -> Samples:
    """``warmup`` calls of every function, then ``rounds`` rounds, each timing ``per_round`` calls of every
    function in turn, so that clock and thermal drift during the run hit all of them alike. Each function's
    round starts from an idle GPU (synchronized), with the ranks together (a barrier, unless ``together`` is
    false: ranks that time different things), after ``before_round`` (e.g. a GPU sleep to enqueue ahead).

    Per call (default): one sample per call, CUDA events around it and the host clock around the events. With
    ``batch``: one sample per round, the mean over ``per_round`` back-to-back calls (the host clock around the
    calls alone, the events outside it)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    us: dict[str, list[float]] = {name: [] for name in fns}
    host_us: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            if together:
                dist.barrier()
            events = _event_pairs(0 if not cuda else 1 if batch else per_round)
            if before_round is not None:
                before_round()
            if batch:
                if cuda:
                    events[0][0].record()
                t0 = time.perf_counter()
                for _ in range(per_round):
                    fn()
                host_us[name].append((time.perf_counter() - t0) * 1e6 / per_round)
                if cuda:
                    events[0][1].record()
            elif cuda:
                for start, end in events:
                    t0 = time.perf_counter()
                    start.record()
                    fn()
                    end.record()
                    host_us[name].append((time.perf_counter() - t0) * 1e6)
            else:
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    fn()
                    host_us[name].append((time.perf_counter() - t0) * 1e6)
            if cuda:
                torch.cuda.synchronize()
                us[name] += [start.elapsed_time(end) * 1e3 / (per_round if batch else 1) for start, end in events]
    return Samples(us if cuda else host_us, host_us)


def _event_pairs(n: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(v) for name, v in samples.items()}


def slowest_rank(values: dict[str, float], cuda: bool = True) -> dict[str, float]:
    """Each value's maximum over the ranks (one all-reduce)."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist()))


def interleaved_us(
    fns: dict[str, Callable[[], object]],
    warmup: int,
    rounds: int,
    per_round: int,
    *,
    cuda: bool = True,
    together: bool = True,
    before_round: Callable[[], object] | None = None,
    host: dict[str, float] | None = None,
    spread: dict[str, tuple[float, float]] | None = None,
) -> dict[str, float]:
    """µs per call of each function (:func:`sample_rounds`, per call): the median over its calls, then the
    slowest rank (this rank's alone where ``together`` is false). ``host`` (if given) receives each function's
    median host time per call, reduced alike: where that is near the GPU time, the GPU waits for the host.
    ``spread`` (if given) receives each function's (min, max) over its calls on this rank."""
    s = sample_rounds(fns, warmup, rounds, per_round, cuda=cuda, together=together, before_round=before_round)
    if spread is not None:
        spread.update({name: (min(v), max(v)) for name, v in s.us.items()})
    out = medians(s.us)
    if together:
        out = slowest_rank(out, cuda)
    if host is not None:
        host.update(slowest_rank(medians(s.host_us), cuda) if together else medians(s.host_us))
    return out
