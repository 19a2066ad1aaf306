"""embedding_bag_all_to_all with the Triton pooling kernel (kernels/embedding_bag.py): every pooled row is stored
straight into the output of the rank that owns it, no pooled tensor and no separate all-to-all.

Per call, on rank r of w, all on the current stream (the pooling kernel never waits, so nothing needs a second
stream; the waits are one-program kernels):
  [unequal splits only] offsets kernel: publish what r receives per source (the exclusive prefix of its output
      splits, in elements) in its flag workspace, then read from every peer p where r's chunk starts in p's
      output (bounded wait on p's flag for this call's epoch)
  pooling kernel: every (block of bags, table) -> r's own chunk into the fresh output, peer p's chunk into half
      ``epoch % 2`` of p's receive buffer; then +segments on counter[r] of each peer it stored to (release, system
      scope), one extra +1 from program (0, 0) to every peer
  wait kernel (one program): until every source's counter reached its target (state, on the device), then the
      epoch advances
  copy kernel: the peers' chunks from our receive buffer (half ``epoch % 2``) into the output
With equal splits (both split lists empty, or all entries equal in both), every rank sends every rank the same
number of rows, so our chunk starts at ``r * chunk`` in every receiver's output: known on the host, no offsets
kernel. With one rank, the pooling kernel alone writes the output (no workspace, no signals).

Why a copy: the caller may keep the output across later calls, so it cannot be a view of the receive buffer
(which the next-but-one call overwrites); our own chunk (1/w of it) is stored into the output directly.

Host synchronization: none on the hot path. Device tables (pointer tables of the tensors, split prefixes) are
cached by value; a new one is written by a small kernel whose arguments carry the values (no pinned staging:
allocating it would synchronize the device). The first call in a group makes the symmetric
workspaces and sets the flags (collective, host barrier): warm up eagerly before capturing. A wait that times
out fills the error words, copied to pinned memory at the end of the call and checked at the next eager call
(or at once with ``config.check_signals``).

Epochs and counters only grow (kernels/embedding_bag.py): no flag is ever reset, CUDA graphs replay the protocol,
and every rank must run the same calls of this choice in the same order (as for any collective).

The communication context (``symm_mem.Comm``) carries what the protocol takes from its group: the registered
choice takes the group's from ``symm_mem.comm_for``; the one-GPU harness (fluxcompile/testing/one_gpu_ranks.py)
gives each simulated rank its own.

Family ``dlrm``, on by default: its choices decline every call while ``config.implementations`` leaves it out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from ...config import config
from ...symm_mem import Comm, ErrorSpec, FlagArray, comm_for, group_size
from .. import protocol_steps
from ..device_tables import device_table

try:
    from ...kernels import embedding_bag as eb
except ImportError:  # no Triton: the choices are not registered (__init__.py)
    eb = None

NAME = "triton"
OP = "embedding_bag_all_to_all"
TAG = "embedding_bag_all_to_all.triton"
MAX_WORLD = 64
# The flag workspace of a rank, all int64 (a counter grows by a call's segments: int32 would wrap within a training
# run): counters ([MAX_WORLD], counter[s]: segments received from rank s, plus one per call), the epoch of its last
# published offsets, the published offsets ([2, MAX_WORLD]).
COUNTERS = 0
PUB_FLAG = 8 * MAX_WORLD
_PUB = 16 * MAX_WORLD
# The put form's offsets (put.py): its outbox ([MAX_WORLD]), inbox ([2, MAX_WORLD]) and offsets counters.
OUTBOX = _PUB + 16 * MAX_WORLD
INBOX = OUTBOX + 8 * MAX_WORLD
OFFSET_COUNTERS = INBOX + 16 * MAX_WORLD
FLAG_BYTES = OFFSET_COUNTERS + 8 * MAX_WORLD
_ALIGN_ELEMS = 64  # a receive buffer's half is a multiple of this many elements


# --- the call's layout ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every pooled row of one call goes, on rank ``rank`` of ``world`` (all in elements or segments of
    ``dim`` elements; see kernels/embedding_bag.py)."""

    bags: int
    tables: int
    dim: int
    rank: int
    world: int
    unit: int  # elements of one dim-0 entry of out_shape
    in_splits: tuple[int, ...]  # dim-0 entries we send to each rank
    out_splits: tuple[int, ...]  # dim-0 entries we receive from each rank
    uniform: bool  # every split of both lists equal: every rank sends every rank the same
    src_start: tuple[int, ...]  # [world + 1] segments: our chunk boundaries
    recv_prefix: tuple[int, ...]  # [world] elements: where each source's chunk starts in our output
    expect: tuple[int, ...]  # [world] counter increments per call: segments from each source + 1 (0: ourselves)
    out_shape: tuple[int, ...]
    parity_elems: int  # elements of one half of a receive buffer (the same on every rank)

    @property
    def out_elems(self) -> int:
        return math.prod(self.out_shape)

    @property
    def hole(self) -> tuple[int, int]:
        """Our own chunk in our output (stored there by the pooling kernel, not copied)."""
        lo = self.recv_prefix[self.rank]
        return lo, lo + self.out_splits[self.rank] * self.unit

    def equal_dst_off(self) -> tuple[int, ...]:
        """With uniform splits: our chunk's start in every receiver's output."""
        return (self.rank * self.in_splits[0] * self.unit,) * self.world

    def data_bytes(self, itemsize: int) -> int:
        return 2 * self.parity_elems * itemsize


