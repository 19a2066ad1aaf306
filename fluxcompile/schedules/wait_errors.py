"""The error words of the schedule interpreter kernel (plan_exec.py), the bound of its dependency waits, and
the host-side reading of the words. No Triton here: the executor reads the words without compiling anything.

Two slots of ``SLOT_WORDS`` int32 words, each in kernels/waits.py's layout (set flag, waiting rank, peer, index,
awaited epoch, wait kind):

* slot 0 (``err[0:8]``): the first wait on a *peer* that timed out, for a message or for the peer's ack of the
  previous call. Once it is set every wait of the launch gives up at once.
* slot 1 (``err[8:16]``, from ``DEP_SLOT``): the first *threadblock dependency* that timed out. A dependency
  waits on a program of this rank, which is often itself waiting on a peer: its timeout is then a symptom, so
  it is kept apart and does not stop the peer waits, which go on to their own bound and record the cause.
  Once it is set the other dependency waits give up at once.

When both slots hold an error the peer's is raised: it names the root cause.

A dependency's bound is ``DEP_SPIN_FACTOR`` peer bounds (:func:`dependency_spin`), so where a peer is missing
its wait normally expires first and the dependencies give up without recording anything:

* a dependency polls GPU-scope flags in this GPU's memory, a peer wait system-scope ones, which can take
  longer per poll: with bounds equal in polls the dependency can expire first;
* the program it depends on may, when healthy, wait up to a peer bound (a peer far behind) before it sets the
  flag;
* a chain through several programs needs no more: with a peer missing, the first peer wait that cannot pass
  starts once its program's earlier waits passed, near the launch's start, and its timeout stops every
  dependency of the chain; a peer that is only late delays the chain by its lateness once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SLOT_WORDS = 8
DEP_SLOT = SLOT_WORDS  # first word of the dependency slot
ERR_WORDS = 2 * SLOT_WORDS
MESSAGE, ACK, DEPENDENCY = 11, 12, 13  # wait kinds
WAIT_KINDS = {MESSAGE: "message", ACK: "ack of the previous call", DEPENDENCY: "threadblock dependency"}
DEP_SPIN_FACTOR = 8
_INT32_MAX = 2**31 - 1


def dependency_spin(max_spin: int) -> int:
    """The bound, in polls, of a threadblock dependency's wait for peer waits bounded by ``max_spin`` polls."""
    return min(max(max_spin, 1) * DEP_SPIN_FACTOR, _INT32_MAX)


def _words(err: torch.Tensor | Sequence[int]) -> list[int]:
    values = err.tolist() if hasattr(err, "tolist") else list(err)
    return [int(x) for x in values[:ERR_WORDS]]


def error_message(err: torch.Tensor | Sequence[int], group_name: str) -> str | None:
    """The error the words record (the peer wait's when both slots hold one), or None."""
    w = _words(err)
    peer_slot, dep_slot = w[:SLOT_WORDS], w[DEP_SLOT : DEP_SLOT + SLOT_WORDS]
    if peer_slot[0]:
        also = f"; a threadblock dependency (done flag {dep_slot[3]}) timed out as well" if dep_slot[0] else ""
        return _peer_message(peer_slot, group_name, also)
    if dep_slot[0]:
        return _dependency_message(dep_slot, group_name)
    return None


def check_error(err: torch.Tensor | Sequence[int], group_name: str) -> None:
    """Raise RuntimeError if the error words (read on the host) record a timeout."""
    msg = error_message(err, group_name)
    if msg:
        raise RuntimeError(msg)


def _peer_message(slot: list[int], group_name: str, also: str) -> str:
    _, rank, peer, index, epoch, kind = slot[:6]
    what = WAIT_KINDS.get(kind, f"wait kind {kind}")
    signal = f"message {index}" if kind == MESSAGE else "call ack"
    return (
        f"fluxcompile.schedules: rank {rank} of group {group_name} timed out waiting for rank {peer}'s {what} "
        f"(signal {signal} never reached epoch {epoch}){also}: is every rank running the same collectives in the "
        "same order?"
    )


def _dependency_message(slot: list[int], group_name: str) -> str:
    _, rank, _, index, epoch, kind = slot[:6]
    what = WAIT_KINDS.get(kind, f"wait kind {kind}")
    return (
        f"fluxcompile.schedules: rank {rank} of group {group_name} timed out in a {what} (done flag {index}, "
        f"call epoch {epoch}) and no wait on a peer timed out: either not every program of the launch became "
        "resident, or the program it depends on waited on a peer for longer than the dependency's bound "
        f"({DEP_SPIN_FACTOR} peer-wait bounds: a peer far behind)"
    )
