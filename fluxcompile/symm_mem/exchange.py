"""The peer exchange: the order in which a rank takes its peers' blocks and sends its own, the handshake that
guards each slot, and the send itself. Every choice that moves row blocks between ranks takes them from here.

Orders (Flux's ring, section 4.2 of the paper): rank ``r`` of ``w`` takes its peers' blocks in ring order,
``r+1, r+2, ..., r-1`` (:func:`ring_order`): at each step every rank reads from (or writes into) a different
peer. A rank whose blocks are *gathered* sends them in the reverse order, ``r-1`` first (:func:`gather_send_order`):
``r-1`` consumes ``r`` first of all, so shards land in the order they are consumed. A rank whose partials are
*scattered* sends them in ring order: what ``r+1`` waits for leaves first.

Handshake (symm_mem/signals.py): per pair of ranks a ``ready`` flag (starts 0; the sender sets the receiver's
once its data has landed) and a ``done`` flag (starts 1; the receiver sets the sender's once the slot may be
written again), 0/1 values reset by their waiter, so CUDA graphs replay them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence

import torch

from .signals import ready_done_flags, stream_consume, stream_write
from .watchdog import Watch, flag_report, watch
from .workspace import current_stream

SLOT_ALIGN = 256  # bytes: every slot starts on this boundary


@functools.cache
def ring_order(rank: int, world: int) -> tuple[int, ...]:
    """The peers in the order ``rank`` takes their blocks: ``rank + 1`` first, then ``rank + 2``, ..."""
    return tuple((rank + step) % world for step in range(1, world))


@functools.cache
def gather_send_order(rank: int, world: int) -> tuple[int, ...]:
    """The peers in the order ``rank`` sends its shard when every rank gathers every shard: ``rank - 1`` first.
    Rank ``p`` takes ``rank``'s shard at step ``(rank - p) % world``, so this is the order of need."""
    return tuple(reversed(ring_order(rank, world)))


def slot_bytes(nbytes: int) -> int:
    """A slot's size for a block of ``nbytes``: rounded up to :data:`SLOT_ALIGN`."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def slice_rows(rows: int, d: int) -> int:
    """Rows of a separate slice of 1/d of a rank's ``rows`` (the all-gather's lead GEMM, the reduce-scatter's
    tail GEMM), rounded down to a multiple of 64 (0: none)."""
    return rows // d // 64 * 64


def stage_groups(world: int, groups: int) -> list[list[int]]:
    """Indices into :func:`ring_order` of each group's peers: consecutive, in arrival order, ``min(groups,
    world - 1)`` groups, sizes as even as possible with the larger ones last (earlier groups wait for fewer)."""
    peers = world - 1
    g = max(1, min(groups, peers))
    sizes = [peers // g + (i >= g - peers % g) for i in range(g)]
    out, j = [], 0
    for size in sizes:
        out.append(list(range(j, j + size)))
        j += size
    return out


def row_ranges(rank: int, world: int, rows: int, js: Sequence[int]) -> list[tuple[int, int]]:
    """The gathered rows of the peers ``ring_order(rank, world)[j]`` for ``j`` in ``js`` (consecutive), as
    [lo, hi) ranges: one, or two where the group wraps past the last rank."""
    order = ring_order(rank, world)
    ranges: list[tuple[int, int]] = []
    for b in (order[j] for j in js):
        lo, hi = b * rows, (b + 1) * rows
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


@functools.cache
def stage_plan(rank: int, world: int, rows: int, groups: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per call signature, once: each group's peer indices and its row ranges flattened to
    ``[lo0, hi0, lo1, hi1, ...]`` (the C++ sequencer's form)."""
    js = stage_groups(world, groups)
    return js, [[x for r in row_ranges(rank, world, rows, g) for x in r] for g in js]


@dataclasses.dataclass
class Handshake:
    """A call site's flags as addresses. ``send_to`` are the peers in the order this rank sends to them, with
    ``done_mine[j]`` (may we write into our slot in ``send_to[j]``'s buffer?) and ``ready_theirs[j]`` (our data
    has landed there); ``recv_from`` are the peers in :func:`ring_order`, with ``ready_mine[j]`` (its data has
    landed here) and ``done_theirs[j]`` (its slot in our buffer is free again)."""

    recv_from: tuple[int, ...]
    send_to: tuple[int, ...]
    done_mine: list[int]
    ready_theirs: list[int]
    ready_mine: list[int]
    done_theirs: list[int]
    watch: Watch | None

    @property
    def lists(self) -> tuple[list[int], ...]:
        """(recv_from, done_mine, ready_theirs, ready_mine, done_theirs): csrc/sequences.h's argument order."""
        return list(self.recv_from), self.done_mine, self.ready_theirs, self.ready_mine, self.done_theirs

    def note(self) -> None:
        """After an eager call, for the watchdog (captured calls are not watched: replays do not come back)."""
        if self.watch is not None and not torch.cuda.is_current_stream_capturing():
            self.watch.note(current_stream())


def handshake(group_name: str, tag: str, rank: int, world: int, send_to: Sequence[int], what: str) -> Handshake:
    """The flags of ``tag`` (made and zeroed on the first call of every rank) for a site that sends to
    ``send_to`` in that order and receives in ring order; ``what`` names the site in the watchdog's report."""
    ready, done = ready_done_flags(group_name, tag, world)
    recv_from = ring_order(rank, world)
    return Handshake(
        recv_from=recv_from,
        send_to=tuple(send_to),
        done_mine=[done.addr(rank, p) for p in send_to],
        ready_theirs=[ready.addr(p, rank) for p in send_to],
        ready_mine=[ready.addr(rank, p) for p in recv_from],
        done_theirs=[done.addr(p, rank) for p in recv_from],
        watch=watch(what, rank, lambda: flag_report(ready, done, list(recv_from))),
    )


def send(stream: torch.cuda.Stream, free: int, pieces: Iterable[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """On ``stream``: once the flag at ``free`` says the peer freed its slot, each ``(dst, src, flag)`` piece: the
    copy engine moves ``src`` into the peer's ``dst`` (peer to peer), then ``flag`` is set. csrc/sequences.cpp's
    ``send_block`` is the same with one piece."""
    stream_consume(stream, free)
    for dst, src, flag in pieces:
        dst.copy_(src)
        stream_write(stream, flag, 1)
