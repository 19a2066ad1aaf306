"""all_gather_matmul with PyTorch's CUTLASS GEMM that waits for its input chunks
(``torch.ops.symm_mem._async_input_mm``): one GEMM launch over the whole gathered A, whose tiles of the
rank-``r`` row block start once ``signals[r]`` is set, local block first (the pivot). The copy engine pulls
the peers' shards straight into the gathered output, so A_gathered needs no further copy.

Where peers pull from depends on the shard A:

* A in symmetric memory (Inductor produced it there, lowerings/comm_buffers.py), where torch tells so
  (``is_symm_mem_tensor``, which torch 2.11 lacks): peers pull straight from A. Nothing is published, but A may
  not be written again until every peer has pulled it, and the next write is the next producer, queued after
  this op on the main stream: so the op waits for the peers' ``done`` flags at its end, and returns only then.
* any other A: our shard is published into a workspace of our own that peers pull from; it may be overwritten
  once every peer has pulled the previous one, so the op waits for the peers' ``done`` flags at its start.

Per call, on rank r (peers p in ring order, symm_mem/exchange.py):
  main stream:  [copied A: wait done_p (p finished pulling our previous shard) -> publish our shard into our
                workspace] -> our shard into our rows of A_gathered (SM copy, before the GEMM) -> set ready_r
                on every p -> signals = [0..] with signals[r] = 1 -> the GEMM
                -> [symmetric A: wait done_p (p finished pulling our A)]
  side stream:  for p: wait ready_p -> pull p's shard (p's A, or p's workspace) into its rows of A_gathered
                (peer-to-peer: the copy engine) -> signals[p] = 1 (the GEMM's tiles of p's rows start)
                -> set done_r on p
The two cases keep flags of their own (``done`` starts 1 for a copied A: the workspace starts free; 0 for a
symmetric A: nothing was pulled yet), each case a communication context of its own (``symm_mem.comm_for``:
workspaces, side stream, watch). Every wait is a stream memory operation, bounded by the watchdog
(symm_mem/watchdog.py) after each eager call. All ranks take the same case: they run the same generated code.
Constraints of the kernel (checked in ``supports``): bf16, one weight, no bias, [K, N] or [N, K]-transposed
weight, shard rows a multiple of its 128-row tile.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ...symm_mem import Comm, FlagArray, comm_for, init_flags, ready_done_flags, stream_consume, stream_write, workspace
from ...symm_mem.exchange import ring_order
from ...symm_mem.persistent import persistent
from ...symm_mem.signals import MAX_HANDSHAKE_RANKS
from ...symm_mem.tensors import is_symm_mem_tensor
from ...symm_mem.watchdog import flag_report
from ...symm_mem.workspace import enable_group
from .layout import shard_layout

NAME = "async_input_mm"
log = logging.getLogger("fluxcompile.async_input_mm")
_TILE_M = 128
_signals: dict[tuple[str, int], Tensor] = {}
_rendezvoused: set[tuple[int, str]] = set()  # (storage address, group): symmetric shards met in an eager call
_COPY_TAG = "async_input_mm"  # the copied shard's workspace; its handshake's flags are _COPY_FLAGS
_COPY_FLAGS = "async_input_mm.flags"
_PULL_TAG = "async_input_mm.pull"  # the context of a symmetric shard: no workspace of its own, flags _PULL_FLAGS
_PULL_FLAGS = "async_input_mm.pull_flags"
_HANDSHAKE_BYTES = 512  # ready_done_flags' layout: ready at 0, done at 256


def supports(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> str | None:
    if not A.is_cuda:
        return "needs CUDA tensors"
    if not hasattr(torch.ops.symm_mem, "_async_input_mm"):
        return "torch.ops.symm_mem._async_input_mm is not in this torch"
    if torch.cuda.get_device_capability(A.device) != (9, 0):
        return "its CUTLASS kernel is built for sm_90 only"
    if group_size < 2:
        return "nothing to overlap with one rank"
    if len(Bs) != 1 or biases[0] is not None:
        return "one weight without bias only"
    b = Bs[0]
    if A.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return "bf16 only"
    if math.prod(A.shape[:gather_dim]) != 1:
        return "gather dim has a leading dim of size > 1"
    if not (b.is_contiguous() or (b.stride(0) == 1 and b.stride(1) == b.shape[0])):
        return "the weight must be [K, N] contiguous or the transpose of a contiguous [N, K]"
    rows = A.numel() // A.shape[-1]
    if rows % _TILE_M:
        return f"shard rows {rows} are not a multiple of the kernel's {_TILE_M}-row tile"
    return None


def all_gather_matmul(
    A: Tensor,
    Bs: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    gather_dim: int,
    group_size: int,
    group_name: str,
    return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:
    """The fused op's signature and outputs. The gathered operand is the GEMM's input buffer, so it is made
    either way; with ``return_A`` False it is not returned."""
    A, rows, k, gathered_shape = shard_layout(A, gather_dim, group_size)
    a = A.view(rows, k)
    source = symmetric_source(a, group_name)
    if source is None:
        A_gathered, outs = _gather_copied(a, Bs[0], group_name, gathered_shape)
    else:
        A_gathered, outs = _gather_symmetric(a, source, Bs[0], group_name, gathered_shape)
    return (A_gathered if return_A else None), outs


# ---------------------------------------------------------------------------------------------
# The shard in symmetric memory.


def symmetric_source(a: Tensor, group_name: str) -> tuple[Any, int] | None:
    """(the group's handle on ``a``'s allocation, ``a``'s element offset in the handle's buffers) where ``a`` is
    symmetric memory, else None. The first call on an allocation is a collective of the group (rendezvous), so it
    must be eager; every rank makes it at the same call, as every rank runs the same generated code."""
    if not is_symm_mem_tensor(a):
        return None
    from torch.distributed import _symmetric_memory as symm

    key = (a.untyped_storage().data_ptr(), group_name)
    if key not in _rendezvoused:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fluxcompile: run {NAME} once eagerly on this symmetric shard before graph capture")
        enable_group(group_name)
    handle = symm.rendezvous(a, group_name)
    if handle is None:
        return None
    offset = shard_offset(handle, a)
    if offset is None:  # alike on every rank (the same layout everywhere): all of them copy
        log.warning("%s: the shard's place in its symmetric allocation is not found; it is copied", NAME)
        return None
    _rendezvoused.add(key)
    return handle, offset


def shard_offset(handle: Any, a: Tensor) -> int | None:
    """The element offset at which ``handle.get_buffer`` on this rank gives ``a``: counted from the handle's
    buffer pointer, or 0 where the handle already starts at ``a`` (torch versions differ)."""
    delta = a.data_ptr() - int(handle.buffer_ptrs[handle.rank])
    candidates = [delta // a.element_size()] if delta >= 0 and delta % a.element_size() == 0 else []
    for offset in [*candidates, 0]:
        try:
            view = handle.get_buffer(handle.rank, list(a.shape), a.dtype, offset)
        except RuntimeError:  # past the allocation's end
            continue
        if view.data_ptr() == a.data_ptr():
            return offset
    return None


def pull_flags(group_name: str, world: int) -> tuple[FlagArray, FlagArray]:
    """The handshake of a symmetric shard, in a small workspace of its own: ``ready`` (starts 0: the owner sets
    the puller's flag once its A is written) and ``done`` (starts 0: the puller sets the owner's flag once it has
    pulled A), indexed by peer rank, the layout of ``ready_done_flags``."""
    if world > MAX_HANDSHAKE_RANKS:
        raise ValueError(f"fluxcompile: {_PULL_FLAGS}: {world} ranks, but the handshake holds {MAX_HANDSHAKE_RANKS}")
    ws = workspace(group_name, 512, tag=_PULL_FLAGS)
    ready, done = FlagArray(ws, 0, world), FlagArray(ws, 256, world)
    init_flags(ready, 0)
    init_flags(done, 0)
    return ready, done


def _describe(comm: Comm) -> str:
    """The watchdog's report: the ready and done flags of the context's handshake (ready_done_flags' layout)."""
    ready, done = FlagArray(comm.flags, 0, comm.world), FlagArray(comm.flags, 256, comm.world)
    return flag_report(ready, done, list(ring_order(comm.rank, comm.world)))


def _gather_symmetric(
    a: Tensor, source: tuple[Any, int], b: Tensor, group_name: str, gathered_shape: list[int]
) -> tuple[Tensor, list[Tensor]]:
    handle, offset = source
    rank, world = handle.rank, handle.world_size
    comm = comm_for(
        group_name, _PULL_TAG, flag_bytes=_HANDSHAKE_BYTES, flags_tag=_PULL_FLAGS, describe=_describe,
        what=f"all_gather_matmul ({NAME}, {_PULL_FLAGS}, group {group_name})",
    )  # fmt: skip
    ready, done = pull_flags(group_name, world)
    main = torch.cuda.current_stream()
    order = ring_order(rank, world)
    rows, k = a.shape

    def peer_shard(p: int) -> Tensor:
        return handle.get_buffer(p, [rows, k], a.dtype, offset)

    A_gathered, out = _gemm_with_pulls(
        a, b, group_name, gathered_shape, ready, done, rank, order, peer_shard, comm.side
    )
    for p in order:  # our A may be written again (the next producer) once every peer has pulled it
        stream_consume(main, done.addr(rank, p))
    comm.note(main)
    return A_gathered, [out]


# ---------------------------------------------------------------------------------------------
# Any other shard: published into our workspace.


def _gather_copied(a: Tensor, b: Tensor, group_name: str, gathered_shape: list[int]) -> tuple[Tensor, list[Tensor]]:
    comm = comm_for(
        group_name, _COPY_TAG, data_bytes=a.numel() * a.element_size(), flag_bytes=_HANDSHAKE_BYTES,
        describe=_describe, what=f"all_gather_matmul ({NAME}, {_COPY_FLAGS}, group {group_name})",
    )  # fmt: skip
    ws = comm.data
    rank, world = comm.rank, comm.world
    ready, done = ready_done_flags(group_name, _COPY_FLAGS, world)
    main = torch.cuda.current_stream()
    order = ring_order(rank, world)
    rows, k = a.shape

    for p in order:  # our workspace is free once every peer has pulled the previous shard
        stream_consume(main, done.addr(rank, p))
    ws.view(rank, (rows, k), a.dtype).copy_(a)

    def peer_shard(p: int) -> Tensor:
        return ws.view(p, (rows, k), a.dtype)

    A_gathered, out = _gemm_with_pulls(
        a, b, group_name, gathered_shape, ready, done, rank, order, peer_shard, comm.side
    )
    comm.note(main)
    return A_gathered, [out]


# ---------------------------------------------------------------------------------------------
# Shared: the GEMM on the main stream, the pulls on the side stream.


def _gemm_with_pulls(
    a: Tensor, b: Tensor, group_name: str, gathered_shape: list[int], ready: FlagArray, done: FlagArray, rank: int,
    order: Sequence[int], peer_shard: Callable[[int], Tensor], side: torch.cuda.Stream,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Our rows into A_gathered, ``ready`` raised on every peer, the GEMM launched; on the ``side`` stream each
    peer's shard pulled into its rows, its signal set, its ``done`` raised. Returns with the main stream after the
    pulls."""
    world = len(order) + 1
    rows, k = a.shape
    signals = _signal_buffer(group_name, world)
    main = torch.cuda.current_stream()
    A_gathered = torch.empty(gathered_shape, dtype=a.dtype, device=a.device)
    rows_of = A_gathered.view(world, rows, k)

    rows_of[rank].copy_(a)
    for p in order:
        stream_write(main, ready.addr(p, rank), 1)
    signals.zero_()
    stream_write(main, signals.data_ptr() + 4 * rank, 1)
    published = torch.cuda.Event()
    published.record(main)
    out = torch.ops.symm_mem._async_input_mm(A_gathered.view(world * rows, k), b, signals, rank)

    side.wait_event(published)
    with torch.cuda.stream(side):
        for p in order:
            stream_consume(side, ready.addr(rank, p))
            rows_of[p].copy_(peer_shard(p))  # peer-to-peer: the copy engine
            stream_write(side, signals.data_ptr() + 4 * p, 1)
            stream_write(side, done.addr(p, rank), 1)
    main.wait_stream(side)
    return A_gathered, out


def _signal_buffer(group_name: str, world: int) -> Tensor:
    key = (group_name, torch.cuda.current_device())
    if key not in _signals:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fluxcompile: run async_input_mm once eagerly before graph capture")
        _signals[key] = persistent(
            lambda: torch.zeros(world, dtype=torch.uint32, device="cuda"), "async_input_mm's signal words"
        )
    return _signals[key]