def split_problem(
    bags: int, tables: int, dim: int, out_shape: Sequence[int], output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int], world: int,
) -> str | None:  # fmt: skip
    """Why the split lists and ``out_shape`` do not describe an all-to-all of the pooled rows (None if they do)."""
    numel = bags * tables * dim
    if not out_shape or math.prod(out_shape) != numel:
        return f"out_shape {list(out_shape)} does not hold the {bags} x {tables * dim} pooled rows"
    units = out_shape[0]
    if units == 0:
        return "no rows"
    unit = numel // units
    if unit % dim:
        return f"a dim-0 entry of out_shape ({unit} elements) cuts a table's {dim} columns"
    for name, splits in (("input", input_split_sizes), ("output", output_split_sizes)):
        if splits and len(splits) != world:
            return f"{name} split list of {len(splits)} entries for a group of {world} ranks"
        if any(s < 0 for s in splits):
            return f"a negative {name} split"
    if input_split_sizes and sum(input_split_sizes) != units:
        return f"input splits add up to {sum(input_split_sizes)}, not out_shape[0] = {units}"
    if (not input_split_sizes or not output_split_sizes) and units % world:
        return f"equal splits of {units} rows over {world} ranks"
    return None


@functools.lru_cache(maxsize=256)
def layout(
    bags: int, tables: int, dim: int, out_shape: tuple[int, ...], output_split_sizes: tuple[int, ...],
    input_split_sizes: tuple[int, ...], rank: int, world: int,
) -> Layout:  # fmt: skip
    why = split_problem(bags, tables, dim, out_shape, output_split_sizes, input_split_sizes, world)
    if why is not None:
        raise ValueError(f"fluxcompile: {OP}: {why}")
    numel = bags * tables * dim
    units = out_shape[0]
    unit = numel // units
    spu = unit // dim  # segments per dim-0 entry
    equal = units // world if units % world == 0 else 0
    ins = tuple(input_split_sizes) if input_split_sizes else (equal,) * world
    outs = tuple(output_split_sizes) if output_split_sizes else (equal,) * world
    uniform = len(set(ins) | set(outs)) == 1
    src_start = tuple(sum(ins[:k]) * spu for k in range(world + 1))
    recv_prefix = tuple(sum(outs[:s]) * unit for s in range(world))
    expect = tuple(0 if s == rank else outs[s] * spu + 1 for s in range(world))
    # The receive buffer's half: exactly our pooled elements with uniform splits (then every rank receives what
    # it sends); otherwise bounded by what every rank could send us, ``world`` times our own (equal on every rank
    # where the ranks pool equal batches, as DLRM's do).
    bound = numel if uniform else world * numel
    parity = -(-bound // _ALIGN_ELEMS) * _ALIGN_ELEMS
    out_shape_r = (sum(outs), *out_shape[1:])
    if math.prod(out_shape_r) > parity:
        raise ValueError(
            f"fluxcompile: {OP}: rank {rank} receives {math.prod(out_shape_r)} elements, more than the {parity} of "
            "its receive buffer (every rank's batch must be alike)"
        )
    return Layout(
        bags, tables, dim, rank, world, unit, ins, outs, uniform, src_start, recv_prefix, expect, out_shape_r, parity
    )


# --- device tables ------------------------------------------------------------------------------------------------


def pointer_table(weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor]) -> Tensor:
    """int64 ``[4, T]``: every table's weight, indices and offsets addresses, and its index count."""
    values = (
        *(w.data_ptr() for w in weights),
        *(i.data_ptr() for i in indices),
        *(o.data_ptr() for o in offsets),
        *(i.numel() for i in indices),
    )
    return device_table(values, weights[0].device)


