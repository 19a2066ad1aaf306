"""An all-to-all of contiguous chunks in put-with-signal form: every rank pushes chunk ``p`` of its local send
buffer into rank ``p``'s receive buffer and then adds what it put to a counter of ``p``'s that counts its
arrivals; the receiver waits on its own counters (kernels/embedding_bag.py's ``wait_kernel``: bounded targets that
only grow).

The send buffer holds segments of ``D`` elements; chunk ``p`` is segments ``src_start[p] .. src_start[p + 1]``
(``src_start`` int64 ``[world + 1]``). It lands at element ``dst_off[p]`` of half ``epoch % 2`` (the epoch the
receiver's wait will publish, ``state[0] + 1``) of ``p``'s receive buffer, halves of ``parity_elems`` elements;
our own chunk goes into ``out`` at ``dst_off[rank]`` instead (a local copy; with ``own_in_recv``, into our own
receive buffer's half at that offset, where a reader of every source's rows finds it). One launch of ``(world, SLICES)``
programs: program ``(k, c)`` moves slice ``c`` of the chunk for peer ``(rank + 1 + k) % world`` (rotated, so the
ranks do not all write into one peer at once) and then signals it: each program adds the elements it put, slice
0 one more, so a source adds its chunk's elements + 1 to our counter for it per call (an empty chunk signals
too), which the receiver knows from its own splits whatever the sender's slicing.

Where our chunk starts in a receiver's output, with unequal splits, only the receiver knows: :func:`publish_offsets`
puts each source its entry (8 bytes with a signal into the source's inbox, halves by the offsets' own epoch) and
:func:`fetch_offsets` waits (bounded) for every receiver's entry and reads them into ``dst_off``.

Two transports, one kernel body:
* :func:`put_chunks_nvshmem_kernel`: NVSHMEM's ``putmem_signal_block`` (kernels/nvshmem_device.py), which delivers
  the data before the signal whatever the peer's transport (P2P over NVLink on one host, the network across
  hosts). Addresses are symmetric: this rank's own receive buffer and counters name the peer's (the NVSHMEM
  backend allocates every symmetric workspace in NVSHMEM's heap).
* :func:`put_chunks_p2p_kernel`: stores into the peer's buffer through its P2P address (``peer_data[p]``), then a
  release add on its counter (``peer_counters[p]``, system scope): the same protocol over torch's CUDA backend, the
  one-GPU rank harness and Triton's interpreter (tests/kernel_checks/put_interpreted.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import nvshmem_device as nv
from .waits import timed_wait

SLICE_BYTES = 256 << 10  # bytes one program puts: slices spread a large chunk over SMs (and NICs' queues)
MAX_SLICES = 16
COPY_BLOCK = 2048
KIND_OFFSETS = tl.constexpr(1)  # kernels/embedding_bag.py's kind of a wait for a receiver's offsets (its error sentence)


@triton.jit
def _put_chunks(
    send, out, recv, counters, peer_data, peer_counters, src_start, dst_off, state, D, parity_elems, rank, world,
    NVSHMEM: tl.constexpr, OWN_IN_RECV: tl.constexpr, SLICES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0)
    c = tl.program_id(1)
    p = (rank + 1 + k) % world
    lo = tl.load(src_start + p) * D
    n = tl.load(src_start + p + 1) * D - lo
    per = tl.cdiv(n, SLICES)
    a = tl.minimum(c * per, n)
    b = tl.minimum(a + per, n)
    dtype = send.dtype.element_ty
    off = tl.load(dst_off + p)
    e = tl.load(state, volatile=True) + 1
    dst = (e & 1).to(tl.int64) * parity_elems + off + a
    if p == rank:  # our own chunk: into out (or our receive buffer's half)
        if OWN_IN_RECV:
            own = recv + dst - a
        else:
            own = out + off
        for i in range(a, b, BLOCK):
            idx = i + tl.arange(0, BLOCK)
            m = idx < b
            tl.store(own + idx, tl.load(send + lo + idx, mask=m), mask=m)
    else:
        value = (b - a) + (c == 0).to(tl.int64)
        if NVSHMEM:
            nbytes = (b - a) * send.dtype.element_ty.primitive_bitwidth // 8
            nv.put_with_signal(recv + dst, send + lo + a, nbytes, counters + rank, value, p)
        else:
            base = tl.load(peer_data + p).to(tl.pointer_type(dtype)) + dst
            for i in range(0, b - a, BLOCK):
                idx = i + tl.arange(0, BLOCK)
                m = idx < b - a
                tl.store(base + idx, tl.load(send + lo + a + idx, mask=m), mask=m)
            tl.debug_barrier()  # every thread's stores before the release
            counter = tl.load(peer_counters + p).to(tl.pointer_type(tl.int64)) + rank
            tl.atomic_add(counter, value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["D", "parity_elems", "rank", "world"])
def put_chunks_nvshmem_kernel(
    send, out, recv, counters, peer_data, peer_counters, src_start, dst_off, state, D, parity_elems, rank, world,
    OWN_IN_RECV: tl.constexpr, SLICES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The exchange by NVSHMEM put-with-signal (launched through ``nvshmem_device.launcher``)."""
    _put_chunks(send, out, recv, counters, peer_data, peer_counters, src_start, dst_off, state, D, parity_elems,
                rank, world, True, OWN_IN_RECV, SLICES, BLOCK)  # fmt: skip


