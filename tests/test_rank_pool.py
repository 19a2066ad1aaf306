"""The rank pool's rendezvous: the ranks meet through a store the pool's process serves on a port it holds."""

from __future__ import annotations

import errno
import socket

import pytest

from fluxcompile.testing import RankPool


def rank_facts() -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), int(t)


def test_ranks_meet_on_a_port_the_pool_holds():
    with RankPool(2, "gloo", timeout_s=300) as a, RankPool(2, "gloo", timeout_s=300) as b:
        ports = a.port, b.port
        assert ports[0] != ports[1] and 0 not in ports
        # Bound by this process for the pool's life: no other process can take it before the ranks connect.
        for port in ports:
            with socket.socket() as s, pytest.raises(OSError) as e:
                s.bind(("127.0.0.1", port))
            assert e.value.errno == errno.EADDRINUSE
        assert a.run(rank_facts) == [(0, 2, 3), (1, 2, 3)]
        assert b.run(rank_facts) == [(0, 2, 3), (1, 2, 3)]
