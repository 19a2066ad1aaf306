"""Host-side rounds of a group's ranks through the default store: every rank publishes a string, then reads every
rank's. The compile-time choice's meeting (fx_passes/decide.py) and the group layout (topology.py) use it before any
collective of the group has run, so it needs nothing but the store the process group was made with."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist

_rounds: dict[tuple[str, str], int] = {}  # (tag, group name) -> rounds this process has taken part in


def gather_strings(
    group: dist.ProcessGroup, tag: str, value: str, timeout_s: float, what: Callable[[int], str], hint: str
) -> tuple[int, list[str]]:
    """This rank's ``n``-th round of ``tag`` in ``group`` (``n`` counts from 1) and every rank's value, in group rank
    order. Every rank of the group must take part in the same rounds in the same order. Waiting longer than
    ``timeout_s`` raises one line: ``what(n)`` waited ... for the group's other ranks (...): ``hint``."""
    name, rank = group.group_name, group.rank()
    n = _rounds[(tag, name)] = _rounds.get((tag, name), 0) + 1
    store = dist.distributed_c10d._get_default_store()
    keys = [f"fluxcompile/{tag}/{name}/{n}/{r}" for r in range(group.size())]
    store.set(keys[rank], value)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise RuntimeError(
            f"fluxcompile: rank {rank}: {what(n)} waited {timeout_s:g} s for the group's other ranks "
            f"({type(e).__name__}): {hint}"
        ) from None
    return n, [store.get(k).decode() for k in keys]
