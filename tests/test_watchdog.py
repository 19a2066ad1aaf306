"""The bound on flag waits (fluxcompile/symm_mem/watchdog.py), with fake events and a fake clock: a call
pending past the timeout is reported once, naming the rank, the op and the signals; completed, recent or
never-noted calls are not."""

from __future__ import annotations

import threading

from fluxcompile.symm_mem import watchdog


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.records = 0

    def record(self, stream=None) -> None:  # torch.cuda.Event.record's signature
        self.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _dog(clock: Clock, reports: list[str]) -> watchdog.Watchdog:
    dog = watchdog.Watchdog(timeout_s=60, poll_s=0.01, on_timeout=reports.append, clock=clock)
    dog._thread = threading.current_thread()  # no background thread: the test calls check() itself
    return dog


def _watch(dog, clock, what="matmul_reduce_scatter (cublas_pipelined)", rank=1, describe=lambda: "Signals ready=0"):
    w = dog.add(watchdog.Watch(what, rank, describe, FakeEvent))
    w_note = w.note

    def note() -> None:  # the watch's own clock is monotonic(); pin it to the fake one
        w_note()
        w.last = clock()

    w.note = note
    return w


def test_pending_past_timeout_is_reported_with_rank_op_and_signals():
    clock, reports = Clock(), []
    dog = _dog(clock, reports)
    w = _watch(dog, clock)
    w.note()
    clock.t += 59
    assert dog.check() is None  # not yet
    clock.t += 2
    report = dog.check()
    assert report is not None
    assert "rank 1" in report and "matmul_reduce_scatter (cublas_pipelined)" in report and "Signals ready=0" in report
    assert "61 s" in report and "FLUXCOMPILE_WATCHDOG_TIMEOUT_S=60" in report


def test_completed_or_unnoted_calls_are_not_reported():
    clock, reports = Clock(), []
    dog = _dog(clock, reports)
    never = _watch(dog, clock, what="never called")
    done = _watch(dog, clock, what="finished")
    done.note()
    done.event.done = True
    clock.t += 3600
    assert never.stuck_for(clock()) == 0.0
    assert dog.check() is None


def test_a_new_call_restarts_the_clock():
    clock, reports = Clock(), []
    dog = _dog(clock, reports)
    w = _watch(dog, clock)
    w.note()
    clock.t += 50
    w.note()  # the host is still calling: the GPU may be behind, not stuck
    clock.t += 50
    assert dog.check() is None
    assert w.event.records == 2


def test_a_failing_flag_read_still_reports_the_timeout():
    clock, reports = Clock(), []
    dog = _dog(clock, reports)

    def broken() -> str:
        raise RuntimeError("device lost")

    w = _watch(dog, clock, describe=broken)
    w.note()
    clock.t += 120
    report = dog.check()
    assert report is not None and "flags unreadable: RuntimeError: device lost" in report


def test_background_thread_calls_on_timeout_once():
    clock, reports = Clock(), []
    got = threading.Event()

    def on_timeout(msg: str) -> None:
        reports.append(msg)
        got.set()

    dog = watchdog.Watchdog(timeout_s=60, poll_s=0.01, on_timeout=on_timeout, clock=clock)
    w = _watch(dog, clock)
    w.note()
    clock.t += 61
    assert got.wait(5), "the watchdog thread did not report"
    dog._thread.join(5)
    assert len(reports) == 1 and not dog._thread.is_alive()


def test_off_when_timeout_is_zero(monkeypatch):
    monkeypatch.setattr(watchdog, "_dog", watchdog.Watchdog(0, 1))
    assert watchdog.watch("x", 0, lambda: "") is None
