"""The embedding-bag backward whose pooled gradients are read straight from the ranks that hold them (DLRM's
model-parallel tables in training, ``fluxcompile.all_to_all_embedding_bag_backward``).

The op exchanges the pooled rows' gradients (``grad``, ``[rows, T * D]`` on every sample owner) back to the tables'
owner, ``G = all_to_all_single(grad)`` (``[B, T * D]``: row ``b`` is bag ``b``'s gradient, its table ``t`` in columns
``t * D ..``), and scatters each bag's row into its table's gradient at every index of the bag:
``weight_grad[t][indices[t][p]] += G[b, t] * scale`` for every position ``p`` of bag ``b`` (``scale`` 1, or one
over the bag's size in mean mode). Row ``b`` of ``G`` comes from source ``s`` (the chunk ``recv_start[s] <= b <
recv_start[s + 1]``), and sits in ``s``'s staged gradients at element ``src_off[s] + (b - recv_start[s]) * T * D``.

:func:`stage_kernel` copies this rank's ``grad`` into its send buffer (half ``epoch % 2`` of two);
:func:`signal_kernel` (one program) then raises this rank's ready flag to the call's epoch (release, system scope),
and :func:`wait_kernel` (one program) waits, bounded, until every peer's ready flag reached it and publishes the
epoch in ``state[0]``. Two launches, so that no launch waits for a peer's launch of the same position (the one-GPU
harness and the interpreter checks run the ranks' launches in turns).
:func:`scatter_kernel`, one program per (block of ``BLOCK_B`` bags, table), loads each bag's gradient row once
from its source's send buffer (a peer's through its P2P address) and adds it, scaled, at every index of the bag
(fp32 atomics): into the table's gradient itself when it is fp32, else into an fp32 accumulator whose touched
rows :func:`rows_kernel` zeroes before and casts into the table's gradient after (only the rows some index
reaches; the rest of the gradient is zeros). Bag blocks are visited from rank ``rank + 1``'s chunk on (rotated),
so the ranks do not all read the same peer at once. For sparse gradients (``SPARSE``) the kernel writes each
position's row of the values (``[indices, D]``: the bag's gradient row, scaled) instead: aten's sparse gradient is
these values at the indices, uncoalesced.

Why no flag says a reader is done: a source overwrites half ``e % 2`` at call ``e + 2``, after its
:func:`wait_kernel` of call ``e + 1`` saw every peer's ready flag reach ``e + 1``; a peer raises it after its
scatter of call ``e`` (stream order), which was its last read of that half. The waits sit in one-program kernels
and the scatter never waits: ranks simulated on one GPU cannot starve a peer of SMs with spinning programs.

Unequal splits: where our chunk starts in each source's send buffer comes from the source: :func:`publish_kernel`
publishes the prefix of its input splits plus this call's half (its half's size is its own: the ranks' gradients
may differ in rows), read by :func:`fetch_kernel`. With equal splits every rank holds as
many rows as it has bags, so the halves are alike and the offsets known on the host. Error words: kernels/embedding_bag.py's layout; kinds ``KIND_OFFSETS`` (its) and
``KIND_READY`` (a source's staged gradients).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import embedding_bag
from .embedding_bag import ERR_WORDS, MAX_BLOCK_D
from .waits import timed_wait

KIND_OFFSETS = embedding_bag.KIND_OFFSETS  # a receiver's published offsets (the forward's kind)
KIND_READY = 2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
COPY_BLOCK = 4096
BLOCK_B = 16
BLOCK_P = 32
NUM_WARPS = 4


@triton.jit(do_not_specialize=["total", "parity_elems"])
def stage_kernel(grad, send, state, total, parity_elems, BLOCK: tl.constexpr):
    """``send[half e % 2][i] = grad[i]`` for the call's epoch ``e`` (``state[0] + 1``)."""
    e = tl.load(state, volatile=True) + 1
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    tl.store(send + (e & 1).to(tl.int64) * parity_elems + offs, tl.load(grad + offs, mask=m), mask=m)


@triton.jit
def signal_kernel(my_ready, state):
    """One program: our ready flag to the call's epoch (after the staging, stream order; release, system scope)."""
    tl.atomic_xchg(my_ready, tl.load(state, volatile=True) + 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["max_spin", "rank", "world"])
