"""Shared fixtures: persistent pools of gloo ranks (one per world size), started on first use."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fluxcompile.testing import RankPool

_pools: dict[int, RankPool] = {}


def pool_of(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        pool = _pools[world_size] = RankPool(world_size, "gloo", timeout_s=900)
    return pool


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n).run(fn, *args)`` runs a module-level ``fn`` on n gloo ranks."""
    yield pool_of
    for pool in _pools.values():
        pool.close()
