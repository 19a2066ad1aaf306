"""matmul_reduce_scatter with the Flux-style CUTLASS GEMM (kernels/cutlass_gemm.py, csrc/flux_gemm.cuh) as a ring
in one GEMM: each rank's epilogue adds its product to the running sum of the chunk that the next rank passed on,
and the owner's epilogue writes the result. No reduction pass, no separate kernel.

``P = A @ B (+ bias)`` is ``[m, n]`` (one pair); owner o's part is chunk o along the scatter axis: rows
``o * m/w ..`` (a row dim with no leading dims > 1) or columns ``o * n/w ..`` (the last dim, any leading dims).
Chunk q is summed along the ring q-1, q-2, ..., q+1, q (each rank passes its running sums to the rank before it):
rank r's GEMM takes the chunks in the order r+1, r+2, ..., r (the tile rotation), and
  * its tiles of chunk r+1 (the first step) compute ``scale * A @ B + scale * bias``;
  * its tiles of a later chunk q add the running sum of chunk q that rank r+1 computed one step earlier and
    pushed into our ``incoming`` buffer (the epilogue's producer waits, bounded, for the sub-chunk's flag before it
    loads the sum);
  * every tile but our own chunk's is stored into P, counted per sub-chunk, and the side stream pushes each stored
    sub-chunk into rank r-1's ``incoming`` (copy engine) and sets its flag there;
  * its tiles of chunk r (the last step) store into the output.
So the exposed time is the last sub-chunk's push and one tile's epilogue; each step lags the previous rank's by
one chunk of the GEMM.

Rounding: each step's epilogue computes ``scale * acc + running sum + scale * bias`` in fp32 and rounds once into
the dtype, so the result is rounded once per rank, in the fixed order q-1, ..., q (as NCCL's ring rounds per hop):
deterministic run to run; :func:`ring_reference` computes the same order on the CPU. (The alternative, each
owner's epilogue loading the w-1 peers' partials and summing them in fp32, needs w-1 sources in the epilogue's
shared memory, which the mainloop's stages pay for; a ring needs one at every world size.)

Bias: each rank adds its own bias (the contract puts it into every rank's partial), scaled as its product for
``avg`` (``scale * bias`` written into a scratch by the call). Layout per rank: the data workspace holds
``incoming`` and then P, both ``[m, n]``; the flag workspace the tile counters and arrival flags (one per
sub-chunk of the axis) and one ``done`` flag (rank r-1 has read its ``incoming`` of the last call: we may push into
it). Counters, arrivals and done are reset by their waiter: CUDA graphs replay them.

The C++ sequencer (csrc/sequences_flux.cpp's ``rs_ring``, through ``cutlass_gemm.rs_sequence``) issues the call,
a call seen before as one CUDA graph (``config.sequence_graphs``); the views and flag addresses are computed once
per call signature (:func:`plan`). Without the sequencer the choices decline. The communication context
(``symm_mem.Comm``) comes from ``symm_mem.comm_for``. Only variants built with the ring's source
(``cutlass_gemm.ring_variants()``) are choices; chunks must be whole clusters of tiles along the scatter axis
(:func:`chunk_declines`). Why the ring cannot deadlock then: csrc/ring_deadlock_freedom.md; a CPU model of its schedule,
run in CI: fluxcompile/testing/ring_schedule.py.

One choice, ``cutlass`` (family ``rs_ring``, off by default: ``FLUXCOMPILE_IMPLEMENTATIONS=+rs_ring``), whose
launch (``cutlass:<variant>``) comes from its shipped tuning table (cutlass_tuning.json, written by
benchmarks/cutlass_tuning.py), a few candidates timed where the table has no entry.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from ...kernels import cutlass_gemm, sequencer
from ...symm_mem import Comm, ErrorSpec, FlagArray, comm_for
from ...symm_mem.exchange import slot_bytes
from ...symm_mem.watchdog import read_flags
from .. import tuning_table
from ..choices import Launches

NAME = "cutlass"
MAX_WORLD = cutlass_gemm.MAX_WORLD
SUBS_PER_CHUNK = 8  # at most; fewer where a chunk has fewer tiles along the axis
MAX_SUBS = MAX_WORLD * SUBS_PER_CHUNK

_DTYPES = (torch.bfloat16, torch.float16)
# The flag workspace: tile counters (start 0) and arrival flags (start 0), one per sub-chunk; done (start 1).
_COUNTERS_OFFSET = 0
_ARRIVED_OFFSET = 4 * MAX_SUBS
_DONE_OFFSET = 8 * MAX_SUBS
FLAG_BYTES = 8 * MAX_SUBS + 16
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


TABLE_PATH = Path(__file__).with_name("cutlass_tuning.json")


def table() -> tuning_table.TuningTable:
    return tuning_table.load(TABLE_PATH)


def parse(name: str) -> str:
    """The variant of a launch's name (one of ``cutlass_gemm.ring_variants()``: the ring's raster is its own)."""
    if name not in cutlass_gemm.ring_variants():
        raise ValueError(f"fluxcompile: no CUTLASS reduce-scatter launch {name!r}")
    return name


def launches_for(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> list[str]:
    """The launches a call runs with: its table entry, or the candidates to time (the same on every rank)."""
    A, B = As[0], Bs[0]
    key = tuning_table.Key.of(tuning_table.arch_of(A.device), group_size, A.dtype, A.shape[0], B.shape[1], A.shape[1])
    args = (As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)
    return table().launches(key, lambda launch: make(launch)[1](*args))


def launches() -> Launches:
    """The family's launch variants as data (``choices.Launches``)."""
    names = ",".join(cutlass_gemm.ring_variants())
    return Launches(launches_for, make, hashlib.sha256(f"{table().digest}|{names}".encode()).hexdigest()[:16])