def wait_kernel(peer_ready, state, err, max_spin, rank, world, TIMED: tl.constexpr):
    """One program: a bounded wait until every peer's ready flag reached the call's epoch, then the epoch in
    ``state[0]``."""
    e = tl.load(state, volatile=True) + 1
    for p in range(0, world):
        if p != rank:
            flag = tl.load(peer_ready + p).to(tl.pointer_type(tl.int64))
            timed_wait(flag, e, err, max_spin, rank, p, e, 2, True, TIMED)
    tl.store(state, e)


@triton.jit(do_not_specialize=["world", "parity_elems"])
def publish_kernel(my_pub, my_flag, my_prefix, state, world, parity_elems, BLOCK_W: tl.constexpr):
    """One program: where each destination's chunk starts in this call's half of our send buffer (``my_prefix`` +
    ``epoch % 2`` halves, in elements) into half ``epoch % 2`` of ``my_pub``, then the epoch in ``my_flag``
    (:func:`fetch_kernel` reads it)."""
    e = tl.load(state, volatile=True) + 1
    half = (e & 1).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    wm = w < world
    v = tl.load(my_prefix + w, mask=wm, other=0) + half * parity_elems
    tl.store(my_pub + half * BLOCK_W + w, v, mask=wm)
    tl.debug_barrier()
    tl.atomic_xchg(my_flag, e, sem="release", scope="sys")


@triton.jit(do_not_specialize=["max_spin", "rank", "world"])
def fetch_kernel(
    peer_pub, peer_flags, src_off, state, err, max_spin, rank, world, BLOCK_W: tl.constexpr, TIMED: tl.constexpr
):  # fmt: skip
    """One program: our entry of every rank's publication (ours too: stream order), once its flag has reached the
    epoch (bounded wait): ``src_off[p]``."""
    e = tl.load(state, volatile=True) + 1
    half = (e & 1).to(tl.int64) * BLOCK_W
    for p in range(0, world):
        if p != rank:
            flag = tl.load(peer_flags + p).to(tl.pointer_type(tl.int64))
            timed_wait(flag, e, err, max_spin, rank, p, e, 1, True, TIMED)
        pub = tl.load(peer_pub + p).to(tl.pointer_type(tl.int64))
        tl.store(src_off + p, tl.load(pub + half + rank, volatile=True))


