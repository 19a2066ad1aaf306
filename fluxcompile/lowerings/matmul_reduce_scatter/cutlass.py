"""matmul_reduce_scatter with the Flux-style CUTLASS GEMM (kernels/cutlass_gemm.py, csrc/flux_gemm.cuh): one
persistent sm_90a GEMM writes this rank's whole partial and counts its stored tiles per owner's chunk; the copy
engine pushes each owner's chunk as soon as its count is complete; the owner reduces.

``P = A @ B (+ bias)`` is ``[m, n]`` (one pair); owner o's part is chunk o along the scatter axis: rows
``o * m/w ..`` (a row dim with no leading dims > 1) or columns ``o * n/w ..`` (the last dim, any leading dims).
Every rank's symmetric data buffer holds w receive slots (slot s: rank s's partial of our chunk, contiguous
``[rows, n]`` or ``[m, n/w]``) and then its own whole P. Per call, on rank r (owners p in ring order, r+1 first:
what the next rank waits for leaves first, and no two ranks push into the same owner at once):
  side stream:  for p: wait counters[p] == tiles_per_chunk[p] (every tile of p's chunk stored) -> reset it to 0
                -> wait done_p (our slot in p's buffer is free) -> copy P's chunk p into slot r of p's buffer
                (copy engine; a column chunk is a 2-D strided copy) -> set ready_r on p
  main stream:  ``gemm`` into P with ``signal=(counters, chunk, axis)`` and ``rotate`` starting at p = r+1's
                chunk (own chunk last) -> reset our own chunk's counter -> wait ready_p of every peer
                -> out = reduction of our own chunk of P and the w-1 received slots -> set done_r on every p
                -> join the side stream
The C++ sequencer (csrc/sequences_flux.cpp's ``rs_flux``, through ``cutlass_gemm.rs_sequence``) issues these
operations, a call seen before as one CUDA graph (``config.sequence_graphs``); the views and flag addresses are
computed once per call signature (:func:`plan`). Without the sequencer the choices decline.
Why this shape: the GEMM holds the SMs and signals without a kernel beside it (its epilogue counts tiles); the
pushes and flags are copy-engine and stream memory operations (no SM, symm_mem/signals.py), so they run under
the GEMM. Counters, ready and done are reset by their waiter (0/1 flags, or a count back to 0): CUDA graphs
replay them.

Bias: the contract (ops.py) puts the bias into every rank's partial, so a sum adds it w times (an average once).
Each rank's GEMM adds its *own* bias in its epilogue, as the reference's addmm does: exact even where the ranks'
biases differ, at no cost, and the reduction needs no bias.

The reduction: one small CUDA kernel (csrc/slot_reduce.cu, in the CUTLASS GEMM's extension): our own chunk read
in place in P (strided for columns) plus the w-1 slots, summed in fp32 in ring order from our own, scaled by 1/w
for ``avg``, rounded once into the output: deterministic run to run. One launch, no temporary.

The communication context (``symm_mem.Comm``: workspaces, side stream, error words, watch) comes from
``symm_mem.comm_for``, as the all-gather choice's does; the ranks it holds and the reasons both decline are
kernels/cutlass_gemm.py's. Stream-K variants cannot count tiles: they decline.

Family ``cutlass``, on by default: its choices decline every call while ``config.implementations`` leaves it out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...kernels import cutlass_gemm, sequencer
from ...symm_mem import Comm, ErrorSpec, FlagArray, comm_for
from ...symm_mem.exchange import ring_order, slot_bytes
from ...symm_mem.watchdog import read_flags

NAME = "cutlass"
MAX_WORLD = cutlass_gemm.MAX_WORLD

_DTYPES = (torch.bfloat16, torch.float16)
# The flag workspace: counters (uint32 per owner chunk, start 0), ready (start 0), done (start 1), each [world].
_COUNTERS_OFFSET = 0
_READY_OFFSET = 4 * MAX_WORLD
_DONE_OFFSET = 8 * MAX_WORLD
FLAG_BYTES = 12 * MAX_WORLD
TAG = "matmul_reduce_scatter.cutlass"
# The error words of the CUTLASS GEMM's waits (``cutlass_gemm.check_error`` reads them).
ERRORS = ErrorSpec(cutlass_gemm.ERR_WORDS, "the CUTLASS choices")


# --- supports -------------------------------------------------------------------------------------------


def scatter_axis(out_shape: Sequence[int], scatter_dim: int) -> int:
    """0 when the owners' parts are row blocks of the flattened ``[m, n]``, 1 when they are column blocks."""
    ndim = len(out_shape)
    return 1 if scatter_dim % ndim == ndim - 1 else 0


def supports(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], scatter_dim: int,
    reduce_op: str, group_size: int, group_name: str,
) -> str | None:  # fmt: skip
    """None when the CUTLASS choices handle the call, else why not (the same on every rank; never raises)."""
    try:
        return _supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size)
    except Exception as e:  # a broken check declines
        return f"supports() raised {type(e).__name__}: {e}"


