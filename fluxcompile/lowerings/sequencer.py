"""The C++ host sequencer of the cuBLAS-pipelined choices (csrc/pipelined.cpp), where it can be built.

The pipelined choices issue ten to thirty stream operations per call (GEMMs, copies, events, flag memory
operations). From Python each costs ~18 µs of host time on the 2xH200 machine, which made a call cost
more host time than a 2048-token layer's GPU work (benchmarks/host_cost.py). The C++ module issues the same
operations, in the same order, from precomputed slot views and flag addresses. Where it cannot be built
(no nvcc, a failed build) the choices run their Python sequence instead: the GPU sees the same work, so
ranks may even differ in which one they use.

``FLUXCOMPILE_PIPELINED_CPP=0`` forces the Python sequences. The C++ sequences also replay calls seen
before as CUDA graphs (``config.sequence_graphs``, csrc/pipelined.cpp's "Replays").
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import ModuleType

import torch

from ..config import config
from ..schedules.orders import ring_after
from ..symm_mem import ready_done_flags, stream_consume, stream_write
from ..symm_mem.watchdog import Watch, flag_report, watch
from ..symm_mem.workspace import current_stream
from . import extensions

log = logging.getLogger("fluxcompile.sequencer")

ENABLED = os.environ.get("FLUXCOMPILE_PIPELINED_CPP", "1") != "0"
_state: dict[str, ModuleType | None] = {}


def sequencer() -> ModuleType | None:
    """The built ``pipelined`` module, or None (Python sequences) if it is disabled or cannot be built."""
    if "mod" in _state:
        return _state["mod"]
    mod = None
    if ENABLED:
        try:
            mod = extensions.load("pipelined")
        except extensions.Unavailable as e:
            log.warning("fluxcompile: the C++ sequencer is unavailable, using the Python sequences: %s", e)
    _state["mod"] = mod
    return mod


def graph_limit() -> int:
    """How many call signatures the C++ sequences may capture as CUDA graphs and replay (config.sequence_graphs;
    0: every call issues its stream operations)."""
    return config.sequence_graphs


def replay_stats() -> dict[str, int]:
    """The C++ sequences' replay counters since the last :func:`clear_replays` (empty without the module)."""
    mod = sequencer()
    if mod is None:
        return {}
    return dict(zip(("replays", "captures", "direct", "failed", "graphs"), mod.replay_stats()))


def clear_replays() -> None:
    """Drop every captured sequence and reset the counters."""
    mod = sequencer()
    if mod is not None:
        mod.clear_replays()


def slice_rows(rows: int, d: int) -> int:
    """Rows of the separate slice of the ``:lead<d>`` (all-gather) and ``:tail<d>`` (reduce-scatter) choices:
    1/d of a rank's rows, rounded down to a multiple of 64 (0: none, the choice declines)."""
    return rows // d // 64 * 64


@dataclasses.dataclass
class Handshake:
    """The ready/done flags (symm_mem/signals.py) of a pipelined call, as addresses per peer, ``j`` running over
    the peers in ring order (their meaning: csrc/pipelined.cpp), and the watchdog's bound on their waits."""

    order: list[int]
    done_mine: list[int]  # done flag of peer order[j] here: may we write into our slot in its buffer?
    ready_theirs: list[int]  # ready flag `rank` in order[j]'s flags: our data has landed there
    ready_mine: list[int]  # ready flag order[j] here: its data has landed here
    done_theirs: list[int]  # done flag `rank` in order[j]'s flags: its slot in our buffer is free again
    watch: Watch | None

    @property
    def lists(self) -> tuple[list[int], ...]:
        """(order, done_mine, ready_theirs, ready_mine, done_theirs): the C++ functions' argument order."""
        return self.order, self.done_mine, self.ready_theirs, self.ready_mine, self.done_theirs

    def send(self, stream: torch.cuda.Stream, j: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """On ``stream`` (the current stream): once peer ``order[j]`` has freed our slot in its buffer (its done
        flag), ``src`` into that slot ``dst`` (peer to peer: the copy engine), then its ready flag. The Python
        twin of csrc/pipelined.cpp's send_block."""
        stream_consume(stream, self.done_mine[j])
        dst.copy_(src)
        stream_write(stream, self.ready_theirs[j], 1)

    def note(self) -> None:
        """After an eager call (graph captures are not watched: their replays do not come back here)."""
        if self.watch is not None and not torch.cuda.is_current_stream_capturing():
            self.watch.note(current_stream())


def handshake(group_name: str, tag: str, rank: int, world: int, what: str) -> Handshake:
    """The flags of ``tag`` (made and zeroed on the first call of every rank), in Flux's ring order after
    ``rank`` (from the schedule library)."""
    ready, done = ready_done_flags(group_name, tag, world)
    order = ring_after(rank, world)
    return Handshake(
        order=order,
        done_mine=[done.addr(rank, p) for p in order],
        ready_theirs=[ready.addr(p, rank) for p in order],
        ready_mine=[ready.addr(rank, p) for p in order],
        done_theirs=[done.addr(p, rank) for p in order],
        watch=watch(what, rank, lambda: flag_report(ready, done, order)),
    )
