"""GEMM -> reduce-scatter: a persistent Triton GEMM whose epilogue stores each finished tile straight into the
symmetric buffer of the rank that owns its rows, plus a small reduction kernel on the owner (Flux, Alg. 1).

``P = sum_i As[i] @ Bs[i] (+ bias)`` is ``[world * rows, N]``; rank ``o`` owns rows ``o * rows ..`` and its
output is ``sum over ranks s of P_s[o's rows]``. Every rank computes its partial tile by tile
(``[BLOCK_M, BLOCK_N]``, never straddling two owners) and stores it into slot ``rank`` of the owner's data
buffer (zero-copy peer stores over NVLink), then sets the tile's flag on the owner with a release atomic.
The owner's reduction kernel waits (acquire) for every peer's flag of a tile and sums the ``world`` slots in
fp32 (slot ``rank``, its own partial, was written by its own GEMM before, in stream order).

* Several products (the backward's ``g1 @ W1 + g3 @ W3``, up to 4, each with its own K and strides)
  accumulate into one fp32 accumulator: one kernel, one store per tile.
* Bias: the contract (ops.py) puts the bias into every rank's partial, so a sum adds it ``world`` times;
  each rank adds its *own* bias in its epilogue, which reproduces that exactly even when ranks' biases
  differ (adding ``world * bias`` once on the owner would not), at no extra cost.
* Tile order (Flux Figure 7): on rank r the tiles of owners r+1, r+2, ... come first and r's own last, so
  ranks do not store into the same peer at the same time and what the peers wait for leaves first.
  Within one owner, Flux's grouped swizzle (GROUP_M row blocks sweep the N blocks) for L2 reuse.
* Graph-safe flags, no reset: ``state[0]`` counts this kernel family's calls on this rank (equal on all
  ranks, as all run the same ops in the same order); a call's epoch is ``e = state[0] + 1``, the GEMM's last
  program publishes it, and a wait passes when ``flag - e >= 0``. Data slots alternate by the epoch's
  parity: a rank can be at most one call ahead of an owner still reducing (its next GEMM follows its own
  reduction, which needed that owner's partials of the same call), so parity keeps the slots apart.
* Waits are bounded (``max_spin`` polls): the first timeout records (rank, peer, tile, epoch) in ``err``,
  later waits give up at once, and :func:`check_error` raises naming the signal.

Buffers (per rank, addresses of every rank's passed in as int64 tensors): data = two parity halves of
``parity_elems`` elements, each ``world`` slots of ``slot_elems`` (slot s: rank s's partial of this rank's
rows, contiguous ``[rows, N]``); flags = int32 ``[world, MAX_TILES]`` (source rank, tile of the owner).

Checked on CPU in Triton's interpreter (tests/test_gemm_rs_kernel.py: ranks simulated with ordinary tensors)
and on GPUs by tests/gpu/test_rs_matmul.py. Its ``triton:*`` choices (lowerings/matmul_reduce_scatter/triton.py)
(family ``triton_rs``) run only where ``config.implementations`` has it (off by default: ``FLUXCOMPILE_IMPLEMENTATIONS=+triton_rs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .waits import bounded_wait

MAX_PRODUCTS = 4
MAX_TILES = 1 << 15  # flag words per source rank: tiles of one owner's rows
ERR_WORDS = 8  # code, rank, peer, tile, epoch


@dataclasses.dataclass(frozen=True)
class Variant:
    """One point of the template space offered to the autotuner."""

    block: tuple[int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8


VARIANTS = {
    "128x256x64": Variant((128, 256, 64)),
    "128x128x64": Variant((128, 128, 64), num_stages=4),
    "64x128x64": Variant((64, 128, 64), num_warps=4, num_stages=4),
}
DEFAULT = "128x256x64"


@triton.jit
def _mma(
    acc, a, b, rows_a, rows_ok, cols, K, stride_am, stride_ak, stride_bk, stride_bn, N,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """acc += a[rows_a] @ b[:, cols] over all of K (masked at the ragged ends)."""
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a_tile = tl.load(
            a + rows_a[:, None] * stride_am + kk[None, :] * stride_ak,
            mask=rows_ok[:, None] & (kk[None, :] < K), other=0.0,
        )  # fmt: skip
        b_tile = tl.load(
            b + kk[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0,
        )  # fmt: skip
        if IEEE:  # fp32 inputs: no TF32, to match the reference's numerics
            acc = tl.dot(a_tile, b_tile, acc, input_precision="ieee")
        else:
            acc = tl.dot(a_tile, b_tile, acc)
    return acc


@triton.jit
def gemm_rs_kernel(
    a0, a1, a2, a3, b0, b1, b2, b3, bias,
    peer_data, peer_flags, state, trace,
    rows, N, K0, K1, K2, K3,
    sam0, sam1, sam2, sam3, sak0, sak1, sak2, sak3,
    sbk0, sbk1, sbk2, sbk3, sbn0, sbn1, sbn2, sbn3,
    slot_elems, parity_elems, m_tiles, n_tiles, rank, world,
    HAS_BIAS: tl.constexpr, NUM_PRODUCTS: tl.constexpr, IEEE: tl.constexpr, TRACE: tl.constexpr,
    FLAG_STRIDE: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    dtype = b0.dtype.element_ty
    pid = tl.program_id(0)
    e = tl.load(state, volatile=True) + 1
    parity = e % 2
    tiles_per_owner = m_tiles * n_tiles
    total = world * tiles_per_owner
    for pos in range(pid, total, NUM_PROGS):
        owner = (rank + 1 + pos // tiles_per_owner) % world  # peers from rank+1 on, own rows last
        tt = pos % tiles_per_owner
        in_group = GROUP_M * n_tiles
        first_m = (tt // in_group) * GROUP_M
        group_m = tl.minimum(m_tiles - first_m, GROUP_M)
        tm = first_m + (tt % in_group) % group_m
        tn = (tt % in_group) // group_m
        lrows = tm * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of the owner's block
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ok = lrows < rows
        grows = owner * rows + lrows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _mma(acc, a0, b0, grows, rows_ok, cols, K0, sam0, sak0, sbk0, sbn0, N, BLOCK_K, IEEE)
        if NUM_PRODUCTS > 1:
            acc = _mma(acc, a1, b1, grows, rows_ok, cols, K1, sam1, sak1, sbk1, sbn1, N, BLOCK_K, IEEE)
        if NUM_PRODUCTS > 2:
            acc = _mma(acc, a2, b2, grows, rows_ok, cols, K2, sam2, sak2, sbk2, sbn2, N, BLOCK_K, IEEE)
        if NUM_PRODUCTS > 3:
            acc = _mma(acc, a3, b3, grows, rows_ok, cols, K3, sam3, sak3, sbk3, sbn3, N, BLOCK_K, IEEE)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        dst = tl.load(peer_data + owner).to(tl.pointer_type(dtype))
        dst += parity * parity_elems + rank * slot_elems
        mask = rows_ok[:, None] & (cols[None, :] < N)
        # .cg: the owner reads it from L2/HBM after the flag, never this SM's L1.
        tl.store(dst + lrows[:, None] * N + cols[None, :], acc.to(dtype), mask=mask, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's stores of the tile before the (cumulative) release of its flag
        tile = tm * n_tiles + tn
        flags = tl.load(peer_flags + owner).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + rank * FLAG_STRIDE + tile, e, sem="release", scope="sys")
        if TRACE:  # test hook: the order this program visited (owner, tile) in
            tl.store(trace + owner * tiles_per_owner + tile, pos)

    # The last program to finish publishes this call's epoch (for the reduction and the next call).
    tl.debug_barrier()
    done = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if done == NUM_PROGS - 1:
        tl.atomic_xchg(state + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state, e, sem="release", scope="gpu")


@triton.jit
def rs_reduce_kernel(
    out, peer_data, peer_flags, state, err,
    rows, N, slot_elems, parity_elems, m_tiles, n_tiles, rank, world, max_spin,
    FLAG_STRIDE: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[rows, N] = sum over ranks of their partials of this rank's rows, tile by tile as they arrive."""
    pid = tl.program_id(0)
    my_data = tl.load(peer_data + rank).to(tl.pointer_type(out.dtype.element_ty))
    my_flags = tl.load(peer_flags + rank).to(tl.pointer_type(tl.int32))
    e = tl.load(state, volatile=True)  # published by this call's GEMM (same stream, before us)
    parity = e % 2
    base = my_data + parity * parity_elems
    for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
        tm = t // n_tiles
        tn = t % n_tiles
        lrows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (lrows[:, None] < rows) & (cols[None, :] < N)
        offs = lrows[:, None] * N + cols[None, :]
        for step in range(1, world):
            src = (rank + step) % world
            bounded_wait(my_flags + src * FLAG_STRIDE + t, e, err, max_spin, rank, src, t, 0, True)
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for src in range(world):  # rank order on every rank: the same rounding everywhere
            acc += tl.load(base + src * slot_elems + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


def n_tiles(rows: int, n: int, block: tuple[int, int, int]) -> tuple[int, int]:
    """(tiles along one owner's rows, tiles along N)."""
    return triton.cdiv(rows, block[0]), triton.cdiv(n, block[1])


def gemm_rs(
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    out: torch.Tensor,
    peer_data: torch.Tensor,
    peer_flags: torch.Tensor,
    slot_elems: int,
    parity_elems: int,
    state: torch.Tensor,
    err: torch.Tensor,
    rank: int,
    world: int,
    *,
    block: tuple[int, int, int] = (128, 128, 64),
    group_m: int = 8,
    num_programs: int | None = None,
    reduce_programs: int | None = None,
    max_spin: int = 1 << 26,  # polls of about 1 µs: a peer missing for about a minute is an error
    num_warps: int = 8,
    num_stages: int = 3,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the GEMM and the reduction: ``out = rows rank * rows.. of reduce_scatter(sum_i As[i] @ Bs[i] +
    bias)``, i.e. this rank's ``[rows, N]`` block of the sum over ranks.

    As[i] ``[world * rows, K_i]``, Bs[i] ``[K_i, N]`` (any strides), bias ``[N]`` or None, out contiguous
    ``[rows, N]``. peer_data / peer_flags: int64 ``[world]``, every rank's data / flag buffer address as seen
    from here (see the module docstring for their layout); state: int32 ``[2]`` of this rank (zeros at first);
    err: int32 ``[ERR_WORDS]``; trace: optional int32 ``[world * tiles per owner]`` (tests: visit order).
    """
    if not 1 <= len(As) <= MAX_PRODUCTS or len(As) != len(Bs):
        raise ValueError(f"gemm_rs: 1 to {MAX_PRODUCTS} products, got {len(As)} left and {len(Bs)} right operands")
    m, n = As[0].shape[0], Bs[0].shape[1]
    dtype = Bs[0].dtype
    for a, b in zip(As, Bs):
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != m or a.shape[1] != b.shape[0] or b.shape[1] != n:
            raise ValueError("gemm_rs: every product must be [M, K_i] @ [K_i, N] with the same M and N")
        if a.dtype != dtype or b.dtype != dtype:
            raise ValueError("gemm_rs: mixed dtypes")
    if m % world:
        raise ValueError(f"gemm_rs: {m} rows do not split over {world} ranks")
    rows = m // world
    if out.shape != (rows, n) or not out.is_contiguous() or out.dtype != dtype:
        raise ValueError(f"gemm_rs: out must be contiguous [{rows}, {n}] of {dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype):
        raise ValueError("gemm_rs: bias must be [N] of the operands' dtype")
    if slot_elems < rows * n or parity_elems < world * slot_elems:
        raise ValueError("gemm_rs: slots too small for the partials")
    if 2 * parity_elems >= 2**31:  # slot offsets are 32-bit sums in the kernel
        raise ValueError("gemm_rs: data buffer of 2**31 elements or more")
    tm, tn = n_tiles(rows, n, block)
    if tm * tn > MAX_TILES:
        raise ValueError(f"gemm_rs: {tm * tn} tiles per owner exceed {MAX_TILES}")
    if peer_data.shape != (world,) or peer_flags.shape != (world,):
        raise ValueError("gemm_rs: peer_data / peer_flags must hold one address per rank")
    if trace is not None and trace.numel() < world * tm * tn:
        raise ValueError("gemm_rs: trace too small")
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count if out.is_cuda else 4
    progs = max(1, min(num_programs or sms, world * tm * tn))
    pad = MAX_PRODUCTS - len(As)
    a_l, b_l = [*As, *[As[0]] * pad], [*Bs, *[Bs[0]] * pad]
    gemm_rs_kernel[(progs,)](
        *a_l, *b_l, bias if bias is not None else out,
        peer_data, peer_flags, state, trace if trace is not None else state,
        rows, n, *[a.shape[1] for a in a_l],
        *[a.stride(0) for a in a_l], *[a.stride(1) for a in a_l],
        *[b.stride(0) for b in b_l], *[b.stride(1) for b in b_l],
        slot_elems, parity_elems, tm, tn, rank, world,
        HAS_BIAS=bias is not None, NUM_PRODUCTS=len(As), IEEE=dtype == torch.float32, TRACE=trace is not None,
        FLAG_STRIDE=MAX_TILES, NUM_PROGS=progs, BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2], GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    rprogs = max(1, min(reduce_programs or 2 * sms, tm * tn))
    rs_reduce_kernel[(rprogs,)](
        out, peer_data, peer_flags, state, err,
        rows, n, slot_elems, parity_elems, tm, tn, rank, world, max_spin,
        FLAG_STRIDE=MAX_TILES, NUM_PROGS=rprogs, BLOCK_M=block[0], BLOCK_N=block[1], num_warps=num_warps,
    )  # fmt: skip
    return out


def check_error(err: torch.Tensor, group_name: str) -> None:
    """Raise if a wait of the reduction timed out (reads ``err``: a host synchronization when on the GPU)."""
    code, rank, peer, tile, epoch = (int(x) for x in err[:5].tolist())
    if code:
        raise RuntimeError(
            f"fluxcompile: rank {rank} of group {group_name} timed out in matmul_reduce_scatter waiting for rank "
            f"{peer}'s partial tile {tile} (signal flags[{peer}, {tile}] never reached epoch {epoch}): is every "
            "rank running the same op in the same order?"
        )