# --- supports -------------------------------------------------------------------------------------------------


def group_size_of(group_name: str) -> int:
    size = _group_sizes.get(group_name)
    if size is None:
        size = _group_sizes[group_name] = group_size(group_name)
    return size


_group_sizes: dict[str, int] = {}


def check_operands(
    weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int,
    include_last_offset: bool, *, cuda: bool = True,
) -> str | None:  # fmt: skip
    """Why the pooling kernel does not take these operands (None if it does)."""
    if mode == 2:
        return "max pooling (mode 2)"
    if mode not in (0, 1):
        return f"mode {mode}"
    if not weights or not len(weights) == len(indices) == len(offsets):
        return "need one index and one offset tensor per table"
    w0 = weights[0]
    if w0.dtype not in eb.DTYPES:
        return f"dtype {w0.dtype} (fp32, bf16 and fp16 only)"
    if any(w.dtype != w0.dtype for w in weights):
        return "tables of mixed dtypes"
    if any(w.dim() != 2 for w in weights):
        return "a table that is not 2-D"
    dim = w0.shape[1]
    if any(w.shape[1] != dim for w in weights):
        return "tables of different dims (per-table D)"
    if dim == 0:
        return "tables of dim 0"
    if any(w.shape[0] > 1 and (w.stride(1) != 1 or w.stride(0) != dim) for w in weights):
        return "a table whose rows are not contiguous"
    if any(i.dim() != 1 or i.dtype not in eb.INDEX_DTYPES for i in indices):
        return "indices that are not 1-D int32/int64"
    if any(o.dim() != 1 or o.dtype not in eb.INDEX_DTYPES for o in offsets):
        return "offsets that are not 1-D int32/int64"
    if any(i.dtype != indices[0].dtype for i in indices) or any(o.dtype != offsets[0].dtype for o in offsets):
        return "index or offset tensors of mixed dtypes"
    if any(not i.is_contiguous() for i in indices) or any(not o.is_contiguous() for o in offsets):
        return "non-contiguous indices or offsets"
    bags = offsets[0].numel() - int(include_last_offset)
    if bags < 0 or any(o.numel() - int(include_last_offset) != bags for o in offsets):
        return "tables with different bag counts"
    device = w0.device
    if any(t.device != device for t in (*weights, *indices, *offsets)):
        return "operands on several devices"
    if cuda and device.type != "cuda":
        return "not on a CUDA device"
    return None


def supports(
    weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
    group_name, per_sample_weights=None,
) -> str | None:  # fmt: skip
    """None when the Triton choices handle the call, else why not (shapes, dtypes, group and config only: the same
    on every rank)."""
    if config.exchange_transport == "put":
        return "exchange_transport is 'put' (the put-with-signal form runs instead of the stores into peers)"
    return call_problem(
        weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
        group_name, per_sample_weights,
    )  # fmt: skip


