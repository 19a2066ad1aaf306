"""Where the put-with-signal form of an exchange runs (the DLRM ops' ``put`` choices): wherever
``config.exchange_transport`` forces it, and where a peer of the group is on another host (which only NVSHMEM's
put reaches); both need torch's NVSHMEM backend (``config.symm_mem_backend``)."""

from __future__ import annotations

from ..config import config
from ..symm_mem import backend, topology


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
