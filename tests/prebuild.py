"""Compiler runs the suite starts right after collection and checks at the end: the slow compile-only checks of
csrc (nvcc, g++) run one after another on a background thread, on the second core, while the Python tests run;
their tests, moved to the end of the session (conftest.py), then only read the results.

A test module registers a job (``register(name, make)``: ``make(workdir)`` returns the command, or a reason to
skip) and marks its test ``@pytest.mark.prebuild(name)``; the test calls ``finished(name)``, which runs the job
itself when nothing started it (a test run alone), skips where there is nothing to run, and fails where the job
could not run."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest


@dataclasses.dataclass
class Result:
    """A finished job: its process's result, and the directory it ran in (its outputs)."""

    out: subprocess.CompletedProcess
    workdir: Path


@dataclasses.dataclass
class _Job:
    make: Callable[[Path], Sequence[str] | str]
    timeout_s: float
    state: str = "new"  # new, queued, running, done
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Result | str | None = None  # str: why the test skips (nothing to run on this machine)
    error: str = ""  # why the job could not run (the test fails)


_jobs: dict[str, _Job] = {}
_lock = threading.Lock()
_queue: list[str] = []
_worker: threading.Thread | None = None
_procs: list[subprocess.Popen] = []
_dirs: list[Path] = []
_stopping = threading.Event()


def register(name: str, make: Callable[[Path], Sequence[str] | str], timeout_s: float = 900) -> None:
    """A job ``name``: ``make(workdir)`` writes what it needs there and returns the command, or a reason to skip."""
    _jobs.setdefault(name, _Job(make, timeout_s))


def _run(name: str) -> None:
    job = _jobs[name]
    try:
        workdir = Path(tempfile.mkdtemp(prefix=f"prebuild-{name}-"))
        _dirs.append(workdir)
        cmd = job.make(workdir)
        if isinstance(cmd, str):
            job.result = cmd
            return
        with _lock:
            if _stopping.is_set():
                job.result = "the session ended first"
                return
            proc = subprocess.Popen(list(cmd), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _procs.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=job.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\nprebuild: {name} ran past {job.timeout_s} s"
        job.result = Result(subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr), workdir)
    except Exception as e:  # the test fails with it
        job.error = f"prebuild: {name} could not run: {type(e).__name__}: {e}"
    finally:
        job.state = "done"
        job.done.set()


def _drain() -> None:
    while True:
        with _lock:
            if _stopping.is_set() or not _queue:
                return
            name = _queue.pop(0)
            _jobs[name].state = "running"
        _run(name)


def start(names: Sequence[str]) -> None:
    """Queue the named jobs (once each) on the background thread, in this order."""
    global _worker
    with _lock:
        for name in names:
            job = _jobs.get(name)
            if job is not None and job.state == "new":
                job.state = "queued"
                _queue.append(name)
        if _queue and (_worker is None or not _worker.is_alive()):
            _worker = threading.Thread(target=_drain, name="prebuild", daemon=True)
            _worker.start()


def finished(name: str) -> Result:
    """The job's result: waits while the background thread runs it, runs it here when nothing has taken it yet (a
    test run alone, or one reached before its turn); skips the test where there is nothing to run here, fails it
    where the job could not run."""
    job = _jobs[name]
    with _lock:
        mine = job.state in ("new", "queued")
        if job.state == "queued":
            _queue.remove(name)
        if mine:
            job.state = "running"
    if mine:
        _run(name)
    job.done.wait()
    if job.error:
        pytest.fail(job.error)
    if isinstance(job.result, str):
        pytest.skip(job.result)
    assert job.result is not None
    return job.result


def stop() -> None:
    """End the session's jobs: running compilers are killed, their directories removed."""
    _stopping.set()
    with _lock:
        _queue.clear()
        for proc in _procs:
            if proc.poll() is None:
                proc.kill()
    for d in _dirs:
        shutil.rmtree(d, ignore_errors=True)
