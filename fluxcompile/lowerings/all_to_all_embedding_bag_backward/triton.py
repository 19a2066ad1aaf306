"""all_to_all_embedding_bag_backward with the Triton scatter (kernels/embedding_bag_backward.py): the tables' owner
reads every bag's gradient row straight from the rank that holds it and adds it into the tables' gradients; no
exchanged tensor and no separate all-to-all.

Per call, on rank r of w, all on the current stream:
  [unequal splits only] publish where each destination's chunk starts in this call's half of r's send buffer
      (the exclusive prefix of its input splits, in elements, plus the half), then read from every peer p where
      r's chunk starts in p's
  [bf16/fp16] rows kernel: zero the fp32 accumulator's rows that the indices reach
  stage kernel: r's gradients into half ``epoch % 2`` of its send buffer
  signal kernel (one program): r's ready flag to the epoch
  wait kernel (one program): a bounded wait for every peer's ready flag, then the epoch
  scatter kernel: every (block of bags, table): the bags' gradient rows from their sources' send buffers, added at
      the bags' indices (fp32 atomics: into the gradient itself when fp32, else the accumulator)
  [bf16/fp16] rows kernel: the accumulator's touched rows cast into the tables' gradients
Sparse gradients (``sparse``): the scatter writes each position's row of the values instead (no accumulator, no
zeroed gradients), and each table's gradient is the sparse COO tensor of those values at its indices, as aten's.
With equal splits (both lists empty, or all entries equal), our chunk starts at ``r * chunk`` rows in every
source's gradients: known on the host, no offsets kernels. With one rank, the scatter reads ``grad`` itself (no
workspace, no signals).

Memory: besides the gradients, bf16/fp16 tables take an fp32 accumulator as large as their gradients (only the rows
their indices reach are written). A send buffer's half holds the rank's gradients; with equal splits every rank's
half is alike, computed by its readers, else published with the offsets.

Epochs only grow (state on the device), so CUDA graphs replay the protocol; every rank must run the same calls of
this choice in the same order (as for any collective). The communication context (``symm_mem.Comm``) comes from
``symm_mem.comm_for`` for the registered choice and from the one-GPU harness (fluxcompile/testing/one_gpu_ranks.py)
in tests.

Family ``dlrm``, on by default: its choices decline every call while ``config.implementations`` leaves it out.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from ...config import config
from ...symm_mem import Comm, ErrorSpec, FlagArray, comm_for, group_size
from .. import protocol_steps
from ..device_tables import device_table

try:
    from ...kernels import embedding_bag_backward as ebb
except ImportError:  # no Triton: the choice is not registered (__init__.py)
    ebb = None

NAME = "triton"
OP = "all_to_all_embedding_bag_backward"
TAG = "all_to_all_embedding_bag_backward.triton"
MAX_WORLD = 64
# The flag workspace of a rank, all int64: its ready flag (the epoch of its last staged gradients), the epoch of
# its last published offsets, the published offsets ([2, MAX_WORLD]).
_READY = 0
_PUB_FLAG = 8
_PUB = 16
# After them, the put form's (put.py): its arrival counters ([MAX_WORLD]), and for its offsets an outbox
# ([MAX_WORLD]), an inbox ([2, MAX_WORLD]) and their counters ([MAX_WORLD]), all int64.
COUNTERS = _PUB + 16 * MAX_WORLD
OUTBOX = COUNTERS + 8 * MAX_WORLD
INBOX = OUTBOX + 8 * MAX_WORLD
OFFSET_COUNTERS = INBOX + 16 * MAX_WORLD
FLAG_BYTES = OFFSET_COUNTERS + 8 * MAX_WORLD
_ALIGN_ELEMS = 64  # a send buffer's half is a multiple of this many elements


# --- the call's layout ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the gradient rows of one call come from, on rank ``rank`` of ``world`` (rows of ``T * D`` elements)."""

    rows: int  # gradient rows this rank holds (and sends)
    bags: int  # bags of every table on this rank (rows it receives)
    tables: int
    dim: int
    rank: int
    world: int
    uniform: bool  # every split of both lists equal
    recv_start: tuple[int, ...]  # [world + 1]: the first bag of each source's chunk
    in_prefix: tuple[int, ...]  # [world]: where each destination's chunk starts in our gradients (elements)
    parity_elems: int  # elements of one half of a send buffer (the same on every rank with uniform splits)

    @property
    def row_elems(self) -> int:
        return self.tables * self.dim

    def equal_src_off(self) -> tuple[int, ...]:
        """With uniform splits: where our chunk starts in every source's gradients."""
        return (self.in_prefix[self.rank],) * self.world

    def data_bytes(self, itemsize: int) -> int:
        return 2 * self.parity_elems * itemsize


