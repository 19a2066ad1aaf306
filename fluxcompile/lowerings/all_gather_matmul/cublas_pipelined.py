"""all_gather_matmul, ``cublas_pipelined``: cuBLAS does the math, the copy engine moves the shards (push), and
the C++ sequencer (csrc/sequences_ag.cpp) issues each call's stream operations.

Per call, on rank r of a group of w (peers in the exchange's orders, symm_mem/exchange.py):

  side stream:  for p in the send order (r-1 first): wait done_p -> copy our shard into slot r of p's symmetric
                buffer (peer to peer, copy engine) -> set ready_r on p;  then fill the gathered output: our rows
                from A, p's rows from slot p once it arrived
  main stream:  mm(A) into our rows of the output;  for p in ring order (r+1 first): wait ready_p -> mm(slot p)
                into p's rows;  wait for the side stream -> set done_r on every p (its slot r here is free)

Why this shape:
* cuBLAS's Hopper GEMMs hold every SM until they finish, so anything beside one that needs an SM (a barrier
  kernel, a same-device memcpy, which the driver runs as a kernel) waits for the GEMM's last wave. Signals are
  stream memory operations (symm_mem/signals.py, no SM), and the shard travels by a peer-to-peer copy, which
  the copy engine does, straight into the peer's buffer where its GEMM reads it: no publish copy, no pull.
* The gathered output (the op's first result) is filled by copies queued on the side stream; they run in the
  GEMM's tail instead of after it.
* ``done`` keeps a sender from overwriting a slot the receiver still reads (graph-safe 0/1 flags).

Variants: ``:concurrent`` runs each remote block's GEMM on a stream of its own as soon as its rows land, beside
the local GEMM, so one GEMM's last partial wave is filled by the next one's tiles; ``:unsplit`` gathers first,
then one GEMM per weight over all rows (no overlap, no split: small M); ``:lead<d>`` runs a GEMM over 1/d of our
rows while the shards fly (and, beside it on another stream, our other rows are copied into our slot), then one
over all other rows read from the symmetric buffer, whose slots abut into the gathered ``[world * rows, k]``;
``:stages<g>`` (family ``ag_stages``, off by default) takes the peers in ``g``
groups, one GEMM per group, instead of one GEMM per peer. Everything is a stream operation, so a call can be captured in a CUDA graph
once its workspace and flags exist (first eager call). The GEMMs run at high stream priority, the copies at
normal: a copy that becomes ready with a GEMM takes only the SMs the GEMM leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...kernels.sequencer import graph_limit, sequencer, unavailable
from ...symm_mem import Comm, Workspace, comm_for
from ...symm_mem.exchange import Handshake, gather_send_order, handshake, slice_rows, slot_bytes, stage_plan
from ...symm_mem.workspace import generation as workspace_generation
from ..scaling import rowwise, scaling_supports, sequence_args
from .layout import layout_supports, shard_layout

NAME = "cublas_pipelined"
LEADS = (8, 4, 2)  # ":lead<d>": the lead GEMM takes 1/d of our rows
STAGES = (2, 3)  # ":stages<g>": the peers in g groups


def supports(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> str | None:
    """None when this choice handles the call, else why not (the same answer on every rank)."""
    return layout_supports(A, Bs, biases, gather_dim, group_size) or unavailable()


def supports_scaled(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    A_scale: Tensor, B_scales: Sequence[Tensor], out_dtype: torch.dtype | None, use_fast_accum: bool,
) -> str | None:  # fmt: skip
    """``supports`` of the scaled calls (fp8: ``_scaled_mm`` per block of rows, cuBLASLt's fp8 GEMM): a tensor-wise
    A scale (a row-wise one would travel with the rows; PyTorch's choice gathers it)."""
    why = layout_supports(A, Bs, biases, gather_dim, group_size, scaled=True)
    why = why or scaling_supports([A] * len(Bs), Bs, biases, [A_scale] * len(Bs), B_scales, out_dtype)
    if why is None and rowwise(A_scale):
        why = "a row-wise A scale (it would travel with the rows)"
    return why or unavailable()


def _slots_abut(A: Tensor) -> str | None:
    """None when the shards' slots abut in the symmetric buffer, so it reads as the gathered ``[world * rows, k]``."""
    nbytes = A.numel() * A.dtype.itemsize
    if slot_bytes(nbytes) != nbytes:
        return "a shard's bytes are not a multiple of 256 (the slots would not abut)"
    return None


def lead_supports(d: int) -> Callable[..., str | None]:
    """``supports`` of ``:lead<d>``."""

    def supports_lead(A, Bs, biases, gather_dim, group_size, group_name) -> str | None:
        reason = supports(A, Bs, biases, gather_dim, group_size, group_name)
        if reason is not None:
            return reason
        rows = A.numel() // A.shape[-1]
        if slice_rows(rows, d) == 0:
            return f"{rows} rows per rank: 1/{d} of them is under 64"
        return _slots_abut(A)

    return supports_lead


def stages_supports(groups: int) -> Callable[..., str | None]:
    """``supports`` of ``:stages<groups>``."""

    def supports_stages(A, Bs, biases, gather_dim, group_size, group_name) -> str | None:
        return supports(A, Bs, biases, gather_dim, group_size, group_name) or _slots_abut(A)

    return supports_stages


@dataclasses.dataclass
class Plan:
    """What a call signature needs besides its operands: slot views and flag addresses (their meaning:
    csrc/sequences_ag.cpp). ``peer_slots`` follow the handshake's send order, ``my_slots`` its ring order."""

    comm: Comm  # the group's context: the data workspace ``ws`` and the side stream
    ws: Workspace
    rank: int
    world: int
    peer_slots: list[Tensor]  # slot rank in peer send_to[j]'s buffer: our shard goes there
    my_slots: list[Tensor]  # slot recv_from[j] in our buffer: its shard arrives there
    hs: Handshake
    buffer: Tensor | None  # our whole buffer as the gathered [world * rows, k], where the slots abut
    generation: int = 0  # workspace.generation() once built: the views are valid while it holds


_plans: dict[tuple, Plan] = {}


def plan(shard_rows: int, k: int, dtype: torch.dtype, group_size: int, group_name: str) -> Plan:
    """The plan of a call signature, made on its first call (every rank alike) and kept while no workspace was
    made or grown since."""
    key = (group_name, torch.cuda.current_device(), shard_rows, k, dtype)
    p = _plans.get(key)
    if p is not None and p.generation == workspace_generation():
        return p
    nbytes = shard_rows * k * dtype.itemsize
    slot = slot_bytes(nbytes)
    comm = comm_for(group_name, "all_gather_matmul", world=group_size, data_bytes=slot * group_size)
    ws = comm.data
    rank, world = comm.rank, comm.world
    hs = handshake(
        group_name, "all_gather_matmul.flags", rank, world, gather_send_order(rank, world),
        f"all_gather_matmul ({NAME}, {key})",
    )  # fmt: skip

    def view(owner: int, src: int) -> Tensor:  # the rows from rank src, in owner's buffer
        return ws.view(owner, (shard_rows, k), dtype, src * slot)

    p = Plan(
        comm=comm, ws=ws, rank=rank, world=world,
        peer_slots=[view(q, rank) for q in hs.send_to],
        my_slots=[view(rank, q) for q in hs.recv_from],
        hs=hs,
        buffer=ws.view(rank, (world * shard_rows, k), dtype) if slot == nbytes else None,
    )  # fmt: skip
    p.generation = workspace_generation()  # after the plan's own workspaces were made
    _plans[key] = p
    return p


def all_gather_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    A_scale: Tensor | None = None, B_scales: Sequence[Tensor] | None = None, out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
    *,
    concurrent: bool = False,
    unsplit: bool = False,
    lead: int = 0,
    groups: int = 0,
    return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:
    """The fused op's signature and outputs; at most one of the variant arguments is set (see the module). With
    ``return_A`` False the C++ sequences neither assemble nor return the gathered output, but ``:unsplit``, whose
    GEMMs read it. With scales (``supports_scaled``), every GEMM is ``_scaled_mm`` (the default, ``:concurrent``
    and ``:unsplit`` only)."""
    n = len(Bs)
    scaling = sequence_args(n, None if A_scale is None else [A_scale] * n, B_scales, out_dtype, use_fast_accum)
    if B_scales is not None and (lead or groups):
        raise ValueError(f"fluxcompile: {NAME} lead={lead} groups={groups} takes no scaled matmuls")
    A, rows, k, gathered_shape = shard_layout(A, gather_dim, group_size)
    p = plan(rows, k, A.dtype, group_size, group_name)
    a = A.view(rows, k)
    seq, side = sequencer(), p.comm.side.cuda_stream
    common = (a, list(Bs), list(biases), gathered_shape, p.peer_slots)
    if lead or groups:
        if p.buffer is None or (lead and slice_rows(rows, lead) == 0):
            raise ValueError(f"fluxcompile: {NAME} lead={lead} groups={groups} does not apply to {rows} x {k} shards")
        if lead:
            aux = _copy_stream().cuda_stream  # the copy of our other rows into our slot
            result = seq.ag_lead(
                *common, p.buffer, *p.hs.lists, p.rank, p.world, slice_rows(rows, lead), side, aux, graph_limit(),
                return_A,
            )
        else:
            js, flat = stage_plan(p.rank, p.world, rows, groups)
            result = seq.ag_stages(
                *common, p.buffer, *p.hs.lists, p.rank, p.world, js, flat, side, graph_limit(), return_A
            )
    elif unsplit:
        result = seq.ag_unsplit(*common, p.my_slots, *p.hs.lists, p.rank, p.world, side, graph_limit(), *scaling)
    else:
        compute = [_compute_stream(j).cuda_stream for j in range(p.world - 1)] if concurrent else []
        result = seq.ag_pipelined(
            *common, p.my_slots, *p.hs.lists, p.rank, p.world, side, compute, graph_limit(), return_A, *scaling
        )
    p.hs.note()
    A_gathered, outs = result
    return (A_gathered if return_A else None), outs


_streams: dict[tuple[int, str, int], torch.cuda.Stream] = {}


def _compute_stream(i: int) -> torch.cuda.Stream:
    """``:concurrent``'s GEMM stream for the i-th peer: high priority, like the sequences' own GEMM stream
    (csrc/streams.cpp, ``gemm_stream``), so that the SM copies beside a GEMM take only the SMs it leaves."""
    return _stream("gemm", i, priority=-1)


def _copy_stream() -> torch.cuda.Stream:
    """``:lead``'s stream for the copy of our rows into our slot, beside the lead GEMM."""
    return _stream("copy", 0, priority=0)


def _stream(kind: str, i: int, priority: int) -> torch.cuda.Stream:
    key = (torch.cuda.current_device(), kind, i)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(priority=priority)
    return _streams[key]
