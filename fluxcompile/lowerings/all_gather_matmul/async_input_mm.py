"""all_gather_matmul with PyTorch's CUTLASS GEMM that waits for its input chunks
(``torch.ops.symm_mem._async_input_mm``): one GEMM launch over the whole gathered A, whose tiles of the
rank-``r`` row block start once ``signals[r]`` is set, local block first (the pivot). The copy engine pulls
the peers' shards straight into the gathered output, so A_gathered needs no further copy.

Per call, on rank r (peers p in ring order, symm_mem/exchange.py):
  main stream:  wait done_p (p finished pulling our previous shard) -> publish our shard into our symmetric
                buffer and into our rows of A_gathered (SM copies, before the GEMM) -> set ready_r on every p
                -> signals = [0..] with signals[r] = 1 -> the GEMM
  side stream:  for p: wait ready_p -> pull p's shard into its rows of A_gathered (peer-to-peer: the copy
                engine) -> signals[p] = 1 (the GEMM's tiles of p's rows start) -> set done_r on p
Constraints of the kernel (checked in ``supports``): bf16, one weight, no bias, [K, N] or [N, K]-transposed
weight, shard rows a multiple of its 128-row tile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ...symm_mem import ready_done_flags, side_stream, stream_consume, stream_write, workspace
from ...symm_mem.exchange import ring_order
from .cublas_pipelined import shard_layout

NAME = "async_input_mm"
_TILE_M = 128
_signals: dict[tuple[str, int], Tensor] = {}


def supports(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> str | None:
    if not A.is_cuda:
        return "needs CUDA tensors"
    if not hasattr(torch.ops.symm_mem, "_async_input_mm"):
        return "torch.ops.symm_mem._async_input_mm is not in this torch"
    if torch.cuda.get_device_capability(A.device) != (9, 0):
        return "its CUTLASS kernel is built for sm_90 only"
    if group_size < 2:
        return "nothing to overlap with one rank"
    if len(Bs) != 1 or biases[0] is not None:
        return "one weight without bias only"
    b = Bs[0]
    if A.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return "bf16 only"
    if math.prod(A.shape[:gather_dim]) != 1:
        return "gather dim has a leading dim of size > 1"
    if not (b.is_contiguous() or (b.stride(0) == 1 and b.stride(1) == b.shape[0])):
        return "the weight must be [K, N] contiguous or the transpose of a contiguous [N, K]"
    rows = A.numel() // A.shape[-1]
    if rows % _TILE_M:
        return f"shard rows {rows} are not a multiple of the kernel's {_TILE_M}-row tile"
    return None


def all_gather_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
) -> tuple[Tensor, list[Tensor]]:
    A, rows, k, gathered_shape = shard_layout(A, gather_dim, group_size)
    ws = workspace(group_name, A.numel() * A.element_size(), tag="async_input_mm")
    rank, world = ws.rank, ws.world_size
    ready, done = ready_done_flags(group_name, "async_input_mm.flags", world)
    signals = _signal_buffer(group_name, world)

    main, side = torch.cuda.current_stream(), side_stream()
    A_gathered = torch.empty(gathered_shape, dtype=A.dtype, device=A.device)
    rows_of = A_gathered.view(world, rows, k)
    order = ring_order(rank, world)

    for p in order:  # our buffer is free once every peer has pulled the previous shard
        stream_consume(main, done.addr(rank, p))
    ws.view(rank, (rows, k), A.dtype).copy_(A.view(rows, k))
    rows_of[rank].copy_(A.view(rows, k))
    for p in order:
        stream_write(main, ready.addr(p, rank), 1)
    signals.zero_()
    stream_write(main, signals.data_ptr() + 4 * rank, 1)
    published = torch.cuda.Event()
    published.record(main)
    out = torch.ops.symm_mem._async_input_mm(A_gathered.view(world * rows, k), Bs[0], signals, rank)

    side.wait_event(published)
    with torch.cuda.stream(side):
        for p in order:
            stream_consume(side, ready.addr(rank, p))
            rows_of[p].copy_(ws.view(p, (rows, k), A.dtype))  # peer-to-peer: the copy engine
            stream_write(side, signals.data_ptr() + 4 * p, 1)
            stream_write(side, done.addr(p, rank), 1)
    main.wait_stream(side)
    return A_gathered, [out]


def _signal_buffer(group_name: str, world: int) -> Tensor:
    key = (group_name, torch.cuda.current_device())
    if key not in _signals:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fluxcompile: run async_input_mm once eagerly before graph capture")
        _signals[key] = torch.zeros(world, dtype=torch.uint32, device="cuda")
    return _signals[key]
