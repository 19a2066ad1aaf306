"""Buffers that outlive the call that makes them, made outside any CUDA graph memory pool.

A fused op makes the state it keeps between calls (epoch counters, error words, peer address tables, scratch) at
its first call. Under ``torch.compile(mode="reduce-overhead")`` that call is the CUDA graph trees' warm-up, during
which the caching allocator hands every allocation of the calling thread to the trees' memory pool
(``torch._C._cuda_beginAllocateCurrentThreadToPool``, as ``torch.cuda.use_mem_pool`` does). A buffer kept there is
a live allocation of the pool that the trees do not track, and they stop ("tensor(s) in the cudagraph pool not
tracked as outputs"). The routing belongs to the thread, so :func:`persistent` runs the function that makes the
buffers on a worker thread of its own (one per process, started at the first use: a hand-off costs far less than
starting a thread, which matters to callers that make buffers per call, like the DLRM op's pointer tables), on the
caller's device and current stream: the caching allocator ties
a block to the stream it was allocated on, and the buffers' first contents (zeros, an uploaded table) are ordered
before the caller's next work, both as if the caller had made them.

The same holds for what a first call's setup leaves behind inside torch: a symmetric workspace's rendezvous
keeps device tables of peer pointers from the caching allocator, and NCCL keeps a collective's tensors (a host
barrier's included) past the call until its watchdog retires them. So workspaces are made, and the setup's
host barriers (:func:`host_barrier`) and the autotuner's runs are made, on the worker too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_lock = threading.Lock()
_worker: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that started it, the worker)
_local = threading.local()  # .on_worker: this thread is the worker (a nested call runs in place)


def _executor() -> ThreadPoolExecutor:
    global _worker
    with _lock:
        # A forked child inherits the executor but not its thread: it starts its own.
        if _worker is None or _worker[0] != os.getpid():
            _worker = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="fluxcompile-persistent"))
        return _worker[1]


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (never on CPU, Triton's interpreter)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def persistent(make: Callable[[], T], what: str = "a persistent buffer") -> T:
    """``make()``, run on the worker thread (same CUDA device and current stream, none of the caller's memory
    pool routing): its result, or its exception raised here. ``make`` allocates and fills, and may run the
    collectives that takes: the caller waits, so each rank still issues its collectives in its own order. It runs
    without autograd (the worker's grad mode would otherwise be on, whatever the caller's). ``what`` names the
    buffers in the error raised during CUDA graph capture, where none can be made."""
    stream = None
    if torch.cuda.is_initialized():
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"fluxcompile: {what} cannot be made during CUDA graph capture; run the op once eagerly before "
                "capturing"
            )
        stream = torch.cuda.current_stream()
    if getattr(_local, "on_worker", False):
        return make()

    def run() -> T:
        _local.on_worker = True
        if stream is not None:
            torch.cuda.set_device(stream.device)
            torch.cuda.set_stream(stream)
        with torch.no_grad():  # as in a compiled graph: a tuned choice's out= GEMM on a weight must not refuse
            return make()

    return _executor().submit(run).result()  # raises make's exception, the same object


def host_barrier(group: dist.ProcessGroup) -> None:
    """``dist.barrier(group)`` on the worker: NCCL keeps the barrier's tensor past the call, which must not be in
    the caller's graph pool."""
    persistent(lambda: dist.barrier(group=group), "a host barrier")
