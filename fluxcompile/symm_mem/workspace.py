"""Workspaces over PyTorch symmetric memory, keyed by (group, device, purpose) and reused.

A workspace is one symmetric byte buffer per (group, device, tag) that grows to the largest request.
Buffers are never freed while the process lives: a CUDA graph captured over an older, smaller buffer
keeps pointing at it. Allocation is a collective (rendezvous), so it happens on the first eager call
of a fused op — the same call on every rank — and never during CUDA-graph capture: warm up first.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from . import backend
from .groups import process_group
from .persistent import persistent

_MIN_BYTES = 1 << 20


@dataclasses.dataclass
class Workspace:
    group_name: str
    buffer: torch.Tensor  # this rank's symmetric uint8 buffer
    handle: object  # torch's _SymmetricMemory: peer buffers, signal pads, barrier
    rank: int
    world_size: int

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def view(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, offset_bytes: int = 0) -> torch.Tensor:
        """``rank``'s buffer (this rank's own or a peer's, mapped here) as a contiguous tensor."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset_bytes % itemsize:
            raise ValueError(f"offset {offset_bytes} is not a multiple of {dtype}'s size")
        return self.handle.get_buffer(rank, list(shape), dtype, offset_bytes // itemsize)

    def addresses(self) -> torch.Tensor:
        """Every rank's buffer as mapped here: int64 ``[world_size]`` on this buffer's device (the kernels' peer
        address table; a host-to-device copy, so made eagerly, never during capture)."""
        ptrs = [int(self.handle.buffer_ptrs[p]) for p in range(self.world_size)]
        return torch.tensor(ptrs, dtype=torch.int64, device=self.buffer.device)

    def barrier(self, channel: int, timeout_ms: int = 30_000) -> None:
        """Device-side barrier of the group on the current stream (bounded: a missing peer is an error
        after ``timeout_ms``, not a hang)."""
        self.handle.barrier(channel=channel, timeout_ms=timeout_ms)


_workspaces: dict[tuple[str, int, str], Workspace] = {}
_retired: list[torch.Tensor] = []  # outgrown buffers, kept alive for graphs captured over them
_side_streams: dict[int, torch.cuda.Stream] = {}
_current_streams: dict[int, torch.cuda.Stream] = {}  # by raw cudaStream_t
_generation = 0  # bumped whenever a workspace is made or grown


def generation() -> int:
    """A counter that changes whenever any workspace is made or grown: views cached from workspaces (the
    choices' plans) are still valid while it has not changed, checked without a lookup per call."""
    return _generation


def enable_group(group_name: str) -> None:
    """Turn on PyTorch's symmetric memory for the group (once; its own symm_mem ops need it too)."""
    from torch.distributed import _symmetric_memory as symm

    if not symm.is_symm_mem_enabled_for_group(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in newer torch, still required by 2.11
            symm.enable_symm_mem_for_group(group_name)


def workspace(group_name: str, nbytes: int, tag: str = "default", world: int | None = None) -> Workspace:
    """The (group, current device, tag) workspace with at least ``nbytes``; a collective when it must grow.
    ``world``: the group size the caller was given, checked against the group's."""
    from torch.distributed import _symmetric_memory as symm

    device = torch.cuda.current_device()
    key = (group_name, device, tag)
    ws = _workspaces.get(key)
    if ws is not None and ws.nbytes >= nbytes:
        _check_world(ws, world)
        return ws
    if torch.cuda.is_current_stream_capturing():
        have = ws.nbytes if ws is not None else 0
        raise RuntimeError(
            f"fluxcompile: symmetric workspace '{tag}' of group {group_name} needs {nbytes} bytes "
            f"but has {have}; it cannot grow during CUDA graph capture. Run the model once eagerly "
            "(warm-up) with the largest shapes before capturing."
        )
    enable_group(group_name)
    size = max(nbytes, 2 * ws.nbytes if ws is not None else 0, _MIN_BYTES)

    def make() -> tuple[torch.Tensor, object]:
        buf = symm.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))
        return buf, symm.rendezvous(buf, group_name)

    live = sum(w.nbytes for (_, d, _), w in _workspaces.items() if d == device)
    backend.apply(device, live + size)

    # The rendezvous keeps device tables from the caching allocator: made outside the caller's graph pool.
    buf, handle = persistent(make, f"symmetric workspace '{tag}' of group {group_name}")
    if ws is not None:
        _retired.append(ws.buffer)
    group = process_group(group_name)
    ws = Workspace(group_name, buf, handle, group.rank(), group.size())
    _workspaces[key] = ws
    global _generation
    _generation += 1
    _check_world(ws, world)
    return ws


def _check_world(ws: Workspace, world: int | None) -> None:
    if world is not None and world != ws.world_size:
        raise ValueError(f"fluxcompile: group_size={world} but group {ws.group_name} has {ws.world_size} ranks")


def current_stream() -> torch.cuda.Stream:
    """``torch.cuda.current_stream()`` for the hot path: that builds a new Stream object per call (costly host
    time); this returns one cached per raw stream handle (two C calls)."""
    raw = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    stream = _current_streams.get(raw)
    if stream is None:
        stream = _current_streams[raw] = torch.cuda.current_stream()
    return stream


def side_stream() -> torch.cuda.Stream:
    """A high-priority stream per device for communication, so its small kernels (barriers) are scheduled
    ahead of the GEMM's pending blocks."""
    device = torch.cuda.current_device()
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return _side_streams[device]