def _supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size) -> str | None:
    why = cutlass_gemm.group_declines(group_size, As[0])
    if why is not None:
        return why
    if len(As) != 1 or len(Bs) != 1:
        return "a sum of several products (one (A, B) pair only)"
    A, B = As[0], Bs[0]
    if reduce_op not in ("sum", "avg"):
        return f"reduce_op {reduce_op!r} (sum and avg only)"
    if A.dtype not in _DTYPES:
        return f"dtype {A.dtype} (bf16 and fp16 only)"
    if B.dtype != A.dtype or (bias is not None and bias.dtype != A.dtype):
        return "mixed dtypes"
    tensors = [A, B, *([bias] if bias is not None else [])]
    if not all(t.is_cuda for t in tensors):
        return "needs CUDA tensors"
    if len({t.device for t in tensors}) > 1:
        return "operands on several devices"
    ndim = len(out_shape)
    if ndim < 2 or not -ndim <= scatter_dim < ndim:
        return f"scatter dim {scatter_dim} of a {ndim}-D output"
    d = scatter_dim % ndim
    m, n = math.prod(out_shape[:-1]), out_shape[-1]
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != m or B.shape[1] != n or A.shape[1] != B.shape[0]:
        return "operand shapes do not match out_shape"
    if m == 0 or n == 0 or A.shape[1] == 0:
        return "an empty product"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        return "a bias that is not [N]"
    if out_shape[d] % group_size:
        return f"dim {d} of size {out_shape[d]} does not split over {group_size} ranks"
    if scatter_axis(out_shape, scatter_dim) == 0:
        if math.prod(out_shape[:d]) != 1:
            return "scatter dim has a leading dim of size > 1 (the ranks' rows are interleaved)"
    elif (n // group_size * A.element_size()) % 16:
        return f"column chunks of {n // group_size} elements are not 16-byte aligned"
    why = cutlass_gemm.operand_unsupported(A, B)
    if why is not None:
        return why
    return sequencer.unavailable()  # the pipelined module issues the protocol (kernels/cutlass_gemm.rs_sequence)


def make(variant: str) -> tuple[Callable[..., Tensor], Callable[..., str | None]]:
    """(fn, supports) of the choice ``cutlass:<variant>``."""
    v = cutlass_gemm.VARIANTS[variant]

    def supports_variant(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
        why = supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)
        if why is None and v.stream_k:
            return "stream-K variants do not count stored tiles (no per-chunk signal)"
        return why

    def run(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name):
        return matmul_reduce_scatter(
            As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, variant=variant
        )

    return run, supports_variant


# --- the protocol ---------------------------------------------------------------------------------------


def layout(m: int, n: int, world: int, axis: int) -> tuple[int, int, int]:
    """(chunk, R, C): an owner's chunk (rows or columns) and its part as an ``[R, C]`` matrix."""
    chunk = (m if axis == 0 else n) // world
    return (chunk, chunk, n) if axis == 0 else (chunk, m, chunk)


def data_bytes(m: int, n: int, world: int, axis: int, dtype: torch.dtype) -> int:
    """Bytes of the data workspace: ``world`` receive slots, then the whole partial."""
    _, rows, cols = layout(m, n, world, axis)
    return slot_bytes(world * rows * cols * dtype.itemsize) + m * n * dtype.itemsize


def _flag_views(comm: Comm) -> tuple[FlagArray, FlagArray, FlagArray]:
    return (
        FlagArray(comm.flags, _COUNTERS_OFFSET, MAX_WORLD),
        FlagArray(comm.flags, _READY_OFFSET, MAX_WORLD),
        FlagArray(comm.flags, _DONE_OFFSET, MAX_WORLD),
    )


def flag_arrays(comm: Comm) -> tuple[FlagArray, FlagArray, FlagArray]:
    """(counters, ready, done) of the flag workspace, set on every rank on first use (0, 0, 1)."""
    counters, ready, done = _flag_views(comm)
    comm.init_flags(counters, 0)
    comm.init_flags(ready, 0)
    comm.init_flags(done, 1)  # every slot starts free
    return counters, ready, done


def describe(comm: Comm) -> str:
    """The watchdog's report: the flags this rank's streams wait on."""
    counters, ready, done = (read_flags(f) for f in _flag_views(comm))
    parts = [
        f"rank {p}: ready={ready[p]} ({'its partial has landed' if ready[p] else 'its partial has not landed'}), "
        f"done={done[p]} ({'it has freed our slot' if done[p] else 'it still reads our slot'}), "
        f"tiles of its chunk stored here={counters[p]}"
        for p in ring_order(comm.rank, comm.world)
    ]
    return "Signals " + "; ".join(parts)


@functools.lru_cache(maxsize=1024)
def _tiles(variant: str, m: int, n: int, chunk: int, axis: int) -> tuple[int, ...]:
    return tuple(cutlass_gemm.tiles_per_chunk(variant, m, n, chunk, axis))


def matmul_reduce_scatter(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], scatter_dim: int,
    reduce_op: str, group_size: int, group_name: str,
    *,
    variant: str,
) -> Tensor:  # fmt: skip
    """The registered choice: this rank's ``Comm`` in the group, then the protocol."""
    m, n = math.prod(out_shape[:-1]), out_shape[-1]
    nbytes = data_bytes(m, n, group_size, scatter_axis(out_shape, scatter_dim), As[0].dtype)
    comm = comm_for(
        group_name, TAG, world=group_size, data_bytes=nbytes, flag_bytes=FLAG_BYTES, errors=ERRORS, describe=describe
    )
    return matmul_reduce_scatter_on(comm, As, Bs, bias, out_shape, scatter_dim, reduce_op, variant=variant)


