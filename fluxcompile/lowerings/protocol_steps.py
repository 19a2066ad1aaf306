"""What the DLRM protocols share around their launches (lowerings/embedding_bag_all_to_all/triton.py and
lowerings/all_to_all_embedding_bag_backward/triton.py): each is a generator that yields after every launch, so the
CPU tests step every simulated rank's launches in lockstep under Triton's interpreter; :func:`run` drives one to
its value. :func:`protocol_state` keeps a protocol's device state per flag workspace; :func:`max_spin` is the bound
of their kernels' waits."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..config import config
from ..symm_mem import Comm, capturing, persistent

T = TypeVar("T")


def max_spin() -> int:
    """The bound on the kernels' waits, ``config.wait_timeout_s``, in microseconds of the GPU timer (polls under
    Triton's interpreter)."""
    return max(1, int(float(config.wait_timeout_s) * 1e6))


def run(steps: Generator[str, None, T]) -> T:
    """Every launch of a stepped protocol, then its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def protocol_state(comm: Comm, states: dict[int, tuple[Any, ...]], sizes: Sequence[int], what: str) -> tuple[Tensor, ...]:
    """A protocol's int64 device tensors of ``sizes``, zeroed once per flag workspace of ``comm`` and kept in
    ``states`` (the protocol's own dict) with the workspace's buffer, so its address is never reused for another one
    while they live: state whose counters and epochs must match the workspace's flags (both start at zero and only
    grow). Made eagerly only: ``what`` names the protocol in the error under CUDA graph capture."""
    buf = comm.flags.buffer
    entry = states.get(buf.data_ptr())
    if entry is None or entry[0] is not buf:
        if capturing(buf.device):
            raise RuntimeError(f"fluxcompile: run {what} once eagerly before CUDA graph capture")
        entry = states[buf.data_ptr()] = persistent(
            lambda: (buf, *(torch.zeros(n, dtype=torch.int64, device=buf.device) for n in sizes)),
            f"the state of {what}",
        )
    return entry[1:]
