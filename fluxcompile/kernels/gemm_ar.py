"""GEMM -> all-reduce (-> residual add + RMSNorm) as one persistent Triton kernel per rank, for decode-sized
m (16 to a few hundred rows); the CUDA kernel in csrc/gemv_ar.cu is its GEMV-shaped sibling for m <= 64 and
follows the same protocol (see its header comment for the argument why it is race-free).

``out = sum over ranks of (A_r @ B_r + bias)``: every rank computes its partial product tile by tile
(``[BLOCK_M, BLOCK_N]``) and stores each finished tile straight into the symmetric slots of the ranks that
reduce it (zero-copy peer stores):

* one-shot: into every rank's slot ``src = rank``; every rank then reduces every tile;
* two-shot: only into the tile's owner (tiles split in contiguous ranges over the ranks); the owner reduces
  it and stores the reduced tile into every peer's result slot.

Communication-aware order: on rank r, positions walk the tiles of owners r+1, r+2, ... first and r's own
last, so what the peers wait for leaves first. A program keeps its tiles through all phases (compute and
push; reduce; two-shot: collect), so a tile is reduced by the program that computed its local partial.

Flags carry epochs: ``state[0]`` counts this kernel family's calls on this rank; a call uses
``e = state[0] + 1``, its last program writes ``e`` back. A wait passes when ``flag - e >= 0``, so stale
flags never pass and nothing is reset between calls or CUDA graph replays. Data slots alternate by the
epoch's parity. Waits are bounded (``max_spin`` polls): the first timeout records (rank, peer, tile,
epoch, kind) in ``err``, later waits give up at once, and :func:`check_error` raises naming them.

The RMSNorm tail (``ops.all_reduce_rmsnorm``): h = residual + r is written by the reducing program together
with the per-tile sums of squares of h; after a grid barrier (all programs are resident: one per SM at
most) each program normalizes its own tiles. The grid barrier is why the tail is checked on CPU with one
program only (Triton's interpreter runs programs one after the other).

Checked on CPU in Triton's interpreter (tests/test_gemm_ar_kernel.py, ordinary tensors standing for the
peers' buffers) and on GPUs by tests/gpu/test_decode_ar.py. Its ``triton:*`` choices of matmul_all_reduce
and all_reduce_rmsnorm (lowerings/matmul_all_reduce/fused_kernels.py) are family ``decode``: they run while
``config.implementations`` has it (the default).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .waits import bounded_wait

MAX_TILES = 8192  # flag words per source rank; the reduced-tile flags follow the world's partial flags
_MAX_TILES = tl.constexpr(MAX_TILES)  # the same, as the kernel sees it
ERR_WORDS = 8  # code, rank, peer, tile, epoch, kind
WAIT_KINDS = {1: "partial tile", 2: "reduced tile", 3: "grid barrier"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One tile configuration, for one-shot or two-shot, offered for m in ``[min_m, max_m]``."""

    block: tuple[int, int, int]
    two_shot: bool
    min_m: int = 1  # the variant declines smaller m (a tile mostly of padding)
    max_m: int = 1 << 20
    num_warps: int = 4
    num_stages: int = 3


VARIANTS: dict[str, Variant] = {
    f"{shot}-{bm}x{bn}x{bk}": Variant((bm, bn, bk), shot == "twoshot", lo, hi)
    for shot in ("oneshot", "twoshot")
    for (bm, bn, bk), lo, hi in (((16, 64, 128), 1, 32), ((64, 64, 64), 17, 1 << 20), ((128, 64, 64), 97, 1 << 20))
}


@triton.jit
def _tile_at(pos, rank, world, n_tiles):
    """Communication-aware order: position -> tile (owners rank+1, rank+2, ..., rank; contiguous ranges)."""
    tile = -1
    rest = pos
    for step in range(1, world + 1):
        o = (rank + step) % world
        lo = (o * n_tiles + world - 1) // world
        hi = ((o + 1) * n_tiles + world - 1) // world
        if (tile < 0) & (rest < hi - lo):
            tile = lo + rest
        if tile < 0:
            rest -= hi - lo
    return tile


