"""A bound on the flag waits that the GPU's front end runs (``cuStreamWaitValue32``, signals.py).

Such a wait has no timeout: a peer that never signals (it crashed, or it does not call the same fused ops in
the same order) leaves this rank's stream blocked in the driver for good, with no error. The watchdog bounds
it from the host, as NCCL's watchdog does for collectives:

* after each eager call, a choice that waits on flags records an event on its stream (``Watch.note``);
* a daemon thread looks every tenth of the timeout (5 s at most) at each watch whose last call is older than it
  and whose event has not completed: the stream has been stuck in or before that call for that long;
* it then reads the watch's flags (a copy on a stream of its own, which the blocked stream does not block)
  and reports, naming this rank, the op and every signal that is not in its expected state (which peer,
  which flag), and ends the process: a stream blocked in the driver cannot be cancelled.

Calls captured in CUDA graphs are not watched (a replay does not come back to the host). The thread's own CUDA
calls (event queries) run in the relaxed stream-capture mode: in the default global mode, a query made while
another thread captures a graph (``torch.cuda.graph``, vLLM's decode graphs) would invalidate that capture.
``config.watchdog_timeout_s`` (``FLUXCOMPILE_WATCHDOG_TIMEOUT_S``, default 600 like NCCL's) sets the bound, read
when a watch is made and at each look; 0 turns the watchdog off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import config

log = logging.getLogger("fluxcompile.watchdog")

_CAPTURE_MODE_RELAXED = 2  # CUstreamCaptureMode


def relax_capture_mode() -> bool:
    """Put this thread's CUDA calls in the relaxed stream-capture mode (``cuThreadExchangeStreamCaptureMode``,
    through the driver library torch has loaded), so that they never invalidate another thread's capture; False
    where the driver cannot be reached."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
        return cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    except (OSError, AttributeError):
        return False


def _abort(message: str) -> None:
    log.critical(message)
    os._exit(134)  # like an abort: the blocked stream would otherwise keep the process alive


class Watch:
    """One watched call site (a fused-op choice and its plan). ``describe()`` returns the report of its flags
    (it runs in the watchdog's thread, only on a timeout)."""

    def __init__(self, what: str, rank: int, describe: Callable[[], str], event_factory: Callable[[], Any]):
        self.what = what
        self.rank = rank
        self.describe = describe
        self._event_factory = event_factory
        self.event: Any = None
        self.last = 0.0  # monotonic time of the last noted call; 0: none pending

    def note(self, stream: Any = None) -> None:
        """After an eager call: mark its end on ``stream`` (default: the current stream)."""
        if self.event is None:
            self.event = self._event_factory()
        self.event.record(stream)
        self.last = time.monotonic()

    def sequence_event(self) -> int:
        """The raw handle of the event that a C++ sequence records at the end of each eager call (made here on
        first use); :meth:`noted` then marks the call."""
        if self.event is None:
            self.event = self._event_factory()
            self.event.record()
        return int(self.event.cuda_event)

    def noted(self) -> None:
        """After an eager call whose end a C++ sequence recorded on :meth:`sequence_event`."""
        self.last = time.monotonic()

    def stuck_for(self, now: float) -> float:
        """Seconds the last noted call has been pending (0 if it completed or none was noted)."""
        if not self.last or self.event is None or self.event.query():
            return 0.0
        return now - self.last


class Watchdog:
    """The thread that looks at the watches. ``timeout_s``/``poll_s`` None: from ``config.watchdog_timeout_s``."""

    def __init__(
        self,
        timeout_s: float | None = None,
        poll_s: float | None = None,
        on_timeout: Callable[[str], None] = _abort,
        clock=time.monotonic,
    ):
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self.on_timeout = on_timeout
        self.clock = clock
        self.watches: list[Watch] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def timeout_s(self) -> float:
        return config.watchdog_timeout_s if self._timeout_s is None else self._timeout_s

    @property
    def poll_s(self) -> float:
        return min(5.0, max(0.05, self.timeout_s / 10)) if self._poll_s is None else self._poll_s

    def add(self, watch: Watch) -> Watch:
        with self._lock:
            self.watches.append(watch)
        if self._thread is None and self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="fluxcompile-watchdog", daemon=True)
            self._thread.start()
        return watch

    def check(self) -> str | None:
        """One look at every watch: the report of the first one stuck past the timeout, else None."""
        now = self.clock()
        with self._lock:
            watches = list(self.watches)
        for w in watches:
            waited = w.stuck_for(now)
            if waited > self.timeout_s:
                try:
                    flags = w.describe()
                except Exception as e:  # the report must not hide the timeout
                    flags = f"(flags unreadable: {type(e).__name__}: {e})"
                return (
                    f"fluxcompile: rank {w.rank}: {w.what} has not finished after {waited:.0f} s "
                    f"(FLUXCOMPILE_WATCHDOG_TIMEOUT_S={self.timeout_s:g}); its stream waits on a peer's signal. "
                    f"{flags}. A peer has died or does not call the same fused ops in the same order."
                )
        return None

    def _run(self) -> None:
        if not relax_capture_mode():
            log.info("fluxcompile watchdog: the CUDA driver cannot set its capture mode; it may break captures")
        while True:
            time.sleep(self.poll_s if self.timeout_s > 0 else 1.0)
            if self.timeout_s <= 0:
                continue  # switched off since the thread started
            try:
                report = self.check()
            except Exception as e:  # a broken check must not take the process down; say it once and stop
                log.warning("fluxcompile watchdog stopped: %s: %s", type(e).__name__, e)
                return
            if report is not None:
                self.on_timeout(report)
                return


_dog = Watchdog()


def watch(what: str, rank: int, describe: Callable[[], str]) -> Watch | None:
    """A new watch (None when the watchdog is off). Call ``note()`` on it after each eager call."""
    if _dog.timeout_s <= 0:
        return None
    import torch

    return _dog.add(Watch(what, rank, describe, torch.cuda.Event))


def flag_report(ready: Any, done: Any, peers: list[int]) -> str:
    """The ready/done handshake flags (signals.ready_done_flags) this rank waits on, read from a stream of the
    watchdog's own, as a sentence naming each peer's signal."""
    import torch

    stream = torch.cuda.Stream(device=ready.ws.buffer.device)
    with torch.cuda.stream(stream):
        r = ready.local().to("cpu").tolist()
        d = done.local().to("cpu").tolist()
    stream.synchronize()
    parts = [
        f"from rank {p}: ready={r[p]} ({'its data has landed' if r[p] else 'its data has not landed'}), "
        f"done={d[p]} ({'it has freed our slot in its buffer' if d[p] else 'it still holds our slot'})"
        for p in peers
    ]
    return "Signals " + "; ".join(parts)


def read_flags(flags: Any) -> list[int]:
    """This rank's flags of a ``FlagArray``, read on a stream of their own (a watch's report; synchronizes)."""
    import torch

    stream = torch.cuda.Stream(device=flags.ws.buffer.device)
    with torch.cuda.stream(stream):
        values = flags.local().to("cpu")
    stream.synchronize()
    return [int(v) for v in values]
