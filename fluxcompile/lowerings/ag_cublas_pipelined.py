"""all_gather_matmul, medium-grained: cuBLAS does the math, the copy engine moves the shards (push).

Per call, on rank r of a group of w, peers p in ring order after r:

  side stream:  for p: wait done_p -> copy our shard into slot r of p's symmetric buffer (peer-to-peer,
                copy engine) -> set ready_r on p;  then fill the gathered output: our rows from A, p's rows
                from slot p once it arrived
  main stream:  mm(A) into our rows of the output;  for p: wait ready_p -> mm(slot p) into p's rows;
                wait for the side stream -> set done_r on every p (its slot r in our buffer is free)

Why this shape (measured on 2xH200, see BENCHMARKS.md):
* cuBLAS's Hopper GEMMs hold every SM until they finish, so anything that needs an SM beside one — a
  barrier kernel, and also a same-device memcpy, which the driver runs as a kernel — waits for the GEMM's
  last partial wave. Signals are therefore stream memory operations (symm_mem/signals.py, no SM), and the
  shard travels by a peer-to-peer copy, which the copy engine does (370 GB/s), straight into the peer's
  buffer where its GEMM reads it: no publish copy, no pull.
* The gathered output (the op's first result) is filled by SM copies queued on the side stream; they run
  in the GEMM's tail instead of after it.
* ``done`` keeps a sender from overwriting a slot the receiver still reads (graph-safe 0/1 flags).
Each chunk's product is written in place into its rows of the output. Everything is a stream operation,
so a call can be captured in a CUDA graph once its workspace and flags exist (first eager call).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..schedules.orders import ring_after
from ..symm_mem import ready_done_flags, side_stream, stream_wait, stream_write, workspace

NAME = "cublas_pipelined"


def supports(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> str | None:
    """None when this choice handles the call, else why not."""
    if not A.is_cuda:
        return "needs CUDA tensors"
    if group_size < 2:
        return "nothing to overlap with one rank"
    if math.prod(A.shape[:gather_dim]) != 1:
        # Each rank's rows would be interleaved in the flattened [M, K]: per-chunk products would land
        # in strided rows (a copy), so the reference does it better.
        return "gather dim has a leading dim of size > 1"
    if any(b.dtype != A.dtype for b in Bs) or any(x is not None and x.dtype != A.dtype for x in biases):
        return "mixed dtypes"
    if any(x is not None and x.dim() > 1 and x.shape[0] != 1 for x in biases):
        return "a bias with rows (only [N] or [1, N] biases are split by rows)"
    return None


def shard_layout(A: Tensor, gather_dim: int, group_size: int) -> tuple[Tensor, int, int, list[int]]:
    """(contiguous shard, its rows, K, the gathered shape): the shard is one block of rows of the gathered
    [M, K] (``supports`` checked the gather dim has no leading dims)."""
    A = A.contiguous()
    k = A.shape[-1]
    gathered_shape = list(A.shape)
    gathered_shape[gather_dim % A.dim()] *= group_size
    return A, A.numel() // k, k, gathered_shape


def all_gather_matmul(
    A: Tensor,
    Bs: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    gather_dim: int,
    group_size: int,
    group_name: str,
    concurrent: bool = False,
) -> tuple[Tensor, list[Tensor]]:
    """``concurrent``: each remote block's GEMM runs on a stream of its own as soon as its rows land, beside
    the local GEMM, so one GEMM's last partial wave is filled by the next one's tiles (the split into
    per-rank GEMMs costs up to a wave each otherwise: 15% at 1024 x 14336 on 132 SMs)."""
    A, shard_rows, k, gathered_shape = shard_layout(A, gather_dim, group_size)
    slot_bytes = -(-A.numel() * A.element_size() // 256) * 256
    ws = workspace(group_name, slot_bytes * group_size, tag="all_gather_matmul")
    rank, world = ws.rank, ws.world_size
    if world != group_size:
        raise ValueError(f"fluxcompile: group_size={group_size} but group {group_name} has {world} ranks")
    ready, done = ready_done_flags(group_name, "all_gather_matmul.flags", world)

    main = torch.cuda.current_stream()
    side = side_stream()
    A_gathered = torch.empty(gathered_shape, dtype=A.dtype, device=A.device)
    rows_of = A_gathered.view(group_size, shard_rows, k)  # rank i's rows (gather dim has no leading dims)
    outs = [torch.empty((group_size * shard_rows, b.shape[-1]), dtype=A.dtype, device=A.device) for b in Bs]
    a_local = A.view(shard_rows, k)
    order = ring_after(rank, world)  # Flux's ring after the local rank, from the schedule library

    def slot(owner: int, src: int) -> Tensor:  # rows from rank src, in owner's buffer
        return ws.view(owner, (shard_rows, k), A.dtype, src * slot_bytes)

    side.wait_stream(main)  # A is ready
    with torch.cuda.stream(side):
        for p in order:
            stream_wait(side, done.addr(rank, p), 1)
            stream_write(side, done.addr(rank, p), 0)
            slot(p, rank).copy_(a_local)  # peer-to-peer: the copy engine
            stream_write(side, ready.addr(p, rank), 1)
        rows_of[rank].copy_(a_local)

    compute = [_compute_stream(i) if concurrent else main for i in range(len(order))]
    for s in compute:
        if s is not main:
            s.wait_stream(main)  # A, the outputs and the flag reset are ready
    _mm_rows(a_local, Bs, biases, outs, rank, shard_rows)
    for p, s in zip(order, compute):
        with torch.cuda.stream(s):
            stream_wait(s, ready.addr(rank, p), 1)
            stream_write(s, ready.addr(rank, p), 0)
            arrived = torch.cuda.Event()
            arrived.record(s)
            with torch.cuda.stream(side):
                side.wait_event(arrived)
                rows_of[p].copy_(slot(rank, p))
            _mm_rows(slot(rank, p), Bs, biases, outs, p, shard_rows)
    for s in compute:
        if s is not main:
            main.wait_stream(s)
    main.wait_stream(side)
    for p in order:
        stream_write(main, done.addr(p, rank), 1)
    return A_gathered, outs


_compute_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _compute_stream(i: int) -> torch.cuda.Stream:
    key = (torch.cuda.current_device(), i)
    if key not in _compute_streams:
        _compute_streams[key] = torch.cuda.Stream()
    return _compute_streams[key]


def _mm_rows(a: Tensor, Bs, biases, outs: list[Tensor], src: int, rows: int) -> None:
    for b, bias, out in zip(Bs, biases, outs):
        dst = out[src * rows : (src + 1) * rows]
        if bias is None:
            torch.mm(a, b, out=dst)
        else:
            torch.addmm(bias, a, b, out=dst)
