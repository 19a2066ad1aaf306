"""embedding_bag_all_to_all in put-with-signal form (choice ``put``): the pooling kernel (kernels/embedding_bag.py)
pools every row into this rank's symmetric send buffer, then one launch puts each peer's chunk into that peer's
receive buffer with NVSHMEM's put-with-signal (kernels/put_signal.py). This is the form that reaches peers on other
hosts: NVSHMEM picks each peer's transport (NVLink P2P on one host, the network across hosts), and no kernel
dereferences a peer's address. ``config.exchange_transport = "put"`` forces it on one host too, so that its path
runs and is tested there; a group that spans hosts takes it with the NVSHMEM backend (lowerings/choices.py's
``remote_peers``).

Per call, on rank r of w:
  [unequal splits only] offsets kernels: put every source where its chunk starts in our output (8 bytes with a
      signal into its inbox), then wait (bounded) for every receiver's entry: where our chunk goes there (with
      uniform splits it starts at ``r * chunk`` everywhere, known on the host)
  pooling kernel (one rank's form): every row into the send buffer, in the op's flat order (chunk p = rows for p)
  put kernel: chunk p into half ``epoch % 2`` of p's receive buffer, then its elements (+1) on p's counter[r];
      our own chunk into the output
  wait kernel (one program, bounded): every source's counter reached its target, then the epoch advances
  copy kernel: the peers' chunks from the receive buffer into the output
The same state, counters and halves as the P2P form (triton.py), whose workspace this choice shares (its data
workspace is the receive buffer's two halves, then the send buffer): the ranks may switch between the two forms
from one call to the next, as every rank takes the same choice per call. Halves alternate by the epoch as there: a
sender is at most one call ahead of a receiver. The send buffer is free again when the put kernel returns
(``putmem_signal_block`` returns once its source may be reused).
The offsets have their own epoch and counter targets (``_offset_states``) and inbox halves, since only this form's
calls with unequal splits advance them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from ...symm_mem import Comm, FlagArray
from .. import protocol_steps
from ..device_tables import device_table
from ..transport import exchange_offsets, spans_hosts, transport_problem
from . import triton as p2p

try:
    from ...kernels import embedding_bag as eb
    from ...kernels import put_signal as ps
except ImportError:  # no Triton: the choice is not registered (__init__.py)
    eb = ps = None

NAME = "put"
_ALIGN_BYTES = 256
_offset_states: dict[int, tuple[Tensor, ...]] = {}


def send_offset(lay: p2p.Layout, itemsize: int) -> int:
    """Bytes from the data workspace's start to the send buffer (after the receive buffer's two halves)."""
    return -(-lay.data_bytes(itemsize) // _ALIGN_BYTES) * _ALIGN_BYTES


def data_bytes(lay: p2p.Layout, itemsize: int) -> int:
    """Bytes of the data workspace: the receive buffer's halves, then the send buffer (every pooled row)."""
    return send_offset(lay, itemsize) + lay.bags * lay.tables * lay.dim * itemsize


def make(
    variant: str, remote: Callable[[str], bool] = spans_hosts
) -> tuple[Callable[..., tuple], Callable[..., str | None]]:  # fmt: skip
    """(fn, supports) of the choice ``put:<variant>`` (``variant``: the pooling kernel's launch); ``remote(group)``:
    whether a peer of the group is on another host."""

    def supports(weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes,
                 input_split_sizes, group_name, per_sample_weights=None) -> str | None:  # fmt: skip
        why = p2p.call_problem(
            weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
            group_name, per_sample_weights,
        )  # fmt: skip
        if why is not None:
            return why
        return transport_problem(p2p.group_size_of(group_name), remote(group_name))

    def run(weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
            group_name, per_sample_weights=None, bookkeeping=False, padding_idx=-1):  # fmt: skip
        book = p2p.bookkeeping_tensors(indices, offsets) if bookkeeping else None
        world = p2p.group_size_of(group_name)
        lay = p2p.layout_of(weights, offsets, include_last_offset, out_shape, output_split_sizes,
                            input_split_sizes, 0, world)  # fmt: skip
        comm = p2p.group_comm(group_name, world, data_bytes(lay, weights[0].element_size()))
        out = protocol_steps.run(protocol(
            comm, weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes,
            input_split_sizes, variant=variant, book=book, padding_idx=padding_idx,
            per_sample_weights=per_sample_weights, nvshmem=True,
        ))  # fmt: skip
        return (out, [], [], []) if book is None else (out, *book)

    return run, supports


