"""Where the ranks of a group run, and whether every rank can reach every other's memory by P2P.

Symmetric memory maps each rank's buffer into its peers' address spaces (CUDA IPC), which works only between GPUs
of one host that can access each other's memory. A group that spans several hosts, or GPUs without peer access,
has no symmetric-memory choice: those choices decline with :func:`no_peer_access`'s reason and the unfused
collective (NCCL) runs instead, rather than failing at the first exchange.

The layout is read once per group and cached: every rank publishes, through the default store, its host (host
name and boot id, :func:`host_identity`), its current CUDA device and which local devices that device can access
(``torch.cuda.can_device_access_peer``); every rank reads all of them and computes the same answer, so the
decision is identical on all ranks. Reading it is a meeting of the group: every rank of the group must ask, in the
same order of groups (the compile-time choice and the autotuner ask at the same points on every rank).
"""

from __future__ import annotations

import dataclasses
import json
import socket

import torch
import torch.distributed as dist

from ..config import config
from .groups import process_group
from .store_gather import gather_strings

BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each rank of a group runs (by group rank), and why symmetric memory cannot span it (None: it can).
    A node is a host: ranks of one node reach each other by P2P (CUDA IPC, NVLink), ranks of two only over the
    network (NVSHMEM's put/get, NCCL): :meth:`remote` and the peer lists say which, per pair."""

    hosts: tuple[str, ...]
    devices: tuple[int, ...]  # each rank's CUDA device index on its host, -1 without CUDA
    no_peer_access: str | None

    @property
    def nodes(self) -> tuple[int, ...]:
        """Each rank's node, numbered by the first rank on it."""
        return node_indices(self.hosts)

    @property
    def node_count(self) -> int:
        return len(set(self.hosts))

    def remote(self, rank: int, peer: int) -> bool:
        """Whether ``peer`` is on another node than ``rank`` (reached over the network, not by P2P)."""
        return self.hosts[rank] != self.hosts[peer]

    def local_peers(self, rank: int) -> tuple[int, ...]:
        """The other ranks of ``rank``'s node, in group order."""
        return tuple(p for p in range(len(self.hosts)) if p != rank and not self.remote(rank, p))

    def remote_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks on other nodes, in group order."""
        return tuple(p for p in range(len(self.hosts)) if self.remote(rank, p))


def node_indices(hosts: tuple[str, ...] | list[str]) -> tuple[int, ...]:
    """Each rank's node index: hosts numbered in order of their first rank (identical on every rank)."""
    order = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    return tuple(order[h] for h in hosts)


_layouts: dict[str, Layout] = {}


def host_identity() -> str:
    """This process's host: its host name and boot id (two hosts may share a name; containers share a boot id)."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _this_rank() -> dict:
    device, peers = -1, []
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        n = torch.cuda.device_count()
        peers = [j == device or torch.cuda.can_device_access_peer(device, j) for j in range(n)]
    return {"host": host_identity(), "device": device, "peers": peers}


def _reason(ranks: list[dict]) -> str | None:
    """Why the ranks (as published) cannot all reach each other by P2P, or None."""
    hosts = list(dict.fromkeys(r["host"] for r in ranks))
    if len(hosts) > 1:
        where = "; ".join(
            f"{h.partition('/')[0]}: ranks {[i for i, r in enumerate(ranks) if r['host'] == h]}" for h in hosts
        )
        return f"the group spans {len(hosts)} hosts ({where}), and symmetric memory reaches only the GPUs of one host"
    for i, a in enumerate(ranks):
        for j, b in enumerate(ranks):
            d = b["device"]
            if i != j and a["device"] >= 0 and d >= 0 and not (d < len(a["peers"]) and a["peers"][d]):
                return (
                    f"ranks {i} and {j} (GPUs {a['device']} and {d}) cannot access each other's memory (no P2P), "
                    "which symmetric memory needs"
                )
    return None


def layout(group: dist.ProcessGroup | str, timeout_s: float | None = None) -> Layout:
    """The group's layout (read once per group, then cached): a meeting of every rank of the group, bounded by
    ``timeout_s`` (default ``config.choose_timeout_s``)."""
    if isinstance(group, str):
        group_name = group
        group = process_group(group_name)
    else:
        group_name = group.group_name
    if group_name in _layouts:
        return _layouts[group_name]
    mine = _this_rank()
    if group.size() == 1:
        ranks = [mine]
    else:
        _, published = gather_strings(
            group,
            "layout",
            json.dumps(mine),
            config.choose_timeout_s if timeout_s is None else timeout_s,
            lambda n: f"reading the layout of group {group_name}",
            "every rank of the group must compile the same graphs",
        )
        ranks = [json.loads(r) for r in published]
    result = Layout(tuple(r["host"] for r in ranks), tuple(r["device"] for r in ranks), _reason(ranks))
    _layouts[group_name] = result
    return result


def no_peer_access(group: dist.ProcessGroup | str, timeout_s: float | None = None) -> str | None:
    """Why no symmetric-memory choice can run on the group (its ranks are not all reachable by P2P), or None."""
    return layout(group, timeout_s).no_peer_access


def clear() -> None:
    """Forget every group's layout: the next question reads it again (every rank of the group must clear alike)."""
    _layouts.clear()
