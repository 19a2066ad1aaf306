"""Signals that cost no SM: 32-bit flags in symmetric memory, written and awaited by the GPU's front end.

cuBLAS's Hopper GEMMs keep every SM busy until they finish, so a signalling *kernel* (a barrier, a
spin-wait) queued beside one cannot start until the GEMM ends. Stream memory operations
(``cuStreamWriteValue32``/``cuStreamWaitValue32``) run without an SM, like the copy engine's copies.
A write carries a memory fence, so data copied earlier on the same stream is visible to a peer that
sees the flag.

Protocol (graph-safe: values never depend on a call counter): a flag is set to 1 by its producer and
consumed by its waiter, which resets it to 0 right after the wait. A CUDA graph replays the same
values every time. The waits are unbounded in the driver: a peer that never signals would hang the stream.
watchdog.py bounds them from the host (eager calls; FLUXCOMPILE_WATCHDOG_TIMEOUT_S) with a report naming the
rank and the signals. All ranks call the same fused ops in the same order, as for any collective.
"""

from __future__ import annotations

import dataclasses

import torch

from .groups import process_group
from .persistent import host_barrier
from .workspace import Workspace, workspace


def _driver():
    from cuda.bindings import driver  # the CUDA Python bindings (present where CUDA GPUs are)

    return driver


def _check(result: tuple, what: str) -> None:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"fluxcompile: {what} failed: {err}")


def stream_write(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    d = _driver()
    _check(
        d.cuStreamWriteValue32(
            d.CUstream(stream.cuda_stream),
            d.CUdeviceptr(addr),
            value,
            d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
        ),
        "cuStreamWriteValue32",
    )


def stream_wait(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    d = _driver()
    _check(
        d.cuStreamWaitValue32(
            d.CUstream(stream.cuda_stream),
            d.CUdeviceptr(addr),
            value,
            d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ,
        ),
        "cuStreamWaitValue32",
    )


def stream_consume(stream: torch.cuda.Stream, addr: int) -> None:
    """The waiter's half of the protocol: wait until the flag is 1, then reset it to 0 for the next use."""
    stream_wait(stream, addr, 1)
    stream_write(stream, addr, 0)


@dataclasses.dataclass
class FlagArray:
    """``count`` int32 flags per rank at ``offset`` bytes into a workspace (one array on every rank)."""

    ws: Workspace
    offset: int
    count: int

    def addr(self, rank: int, index: int) -> int:
        return int(self.ws.handle.buffer_ptrs[rank]) + self.offset + 4 * index

    def local(self) -> torch.Tensor:
        return self.ws.view(self.ws.rank, (self.count,), torch.int32, self.offset)


_initialized: set[tuple[int, int]] = set()


def init_flags(flags: FlagArray, value: int) -> None:
    """Set this rank's flags to ``value`` once per buffer, then make sure every rank has (host barrier):
    before that no peer may write into them. Eager only (first call, before any graph capture)."""
    key = (flags.ws.buffer.data_ptr(), flags.offset)
    if key in _initialized:
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fluxcompile: signal flags must be initialized by an eager call before graph capture")
    flags.local().fill_(value)
    torch.cuda.synchronize()
    host_barrier(process_group(flags.ws.group_name))
    _initialized.add(key)


MAX_HANDSHAKE_RANKS = 64  # 256 bytes of int32 flags per array


def ready_done_flags(group_name: str, tag: str, world: int) -> tuple[FlagArray, FlagArray]:
    """The slot handshake of the copy-based choices, in a small workspace of its own (``tag``): ``ready``
    (starts 0: the sender sets the receiver's flag once its data has landed) and ``done`` (starts 1: the
    receiver sets the sender's flag once the slot may be overwritten again). Each is indexed by peer rank
    (64 flags per array)."""
    if world > MAX_HANDSHAKE_RANKS:
        raise ValueError(f"fluxcompile: {tag}: {world} ranks, but the handshake holds {MAX_HANDSHAKE_RANKS}")
    ws = workspace(group_name, 512, tag=tag)
    ready, done = FlagArray(ws, 0, world), FlagArray(ws, 256, world)
    init_flags(ready, 0)
    init_flags(done, 1)  # every slot starts free
    return ready, done
