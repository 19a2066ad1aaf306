"""The reduction of a reduce-scatter's received slots: ``out = scale * (own + sum of the peers' slots)`` as one
small Triton kernel, per output tile our own chunk read in place (strided for columns) plus the w-1 slots, summed
in fp32 in ring order, rounded once into the output. One launch, no temporary; torch ops would need an fp32
temporary and 3+ launches. The CUTLASS reduce-scatter choice (lowerings/matmul_reduce_scatter/cutlass.py) runs it.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover  (Triton comes with torch's CUDA builds)
    triton = None


if triton is not None:

    @triton.jit
    def reduce_slots_kernel(
        slots, own, out, R, C, ld_own, slot_elems, rank, world, scale,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """out[R, C] = scale * (own[R, C] (row stride ld_own) + sum of slots[s] for s != rank), fp32."""
        pid = tl.program_id(0)
        tiles_c = tl.cdiv(C, BLOCK_C)
        r = (pid // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = (pid % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < R) & (c[None, :] < C)
        rc = r[:, None].to(tl.int64) * C + c[None, :]
        acc = tl.load(own + r[:, None].to(tl.int64) * ld_own + c[None, :], mask=mask, other=0.0).to(tl.float32)
        for j in range(1, world):
            s = (rank + j) % world
            acc += tl.load(slots + s.to(tl.int64) * slot_elems + rc, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + rc, (acc * scale).to(out.dtype.element_ty), mask=mask)


_loaded: set[tuple] = set()


def load_reduction(slots: Tensor, own: Tensor, rank: int) -> None:
    """Run the reduction once per signature before the call's GEMM (its result unused): loading a kernel's module
    waits for the device, which must not happen while this rank's GEMM waits for peers that have not launched."""
    key = (slots.device, slots.dtype, tuple(slots.shape), own.stride(0), rank)
    if key in _loaded or torch.cuda.is_current_stream_capturing():
        return
    reduce_slots(slots, own, torch.empty(own.shape, dtype=own.dtype, device=own.device), rank, 1.0)
    _loaded.add(key)


def reduce_slots(slots: Tensor, own: Tensor, out: Tensor, rank: int, scale: float) -> None:
    """``out = scale * (own + sum_{s != rank} slots[s])`` in fp32 on the current stream. ``slots`` is
    contiguous ``[world, R, C]``, ``own`` ``[R, C]`` with unit column stride, ``out`` contiguous ``[R, C]``."""
    world, rows, cols = slots.shape
    if triton is None:  # pragma: no cover
        acc = own.float()
        for j in range(1, world):
            acc += slots[(rank + j) % world].float()
        out.copy_(acc * scale)
        return
    block_c = min(256, triton.next_power_of_2(cols))
    block_r = max(1, 4096 // block_c)
    grid = (triton.cdiv(rows, block_r) * triton.cdiv(cols, block_c),)
    reduce_slots_kernel[grid](
        slots, own, out, rows, cols, own.stride(0), rows * cols, rank, world, scale,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
