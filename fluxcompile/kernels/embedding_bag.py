"""Embedding-bag pooling whose pooled rows go straight to the rank that owns them (DLRM's model-parallel tables,
``fluxcompile.embedding_bag_all_to_all``).

The op pools ``P = cat([embedding_bag(indices[t], weights[t], offsets[t], mode) for t], dim=-1)`` (``[B, T * D]``)
and all-to-alls ``P.reshape(out_shape)`` along dim 0. In ``P``'s flat order a pooled row of one table is a
*segment* of ``D`` elements: segment ``g = b * T + t`` (bag ``b``, table ``t``) starts at element ``g * D``. The
all-to-all's chunks, in segments, are ``src_start[r] <= g < src_start[r + 1]`` (chunk ``r`` goes to rank ``r``),
and in the receiver's output our chunk starts at element ``dst_off[r]`` (what lower ranks send it before us:
rank-major order). So segment ``g`` of chunk ``r`` lands at element ``dst_off[r] + (g - src_start[r]) * D`` of rank
``r``'s output: for the usual ``out_shape`` (``[B, T * D]``) that is row ``row offset + local row``, columns
``t * D ..``.

:func:`pool_kernel`: one program per (block of ``BLOCK_B`` bags, table); it reads the bags' ranges from the table's
offsets, gathers ``UNROLL`` positions of every bag at a time (``[BLOCK_B, UNROLL, BLOCK_D]`` rows in flight),
accumulates in fp32 (sum, or mean: divided by the bag's length, an empty bag pools to zeros), and stores each
pooled row, in the table's dtype, at its destination: our own chunk into ``out`` (this rank's output), a peer's
chunk into that peer's receive buffer (``peer_data[r]``, half ``parity`` of two). Tables, index and offset tensors
come as a pointer table (``tables``, int64 ``[4, T]``: weight, indices and offsets addresses, index count), so one
launch pools every table whatever their row counts. Bag blocks are visited from rank ``rank + 1``'s chunk on
(rotated), so the ranks do not all store into the same peer at once.

Signals (with ``SIGNAL``, i.e. more than one rank): after its stores a program adds, per peer ``r`` it stored to,
the number of segments it stored there to ``counter[rank]`` (int64: it grows by a call's segments) on ``r`` (``peer_counters[r]``: release, system
scope); program (0, 0) adds one more to every peer (a token: every pair signals every call, even an empty
chunk). Counters only grow: the receiver's :func:`wait_kernel` keeps in ``state`` what each source's counter must
reach (``state[1 + s]``, plus this call's ``expect[s]`` = segments it receives from ``s`` + 1) and waits, bounded,
until it does; then it publishes the call's epoch ``state[0]``. No reset, so no race with a fast peer's next call,
and CUDA graphs replay it (everything lives on the device). Receive buffers alternate halves by the epoch's parity:
a sender can be at most one call ahead of a receiver (its next call follows its own wait, which needed the
receiver's signals of this call, sent after the receiver's previous copy-out).

With ``BOOK`` (a training forward) the pooling kernel also writes what aten's CUDA ``_embedding_bag`` gives its
backward: each bag's size and, for each index position, its bag (``offset2bag``), in the indices' dtype; no
extra launch, and no index is read for it. With ``PAD`` (a padding index) positions of that index pool nothing and
count in no bag's size (a mean divides by the others), as aten's. With ``PSW`` each position's row is scaled by its
per-sample weight before the sum.

:func:`publish_kernel` and :func:`fetch_offsets_kernel` (unequal splits): every rank publishes the exclusive prefix
of what it receives per source (``my_prefix``) in its flag workspace (half ``epoch % 2``) with the epoch in a flag;
then reads, from every peer ``r``, the entry for itself once ``r``'s flag has reached the epoch: ``dst_off[r]``.
With equal splits the prefix is ``rank * chunk`` everywhere and the caller passes it without these kernels.

:func:`copy_kernel`: the peers' chunks from the receive buffer (half ``parity``) into the output, every element
except our own chunk (``[hole_lo, hole_hi)``: the pooling kernel stored it there already).

Error words (``ERR_WORDS`` int32, kernels/waits.py): ``err[0]`` = 1 on the first timeout, then the waiting rank,
the peer, the epoch, the awaited value and the kind (``KIND_ROWS``: a source's pooled rows; ``KIND_OFFSETS``: a
receiver's published offsets). :func:`error_message` words them.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .waits import timed_wait

ERR_WORDS = 6
KIND_ROWS = 0
KIND_OFFSETS = 1
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_BLOCK_D = 256
COPY_BLOCK = 2048


@dataclasses.dataclass(frozen=True)
class Variant:
    """A launch of the pooling kernel: bags per program, positions gathered per step, warps, and the column block
    (0: ``D`` rounded up to a power of two, at most ``MAX_BLOCK_D``)."""

    block_b: int
    unroll: int
    num_warps: int
    block_d: int = 0

    def __post_init__(self) -> None:
        for name in ("block_b", "unroll", "num_warps", "block_d"):
            x = getattr(self, name)
            if x < (0 if name == "block_d" else 1) or x & (x - 1):
                raise ValueError(f"embedding_bag Variant: {name}={x} is not a power of two")

    def column_block(self, d: int) -> int:
        return self.block_d or min(triton.next_power_of_2(d), MAX_BLOCK_D)


# Offered to the autotuner (the benchmark, benchmarks/dlrm.py, sweeps more). Rows in flight per program: block_b x
# unroll; fp32 values per thread for D = 128: block_b * unroll * 128 / (32 * num_warps).
VARIANTS = {
    "b8u4w4": Variant(8, 4, 4),
    "b16u4w8": Variant(16, 4, 8),
    "b4u8w4": Variant(4, 8, 4),
    "b32u2w8": Variant(32, 2, 8),
    "b8u8w8": Variant(8, 8, 8),
}
DEFAULT = "b8u4w4"


def name_of(v: Variant) -> str:
    """``b<bags>u<unroll>w<warps>`` (``d<block_d>`` after it when set): the names of ``VARIANTS``."""
    return f"b{v.block_b}u{v.unroll}w{v.num_warps}" + (f"d{v.block_d}" if v.block_d else "")


@triton.jit(do_not_specialize=["B", "T", "rank", "world", "rot", "pad"])
def pool_kernel(
    tables, out, peer_data, peer_counters, dst_off, src_start, state, book, psw,
    B, T, D, parity_elems, rank, world, rot, pad,
    MODE: tl.constexpr, LAST: tl.constexpr, IDX64: tl.constexpr, OFF64: tl.constexpr, SIGNAL: tl.constexpr,
    ALIGNED: tl.constexpr, BOOK: tl.constexpr, PAD: tl.constexpr, PSW: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    dtype = out.dtype.element_ty
    pid = tl.program_id(0)
    t = tl.program_id(1)
    nb = tl.num_programs(0)
    blk = (pid + rot) % nb
    bags = blk * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = bags < B

    w_ptr = tl.load(tables + t).to(tl.pointer_type(dtype))
    if ALIGNED:  # 16-byte aligned tables and rows: vector loads
        w_ptr = tl.multiple_of(w_ptr, 16)
    if IDX64:
        i_ptr = tl.load(tables + T + t).to(tl.pointer_type(tl.int64))
    else:
        i_ptr = tl.load(tables + T + t).to(tl.pointer_type(tl.int32))
    if OFF64:
        o_ptr = tl.load(tables + 2 * T + t).to(tl.pointer_type(tl.int64))
    else:
        o_ptr = tl.load(tables + 2 * T + t).to(tl.pointer_type(tl.int32))
    n_idx = tl.load(tables + 3 * T + t)
    if PSW:  # per-sample weights, in the tables' dtype
        p_ptr = tl.load(psw + t).to(tl.pointer_type(dtype))

    start = tl.load(o_ptr + bags, mask=bmask, other=0).to(tl.int64)
    nxt = bags + 1
    if LAST:
        end = tl.load(o_ptr + nxt, mask=bmask, other=0).to(tl.int64)
    else:
        end = tl.load(o_ptr + nxt, mask=bmask & (nxt < B), other=0).to(tl.int64)
        end = tl.where(nxt < B, end, n_idx)
    lens = tl.where(bmask, tl.maximum(end - start, 0), 0)
    max_len = tl.max(lens, axis=0).to(tl.int32)
    ks = tl.arange(0, UNROLL)
    count = lens  # the bag's size: its positions but the padding index's
    if PAD:
        count = tl.zeros((BLOCK_B,), dtype=tl.int64)
        for j in range(0, max_len, UNROLL):
            pm = (j + ks)[None, :] < lens[:, None]
            idx = tl.load(i_ptr + start[:, None] + (j + ks)[None, :], mask=pm, other=0).to(tl.int64)
            count += tl.sum((pm & (idx != pad)).to(tl.int64), axis=1)
    if BOOK:  # the backward's bookkeeping, in the indices' dtype: each bag's size, each position's bag
        if IDX64:
            sizes = tl.load(book + T + t).to(tl.pointer_type(tl.int64))
            o2b = tl.load(book + t).to(tl.pointer_type(tl.int64))
        else:
            sizes = tl.load(book + T + t).to(tl.pointer_type(tl.int32))
            o2b = tl.load(book + t).to(tl.pointer_type(tl.int32))
        ty = sizes.dtype.element_ty
        tl.store(sizes + bags, count.to(ty), mask=bmask)
        for j in range(0, max_len, UNROLL):
            pos = j + ks
            pm = pos[None, :] < lens[:, None]
            tl.store(o2b + start[:, None] + pos[None, :], (bags[:, None] + 0 * pos[None, :]).to(ty), mask=pm)

    # Where each bag's pooled row goes: its chunk's rank r, the element offset in r's output.
    seg = bags.to(tl.int64) * T + t
    r = tl.zeros((BLOCK_B,), dtype=tl.int32)
    for k in range(1, world):
        r += (seg >= tl.load(src_start + k)).to(tl.int32)
    elem = tl.load(dst_off + r) + (seg - tl.load(src_start + r)) * D
    if ALIGNED:
        elem = tl.multiple_of(elem, 16)
    local = bmask & (r == rank)
    if SIGNAL:
        e = tl.load(state, volatile=True) + 1
        remote = bmask & (r != rank)
        base = tl.load(peer_data + r, mask=remote, other=0)
        dst = base.to(tl.pointer_type(dtype)) + (e & 1).to(tl.int64) * parity_elems + elem
        if ALIGNED:  # receive buffers are 16-byte aligned, halves and chunks too
            dst = tl.multiple_of(dst, 16)

    for d0 in range(0, D, BLOCK_D):
        cols = tl.max_contiguous(tl.multiple_of(d0 + tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
        cmask = cols < D
        acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
        for j in range(0, max_len, UNROLL):
            pos = j + ks
            pmask = pos[None, :] < lens[:, None]  # [BLOCK_B, UNROLL]
            idx = tl.load(i_ptr + start[:, None] + pos[None, :], mask=pmask, other=0).to(tl.int64)
            if PAD:  # the padding index pools nothing
                pmask = pmask & (idx != pad)
            row = idx * D
            if ALIGNED:
                row = tl.multiple_of(row, [16, 16])
            rows = tl.load(
                w_ptr + row[:, :, None] + cols[None, None, :],
                mask=pmask[:, :, None] & cmask[None, None, :], other=0.0,
            )  # fmt: skip
            if PSW:
                wts = tl.load(p_ptr + start[:, None] + pos[None, :], mask=pmask, other=0.0).to(tl.float32)
                acc += tl.sum(rows.to(tl.float32) * wts[:, :, None], axis=1)
            else:
                acc += tl.sum(rows.to(tl.float32), axis=1)
        if MODE == 1:
            acc = acc / tl.maximum(count, 1).to(tl.float32)[:, None]
        res = acc.to(dtype)
        tl.store(out + elem[:, None] + cols[None, :], res, mask=local[:, None] & cmask[None, :])
        if SIGNAL:
            tl.store(dst[:, None] + cols[None, :], res, mask=remote[:, None] & cmask[None, :])

    if SIGNAL:
        # Every thread's stores of the block before the (cumulative) releases of the counters.
        tl.debug_barrier()
        token = ((pid == 0) & (t == 0)).to(tl.int32)
        for k in range(0, world):
            if k != rank:
                cnt = tl.sum((remote & (r == k)).to(tl.int32), axis=0) + token
                if cnt > 0:
                    counter = tl.load(peer_counters + k).to(tl.pointer_type(tl.int64)) + rank
                    tl.atomic_add(counter, cnt.to(tl.int64), sem="release", scope="sys")


@triton.jit(do_not_specialize=["max_spin", "rank", "world"])
def wait_kernel(counters, expect, state, err, max_spin, rank, world, TIMED: tl.constexpr):
    """One program: wait until every source's counter reached its target, then publish the epoch."""
    e = tl.load(state, volatile=True) + 1
    for s in range(0, world):
        inc = tl.load(expect + s)
        if inc != 0:
            target = tl.load(state + 1 + s, volatile=True) + inc
            timed_wait(counters + s, target, err, max_spin, rank, s, e, 0, True, TIMED)
            tl.store(state + 1 + s, target)
    tl.store(state, e)


