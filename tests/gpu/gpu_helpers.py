"""Helpers for the GPU tests."""

from __future__ import annotations

import torch
import torch.distributed as dist


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill free cached memory with NaN, so outputs a kernel forgets to write show up as NaN."""
    t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    t.fill_(float("nan"))
    del t


def require_sequencer() -> None:
    """The cuBLAS-pipelined choices run only through the C++ sequencer (csrc's pipelined module): fail with the
    reason where it did not build, rather than let the choices decline and their tests pass by skipping."""
    from fluxcompile.kernels import sequencer

    why = sequencer.unavailable()
    assert why is None, why


def assert_on_every_rank(error: str | None, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any rank has an ``error`` (its message and rank included), else nothing: a
    check that fails on some ranks only must not send the others on into the next collective alone."""
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise AssertionError("\n".join(failed))


def shared_seed() -> int:
    """A fresh random seed, the same on every rank (rank 0's): each run draws new inputs."""
    s = torch.randint(0, 2**30, (1,), device="cuda")
    dist.broadcast(s, 0)
    return int(s)
