"""matmul_reduce_scatter, medium-grained: cuBLAS does the math, and its output is the communication.

Rank o owns rows ``o * rows ..`` of ``P = sum_i As[i] @ Bs[i] (+ bias)`` (``[world * rows, N]``); its result
is the sum over ranks of their partials of those rows. Every rank's symmetric buffer has one slot per source
rank: slot s holds rank s's partial of the owner's rows. Per call, on rank r, peers p in ring order after r:

  zero-copy (default):  for p: wait done_p -> mm(A[p's rows]) with ``out=`` p's slot r (the GEMM's epilogue
                        stores over NVLink straight into p's memory) -> set ready_r on p;
                        then mm(A[r's rows]) into our own slot r
  push:                 for p: mm(A[p's rows]) into a local staging slot; on the side stream: wait done_p ->
                        copy it into p's slot r (copy engine) -> set ready_r on p;  then our own block
  both:                 for p: wait ready_p;  out = sum of the slots (fp32 accumulate, one rounding);
                        set done_r on every p (its slot r in our buffer is free again)

Why this shape:
* The peers' row blocks go first, starting with rank + 1 (Flux Figure 7): what the others wait for leaves
  first, and no two ranks write into the same peer at the same time; the local block (no communication) last.
* Signals are stream memory operations (symm_mem/signals.py): no SM, so they are not stuck behind a GEMM
  that holds every SM (BENCHMARKS.md). A flag write fences the stream's earlier writes (peer stores
  included) system-wide, so the owner sees the partial once it sees the flag.
* ``done`` keeps a fast rank from overwriting a slot the owner still reads (0/1 flags reset by their waiter:
  a CUDA graph replays the same values). It is set after the owner's whole reduction, so slots of calls with
  different shapes (other offsets) never overlap a reduction still running.
* Bias: the contract (ops.py) puts it into every rank's partial (a sum adds it ``world`` times); each rank's
  first GEMM adds its own bias (``addmm``), exactly as the reference does.
Everything is a stream operation, so a call can be captured in a CUDA graph once its workspace and flags
exist (first eager call).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..symm_mem import Workspace, side_stream, stream_consume, stream_write, workspace
from ..symm_mem.workspace import generation as workspace_generation
from .sequencer import Handshake, graph_limit, handshake, sequencer, slice_rows

NAME = "cublas_pipelined"
TAILS = (8, 4, 2)  # ":tail<d>" choices: 1/d of our rows (a multiple of 64) computed beside the pushes
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_WORLD = 64  # flags: 64 ready + 64 done words in a 512-byte flag workspace


def row_layout(out_shape: Sequence[int], scatter_dim: int, group_size: int) -> tuple[int, int, int, list[int]]:
    """(M, N, rows per rank, this rank's output shape) for a scatter dim with no leading dims > 1, where the
    ranks' row blocks of the flattened ``[M, N]`` are contiguous: rank o's are rows ``o * rows ..``."""
    d = scatter_dim % len(out_shape)
    m, n = math.prod(out_shape[:-1]), out_shape[-1]
    shape = list(out_shape)
    shape[d] //= group_size
    return m, n, m // group_size, shape


def supports(
    As: Sequence[Tensor],
    Bs: Sequence[Tensor],
    bias: Tensor | None,
    out_shape: Sequence[int],
    scatter_dim: int,
    reduce_op: str,
    group_size: int,
    group_name: str,
) -> str | None:
    """None when this choice handles the call, else why not (the same answer on every rank)."""
    if reduce_op != "sum":
        return f"reduce_op {reduce_op!r}: only 'sum' is implemented"
    if group_size < 2:
        return "nothing to overlap with one rank"
    if group_size > _MAX_WORLD:
        return f"more than {_MAX_WORLD} ranks"
    ndim = len(out_shape)
    if ndim < 2 or not -ndim <= scatter_dim < ndim or scatter_dim % ndim == ndim - 1:
        return f"scatter dim {scatter_dim} is not a row dim of a {ndim}-D output"
    d = scatter_dim % ndim
    if math.prod(out_shape[:d]) != 1:
        # Each rank's rows would be interleaved in the flattened [M, N]: per-owner GEMMs would need
        # strided row gathers (copies), so the reference does it better.
        return "scatter dim has a leading dim of size > 1 (the ranks' rows are interleaved)"
    if out_shape[d] % group_size:
        return f"dim {d} of size {out_shape[d]} does not split over {group_size} ranks"
    if not As or len(As) != len(Bs):
        return "need as many left as right operands"
    dtype = As[0].dtype
    if any(t.dtype != dtype for t in (*As, *Bs)) or (bias is not None and bias.dtype != dtype):
        return "mixed dtypes"
    if dtype not in _DTYPES:
        return f"dtype {dtype}"
    m, n = math.prod(out_shape[:-1]), out_shape[-1]
    for a, b in zip(As, Bs):
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != m or b.shape[1] != n or a.shape[1] != b.shape[0]:
            return "operand shapes do not match out_shape"
    if bias is not None and tuple(bias.shape) not in ((n,), (1, n)):
        return "a bias with rows (only [N] or [1, N] biases are split by rows)"
    tensors = [*As, *Bs, *([bias] if bias is not None else [])]
    if not all(t.is_cuda for t in tensors):
        return "needs CUDA tensors"
    if len({t.device for t in tensors}) > 1:
        return "operands on several devices"
    return None


tail_rows = slice_rows  # rows of the tail GEMM of ``:tail<d>``


def tail_supports(d: int):
    """``supports`` of the ``:tail<d>`` choice."""

    def supports_tail(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
        reason = supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)
        if reason is not None:
            return reason
        rows = row_layout(out_shape, scatter_dim, group_size)[2]
        if tail_rows(rows, d) == 0:
            return f"{rows} rows per rank: 1/{d} of them is under 64"
        return None

    return supports_tail


@dataclasses.dataclass
class _Plan:
    """What a call signature needs besides its operands: slot views and flag addresses (see csrc/pipelined.cpp
    for the lists' meaning; ``j`` runs over the peers in ring order)."""

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
    stage_all: Tensor | None  # unsplit: our whole [M, N] partial, after the slots
    hs: Handshake  # the flags, per peer in ring order
    generation: int = 0  # workspace.generation() once built: the views are valid while it holds


_plans: dict[tuple, _Plan] = {}
_TAG = "matmul_reduce_scatter"


def _plan(
    out_shape: Sequence[int], scatter_dim: int, group_size: int, group_name: str, dtype, push: bool, unsplit: bool
) -> _Plan:
    key = (group_name, torch.cuda.current_device(), tuple(out_shape), scatter_dim, dtype, push, unsplit)
    plan = _plans.get(key)
    # A plan holds views of one buffer: valid while no workspace was made or grown since (another signature
    # may have grown this one; every rank makes the same calls, so every rank rebuilds here alike).
    if plan is not None and plan.generation == workspace_generation():
        return plan
    _, n, rows, shape = row_layout(out_shape, scatter_dim, group_size)
    itemsize = dtype.itemsize
    slot_bytes = -(-rows * n * itemsize // 256) * 256
    # Slots 0..world-1: the partials of our rows by source rank; push also stages ours in world..2*world-1;
    # unsplit puts our whole partial after the slots.
    stage_bytes = slot_bytes * group_size if push else rows * group_size * n * itemsize if unsplit else 0
    ws = workspace(group_name, slot_bytes * group_size + stage_bytes, tag=_TAG)
    rank, world = ws.rank, ws.world_size
    if world != group_size:
        raise ValueError(f"fluxcompile: group_size={group_size} but group {group_name} has {world} ranks")
    hs = handshake(
        group_name, "matmul_reduce_scatter.flags", rank, world, f"matmul_reduce_scatter (cublas_pipelined, {key})"
    )
    order = hs.order

    def slot(owner: int, index: int) -> Tensor:
        return ws.view(owner, (rows, n), dtype, index * slot_bytes)

    mine = ws.view(rank, (world * slot_bytes // itemsize,), dtype).view(world, -1)[:, : rows * n]
    plan = _Plan(
        ws=ws, rank=rank, world=world, rows=rows, n=n, shape=shape,
        peer_slots=[slot(p, rank) for p in order],
        stage_slots=[slot(rank, world + p) for p in order] if push else [],
        own_slot=slot(rank, rank),
        own_slots=mine.view(world, rows, n),
        stage_all=ws.view(rank, (world * rows, n), dtype, world * slot_bytes) if unsplit else None,
        hs=hs,
    )  # fmt: skip
    plan.generation = workspace_generation()  # after the plan's own workspaces were made
    _plans[key] = plan
    return plan


def matmul_reduce_scatter(
    As: Sequence[Tensor],
    Bs: Sequence[Tensor],
    bias: Tensor | None,
    out_shape: Sequence[int],
    scatter_dim: int,
    reduce_op: str,
    group_size: int,
    group_name: str,
    *,
    push: bool = False,
    unsplit: bool = False,
    tail: int = 0,
) -> Tensor:
    """``push``: stage each peer's block locally, the copy engine moves it; ``unsplit``: one GEMM over all
    rows, then the copy engine moves the peers' blocks (no overlap, no split: for small M); ``tail`` (d > 0):
    as unsplit, but 1/d of our own rows are computed last, beside the pushes."""
    if tail:
        plan = _plan(out_shape, scatter_dim, group_size, group_name, As[0].dtype, False, True)
        rows = tail_rows(plan.rows, tail)
        if rows == 0:
            raise ValueError(f"fluxcompile: tail {tail} does not apply to {plan.rows} rows per rank")
        out = _issue_tail(As, Bs, bias, plan, rows)
        plan.hs.note()
        return out
    plan = _plan(out_shape, scatter_dim, group_size, group_name, As[0].dtype, push, unsplit)
    out = _issue(As, Bs, bias, plan, push, unsplit)
    plan.hs.note()
    return out


def _issue(As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, plan: _Plan, push: bool, unsplit: bool):
    seq = sequencer()
    if unsplit:
        return _issue_tail(As, Bs, bias, plan, 0)
    if seq is not None:
        side = side_stream().cuda_stream if push else 0
        return seq.rs_pipelined(
            list(As), list(Bs), bias, plan.peer_slots, plan.stage_slots, plan.own_slot, plan.own_slots,
            *plan.hs.lists, plan.shape, plan.rank, plan.rows, push, side, graph_limit(),
        )  # fmt: skip
    return _python_sequence(As, Bs, bias, plan, push)


def _issue_tail(As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, plan: _Plan, tail: int) -> Tensor:
    seq = sequencer()
    if seq is not None:
        return seq.rs_tail(
            list(As), list(Bs), bias, plan.stage_all, plan.peer_slots, plan.own_slot, plan.own_slots,
            *plan.hs.lists, plan.shape, plan.rank, plan.rows, tail, side_stream().cuda_stream, graph_limit(),
        )  # fmt: skip
    return _python_tail(As, Bs, bias, plan, tail)


def _python_tail(As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, plan: _Plan, tail: int) -> Tensor:
    """The same stream operations as csrc/pipelined.cpp's rs_tail, from Python (its fallback); ``tail`` 0 is
    the unsplit choice (one GEMM over every row)."""
    rows, rank, world, main, side = plan.rows, plan.rank, plan.world, torch.cuda.current_stream(), side_stream()
    P = plan.stage_all
    m = P.shape[0]
    lo = rank * rows + (rows - tail if rank == world - 1 else 0)
    hi = lo + tail
    if tail == 0:
        _matmul_rows(As, Bs, bias, 0, m, P)
    else:
        if lo > 0:
            _matmul_rows(As, Bs, bias, 0, lo, P[:lo])
        if hi < m:
            _matmul_rows(As, Bs, bias, hi, m - hi, P[hi:])
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for j, p in enumerate(plan.hs.order):
            plan.hs.send(side, j, plan.peer_slots[j], P[p * rows : (p + 1) * rows])
    if tail > 0:
        _matmul_rows(As, Bs, bias, lo, tail, P[lo:hi])  # beside the pushes
    mine = P[rank * rows : (rank + 1) * rows]
    if world > 2:
        plan.own_slot.copy_(mine)  # so one sum covers every source
    return _reduce_and_release(plan, mine, As[0], side)


def _python_sequence(As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, plan: _Plan, push: bool):
    """The same stream operations as csrc/pipelined.cpp's rs_pipelined, from Python (its fallback)."""
    rows, main = plan.rows, torch.cuda.current_stream()

    def partial(owner: int, dst: Tensor) -> None:
        _matmul_rows(As, Bs, bias, owner * rows, rows, dst)

    if push:
        side = side_stream()
        for j, p in enumerate(plan.hs.order):
            partial(p, plan.stage_slots[j])
            side.wait_stream(main)
            with torch.cuda.stream(side):
                plan.hs.send(side, j, plan.peer_slots[j], plan.stage_slots[j])
    else:
        for j, p in enumerate(plan.hs.order):
            stream_consume(main, plan.hs.done_mine[j])
            partial(p, plan.peer_slots[j])  # zero-copy: cuBLAS stores into p's memory
            stream_write(main, plan.hs.ready_theirs[j], 1)
    partial(plan.rank, plan.own_slot)
    # With no peers the side stream did nothing (under a capture it never joined): nothing to wait for.
    return _reduce_and_release(plan, plan.own_slot, As[0], side_stream() if push and plan.hs.order else None)


def _reduce_and_release(plan: _Plan, mine: Tensor, like: Tensor, side) -> Tensor:
    """Once the peers' partials of our rows have landed: ours (``mine``) plus theirs, then our slots are free
    again for the peers (after ``side``'s pushes, if any: they read our staging)."""
    main = torch.cuda.current_stream()
    for addr in plan.hs.ready_mine:
        stream_consume(main, addr)
    out = torch.empty(plan.shape, dtype=like.dtype, device=like.device)
    out2 = out.view(plan.rows, plan.n)
    if plan.world == 1:
        out2.copy_(mine)  # one rank (tests of the sequences themselves: the choices decline it)
    elif plan.world == 2:
        torch.add(mine, plan.own_slots[plan.hs.order[0]], out=out2)  # fp32 math, one rounding
    else:
        torch.sum(plan.own_slots, dim=0, out=out2)  # accumulates in fp32, rounds once
    if side is not None:
        main.wait_stream(side)
    for addr in plan.hs.done_theirs:
        stream_write(main, addr, 1)
    return out


def _matmul_rows(As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, lo: int, count: int, dst: Tensor):
    """dst <- sum_i As[i][lo : lo + count] @ Bs[i] (+ bias), as csrc/pipelined.cpp's matmul_rows: the bias in
    the first product, later products accumulated in cuBLAS (fp32) over the sum so far."""
    hi = lo + count
    if bias is None:
        torch.mm(As[0][lo:hi], Bs[0], out=dst)
    else:
        torch.addmm(bias, As[0][lo:hi], Bs[0], out=dst)
    for a, b in zip(As[1:], Bs[1:]):
        dst.addmm_(a[lo:hi], b)
