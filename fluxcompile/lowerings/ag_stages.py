"""all_gather_matmul, ``cublas_pipelined:stages<g>``: the pipelined choice with the peers' shards taken in
``g`` groups, one GEMM per group, instead of one GEMM per peer.

At 2 ranks the per-peer split is two GEMMs; at 8 it is eight GEMMs of m/8 rows each, which cost 1.5-2.9x
NCCL+cuBLAS on 8xH200 (BENCHMARKS.md, TP=8): each small GEMM loses up to a wave. Here, on rank r:

  side stream:  the pushes of ag_cublas_pipelined (rank-1 first), then the gathered output's rows
  main stream:  GEMM over our own rows (from A) while the shards fly; then for each group of consecutive
                peers in arrival order (r+1, r+2, ...): wait for their ready flags -> one GEMM over their rows,
                read from our symmetric buffer, whose slots abut into the gathered [world * rows, k]
                (a group that wraps past the last rank is two row ranges, hence two GEMMs)

The groups are as even as the peer count allows, the earlier ones no larger (they wait for fewer shards).
Experimental until its GPU tests have run: it declines unless ``FLUXCOMPILE_EXPERIMENTAL_AG_STAGES=1``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from ..symm_mem import side_stream, stream_consume, stream_write
from . import ag_cublas_pipelined as pipelined
from .sequencer import graph_limit, sequencer

ENABLED = os.environ.get("FLUXCOMPILE_EXPERIMENTAL_AG_STAGES", "0") == "1"
GROUPS = (2, 3)  # ":stages<g>" choices


def stage_groups(rank: int, world: int, groups: int) -> list[list[int]]:
    """The indices j (into the ring order ``rank+1, rank+2, ...``) of each group's peers: consecutive, in
    arrival order, ``min(groups, world - 1)`` groups, sizes as even as possible with the larger ones last."""
    peers = world - 1
    g = max(1, min(groups, peers))
    sizes = [peers // g + (i >= g - peers % g) for i in range(g)]
    out, j = [], 0
    for size in sizes:
        out.append(list(range(j, j + size)))
        j += size
    return out


def row_ranges(rank: int, world: int, rows: int, js: Sequence[int]) -> list[tuple[int, int]]:
    """The gathered rows of the peers ``(rank + 1 + j) % world`` for ``j`` in ``js`` (consecutive), as
    [lo, hi) ranges: one, or two where the group wraps past the last rank."""
    blocks = [(rank + 1 + j) % world for j in js]
    ranges: list[tuple[int, int]] = []
    for b in blocks:
        lo, hi = b * rows, (b + 1) * rows
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


@functools.cache
def stage_plan(
    rank: int, world: int, rows: int, groups: int
) -> tuple[list[list[int]], list[list[tuple[int, int]]], list[list[int]]]:
    """Per call signature, once (the calls are a hot path): each group's peer indices, its row ranges, and the
    ranges flattened to [lo0, hi0, lo1, hi1, ...] as the C++ sequencer takes them."""
    js = stage_groups(rank, world, groups)
    ranges = [row_ranges(rank, world, rows, g) for g in js]
    return js, ranges, [[x for r in rs for x in r] for rs in ranges]


def supports(groups: int):
    """``supports`` of ``:stages<groups>``."""

    def supports_stages(
        A: Tensor,
        Bs: Sequence[Tensor],
        biases: Sequence[Tensor | None],
        gather_dim: int,
        group_size: int,
        group_name: str,
    ) -> str | None:
        if not ENABLED:
            return "experimental: FLUXCOMPILE_EXPERIMENTAL_AG_STAGES=1 enables it"
        return pipelined.supports(A, Bs, biases, gather_dim, group_size, group_name) or pipelined.slots_abut(A)

    return supports_stages


def all_gather_matmul(
    A: Tensor,
    Bs: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    gather_dim: int,
    group_size: int,
    group_name: str,
    groups: int = 2,
) -> tuple[Tensor, list[Tensor]]:
    A, rows, k, gathered_shape = pipelined.shard_layout(A, gather_dim, group_size)
    plan = pipelined._plan(rows, k, A.dtype, group_size, group_name)
    if plan.buffer is None:
        raise ValueError(f"fluxcompile: {rows} x {k} shards: the slots do not abut (see ag_stages.supports)")
    a_local = A.view(rows, k)
    js, ranges, flat = stage_plan(plan.rank, plan.world, rows, groups)
    seq = sequencer()
    if seq is not None:
        out = seq.ag_stages(
            a_local, list(Bs), list(biases), gathered_shape, plan.peer_slots, plan.buffer, *plan.hs.lists,
            plan.rank, plan.world, js, flat, side_stream().cuda_stream, graph_limit(),
        )  # fmt: skip
    else:
        out = _python_stages(a_local, Bs, biases, gathered_shape, plan, js, ranges)
    plan.hs.note()
    return out


def _python_stages(a_local: Tensor, Bs, biases, gathered_shape: list[int], plan, js, ranges):
    """The same stream operations as csrc/pipelined.cpp's ag_stages, from Python (its fallback)."""
    rank, world, buf = plan.rank, plan.world, plan.buffer
    rows, k = a_local.shape
    main, side = torch.cuda.current_stream(), side_stream()
    A_gathered = torch.empty(gathered_shape, dtype=a_local.dtype, device=a_local.device)
    rows_of = A_gathered.view(world, rows, k)
    outs = [torch.empty((world * rows, b.shape[-1]), dtype=a_local.dtype, device=a_local.device) for b in Bs]
    pipelined._push_shard(plan, a_local, rows_of, main, side)
    pipelined._mm_at(a_local, Bs, biases, outs, rank * rows)
    for group, group_ranges in zip(js, ranges):
        for j in group:
            stream_consume(main, plan.hs.ready_mine[j])
        side.wait_stream(main)
        with torch.cuda.stream(side):  # the gathered output's rows of this group, beside its GEMMs
            for lo, hi in group_ranges:
                A_gathered.view(world * rows, k)[lo:hi].copy_(buf[lo:hi])
        for lo, hi in group_ranges:
            pipelined._mm_at(buf[lo:hi], Bs, biases, outs, lo)
    main.wait_stream(side)
    for addr in plan.hs.done_theirs:
        stream_write(main, addr, 1)
    return A_gathered, outs
