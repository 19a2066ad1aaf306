"""GPU tests: one process per GPU, started by torch.distributed.run (scripts/gpu-check does it)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        skip = pytest.mark.skip(reason="GPU tests run under torch.distributed.run on a GPU machine (scripts/gpu-check)")
        for item in items:  # this hook sees the whole session's items: mark only the GPU tests
            if os.path.dirname(str(item.path)) == here:
                item.add_marker(skip)
    elif int(os.environ.get("WORLD_SIZE", "1")) < 2:
        # One GPU: the tests of what only happens between ranks (the overlapped choices decline a 1-rank
        # group, nothing fuses, no peer can be missing) skip instead of failing on that.
        skip = pytest.mark.skip(reason="needs 2+ ranks (one GPU here)")
        for item in items:
            if os.path.dirname(str(item.path)) == here and item.get_closest_marker("peers"):
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def nccl_group():
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        yield None
        return
    local_rank = int(os.environ["LOCAL_RANK"])
    if os.environ.get("FLUXCOMPILE_TEST_SHARED_GPU") == "1":
        # Several processes on one GPU (scripts/gpu-check's nvshmem-pes step, under MPS): NCCL refuses a GPU twice
        # in a communicator, so the group is gloo's (the tests that run so need no NCCL collective).
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        yield dist.group.WORLD
        dist.destroy_process_group()
        return
    torch.cuda.set_device(local_rank)
    # A failed assertion on one rank must not leave the other waiting forever in a collective.
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=120))
    yield dist.group.WORLD
    dist.destroy_process_group()


def pytest_runtest_logreport(report):
    """A failure is printed at once, with its rank: pytest's own summary comes at the end of the session, which
    a rank whose peers hang (or a step time limit) may never reach."""
    if report.failed and "LOCAL_RANK" in os.environ:
        text = report.longreprtext[-4000:]
        sys.stderr.write(f"\n[rank {os.environ.get('RANK', '?')}] FAILED {report.nodeid} ({report.when}):\n{text}\n")
        sys.stderr.flush()
