"""Simulated ranks' stepped protocols (generators that yield after each launch) run in lockstep: one launch of
every rank in turn, until every rank's protocol has returned. Triton's interpreter runs one kernel at a time, and no
launch of these protocols waits for a peer's launch of the same or a later position, so lockstep is an order the GPU
may take."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any


def lockstep(gens: dict[int, Generator[str, None, Any]], world: int) -> list[Any]:
    """Every generator's value by rank (None for a rank without one)."""
    outs: dict[int, Any] = {}
    while len(outs) < len(gens):
        for r, gen in gens.items():
            if r in outs:
                continue
            try:
                next(gen)
            except StopIteration as done:
                outs[r] = done.value
    return [outs.get(r) for r in range(world)]