def split_problem(
    rows: int, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], world: int
) -> str | None:  # fmt: skip
    """Why the split lists do not exchange ``rows`` gradient rows (None if they do)."""
    for name, splits in (("input", input_split_sizes), ("output", output_split_sizes)):
        if splits and len(splits) != world:
            return f"{name} split list of {len(splits)} entries for a group of {world} ranks"
        if any(s < 0 for s in splits):
            return f"a negative {name} split"
    if input_split_sizes and sum(input_split_sizes) != rows:
        return f"input splits add up to {sum(input_split_sizes)}, not the gradients' {rows} rows"
    if (not input_split_sizes or not output_split_sizes) and rows % world:
        return f"equal splits of {rows} rows over {world} ranks"
    return None


def received(rows: int, output_split_sizes: Sequence[int]) -> int:
    """The exchanged rows this rank receives: one per bag of its tables."""
    return sum(output_split_sizes) if output_split_sizes else rows


@functools.lru_cache(maxsize=256)
def layout(
    rows: int, tables: int, dim: int, output_split_sizes: tuple[int, ...], input_split_sizes: tuple[int, ...],
    rank: int, world: int,
) -> Layout:  # fmt: skip
    why = split_problem(rows, output_split_sizes, input_split_sizes, world)
    if why is not None:
        raise ValueError(f"fluxcompile: {OP}: {why}")
    bags = received(rows, output_split_sizes)
    row_elems = tables * dim
    equal = rows // world if rows % world == 0 else 0
    ins = tuple(input_split_sizes) if input_split_sizes else (equal,) * world
    outs = tuple(output_split_sizes) if output_split_sizes else (equal,) * world
    uniform = len(set(ins) | set(outs)) == 1
    recv_start = tuple(sum(outs[:s]) for s in range(world + 1))
    in_prefix = tuple(sum(ins[:k]) * row_elems for k in range(world))
    # The send buffer's half: our gradients. With uniform splits every rank's is alike (as many rows as bags) and
    # readers compute it; otherwise each source publishes its offsets with its half included.
    parity = -(-rows * row_elems // _ALIGN_ELEMS) * _ALIGN_ELEMS
    return Layout(rows, bags, tables, dim, rank, world, uniform, recv_start, in_prefix, parity)


def layout_of(grad: Tensor, tables: int, output_split_sizes, input_split_sizes, rank, world):
    return layout(
        grad.shape[0], tables, grad.shape[1] // tables, tuple(int(s) for s in output_split_sizes),
        tuple(int(s) for s in input_split_sizes), rank, world,
    )  # fmt: skip


def data_bytes(grad: Tensor, tables: int, output_split_sizes, input_split_sizes, world: int) -> int:
    """Bytes of the data workspace a call needs on every rank (the one-GPU harness sizes its workspaces with it)."""
    lay = layout_of(grad, tables, output_split_sizes, input_split_sizes, 0, world)
    return lay.data_bytes(grad.element_size())


# --- supports -------------------------------------------------------------------------------------------------


_group_sizes: dict[str, int] = {}


def group_size_of(group_name: str) -> int:
    size = _group_sizes.get(group_name)
    if size is None:
        size = _group_sizes[group_name] = group_size(group_name)
    return size


def check_operands(
    grad: Tensor, indices: Sequence[Tensor], offsets: Sequence[Tensor], bag_size: Sequence[Tensor],
    num_weights: Sequence[int], scale_grad_by_freq: bool, mode: int,
) -> str | None:  # fmt: skip
    """Why the scatter kernel does not take these operands (None if it does)."""
    if mode == 2:
        return "max pooling (mode 2)"
    if mode not in (0, 1):
        return f"mode {mode}"
    tables = len(indices)
    if not tables or not tables == len(offsets) == len(bag_size) == len(num_weights):
        return "need one index, offset and bag-size tensor and one row count per table"
    if grad.dtype not in ebb.DTYPES:
        return f"dtype {grad.dtype} (fp32, bf16 and fp16 only)"
    if grad.dim() != 2 or grad.shape[1] % tables or grad.shape[1] == 0:
        return f"gradients {list(grad.shape)} are not {tables} tables' rows side by side"
    if any(i.dim() != 1 or i.dtype not in ebb.INDEX_DTYPES for i in indices):
        return "indices that are not 1-D int32/int64"
    if any(o.dim() != 1 or o.dtype not in ebb.INDEX_DTYPES for o in offsets):
        return "offsets that are not 1-D int32/int64"
    if any(i.dtype != indices[0].dtype for i in indices) or any(o.dtype != offsets[0].dtype for o in offsets):
        return "index or offset tensors of mixed dtypes"
    if any(s.dim() != 1 or s.dtype not in ebb.INDEX_DTYPES for s in bag_size):
        return "bag sizes that are not 1-D int32/int64"
    if any(s.dtype != bag_size[0].dtype for s in bag_size):
        return "bag sizes of mixed dtypes"
    if any(not t.is_contiguous() for t in (*indices, *offsets, *bag_size)):
        return "non-contiguous indices, offsets or bag sizes"
    if any(o.numel() != offsets[0].numel() for o in offsets):
        return "tables with different bag counts"
    device = grad.device
    if any(t.device != device for t in (*indices, *offsets, *bag_size)):
        return "operands on several devices"
    return None


def supports(
    grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
    output_split_sizes, input_split_sizes, group_name, per_sample_weights=None, weights=None,
) -> str | None:  # fmt: skip
    """None when the Triton choice handles the call, else why not (shapes, dtypes, group and config only: the same
    on every rank)."""
    if config.exchange_transport == "put":
        return "exchange_transport is 'put' (the put-with-signal form runs instead of the reads from peers)"
    return call_problem(
        grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
        output_split_sizes, input_split_sizes, group_name, per_sample_weights, weights,
    )  # fmt: skip


def call_problem(
    grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
    output_split_sizes, input_split_sizes, group_name, per_sample_weights=None, weights=None,
) -> str | None:  # fmt: skip
    """Why the scatter and this op's layout do not take the call (None if they do), whatever the form of its
    exchange."""
    why = check_operands(grad, indices, offsets, bag_size, num_weights, scale_grad_by_freq, mode)
    if why is None and per_sample_weights is not None:
        why = weights_problem(grad, indices, per_sample_weights, weights, mode)
    if why is not None:
        return why
    try:
        world = group_size_of(group_name)
    except Exception as e:
        return f"no process group {group_name!r} ({type(e).__name__})"
    if world > MAX_WORLD:
        return f"more than {MAX_WORLD} ranks"
    why = split_problem(grad.shape[0], list(output_split_sizes), list(input_split_sizes), world)
    if why is not None:
        return why
    return bag_problem(received(grad.shape[0], list(output_split_sizes)), offsets, bag_size, mode) or (
        "not on a CUDA device" if grad.device.type != "cuda" else None
    )


def weights_problem(
    grad: Tensor, indices: Sequence[Tensor], per_sample_weights: Sequence[Tensor], weights: Sequence[Tensor] | None,
    mode: int,
) -> str | None:  # fmt: skip
    """Why the scatter does not take these per-sample weights (and tables, for their gradients): None if it does."""
    if mode != 0:
        return "per-sample weights outside sum pooling"
    if len(per_sample_weights) != len(indices) or (weights is not None and len(weights) != len(indices)):
        return "per-sample weights or tables for some tables only"
    dim = grad.shape[1] // len(indices)
    for p, i in zip(per_sample_weights, indices):
        if p.dim() != 1 or p.numel() != i.numel() or not p.is_contiguous() or p.dtype != grad.dtype:
            return "per-sample weights that are not one contiguous weight per index in the gradients' dtype"
    if weights is not None:
        if dim > ebb.MAX_BLOCK_D:
            return f"per-sample weights' gradients of dim {dim} (at most {ebb.MAX_BLOCK_D})"
        for w in weights:
            if w.dim() != 2 or w.shape[1] != dim or w.dtype != grad.dtype or (w.shape[0] > 1 and w.stride() != (dim, 1)):
                return "tables that are not contiguous rows of the gradients' dim and dtype"
    return None


def bag_problem(bags: int, offsets: Sequence[Tensor], bag_size: Sequence[Tensor], mode: int) -> str | None:
    """Why the tables' offsets (and, in mean mode, bag sizes) do not describe ``bags`` bags (None if they do):
    ``include_last_offset`` adds one offset, aten's CUDA forward one bag size."""
    n = offsets[0].numel()
    if n not in (bags, bags + 1):
        return f"offsets of {n} entries for {bags} exchanged rows (one per bag)"
    if mode == 1 and any(s.numel() < bags for s in bag_size):
        return f"bag sizes of fewer than {bags} entries"
    return None


def make() -> tuple[Callable[..., list[Tensor]], Callable[..., str | None]]:
    """(fn, supports) of the choice ``triton``."""

    def run(grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
            output_split_sizes, input_split_sizes, group_name, per_sample_weights=None, weights=None, sparse=False,
            padding_idx=-1):  # fmt: skip
        return all_to_all_embedding_bag_backward(
            grad, indices, offsets, bag_size, num_weights, mode, output_split_sizes, input_split_sizes, group_name,
            padding_idx=padding_idx, sparse=sparse, per_sample_weights=per_sample_weights, weights=weights,
            scale_grad_by_freq=scale_grad_by_freq,
        )  # fmt: skip

    return run, supports


# --- the protocol -------------------------------------------------------------------------------------------------

_states: dict[int, tuple[Tensor, Tensor, Tensor]] = {}


def group_comm(group_name: str, world: int, data_bytes: int) -> Comm:
    """This rank's context in a process group: the (group, device) workspaces of this choice (a collective where
    one must be made or grow: every rank makes the same call) and the error buffer."""
    return comm_for(
        group_name, TAG, world=world, data_bytes=data_bytes, flag_bytes=FLAG_BYTES,
        errors=ErrorSpec(ebb.ERR_WORDS, "the DLRM backward kernel"),
    )  # fmt: skip


def all_to_all_embedding_bag_backward(
    grad: Tensor, indices: Sequence[Tensor], offsets: Sequence[Tensor], bag_size: Sequence[Tensor],
    num_weights: Sequence[int], mode: int, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
    group_name: str, padding_idx: int = -1, sparse: bool = False, per_sample_weights: Sequence[Tensor] | None = None,
    weights: Sequence[Tensor] | None = None, scale_grad_by_freq: bool = False,
) -> list[Tensor]:  # fmt: skip
    """The registered choice: this rank's ``Comm`` in the group (none with one rank), then the protocol."""
    world = group_size_of(group_name)
    comm = None
    grad = grad.contiguous()
    if world > 1:
        comm = group_comm(group_name, world, data_bytes(grad, len(indices), output_split_sizes, input_split_sizes, world))
    return all_to_all_embedding_bag_backward_on(
        comm, grad, indices, offsets, bag_size, num_weights, mode, output_split_sizes, input_split_sizes,
        padding_idx=padding_idx, sparse=sparse, per_sample_weights=per_sample_weights, weights=weights,
        scale_grad_by_freq=scale_grad_by_freq,
    )  # fmt: skip


def _state(comm: Comm) -> tuple[Tensor, Tensor]:
    """This rank's protocol state (int64 ``[1]``: the epoch of its last call, matching its ready flag: both start at
    zero and only grow) and its offsets scratch (int64 ``[MAX_WORLD]``), one pair per flag workspace. The workspace's
    buffer is kept with them, so its address is never reused for another one while they live."""
    return protocol_steps.protocol_state(comm, _states, (1, MAX_WORLD), f"{OP} ({NAME})")


def all_to_all_embedding_bag_backward_on(
    comm: Comm | None, grad: Tensor, indices: Sequence[Tensor], offsets: Sequence[Tensor], bag_size: Sequence[Tensor],
    num_weights: Sequence[int], mode: int, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], *,
    max_spin: int | None = None, padding_idx: int = -1, sparse: bool = False,
    per_sample_weights: Sequence[Tensor] | None = None, weights: Sequence[Tensor] | None = None,
    scale_grad_by_freq: bool = False, exchange: Exchange | None = None, form: str = NAME,
) -> list[Tensor]:  # fmt: skip
    """The op's result on the rank of ``comm`` (None: a group of one rank); every rank of the group makes the same
    call. The protocol of the module's docstring, on the current stream (``exchange``: :func:`protocol`'s).
    ``padding_idx``: aten's (-1: none);
    ``sparse``: sparse COO gradients (each position's row at its index, uncoalesced), as aten's;
    ``per_sample_weights``: aten's (sum pooling), and with the tables (``weights``) the per-sample weights'
    gradients follow the tables' in the result."""
    steps = protocol(
        comm, grad, indices, offsets, bag_size, num_weights, mode, output_split_sizes, input_split_sizes,
        max_spin=max_spin, padding_idx=padding_idx, sparse=sparse, per_sample_weights=per_sample_weights,
        weights=weights, scale_grad_by_freq=scale_grad_by_freq, exchange=exchange, form=form,
    )  # fmt: skip
    return protocol_steps.run(steps)


