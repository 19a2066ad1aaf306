"""Communication orders for the fused kernels, read off programs of the library rather than written as
loops in each kernel: the order in which a rank's output blocks arrive when a program runs."""

from __future__ import annotations

import functools

from .program import OUTPUT, Program, Slot


def arrival_order(program: Program, rank: int) -> list[int]:
    """The output chunk indices of ``rank`` written from another rank, ordered by the number of transfers
    between ranks on their route (the step at which they can land: a route of k hops lands at step k; ties
    in program order)."""
    hops: dict[Slot, int] = {}
    landed: list[tuple[int, int, int]] = []
    for pos, op in enumerate(program.ops):
        n = hops.get(op.src, 0) + (op.src[1] != op.dst[1])
        if op.kind == "reduce":
            n = max(n, hops.get(op.dst, 0))
        hops[op.dst] = n
        if op.dst[0] == OUTPUT and op.dst[1] == rank and op.src[1] != rank:
            landed.append((n, pos, op.dst[2]))
    order: dict[int, None] = {}
    for _, _, index in sorted(landed):
        order.setdefault(index, None)
    return list(order)


@functools.cache
def ring_after(rank: int, world: int) -> tuple[int, ...]:
    """The peers in the order the Flux ring delivers their blocks to ``rank``: rank + 1 first, then rank + 2,
    ... (``library.ring_all_gather(world, reverse=True)``). The fused all-gather and reduce-scatter choices
    move their row blocks in this order, so what a peer waits for leaves first and no two ranks read from
    (or write into) the same peer at the same step."""
    from .library import ring_all_gather

    return tuple(arrival_order(ring_all_gather(world, reverse=True), rank)) if world > 1 else ()
