"""What the put-with-signal forms of the exchanges share (the DLRM ops' ``put`` choices): where they run (wherever
``config.exchange_transport`` forces it, and where a peer of the group is on another host, which only NVSHMEM's
put reaches; both need torch's NVSHMEM backend, ``config.symm_mem_backend``), and the exchange of where each
source's chunk goes in its receivers (:func:`exchange_offsets`)."""

from __future__ import annotations

from collections.abc import Generator

import torch
from torch import Tensor

from ..config import config
from ..symm_mem import Comm, backend, topology
from .device_tables import device_table

try:
    from ..kernels import put_signal as ps
except ImportError:  # no Triton: no put form is registered
    ps = None


def spans_hosts(group_name: str) -> bool:
    """Whether a peer of the group is on another host (symm_mem/topology.py: read once per group, a meeting of the
    group the compile-time choice and the autotuner have already held)."""
    return topology.layout(group_name).node_count > 1


def transport_problem(world: int, remote: bool) -> str | None:
    """Why the put form does not run for a group of ``world`` ranks (None: it does); ``remote``: a peer is on
    another host."""
    if world == 1:
        return "one rank (nothing to put)"
    if config.exchange_transport != "put" and not remote:
        return "exchange_transport is 'p2p' and every peer is on this host (the P2P form stores there directly)"
    if backend.wanted() != "NVSHMEM":
        return "put-with-signal needs symm_mem_backend 'nvshmem'"
    return None


def exchange_offsets(
    comm: Comm, values: Tensor, ostate: Tensor, dst_off: Tensor, spin: int, *, outbox: int, inbox: int,
    counters: int, block_w: int, nvshmem: bool,
) -> Generator[str, None, None]:  # fmt: skip
    """Unequal splits: put every source ``values[s]`` (where its chunk goes in our buffer), then wait (bounded) for
    every receiver's entry, into ``dst_off`` (kernels/put_signal.py's ``publish_offsets`` and ``fetch_offsets``),
    yielding after each launch. ``outbox``, ``inbox``, ``counters``: byte offsets of the regions in the flag
    workspace (int64 ``[block_w]``, ``[2, block_w]``, ``[block_w]``); ``ostate``: the offsets' own state."""
    rank, world, device = comm.rank, comm.world, values.device
    flags = [int(p) for p in comm.flags.handle.buffer_ptrs][:world]
    my_inbox = comm.flags.view(rank, (2 * block_w,), torch.int64, inbox)
    my_counters = comm.flags.view(rank, (block_w,), torch.int64, counters)
    ps.publish_offsets(
        values, comm.flags.view(rank, (block_w,), torch.int64, outbox), my_inbox, my_counters, ostate, rank=rank,
        world=world, block_w=block_w, nvshmem=nvshmem, peer_inbox=device_table(tuple(p + inbox for p in flags), device),
        peer_counters=device_table(tuple(p + counters for p in flags), device),
    )  # fmt: skip
    yield "publish"
    ps.fetch_offsets(
        values, my_inbox, my_counters, ostate, dst_off, comm.errors.err, spin, rank=rank, world=world, block_w=block_w
    )  # fmt: skip
    yield "fetch_offsets"
