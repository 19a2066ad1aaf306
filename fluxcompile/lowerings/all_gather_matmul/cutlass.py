"""all_gather_matmul with the Flux-style CUTLASS GEMM (kernels/cutlass_gemm.py, csrc/flux_gemm.cuh): one
persistent sm_90a GEMM per weight over the whole gathered operand, whose tiles wait for the chunks holding their
rows, fed by copy-engine pushes chunk by chunk.

Per call, on rank r of w (peers p in the exchange's gather send order, r-1 first: symm_mem/exchange.py). Our
symmetric data buffer reads as the gathered ``[w * rows, k]``: slot s (rows ``s * rows ..``) holds rank s's rows.
  side stream:  for p: wait done_p -> for each chunk c of our rows: copy it into slot r of p's buffer (peer to
                peer, copy engine) -> set arrived[r, c] on p
  main stream:  [copy A into our slot r] -> per weight: ``gemm`` over the whole buffer with
                ``wait=(arrived, rows, chunk_rows, r)`` and ``rotate=(0, r * rows)`` (our rows' tiles first,
                nothing to wait for; every other tile waits, bounded, for the chunks holding its rows)
                -> clear our arrived flags -> [A_gathered = a copy of the buffer, our rows from A]
                -> join the side stream -> set done_r on every p (its slot in our buffer may be written again)
Our rows are read where A is (``local=`` of ``gemm``: a TMA descriptor of their own) when ``rows`` is a multiple
of the tile's M and A is 16-byte aligned; otherwise (a tile would straddle our rows and a peer's) A is copied into
our slot first. A_gathered is produced only where the caller reads it (the op's ``return_A``, set by the graph
pass from the gathered tensor's users); else the choice returns None for it.
The C++ sequencer (csrc/sequences_flux.cpp, through ``cutlass_gemm.ag_sequence``) issues these operations, a
call seen before as one CUDA graph (``config.sequence_graphs``); the slot views, chunk bounds and flag addresses
are computed once per call signature (:func:`plan`). Without the sequencer the choices decline.
A wait that times out fills an error buffer (``cutlass_gemm.ERR_WORDS`` words), copied to pinned host memory
by the sequence and checked at the start of the next eager call (no synchronization on the hot path), or after
every call with ``config.check_signals``; the sequence also records the watchdog's event. Flags are 0/1, reset by their waiter: CUDA graphs replay them.

The communication context (``symm_mem.Comm``) carries everything the protocol takes from its group (workspaces,
side stream, SM count, flag initialization, error buffer, watchdog); :func:`all_gather_matmul_on` takes it
explicitly, so the same code runs between GPUs (the registered choice takes the group's from ``symm_mem.comm_for``)
and between ranks simulated on one GPU (fluxcompile/testing/one_gpu_ranks.py).

Family ``cutlass``, on by default: its choices decline every call while ``config.implementations`` leaves it out.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from ...kernels import cutlass_gemm, sequencer
from ...symm_mem import Comm, ErrorSpec, FlagArray, comm_for
from ...symm_mem.exchange import gather_send_order
from ...symm_mem.watchdog import read_flags
from .. import tuning_table
from ..choices import Launches
from .layout import layout_supports, shard_layout

NAME = "cutlass"
MAX_WORLD = cutlass_gemm.MAX_WORLD
MAX_WEIGHTS = 4
CHUNKS = 4  # communication chunks per shard by default (each at least one tile of M rows where the shard has them)
MAX_CHUNKS = 8
_DTYPES = (torch.bfloat16, torch.float16)
# The flag workspace: arrived (int32, [world, MAX_CHUNKS], starts 0), then done (int32, [world], starts 1).
_ARRIVED_OFFSET = 0
_DONE_OFFSET = 4 * MAX_WORLD * MAX_CHUNKS
FLAG_BYTES = _DONE_OFFSET + 4 * MAX_WORLD
TAG = "all_gather_matmul.cutlass"


# The error words of the CUTLASS GEMM's waits (``cutlass_gemm.check_error`` reads them).
ERRORS = ErrorSpec(cutlass_gemm.ERR_WORDS, "the CUTLASS choices")


# --- supports -------------------------------------------------------------------------------------------


def supports(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> str | None:
    """None when the CUTLASS choices handle the call, else why not (the same on every rank; never raises)."""
    try:
        return _supports(A, Bs, biases, gather_dim, group_size)
    except Exception as e:  # a broken check declines
        return f"supports() raised {type(e).__name__}: {e}"


def _supports(A, Bs, biases, gather_dim, group_size) -> str | None:
    why = cutlass_gemm.group_declines(group_size, A)
    if why is not None:
        return why
    if not Bs or len(Bs) != len(biases):
        return "need one bias (or None) per weight"
    if len(Bs) > MAX_WEIGHTS:
        return f"more than {MAX_WEIGHTS} weights"
    if A.dtype not in _DTYPES:
        return f"dtype {A.dtype} (bf16 and fp16 only)"
    why = layout_supports(A, Bs, biases, gather_dim, group_size)  # CUDA, one block of rows per rank, dtypes
    if why is not None:
        return why
    if A.dim() < 2 or A.numel() == 0:
        return "an empty shard"
    if any(t.device != A.device for t in (*Bs, *(x for x in biases if x is not None))):
        return "operands on several devices"
    k = A.shape[-1]
    # The gathered operand as the kernel reads it: [world * rows, K], row-major (the symmetric buffer).
    a = torch.empty(group_size * (A.numel() // k), k, dtype=A.dtype, device="meta")
    for b, bias in zip(Bs, biases):
        if b.dim() != 2 or b.shape[0] != k:
            return "a weight that is not [K, N]"
        why = cutlass_gemm.operand_unsupported(a, b)
        if why is not None:
            return why
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
            return "a bias that is not [N]"
    return sequencer.unavailable()  # the pipelined module issues the protocol (kernels/cutlass_gemm.ag_sequence)


@dataclasses.dataclass(frozen=True)
class Launch:
    """A choice's launch options that cost no compilation: the tile scheduler's raster order (``gemm``'s
    ``raster``), the communication chunks per shard, and the grouped tile order (``gemm``'s ``group_m``: rows of
    tiles a group, 0: off; it runs the scheduler along N)."""

    raster: str = "auto"
    chunks: int = CHUNKS
    group_m: int = 0


# A launch's name: ``<variant>[:<option>]...``, options ``n``/``m`` (raster along N or M), ``c<chunks>`` (chunks
# per shard, 1 to MAX_CHUNKS) and ``g<rows>`` (the grouped tile order, GROUPS rows of tiles a group).
GROUPS = (4, 8, 16)
# The family's one choice runs the launch that its shipped tuning table (cutlass_tuning.json, written by
# benchmarks/cutlass_tuning.py from the fused op's recorded times) gives the call's arch, world size, dtype and
# GEMM shape; the table's candidates are timed where it has no entry.
TABLE_PATH = Path(__file__).with_name("cutlass_tuning.json")


def table() -> tuning_table.TuningTable:
    return tuning_table.load(TABLE_PATH)


def parse(name: str) -> tuple[str, Launch]:
    """(variant, launch options) of a launch's name (the part after ``cutlass:``)."""
    variant, *options = name.split(":")
    launch = Launch()
    for option in options:
        digits = option[1:]
        if option in ("n", "m") and launch.raster == "auto":
            launch = dataclasses.replace(launch, raster=option)
        elif option[:1] == "c" and digits.isdigit() and 1 <= int(digits) <= MAX_CHUNKS:
            launch = dataclasses.replace(launch, chunks=int(digits))
        elif option[:1] == "g" and digits.isdigit() and int(digits) in GROUPS:
            launch = dataclasses.replace(launch, group_m=int(digits))
        else:
            raise ValueError(f"fluxcompile: no CUTLASS all-gather launch {name!r}")
    if variant not in cutlass_gemm.variants():
        raise ValueError(f"fluxcompile: no CUTLASS all-gather launch {name!r}")
    return variant, launch