def make(variant: str) -> tuple[Callable[..., Tensor], Callable[..., str | None]]:
    """(fn, supports) of the launch ``variant`` (one of ``cutlass_gemm.ring_variants()``)."""
    parse(variant)

    def supports_variant(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
        why = supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)
        if why is not None:
            return why
        m, n = math.prod(out_shape[:-1]), out_shape[-1]
        return chunk_declines(variant, m, n, group_size, scatter_axis(out_shape, scatter_dim))

    def run(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name):
        return matmul_reduce_scatter(
            As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, variant=variant
        )

    return run, supports_variant


def ring_unit(variant: str, axis: int) -> int:
    """Elements along the scatter axis ``axis`` of one cluster of ``variant``'s tiles: a rank's chunk is a whole
    number of them, so no cluster holds tiles of two steps of the ring."""
    v = cutlass_gemm.VARIANTS[variant]
    return v.tile[axis] * v.cluster[axis]


def chunk_declines(variant: str, m: int, n: int, world: int, axis: int) -> str | None:
    """None where ``variant``'s ring takes an ``[m, n]`` partial scattered along ``axis`` over ``world`` ranks,
    else why not. A rank's chunk must be whole clusters of tiles along the axis: the CTAs of a cluster share
    their mainloop's pipeline (TMA multicast), so a cluster holding a tile of step s and one of step s + 1 of
    the ring ties the first's next tiles to the second's wait for the next rank's step s, which, once a rank has
    more tiles than CTAs, waits for tiles queued behind that same tie on the next rank: every rank waits on the
    next (the hang between four GPUs; csrc/ring_deadlock_freedom.md, checked by fluxcompile/testing/ring_schedule.py)."""
    v = cutlass_gemm.VARIANTS[variant]
    if not v.ring:
        return f"variant {variant} is not built with the ring's source"
    chunk = layout(m, n, world, axis)[0]
    what = "rows" if axis == 0 else "columns"
    tile, unit = v.tile[axis], ring_unit(variant, axis)
    if chunk % tile:
        return f"a rank's {chunk} {what} are not whole {tile}-{what[:-1]} tiles of {variant}"
    if chunk % unit:
        return (
            f"a rank's {chunk} {what} are not whole clusters of {variant} ({unit} {what}): a cluster would hold "
            "tiles of two steps of the ring, which can deadlock"
        )
    return None


# --- the protocol ---------------------------------------------------------------------------------------


def layout(m: int, n: int, world: int, axis: int) -> tuple[int, int, int]:
    """(chunk, R, C): an owner's chunk (rows or columns) and its part as an ``[R, C]`` matrix."""
    chunk = (m if axis == 0 else n) // world
    return (chunk, chunk, n) if axis == 0 else (chunk, m, chunk)