def call_problem(
    weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
    group_name, per_sample_weights=None,
) -> str | None:  # fmt: skip
    """Why the pooling kernel and this op's layout do not take the call (None if they do), whatever the form of
    its exchange."""
    why = check_operands(weights, indices, offsets, mode, include_last_offset, cuda=False)
    if why is None and per_sample_weights is not None:
        why = weights_problem(per_sample_weights, weights, indices, mode)
    if why is not None:
        return why
    try:
        world = group_size_of(group_name)
    except Exception as e:
        return f"no process group {group_name!r} ({type(e).__name__})"
    if world > MAX_WORLD:
        return f"more than {MAX_WORLD} ranks"
    bags = offsets[0].numel() - int(include_last_offset)
    why = split_problem(
        bags, len(weights), weights[0].shape[1], list(out_shape), list(output_split_sizes),
        list(input_split_sizes), world,
    )  # fmt: skip
    if why is None and weights[0].device.type != "cuda":
        why = "not on a CUDA device"
    return why


def weights_problem(
    per_sample_weights: Sequence[Tensor], weights: Sequence[Tensor], indices: Sequence[Tensor], mode: int
) -> str | None:  # fmt: skip
    """Why the pooling kernel does not take these per-sample weights (None if it does)."""
    if mode != 0:
        return "per-sample weights outside sum pooling"
    if len(per_sample_weights) != len(indices):
        return "per-sample weights for some tables only"
    for p, w, i in zip(per_sample_weights, weights, indices):
        if p.dim() != 1 or p.numel() != i.numel() or not p.is_contiguous():
            return "per-sample weights that are not one contiguous weight per index"
        if p.dtype != w.dtype or p.device != w.device:
            return "per-sample weights of another dtype or device than the tables"
    return None


def make(variant: str) -> tuple[Callable[..., Tensor], Callable[..., str | None]]:
    """(fn, supports) of the choice ``triton:<variant>``."""
    if variant not in eb.VARIANTS:
        raise ValueError(f"fluxcompile: no embedding-bag variant {variant!r}")

    def run(weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
            group_name, per_sample_weights=None, bookkeeping=False, padding_idx=-1):  # fmt: skip
        book = bookkeeping_tensors(indices, offsets) if bookkeeping else None
        out = embedding_bag_all_to_all(
            weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
            group_name, variant=variant, book=book, padding_idx=padding_idx, per_sample_weights=per_sample_weights,
        )  # fmt: skip
        return (out, [], [], []) if book is None else (out, *book)

    return run, supports