@triton.jit(do_not_specialize=["B", "T", "TD", "parity_elems", "world", "rot", "pad"])
def scatter_kernel(
    tables, dst, like, peer_send, src_off, recv_start, state, psw, freq, B, T, D, TD, parity_elems, world, rot, pad,
    MODE: tl.constexpr, IDX64: tl.constexpr, OFF64: tl.constexpr, SIZE64: tl.constexpr, ABS: tl.constexpr,
    SPARSE: tl.constexpr, PSW: tl.constexpr, PGRAD: tl.constexpr, FREQ: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Every (block of bags, table): the bags' gradient rows from their sources, added at the bags' indices into
    ``dst[t]`` (fp32). ``tables`` int64 ``[5, T]``: indices, offsets and bag-size addresses, index and offset
    counts; ``dst`` int64 ``[T]``: fp32 destinations (a table's gradient or its accumulator); ``like``: any
    tensor of the gradients' dtype (only its type is read); ``peer_send`` int64 ``[world]``: every source's send
    buffer; ``src_off`` int64 ``[world]``: our chunk's element offset in its half (``ABS``: in the buffer, the half
    included, as :func:`publish_kernel` publishes it); ``recv_start`` int64 ``[world]``: the
    first bag of each source's chunk. ``psw`` int64 ``[3, T]``: every table's per-sample weights (``PSW``: each
    position's contribution scaled by its weight), its table and its per-sample weights' gradient (``PGRAD``: each
    position's gradient row dotted with its table row, one column block holding the whole dim). ``freq`` int64
    ``[T]`` (``FREQ``, scale_grad_by_freq): every table's fp32 count of each index in its indices; each add is
    divided by its index's count."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    nb = tl.num_programs(0)
    blk = (pid + rot) % nb
    bags = blk * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = bags < B
    dtype = like.dtype.element_ty

    if IDX64:
        i_ptr = tl.load(tables + t).to(tl.pointer_type(tl.int64))
    else:
        i_ptr = tl.load(tables + t).to(tl.pointer_type(tl.int32))
    if OFF64:
        o_ptr = tl.load(tables + T + t).to(tl.pointer_type(tl.int64))
    else:
        o_ptr = tl.load(tables + T + t).to(tl.pointer_type(tl.int32))
    n_idx = tl.load(tables + 3 * T + t)
    n_off = tl.load(tables + 4 * T + t)
    if SPARSE:  # each position's row of the sparse gradient's values, in the gradients' dtype
        out = tl.load(dst + t).to(tl.pointer_type(like.dtype.element_ty))
    else:
        out = tl.load(dst + t).to(tl.pointer_type(tl.float32))
    if PSW:
        p_ptr = tl.load(psw + t).to(tl.pointer_type(dtype))
    if FREQ:
        f_ptr = tl.load(freq + t).to(tl.pointer_type(tl.float32))
    if PGRAD:
        w_ptr = tl.load(psw + T + t).to(tl.pointer_type(dtype))
        pg_ptr = tl.load(psw + 2 * T + t).to(tl.pointer_type(dtype))

    start = tl.load(o_ptr + bags, mask=bmask, other=0).to(tl.int64)
    nxt = bags + 1
    end = tl.load(o_ptr + nxt, mask=bmask & (nxt < n_off), other=0).to(tl.int64)
    end = tl.where(nxt < n_off, end, n_idx)
    lens = tl.where(bmask, tl.maximum(end - start, 0), 0)
    max_len = tl.max(lens, axis=0).to(tl.int32)
    if MODE == 1:
        if SIZE64:
            s_ptr = tl.load(tables + 2 * T + t).to(tl.pointer_type(tl.int64))
        else:
            s_ptr = tl.load(tables + 2 * T + t).to(tl.pointer_type(tl.int32))
        size = tl.load(s_ptr + bags, mask=bmask, other=1)
        scale = 1.0 / tl.maximum(size, 1).to(tl.float32)

    # Each bag's source and the address of its gradient row there (half e % 2 of the source's send buffer).
    s = tl.zeros((BLOCK_B,), dtype=tl.int32)
    for k in range(1, world):
        s += (bags >= tl.load(recv_start + k)).to(tl.int32)
    e = tl.load(state, volatile=True)
    base = tl.load(peer_send + s, mask=bmask, other=0).to(tl.pointer_type(dtype))
    row = base + tl.load(src_off + s, mask=bmask, other=0)
    if not ABS:
        row += (e & 1).to(tl.int64) * parity_elems
    row += (bags - tl.load(recv_start + s, mask=bmask, other=0)).to(tl.int64) * TD + t * D

    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        m2 = bmask[:, None] & cmask[None, :]
        g = tl.load(row[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if MODE == 1:
            g = g * scale[:, None]
        for j in range(0, max_len):
            pm = j < lens
            gj = g
            if PSW:
                gj = g * tl.load(p_ptr + start + j, mask=pm, other=0.0).to(tl.float32)[:, None]
            if SPARSE:
                m = pm[:, None] & cmask[None, :]
                tl.store(out + (start + j)[:, None] * D + cols[None, :], gj.to(dtype), mask=m)
            if (not SPARSE) or PGRAD:
                idx = tl.load(i_ptr + start + j, mask=pm, other=0).to(tl.int64)
                live = pm & (idx != pad)  # the padding index gets no gradient
                m = live[:, None] & cmask[None, :]
                if not SPARSE:
                    if FREQ:  # scale_grad_by_freq: by how often the index occurs in the table's indices
                        gj = gj / tl.load(f_ptr + idx, mask=live, other=1.0)[:, None]
                    tl.atomic_add(out + idx[:, None] * D + cols[None, :], gj, mask=m, sem="relaxed")
                if PGRAD:  # d loss / d weight[p] = <gradient row of p's bag, table row at p's index>
                    wrow = tl.load(w_ptr + idx[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
                    tl.store(pg_ptr + start + j, tl.sum(g * wrow, axis=1).to(dtype), mask=pm)


@triton.jit(do_not_specialize=["T"])
def rows_kernel(
    tables, acc, grads, like, T, D, CAST: tl.constexpr, IDX64: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """Every (block of index positions, table): the accumulator's rows at those indices zeroed (``CAST`` False),
    or cast into the table's gradient (``CAST`` True). ``tables`` as :func:`scatter_kernel`'s; ``acc`` int64
    ``[T]``: fp32 accumulator addresses; ``grads`` int64 ``[T]``: the gradients' addresses, of ``like``'s dtype."""
    t = tl.program_id(1)
    n_idx = tl.load(tables + 3 * T + t)
    pos = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = pos < n_idx
    if IDX64:
        i_ptr = tl.load(tables + t).to(tl.pointer_type(tl.int64))
    else:
        i_ptr = tl.load(tables + t).to(tl.pointer_type(tl.int32))
    idx = tl.load(i_ptr + pos, mask=pm, other=0).to(tl.int64)
    a = tl.load(acc + t).to(tl.pointer_type(tl.float32)) + idx[:, None] * D
    out_ty = like.dtype.element_ty
    out = tl.load(grads + t).to(tl.pointer_type(out_ty))
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m2 = pm[:, None] & (cols < D)[None, :]
        if CAST:
            v = tl.load(a + cols[None, :], mask=m2, other=0.0)
            tl.store(out + idx[:, None] * D + cols[None, :], v.to(out_ty), mask=m2)
        else:
            tl.store(a + cols[None, :], tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32), mask=m2)


# --- launchers ----------------------------------------------------------------------------------------------


def column_block(dim: int) -> int:
    return min(triton.next_power_of_2(dim), MAX_BLOCK_D)


def stage(grad: torch.Tensor, send: torch.Tensor, state: torch.Tensor, parity_elems: int) -> None:
    """Launch :func:`stage_kernel`: ``grad`` (contiguous) into half ``epoch % 2`` of ``send`` (both halves)."""
    total = grad.numel()
    if total:
        stage_kernel[(triton.cdiv(total, COPY_BLOCK),)](grad, send, state, total, parity_elems, BLOCK=COPY_BLOCK,
                                                        num_warps=4)  # fmt: skip


def publish(my_pub: torch.Tensor, my_flag: torch.Tensor, my_prefix: torch.Tensor, state: torch.Tensor, world: int,
            parity_elems: int, block_w: int) -> None:  # fmt: skip
    """Launch :func:`publish_kernel` (one program); ``my_pub`` holds two halves of ``block_w`` int64."""
    publish_kernel[(1,)](my_pub, my_flag, my_prefix, state, world, parity_elems, BLOCK_W=block_w, num_warps=1)


def fetch(peer_pub: torch.Tensor, peer_flags: torch.Tensor, src_off: torch.Tensor, state: torch.Tensor,
          err: torch.Tensor, max_spin: int, rank: int, world: int, block_w: int) -> None:  # fmt: skip
    """Launch :func:`fetch_kernel` (one program)."""
    fetch_kernel[(1,)](peer_pub, peer_flags, src_off, state, err, max_spin, rank, world, BLOCK_W=block_w,
                       TIMED=state.is_cuda, num_warps=1)  # fmt: skip


def signal(my_ready: torch.Tensor, state: torch.Tensor) -> None:
    """Launch :func:`signal_kernel` (one program); ``my_ready``: this rank's ready flag (int64)."""
    signal_kernel[(1,)](my_ready, state, num_warps=1)


def wait(peer_ready: torch.Tensor, state: torch.Tensor, err: torch.Tensor, max_spin: int, rank: int,
         world: int) -> None:  # fmt: skip
    """Launch :func:`wait_kernel` (one program); ``peer_ready`` int64 ``[world]``: every rank's ready flag."""
    wait_kernel[(1,)](peer_ready, state, err, max_spin, rank, world, TIMED=state.is_cuda, num_warps=1)


def scatter(
    tables: torch.Tensor, dst: torch.Tensor, like: torch.Tensor, num_bags: int, num_tables: int, dim: int, *,
    mode: int, index_dtype: torch.dtype, offset_dtype: torch.dtype, size_dtype: torch.dtype = torch.int64,
    peer_send: torch.Tensor, src_off: torch.Tensor,
    recv_start: torch.Tensor, state: torch.Tensor, parity_elems: int, row_elems: int, world: int,
    rot_bag: int = 0, absolute: bool = False, padding_idx: int = -1, sparse: bool = False,
    psw: torch.Tensor | None = None, pgrad: bool = False, freq: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Launch :func:`scatter_kernel` over ``num_bags`` bags of ``num_tables`` tables; ``row_elems``: elements of a
    gradient row (``T * D``); ``rot_bag``: the bag whose block goes first; ``absolute``: ``src_off`` includes the
    half (published by :func:`publish`); ``padding_idx`` (-1: none): that index gets no gradient; ``sparse``:
    ``dst`` holds every table's values (``[indices, D]``, the gradients' dtype), each position's row written (its
    bag's gradient, scaled) instead of added at its index; ``psw``: int64 ``[3, T]`` (per-sample weights, tables,
    the per-sample weights' gradients), ``pgrad``: write those gradients (``dim`` at most ``MAX_BLOCK_D``);
    ``freq``: int64 ``[T]``, every table's fp32 index counts (scale_grad_by_freq, dense gradients only)."""
    if freq is not None and sparse:
        raise ValueError("embedding_bag backward: scale_grad_by_freq with sparse gradients (aten has neither)")
    if pgrad and dim > MAX_BLOCK_D:
        raise ValueError(f"embedding_bag backward: per-sample weights' gradients of dim {dim} > {MAX_BLOCK_D}")
    if mode not in (0, 1):
        raise ValueError(f"embedding_bag backward: mode {mode} (0 sum and 1 mean only)")
    if num_bags == 0 or num_tables == 0:
        return
    nb = triton.cdiv(num_bags, BLOCK_B)
    scatter_kernel[(nb, num_tables)](
        tables, dst, like, peer_send, src_off, recv_start, state, psw if psw is not None else state,
        freq if freq is not None else state, num_bags, num_tables, dim, row_elems,
        parity_elems, world, (rot_bag // BLOCK_B) % nb, padding_idx,
        MODE=mode, IDX64=index_dtype == torch.int64, OFF64=offset_dtype == torch.int64,
        SIZE64=size_dtype == torch.int64, ABS=bool(absolute), SPARSE=bool(sparse), PSW=psw is not None,
        PGRAD=bool(pgrad), FREQ=freq is not None,
        BLOCK_B=BLOCK_B,
        BLOCK_D=column_block(dim), num_warps=NUM_WARPS,
    )  # fmt: skip


def rows(tables: torch.Tensor, acc: torch.Tensor, grads: torch.Tensor, like: torch.Tensor, max_indices: int,
         num_tables: int, dim: int, *, cast: bool, index_dtype: torch.dtype) -> None:  # fmt: skip
    """Launch :func:`rows_kernel`: zero the accumulators' indexed rows, or (``cast``) cast them into the
    gradients; ``max_indices``: the largest index count of the tables."""
    if max_indices == 0 or num_tables == 0:
        return
    rows_kernel[(triton.cdiv(max_indices, BLOCK_P), num_tables)](
        tables, acc, grads, like, num_tables, dim, CAST=cast, IDX64=index_dtype == torch.int64, BLOCK_P=BLOCK_P,
        BLOCK_D=column_block(dim), num_warps=NUM_WARPS,
    )  # fmt: skip


def error_message(words: list[int], what: str) -> str | None:
    """The error words in a sentence (None when no wait timed out): a wait on a peer's ready flag (the P2P form)
    or on its arrival counter (the put form, kernels/embedding_bag.py's wait, ``KIND_ROWS``)."""
    if words[5] == embedding_bag.KIND_ROWS:
        return embedding_bag.error_message(words, what, rows="put gradient rows (its arrival counter")
    return embedding_bag.error_message(words, what, rows="staged gradients (its ready flag")


def check_error(err: torch.Tensor, what: str) -> None:
    """Raise if a wait timed out (reads ``err``: a host synchronization when on the GPU)."""
    msg = error_message([int(x) for x in err[:ERR_WORDS].tolist()], what)
    if msg is not None:
        raise RuntimeError(msg)
