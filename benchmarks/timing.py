"""Per-call time of a function called ``iters`` times in a row: CUDA events on the GPU, the host clock elsewhere
(the benchmarks' CPU smoke runs)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


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