def bookkeeping_tensors(
    indices: Sequence[Tensor], offsets: Sequence[Tensor]
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:  # fmt: skip
    """Every table's offset2bag, bag_size and max_indices as aten's CUDA ``_embedding_bag`` allocates them in sum
    and mean pooling (the indices' dtype; one bag size per offset; no max indices), for the pooling kernel to fill
    (the last bag size is left unwritten with ``include_last_offset``, as aten leaves it)."""
    if any(i.dtype != o.dtype for i, o in zip(indices, offsets)):
        raise ValueError(f"fluxcompile: {OP}: the bookkeeping of indices and offsets of different dtypes")
    return (
        [torch.empty(i.numel(), dtype=i.dtype, device=i.device) for i in indices],
        [torch.empty(o.numel(), dtype=i.dtype, device=i.device) for i, o in zip(indices, offsets)],
        [torch.empty(0, dtype=i.dtype, device=i.device) for i in indices],
    )


# --- the protocol -------------------------------------------------------------------------------------------------

_states: dict[int, tuple[Tensor, Tensor, Tensor]] = {}


def group_comm(group_name: str, world: int, data_bytes: int) -> Comm:
    """This rank's context in a process group: the (group, device) workspaces of this choice (a collective where
    one must be made or grow: every rank makes the same call) and the error buffer."""
    return comm_for(
        group_name, TAG, world=world, data_bytes=data_bytes, flag_bytes=FLAG_BYTES,
        errors=ErrorSpec(eb.ERR_WORDS, "the DLRM kernel"),
    )  # fmt: skip


def embedding_bag_all_to_all(
    weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int,
    include_last_offset: bool, out_shape: Sequence[int], output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int], group_name: str, *, variant: str | eb.Variant = "",
    book: tuple[Sequence[Tensor], ...] | None = None, padding_idx: int = -1,
    per_sample_weights: Sequence[Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """The registered choice: this rank's ``Comm`` in the group (none with one rank), then the protocol."""
    world = group_size_of(group_name)
    comm = None
    if world > 1:
        lay = layout_of(weights, offsets, include_last_offset, out_shape, output_split_sizes, input_split_sizes, 0, world)
        comm = group_comm(group_name, world, lay.data_bytes(weights[0].element_size()))
    return embedding_bag_all_to_all_on(
        comm, weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
        variant=variant, book=book, padding_idx=padding_idx, per_sample_weights=per_sample_weights,
    )  # fmt: skip


def layout_of(weights, offsets, include_last_offset, out_shape, output_split_sizes, input_split_sizes, rank, world):
    bags = offsets[0].numel() - int(include_last_offset)
    return layout(
        bags, len(weights), weights[0].shape[1], tuple(int(s) for s in out_shape),
        tuple(int(s) for s in output_split_sizes), tuple(int(s) for s in input_split_sizes), rank, world,
    )  # fmt: skip


def data_bytes(
    weights: Sequence[Tensor], offsets: Sequence[Tensor], include_last_offset: bool, out_shape: Sequence[int],
    output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], world: int,
) -> int:  # fmt: skip
    """Bytes of the data workspace a call needs on every rank (the one-GPU harness sizes its workspaces with it)."""
    lay = layout_of(weights, offsets, include_last_offset, out_shape, output_split_sizes, input_split_sizes, 0, world)
    return lay.data_bytes(weights[0].element_size())


def protocol_state(comm: Comm) -> tuple[Tensor, Tensor]:
    """This rank's protocol state (int64 ``[1 + MAX_WORLD]``: the epoch, then each source's counter target) and its
    offsets scratch (int64 ``[MAX_WORLD]``), one pair per flag workspace, whose counters the state must match (both
    start at zero and only grow). The workspace's buffer is kept with them, so its address is never reused for
    another one while they live."""
    return protocol_steps.protocol_state(comm, _states, (1 + MAX_WORLD, MAX_WORLD), f"{OP} ({NAME})")


def peer_tables(comm: Comm, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """int64 ``[world]`` each: every rank's receive buffer, counters, published offsets and their flag."""
    data = [int(p) for p in comm.data.handle.buffer_ptrs][: comm.world]
    flags = [int(p) for p in comm.flags.handle.buffer_ptrs][: comm.world]
    return (
        device_table(tuple(data), device),
        device_table(tuple(p + COUNTERS for p in flags), device),
        device_table(tuple(p + _PUB for p in flags), device),
        device_table(tuple(p + PUB_FLAG for p in flags), device),
    )


def embedding_bag_all_to_all_on(
    comm: Comm | None, weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int,
    include_last_offset: bool, out_shape: Sequence[int], output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int], *, variant: str | eb.Variant = "", max_spin: int | None = None,
    book: tuple[Sequence[Tensor], ...] | None = None, padding_idx: int = -1,
    per_sample_weights: Sequence[Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """The op's result on the rank of ``comm`` (None: a group of one rank); every rank of the group makes the same
    call. The protocol of the module's docstring, on the current stream. ``variant``: a name of ``VARIANTS``
    (default: ``DEFAULT``) or a ``Variant``. ``book``: the bookkeeping's tensors (:func:`bookkeeping_tensors`),
    which the pooling kernel fills. ``padding_idx``, ``per_sample_weights``: aten's."""
    steps = protocol(
        comm, weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
        variant=variant, max_spin=max_spin, book=book, padding_idx=padding_idx, per_sample_weights=per_sample_weights,
    )  # fmt: skip
    return protocol_steps.run(steps)


def protocol(
    comm: Comm | None, weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int,
    include_last_offset: bool, out_shape: Sequence[int], output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int], *, variant: str | eb.Variant = "", max_spin: int | None = None,
    book: tuple[Sequence[Tensor], ...] | None = None, padding_idx: int = -1,
    per_sample_weights: Sequence[Tensor] | None = None,
) -> Generator[str, None, Tensor]:  # fmt: skip
    """:func:`embedding_bag_all_to_all_on` as a generator that yields the name of each launch after it (its value
    is the output): the CPU tests run every simulated rank's launches in lockstep in Triton's interpreter, which
    cannot run two ranks at once."""
    if isinstance(variant, str):
        variant = variant or eb.DEFAULT
        v = eb.VARIANTS[variant]
    else:  # a Variant of one's own (benchmarks/dlrm.py's sweep)
        v, variant = variant, eb.name_of(variant)
    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    w0 = weights[0]
    device, dtype = w0.device, w0.dtype
    lay = layout_of(weights, offsets, include_last_offset, out_shape, output_split_sizes, input_split_sizes, rank, world)
    out = torch.empty(lay.out_shape, dtype=dtype, device=device)
    if lay.bags == 0:
        return out
    tables = pointer_table(weights, indices, offsets)
    dim = lay.dim
    aligned = dim % 16 == 0 and all(w.data_ptr() % 16 == 0 for w in weights)
    common = dict(
        mode=mode, include_last_offset=include_last_offset, index_dtype=indices[0].dtype,
        offset_dtype=offsets[0].dtype, variant=v, aligned=aligned,
        src_start=device_table(lay.src_start, device),
        book=None if book is None else device_table(tuple(t.data_ptr() for t in (*book[0], *book[1])), device),
        padding_idx=padding_idx,
        psw=None if per_sample_weights is None else device_table(tuple(p.data_ptr() for p in per_sample_weights), device),
    )  # fmt: skip
    if world == 1:
        eb.pool(tables, out, lay.bags, lay.tables, dim, dst_off=device_table((0,), device), **common)
        yield "pool"
        return out

    what = f"{OP} ({NAME}:{variant})"
    if comm.data.nbytes < lay.data_bytes(w0.element_size()):
        raise ValueError(f"fluxcompile: {what}: the data workspace has {comm.data.nbytes} bytes, too few")
    if world > MAX_WORLD:
        raise ValueError(f"fluxcompile: {what}: more than {MAX_WORLD} ranks")
    comm.init_flags(FlagArray(comm.flags, COUNTERS, (PUB_FLAG + 8) // 4), 0)  # counters and the offsets' flag
    comm.errors.check_previous(what, eb.check_error)
    state, scratch = protocol_state(comm)
    spin = max_spin if max_spin is not None else protocol_steps.max_spin()
    err = comm.errors.err
    peer_data, peer_counters, peer_pub, peer_flags = peer_tables(comm, device)
    if lay.uniform:
        dst_off = device_table(lay.equal_dst_off(), device)
    else:
        dst_off = scratch
        prefix = device_table(lay.recv_prefix, device)
        my_pub = comm.flags.view(rank, (2 * MAX_WORLD,), torch.int64, _PUB)
        eb.publish(my_pub, comm.flags.view(rank, (1,), torch.int64, PUB_FLAG), prefix, state, world, MAX_WORLD)
        yield "publish"
        eb.fetch_offsets(prefix, peer_pub, peer_flags, dst_off, state, err, spin, rank, world, MAX_WORLD)
        yield "fetch_offsets"
    eb.pool(
        tables, out, lay.bags, lay.tables, dim, dst_off=dst_off, rank=rank, world=world, peer_data=peer_data,
        peer_counters=peer_counters, state=state, parity_elems=lay.parity_elems,
        rot_segment=lay.src_start[(rank + 1) % world], **common,
    )  # fmt: skip
    yield "pool"
    counters = comm.flags.view(rank, (MAX_WORLD,), torch.int64, COUNTERS)
    eb.wait(counters, device_table(lay.expect, device), state, err, spin, rank, world)
    yield "wait"
    recv = comm.data.view(rank, (2 * lay.parity_elems,), dtype)
    eb.copy_out(out.view(-1), recv, state, lay.hole, lay.parity_elems)
    yield "copy"
    comm.errors.report(what, eb.check_error)
    return out