@triton.jit
def _write_output(
    r, rows, cols, mask, tn, out, residual, ss_part, M, N, n_tiles_n, TAIL: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Store the reduced tile ``r`` (output dtype) or, with the tail, h = residual + r and its row sums of
    squares into ss_part[row, tn]."""
    offs = rows[:, None] * N + cols[None, :]
    if TAIL:
        res = tl.load(residual + offs, mask=mask, other=0.0)
        h = (res.to(tl.float32) + r.to(tl.float32)).to(out.dtype.element_ty)
        tl.store(out + offs, h, mask=mask)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
        tl.store(ss_part + rows * n_tiles_n + tn, tl.sum(hf * hf, axis=1), mask=rows < M)
    else:
        tl.store(out + offs, r, mask=mask)


# No value specialization of the row count, rank and scalars: one compiled kernel serves every decode batch
# size (m = 1 would otherwise be a kernel of its own) and both ranks.
@triton.jit(do_not_specialize=["M", "rank", "world", "max_spin", "eps"])
def gemm_ar_kernel(
    a, b, bias, out, normed, residual, norm_w,
    peer_data, peer_flags, state, ss_part, err,
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    slot_elems, n_tiles_m, n_tiles_n, eps, rank, world, max_spin,
    HAS_BIAS: tl.constexpr, TWO_SHOT: tl.constexpr, TAIL: tl.constexpr, WEIGHT_AFTER_CAST: tl.constexpr,
    IEEE: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    dtype = out.dtype.element_ty
    pid = tl.program_id(0)
    n_tiles = n_tiles_m * n_tiles_n
    e = tl.load(state, volatile=True) + 1
    parity = e % 2
    my_data = tl.load(peer_data + rank).to(tl.pointer_type(dtype))
    my_flags = tl.load(peer_flags + rank).to(tl.pointer_type(tl.int32))
    result_slot = 2 * world + parity

    # Phase 1: partial tiles, pushed to the ranks that reduce them. Tiles are numbered M-block fastest, so
    # programs running side by side share the weight's column block (read from HBM once, then from L2).
    for pos in range(pid, n_tiles, NUM_PROGS):
        t = _tile_at(pos, rank, world, n_tiles)
        tm = t % n_tiles_m
        tn = t // n_tiles_m
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            a_tile = tl.load(
                a + rows[:, None] * stride_am + kk[None, :] * stride_ak,
                mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0,
            )  # fmt: skip
            b_tile = tl.load(
                b + kk[:, None] * stride_bk + cols[None, :] * stride_bn,
                mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0,
            )  # fmt: skip
            if IEEE:
                acc = tl.dot(a_tile, b_tile, acc, input_precision="ieee")
            else:
                acc = tl.dot(a_tile, b_tile, acc)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        part = acc.to(dtype)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        owner = (t * world) // n_tiles
        src_slot = (parity * world + rank) * slot_elems
        if TWO_SHOT:
            dst_data = tl.load(peer_data + owner).to(tl.pointer_type(dtype))
            tl.store(dst_data + src_slot + offs, part, mask=mask, cache_modifier=".cg")
        else:
            for step in range(world):  # peers first, own slot last
                dst = (rank + 1 + step) % world
                dst_data = tl.load(peer_data + dst).to(tl.pointer_type(dtype))
                tl.store(dst_data + src_slot + offs, part, mask=mask, cache_modifier=".cg")
        tl.debug_barrier()  # all of the tile's stores before the flag's (cumulative) release
        for step in range(1, world):
            dst = (rank + step) % world
            if TWO_SHOT:
                to_dst = dst == owner
            else:
                to_dst = dst >= 0
            if to_dst:
                dst_flags = tl.load(peer_flags + dst).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(dst_flags + rank * _MAX_TILES + t, e, sem="release", scope="sys")

    # Phase 2: reduce this rank's tiles (one-shot: all of them), in rank order like every rank.
    for pos in range(pid, n_tiles, NUM_PROGS):
        t = _tile_at(pos, rank, world, n_tiles)
        owner = (t * world) // n_tiles
        if TWO_SHOT:
            mine = owner == rank
        else:
            mine = owner >= 0
        if mine:
            tm = t % n_tiles_m
            tn = t // n_tiles_m
            rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            offs = rows[:, None] * N + cols[None, :]
            ok = 1
            for step in range(1, world):
                src = (rank + step) % world
                if ok != 0:
                    ok = bounded_wait(my_flags + src * _MAX_TILES + t, e, err, max_spin, rank, src, t, 1, True).to(
                        tl.int32
                    )
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in range(world):
                total += tl.load(
                    my_data + (parity * world + src) * slot_elems + offs, mask=mask, other=0.0, cache_modifier=".cg"
                ).to(tl.float32)
            r = total.to(dtype)
            if TWO_SHOT:
                for step in range(1, world):
                    dst = (rank + step) % world
                    dst_data = tl.load(peer_data + dst).to(tl.pointer_type(dtype))
                    tl.store(dst_data + result_slot * slot_elems + offs, r, mask=mask, cache_modifier=".cg")
                tl.debug_barrier()
                if ok != 0:
                    for step in range(1, world):
                        dst = (rank + step) % world
                        dst_flags = tl.load(peer_flags + dst).to(tl.pointer_type(tl.int32))
                        tl.atomic_xchg(dst_flags + world * _MAX_TILES + t, e, sem="release", scope="sys")
            _write_output(r, rows, cols, mask, tn, out, residual, ss_part, M, N, n_tiles_n, TAIL, BLOCK_N)

    # Phase 3 (two-shot): the tiles the other ranks reduced.
    if TWO_SHOT:
        for pos in range(pid, n_tiles, NUM_PROGS):
            t = _tile_at(pos, rank, world, n_tiles)
            owner = (t * world) // n_tiles
            if owner != rank:
                tm = t % n_tiles_m
                tn = t // n_tiles_m
                rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
                cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                offs = rows[:, None] * N + cols[None, :]
                bounded_wait(my_flags + world * _MAX_TILES + t, e, err, max_spin, rank, owner, t, 2, True)
                tl.debug_barrier()
                r = tl.load(my_data + result_slot * slot_elems + offs, mask=mask, other=0.0, cache_modifier=".cg")
                _write_output(r, rows, cols, mask, tn, out, residual, ss_part, M, N, n_tiles_n, TAIL, BLOCK_N)

    if TAIL:
        # Grid barrier: the last program to arrive resets the count and releases the others with epoch e.
        tl.debug_barrier()
        arrived = tl.atomic_add(state + 2, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_PROGS - 1:
            tl.atomic_xchg(state + 2, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(state + 3, e, sem="release", scope="gpu")
        else:
            bounded_wait(state + 3, e, err, max_spin, rank, -1, -1, 3, False)
        tl.debug_barrier()
        for pos in range(pid, n_tiles, NUM_PROGS):
            t = _tile_at(pos, rank, world, n_tiles)
            tm = t % n_tiles_m
            tn = t // n_tiles_m
            rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            offs = rows[:, None] * N + cols[None, :]
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for j in range(n_tiles_n):  # the same order on every program
                ss += tl.load(ss_part + rows * n_tiles_n + j, mask=rows < M, other=0.0, cache_modifier=".cg")
            inv = 1.0 / tl.sqrt(ss / N + eps)
            h = tl.load(out + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(norm_w + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            x = h * inv[:, None]
            if WEIGHT_AFTER_CAST:
                y = x.to(dtype).to(tl.float32) * w
            else:
                y = x * w
            tl.store(normed + offs, y.to(dtype), mask=mask)

    # The last program to finish publishes this call's epoch for the next call.
    tl.debug_barrier()
    done = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if done == NUM_PROGS - 1:
        tl.atomic_xchg(state + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state, e, sem="release", scope="gpu")


def n_tiles(m: int, n: int, block: tuple[int, int, int]) -> tuple[int, int]:
    """(tiles along m, tiles along n)."""
    return triton.cdiv(m, block[0]), triton.cdiv(n, block[1])


def gemm_ar(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    peer_data: torch.Tensor,
    peer_flags: torch.Tensor,
    slot_elems: int,
    state: torch.Tensor,
    err: torch.Tensor,
    rank: int,
    world: int,
    *,
    two_shot: bool,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, bool] | None = None,
    ss_part: torch.Tensor | None = None,
    block: tuple[int, int, int] = (64, 64, 64),
    num_programs: int | None = None,
    max_spin: int = 1 << 26,  # polls of about 1 µs: a peer missing for about a minute is an error
    num_warps: int = 4,
    num_stages: int = 3,
    compile_only: bool = False,
) -> None:
    """Launch the kernel: ``out = all_reduce(a @ b + bias)`` (or, with ``tail = (normed, residual, weight,
    eps, weight_after_cast)``, ``out = residual + all_reduce(...)`` and ``normed = RMSNorm(out) * weight``).

    a ``[m, k]``, b ``[k, n]`` (any strides), out/normed/residual contiguous ``[m, n]``; peer_data/peer_flags:
    int64 ``[world]`` addresses of every rank's data and flag buffers as seen from here; data slot ``i``
    starts ``i * slot_elems`` elements into a data buffer (``2 * world + 2`` slots); flag buffers hold
    ``(world + 1) * MAX_TILES`` int32; state: int32 ``[4]`` of this rank; err: int32 ``[ERR_WORDS]``;
    ss_part: float32 ``[m * tiles along n]`` (tail).
    """
    m, k = a.shape
    n = b.shape[1]
    tm, tn = n_tiles(m, n, block)
    total = tm * tn
    if b.shape[0] != k or out.shape != (m, n) or not out.is_contiguous():
        raise ValueError("gemm_ar: want a [m, k], b [k, n], out contiguous [m, n]")
    if total > MAX_TILES or (two_shot and total < world):
        raise ValueError(f"gemm_ar: {total} tiles (need at most {MAX_TILES}; two-shot at least {world})")
    if m * n > slot_elems:
        raise ValueError("gemm_ar: a slot is smaller than the output")
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    num_programs = max(1, min(num_programs, total))
    if tail is not None:
        normed, residual, norm_w, eps, weight_after_cast = tail
        if ss_part is None or ss_part.numel() < m * tn:
            raise ValueError("gemm_ar: the tail needs ss_part with m * tiles-along-n floats")
    else:
        normed, residual, norm_w, eps, weight_after_cast = out, out, out, 0.0, False
        ss_part = state  # unused
    args = (
        a, b, bias if bias is not None else out, out, normed, residual, norm_w,
        peer_data, peer_flags, state, ss_part, err,
        m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        slot_elems, tm, tn, float(eps), rank, world, max_spin,
    )  # fmt: skip
    meta = dict(
        HAS_BIAS=bias is not None, TWO_SHOT=two_shot, TAIL=tail is not None,
        WEIGHT_AFTER_CAST=bool(weight_after_cast), IEEE=a.dtype == torch.float32, NUM_PROGS=num_programs,
        BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2], num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if compile_only:  # compile (or find in Triton's cache) without launching: ranks can then start together
        gemm_ar_kernel.warmup(*args, grid=(num_programs,), **meta)
    else:
        gemm_ar_kernel[(num_programs,)](*args, **meta)


def check_error(err: torch.Tensor, group_name: str) -> None:
    """Raise if a wait of the kernel timed out (reads ``err``: a host synchronization when on the GPU)."""
    code, rank, peer, tile, epoch, kind = (int(x) for x in err[:6].tolist())
    if not code:
        return
    what = WAIT_KINDS.get(kind, f"wait kind {kind}")
    if peer < 0:
        raise RuntimeError(
            f"fluxcompile: rank {rank} of group {group_name} timed out in the kernel's {what} (call epoch {epoch}): "
            "not every program of the launch became resident"
        )
    raise RuntimeError(
        f"fluxcompile: rank {rank} of group {group_name} timed out waiting for rank {peer}'s {what} {tile} "
        f"(signal flag never reached epoch {epoch}): is every rank running the same op in the same order?"
    )
