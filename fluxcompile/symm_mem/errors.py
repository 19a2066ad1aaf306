"""A rank's error words of its kernels' bounded waits, read without synchronizing on the hot path.

A kernel whose wait for a peer times out writes its error words on the device (``err``; a kernel family's own
layout, read by its ``check(words, what)``, which raises naming the rank and the signal). At the end of an eager
call :meth:`ErrorWords.report` copies them to pinned host memory behind an event; the next call's
:meth:`ErrorWords.check_previous` raises once that copy has landed. ``config.check_signals`` synchronizes and
checks at the end of every call. Under CUDA graph capture neither acts (event queries are not allowed there): the
next eager call checks the replays. On CPU (Triton's interpreter) a report checks at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from ..config import config
from .persistent import capturing, persistent
from .workspace import current_stream

Check = Callable[[Tensor, str], None]


@dataclasses.dataclass
class ErrorWords:
    """The device words (``err``), their host copy (pinned on CUDA), the event after which the copy has landed and
    the call that made it."""

    err: Tensor  # int32 [words] on the device
    host: Tensor  # int32 [words]
    event: torch.cuda.Event | None = None
    reported: str = ""

    @classmethod
    def make(cls, device: torch.device | str, words: int, owner: str) -> ErrorWords:
        """Zeroed words on ``device``, made on ``symm_mem.persistent``'s worker (kept across calls, so never from
        a caller's CUDA graph pool); ``owner`` names the kernels in the errors."""
        device = torch.device(device)
        if capturing(device):
            raise RuntimeError(f"fluxcompile: run {owner} once eagerly before CUDA graph capture")

        def make() -> ErrorWords:
            host = torch.zeros(words, dtype=torch.int32)
            err = torch.zeros(words, dtype=torch.int32, device=device)
            return cls(err, host.pin_memory() if device.type == "cuda" else host)

        return persistent(make, f"the error words of {owner}")

    def check_previous(self, what: str, check: Check) -> None:
        """Raise, through ``check``, if an earlier call's wait timed out and its copy has landed (no
        synchronization)."""
        if self.err.device.type != "cuda" or capturing(self.err.device):
            return
        if self.event is not None and self.event.query() and int(self.host[0]):
            # The words were recorded by an earlier call (the one that copied them or one before it).
            check(self.host, f"{self.reported} or an earlier call (found at {what})")

    def report(self, what: str, check: Check) -> None:
        """At the end of an eager call: copy the words to the host, checked by the next call (now with
        ``config.check_signals``, which synchronizes, and on CPU)."""
        if self.err.device.type != "cuda":
            check(self.err, what)
            return
        if capturing(self.err.device):
            return
        self.host.copy_(self.err, non_blocking=True)
        self.reported = what
        if self.event is None:  # one event, recorded again by every call (creating one per call costs host time)
            self.event = torch.cuda.Event()
        self.event.record(current_stream())
        if config.check_signals:
            self.event.synchronize()
            check(self.host, what)

    def sequence_event(self) -> int:
        """The raw handle of the event that a C++ sequence records once it has itself copied the words to ``host``
        (the event made here on first use, on the current stream)."""
        if self.event is None:
            self.event = torch.cuda.Event()
            self.event.record(current_stream())
        return int(self.event.cuda_event)

    def issued(self, what: str, check: Check) -> None:
        """After a C++ sequence that copied the words to ``host`` and recorded :meth:`sequence_event` (an eager
        call): as :meth:`report` after its copy."""
        self.reported = what
        if config.check_signals and not capturing(self.err.device):
            self.event.synchronize()
            check(self.host, what)

    def clear(self) -> None:
        """Zero the words and their host copy (a test that broke a group on purpose, so later checks stay
        clean)."""
        self.err.zero_()
        self.host.zero_()
        self.reported = ""
