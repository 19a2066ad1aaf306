"""The rewrite report: for every collective of every compiled graph, what fused and, if not, why.

Each run of the rewrite pass publishes one :class:`GraphReport`. Reports are kept in memory (see
:func:`reports` and :func:`collect`) and logged on the ``fluxcompile`` logger at INFO.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Iterator

log = logging.getLogger("fluxcompile")


@dataclasses.dataclass
class Entry:
    """One collective of a graph."""

    node: str  # the collective's node name in the post-grad graph
    collective: str  # e.g. "all_gather_into_tensor"
    group_name: str
    fused_op: str | None  # the fused op it became, None if left alone
    detail: str  # when fused: what went in; otherwise: the reason it was left alone

    @property
    def fused(self) -> bool:
        return self.fused_op is not None

    def line(self) -> str:
        name = self.node if self.node.startswith(self.collective) else f"{self.collective} {self.node}"
        head = f"{name} (group {self.group_name})"
        if self.fused:
            return f"  fused    {head} -> fluxcompile.{self.fused_op}: {self.detail}"
        return f"  kept     {head}: {self.detail}"


@dataclasses.dataclass
class GraphReport:
    graph_id: int
    kind: str  # "forward", "backward" or "inference"
    entries: list[Entry] = dataclasses.field(default_factory=list)

    def fused(self, op: str | None = None) -> list[Entry]:
        return [e for e in self.entries if e.fused and (op is None or e.fused_op == op)]

    def kept(self) -> list[Entry]:
        return [e for e in self.entries if not e.fused]

    def count(self, op: str) -> int:
        return len(self.fused(op))

    def summary(self) -> str:
        counts = Counter(e.fused_op for e in self.entries if e.fused)
        parts = ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "nothing fused"
        return f"graph {self.graph_id} ({self.kind}): {len(self.entries)} collectives; {parts}"

    def format(self) -> str:
        return "\n".join([self.summary(), *(e.line() for e in self.entries)])


@dataclasses.dataclass
class Report:
    """The reports of several graphs (e.g. one model's forward and backward)."""

    graphs: list[GraphReport]

    def count(self, op: str, kind: str | None = None) -> int:
        return sum(g.count(op) for g in self.graphs if kind is None or g.kind == kind)

    def of_kind(self, kind: str) -> list[GraphReport]:
        return [g for g in self.graphs if g.kind == kind]

    def entries(self) -> list[Entry]:
        return [e for g in self.graphs for e in g.entries]

    def format(self) -> str:
        if not self.graphs:
            return "fluxcompile: no graph was compiled (a cache hit, or no collective reached the backend)"
        return "\n".join(g.format() for g in self.graphs)

    __str__ = format


_lock = threading.Lock()
_ids = itertools.count()
_history: list[GraphReport] = []
_collectors: list[list[GraphReport]] = []
_MAX_HISTORY = 256


def new_graph_report(kind: str) -> GraphReport:
    return GraphReport(next(_ids), kind)


def publish(report: GraphReport, log_it: bool = True) -> None:
    with _lock:
        _history.append(report)
        del _history[:-_MAX_HISTORY]
        for sink in _collectors:
            sink.append(report)
    if log_it:
        log.info("rewrite report\n%s", report.format())


def reports() -> Report:
    """The most recent graph reports of this process (up to 256)."""
    with _lock:
        return Report(list(_history))


def clear() -> None:
    with _lock:
        _history.clear()


@contextlib.contextmanager
def collect() -> Iterator[Report]:
    """Gather the reports of the graphs compiled inside the ``with`` block."""
    sink: list[GraphReport] = []
    with _lock:
        _collectors.append(sink)
    try:
        yield Report(sink)
    finally:
        with _lock:
            _collectors.remove(sink)