def sub_chunk(chunk: int, tile: int) -> int:
    """The elements of a sub-chunk (the unit of the pushes and their waits): the chunk's tiles along the axis split
    into the most equal parts, at most SUBS_PER_CHUNK."""
    tiles = chunk // tile
    parts = max(d for d in range(1, min(SUBS_PER_CHUNK, tiles) + 1) if tiles % d == 0)
    return chunk // parts


def data_bytes(m: int, n: int, world: int, axis: int, dtype: torch.dtype) -> int:
    """Bytes of the data workspace: the running sums that arrive, then our whole partial (both ``[m, n]``)."""
    return slot_bytes(m * n * dtype.itemsize) + m * n * dtype.itemsize


def _flag_views(comm: Comm) -> tuple[FlagArray, FlagArray, FlagArray]:
    return (
        FlagArray(comm.flags, _COUNTERS_OFFSET, MAX_SUBS),
        FlagArray(comm.flags, _ARRIVED_OFFSET, MAX_SUBS),
        FlagArray(comm.flags, _DONE_OFFSET, 1),
    )


def flag_arrays(comm: Comm) -> tuple[FlagArray, FlagArray, FlagArray]:
    """(counters, arrived, done) of the flag workspace, set on every rank on first use (0, 0, 1)."""
    counters, arrived, done = _flag_views(comm)
    comm.init_flags(counters, 0)
    comm.init_flags(arrived, 0)
    comm.init_flags(done, 1)  # our running sums start free
    return counters, arrived, done


def describe(comm: Comm) -> str:
    """The watchdog's report: the flags this rank's streams and kernels wait on."""
    counters, arrived, done = (read_flags(f) for f in _flag_views(comm))
    prev, nxt = (comm.rank - 1) % comm.world, (comm.rank + 1) % comm.world
    landed = [j for j, f in enumerate(arrived) if f]
    stored = {j: c for j, c in enumerate(counters) if c}
    return (
        f"Signals: running sums from rank {nxt} landed here for sub-chunks {landed or 'none'}; "
        f"done={done[0]} ({'rank ' + str(prev) + ' has read its running sums: we may push' if done[0] else 'rank ' + str(prev) + ' still reads its running sums'}); "
        f"tiles stored per sub-chunk, not yet pushed: {stored or 'none'}"
    )


@functools.lru_cache(maxsize=1024)
def _tiles(variant: str, m: int, n: int, sub: int, axis: int) -> tuple[int, ...]:
    return tuple(cutlass_gemm.tiles_per_chunk(variant, m, n, sub, axis))


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
    """What a call signature needs besides its operands (csrc/sequences_flux.cpp's ``rs_ring`` reads them): the
    views into the symmetric workspaces, the flag addresses and the call's small local buffers."""

    incoming: Tensor  # our running sums, [m, n]: written by rank + 1
    partial: Tensor  # our P, [m, n]
    peer_incoming: Tensor  # rank - 1's running sums, [m, n]
    zero: Tensor  # zeros, [TM, n] or [m, TN]: what the first step's tiles add
    bias_scratch: Tensor | None  # [n]: scale * bias (a bias and avg)
    chunk: int
    sub: int
    tiles: list[int]  # per sub-chunk of the axis: its count once every tile of it is stored
    counters: Tensor  # our tile counters, int32 [sub-chunks]
    arrived: Tensor  # our arrival flags, int32 [sub-chunks]
    arrived_theirs: int  # rank - 1's arrival flags' address
    done_mine: int
    done_theirs: int
    err_host: Tensor | None  # what the sequence reports its call with (Comm.sequence_reporting)
    events: list[int]


def plan(
    comm: Comm, m: int, n: int, axis: int, dtype: torch.dtype, variant: str, bias_dtype: torch.dtype | None = None
) -> Plan:
    """The plan of a ``[m, n]`` partial scattered along ``axis`` on ``comm`` (``Comm.plan``: made on the
    signature's first call, kept while the context keeps its workspaces). ``bias_dtype``: a scaled bias's scratch."""
    key = (TAG, m, n, axis, dtype, variant, bias_dtype)
    return comm.plan(key, lambda: _make_plan(comm, m, n, axis, dtype, variant, bias_dtype))


