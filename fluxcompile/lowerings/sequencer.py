"""The C++ host sequencer of the cuBLAS-pipelined choices (csrc/pipelined.cpp), where it can be built.

The pipelined choices issue ten to thirty stream operations per call (GEMMs, copies, events, flag memory
operations). From Python each costs ~18 µs of host time on the 2xH200 machine, which made a call cost
more host time than a 2048-token layer's GPU work (benchmarks/host_cost.py). The C++ module issues the same
operations, in the same order, from precomputed slot views and flag addresses. Where it cannot be built
(no nvcc, a failed build) the choices run their Python sequence instead: the GPU sees the same work, so
ranks may even differ in which one they use.

``FLUXCOMPILE_PIPELINED_CPP=0`` forces the Python sequences.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

from .. import csrc_build

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
            mod = csrc_build.load("pipelined")
        except csrc_build.Unavailable as e:
            log.warning("fluxcompile: the C++ sequencer is unavailable, using the Python sequences: %s", e)
    _state["mod"] = mod
    return mod
