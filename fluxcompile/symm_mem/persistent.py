"""Buffers that outlive the call that makes them, made outside any CUDA graph memory pool.

A fused op makes the state it keeps between calls (epoch counters, error words, peer address tables, scratch) at
its first call. Under ``torch.compile(mode="reduce-overhead")`` that call is the CUDA graph trees' warm-up, during
which the caching allocator hands every allocation of the calling thread to the trees' memory pool
(``torch._C._cuda_beginAllocateCurrentThreadToPool``, as ``torch.cuda.use_mem_pool`` does). A buffer kept there is
a live allocation of the pool that the trees do not track, and they stop ("tensor(s) in the cudagraph pool not
tracked as outputs"). The routing belongs to the thread, so :func:`persistent` runs the function that makes the
buffers on a short-lived thread of its own, on the caller's device and current stream: the caching allocator ties
a block to the stream it was allocated on, and the buffers' first contents (zeros, an uploaded table) are ordered
before the caller's next work, both as if the caller had made them.

Symmetric workspaces (workspace.py) need none of this: torch's symmetric-memory allocator maps their memory
itself, outside the caching allocator and its pools.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def persistent(make: Callable[[], T], what: str = "a persistent buffer") -> T:
    """``make()``, run on a thread of its own (same CUDA device and current stream, none of the caller's memory
    pool routing): its result, or its exception raised here. ``make`` only allocates and fills; it runs no
    collective. ``what`` names the buffers in the error raised during CUDA graph capture, where none can be made."""
    stream = None
    if torch.cuda.is_initialized():
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"fluxcompile: {what} cannot be made during CUDA graph capture; run the op once eagerly before "
                "capturing"
            )
        stream = torch.cuda.current_stream()
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            if stream is not None:
                torch.cuda.set_device(stream.device)
                torch.cuda.set_stream(stream)
            result.append(make())
        except BaseException as e:  # raised again in the caller's thread
            error.append(e)

    worker = threading.Thread(target=run, name="fluxcompile-persistent", daemon=True)
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]
