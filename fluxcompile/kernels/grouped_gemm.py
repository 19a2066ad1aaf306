"""Grouped GEMM (MoE experts) as one persistent Triton kernel, with the all-to-all of the MoE dispatch and combine
built into it: the dispatch pulls its rows from the peers' send buffers, the combine scatters its rows into the
peers' receive buffers. lowerings/all_to_all/triton.py runs the per-rank protocols around it.

The GEMM
--------
``outs[w][rows of group g] = X[rows of group g] @ Bs[w][g]`` for up to ``MAX_WEIGHTS`` weights ``[E, K, N_w]``
sharing ``X`` (w1 and w3 of a SwiGLU expert). Groups are ``torch._grouped_mm``'s: ends ``offs`` (int32 ``[E]``, read
on the device; no host synchronization), or equal groups of ``R / E`` rows (``torch.bmm``). Rows after the last
group end are not computed (grouped_mm leaves them unspecified). ``X`` is ``a`` itself, or its rows picked through
``row_index`` (``X[j] = a[row_index[j]]``; an index outside ``[0, len(a))``, torchtitan's padding index
``len(a)`` included, reads a zero row).

Tiles: one launch multiplies one weight, or two that share every A tile (two accumulators in one mainloop: w1
and w3, each with half the variant's BLOCK_N, so registers and shared memory are the variant's); a third weight
is a second launch. (One mainloop per weight in one kernel would add up their pipelines' shared memory.) A program
walks the groups (their ends loaded on the device, as Triton's grouped-GEMM tutorial does) and takes every
``num_progs``-th tile; inside a group, Flux's grouped swizzle (``GROUP_M`` row blocks sweep the N blocks) keeps
the A rows and weight columns of neighbouring tiles in L2. A tile's rows may run into the next group (it loads
them, they are masked out): output tiles store only rows of their own group. The weights are read through TMA
(Hopper tensor descriptors over ``[E * K, N]``, or ``[E * N, K]`` for a weight stored ``[E, N, K]`` and
transposed; made once per program), ``a`` through TMA when its rows are neither gathered nor written by this
launch (TMA reads through the async proxy, which a generic store of another program is not ordered with),
otherwise through pointer loads (cp.async); masks handle ragged groups, K and N.

The dispatch's pull (``Pull``)
------------------------------
The exchanged rows ``A_exchanged`` (rows ``[source rank][...]``, as ``all_to_all_single`` returns them) are
read from every source's symmetric send buffer, which holds that rank's ``A``: source ``s`` has published into
this rank's flag words ``info[s] = (offset, count)`` (where this rank's rows start in its send buffer, and how
many), then ``ready[s] = epoch`` (release). A program bounded-waits (acquire) for every source's ``ready``, then
its *copy tiles* (``COPY_M`` exchanged rows each; a row's source is found from the published counts; the local
rank's rows come straight from ``A``) copy rows from the peers (peer-to-peer loads) into ``A_exchanged``, the op's
first output, in place; a rank's copy tiles start at its own rows, then rank + 1's, ..., so the ranks do not all
read from rank 0 at once. The GEMM then reads ``A_exchanged`` from local memory (gathered through ``row_index``):
a weight's column blocks would each re-read the A rows, and reads of a peer's memory are not cached in this
GPU's L2. Two ways to run it:
* fused (``gemm=True``): the copy tiles come first in every program's order, each adds its rows per source to
  local counters (``arrived[s]``, release); a GEMM tile bounded-waits (acquire) until every source its rows come
  from has all its rows (``arrived[s] >= count``), so the GEMM starts while the last rows are still in flight.
  This needs every program resident (at most one per SM, nothing else filling the GPU).
* ordered (``copiers`` > 0), Flux's tile order: a few programs copy, the peers' rows first (rank + 1's on) and
  this rank's own last, while the others run the GEMM tiles in the order the rows arrive: every group's rows of
  this rank (read from ``A`` itself: no wait), then every group's rows of rank + 1, ... (segments found by a binary
  search over ``row_index``, written by program 0 into the flag words; tiles never cross a segment), every program
  taking the next tile from a counter, the copying ones too once they have copied. All programs work on the same
  group at a time (its weights shared in L2), and the GEMM overlaps the pull.
* split (``gemm=False``): a launch of copy tiles only; the GEMM is a second launch (A through TMA where no
  ``row_index`` gathers it).
The last program to finish (a counter in the flag words) resets the counters and tells every source
``done[me] = epoch`` (release): its send buffer may be overwritten by its next call.

The combine's scatter (``Scatter``)
-----------------------------------
Every output row ``j`` goes to its final position: row ``i = row_index[j]`` (or ``j``) of ``Y``, dropped when
``i`` is outside ``[0, y_rows)`` (the padding index), belongs to destination ``d`` whose range of ``Y`` holds it;
``d`` has published ``info[d] = (offset, count)`` (where this rank's rows start in its receive buffer, how many)
and ``ready[d] = epoch`` once its buffer is ready (zeroed where needed). Before its first store a program waits
for every destination's ``ready``; the epilogue stores each row at ``offset + i - start`` of ``d``'s receive
buffer (peer-to-peer stores), or with ``accumulate`` atomically adds it there in fp32 (the receive buffers are
then fp32). The last program to finish writes ``done[me] = epoch`` (release) into every destination's flags:
everything this rank sends has landed. A counter of rows would not do: ``row_index`` may drop or repeat rows.

Waits and errors
----------------
Every wait is :func:`kernels.waits.timed_wait` (``bounded_wait`` bounded by the GPU's timer): after ``max_spin``
microseconds (polls under the interpreter) it records (rank, peer, tile, awaited value, kind) in ``err``
(``ERR_WORDS`` int32) and the launch's other waits give up at once; tiles whose data
never came are skipped, never read from unpublished addresses. :func:`check_error` raises naming the rank and
the signal (``WAIT_KINDS``). Epochs: ``state[0]`` (this rank's flag words) counts the calls; :func:`publish`
increments it, so flags only grow, are never reset across ranks, and CUDA graph replays advance them.

Flag words (int32, one array per rank and per op, in symmetric memory): ``ready[64]``, ``info[64][2]``,
``done[64]`` (written by peers), ``arrived[64]``, ``scratch[64]``, ``state[8]``, the segment table (this rank's
own).

Checked on CPU with Triton's interpreter (tests/test_moe_kernels.py: ragged and empty groups, gather with
padding, several weights, both weight layouts, TMA, the pull and the scatter against ``ops`` references, waits
that time out) and compiled for sm_90 (wgmma, TMA, shared memory); on GPUs by tests/gpu/test_moe_ranks.py and
benchmarks/moe.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import tma_scratch
from .waits import record_error, timed_wait

MAX_WEIGHTS = 3
MAX_WORLD = 64
ERR_WORDS = 8  # code, rank, peer, tile, awaited value, kind

# Flag words of one rank (int32 offsets).
READY = 0
INFO = MAX_WORLD
DONE = 3 * MAX_WORLD
ARRIVED = 4 * MAX_WORLD
SCRATCH = 5 * MAX_WORLD
STATE = 6 * MAX_WORLD  # [0] epoch, [1] segment table of this epoch, [2] programs finished, [3] next tile (ordered)
TABLE = 6 * MAX_WORLD + 8  # the ordered dispatch's segment table (written before it is read)
FLAG_BYTES = 4096
FLAG_WORDS = FLAG_BYTES // 4
TABLE_WORDS = FLAG_WORDS - TABLE

_READY = tl.constexpr(READY)
_INFO = tl.constexpr(INFO)
_DONE = tl.constexpr(DONE)
_ARRIVED = tl.constexpr(ARRIVED)
_SCRATCH = tl.constexpr(SCRATCH)
_STATE = tl.constexpr(STATE)
_TABLE = tl.constexpr(TABLE)

WAIT_KINDS = {
    1: ("ready flag", "its rows in its send buffer (dispatch)"),
    2: ("arrival counter", "its rows copied into this rank's exchanged rows (dispatch)"),
    3: ("done flag", "it to finish reading this rank's send buffer (dispatch)"),
    4: ("ready flag", "its receive buffer (combine)"),
    5: ("done flag", "its rows delivered into this rank's receive buffer (combine)"),
    6: ("published splits", "the split sizes every rank published (they disagree with this rank's)"),
    7: ("segment table", "its program 0 to write the ordered dispatch's segments (this rank's own)"),
    8: ("block flag", "its permuted pull to land a block of the experts' rows (the CUTLASS dispatch's GEMM)"),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One tile configuration offered to the autotuner and the benchmark."""

    block: tuple[int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    tma: bool = True  # weights (and ungathered A) through TMA where their layout allows
    # Persistent programs per SM in launches that wait for nothing (the GEMM alone, the split dispatch's GEMM):
    # two hide each other's tile prologue and epilogue where two fit on an SM (tests/test_moe_kernels.py checks
    # shared memory and registers). Launches that wait run one per SM (every program resident).
    per_sm: int = 1

    @property
    def name(self) -> str:
        bm, bn, bk = self.block
        return f"{bm}x{bn}x{bk}-w{self.num_warps}s{self.num_stages}" + (f"x{self.per_sm}" if self.per_sm > 1 else "")


# A weight's column block is BLOCK_N, or BLOCK_N / 2 where two weights share the A tiles, at most 128
# (launch_block): 256 through TMA computed wrong results under Triton 3.6 (BENCHMARKS.md, the AG-GEMM kernel).
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant((128, 128, 64), num_warps=8, num_stages=4),
        Variant((128, 256, 64), num_warps=8, num_stages=3),
        Variant((128, 128, 64), num_warps=4, num_stages=4),
        Variant((256, 128, 64), num_warps=8, num_stages=3),
        Variant((128, 64, 64), num_warps=4, num_stages=4),
        Variant((64, 128, 64), num_warps=4, num_stages=5),
        Variant((128, 128, 64), num_warps=8, num_stages=3, per_sm=2),
        Variant((128, 128, 64), num_warps=4, num_stages=3, per_sm=2),
    )
}
DEFAULT = "128x128x64-w8s4"

