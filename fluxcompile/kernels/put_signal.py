"""An all-to-all of contiguous chunks in put-with-signal form: every rank pushes chunk ``p`` of its local send
buffer into rank ``p``'s receive buffer and then adds 1 to a counter of ``p``'s that counts its arrivals; the
receiver waits on its own counters (kernels/embedding_bag.py's ``wait_kernel``: bounded, epoch-valued targets that
only grow).

The send buffer holds segments of ``D`` elements; chunk ``p`` is segments ``src_start[p] .. src_start[p + 1]``
(``src_start`` int64 ``[world + 1]``). It lands at element ``dst_off[p]`` of half ``epoch % 2`` (the epoch the
receiver's wait will publish, ``state[0] + 1``) of ``p``'s receive buffer, halves of ``parity_elems`` elements;
our own chunk goes into ``out`` at ``dst_off[rank]`` instead (a local copy; with ``own_in_recv``, into our own
receive buffer's half at that offset, where a reader of every source's rows finds it). One launch of ``(world, SLICES)``
programs: program ``(k, c)`` moves slice ``c`` of the chunk for peer ``(rank + 1 + k) % world`` (rotated, so the
ranks do not all write into one peer at once) and then signals it: every source adds ``SLICES`` to each of our
counters per call, an empty chunk included (its programs signal without data).

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

SLICE_BYTES = 256 << 10  # bytes one program puts: slices spread a large chunk over SMs (and NICs' queues)
MAX_SLICES = 16
COPY_BLOCK = 2048


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
        if NVSHMEM:
            nbytes = (b - a) * send.dtype.element_ty.primitive_bitwidth // 8
            nv.put_with_signal(recv + dst, send + lo + a, nbytes, counters + rank, p)
        else:
            base = tl.load(peer_data + p).to(tl.pointer_type(dtype)) + dst
            for i in range(0, b - a, BLOCK):
                idx = i + tl.arange(0, BLOCK)
                m = idx < b - a
                tl.store(base + idx, tl.load(send + lo + a + idx, mask=m), mask=m)
            tl.debug_barrier()  # every thread's stores before the release
            counter = tl.load(peer_counters + p).to(tl.pointer_type(tl.int64)) + rank
            tl.atomic_add(counter, 1, sem="release", scope="sys")


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
