"""Communication orders read off programs: the order in which a rank's output blocks arrive when a program runs
(tests check the fused kernels' orders, symm_mem/exchange.py, against the library's programs)."""

from __future__ import annotations

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