def make(name: str) -> tuple[Callable[..., tuple[Tensor | None, list[Tensor]]], Callable[..., str | None]]:
    """(fn, supports) of the launch ``name`` (a variant, optionally with options: :func:`parse`)."""
    variant, launch = parse(name)

    def run(A, Bs, biases, gather_dim, group_size, group_name, return_A=True):
        return all_gather_matmul(
            A, Bs, biases, gather_dim, group_size, group_name, variant=variant, launch=launch, return_A=return_A
        )

    return run, supports


def launches_for(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> list[str]:
    """The launches a call runs with: its table entry, or the candidates to time (the same on every rank)."""
    k = A.shape[-1]
    rows = A.numel() // k
    key = tuning_table.Key.of(tuning_table.arch_of(A.device), group_size, A.dtype, group_size * rows,
                              max(b.shape[-1] for b in Bs), k)  # fmt: skip
    args = (A, Bs, biases, gather_dim, group_size, group_name)
    return table().launches(key, lambda launch: make(launch)[1](*args))


def launches() -> Launches:
    """The family's launch variants as data (``choices.Launches``)."""
    names = ",".join(cutlass_gemm.variants())
    digest = hashlib.sha256(f"{table().digest}|{names}|{GROUPS}|{MAX_CHUNKS}".encode()).hexdigest()[:16]
    return Launches(launches_for, make, digest)


# --- the protocol ---------------------------------------------------------------------------------------


def chunking(rows: int, tile_m: int, chunks: int = CHUNKS) -> tuple[int, int]:
    """(chunk_rows, chunks) of a shard of ``rows``: ``chunks`` chunks, each at least one tile of M (fewer chunks
    for a small shard)."""
    chunk_rows = min(rows, max(tile_m, -(-rows // chunks)))
    return chunk_rows, -(-rows // chunk_rows)


def data_bytes(rows: int, k: int, world: int, dtype: torch.dtype) -> int:
    """Bytes of the data workspace for shards of ``rows`` x ``k``: the gathered operand, slots abutting."""
    return world * rows * k * dtype.itemsize


def _flag_views(comm: Comm) -> tuple[FlagArray, FlagArray]:
    return FlagArray(comm.flags, _ARRIVED_OFFSET, MAX_WORLD * MAX_CHUNKS), FlagArray(comm.flags, _DONE_OFFSET, MAX_WORLD)


def flag_arrays(comm: Comm) -> tuple[FlagArray, FlagArray]:
    """(arrived, done) of the flag workspace, set on every rank on first use (arrived 0, done 1)."""
    arrived, done = _flag_views(comm)
    comm.init_flags(arrived, 0)
    comm.init_flags(done, 1)  # every slot starts free
    return arrived, done


def describe(comm: Comm) -> str:
    """The watchdog's report: the done flags this rank waits on before its pushes."""
    d = read_flags(_flag_views(comm)[1])
    peers = gather_send_order(comm.rank, comm.world)
    return "Signals " + "; ".join(
        f"to rank {p}: done={d[p]} ({'it has freed our slot' if d[p] else 'it still reads our slot'})" for p in peers
    )


def all_gather_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    *,
    variant: str,
    launch: Launch = Launch(),
    return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """The registered choice: this rank's ``Comm`` in the group, then the protocol."""
    k = A.shape[-1]
    rows = A.numel() // k
    nbytes = data_bytes(rows, k, group_size, A.dtype)
    comm = comm_for(
        group_name, TAG, world=group_size, data_bytes=nbytes, flag_bytes=FLAG_BYTES, errors=ERRORS, describe=describe
    )
    return all_gather_matmul_on(comm, A, Bs, biases, gather_dim, variant=variant, launch=launch, return_A=return_A)


@dataclasses.dataclass
class Plan:
    """What a call signature needs besides its operands (csrc/sequences_flux.cpp's ``ag_flux`` reads them): the
    views into the symmetric workspaces and the flag addresses, lists over the peers in the send order
    (``gather_send_order``: shards land in the order the peers' tiles take them)."""

    chunk_rows: int
    in_place: bool  # rows a multiple of the tile's M: the GEMMs may read our rows where A is
    peer_slots: list[Tensor]  # slot rank in peer send_to[j]'s buffer, [rows, k]: our shard goes there
    buffer: Tensor  # our whole buffer as the gathered [world * rows, k] (slot s: rows pushed by rank s)
    chunk_bounds: list[int]  # our chunks' rows, flattened [lo0, hi0, lo1, hi1, ...]
    done_mine: list[int]  # done[rank, p]: p has freed our slot in its buffer
    arrived_theirs: list[int]  # arrived[p, rank * chunks + c] at j * chunks + c: our chunk c has landed in p's
    done_theirs: list[int]  # done[p, rank]: p's slot in our buffer is free again
    arrived: Tensor  # our arrival flags, int32 [world * chunks]: what our GEMMs' tiles wait on
    # What the sequence reports its call with (Comm.sequence_reporting): on CUDA it copies the error words to
    # their pinned host copy and records the context's events itself.
    err_host: Tensor | None
    events: list[int]


def plan(comm: Comm, rows: int, k: int, dtype: torch.dtype, variant: str, launch: Launch = Launch()) -> Plan:
    """The plan of shards of ``rows`` x ``k`` on ``comm`` (``Comm.plan``: made on the signature's first call, kept
    while the context keeps its workspaces)."""
    return comm.plan((TAG, rows, k, dtype, variant, launch), lambda: _make_plan(comm, rows, k, dtype, variant, launch))


def _make_plan(comm: Comm, rows: int, k: int, dtype: torch.dtype, variant: str, launch: Launch) -> Plan:
    rank, world = comm.rank, comm.world
    if comm.data.nbytes < data_bytes(rows, k, world, dtype):
        what = f"all_gather_matmul ({NAME}:{variant})"
        raise ValueError(f"fluxcompile: {what}: the data workspace has {comm.data.nbytes} bytes, too few")
    tile_m = cutlass_gemm.VARIANTS[variant].tile[0]
    chunk_rows, n_chunks = chunking(rows, tile_m, launch.chunks)
    arrived_all, done = _flag_views(comm)
    send_to = gather_send_order(rank, world)
    slot_offset = rank * rows * k * dtype.itemsize
    err_host, events = comm.sequence_reporting()
    p = Plan(
        chunk_rows=chunk_rows, in_place=rows % tile_m == 0,
        peer_slots=[comm.data.view(q, (rows, k), dtype, slot_offset) for q in send_to],
        buffer=comm.data.view(rank, (world * rows, k), dtype),
        chunk_bounds=[x for c in range(n_chunks) for x in (c * chunk_rows, min(rows, (c + 1) * chunk_rows))],
        done_mine=[done.addr(rank, q) for q in send_to],
        arrived_theirs=[arrived_all.addr(q, rank * n_chunks + c) for q in send_to for c in range(n_chunks)],
        done_theirs=[done.addr(q, rank) for q in send_to],
        arrived=comm.flags.view(rank, (world * n_chunks,), torch.int32, _ARRIVED_OFFSET),
        err_host=err_host, events=events,
    )  # fmt: skip
    return p


def all_gather_matmul_on(
    comm: Comm, A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, *, variant: str,
    launch: Launch = Launch(), return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """The op's results on the rank of ``comm`` (every rank of its group makes the same call): the protocol of
    the module's docstring, on the current stream and ``comm.side``."""
    rank, world = comm.rank, comm.world
    A, rows, k, gathered_shape = shard_layout(A, gather_dim, world)
    what = f"all_gather_matmul ({NAME}:{variant})"
    p = plan(comm, rows, k, A.dtype, variant, launch)
    flag_arrays(comm)
    comm.errors.check_previous(what, cutlass_gemm.check_error)
    A_gathered, outs = cutlass_gemm.ag_sequence(
        A.view(rows, k), list(Bs), list(biases), gathered_shape, p.peer_slots, p.buffer, p.chunk_bounds,
        p.done_mine, p.arrived_theirs, p.done_theirs, p.arrived, comm.errors.err,
        rank=rank, world=world, chunk_rows=p.chunk_rows, variant=variant, sm_count=comm.sm_count, side=comm.side,
        in_place=p.in_place, return_A=return_A, err_host=p.err_host, events=p.events, raster=launch.raster,
        group_m=launch.group_m,
    )  # fmt: skip
    comm.after_sequence(what, cutlass_gemm.check_error)
    return A_gathered, outs