@triton.jit(do_not_specialize=["D", "parity_elems", "rank", "world"])
def put_chunks_p2p_kernel(
    send, out, recv, counters, peer_data, peer_counters, src_start, dst_off, state, D, parity_elems, rank, world,
    OWN_IN_RECV: tl.constexpr, SLICES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The exchange by P2P stores and a release add."""
    _put_chunks(send, out, recv, counters, peer_data, peer_counters, src_start, dst_off, state, D, parity_elems,
                rank, world, False, OWN_IN_RECV, SLICES, BLOCK)  # fmt: skip


@triton.jit
def _publish_offsets(
    values, outbox, inbox, counters, peer_inbox, peer_counters, ostate, rank, world, NVSHMEM: tl.constexpr,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    e = tl.load(ostate, volatile=True) + 1
    half = (e & 1).to(tl.int64) * BLOCK_W
    w = tl.arange(0, BLOCK_W)
    wm = w < world
    tl.store(outbox + w, tl.load(values + w, mask=wm, other=0), mask=wm)  # a put's source: symmetric memory
    tl.debug_barrier()
    for p in range(0, world):
        if p != rank:
            if NVSHMEM:
                eight = tl.full((), 8, tl.int64)
                one = tl.full((), 1, tl.int64)
                nv.put_with_signal(inbox + half + rank, outbox + p, eight, counters + rank, one, p)
            else:
                slot = tl.load(peer_inbox + p).to(tl.pointer_type(tl.int64)) + half + rank
                tl.store(slot, tl.load(values + p))
                tl.debug_barrier()
                counter = tl.load(peer_counters + p).to(tl.pointer_type(tl.int64)) + rank
                tl.atomic_add(counter, 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["rank", "world"])
def publish_offsets_nvshmem_kernel(
    values, outbox, inbox, counters, peer_inbox, peer_counters, ostate, rank, world, BLOCK_W: tl.constexpr
):  # fmt: skip
    """One program: ``values[p]`` into every peer p's inbox (half by the offsets' epoch ``ostate[0] + 1``), slot
    ``rank``, with +1 on p's offsets counter ``rank`` (NVSHMEM put-with-signal)."""
    _publish_offsets(values, outbox, inbox, counters, peer_inbox, peer_counters, ostate, rank, world, True, BLOCK_W)


@triton.jit(do_not_specialize=["rank", "world"])
def publish_offsets_p2p_kernel(
    values, outbox, inbox, counters, peer_inbox, peer_counters, ostate, rank, world, BLOCK_W: tl.constexpr
):  # fmt: skip
    """:func:`publish_offsets_nvshmem_kernel` by P2P stores and a release add."""
    _publish_offsets(values, outbox, inbox, counters, peer_inbox, peer_counters, ostate, rank, world, False, BLOCK_W)


@triton.jit(do_not_specialize=["max_spin", "rank", "world"])
def fetch_offsets_kernel(
    values, inbox, counters, ostate, dst_off, err, max_spin, rank, world, BLOCK_W: tl.constexpr, TIMED: tl.constexpr
):  # fmt: skip
    """One program: a bounded wait until every peer's offsets counter reached its target (``ostate[1 + p] + 1``),
    then ``dst_off[p]`` = its entry in our inbox (ours: ``values[rank]``); the offsets' epoch advances."""
    e = tl.load(ostate, volatile=True) + 1
    half = (e & 1).to(tl.int64) * BLOCK_W
    for p in range(0, world):
        if p == rank:
            tl.store(dst_off + p, tl.load(values + rank))
        else:
            target = tl.load(ostate + 1 + p, volatile=True) + 1
            timed_wait(counters + p, target, err, max_spin, rank, p, e, KIND_OFFSETS, True, TIMED)
            tl.store(ostate + 1 + p, target)
            tl.store(dst_off + p, tl.load(inbox + half + p, volatile=True))
    tl.store(ostate, e)