@triton.jit
def publish_kernel(my_pub, my_flag, my_prefix, state, world, BLOCK_W: tl.constexpr):
    """One program: publish ``my_prefix`` (half ``epoch % 2`` of ``my_pub``), then the epoch in ``my_flag``."""
    e = tl.load(state, volatile=True) + 1
    half = (e & 1).to(tl.int64) * BLOCK_W
    w = tl.arange(0, BLOCK_W)
    wm = w < world
    tl.store(my_pub + half + w, tl.load(my_prefix + w, mask=wm, other=0), mask=wm)
    tl.debug_barrier()
    tl.atomic_xchg(my_flag, e, sem="release", scope="sys")


@triton.jit(do_not_specialize=["max_spin", "rank", "world"])
def fetch_offsets_kernel(
    my_prefix, peer_pub, peer_flags, dst_off, state, err, max_spin, rank, world, BLOCK_W: tl.constexpr,
    TIMED: tl.constexpr,
):  # fmt: skip
    """One program: our entry of every peer's published prefix, once its flag has reached the epoch (bounded
    wait): ``dst_off[p]``."""
    e = tl.load(state, volatile=True) + 1
    half = (e & 1).to(tl.int64) * BLOCK_W
    for p in range(0, world):
        if p == rank:
            tl.store(dst_off + p, tl.load(my_prefix + rank))
        else:
            flag = tl.load(peer_flags + p).to(tl.pointer_type(tl.int64))
            timed_wait(flag, e, err, max_spin, rank, p, e, 1, True, TIMED)
            pub = tl.load(peer_pub + p).to(tl.pointer_type(tl.int64))
            tl.store(dst_off + p, tl.load(pub + half + rank, volatile=True))