def protocol(
    comm: Comm, weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int,
    include_last_offset: bool, out_shape: Sequence[int], output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int], *, variant: str = "", max_spin: int | None = None,
    book: tuple[Sequence[Tensor], ...] | None = None, padding_idx: int = -1,
    per_sample_weights: Sequence[Tensor] | None = None, nvshmem: bool = True,
) -> Generator[str, None, Tensor]:  # fmt: skip
    """The put form's launches on the rank of ``comm`` (every rank of the group makes the same call), yielding the
    name of each after it (the CPU tests step simulated ranks in lockstep); its value is the output. ``nvshmem``:
    put with NVSHMEM (the workspaces are in NVSHMEM's heap), else store through the peers' P2P addresses (the rank
    harnesses and Triton's interpreter)."""
    variant = variant or eb.DEFAULT
    v = eb.VARIANTS[variant]
    rank, world = comm.rank, comm.world
    w0 = weights[0]
    device, dtype = w0.device, w0.dtype
    lay = p2p.layout_of(weights, offsets, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
                        rank, world)  # fmt: skip
    what = f"{p2p.OP} ({NAME}:{variant})"
    out = torch.empty(lay.out_shape, dtype=dtype, device=device)
    if lay.bags == 0:
        return out
    itemsize = w0.element_size()
    if comm.data.nbytes < data_bytes(lay, itemsize):
        raise ValueError(f"fluxcompile: {what}: the data workspace has {comm.data.nbytes} bytes, too few")
    comm.init_flags(FlagArray(comm.flags, p2p.COUNTERS, (p2p.PUB_FLAG + 8) // 4), 0)
    comm.errors.check_previous(what, eb.check_error)
    state, scratch = p2p.protocol_state(comm)
    spin = max_spin if max_spin is not None else protocol_steps.max_spin()
    if lay.uniform:
        dst_off = device_table(lay.equal_dst_off(), device)
    else:  # where our chunk starts in each receiver's output: from the receivers
        comm.init_flags(FlagArray(comm.flags, p2p.OUTBOX, (p2p.FLAG_BYTES - p2p.OUTBOX) // 4), 0)
        (ostate,) = protocol_steps.protocol_state(comm, _offset_states, (1 + p2p.MAX_WORLD,), f"{what} offsets")
        dst_off = scratch
        yield from exchange_offsets(
            comm, device_table(lay.recv_prefix, device), ostate, dst_off, spin, outbox=p2p.OUTBOX, inbox=p2p.INBOX,
            counters=p2p.OFFSET_COUNTERS, block_w=p2p.MAX_WORLD, nvshmem=nvshmem,
        )  # fmt: skip
    numel = lay.bags * lay.tables * lay.dim
    send = comm.data.view(rank, (numel,), dtype, send_offset(lay, itemsize))
    tables = p2p.pointer_table(weights, indices, offsets)
    eb.pool(
        tables, send, lay.bags, lay.tables, lay.dim, mode=mode, include_last_offset=include_last_offset,
        index_dtype=indices[0].dtype, offset_dtype=offsets[0].dtype, variant=v,
        aligned=lay.dim % 16 == 0 and all(w.data_ptr() % 16 == 0 for w in weights),
        dst_off=device_table((0,), device), src_start=device_table((0, numel // lay.dim), device),
        book=None if book is None else device_table(tuple(t.data_ptr() for t in (*book[0], *book[1])), device),
        padding_idx=padding_idx,
        psw=None if per_sample_weights is None else device_table(tuple(p.data_ptr() for p in per_sample_weights), device),
    )  # fmt: skip
    yield "pool"
    recv = comm.data.view(rank, (2 * lay.parity_elems,), dtype)
    counters = comm.flags.view(rank, (p2p.MAX_WORLD,), torch.int64, p2p.COUNTERS)
    n_slices = ps.slices(max(b - a for a, b in zip(lay.src_start, lay.src_start[1:])) * lay.dim * itemsize)
    peer_data, peer_counters, _, _ = p2p.peer_tables(comm, device)
    ps.put_chunks(
        send, out.view(-1), recv, counters, src_start=device_table(lay.src_start, device),
        dst_off=dst_off, state=state, dim=lay.dim, parity_elems=lay.parity_elems,
        rank=rank, world=world, n_slices=n_slices, nvshmem=nvshmem, peer_data=peer_data, peer_counters=peer_counters,
    )  # fmt: skip
    yield "put"
    # each source adds its chunk's elements + 1
    expect = tuple(0 if s == rank else lay.out_splits[s] * lay.unit + 1 for s in range(world))
    eb.wait(counters, device_table(expect, device), state, comm.errors.err, spin, rank, world)
    yield "wait"
    eb.copy_out(out.view(-1), recv, state, lay.hole, lay.parity_elems)
    yield "copy"
    comm.errors.report(what, eb.check_error)
    return out
