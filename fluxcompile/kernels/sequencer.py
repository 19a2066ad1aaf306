"""The C++ host sequencer of the cuBLAS-pipelined choices (csrc's pipelined module, csrc/sequences.h).

A pipelined call issues ten to thirty stream operations (GEMMs, copies, events, flag memory operations).
Issued from Python each costs as much host time as a small GEMM's GPU time, so the sequences live in C++ alone,
fed with precomputed slot views and flag addresses (each choice's "plan"). Where the module cannot be built
(no GPU, no nvcc, a failed build) the choices built on it decline with the reason. The sequences also replay
calls seen before as CUDA graphs (``config.sequence_graphs``, csrc/replays.h).
"""

from __future__ import annotations

from types import ModuleType

from ..config import config
from . import extensions


def sequencer() -> ModuleType:
    """The built ``pipelined`` module (built on first use); raises :class:`extensions.Unavailable`."""
    return extensions.load("pipelined")


def unavailable() -> str | None:
    """Why the sequencer cannot run here, or None."""
    try:
        sequencer()
    except extensions.Unavailable as e:
        return f"the C++ sequencer (csrc's pipelined module) is unavailable: {e}"
    return None


def graph_limit() -> int:
    """How many call signatures the sequences may capture as CUDA graphs and replay (0: none)."""
    return config.sequence_graphs


def replay_stats() -> dict[str, int]:
    """The replay counters since the last :func:`clear_replays`."""
    return dict(zip(("replays", "captures", "direct", "failed", "graphs"), sequencer().replay_stats()))


def capture_failure() -> str | None:
    """Why the last capture that failed since :func:`clear_replays` failed (``replay_stats()["failed"]`` counts
    them), or None. The sequencer's warning gives the first failure's reason only."""
    return sequencer().capture_failure() or None


def clear_replays() -> None:
    """Drop every captured sequence, reset the counters and forget the last capture failure."""
    sequencer().clear_replays()