def slices(chunk_bytes: int) -> int:
    """Programs per peer for a largest chunk of ``chunk_bytes``: one per ``SLICE_BYTES``, at most ``MAX_SLICES``
    (a power of two, so few kernels compile)."""
    n = max(1, -(-chunk_bytes // SLICE_BYTES))
    return min(MAX_SLICES, 1 << (n - 1).bit_length())


def put_chunks(
    send: torch.Tensor, out: torch.Tensor, recv: torch.Tensor, counters: torch.Tensor, *, src_start: torch.Tensor,
    dst_off: torch.Tensor, state: torch.Tensor, dim: int, parity_elems: int, rank: int, world: int, n_slices: int,
    nvshmem: bool, peer_data: torch.Tensor | None = None, peer_counters: torch.Tensor | None = None,
    own_in_recv: bool = False,
) -> None:  # fmt: skip
    """Launch the exchange (see the module): ``send`` this rank's segments (flat, the dtype of ``out``); ``out``
    its output (flat); ``recv``: its receive buffer (both halves) and ``counters`` its int64 arrival counters, by
    source (symmetric: with ``nvshmem`` they name the peers'); ``peer_data``/``peer_counters`` int64 ``[world]``
    (every rank's receive buffer and counters, for the P2P transport); ``state``: the receiver's protocol state
    (``state[0]`` the epoch of its last wait). ``n_slices``: programs per peer (:func:`slices`). ``own_in_recv``:
    our own chunk into ``recv``'s half like the peers' (``out`` unused) rather than into ``out``."""
    if n_slices not in {1 << i for i in range(MAX_SLICES.bit_length())}:
        raise ValueError(f"put_chunks: {n_slices} slices (a power of two up to {MAX_SLICES})")
    if not nvshmem and (peer_data is None or peer_counters is None):
        raise ValueError("put_chunks: the P2P transport needs peer_data and peer_counters")
    args = (
        send, out, recv, counters, peer_data if peer_data is not None else src_start,
        peer_counters if peer_counters is not None else src_start, src_start, dst_off, state, dim, parity_elems,
        rank, world,
    )  # fmt: skip
    kernel = nv.launcher(put_chunks_nvshmem_kernel) if nvshmem else put_chunks_p2p_kernel
    kernel[(world, n_slices)](*args, OWN_IN_RECV=bool(own_in_recv), SLICES=n_slices, BLOCK=COPY_BLOCK, num_warps=4)


def publish_offsets(
    values: torch.Tensor, outbox: torch.Tensor, inbox: torch.Tensor, counters: torch.Tensor, ostate: torch.Tensor,
    *, rank: int, world: int, block_w: int, nvshmem: bool, peer_inbox: torch.Tensor | None = None,
    peer_counters: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Launch the offsets' publication (one program): ``values`` int64 ``[world]`` (where each source's chunk starts
    in our output); ``outbox`` int64 ``[block_w]``, ``inbox`` int64 ``[2, block_w]`` and ``counters`` int64
    ``[block_w]``, this rank's symmetric words; ``ostate`` the offsets' state (int64 ``[1 + block_w]``);
    ``peer_inbox``/``peer_counters``: every rank's inbox and counters (the P2P transport)."""
    if not nvshmem and (peer_inbox is None or peer_counters is None):
        raise ValueError("publish_offsets: the P2P transport needs peer_inbox and peer_counters")
    kernel = nv.launcher(publish_offsets_nvshmem_kernel) if nvshmem else publish_offsets_p2p_kernel
    kernel[(1,)](
        values, outbox, inbox, counters, peer_inbox if peer_inbox is not None else values,
        peer_counters if peer_counters is not None else values, ostate, rank, world, BLOCK_W=block_w, num_warps=1,
    )  # fmt: skip


def fetch_offsets(
    values: torch.Tensor, inbox: torch.Tensor, counters: torch.Tensor, ostate: torch.Tensor, dst_off: torch.Tensor,
    err: torch.Tensor, max_spin: int, *, rank: int, world: int, block_w: int,
) -> None:  # fmt: skip
    """Launch the offsets' wait and read (one program): ``dst_off`` int64 ``[world]`` gets every receiver's entry."""
    fetch_offsets_kernel[(1,)](
        values, inbox, counters, ostate, dst_off, err, max_spin, rank, world, BLOCK_W=block_w,
        TIMED=ostate.is_cuda, num_warps=1,
    )  # fmt: skip
