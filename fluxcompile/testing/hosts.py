"""Ranks that pretend to run on other hosts: the group layout (symm_mem/topology.py) reads the host each rank
publishes, so one machine's gloo ranks can stand for a group that spans several nodes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.distributed as dist

from ..symm_mem import topology


@contextlib.contextmanager
def simulated_hosts(host_of_rank: Callable[[int], str]) -> Iterator[None]:
    """Inside the block, this rank publishes ``host_of_rank(its global rank)`` as its host. Every rank of the
    groups involved must enter the block alike: the cached layouts are forgotten on entry and on exit, so the
    next question about a group reads its layout again, a meeting of all its ranks."""
    rank = dist.get_rank()
    saved = topology.host_identity
    topology.host_identity = lambda: host_of_rank(rank)
    topology.clear()
    try:
        yield
    finally:
        topology.host_identity = saved
        topology.clear()
