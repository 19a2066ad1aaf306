"""all_to_all_embedding_bag_backward in put-with-signal form (choice ``put``): every rank puts each owner's chunk of
its pooled rows' gradients into that owner's receive buffer with NVSHMEM's put-with-signal (kernels/put_signal.py),
and the owner's scatter (kernels/embedding_bag_backward.py) reads every source's rows from its own memory. The
form that reaches owners on other hosts (NVSHMEM picks each peer's transport; no kernel dereferences a peer's
address), forced on one host by ``config.exchange_transport = "put"`` (lowerings/transport.py).

Per call, on rank r of w:
  [unequal splits only] offsets kernels: put every source where its rows start in our receive half (8 bytes with
      a signal into its inbox), then wait (bounded) for every owner's entry: where our chunk goes there (with
      uniform splits, ``r * chunk`` rows everywhere, known on the host)
  [bf16/fp16] rows kernel: zero the fp32 accumulator's touched rows (triton.py's protocol, unchanged)
  copy: the gradients into our symmetric send buffer (a put's source is symmetric memory, which a remote
      transport reaches)
  put kernel: chunk p into half ``epoch % 2`` of p's receive buffer, then its elements (+1) on p's counter[r];
      our own chunk into our receive buffer's half
  wait kernel (one program, bounded; kernels/embedding_bag.py's): every source's counter reached its target, then
      the epoch advances
  scatter kernel: every bag's row from our receive buffer, added at the bag's indices (triton.py's protocol)
The data workspace holds the P2P form's two send halves, then this form's two receive halves and its send buffer;
its state (epoch and counter targets) and counters are its own. The P2P form's and this form's traffic never
meet, so the ranks may switch forms from one call to the next. Halves alternate by the epoch: a sender is at most
one call ahead of a receiver (its next call follows its wait, which needed the receiver's puts of this call, made
after the receiver's scatter of the previous one).

A receive half holds what this rank receives: with uniform splits its own rows' worth, else ``world`` times that
(a bound alike on every rank where the ranks hold as many gradient rows, as DLRM's do: a sender writes at the
receiver's half by its own bound).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

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
_ALIGN_ELEMS = 64
_states: dict[int, tuple[Tensor, ...]] = {}


def recv_parity(lay: p2p.Layout) -> int:
    """Elements of one half of this form's receive buffer (see the module)."""
    if lay.uniform:
        return lay.parity_elems
    return -(-lay.world * lay.rows * lay.row_elems // _ALIGN_ELEMS) * _ALIGN_ELEMS


def regions(lay: p2p.Layout, itemsize: int) -> tuple[int, int, int]:
    """Bytes from the data workspace's start to this form's receive halves and to its send buffer, and its size."""
    recv = -(-lay.data_bytes(itemsize) // _ALIGN_BYTES) * _ALIGN_BYTES
    send = recv + -(-2 * recv_parity(lay) * itemsize // _ALIGN_BYTES) * _ALIGN_BYTES
    return recv, send, send + lay.rows * lay.row_elems * itemsize


def protocol_state(comm: Comm) -> Tensor:
    """This form's state on the rank of ``comm`` (int64 ``[1 + MAX_WORLD]``: the epoch, then each source's counter
    target), one per flag workspace (both start at zero and only grow)."""
    return _state_of(comm)[0]


def _state_of(comm: Comm) -> tuple[Tensor, Tensor, Tensor]:
    """The state, the offsets' scratch (int64 ``[MAX_WORLD]``) and the offsets' own state (int64
    ``[1 + MAX_WORLD]``: only calls with unequal splits advance it)."""
    return protocol_steps.protocol_state(
        comm, _states, (1 + p2p.MAX_WORLD, p2p.MAX_WORLD, 1 + p2p.MAX_WORLD), f"{p2p.OP} ({NAME})"
    )


def data_bytes(lay: p2p.Layout, itemsize: int) -> int:
    """Bytes of the data workspace this form needs (the P2P form's halves, then its own buffers)."""
    return regions(lay, itemsize)[2]


def exchange(
    comm: Comm, grad: Tensor, lay: p2p.Layout, spin: int, *, nvshmem: bool = True
) -> Generator[str, None, p2p.Reach]:
    """The put form's exchange (:data:`p2p.Exchange`; ``nvshmem``: put with NVSHMEM, else store through the peers'
    P2P addresses: the rank harnesses and Triton's interpreter)."""
    rank, world, device, dtype = comm.rank, comm.world, grad.device, grad.dtype
    what = f"{p2p.OP} ({NAME})"
    itemsize = grad.element_size()
    recv_at, send_at, need = regions(lay, itemsize)
    if comm.data.nbytes < need:
        raise ValueError(f"fluxcompile: {what}: the data workspace has {comm.data.nbytes} bytes, too few")
    comm.init_flags(FlagArray(comm.flags, p2p.COUNTERS, (p2p.FLAG_BYTES - p2p.COUNTERS) // 4), 0)
    state, scratch, ostate = _state_of(comm)
    parity = recv_parity(lay)
    row_elems = lay.row_elems
    if lay.bags * row_elems > parity:
        raise ValueError(
            f"fluxcompile: {what}: rank {rank} receives {lay.bags} rows, more than its receive half holds (every "
            "rank must hold as many gradient rows)"
        )
    flags = [int(p) for p in comm.flags.handle.buffer_ptrs][:world]
    # rows we send each owner, and where each source's rows start in our receive half (elements)
    ins = [b - a for a, b in zip(lay.in_prefix, (*lay.in_prefix[1:], lay.rows * row_elems))]
    ours = tuple(lay.recv_start[s] * row_elems for s in range(world))
    if lay.uniform:
        dst_off = device_table((ours[rank],) * world, device)
    else:  # where our chunk goes in each owner's receive half: from the owners
        dst_off = scratch
        yield from exchange_offsets(
            comm, device_table(ours, device), ostate, dst_off, spin, outbox=p2p.OUTBOX, inbox=p2p.INBOX,
            counters=p2p.OFFSET_COUNTERS, block_w=p2p.MAX_WORLD, nvshmem=nvshmem,
        )  # fmt: skip
    recv = comm.data.view(rank, (2 * parity,), dtype, recv_at)
    send = comm.data.view(rank, (lay.rows * lay.row_elems,), dtype, send_at)
    send.copy_(grad.reshape(-1))
    yield "copy"
    counters = comm.flags.view(rank, (p2p.MAX_WORLD,), torch.int64, p2p.COUNTERS)
    n_slices = ps.slices(max(ins) * itemsize)
    data = [int(p) for p in comm.data.handle.buffer_ptrs][:world]
    src_start = (*(a // row_elems for a in lay.in_prefix), lay.rows)
    ps.put_chunks(
        send, send, recv, counters, src_start=device_table(src_start, device), dst_off=dst_off, state=state,
        dim=row_elems, parity_elems=parity, rank=rank, world=world, n_slices=n_slices, nvshmem=nvshmem,
        peer_data=device_table(tuple(p + recv_at for p in data), device),
        peer_counters=device_table(tuple(p + p2p.COUNTERS for p in flags), device), own_in_recv=True,
    )  # fmt: skip
    yield "put"
    # each source adds its chunk's elements + 1
    expect = tuple(
        0 if s == rank else (lay.recv_start[s + 1] - lay.recv_start[s]) * row_elems + 1 for s in range(world)
    )
    eb.wait(counters, device_table(expect, device), state, comm.errors.err, spin, rank, world)
    yield "wait"
    # every source's rows sit in our receive buffer's half, source s's from bag recv_start[s] on
    return p2p.Reach(device_table((recv.data_ptr(),) * world, device), device_table(ours, device), state, False, parity)


def make(remote: Callable[[str], bool] = spans_hosts) -> tuple[Callable[..., list[Tensor]], Callable[..., str | None]]:
    """(fn, supports) of the choice ``put``; ``remote(group)``: whether a peer of the group is on another host."""

    def supports(grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
                 output_split_sizes, input_split_sizes, group_name, per_sample_weights=None,
                 weights=None) -> str | None:  # fmt: skip
        why = p2p.call_problem(
            grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
            output_split_sizes, input_split_sizes, group_name, per_sample_weights, weights,
        )  # fmt: skip
        if why is not None:
            return why
        return transport_problem(p2p.group_size_of(group_name), remote(group_name))

    def run(grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
            output_split_sizes, input_split_sizes, group_name, per_sample_weights=None, weights=None, sparse=False,
            padding_idx=-1):  # fmt: skip
        world = p2p.group_size_of(group_name)
        grad = grad.contiguous()
        lay = p2p.layout_of(grad, len(indices), output_split_sizes, input_split_sizes, 0, world)
        comm = p2p.group_comm(group_name, world, data_bytes(lay, grad.element_size()))
        return p2p.all_to_all_embedding_bag_backward_on(
            comm, grad, indices, offsets, bag_size, num_weights, mode, output_split_sizes, input_split_sizes,
            padding_idx=padding_idx, sparse=sparse, per_sample_weights=per_sample_weights, weights=weights,
            scale_grad_by_freq=scale_grad_by_freq, exchange=exchange, form=NAME,
        )  # fmt: skip

    return run, supports