COPY_M = 32  # rows of a copy tile (pull)
COPY_K = 256  # columns per copy step
COPIER_K = 512  # columns per copy step where a few programs copy (more bytes in flight per program)
PERMUTED_K = 1024  # columns per copy step of the permuted pull: one program per SM, 16 warps, 64 KiB in flight
PERMUTED_WARPS = 16


@dataclasses.dataclass
class Signals:
    """One rank's signals for a launch: its flag words (``my_flags``, int32 ``[FLAG_WORDS]``), every rank's flag
    words as addresses seen from here (``peer_flags``, int64 ``[world]``), the error words (int32
    ``[ERR_WORDS]``) and the bound of every wait, ``max_spin``: microseconds of the GPU's timer (polls under
    Triton's interpreter, which has no timer)."""

    my_flags: torch.Tensor
    peer_flags: torch.Tensor
    err: torch.Tensor
    rank: int
    world: int
    max_spin: int = 60_000_000


@dataclasses.dataclass
class Pull:
    """The dispatch's copy phase: ``a_local`` this rank's rows (contiguous ``[rows, K]``, the local source),
    ``src_bases`` (int64 ``[world]``) every rank's send buffer as an address seen from here, ``a_out`` the
    exchanged rows (contiguous, ``rows`` x K, written here), ``rows`` their number."""

    a_local: torch.Tensor
    src_bases: torch.Tensor
    a_out: torch.Tensor
    rows: int


@dataclasses.dataclass
class Scatter:
    """The combine's epilogue: ``dst_bases`` (int64 ``[world]``) every rank's receive buffer (rows of N elements,
    the output's dtype, or fp32 with ``accumulate``), ``y_rows`` the rows of Y (an index outside ``[0, y_rows)``
    is dropped)."""

    dst_bases: torch.Tensor
    y_rows: int
    accumulate: bool = False


# --- device helpers ---------------------------------------------------------------------------------------


@triton.jit
def _locate(rows, table, world):
    """Which published range holds each of ``rows`` (int32): (rank, start of its range); rank == world past the
    last range. ``table`` holds (offset, count) int32 pairs per rank (written by the peers: read through L2);
    ranges follow each other in rank order."""
    who = tl.zeros_like(rows)
    start = tl.zeros_like(rows)
    lo = tl.full((), 0, tl.int32)
    for s in range(world):
        end = lo + tl.load(table + 2 * s + 1, cache_modifier=".cg")
        past = rows >= end
        who += past.to(tl.int32)
        start = tl.where(past, end, start)
        lo = end
    return who, start


@triton.jit
def _wait_all(my_flags, slot, e, err, max_spin, rank, world, kind, SKIP_SELF: tl.constexpr, TIMED: tl.constexpr):
    """Bounded waits until ``my_flags[slot + s] - e >= 0`` for every rank s (not this one with ``SKIP_SELF``);
    1 if all passed."""
    ok = tl.full((), 1, tl.int32)
    for s in range(world):
        want = ok != 0
        if SKIP_SELF:
            want = want & (s != rank)
        if want:
            ok = timed_wait(my_flags + slot + s, e, err, max_spin, rank, s, -1, kind, True, TIMED).to(tl.int32)
    return ok


