"""Shared fixtures: persistent pools of gloo ranks (one per world size), started on first use; the background
compiles of the compile-only checks (prebuild.py), started once the session is collected, their tests last."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import prebuild

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


def _jobs(item: pytest.Item) -> list[str]:
    return [m.args[0] for m in item.iter_markers("prebuild")]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of background compiles run last: by then their compilers have finished beside the other tests."""
    items[:] = [i for i in items if not _jobs(i)] + [i for i in items if _jobs(i)]


def pytest_collection_finish(session: pytest.Session) -> None:
    prebuild.start([name for item in session.items for name in _jobs(item)])


def pytest_sessionfinish(session: pytest.Session) -> None:
    prebuild.stop()
