"""matmul_reduce_scatter, ``cublas_pipelined``: cuBLAS does the math and its output is the communication; the C++
sequencer (csrc/sequences_rs.cpp) issues each call's stream operations.

Rank o owns rows ``o * rows ..`` of ``P = sum_i As[i] @ Bs[i] (+ bias)`` (``[world * rows, N]``); its result is
the sum over ranks of their partials of those rows. Every rank's symmetric buffer has one slot per source rank:
slot s holds rank s's partial of the owner's rows. Per call, on rank r, peers p in ring order (r+1 first, which
is also a reduce-scatter's send order: symm_mem/exchange.py):

  zero-copy (default):  for p: wait done_p -> mm(A[p's rows]) with ``out=`` p's slot r (the GEMM's epilogue
                        stores over NVLink straight into p's memory) -> set ready_r on p;
                        then mm(A[r's rows]) into our own slot r
  :push:                for p: mm(A[p's rows]) into a local staging slot; on the side stream: wait done_p ->
                        copy it into p's slot r (copy engine) -> set ready_r on p;  then our own block
  :unsplit / :tail<d>:  one GEMM over all rows (with 1/d of our own rows computed last, beside the pushes),
                        then the copy engine pushes each peer's block
  :stages<g>:           (family ``rs_stages``, off by default) the peers' blocks
                        in g groups, one GEMM per group, each group pushed beside the next group's GEMM
  all:                  for p: wait ready_p;  out = sum of the slots (fp32 accumulate, one rounding);
                        set done_r on every p (its slot r in our buffer is free again)
  :addmm (two ranks):   the peer's block as zero-copy; then wait ready_p -> out = A[r's rows] @ B + slot p, the
                        sum in the GEMM's epilogue (cuBLASLt, one rounding) instead of a pass of its own after
                        it -> set done_r on p
  :pushadd (two ranks): the peer's block as :push; the first half of our rows into our slot beside the push;
                        wait ready_p -> the other half as :addmm; the first half's sum as "all" below

Why this shape:
* What the others wait for leaves first, and no two ranks write into the same peer at once (Flux, Figure 7);
  the local block (no communication) goes last.
* Signals are stream memory operations (symm_mem/signals.py): no SM, so they are not stuck behind a GEMM that
  holds every SM. A flag write fences the stream's earlier writes (peer stores included) system-wide, so the
  owner sees the partial once it sees the flag.
* ``done`` keeps a fast rank from overwriting a slot the owner still reads (0/1 flags reset by their waiter: a
  CUDA graph replays the same values). It is set after the owner's whole reduction, so slots of calls with
  different shapes (other offsets) never overlap a reduction still running.
* Bias: the contract (ops.py) puts it into every rank's partial (a sum adds it ``world`` times); each rank's
  first GEMM adds its own bias (``addmm``), exactly as the reference does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...kernels.sequencer import graph_limit, sequencer, unavailable
from ...symm_mem import Comm, Workspace, comm_for
from ...symm_mem.exchange import Handshake, handshake, ring_order, slice_rows, slot_bytes, stage_plan
from ...symm_mem.workspace import generation as workspace_generation
from ..scaling import scaling_supports, sequence_args
from .layout import layout_supports, row_layout

NAME = "cublas_pipelined"
TAILS = (8, 4, 2)  # ":tail<d>": 1/d of our rows (a multiple of 64) computed beside the pushes
STAGES = (2, 3)  # ":stages<g>": the peers' blocks in g groups


def supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
    """None when this choice handles the call, else why not (the same answer on every rank)."""
    return layout_supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size) or unavailable()


def supports_scaled(
    As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, A_scales, B_scales, out_dtype,
    use_fast_accum,
) -> str | None:  # fmt: skip
    """``supports`` of the scaled calls (fp8: ``_scaled_mm`` per block of rows, cuBLASLt's fp8 GEMM; row-wise A
    scales are taken with the rows)."""
    why = layout_supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, scaled=True)
    return why or scaling_supports(As, Bs, [bias] + [None] * (len(As) - 1), A_scales, B_scales, out_dtype) or unavailable()


def tail_supports(d: int, scaled: bool = False) -> Callable[..., str | None]:
    """``supports`` of ``:tail<d>`` (of its scaled calls where ``scaled``)."""

    def supports_tail(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, *scaling) -> str | None:
        check = supports_scaled if scaled else supports
        reason = check(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, *scaling)
        if reason is not None:
            return reason
        rows = row_layout(out_shape, scatter_dim, group_size)[2]
        if slice_rows(rows, d) == 0:
            return f"{rows} rows per rank: 1/{d} of them is under 64"
        return None

    return supports_tail


def addmm_supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
    """``supports`` of ``:addmm``."""
    reason = supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)
    if reason is not None:
        return reason
    if group_size != 2:
        return f"{group_size} ranks: the peer's partial rides in our GEMM's epilogue at two ranks only"
    if not sequencer().lt_available():
        return "cuBLASLt not found: its GEMM would copy the peer's partial into the output first"
    return None


def pushadd_supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
    """``supports`` of ``:pushadd``."""
    reason = addmm_supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)
    if reason is not None:
        return reason
    rows = row_layout(out_shape, scatter_dim, group_size)[2]
    if slice_rows(rows, 2) == 0:
        return f"{rows} rows per rank: half of them is under 64"
    return None


def stages_supports(groups: int) -> Callable[..., str | None]:
    """``supports`` of ``:stages<groups>``."""

    def supports_stages(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
        return supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)

    return supports_stages


@dataclasses.dataclass
class Plan:
    """What a call signature needs besides its operands: slot views and flag addresses (their meaning:
    csrc/sequences_rs.cpp; ``j`` runs over the peers in ring order)."""

    comm: Comm  # the group's context: the data workspace ``ws`` and the side stream
    ws: Workspace
    rank: int
    world: int
    rows: int
    n: int
    shape: list[int]
    peer_slots: list[Tensor]
    stage_slots: list[Tensor]
    own_slot: Tensor
    own_slots: Tensor  # [world, rows, n]
    stage_all: Tensor | None  # unsplit, tail and stages: our whole [M, N] partial, after the slots
    hs: Handshake
    generation: int = 0  # workspace.generation() once built: the views are valid while it holds


_plans: dict[tuple, Plan] = {}


def plan(
    out_shape: Sequence[int],
    scatter_dim: int,
    group_size: int,
    group_name: str,
    dtype: torch.dtype,
    push: bool,
    unsplit: bool,
) -> Plan:
    """The plan of a call signature, made on its first call (every rank alike) and kept while no workspace was
    made or grown since."""
    key = (group_name, torch.cuda.current_device(), tuple(out_shape), scatter_dim, dtype, push, unsplit)
    p = _plans.get(key)
    if p is not None and p.generation == workspace_generation():
        return p
    _, n, rows, shape = row_layout(out_shape, scatter_dim, group_size)
    itemsize = dtype.itemsize
    slot = slot_bytes(rows * n * itemsize)
    # Slots 0..world-1: the partials of our rows by source rank; push stages ours in world..2*world-1; unsplit
    # puts our whole partial after the slots.
    stage_bytes = slot * group_size if push else rows * group_size * n * itemsize if unsplit else 0
    comm = comm_for(group_name, "matmul_reduce_scatter", world=group_size, data_bytes=slot * group_size + stage_bytes)
    ws = comm.data
    rank, world = comm.rank, comm.world
    hs = handshake(
        group_name, "matmul_reduce_scatter.flags", rank, world, ring_order(rank, world),
        f"matmul_reduce_scatter ({NAME}, {key})",
    )  # fmt: skip

    def view(owner: int, index: int) -> Tensor:
        return ws.view(owner, (rows, n), dtype, index * slot)

    mine = ws.view(rank, (world * slot // itemsize,), dtype).view(world, -1)[:, : rows * n]
    p = Plan(
        comm=comm, ws=ws, rank=rank, world=world, rows=rows, n=n, shape=shape,
        peer_slots=[view(q, rank) for q in hs.send_to],
        stage_slots=[view(rank, world + q) for q in hs.send_to] if push else [],
        own_slot=view(rank, rank),
        own_slots=mine.view(world, rows, n),
        stage_all=ws.view(rank, (world * rows, n), dtype, world * slot) if unsplit else None,
        hs=hs,
    )  # fmt: skip
    p.generation = workspace_generation()  # after the plan's own workspaces were made
    _plans[key] = p
    return p


def matmul_reduce_scatter(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], scatter_dim: int,
    reduce_op: str, group_size: int, group_name: str,
    A_scales: Sequence[Tensor] | None = None, B_scales: Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None, use_fast_accum: bool = False,
    *,
    push: bool = False,
    unsplit: bool = False,
    tail: int = 0,
    groups: int = 0,
    addmm: bool = False,
) -> Tensor:
    """The fused op's signature and output; at most one of the variant arguments is set (see the module). With
    scales (``supports_scaled``), every GEMM is ``_scaled_mm`` into partials of its out_dtype (the default,
    ``:push``, ``:unsplit`` and ``:tail<d>`` only)."""
    scaling = sequence_args(len(As), A_scales, B_scales, out_dtype, use_fast_accum)
    if B_scales is not None and (addmm or groups):
        raise ValueError(f"fluxcompile: {NAME} addmm={addmm} groups={groups} takes no scaled matmuls")
    whole = unsplit or tail > 0 or groups > 0  # one [M, N] partial in the buffer
    dtype = (out_dtype or As[0].dtype) if B_scales is not None else As[0].dtype
    p = plan(out_shape, scatter_dim, group_size, group_name, dtype, push and not whole, whole)
    seq, As, Bs = sequencer(), list(As), list(Bs)
    flags = (*p.hs.lists, p.shape, p.rank, p.rows)
    if addmm:
        if p.world != 2:
            raise ValueError(f"fluxcompile: {NAME}:addmm and :pushadd are for two ranks, not {p.world}")
        split = slice_rows(p.rows, 2) if push else 0
        if push and split == 0:
            raise ValueError(f"fluxcompile: {NAME}:pushadd does not apply to {p.rows} rows per rank")
        out = seq.rs_addmm(
            As, Bs, bias, p.peer_slots, p.stage_slots, p.own_slot, p.own_slots, *flags, split,
            p.comm.side.cuda_stream if push else 0, graph_limit(),
        )  # fmt: skip
    elif groups:
        js, flat = stage_plan(p.rank, p.world, p.rows, groups)
        out = seq.rs_stages(
            As, Bs, bias, p.stage_all, p.peer_slots, p.own_slot, p.own_slots, *flags, js, flat,
            p.comm.side.cuda_stream, graph_limit(),
        )  # fmt: skip
    elif whole:
        rows = slice_rows(p.rows, tail) if tail else 0
        if tail and rows == 0:
            raise ValueError(f"fluxcompile: {NAME} tail={tail} does not apply to {p.rows} rows per rank")
        out = seq.rs_tail(
            As, Bs, bias, p.stage_all, p.peer_slots, p.own_slot, p.own_slots, *flags, rows,
            p.comm.side.cuda_stream, graph_limit(), *scaling,
        )  # fmt: skip
    else:
        out = seq.rs_pipelined(
            As, Bs, bias, p.peer_slots, p.stage_slots, p.own_slot, p.own_slots, *flags, push,
            p.comm.side.cuda_stream if push else 0, graph_limit(), *scaling,
        )  # fmt: skip
    p.hs.note()
    return out