@triton.jit
def _tell_done(peer_flags, rank, world, e, SKIP_SELF: tl.constexpr):
    """``done[rank] = e`` (release) in every rank's flag words (not this rank's own with ``SKIP_SELF``)."""
    for p in range(world):
        if not SKIP_SELF or p != rank:
            pf = tl.load(peer_flags + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(pf + _DONE + rank, e, sem="release", scope="sys")


@triton.jit
def _copy_rows(ex, ok, out_rows, out_ok, out, local_addr, src_bases, my_flags, K, rank, world,
               ALIGN: tl.constexpr, COPY_K: tl.constexpr, ZERO_FILL: tl.constexpr):  # fmt: skip
    """Exchanged rows ``ex`` (where ``ok`` and a published range holds them) read from their sources' send buffers
    (this rank's own from ``local_addr``) into rows ``out_rows`` of ``out`` (where ``out_ok``; with ``ZERO_FILL``
    rows not read store zeros, else nothing): (the source of each row, whether it was read)."""
    dtype = out.dtype.element_ty
    who, start = _locate(ex, my_flags + _INFO, world)
    ok = ok & (who < world)
    src = tl.minimum(who, world - 1)
    offset = tl.load(my_flags + _INFO + 2 * src, mask=ok, other=0, cache_modifier=".cg")
    base = tl.load(src_bases + src, mask=ok, other=0)
    base = tl.where(src == rank, local_addr, base)
    src_row = (offset + ex - start).to(tl.int64)
    row_ptr = tl.multiple_of(base.to(tl.pointer_type(dtype)) + src_row * K, ALIGN)
    out_row = out_rows.to(tl.int64) * K
    for k0 in range(0, K, COPY_K):
        ks = k0 + tl.arange(0, COPY_K)
        in_k = ks[None, :] < K
        x = tl.load(row_ptr[:, None] + ks[None, :], mask=ok[:, None] & in_k, other=0.0, cache_modifier=".cg")
        stored = out_ok if ZERO_FILL else out_ok & ok
        tl.store(out + out_row[:, None] + ks[None, :], x, mask=stored[:, None] & in_k)
    return who, ok


@triton.jit
def _pull_tile(
    t, local_addr, src_bases, a_out, my_flags, n_rows, K, rank, world,
    COUNT: tl.constexpr, ALIGN: tl.constexpr, COPY_M: tl.constexpr, COPY_K: tl.constexpr,
):  # fmt: skip
    """Copy exchanged rows t * COPY_M.. from their sources into ``a_out``; with COUNT, add them to the sources'
    arrival counters afterwards."""
    rows = t * COPY_M + tl.arange(0, COPY_M)
    valid = rows < n_rows
    who, valid = _copy_rows(rows, valid, rows, valid, a_out, local_addr, src_bases, my_flags, K, rank, world,
                            ALIGN, COPY_K, False)  # fmt: skip
    if COUNT:
        tl.debug_barrier()  # every thread's stores before the counters' (cumulative) release
        for s in range(world):
            n_s = tl.sum(((who == s) & valid).to(tl.int32), axis=0)
            if n_s > 0:
                tl.atomic_add(my_flags + _ARRIVED + s, n_s, sem="release", scope="gpu")


@triton.jit
def _max(x, y):
    return tl.maximum(x, y)


@triton.jit
def _gathered(row_index, j, mask, n_a):
    """(ok, rows): the rows of ``a`` that ``row_index[j]`` picks (int32, 0 where not ok); an index outside
    ``[0, n_a)`` (torchtitan's padding index ``n_a`` and torch's -1 included) or a masked ``j`` picks none."""
    idx = tl.load(row_index + j, mask=mask, other=n_a).to(tl.int64)
    idx = tl.where(idx < 0, idx + n_a + 1, idx)  # torch's negative indices (-1: the padding row)
    ok = (idx >= 0) & (idx < n_a)
    return ok, tl.where(ok, idx, 0).to(tl.int32)


@triton.jit
def _segments(
    table, row_index, offs, my_flags, n_a, R, E, group_rows, world,
    HAS_OFFS: tl.constexpr, GATHER: tl.constexpr, E_BLOCK: tl.constexpr, W_BLOCK: tl.constexpr,
):  # fmt: skip
    """The ordered dispatch's segments: ``table[g * (world + 1) + s]`` is where source s's rows start in group g
    (its first row from s or a later source, by a binary search over the group's rows, which come in source order
    as a [source][expert] -> [expert][source] permutation leaves them), and the group's end for s = world. Rows in
    another order still fall into some segment (bounds never decrease): every order is computed right, rows in
    source order overlap best. One lane per (group, source), all searched at once."""
    lanes = tl.arange(0, E_BLOCK * W_BLOCK)
    g = lanes // W_BLOCK
    s = lanes % W_BLOCK
    in_g = g < E
    if HAS_OFFS:  # the kernel's clamping: lo = the previous groups' largest end, hi = max(end, lo), both <= R
        end = tl.load(offs + g, mask=in_g, other=0).to(tl.int32)
        prev = tl.load(offs + g - 1, mask=in_g & (g > 0), other=0).to(tl.int32)
        hi = tl.minimum(tl.associative_scan(end, 0, _max), R)
        lo = tl.minimum(tl.associative_scan(prev, 0, _max), R)
    else:
        lo = g * group_rows
        hi = lo + group_rows
    first = lo
    last = hi
    while tl.max(last - first, axis=0) > 0:
        live = first < last
        mid = (first + last) // 2
        if GATHER:
            ok, rows = _gathered(row_index, mid, live & in_g, n_a)
        else:
            ok = mid < n_a
            rows = mid
        who, _ = _locate(rows, my_flags + _INFO, world)
        who = tl.where(ok, who, world)  # rows of no source (padding) go last
        last = tl.where(live & (who >= s), mid, last)
        first = tl.where(live & (who < s), mid + 1, first)
    first = tl.associative_scan(tl.where(s >= world, hi, first), 0, _max)
    tl.store(table + g * (world + 1) + s, first, mask=in_g & (s <= world))


@triton.jit
def _b_tile(b_ptrs, b_desc, g, col0, k0, ks, K, width, sbk, offs_n,
            B_TMA: tl.constexpr, B_T: tl.constexpr):  # fmt: skip
    if B_TMA:
        if B_T:  # the weight is stored [E, N, K]: rows g * N + col0.. of its [E * N, K] view
            t = b_desc.load([g * width + col0, k0]).T
        else:  # [E * K, N]: rows g * K + k0.. (K is a multiple of BLOCK_K: no row of the next expert)
            t = b_desc.load([g * K + k0, col0])
    else:
        t = tl.load(b_ptrs + ks[:, None] * sbk, mask=(ks[:, None] < K) & (offs_n[None, :] < width), other=0.0)
    return t


@triton.jit
def _mma(
    a, a_desc, a_off, a_ok, b0, d0, b1, d1, g, row0, col0, K, n0, n1, stride_ak,
    sbe0, sbk0, sbn0, sbe1, sbk1, sbn1,
    DUAL: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_T: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The fp32 [BLOCK_M, BLOCK_N] products of the tile's A rows (``a + a_off``, zero where not ``a_ok``;
    with A_TMA rows row0.. through ``a_desc``) and columns col0.. of expert ``g`` of the weight(s): one mainloop,
    with DUAL two accumulators sharing each A tile (w1 and w3). Returns (acc0, acc1); acc1 is acc0 unless DUAL."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    gl = tl.full((), 0, tl.int64) + g
    a_ptrs = a + a_off[:, None]
    b0_ptrs = b0 + gl * sbe0 + offs_n[None, :] * sbn0
    b1_ptrs = b1 + gl * sbe1 + offs_n[None, :] * sbn1
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if A_TMA:
            a_tile = a_desc.load([row0, k0])
        else:
            a_tile = tl.load(a_ptrs + ks[None, :] * stride_ak, mask=a_ok[:, None] & (ks[None, :] < K), other=0.0)
        t0 = _b_tile(b0_ptrs, d0, g, col0, k0, ks, K, n0, sbk0, offs_n, B_TMA, B_T)
        if IEEE:
            acc0 = tl.dot(a_tile, t0, acc0, input_precision="ieee")
        else:
            acc0 = tl.dot(a_tile, t0, acc0)
        if DUAL:
            t1 = _b_tile(b1_ptrs, d1, g, col0, k0, ks, K, n1, sbk1, offs_n, B_TMA, B_T)
            if IEEE:
                acc1 = tl.dot(a_tile, t1, acc1, input_precision="ieee")
            else:
                acc1 = tl.dot(a_tile, t1, acc1)
    if not DUAL:
        acc1 = acc0
    return acc0, acc1


@triton.jit
def _b_desc(b, E, K, width, sbk, sbn, B_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if B_T:
        d = tl.make_tensor_descriptor(b, [E * width, K], [sbn, 1], [BLOCK_N, BLOCK_K])
    else:
        d = tl.make_tensor_descriptor(b, [E * K, width], [sbk, 1], [BLOCK_K, BLOCK_N])
    return d


# Sizes, ranks and addresses are not value-specialized: one compiled kernel serves every call of a shape family.
@triton.jit(
    do_not_specialize=[
        "R", "n_a", "group_rows", "n_pull", "y_rows", "rank", "world", "max_spin", "num_progs", "local_addr",
        "local_delta", "copiers",
    ]
)  # fmt: skip
def grouped_gemm_kernel(
    a, row_index, offs, b0, b1, c0, c1,
    local_addr, local_delta, src_bases, a_out, dst_bases, my_flags, peer_flags, err,
    R, n_a, K, n0, n1, n_tiles, E, group_rows,
    stride_am, stride_ak, sbe0, sbe1, sbk0, sbk1, sbn0, sbn1,
    n_pull, y_rows, rank, world, max_spin, num_progs, copiers,
    HAS_OFFS: tl.constexpr, GATHER: tl.constexpr, Y_INDEX: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_T: tl.constexpr,
    DUAL: tl.constexpr, PULL: tl.constexpr, GEMM: tl.constexpr, SCATTER: tl.constexpr, ORDERED: tl.constexpr,
    ACCUMULATE: tl.constexpr, IEEE: tl.constexpr, ALIGN: tl.constexpr, ROW_ALIGN: tl.constexpr,
    TIMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    COPY_M: tl.constexpr, COPY_K: tl.constexpr, E_BLOCK: tl.constexpr, W_BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    e_call = tl.full((), 0, tl.int32)
    if PULL or SCATTER:
        e_call = tl.load(my_flags + _STATE, volatile=True)  # this call's epoch (publish() advanced it)

    # --- the dispatch's copy tiles: every source's rows into A_exchanged
    n_copy = tl.full((), 0, tl.int32)
    pull_ok = tl.full((), 1, tl.int32)
    my_lo = tl.full((), 0, tl.int32)  # where this rank's own rows start in A_exchanged
    my_off = tl.full((), 0, tl.int32)  # ... and in a_local
    if PULL:
        n_copy = tl.cdiv(n_pull, COPY_M)
        pull_ok = _wait_all(my_flags, _READY, e_call, err, max_spin, rank, world, 1, False, TIMED)
        tl.debug_barrier()
        if pull_ok != 0:
            total = tl.full((), 0, tl.int32)
            for s in range(world):
                count = tl.load(my_flags + _INFO + 2 * s + 1, cache_modifier=".cg")
                my_lo += tl.where(s < rank, count, 0)
                total += count
            my_off = tl.load(my_flags + _INFO + 2 * rank, cache_modifier=".cg")
            if pid == 0:
                if total != n_pull:
                    record_error(err, rank, -1, total, n_pull, 6)  # not a timeout: the splits disagree
                if ORDERED:  # the segments' bounds, before this program copies
                    _segments(
                        my_flags + _TABLE, row_index, offs, my_flags, n_a, R, E, group_rows, world,
                        HAS_OFFS, GATHER, E_BLOCK, W_BLOCK,
                    )  # fmt: skip
                    tl.debug_barrier()
                    tl.atomic_xchg(my_flags + _STATE + 1, e_call, sem="release", scope="gpu")
            if ORDERED:
                # Programs 0..copiers-1 copy, the peers' rows first (rank + 1's on), this rank's own last (the GEMM
                # reads them from a_local), then join the GEMM; the other programs start on the GEMM tiles.
                copying = copiers
                shift = (my_lo + tl.load(my_flags + _INFO + 2 * rank + 1, cache_modifier=".cg")) // COPY_M
            else:
                # Every program copies, from this rank's own rows on, then rank + 1's, ...: at any moment the ranks
                # read from different sources, not all from rank 0.
                copying = num_progs
                shift = my_lo // COPY_M
            if pid < copying:
                for t in range(pid, n_copy, copying):
                    _pull_tile(
                        (t + shift) % n_copy, local_addr, src_bases, a_out, my_flags, n_pull, K, rank, world, GEMM,
                        ALIGN, COPY_M, COPY_K,
                    )  # fmt: skip

    # --- the GEMM tiles
    if GEMM:
        if A_TMA:
            a_desc = tl.make_tensor_descriptor(a, [n_a, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        else:
            a_desc = a
        if B_TMA:
            d0 = _b_desc(b0, E, K, n0, sbk0, sbn0, B_T, BLOCK_N, BLOCK_K)
            d1 = d0
            if DUAL:
                d1 = _b_desc(b1, E, K, n1, sbk1, sbn1, B_T, BLOCK_N, BLOCK_K)
        else:
            d0 = b0
            d1 = b1
        scatter_ok = tl.full((), 1, tl.int32)
        waited = tl.full((), 0, tl.int32)
        if ORDERED:
            # Segments (source, group) in the order the rows arrive: this rank's own rows (read from a_local) in
            # every group, then rank + 1's, ... (program 0 wrote their bounds); every program takes the next tile
            # from a counter (the copying ones once they have copied), so all work on the same group at a time.
            table = my_flags + _TABLE
            have = timed_wait(my_flags + _STATE + 1, e_call, err, max_spin, rank, rank, -1, 7, False, TIMED)
            n_segs = tl.where(have, world * E, 0)  # no table (a wait timed out): no tile
            t = tl.atomic_add(my_flags + _STATE + 3, 1, sem="relaxed", scope="gpu")
        else:
            # The GEMM tiles continue the copy tiles' round robin over the programs.
            t = (pid + num_progs - n_copy % num_progs) % num_progs
            n_segs = E
        base = tl.full((), 0, tl.int32)
        prev_hi = tl.full((), 0, tl.int32)
        next_end = tl.full((), 0, tl.int32)
        next_lo = tl.full((), 0, tl.int32)
        if ORDERED:  # segment 0's bounds (group 0, this rank), then each segment's loaded while the one before runs
            next_lo = tl.load(table + rank, cache_modifier=".cg")
            next_end = tl.load(table + rank + 1, cache_modifier=".cg")
        elif HAS_OFFS:
            next_end = tl.load(offs).to(tl.int32)
        for seg in range(n_segs):
            g = seg % E
            if ORDERED:
                lo = next_lo
                hi = next_end
                ahead = seg + 1 < n_segs
                at = table + ((seg + 1) % E) * (world + 1) + (rank + (seg + 1) // E) % world
                next_lo = tl.load(at, mask=ahead, other=0, cache_modifier=".cg")
                next_end = tl.load(at + 1, mask=ahead, other=0, cache_modifier=".cg")
            elif HAS_OFFS:
                # Group g's rows [lo, hi) (clamped into [0, R], never overlapping); the next group's end is loaded
                # now, while this group's tiles run, not when the program reaches it.
                end = next_end
                next_end = tl.load(offs + g + 1, mask=g + 1 < E, other=0).to(tl.int32)
                lo = prev_hi
                hi = tl.minimum(tl.maximum(end, lo), R)
                prev_hi = hi
            else:
                lo = g * group_rows
                hi = lo + group_rows
            m_tiles = tl.cdiv(hi - lo, BLOCK_M)
            count = m_tiles * n_tiles
            while t < base + count:
                tt = t - base
                in_group = GROUP_M * n_tiles
                first_m = (tt // in_group) * GROUP_M
                group_m = tl.minimum(m_tiles - first_m, GROUP_M)
                pid_m = first_m + (tt % in_group) % group_m
                pid_n = (tt % in_group) // group_m
                row0 = lo + pid_m * BLOCK_M
                j = row0 + tl.arange(0, BLOCK_M)
                j_ok = j < hi
                # The rows of `a` this tile reads.
                if GATHER:
                    a_ok, a_rows = _gathered(row_index, j, j_ok, n_a)
                else:
                    a_ok = j_ok
                    a_rows = j
                a_off = a_rows.to(tl.int64) * stride_am
                tile_ok = tl.full((), 1, tl.int32)
                if PULL:
                    # Fused dispatch: wait until every source of these rows has all its rows in A_exchanged;
                    # ordered: this rank's own rows are read from a_local, never waited for.
                    who, _ = _locate(a_rows, my_flags + _INFO, world)
                    if ORDERED:
                        # tl.where, not `& (pull_ok != 0)`: the mask stays boolean in Triton 3.9's interpreter,
                        # which widens a scalar condition to int32 when it meets a block (so below too).
                        a_ok = tl.where(pull_ok != 0, a_ok & (who < world), False)
                        local_off = local_delta + (my_off + a_rows - my_lo).to(tl.int64) * K
                        a_off = tl.where(who == rank, local_off, a_off)
                    for s in range(world):
                        touched = tl.max(((who == s) & a_ok).to(tl.int32), axis=0)
                        if ORDERED:
                            touched = tl.where(s == rank, 0, touched)
                        if (touched > 0) & (tile_ok != 0):
                            need = tl.load(my_flags + _INFO + 2 * s + 1, cache_modifier=".cg")
                            tile_ok = timed_wait(
                                my_flags + _ARRIVED + s, need, err, max_spin, rank, s, t, 2, False, TIMED
                            ).to(tl.int32)
                    tl.debug_barrier()
                col0 = pid_n * BLOCK_N
                acc, acc1 = _mma(
                    a, a_desc, tl.multiple_of(a_off, ROW_ALIGN), a_ok, b0, d0, b1, d1, g, row0, col0, K, n0, n1,
                    stride_ak, sbe0, sbk0, sbn0, sbe1, sbk1, sbn1,
                    DUAL, A_TMA, B_TMA, B_T, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                width = n0
                dtype = c0.dtype.element_ty
                cols = col0 + tl.arange(0, BLOCK_N)
                col_ok = cols < width
                if SCATTER:
                    if waited == 0:  # before this program's first store: every destination's buffer is ready
                        scatter_ok = _wait_all(my_flags, _READY, e_call, err, max_spin, rank, world, 4, False, TIMED)
                        tl.debug_barrier()
                        waited = 1
                    if Y_INDEX:
                        yi = tl.load(row_index + j, mask=j_ok, other=y_rows).to(tl.int64)
                        yi = tl.where(yi < 0, yi + y_rows + 1, yi)  # torch's negative indices (-1: the padding row)
                    else:
                        yi = j.to(tl.int64)
                    y_ok = j_ok & (yi >= 0) & (yi < y_rows)
                    yi32 = tl.where(y_ok, yi, 0).to(tl.int32)
                    who, start = _locate(yi32, my_flags + _INFO, world)
                    y_ok = tl.where(scatter_ok != 0, y_ok & (who < world), False)
                    dst = tl.minimum(who, world - 1)
                    offset = tl.load(my_flags + _INFO + 2 * dst, mask=y_ok, other=0, cache_modifier=".cg")
                    dbase = tl.load(dst_bases + dst, mask=y_ok, other=0)
                    pos = (offset + yi32 - start).to(tl.int64) * width
                    m = y_ok[:, None] & col_ok[None, :]
                    if ACCUMULATE:
                        rp = tl.multiple_of(dbase.to(tl.pointer_type(tl.float32)) + pos, ALIGN)
                        tl.atomic_add(rp[:, None] + cols[None, :], acc, mask=m, sem="relaxed", scope="sys")
                    else:
                        rp = tl.multiple_of(dbase.to(tl.pointer_type(dtype)) + pos, ALIGN)
                        tl.store(rp[:, None] + cols[None, :], acc.to(dtype), mask=m)
                else:
                    keep = tl.where(tile_ok != 0, j_ok, False)[:, None]
                    out_rows = j.to(tl.int64)[:, None]
                    tl.store(c0 + out_rows * n0 + cols[None, :], acc.to(dtype), mask=keep & col_ok[None, :])
                    if DUAL:
                        tl.store(c1 + out_rows * n1 + cols[None, :], acc1.to(dtype), mask=keep & (cols < n1)[None, :])
                if ORDERED:
                    t = tl.atomic_add(my_flags + _STATE + 3, 1, sem="relaxed", scope="gpu")
                else:
                    t += num_progs
            base += count

    # --- the last program to finish: reset the counters, tell the peers
    if PULL or SCATTER:
        tl.debug_barrier()
        finished = tl.atomic_add(my_flags + _STATE + 2, 1, sem="acq_rel", scope="sys")
        if finished == num_progs - 1:
            tl.atomic_xchg(my_flags + _STATE + 2, 0, sem="relaxed", scope="gpu")
            if ORDERED:
                tl.atomic_xchg(my_flags + _STATE + 3, 0, sem="relaxed", scope="gpu")
            if PULL:
                if GEMM:
                    for s in range(world):
                        tl.atomic_xchg(my_flags + _ARRIVED + s, 0, sem="relaxed", scope="gpu")
                _tell_done(peer_flags, rank, world, e_call, True)  # we read nothing more from their send buffers
            if SCATTER:
                _tell_done(peer_flags, rank, world, e_call, False)  # everything we send them has landed


@triton.jit
def _put(scratch, i: tl.constexpr, packed):
    p = packed.to(tl.int64)
    tl.store(scratch + 2 * i, (p & 0x7FFFFFFF).to(tl.int32))
    tl.store(scratch + 2 * i + 1, ((p >> 32) & 0x3FFFFFFF).to(tl.int32))


# The split sizes come as host ints: packed two per int64 argument (a CUDA graph keeps kernel arguments by value),
# with bit 62 set so that every argument is an int64 (Triton types a small int as int32: another compiled kernel).
@triton.jit(
    do_not_specialize=["rank", "world"] + [f"u{i:02d}" for i in range(MAX_WORLD // 2)]
)  # fmt: skip
def publish_kernel(
    my_flags, peer_flags, rank, world,
    u00, u01, u02, u03, u04, u05, u06, u07, u08, u09, u10, u11, u12, u13, u14, u15,
    u16, u17, u18, u19, u20, u21, u22, u23, u24, u25, u26, u27, u28, u29, u30, u31,
):  # fmt: skip
    """Advance this rank's epoch e; write ``info[rank] = (offset, count)`` of every rank p's range (the counts are
    ``u``; offsets their prefix sums) into p's flag words, then ``ready[rank] = e`` (release)."""
    e = tl.load(my_flags + _STATE, volatile=True) + 1
    tl.store(my_flags + _STATE, e)
    sc = my_flags + _SCRATCH
    _put(sc, 0, u00)
    _put(sc, 1, u01)
    _put(sc, 2, u02)
    _put(sc, 3, u03)
    _put(sc, 4, u04)
    _put(sc, 5, u05)
    _put(sc, 6, u06)
    _put(sc, 7, u07)
    _put(sc, 8, u08)
    _put(sc, 9, u09)
    _put(sc, 10, u10)
    _put(sc, 11, u11)
    _put(sc, 12, u12)
    _put(sc, 13, u13)
    _put(sc, 14, u14)
    _put(sc, 15, u15)
    _put(sc, 16, u16)
    _put(sc, 17, u17)
    _put(sc, 18, u18)
    _put(sc, 19, u19)
    _put(sc, 20, u20)
    _put(sc, 21, u21)
    _put(sc, 22, u22)
    _put(sc, 23, u23)
    _put(sc, 24, u24)
    _put(sc, 25, u25)
    _put(sc, 26, u26)
    _put(sc, 27, u27)
    _put(sc, 28, u28)
    _put(sc, 29, u29)
    _put(sc, 30, u30)
    _put(sc, 31, u31)
    tl.debug_barrier()
    offset = tl.full((), 0, tl.int32)
    for p in range(world):
        count = tl.load(sc + p, volatile=True)
        pf = tl.load(peer_flags + p).to(tl.pointer_type(tl.int32))
        tl.store(pf + _INFO + 2 * rank, offset)
        tl.store(pf + _INFO + 2 * rank + 1, count)
        offset += count
    tl.debug_barrier()  # the info words before the flags' (cumulative) release
    for p in range(world):
        pf = tl.load(peer_flags + p).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(pf + _READY + rank, e, sem="release", scope="sys")


@triton.jit(do_not_specialize=["rank", "world", "max_spin"])
def wait_kernel(
    my_flags, err, rank, world, max_spin, KIND: tl.constexpr, SKIP_SELF: tl.constexpr, TIMED: tl.constexpr
):
    """Bounded waits until every rank's ``done`` word reaches this rank's current epoch."""
    e = tl.load(my_flags + _STATE, volatile=True)
    _wait_all(my_flags, _DONE, e, err, max_spin, rank, world, KIND, SKIP_SELF, TIMED)


# --- launchers ---------------------------------------------------------------------------------------------


def pack_counts(counts: Sequence[int]) -> list[int]:
    """``publish_kernel``'s ``u`` arguments: ``MAX_WORLD`` int32 counts, two per int64."""
    if len(counts) > MAX_WORLD or any(not 0 <= int(c) < 2**30 for c in counts):
        raise ValueError(f"fluxcompile: at most {MAX_WORLD} counts in [0, 2**30), got {list(counts)}")
    c = [int(x) for x in counts] + [0] * (MAX_WORLD - len(counts))
    return [c[2 * i] | (c[2 * i + 1] << 32) | (1 << 62) for i in range(MAX_WORLD // 2)]


def publish(sig: Signals, counts: Sequence[int]) -> None:
    """Advance this rank's epoch and publish ``counts[p]`` rows for every rank p (see ``publish_kernel``)."""
    if len(counts) != sig.world:
        raise ValueError(f"fluxcompile: {len(counts)} counts for {sig.world} ranks")
    publish_kernel[(1,)](sig.my_flags, sig.peer_flags, sig.rank, sig.world, *pack_counts(counts), num_warps=1)


def wait_done(sig: Signals, kind: int, skip_self: bool) -> None:
    """A one-program kernel: bounded waits until every rank's ``done`` word reaches this rank's epoch."""
    wait_kernel[(1,)](
        sig.my_flags, sig.err, sig.rank, sig.world, sig.max_spin, KIND=kind, SKIP_SELF=skip_self,
        TIMED=sig.my_flags.is_cuda, num_warps=1,
    )


def _tma_weight_layout(b: torch.Tensor, block: tuple[int, int, int]) -> bool | None:
    """``B_T`` for a weight TMA can read (``[E, K, N]`` rows of N, K a multiple of BLOCK_K; or ``[E, N, K]``
    transposed), None where it cannot."""
    es = b.element_size()
    _, k, n = b.shape
    if b.data_ptr() % 16:
        return None
    if b.stride(2) == 1 and n > 1 and b.stride(0) == k * b.stride(1) and (b.stride(1) * es) % 16 == 0:
        return False if k % block[2] == 0 else None
    if b.stride(1) == 1 and b.stride(0) == n * b.stride(2) and (b.stride(2) * es) % 16 == 0:
        return True
    return None


def weight_layouts(Bs: Sequence[torch.Tensor], block: tuple[int, int, int]) -> bool | None:
    """The common ``B_T`` of weights that all go through TMA, None where one cannot (pointer loads then)."""
    layouts = {_tma_weight_layout(b, block) for b in Bs}
    return layouts.pop() if len(layouts) == 1 and None not in layouts else None


def grouped_gemm(
    a: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None = None,
    *,
    offs: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
    pull: Pull | None = None,
    gemm: bool = True,
    scatter: Scatter | None = None,
    sig: Signals | None = None,
    variant: Variant | str = DEFAULT,
    num_programs: int | None = None,
    tma: bool | None = None,
    copiers: int = 0,
) -> list[torch.Tensor]:
    """``outs[w] = grouped(X, Bs[w])`` (see the module), with the dispatch's ``pull`` before it (``a`` is then
    ``pull.a_out``; ``gemm=False``: the pull only) or the combine's ``scatter`` as its epilogue (then nothing is
    stored locally and ``outs`` is ignored). One launch per two weights (two share each A tile: their column
    blocks are half the variant's BLOCK_N each); a third weight is a second launch, after the pull.

    a: ``[n_a, K]`` with contiguous rows; Bs: ``[E, K, N_w]``, any strides; offs: ``[E]`` int32/int64 group ends,
    or None (equal groups: the rows of X divide by E); row_index: ``[R]`` int32/int64, or None (X = a); with
    ``scatter`` it places the output rows instead (one index per row of ``a``); outs: contiguous ``[R, N_w]`` (made
    when None). ``sig`` is required with ``pull`` or ``scatter``. ``num_programs``: the persistent programs
    (default: the device's SMs; with ``pull`` and ``gemm`` every one must be resident). ``tma``: the variant's
    choice unless given. ``copiers``: with ``pull`` and ``gemm``, that many programs copy while the others
    multiply in the order the rows arrive (the module's ordered dispatch); 0: every program copies first.
    """
    v = VARIANTS[variant] if isinstance(variant, str) else variant
    if not 1 <= len(Bs) <= MAX_WEIGHTS:
        raise ValueError(f"grouped_gemm: 1 to {MAX_WEIGHTS} weights, got {len(Bs)}")
    if a.dim() != 2 or a.stride(1) != 1:
        raise ValueError("grouped_gemm: a must be [rows, K] with contiguous rows")
    n_a, k = a.shape
    E = Bs[0].shape[0]
    if any(b.dim() != 3 or b.shape[0] != E or b.shape[1] != k or b.dtype != a.dtype for b in Bs):
        shapes = [tuple(b.shape) for b in Bs]
        raise ValueError(f"grouped_gemm: weights must be [E, K={k}, N] of a's dtype, got {shapes}")
    gather = row_index is not None and scatter is None  # the combine's row_index places output rows instead
    R = row_index.numel() if gather else n_a
    if row_index is not None and not gather and row_index.numel() != n_a:
        raise ValueError(f"grouped_gemm: the scatter's row_index needs one index per row ({n_a}): {row_index.numel()}")
    if offs is not None and (offs.dim() != 1 or offs.numel() != E):
        raise ValueError(f"grouped_gemm: offs must be [E={E}]")
    if gemm and offs is None and R % E:
        raise ValueError(f"grouped_gemm: {R} rows do not split into {E} equal groups")
    if (pull is not None or scatter is not None) and sig is None:
        raise ValueError("grouped_gemm: the pull and the scatter need the signals")
    if pull is not None and (pull.a_out is not a or not a.is_contiguous()):
        raise ValueError("grouped_gemm: with a pull, a is the pull's output")
    if scatter is not None and (len(Bs) != 1 or pull is not None):
        raise ValueError("grouped_gemm: the scatter epilogue takes one weight and no pull")
    widths = [b.shape[2] for b in Bs]
    if scatter is None and gemm:
        if outs is None:
            outs = [torch.empty(R, n, dtype=a.dtype, device=a.device) for n in widths]
        if any(o.shape != (R, n) or not o.is_contiguous() for o, n in zip(outs, widths)):
            raise ValueError("grouped_gemm: outputs must be contiguous [R, N]")
    outs = list(outs) if outs is not None else []
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    kw = dict(offs=offs, row_index=row_index, gather=gather, R=R, sig=sig, v=v, num_programs=num_programs, tma=tma)
    if len(Bs) <= 2:
        launch_grouped(a, list(Bs), outs, pull=pull, gemm=gemm, scatter=scatter, copiers=copiers, **kw)
    else:  # the first two weights (after the pull), then the third from the rows now local
        launch_grouped(a, list(Bs[:2]), outs[:2], pull=pull, gemm=gemm, scatter=None, copiers=copiers, **kw)
        if gemm:
            launch_grouped(a, list(Bs[2:]), outs[2:], pull=None, gemm=True, scatter=None, **kw)
    return outs


def launch_block(v: Variant, dual: bool) -> tuple[int, int, int]:
    """A launch's (BLOCK_M, BLOCK_N per weight, BLOCK_K): two weights get half the variant's columns each (two
    accumulators: the variant's registers and shared memory); a weight's block is at most 128 columns (256
    through TMA computed wrong results under Triton 3.6, and one accumulator of 256 spills)."""
    bm, bn, bk = v.block
    return bm, min(bn // 2 if dual else bn, 128), bk


def launch_grouped(
    a, Bs, outs, *, offs, row_index, gather, R, pull, gemm, scatter, sig, v, num_programs, tma, copiers=0
) -> None:
    """One launch of ``grouped_gemm_kernel`` for one or two weights (see :func:`grouped_gemm`)."""
    n_a, k = a.shape
    E = Bs[0].shape[0]
    dual = len(Bs) == 2
    bm, bn, bk = launch_block(v, dual)
    widths = [b.shape[2] for b in Bs]
    n_tiles = triton.cdiv(max(widths), bn)
    use_tma = v.tma if tma is None else tma
    b_t = weight_layouts(Bs, (bm, bn, bk)) if use_tma else None
    es = a.element_size()
    a_tma = bool(
        use_tma and gemm and not gather and pull is None and n_a > 0
        and a.data_ptr() % 16 == 0 and (a.stride(0) * es) % 16 == 0
    )  # fmt: skip
    if b_t is not None or a_tma:
        tma_scratch.set_allocator()
    # Rows of peers' buffers are 16-byte aligned where the row length is (the buffers themselves are).
    row_bytes = k * es if pull is not None else widths[0] * (4 if scatter is not None and scatter.accumulate else es)
    align = 16 if row_bytes % 16 == 0 else 1
    if pull is not None and pull.a_local.data_ptr() % 16:
        align = 1
    n_pull = pull.rows if pull is not None else 0
    work = (triton.cdiv(n_pull, COPY_M) if pull is not None else 0) + (
        min(triton.cdiv(R, bm) + E, R) * n_tiles if gemm and R else 0
    )
    if work == 0 and sig is None:
        return  # nothing to compute, nobody to signal
    progs = max(1, min(num_programs * (v.per_sm if sig is None else 1), work))
    copiers = min(copiers, progs - 1) if pull is not None and gemm and E * (sig.world + 1) <= TABLE_WORDS else 0
    # Element offsets of A's rows: multiples of 16 bytes where the rows (and, ordered, a_local against a) are.
    local_delta = 0
    row_align = 16 // es if (a.stride(0) * es) % 16 == 0 and a.data_ptr() % 16 == 0 else 1
    if copiers > 0:
        local_delta = (pull.a_local.data_ptr() - a.data_ptr()) // es
        if align != 16 or local_delta % (16 // es):
            row_align = 1
    b1 = Bs[1] if dual else Bs[0]
    c0 = outs[0] if outs else a
    c1 = outs[1] if dual and outs else c0
    # Pointer arguments a launch does not use get `a` (never read through).
    grouped_gemm_kernel[(progs,)](
        a, row_index if row_index is not None else a, offs if offs is not None else a,
        Bs[0], b1, c0, c1,
        pull.a_local.data_ptr() if pull is not None else 0, local_delta,
        pull.src_bases if pull is not None else a,
        pull.a_out if pull is not None else a,
        scatter.dst_bases if scatter is not None else a,
        sig.my_flags if sig is not None else a,
        sig.peer_flags if sig is not None else a,
        sig.err if sig is not None else a,
        R, n_a, k, widths[0], b1.shape[2], n_tiles, E, R // E if offs is None else 0,
        a.stride(0), a.stride(1),
        Bs[0].stride(0), b1.stride(0), Bs[0].stride(1), b1.stride(1), Bs[0].stride(2), b1.stride(2),
        n_pull, scatter.y_rows if scatter is not None else 0,
        sig.rank if sig is not None else 0, sig.world if sig is not None else 1,
        sig.max_spin if sig is not None else 0, progs, copiers,
        HAS_OFFS=offs is not None, GATHER=gather, Y_INDEX=row_index is not None and scatter is not None,
        A_TMA=a_tma, B_TMA=b_t is not None, B_T=bool(b_t), DUAL=dual, PULL=pull is not None, GEMM=gemm,
        SCATTER=scatter is not None, ORDERED=copiers > 0, ACCUMULATE=scatter is not None and scatter.accumulate,
        IEEE=a.dtype == torch.float32, ALIGN=align, ROW_ALIGN=row_align, TIMED=a.is_cuda,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=v.group_m, COPY_M=COPY_M,
        COPY_K=COPIER_K if copiers > 0 else COPY_K, E_BLOCK=triton.next_power_of_2(E) if copiers > 0 else 1,
        W_BLOCK=triton.next_power_of_2(sig.world + 1) if copiers > 0 else 1,
        num_warps=v.num_warps, num_stages=v.num_stages,
    )  # fmt: skip


# --- the dispatch's copy in the experts' order (for a GEMM that waits per block of rows) -------------------------


@triton.jit(do_not_specialize=["n_x", "n_pull", "rank", "world", "max_spin", "num_progs", "local_addr"])
def permuted_pull_kernel(
    row_index, local_addr, src_bases, x_out, ex_out, block_flags, my_flags, peer_flags, err,
    n_x, n_pull, K, rank, world, max_spin, num_progs,
    ALIGN: tl.constexpr, TIMED: tl.constexpr, COPY_M: tl.constexpr, COPY_K: tl.constexpr,
    GATHER: tl.constexpr, EXCHANGED: tl.constexpr,
):  # fmt: skip
    """Flux's permuting copy for the dispatch: row j of ``x_out`` (the experts' rows, in their order) is exchanged row
    ``row_index[j]`` (``A_exchanged[row_index[j]]``, a padding index a zero row; without ``GATHER``, row j), pulled
    straight from its source's send buffer (this rank's own rows from ``local_addr``); once a tile of ``COPY_M`` rows
    of ``x_out`` is stored, ``block_flags[tile]`` becomes the call's epoch (release): a GEMM that waits per block of
    rows (csrc/cutlass_grouped.cuh) starts on the first blocks while later ones arrive. With ``EXCHANGED`` the
    programs then also pull the exchanged rows in source order into ``ex_out`` (``A_exchanged``, for a caller that
    reads it). The protocol around it is the pull's (module docstring): every source's ``ready`` awaited first,
    the last program tells every source ``done``. Tiles are taken round robin by the programs."""
    pid = tl.program_id(0)
    e_call = tl.load(my_flags + _STATE, volatile=True)  # this call's epoch (publish() advanced it)
    ok = _wait_all(my_flags, _READY, e_call, err, max_spin, rank, world, 1, False, TIMED)
    tl.debug_barrier()
    n_tiles = tl.cdiv(n_x, COPY_M)
    if ok != 0:
        total = tl.full((), 0, tl.int32)
        for s in range(world):
            total += tl.load(my_flags + _INFO + 2 * s + 1, cache_modifier=".cg")
        if pid == 0 and total != n_pull:
            record_error(err, rank, -1, total, n_pull, 6)  # not a timeout: the splits disagree
        for t in range(pid, n_tiles, num_progs):
            j = t * COPY_M + tl.arange(0, COPY_M)
            in_x = j < n_x
            if GATHER:
                good, ex = _gathered(row_index, j, in_x, n_pull)
            else:
                good, ex = in_x & (j < n_pull), j
            _copy_rows(ex, good, j, in_x, x_out, local_addr, src_bases, my_flags, K, rank, world, ALIGN, COPY_K, True)
            tl.debug_barrier()  # every thread's stores before the block's (cumulative) release
            tl.atomic_xchg(block_flags + t, e_call, sem="release", scope="gpu")
        if EXCHANGED:
            for t in range(pid, tl.cdiv(n_pull, COPY_M), num_progs):
                rows = t * COPY_M + tl.arange(0, COPY_M)
                valid = rows < n_pull
                _copy_rows(rows, valid, rows, valid, ex_out, local_addr, src_bases, my_flags, K, rank, world,
                           ALIGN, COPY_K, False)  # fmt: skip
    # --- the last program to finish: tell every source its send buffer is free
    tl.debug_barrier()
    finished = tl.atomic_add(my_flags + _STATE + 2, 1, sem="acq_rel", scope="sys")
    if finished == num_progs - 1:
        tl.atomic_xchg(my_flags + _STATE + 2, 0, sem="relaxed", scope="gpu")
        _tell_done(peer_flags, rank, world, e_call, True)


def permuted_pull(
    pull: Pull, row_index: torch.Tensor | None, block_flags: torch.Tensor, sig: Signals, num_programs: int,
    exchanged: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One launch of :func:`permuted_pull_kernel`: ``pull.a_out`` receives the experts' rows ``x`` (``len(row_index)``
    rows, ``x[j] = A_exchanged[row_index[j]]``, zeros for a padding index; without ``row_index``, the exchanged rows
    themselves) and ``block_flags`` (int32, one per ``COPY_M`` rows of ``x``) the call's epoch as each block lands;
    ``pull.rows`` is the exchanged rows' count; ``exchanged`` (contiguous ``[pull.rows, K]``), where given, the
    exchanged rows in source order too. After :func:`publish` on every rank, as the pull. ``num_programs``
    programs of ``PERMUTED_WARPS`` warps each, ``COPY_M`` x ``PERMUTED_K`` elements a step: one program fills an
    SM's worth of loads in flight, so a GEMM beside it on the other SMs keeps them all."""
    x_out, k = pull.a_out, pull.a_out.shape[1]
    n_x = row_index.numel() if row_index is not None else pull.rows
    if x_out.shape[0] < n_x or not x_out.is_contiguous() or block_flags.dtype != torch.int32:
        raise ValueError("fluxcompile: the permuted pull writes a contiguous [len(row_index), K] and int32 flags")
    if block_flags.numel() < triton.cdiv(n_x, COPY_M):
        raise ValueError(f"fluxcompile: one block flag per {COPY_M} rows of the experts' rows")
    if exchanged is not None and (not exchanged.is_contiguous() or tuple(exchanged.shape) != (pull.rows, k)):
        raise ValueError("fluxcompile: the permuted pull writes the exchanged rows as a contiguous [rows, K]")
    es = x_out.element_size()
    align = 16 if (k * es) % 16 == 0 and pull.a_local.data_ptr() % 16 == 0 else 1
    progs = max(1, min(num_programs, triton.cdiv(max(n_x, pull.rows if exchanged is not None else 0), COPY_M)))
    permuted_pull_kernel[(progs,)](
        row_index if row_index is not None else x_out, pull.a_local.data_ptr(), pull.src_bases, x_out,
        exchanged if exchanged is not None else x_out, block_flags, sig.my_flags, sig.peer_flags, sig.err,
        n_x, pull.rows, k, sig.rank, sig.world, sig.max_spin, progs,
        ALIGN=align, TIMED=x_out.is_cuda, COPY_M=COPY_M, COPY_K=min(PERMUTED_K, triton.next_power_of_2(k)),
        GATHER=row_index is not None, EXCHANGED=exchanged is not None, num_warps=PERMUTED_WARPS,
    )  # fmt: skip


def check_error(err: torch.Tensor, group_name: str, what: str = "the MoE all-to-all") -> None:
    """Raise if a wait of the kernels timed out or the splits disagreed (reads ``err``: a host synchronization
    when on the GPU)."""
    code, rank, peer, tile, value, kind = (int(x) for x in err[:6].tolist())
    if not code:
        return
    signal, meaning = WAIT_KINDS.get(kind, (f"signal of kind {kind}", "?"))
    if kind == 6:
        raise RuntimeError(
            f"fluxcompile: {what}: rank {rank} of group {group_name}: the split sizes the ranks published add up to "
            f"{tile} rows, but this rank expects {value}: every rank must pass matching splits"
        )
    tile_s = f" (tile {tile})" if tile >= 0 else ""
    raise RuntimeError(
        f"fluxcompile: {what}: rank {rank} of group {group_name} timed out waiting for rank {peer}'s {signal}"
        f"{tile_s}: {meaning}; it never reached {value}. Is every rank running the same op in the same order?"
    )