@triton.jit(do_not_specialize=["total", "hole_lo", "hole_hi", "parity_elems"])
def copy_kernel(out, recv, state, total, hole_lo, hole_hi, parity_elems, BLOCK: tl.constexpr):
    """``out[i] = recv[parity half][i]`` for every element but ``[hole_lo, hole_hi)``; the epoch (hence the half)
    is the one :func:`wait_kernel` published just before."""
    e = tl.load(state, volatile=True)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = (offs < total) & ((offs < hole_lo) | (offs >= hole_hi))
    v = tl.load(recv + (e & 1).to(tl.int64) * parity_elems + offs, mask=m)
    tl.store(out + offs, v, mask=m)


@triton.jit(do_not_specialize=["n", *[f"v{i}" for i in range(16)]])
def fill_kernel(dst, n, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """``dst[:n] = (v0, v1, ...)`` (n <= 16): a small table written with its values as arguments, so a CUDA graph
    captures it without host memory."""
    ty = dst.dtype.element_ty
    tl.store(dst + 0, v0.to(ty), mask=n > 0)
    tl.store(dst + 1, v1.to(ty), mask=n > 1)
    tl.store(dst + 2, v2.to(ty), mask=n > 2)
    tl.store(dst + 3, v3.to(ty), mask=n > 3)
    tl.store(dst + 4, v4.to(ty), mask=n > 4)
    tl.store(dst + 5, v5.to(ty), mask=n > 5)
    tl.store(dst + 6, v6.to(ty), mask=n > 6)
    tl.store(dst + 7, v7.to(ty), mask=n > 7)
    tl.store(dst + 8, v8.to(ty), mask=n > 8)
    tl.store(dst + 9, v9.to(ty), mask=n > 9)
    tl.store(dst + 10, v10.to(ty), mask=n > 10)
    tl.store(dst + 11, v11.to(ty), mask=n > 11)
    tl.store(dst + 12, v12.to(ty), mask=n > 12)
    tl.store(dst + 13, v13.to(ty), mask=n > 13)
    tl.store(dst + 14, v14.to(ty), mask=n > 14)
    tl.store(dst + 15, v15.to(ty), mask=n > 15)


# --- launchers ----------------------------------------------------------------------------------------------


def pool(
    tables: torch.Tensor,
    out: torch.Tensor,
    num_bags: int,
    num_tables: int,
    dim: int,
    *,
    mode: int,
    include_last_offset: bool,
    index_dtype: torch.dtype,
    offset_dtype: torch.dtype,
    variant: Variant,
    dst_off: torch.Tensor,
    src_start: torch.Tensor,
    rank: int = 0,
    world: int = 1,
    peer_data: torch.Tensor | None = None,
    peer_counters: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    parity_elems: int = 0,
    rot_segment: int | None = None,
    aligned: bool = False,
    book: torch.Tensor | None = None,
    padding_idx: int = -1,
    psw: torch.Tensor | None = None,
) -> None:
    """Launch :func:`pool_kernel`. ``tables``: int64 ``[4, T]`` (weight, indices, offsets addresses; index counts);
    ``out``: this rank's output (contiguous, the tables' dtype); ``dst_off`` int64 ``[world]``, ``src_start`` int64
    ``[world + 1]`` (see the module). With ``world > 1``: ``peer_data``/``peer_counters`` int64 ``[world]``
    (addresses of every rank's receive buffer and counter array), ``state`` (this rank's int64 ``[1 + MAX_WORLD]``),
    ``parity_elems`` (elements of a receive buffer's half). ``rot_segment``: the segment whose bag block goes
    first (None: bag 0). ``aligned``: every table's address and ``dim`` are multiples of 16 (bytes and elements),
    so are ``out``'s, every receive buffer's and ``parity_elems``: the kernel vectorizes its loads and stores.
    ``book``: int64 ``[2, T]``, every table's offset2bag and bag_size addresses (the indices' dtype, which the
    offsets share): the kernel writes each position's bag and each bag's size there, as aten's CUDA
    ``_embedding_bag`` does for its backward. ``padding_idx`` (-1: none): positions of that index pool nothing and
    count in no bag's size. ``psw``: int64 ``[T]``, every table's per-sample weights (the tables' dtype; sum
    pooling): each position's row is scaled by its weight."""
    if mode not in (0, 1):
        raise ValueError(f"embedding_bag pooling: mode {mode} (0 sum and 1 mean only)")
    signal = world > 1
    if signal and (peer_data is None or peer_counters is None or state is None):
        raise ValueError("embedding_bag pooling: several ranks need peer_data, peer_counters and state")
    if num_bags == 0 or num_tables == 0:
        return
    block_d = variant.column_block(dim)
    nb = triton.cdiv(num_bags, variant.block_b)
    rot = 0
    if rot_segment is not None:
        rot = (rot_segment // num_tables) // variant.block_b % nb
    dummy = dst_off
    pool_kernel[(nb, num_tables)](
        tables, out,
        peer_data if signal else dummy, peer_counters if signal else dummy,
        dst_off, src_start, state if signal else dummy, book if book is not None else dummy,
        psw if psw is not None else dummy,
        num_bags, num_tables, dim, parity_elems, rank, world, rot, padding_idx,
        MODE=mode, LAST=bool(include_last_offset), IDX64=index_dtype == torch.int64,
        OFF64=offset_dtype == torch.int64, SIGNAL=signal, ALIGNED=bool(aligned), BOOK=book is not None,
        PAD=padding_idx >= 0, PSW=psw is not None,
        BLOCK_B=variant.block_b, BLOCK_D=block_d, UNROLL=variant.unroll, num_warps=variant.num_warps,
    )  # fmt: skip


def wait(counters: torch.Tensor, expect: torch.Tensor, state: torch.Tensor, err: torch.Tensor, max_spin: int,
         rank: int, world: int) -> None:  # fmt: skip
    """Launch :func:`wait_kernel` (one program)."""
    wait_kernel[(1,)](counters, expect, state, err, max_spin, rank, world, TIMED=counters.is_cuda, num_warps=1)


def publish(my_pub: torch.Tensor, my_flag: torch.Tensor, my_prefix: torch.Tensor, state: torch.Tensor, world: int,
            block_w: int) -> None:  # fmt: skip
    """Launch :func:`publish_kernel` (one program); ``my_pub`` holds two halves of ``block_w`` int64."""
    publish_kernel[(1,)](my_pub, my_flag, my_prefix, state, world, BLOCK_W=block_w, num_warps=1)


def fetch_offsets(
    my_prefix: torch.Tensor, peer_pub: torch.Tensor, peer_flags: torch.Tensor, dst_off: torch.Tensor,
    state: torch.Tensor, err: torch.Tensor, max_spin: int, rank: int, world: int, block_w: int,
) -> None:  # fmt: skip
    """Launch :func:`fetch_offsets_kernel` (one program)."""
    fetch_offsets_kernel[(1,)](
        my_prefix, peer_pub, peer_flags, dst_off, state, err, max_spin, rank, world, BLOCK_W=block_w,
        TIMED=state.is_cuda, num_warps=1,
    )  # fmt: skip


def fill(t: torch.Tensor, values: tuple[int, ...]) -> None:
    """``t[:len(values)] = values`` by :func:`fill_kernel` launches (16 values each)."""
    for lo in range(0, len(values), 16):
        chunk = tuple(values[lo : lo + 16])
        fill_kernel[(1,)](t[lo:], len(chunk), *chunk, *([0] * (16 - len(chunk))), num_warps=1)


def copy_out(out: torch.Tensor, recv: torch.Tensor, state: torch.Tensor, hole: tuple[int, int], parity_elems: int) -> None:
    """Launch :func:`copy_kernel` over ``out``'s elements (``recv``: the receive buffer, both halves)."""
    total = out.numel()
    if total == 0 or (hole[0] <= 0 and hole[1] >= total):
        return
    copy_kernel[(triton.cdiv(total, COPY_BLOCK),)](
        out, recv, state, total, hole[0], hole[1], parity_elems, BLOCK=COPY_BLOCK, num_warps=4
    )


def error_message(words: list[int], what: str, rows: str = "pooled rows (its counter") -> str | None:
    """The error words in a sentence (None when no wait timed out); ``rows`` names what a peer's flag of a kind
    other than ``KIND_OFFSETS`` stands for (kernels/embedding_bag_backward.py names its own)."""
    if not words[0]:
        return None
    rank, peer, epoch, value, kind = words[1:6]
    if kind == KIND_OFFSETS:
        awaited = f"rank {peer}'s published split offsets (its flag never reached epoch {value})"
    else:
        awaited = f"rank {peer}'s {rows} never reached {value})"
    return (
        f"fluxcompile: {what}: rank {rank} timed out in call {epoch} waiting for {awaited}: is every rank running "
        "the same op in the same order?"
    )


def check_error(err: torch.Tensor, what: str) -> None:
    """Raise if a wait timed out (reads ``err``: a host synchronization when on the GPU)."""
    msg = error_message([int(x) for x in err[:ERR_WORDS].tolist()], what)
    if msg is not None:
        raise RuntimeError(msg)