@dataclasses.dataclass
class Plan:
    """What a call signature needs besides its operands (csrc/sequences_flux.cpp's ``rs_flux`` reads them): the
    views into the symmetric workspaces and the flag addresses, lists over the owners in ring order."""

    partial: Tensor  # our whole partial P, [m, n]
    slots: Tensor  # [world, rows, cols]: slot s receives rank s's partial of our chunk
    peer_slots: list[Tensor]  # slot rank in owner owners[j]'s buffer
    owners: list[int]
    tiles: list[int]  # owner owners[j]'s count once every tile of its chunk is stored
    done_mine: list[int]
    ready_theirs: list[int]
    ready_mine: list[int]
    done_theirs: list[int]
    counters: Tensor  # our tile counters, int32 [world]
    err_host: Tensor | None  # what the sequence reports its call with (Comm.sequence_reporting)
    events: list[int]


def plan(comm: Comm, m: int, n: int, axis: int, dtype: torch.dtype, variant: str) -> Plan:
    """The plan of a ``[m, n]`` partial scattered along ``axis`` on ``comm`` (``Comm.plan``: made on the
    signature's first call, kept while the context keeps its workspaces)."""
    return comm.plan((TAG, m, n, axis, dtype, variant), lambda: _make_plan(comm, m, n, axis, dtype, variant))


def _make_plan(comm: Comm, m: int, n: int, axis: int, dtype: torch.dtype, variant: str) -> Plan:
    rank, world = comm.rank, comm.world
    if comm.data.nbytes < data_bytes(m, n, world, axis, dtype):
        what = f"matmul_reduce_scatter ({NAME}:{variant})"
        raise ValueError(f"fluxcompile: {what}: the data workspace has {comm.data.nbytes} bytes, too few")
    chunk, rows, cols = layout(m, n, world, axis)
    _, ready, done = flag_arrays(comm)
    slot_elems, es = rows * cols, dtype.itemsize
    owners = ring_order(rank, world)
    tiles = _tiles(variant, m, n, chunk, axis)
    err_host, events = comm.sequence_reporting()
    p = Plan(
        partial=comm.data.view(rank, (m, n), dtype, slot_bytes(world * slot_elems * es)),
        slots=comm.data.view(rank, (world, rows, cols), dtype),
        peer_slots=[comm.data.view(q, (rows, cols), dtype, rank * slot_elems * es) for q in owners],
        owners=owners, tiles=[tiles[q] for q in owners],
        done_mine=[done.addr(rank, q) for q in owners], ready_theirs=[ready.addr(q, rank) for q in owners],
        ready_mine=[ready.addr(rank, q) for q in owners], done_theirs=[done.addr(q, rank) for q in owners],
        counters=comm.flags.view(rank, (world,), torch.int32, _COUNTERS_OFFSET),
        err_host=err_host, events=events,
    )  # fmt: skip
    return p


def matmul_reduce_scatter_on(
    comm: Comm, As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int],
    scatter_dim: int, reduce_op: str, *, variant: str,
) -> Tensor:  # fmt: skip
    """The op's result on the rank of ``comm`` (every rank of its group makes the same call): the protocol of
    the module's docstring, on the current stream and ``comm.side``."""
    rank, world = comm.rank, comm.world
    (a,), (b,) = As, Bs
    m, n = a.shape[0], b.shape[1]
    axis = scatter_axis(out_shape, scatter_dim)
    what = f"matmul_reduce_scatter ({NAME}:{variant})"
    p = plan(comm, m, n, axis, a.dtype, variant)
    comm.errors.check_previous(what, cutlass_gemm.check_error)
    shape = list(out_shape)
    shape[scatter_dim % len(shape)] //= world
    out = cutlass_gemm.rs_sequence(
        a, b, bias, p.partial, p.slots, p.peer_slots, p.owners, p.tiles, p.done_mine, p.ready_theirs, p.ready_mine,
        p.done_theirs, p.counters, comm.errors.err, shape,
        rank=rank, world=world, axis=axis, chunk=layout(m, n, world, axis)[0],
        scale=1.0 / world if reduce_op == "avg" else 1.0, variant=variant, sm_count=comm.sm_count, side=comm.side,
        err_host=p.err_host, events=p.events,
    )  # fmt: skip
    comm.after_sequence(what, cutlass_gemm.check_error)
    return out