def _make_plan(comm: Comm, m: int, n: int, axis: int, dtype: torch.dtype, variant: str, bias_dtype) -> Plan:
    rank, world = comm.rank, comm.world
    if comm.data.nbytes < data_bytes(m, n, world, axis, dtype):
        what = f"matmul_reduce_scatter ({NAME}:{variant})"
        raise ValueError(f"fluxcompile: {what}: the data workspace has {comm.data.nbytes} bytes, too few")
    tm, tn, _ = cutlass_gemm.VARIANTS[variant].tile
    chunk = layout(m, n, world, axis)[0]
    sub = sub_chunk(chunk, tm if axis == 0 else tn)
    subs = world * (chunk // sub)
    if subs > MAX_SUBS:
        raise ValueError(f"fluxcompile: {subs} sub-chunks, more than the flag workspace's {MAX_SUBS}")
    _, arrived, done = flag_arrays(comm)
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    offset = slot_bytes(m * n * dtype.itemsize)
    device = comm.data.buffer.device
    err_host, events = comm.sequence_reporting()
    return Plan(
        incoming=comm.data.view(rank, (m, n), dtype),
        partial=comm.data.view(rank, (m, n), dtype, offset),
        peer_incoming=comm.data.view(prev, (m, n), dtype),
        zero=torch.zeros((tm, n) if axis == 0 else (m, tn), dtype=dtype, device=device),
        bias_scratch=torch.empty(n, dtype=bias_dtype, device=device) if bias_dtype is not None else None,
        chunk=chunk, sub=sub, tiles=list(_tiles(variant, m, n, sub, axis)),
        counters=comm.flags.view(rank, (subs,), torch.int32, _COUNTERS_OFFSET),
        arrived=comm.flags.view(rank, (subs,), torch.int32, _ARRIVED_OFFSET),
        arrived_theirs=arrived.addr(prev, 0),
        done_mine=done.addr(rank, 0), done_theirs=done.addr(nxt, 0),
        err_host=err_host, events=events,
    )  # fmt: skip


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
    scale = 1.0 / world if reduce_op == "avg" else 1.0
    p = plan(comm, m, n, axis, a.dtype, variant, bias.dtype if bias is not None and scale != 1.0 else None)
    comm.errors.check_previous(what, cutlass_gemm.check_error)
    shape = list(out_shape)
    shape[scatter_dim % len(shape)] //= world
    out = cutlass_gemm.rs_sequence(
        a, b, bias, p.bias_scratch, p.partial, p.incoming, p.peer_incoming, p.zero, p.counters, p.arrived, p.tiles,
        p.arrived_theirs, p.done_mine, p.done_theirs, comm.errors.err, shape,
        rank=rank, world=world, axis=axis, chunk=p.chunk, sub=p.sub, scale=scale, variant=variant,
        sm_count=comm.sm_count, side=comm.side, err_host=p.err_host, events=p.events,
    )  # fmt: skip
    comm.after_sequence(what, cutlass_gemm.check_error)
    return out


def ring_reference(
    partials: Sequence[Tensor], biases: Sequence[Tensor | None], world: int, axis: int, scale: float, dtype: torch.dtype
) -> list[Tensor]:
    """Every rank's result as the ring computes it, from each rank's fp32 product ``partials[r]`` ``[m, n]`` and its
    bias: chunk q summed in the order q-1, q-2, ..., q, each step ``scale * product + running sum + scale * bias``
    in fp32 (``scale * bias`` rounded to the bias's dtype, as the call's scratch holds it) rounded once to
    ``dtype``. Chunk q of the ``[m, n]`` result along ``axis``, per rank."""
    out = []
    for q in range(world):
        running = None
        for step in range(world):
            r = (q - 1 - step) % world
            part = partials[r].float() * scale
            if biases[r] is not None:
                part = part + (biases[r].float() * scale).to(biases[r].dtype).float()  # the scratch's rounding
            part = part.chunk(world, dim=axis)[q]
            if running is not None:
                part = part + running.float()
            running = part.to(dtype)
        out.append(running)
    return out
