"""all_gather_matmul, medium-grained: cuBLAS does the math, the copy engine moves the shards (push).

Per call, on rank r of a group of w, peers p in ring order after r:

  side stream:  for p in reverse ring order (r-1 first: see push_sequence): wait done_p -> copy our shard
                into slot r of p's symmetric buffer (peer-to-peer, copy engine) -> set ready_r on p;  then
                fill the gathered output: our rows from A, p's rows from slot p once it arrived
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

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..symm_mem import Workspace, side_stream, stream_consume, stream_write, workspace
from ..symm_mem.workspace import generation as workspace_generation
from .sequencer import Handshake, graph_limit, handshake, sequencer, slice_rows

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


LEADS = (8, 4, 2)  # ":lead<d>" choices: the lead GEMM takes 1/d of our rows


lead_rows = slice_rows  # rows of the lead GEMM of ``:lead<d>``


def slots_abut(A: Tensor) -> str | None:
    """None when the shards' slots abut in the symmetric buffer (no padding between them), so the buffer
    reads as the gathered ``[world * rows, k]`` (the lead and stages choices need that), else why not."""
    if (A.numel() * A.dtype.itemsize) % 256:
        return "a shard's bytes are not a multiple of 256 (the slots would not abut)"
    return None


def lead_supports(d: int):
    """``supports`` of the ``:lead<d>`` choice."""

    def supports_lead(
        A: Tensor,
        Bs: Sequence[Tensor],
        biases: Sequence[Tensor | None],
        gather_dim: int,
        group_size: int,
        group_name: str,
    ) -> str | None:
        reason = supports(A, Bs, biases, gather_dim, group_size, group_name)
        if reason is not None:
            return reason
        rows = A.numel() // A.shape[-1]
        if lead_rows(rows, d) == 0:
            return f"{rows} rows per rank: 1/{d} of them is under 64"
        return slots_abut(A)

    return supports_lead


def shard_layout(A: Tensor, gather_dim: int, group_size: int) -> tuple[Tensor, int, int, list[int]]:
    """(contiguous shard, its rows, K, the gathered shape): the shard is one block of rows of the gathered
    [M, K] (``supports`` checked the gather dim has no leading dims)."""
    A = A.contiguous()
    k = A.shape[-1]
    gathered_shape = list(A.shape)
    gathered_shape[gather_dim % A.dim()] *= group_size
    return A, A.numel() // k, k, gathered_shape


@dataclasses.dataclass
class _Plan:
    """What a call signature needs besides its operands: slot views and flag addresses (see csrc/pipelined.cpp
    for the lists' meaning; ``j`` runs over the peers in ring order)."""

    ws: Workspace
    rank: int
    world: int
    peer_slots: list[Tensor]  # slot rank in peer order[j]'s buffer: our shard goes there
    my_slots: list[Tensor]  # slot order[j] in our buffer: its shard arrives there
    hs: Handshake  # the flags, per peer in ring order
    buffer: Tensor | None  # our whole buffer as the gathered [world * rows, k], where the slots abut (lead)
    generation: int = 0  # workspace.generation() once built: the views are valid while it holds


_plans: dict[tuple, _Plan] = {}
_TAG = "all_gather_matmul"


def _plan(shard_rows: int, k: int, dtype, group_size: int, group_name: str) -> _Plan:
    key = (group_name, torch.cuda.current_device(), shard_rows, k, dtype)
    plan = _plans.get(key)
    # Views of one buffer: valid while no workspace was made or grown since (every rank rebuilds alike).
    if plan is not None and plan.generation == workspace_generation():
        return plan
    slot_bytes = -(-shard_rows * k * dtype.itemsize // 256) * 256
    ws = workspace(group_name, slot_bytes * group_size, tag=_TAG)
    rank, world = ws.rank, ws.world_size
    if world != group_size:
        raise ValueError(f"fluxcompile: group_size={group_size} but group {group_name} has {world} ranks")
    hs = handshake(group_name, "all_gather_matmul.flags", rank, world, f"all_gather_matmul (cublas_pipelined, {key})")
    order = hs.order

    def slot(owner: int, src: int) -> Tensor:  # rows from rank src, in owner's buffer
        return ws.view(owner, (shard_rows, k), dtype, src * slot_bytes)

    abut = slot_bytes == shard_rows * k * dtype.itemsize
    plan = _Plan(
        ws=ws, rank=rank, world=world,
        peer_slots=[slot(p, rank) for p in order],
        my_slots=[slot(rank, p) for p in order],
        hs=hs,
        buffer=ws.view(rank, (world * shard_rows, k), dtype) if abut else None,
    )  # fmt: skip
    plan.generation = workspace_generation()  # after the plan's own workspaces were made
    _plans[key] = plan
    return plan


def all_gather_matmul(
    A: Tensor,
    Bs: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    gather_dim: int,
    group_size: int,
    group_name: str,
    concurrent: bool = False,
    unsplit: bool = False,
    lead: int = 0,
) -> tuple[Tensor, list[Tensor]]:
    """``concurrent``: each remote block's GEMM runs on a stream of its own as soon as its rows land, beside
    the local GEMM, so one GEMM's last partial wave is filled by the next one's tiles (the split into
    per-rank GEMMs costs up to a wave each otherwise: 15% at 1024 x 14336 on 132 SMs). ``unsplit``: the copy
    engine gathers first, then one GEMM per weight over all rows (no overlap, no split: for small M).
    ``lead`` (d > 0): a GEMM over 1/d of our rows while the shards fly, then one over all other rows, read
    from the symmetric buffer (csrc/pipelined.cpp, ag_lead): two GEMMs instead of one per rank."""
    A, shard_rows, k, gathered_shape = shard_layout(A, gather_dim, group_size)
    plan = _plan(shard_rows, k, A.dtype, group_size, group_name)
    a_local = A.view(shard_rows, k)
    if lead:
        if plan.buffer is None or lead_rows(shard_rows, lead) == 0:
            raise ValueError(
                f"fluxcompile: lead {lead} does not apply to {shard_rows} x {k} shards (see lead_supports)"
            )
        outs = _issue_lead(a_local, Bs, biases, gathered_shape, plan, lead_rows(shard_rows, lead))
        plan.hs.note()
        return outs
    outs = _issue(a_local, Bs, biases, gathered_shape, plan, concurrent, unsplit)
    plan.hs.note()
    return outs


def _issue(a_local: Tensor, Bs, biases, gathered_shape: list[int], plan: _Plan, concurrent: bool, unsplit: bool):
    seq = sequencer()
    if unsplit:
        if seq is not None:
            return seq.ag_unsplit(
                a_local, list(Bs), list(biases), gathered_shape, plan.peer_slots, plan.my_slots, *plan.hs.lists,
                plan.rank, plan.world, side_stream().cuda_stream, graph_limit(),
            )  # fmt: skip
        return _python_unsplit(a_local, Bs, biases, gathered_shape, plan)
    if seq is not None:
        compute = [_compute_stream(j).cuda_stream for j in range(len(plan.hs.order))] if concurrent else []
        return seq.ag_pipelined(
            a_local, list(Bs), list(biases), gathered_shape, plan.peer_slots, plan.my_slots, *plan.hs.lists,
            plan.rank, plan.world, side_stream().cuda_stream, compute, graph_limit(),
        )  # fmt: skip
    return _python_sequence(a_local, Bs, biases, gathered_shape, plan, concurrent)


def _issue_lead(a_local: Tensor, Bs, biases, gathered_shape: list[int], plan: _Plan, lead: int):
    seq = sequencer()
    if seq is not None:
        return seq.ag_lead(
            a_local, list(Bs), list(biases), gathered_shape, plan.peer_slots, plan.buffer, *plan.hs.lists,
            plan.rank, plan.world, lead, side_stream().cuda_stream, graph_limit(),
        )  # fmt: skip
    return _python_lead(a_local, Bs, biases, gathered_shape, plan, lead)


def _python_lead(a_local: Tensor, Bs, biases, gathered_shape: list[int], plan: _Plan, lead: int):
    """The same stream operations as csrc/pipelined.cpp's ag_lead, from Python (its fallback)."""
    rank, world, buf = plan.rank, plan.world, plan.buffer
    rows, k = a_local.shape
    m = world * rows
    main, side = torch.cuda.current_stream(), side_stream()
    A_gathered = torch.empty(gathered_shape, dtype=a_local.dtype, device=a_local.device)
    rows_of = A_gathered.view(world, rows, k)
    outs = [torch.empty((m, b.shape[-1]), dtype=a_local.dtype, device=a_local.device) for b in Bs]
    _push_shard(plan, a_local, rows_of, main, side)
    buf[rank * rows : (rank + 1) * rows].copy_(a_local)  # our own slot, on main: not behind the pushes
    lead_lo = rows - lead if rank == world - 1 else 0  # so that the rest of the rows is contiguous
    lo, hi = rank * rows + lead_lo, rank * rows + lead_lo + lead
    _mm_at(a_local[lead_lo : lead_lo + lead], Bs, biases, outs, lo)
    for addr in plan.hs.ready_mine:
        stream_consume(main, addr)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for p in plan.hs.order:
            rows_of[p].copy_(buf[p * rows : (p + 1) * rows])
    if lo > 0:
        _mm_at(buf[:lo], Bs, biases, outs, 0)
    if hi < m:
        _mm_at(buf[hi:], Bs, biases, outs, hi)
    main.wait_stream(side)
    for addr in plan.hs.done_theirs:
        stream_write(main, addr, 1)
    return A_gathered, outs


def _mm_at(a: Tensor, Bs, biases, outs: list[Tensor], lo: int) -> None:
    """Rows ``lo .. lo + len(a)`` of every output: ``a @ B (+ bias)``."""
    for b, bias, out in zip(Bs, biases, outs):
        dst = out[lo : lo + a.shape[0]]
        if bias is None:
            torch.mm(a, b, out=dst)
        else:
            torch.addmm(bias, a, b, out=dst)


def _python_sequence(a_local: Tensor, Bs, biases, gathered_shape: list[int], plan: _Plan, concurrent: bool):
    """The same stream operations as csrc/pipelined.cpp's ag_pipelined, from Python (its fallback)."""
    rank, world = plan.rank, plan.world
    shard_rows, k = a_local.shape
    main = torch.cuda.current_stream()
    side = side_stream()
    A_gathered = torch.empty(gathered_shape, dtype=a_local.dtype, device=a_local.device)
    rows_of = A_gathered.view(world, shard_rows, k)  # rank i's rows (gather dim has no leading dims)
    outs = [torch.empty((world * shard_rows, b.shape[-1]), dtype=a_local.dtype, device=a_local.device) for b in Bs]
    _push_shard(plan, a_local, rows_of, main, side)

    compute = [_compute_stream(j) if concurrent else main for j in range(len(plan.hs.order))]
    for s in compute:
        if s is not main:
            s.wait_stream(main)  # A, the outputs and the flag reset are ready
    _mm_at(a_local, Bs, biases, outs, rank * shard_rows)
    for j, (p, s) in enumerate(zip(plan.hs.order, compute)):
        with torch.cuda.stream(s):
            stream_consume(s, plan.hs.ready_mine[j])
            side.wait_stream(s)
            with torch.cuda.stream(side):
                rows_of[p].copy_(plan.my_slots[j])
            _mm_at(plan.my_slots[j], Bs, biases, outs, p * shard_rows)
    for s in compute:
        if s is not main:
            main.wait_stream(s)
    main.wait_stream(side)
    for addr in plan.hs.done_theirs:
        stream_write(main, addr, 1)
    return A_gathered, outs


def _python_unsplit(a_local: Tensor, Bs, biases, gathered_shape: list[int], plan: _Plan):
    """The same stream operations as csrc/pipelined.cpp's ag_unsplit, from Python (its fallback)."""
    world = plan.world
    shard_rows, k = a_local.shape
    main, side = torch.cuda.current_stream(), side_stream()
    A_gathered = torch.empty(gathered_shape, dtype=a_local.dtype, device=a_local.device)
    rows_of = A_gathered.view(world, shard_rows, k)
    _push_shard(plan, a_local, rows_of, main, side)
    with torch.cuda.stream(side):
        for j, p in enumerate(plan.hs.order):
            stream_consume(side, plan.hs.ready_mine[j])
            rows_of[p].copy_(plan.my_slots[j])
        for addr in plan.hs.done_theirs:
            stream_write(side, addr, 1)  # our slots are free again
    main.wait_stream(side)
    all_rows = A_gathered.view(world * shard_rows, k)
    outs = [torch.mm(all_rows, b) if x is None else torch.addmm(x, all_rows, b) for b, x in zip(Bs, biases)]
    return A_gathered, outs


def push_sequence(peers: int) -> list[int]:
    """The order (indices j into the ring order ``order = rank+1, rank+2, ...``) in which a rank pushes its
    shard: rank-1 first, then rank-2, ... Every rank consumes its peers' shards in ring order (rank+1 first),
    and rank+1 pushes to rank at its first step, rank+2 at its second, so shards land in the order they are
    consumed; at each step the ranks push to distinct peers. (Pushing in ring order too, as before, made each
    rank's first remote GEMM wait for the shard that lands last: no overlap beyond the local GEMM at 4+ ranks.)
    csrc/pipelined.cpp's push_shard loops the same way."""
    return list(range(peers - 1, -1, -1))


def _push_shard(plan: _Plan, a_local: Tensor, rows_of: Tensor, main, side) -> None:
    """On the side stream, once A is ready: our shard into each peer's slot (the copy engine), then into our
    rows of the gathered output."""
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for j in push_sequence(len(plan.hs.order)):
            plan.hs.send(side, j, plan.peer_slots[j], a_local)
        rows_of[plan.rank].copy_(a_local)


_compute_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _compute_stream(i: int) -> torch.cuda.Stream:
    key = (torch.cuda.current_device(), i)
    if key not in _compute_streams:
        _compute_streams[key] = torch.cuda.Stream()
    return _compute_streams[key]
