"""all_gather -> GEMM as one persistent Triton kernel whose tiles wait for their rows (Flux, Alg. 2-3).

The gathered rows live in two places: this rank's shard (``a_local``) and, for every other rank, a slot
of this rank's symmetric workspace (``a_slots[src]``) that the peer fills with copy-engine pushes, one
communication chunk of ``chunk_rows`` rows at a time, setting ``flags[src, chunk] = 1`` after each chunk.
The communication chunk is decoupled from the GEMM tile (Flux section 4.3).

Tile order: the local rank's rows first (no wait), then the other ranks in ring order after the local
rank — the order their chunks arrive in — and, inside one source rank, Flux's grouped swizzle
(GROUP_M row blocks sweep the N blocks) so the tiles of one arriving chunk run together. Before a
remote tile, the program spin-waits (acquire) on the flags of the chunks its rows cover. The wait is
bounded (kernels/waits.py): after ``max_spin`` polls it records the source rank and chunk in ``err`` and
skips the tile, so a missing peer gives an error naming the rank and the signal (see :func:`check_error`), not a hang.

Several weights sharing the gathered input run in one launch (``Bs`` up to 4: their N blocks are one
index space); each has an optional bias added in the epilogue. The tiles of the first N block also store
the A rows they load into the gathered output (``a_out``), which the op returns. Loads go through plain
pointers or, on Hopper, TMA tensor descriptors (``tma=True``).

Checked on CPU with Triton's interpreter (tests/test_ag_gemm_kernel.py: tiling, ragged rows, several
weights, bias, ring order, both weight layouts under TMA, the gathered output, the timeout path) and on
GPUs by tests/gpu/test_ag_matmul.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import tma_scratch
from .waits import bounded_wait

MAX_WEIGHTS = 4
ERR_WORDS = 8  # kernels/waits.py's layout: flag, waiting rank, source rank, chunk, awaited value, kind


@dataclasses.dataclass(frozen=True)
class Variant:
    """One point of the template space offered to the autotuner."""

    block: tuple[int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K
    chunks: int  # communication chunks per shard (Flux 4.3: decoupled from the GEMM tile)
    tma: bool = True
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8


# The tile shapes offered (BENCHMARKS.md has their timings); TMA with BLOCK_N = 256 is not offered: it computes
# wrong results under Triton 3.6.
VARIANTS = {
    "tma-256x128x64-c1": Variant((256, 128, 64), 1),
    "tma-256x128x64-c4": Variant((256, 128, 64), 4),
    "tma-128x128x64-s4-c1": Variant((128, 128, 64), 1, num_stages=4),
    "tma-128x128x64-w4s4-c1": Variant((128, 128, 64), 1, num_warps=4, num_stages=4),
}
DEFAULT = "tma-256x128x64-c1"


@triton.jit
def _pick(w, x0, x1, x2, x3):
    """x_w for a runtime w in [0, 4)."""
    if w == 0:
        r = x0
    elif w == 1:
        r = x1
    elif w == 2:
        r = x2
    else:
        r = x3
    return r


@triton.jit
def _mainloop(
    a, b, a_out, rows, K, width, row0, col0, out_row0,
    stride_am, stride_ak, stride_bk, stride_bn,
    STORE_A: tl.constexpr, USE_TMA: tl.constexpr, B_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] fp32 product of rows row0.. of ``a`` and columns col0.. of ``b``; with STORE_A
    the A tiles are also stored into rows out_row0 + row0.. of ``a_out`` (contiguous [*, K])."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # Hopper's tensor-memory accelerator: descriptors made per tile, since the A rows (local shard or a
        # peer's slot) and the weight change from tile to tile. TMA zero-fills rows past ``rows``.
        a_desc = tl.make_tensor_descriptor(a, [rows, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if B_T:  # the weight is stored [N, K] (an nn.Linear weight, transposed in the graph)
            b_desc = tl.make_tensor_descriptor(b, [width, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b, [K, width], [stride_bk, 1], [BLOCK_K, BLOCK_N])
        for k0 in range(0, K, BLOCK_K):
            a_tile = a_desc.load([row0, k0])
            if B_T:
                b_tile = b_desc.load([col0, k0]).T
            else:
                b_tile = b_desc.load([k0, col0])
            if STORE_A:
                ks = k0 + offs_k
                tl.store(
                    a_out + (out_row0 + offs_m)[:, None] * K + ks[None, :],
                    a_tile,
                    mask=(offs_m[:, None] < rows) & (ks[None, :] < K),
                )
            acc = tl.dot(a_tile, b_tile, acc)
    else:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            a_mask = (offs_m[:, None] < rows) & (ks[None, :] < K)
            a_tile = tl.load(a + offs_m[:, None] * stride_am + ks[None, :] * stride_ak, mask=a_mask, other=0.0)
            b_tile = tl.load(
                b + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=(ks[:, None] < K) & (offs_n[None, :] < width),
                other=0.0,
            )
            if STORE_A:
                tl.store(a_out + (out_row0 + offs_m)[:, None] * K + ks[None, :], a_tile, mask=a_mask)
            acc = tl.dot(a_tile, b_tile, acc)
    return acc


@triton.jit
def ag_gemm_kernel(
    a_local,
    a_out,
    a_slots,
    flags,
    err,
    b0,
    b1,
    b2,
    b3,
    c0,
    c1,
    c2,
    c3,
    bias0,
    bias1,
    bias2,
    bias3,
    n0,
    n1,
    n2,
    n3,  # widths
    nt1,
    nt2,
    nt3,
    n_tiles,  # first N block of weights 1..3, total N blocks
    rank,
    world,
    rows,
    K,
    chunk_rows,
    n_chunks,
    slot_stride,
    max_spin,
    stride_am,
    stride_ak,  # of a_local and of each slot (same layout)
    sbk0,
    sbk1,
    sbk2,
    sbk3,  # the weights' strides
    sbn0,
    sbn1,
    sbn2,
    sbn3,  # (outputs are contiguous [world * rows, n_i])
    HAS_BIAS0: tl.constexpr,
    HAS_BIAS1: tl.constexpr,
    HAS_BIAS2: tl.constexpr,
    HAS_BIAS3: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STORE_A: tl.constexpr,
    USE_TMA: tl.constexpr,
    B_T: tl.constexpr,
):
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(rows, BLOCK_M)
    tiles_per_rank = m_tiles * n_tiles
    total = world * tiles_per_rank
    for t in range(pid, total, NUM_PROGS):
        step = t // tiles_per_rank
        src = (rank + step) % world
        tt = t % tiles_per_rank
        # Grouped swizzle within the source rank's row blocks.
        in_group = GROUP_M * n_tiles
        first_m = (tt // in_group) * GROUP_M
        group_m = tl.minimum(m_tiles - first_m, GROUP_M)
        pid_m = first_m + (tt % in_group) % group_m
        pid_n = (tt % in_group) // group_m
        row0 = pid_m * BLOCK_M

        ready = 1
        if src != rank:
            c_lo = row0 // chunk_rows
            c_hi = (tl.minimum(row0 + BLOCK_M, rows) - 1) // chunk_rows
            for c in range(c_lo, c_hi + 1):
                if bounded_wait(flags + src * n_chunks + c, 1, err, max_spin, rank, src, c, 0, SYS=True) == 0:
                    ready = 0

        if ready == 1:
            w = (pid_n >= nt1).to(tl.int32) + (pid_n >= nt2).to(tl.int32) + (pid_n >= nt3).to(tl.int32)
            first_n = _pick(w, 0, nt1, nt2, nt3)
            width = _pick(w, n0, n1, n2, n3)
            b = _pick(w, b0, b1, b2, b3)
            stride_bk = _pick(w, sbk0, sbk1, sbk2, sbk3)
            stride_bn = _pick(w, sbn0, sbn1, sbn2, sbn3)
            c_out = _pick(w, c0, c1, c2, c3)
            col0 = (pid_n - first_n) * BLOCK_N

            if src == rank:
                a = a_local
            else:
                a = a_slots + src * slot_stride
            offs_m = row0 + tl.arange(0, BLOCK_M)
            offs_n = col0 + tl.arange(0, BLOCK_N)
            # The first N block of each row block also writes its A rows into the gathered output (the op's
            # first result), so no copy kernel has to wait for this persistent kernel to free the SMs.
            store_here = False
            if STORE_A:
                store_here = pid_n == 0
            if store_here:
                acc = _mainloop(
                    a, b, a_out, rows, K, width, row0, col0, src * rows, stride_am, stride_ak, stride_bk, stride_bn,
                    True, USE_TMA, B_T, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
            else:
                acc = _mainloop(
                    a, b, a_out, rows, K, width, row0, col0, src * rows, stride_am, stride_ak, stride_bk, stride_bn,
                    False, USE_TMA, B_T, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
            if w == 0:
                if HAS_BIAS0:
                    acc += tl.load(bias0 + offs_n, mask=offs_n < width, other=0.0).to(tl.float32)[None, :]
            elif w == 1:
                if HAS_BIAS1:
                    acc += tl.load(bias1 + offs_n, mask=offs_n < width, other=0.0).to(tl.float32)[None, :]
            elif w == 2:
                if HAS_BIAS2:
                    acc += tl.load(bias2 + offs_n, mask=offs_n < width, other=0.0).to(tl.float32)[None, :]
            else:
                if HAS_BIAS3:
                    acc += tl.load(bias3 + offs_n, mask=offs_n < width, other=0.0).to(tl.float32)[None, :]
            out_rows = src * rows + offs_m
            tl.store(
                c_out + out_rows[:, None] * width + offs_n[None, :],
                acc.to(c_out.dtype.element_ty),
                mask=(offs_m[:, None] < rows) & (offs_n[None, :] < width),
            )


def ag_gemm(
    a_local: torch.Tensor,
    a_slots: torch.Tensor,
    flags: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    rank: int,
    world: int,
    chunk_rows: int,
    err: torch.Tensor,
    *,
    num_programs: int | None = None,
    block: tuple[int, int, int] = (128, 128, 64),
    group_m: int = 8,
    max_spin: int = 1 << 26,  # polls of about 1 µs each: a peer missing for about a minute is an error
    outs: Sequence[torch.Tensor] | None = None,
    num_warps: int = 8,
    num_stages: int = 3,
    tma: bool = False,
    a_out: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Launch the kernel: ``outs[i] = gathered_rows @ Bs[i] (+ biases[i])``, rows in rank order.

    a_local: ``[rows, K]`` this rank's shard; a_slots: ``[world, rows, K]`` (slot ``rank`` unused);
    flags: int32 ``[world, ceil(rows / chunk_rows)]``, 1 where a chunk has arrived; err: int32 ``[ERR_WORDS]``.
    a_out: if given, contiguous ``world * rows * K`` elements that receive the gathered rows (rank order).
    tma: load through device-side tensor descriptors (Hopper), see :func:`tma_unsupported`.
    """
    if not 1 <= len(Bs) <= MAX_WEIGHTS or len(Bs) != len(biases):
        raise ValueError(f"ag_gemm: 1 to {MAX_WEIGHTS} weights with as many biases, got {len(Bs)}/{len(biases)}")
    rows, k = a_local.shape
    if a_slots.shape[1:] != a_local.shape or a_slots.stride()[1:] != a_local.stride():
        raise ValueError("ag_gemm: the slots must have the local shard's shape and layout")
    if any(b.dim() != 2 or b.shape[0] != k or b.dtype != a_local.dtype for b in Bs):
        raise ValueError("ag_gemm: every weight must be [K, N] of the shard's dtype")
    bm, bn, bk = block
    n_chunks = triton.cdiv(rows, chunk_rows)
    if flags.shape != (world, n_chunks) or flags.dtype != torch.int32:
        raise ValueError(f"ag_gemm: flags must be int32 [{world}, {n_chunks}]")
    if outs is None:
        outs = [torch.empty(world * rows, b.shape[1], dtype=a_local.dtype, device=a_local.device) for b in Bs]
    if any(not o.is_contiguous() or tuple(o.shape) != (world * rows, b.shape[1]) for o, b in zip(outs, Bs)):
        raise ValueError("ag_gemm: outputs must be contiguous [world * rows, N]")
    pad = MAX_WEIGHTS - len(Bs)
    bs = [*Bs, *([Bs[0]] * pad)]
    cs = [*outs, *([outs[0]] * pad)]
    bias_list = [*biases, *([None] * pad)]
    widths = [b.shape[1] for b in bs]
    tiles = [triton.cdiv(w, bn) if i < len(Bs) else 0 for i, w in enumerate(widths)]
    starts = [sum(tiles[:i]) for i in range(1, MAX_WEIGHTS)]
    b_t = False
    if tma:
        why = tma_unsupported(a_local, a_slots.stride(0), Bs) or (a_slots.data_ptr() % 16 and "unaligned slots")
        if why:
            raise ValueError(f"ag_gemm: TMA variant: {why}")
        b_t = Bs[0].stride(0) == 1 and Bs[0].shape[1] > 1
        tma_scratch.set_allocator()
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(a_local.device).multi_processor_count if a_local.is_cuda else 4
    if a_out is not None and (not a_out.is_contiguous() or a_out.numel() != world * rows * k):
        raise ValueError("ag_gemm: a_out must be contiguous with world * rows * K elements")
    ag_gemm_kernel[(num_programs,)](
        a_local, a_out if a_out is not None else a_local, a_slots, flags, err,
        *bs, *cs, *[x if x is not None else bs[0] for x in bias_list],
        *widths, *starts, sum(tiles),
        rank, world, rows, k, chunk_rows, n_chunks, a_slots.stride(0), max_spin,
        a_local.stride(0), a_local.stride(1), *[b.stride(0) for b in bs], *[b.stride(1) for b in bs],
        *[x is not None for x in bias_list],
        NUM_PROGS=num_programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
        STORE_A=a_out is not None, USE_TMA=tma, B_T=b_t,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return list(outs)


def tma_unsupported(a_local: torch.Tensor, slot_stride: int, Bs: Sequence[torch.Tensor]) -> str | None:
    """Why the TMA variant cannot run on these operands (None if it can): TMA needs a unit inner stride,
    16-byte aligned bases and row strides, and one weight layout for all weights ([K, N] or [N, K]).
    ``slot_stride``: elements between two slots of the (aligned) symmetric workspace."""
    es = a_local.element_size()
    if a_local.stride(1) != 1:
        return "the shard's K dim is not contiguous"
    if (a_local.stride(0) * es) % 16 or (slot_stride * es) % 16:
        return "row strides are not multiples of 16 bytes"
    if a_local.data_ptr() % 16:
        return "the shard's base address is not 16-byte aligned"
    layouts = set()
    for b in Bs:
        if b.stride(1) == 1 and b.shape[1] > 1:
            layouts.add("kn")
            row = b.stride(0)
        elif b.stride(0) == 1:
            layouts.add("nk")
            row = b.stride(1)
        else:
            return "a weight with no unit stride"
        if (row * es) % 16 or b.data_ptr() % 16:
            return "a weight's row stride or base is not 16-byte aligned"
    if len(layouts) > 1:
        return "weights of different layouts ([K, N] and [N, K])"
    return None


def check_error(err: torch.Tensor, rank: int, group_name: str) -> None:
    """Raise if a wait in the kernel timed out (reads ``err``: a host synchronization)."""
    code, _, src, chunk = (int(x) for x in err[:4].tolist())
    if code:
        raise RuntimeError(
            f"fluxcompile: rank {rank} of group {group_name} timed out waiting for rank {src}'s "
            f"chunk {chunk} (signal flags[{src}, {chunk}] never became 1): is every rank running the same op?"
        )