def _tables(indices: Sequence[Tensor], offsets: Sequence[Tensor], bag_size: Sequence[Tensor], device) -> Tensor:
    """int64 ``[5, T]``: every table's indices, offsets and bag-size addresses, its index and offset counts."""
    values = (
        *(i.data_ptr() for i in indices),
        *(o.data_ptr() for o in offsets),
        *(s.data_ptr() for s in bag_size),
        *(i.numel() for i in indices),
        *(o.numel() for o in offsets),
    )
    return device_table(values, device)


@dataclasses.dataclass(frozen=True)
class Reach:
    """Where the scatter finds every source's rows after an exchange (kernels/embedding_bag_backward.py's
    ``scatter``): each source's buffer, our chunk's offset there (``absolute``: the half included), the state
    whose epoch picks the half, and the half's elements."""

    peer_send: Tensor
    src_off: Tensor
    state: Tensor
    absolute: bool
    parity_elems: int


Exchange = Callable[[Comm, Tensor, Layout, int], Generator[str, None, Reach]]


def p2p_exchange(comm: Comm, grad: Tensor, lay: Layout, spin: int) -> Generator[str, None, Reach]:
    """The P2P form's exchange: stage ``grad`` in our send buffer's half and raise our ready flag ([unequal splits]
    after publishing our offsets and reading our chunk's in every peer's), then wait for every peer's flag: the
    scatter reads each source's rows from its send buffer."""
    rank, world, device, dtype = comm.rank, comm.world, grad.device, grad.dtype
    what = f"{OP} ({NAME})"
    if comm.data.nbytes < lay.data_bytes(grad.element_size()):
        raise ValueError(f"fluxcompile: {what}: the data workspace has {comm.data.nbytes} bytes, too few")
    comm.init_flags(FlagArray(comm.flags, _READY, _PUB // 4), 0)  # the ready flag and the offsets' flag
    state, scratch = _state(comm)
    err = comm.errors.err
    flags = [int(p) for p in comm.flags.handle.buffer_ptrs][:world]
    if lay.uniform:
        src_off = device_table(lay.equal_src_off(), device)
    else:
        src_off = scratch
        prefix = device_table(lay.in_prefix, device)
        my_pub = comm.flags.view(rank, (2 * MAX_WORLD,), torch.int64, _PUB)
        my_flag = comm.flags.view(rank, (1,), torch.int64, _PUB_FLAG)
        ebb.publish(my_pub, my_flag, prefix, state, world, lay.parity_elems, MAX_WORLD)
        yield "publish"
        ebb.fetch(
            device_table(tuple(p + _PUB for p in flags), device),
            device_table(tuple(p + _PUB_FLAG for p in flags), device), src_off, state, err, spin, rank, world,
            MAX_WORLD,
        )  # fmt: skip
        yield "fetch"
    send = comm.data.view(rank, (2 * lay.parity_elems,), dtype)
    ebb.stage(grad, send, state, lay.parity_elems)
    yield "stage"
    ebb.signal(comm.flags.view(rank, (1,), torch.int64, _READY), state)
    yield "signal"
    ebb.wait(device_table(tuple(p + _READY for p in flags), device), state, err, spin, rank, world)
    yield "wait"
    peer_send = device_table(tuple(int(p) for p in comm.data.handle.buffer_ptrs[:world]), device)
    return Reach(peer_send, src_off, state, not lay.uniform, lay.parity_elems)


def protocol(
    comm: Comm | None, grad: Tensor, indices: Sequence[Tensor], offsets: Sequence[Tensor], bag_size: Sequence[Tensor],
    num_weights: Sequence[int], mode: int, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], *,
    max_spin: int | None = None, padding_idx: int = -1, sparse: bool = False,
    per_sample_weights: Sequence[Tensor] | None = None, weights: Sequence[Tensor] | None = None,
    scale_grad_by_freq: bool = False, exchange: Exchange | None = None, form: str = NAME,
) -> Generator[str, None, list[Tensor]]:  # fmt: skip
    """:func:`all_to_all_embedding_bag_backward_on` as a generator that yields the name of each launch after it (its
    value is the tables' gradients): the CPU tests run every simulated rank's launches in lockstep in Triton's
    interpreter, which cannot run two ranks at once. ``exchange``: how the scatter reaches every source's rows
    (default :func:`p2p_exchange`; put.py's puts them here first); ``form``: the choice's name in errors."""
    if sparse and scale_grad_by_freq:
        raise ValueError(f"fluxcompile: {OP} ({NAME}): scale_grad_by_freq with sparse gradients (aten refuses it too)")
    if sparse and padding_idx >= 0:
        raise ValueError(f"fluxcompile: {OP} ({NAME}): sparse gradients with a padding_idx (aten drops its positions)")
    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    device, dtype = grad.device, grad.dtype
    T = len(indices)
    lay = layout_of(grad, T, output_split_sizes, input_split_sizes, rank, world)
    if why := bag_problem(lay.bags, offsets, bag_size, mode):
        raise ValueError(f"fluxcompile: {OP}: {why}")
    dim = lay.dim
    num_weights = [int(n) for n in num_weights]
    fp32 = dtype == torch.float32 or sparse  # sparse: the values are written, never accumulated
    if sparse:  # each position's row of the values (aten's uncoalesced sparse gradient)
        grads = [torch.empty(i.numel(), dim, dtype=dtype, device=device) for i in indices]
    else:
        grads = [torch.zeros(n, dim, dtype=dtype, device=device) for n in num_weights]
    if fp32:
        dst = device_table(tuple(g.data_ptr() for g in grads), device)
    else:
        acc = torch.empty(max(1, sum(num_weights) * dim), dtype=torch.float32, device=device)
        starts = [0, *itertools.accumulate(num_weights)]
        dst = device_table(tuple(acc.data_ptr() + 4 * dim * s for s in starts[:T]), device)
        out_table = device_table(tuple(g.data_ptr() for g in grads), device)
    tables = _tables(indices, offsets, bag_size, device)
    pgrads = []
    psw = None
    if per_sample_weights is not None:
        if weights is not None:  # the per-sample weights' gradients, zero where no bag reaches
            pgrads = [torch.zeros(i.numel(), dtype=dtype, device=device) for i in indices]
        ptrs = (*per_sample_weights, *(weights or per_sample_weights), *(pgrads or per_sample_weights))
        psw = device_table(tuple(x.data_ptr() for x in ptrs), device)
    freq = None
    if scale_grad_by_freq:  # how often each index occurs in its table's indices (no host synchronization)
        counts = [
            torch.zeros(n, dtype=torch.float32, device=device).index_add_(
                0, i.long(), torch.ones((), dtype=torch.float32, device=device).expand(i.numel())
            )
            for i, n in zip(indices, num_weights)
        ]
        freq = device_table(tuple(c.data_ptr() for c in counts), device)
    max_idx = max(i.numel() for i in indices)
    kinds = dict(index_dtype=indices[0].dtype)
    if not fp32:
        ebb.rows(tables, dst, out_table, grad, max_idx, T, dim, cast=False, **kinds)
        yield "zero"
    scatter = dict(
        mode=mode, offset_dtype=offsets[0].dtype, size_dtype=bag_size[0].dtype, recv_start=device_table(lay.recv_start, device),
        row_elems=lay.row_elems, world=world, padding_idx=padding_idx, sparse=sparse, psw=psw, pgrad=bool(pgrads),
        freq=freq, **kinds,
    )  # fmt: skip
    if world == 1:
        ebb.scatter(
            tables, dst, grad, lay.bags, T, dim, peer_send=device_table((grad.data_ptr(),), device),
            src_off=device_table((0,), device), state=device_table((0,), device), parity_elems=0, **scatter,
        )  # fmt: skip
        yield "scatter"
    else:
        what = f"{OP} ({form})"
        if world > MAX_WORLD:
            raise ValueError(f"fluxcompile: {what}: more than {MAX_WORLD} ranks")
        comm.errors.check_previous(what, ebb.check_error)
        spin = max_spin if max_spin is not None else protocol_steps.max_spin()
        reach = yield from (exchange or p2p_exchange)(comm, grad, lay, spin)
        ebb.scatter(
            tables, dst, grad, lay.bags, T, dim, peer_send=reach.peer_send, src_off=reach.src_off, state=reach.state,
            parity_elems=reach.parity_elems, rot_bag=lay.recv_start[(rank + 1) % world], absolute=reach.absolute,
            **scatter,
        )  # fmt: skip
        yield "scatter"
        comm.errors.report(what, ebb.check_error)
    if not fp32:
        ebb.rows(tables, dst, out_table, grad, max_idx, T, dim, cast=True, **kinds)
        yield "cast"
    if sparse:
        # the indices copied (an output never aliases an input), as int64 as aten's
        grads = [
            torch.sparse_coo_tensor(
                i.view(1, -1).to(torch.int64, copy=True), v, (n, dim), check_invariants=False, is_coalesced=False
            )
            for i, v, n in zip(indices, grads, num_weights)
        ]
    return grads + pgrads
