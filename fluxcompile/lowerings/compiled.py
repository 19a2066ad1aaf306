"""The choice a fused op's node carries from compile time: its format, and how a call resolves it.

The compile-time choice (``fx_passes/decide.py``) writes each rewritten site's decision into the op's
``choice`` argument, so the compiled code holds it (Inductor's FX graph cache replays it with the graph) and
the op's CUDA implementation runs it without tuning, without a collective, and also under CUDA graph capture.
A spec is a table of choice names by the call's *row count* (``rows``: the M of the op's matmuls on this
rank), ``"<name>"`` for every row count, or ``"<name>;<rows>:<name>;..."``: each name applies from its row
count (the first from 0) up to the next one's. ``""`` means no compile-time decision: the runtime autotuner
picks per call signature.

The row count is the same on every rank for the ops with tables (all-gather, reduce-scatter, all-reduce), so
every rank resolves a table to the same name. A name that this process does not offer, or whose ``supports``
declines the call (a row count inside a range that the range's representative did not exercise, e.g. a
kernel's tile multiple), resolves to the reference: a decision made from the shapes alone, alike on every rank.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from torch import Tensor

from .choices import REFERENCE, SCALABLE_OPS, Choice, choice_named, choices_for, scaled

log = logging.getLogger("fluxcompile.compiled")


def _rows_of_a(args: tuple) -> int:
    A: Tensor = args[0]
    return A.numel() // A.shape[-1] if A.dim() > 1 else 1


def _rows_of_product(args: tuple) -> int:
    return args[0][0].shape[0]


def _rows_of_tail(args: tuple) -> int:
    x = args[0]
    return _rows_of_a(args) if x is not None else args[1][0].shape[0]


# op name -> the call's row count, from the arguments its choices take. Ops whose row counts differ between
# ranks (the all-to-all ops) have no entry: their specs hold one name.
ROWS: dict[str, Callable[[tuple], int]] = {
    "all_gather_matmul": _rows_of_a,
    "matmul_reduce_scatter": _rows_of_product,
    "matmul_all_reduce": _rows_of_product,
    "all_reduce_rmsnorm": _rows_of_tail,
}
ROWS.update({scaled(op): ROWS[op] for op in SCALABLE_OPS})


def encode(table: Sequence[tuple[int, str]]) -> str:
    """The spec of ``[(from_rows, name), ...]`` (ascending, the first from 0), merging equal neighbours."""
    merged: list[tuple[int, str]] = []
    for lo, name in table:
        if not merged or merged[-1][1] != name:
            merged.append((lo, name))
    if not merged or merged[0][0] != 0:
        raise ValueError(f"fluxcompile: a choice table must start at 0 rows: {list(table)}")
    return ";".join([merged[0][1], *(f"{lo}:{name}" for lo, name in merged[1:])])


@functools.lru_cache(maxsize=256)
def decode(spec: str) -> tuple[tuple[int, str], ...]:
    """``[(from_rows, name), ...]`` of a spec; a malformed one is an error naming it."""
    first, *rest = spec.split(";")
    table = [(0, first)]
    for part in rest:
        lo, sep, name = part.partition(":")
        if not sep or not lo.isdigit() or not name or int(lo) <= table[-1][0]:
            raise ValueError(f"fluxcompile: malformed compiled choice {spec!r}")
        table.append((int(lo), name))
    return tuple(table)


def name_for(op_name: str, spec: str, args: tuple) -> str:
    """The choice name ``spec`` gives this call."""
    table = decode(spec)
    if len(table) == 1:
        return table[0][1]
    rows_of = ROWS.get(op_name)
    if rows_of is None:
        raise ValueError(f"fluxcompile: {op_name} takes one compiled choice, not a table by rows: {spec!r}")
    rows = rows_of(args)
    name = table[0][1]
    for lo, n in table[1:]:
        if rows < lo:
            break
        name = n
    return name


def resolve(op_name: str, spec: str, args: tuple) -> Choice:
    """The choice a call of ``op_name`` runs under ``spec`` (the reference where the named one is not offered
    here or declines the call)."""
    name = name_for(op_name, spec, args)
    offered = choices_for(op_name)
    choice = choice_named(op_name, name, offered)
    reason = "not offered in this process" if choice is None else choice.declines(*args)
    if reason is None:
        return choice
    log.warning("fluxcompile: %s: the compiled choice %s runs the reference instead: %s", op_name, name, reason)
    return next(c for c in offered if c.name == REFERENCE)
