"""A pool of rank processes that runs one function on every rank, for tests and the demo.

Starting processes and a process group costs seconds, so the pool keeps them: ``pool.run(fn, *args)``
sends ``fn`` (a module-level function, found again by file and name in the workers) to every rank, and
returns the per-rank results or raises with every failing rank's traceback. A waiting call checks that its
ranks are alive several times a second: a rank process that ends (at start-up or during a run) ends the call
at once with :class:`RankDied`, naming the rank and its error (or its exit code when it sent none). A run
that does not finish in time kills the pool, so a hang becomes an error naming the ranks that did not answer.

The ranks meet through a ``TCPStore`` that the pool's own process serves: it listens on a port the system picks
(port 0) and stays bound while the pool lives, so no other process can take the port between its choice and the
ranks' rendezvous.
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

POLL_S = 0.2  # how often a waiting call checks that every rank process is still alive
_FATAL = "fatal"  # status of a message a rank sends just before it exits on an error


class RankDied(RuntimeError):
    """A rank process ended: ``summary`` is one line naming the rank and its error, ``details`` its traceback."""

    def __init__(self, rank: int, summary: str, details: str = "") -> None:
        super().__init__(f"{summary}\n{details}".rstrip())
        self.rank = rank
        self.summary = summary
        self.details = details


def free_port() -> int:
    """A port free now (another process may take it before the caller binds it: prefer binding port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``, or the type alone when the message is empty."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 600.0) -> None:
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._closed = False
        ctx = mp.get_context("spawn")
        self._store = _serve_store(world_size)
        self._port: int = self._store.port
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, self._port, backend, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results in rank order.

        Raises :class:`RankDied` as soon as a rank process ends and ``TimeoutError`` when the ranks do not all
        answer within the timeout (both kill the pool), ``AssertionError`` with the traceback of every rank
        where ``fn`` raised (the pool stays usable).
        """
        if self._closed:
            raise RuntimeError("RankPool: the rank processes are gone (an earlier run hung or crashed)")
        self._raise_if_dead(fn.__name__)
        task = (fn.__module__, os.path.abspath(inspect.getfile(fn)), fn.__name__, args)
        for q in self._tasks:
            q.put(task)
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        results: dict[int, tuple[bool, Any]] = {}
        while len(results) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._raise_if_dead(fn.__name__)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(results))
                    self._kill()
                    raise TimeoutError(
                        f"RankPool: ranks {missing} did not finish {fn.__name__} within {limit:.0f} s"
                    ) from None
                continue
            if status == _FATAL:
                self._kill()
                raise RankDied(rank, *value)
            results[rank] = (status, value)
        errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(results.items()) if not ok]
        if errors:
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [results[r][1] for r in range(self.world_size)]

    @property
    def port(self) -> int:
        """The port of the ranks' rendezvous store, which this process serves while the pool lives."""
        return self._port

    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        """Stop the ranks: each leaves its process group and exits; one that does not within 10 s is killed."""
        if self._closed:
            return
        self._closed = True
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._store = None

    def _raise_if_dead(self, name: str) -> None:
        """Raise RankDied if a rank process has ended: with the error it sent, else with its exit code."""
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
        if not dead:
            return
        error = self._fatal_message() or RankDied(dead[0][0], f"rank {dead[0][0]} {_exit_text(dead[0][1])} ({name})")
        self._kill()
        raise error

    def _fatal_message(self) -> RankDied | None:
        """The first error a rank sent before exiting, from what is left on the results queue."""
        while True:
            try:
                rank, status, value = self._results.get(timeout=POLL_S)
            except queue.Empty:
                return None
            if status == _FATAL:
                return RankDied(rank, *value)

    def _kill(self) -> None:
        """End every rank process now: after a death or a hang the others may wait on it forever."""
        self._closed = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._store = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load(module: str, path: str, cache: dict[str, Any]) -> Any:
    """The function's module, imported under its own name so what it returns unpickles in the parent."""
    if path not in cache:
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.append(folder)  # a test module imported by pytest from its folder
        if module != "__main__":
            try:
                cache[path] = importlib.import_module(module)
                return cache[path]
            except ImportError:
                pass
        name = "_rankpool_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cache[path] = module
    return cache[path]


_HOST = "127.0.0.1"
_STORE_TIMEOUT = timedelta(seconds=120)


def _serve_store(world_size: int) -> Any:
    """The ranks' rendezvous store, served by this process on a port the system picks."""
    import torch.distributed as dist

    return dist.TCPStore(_HOST, 0, world_size, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False)


def _start(rank: int, world_size: int, port: int, backend: str) -> None:
    """Join the process group through the pool's store (a client of it), not through the environment."""
    import torch
    import torch.distributed as dist

    # Two ranks on a two-core machine: one thread each, or they fight over the cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=_STORE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_STORE_TIMEOUT)


def _serve(rank: int, tasks: Any, results: Any) -> None:
    """Run tasks until the pool sends None; a task's exception goes back as its traceback."""
    import torch

    modules: dict[str, Any] = {}
    while True:
        task = tasks.get()
        if task is None:
            break
        module, path, name, args = task
        try:
            torch._dynamo.reset()
            value = getattr(_load(module, path, modules), name)(*args)
            results.put((rank, True, value))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))


def _worker(rank: int, world_size: int, port: int, backend: str, tasks: Any, results: Any) -> None:
    stage = "at start-up"
    try:
        _start(rank, world_size, port, backend)
        stage = "waiting for a task"
        _serve(rank, tasks, results)
        stage = "leaving its process group"
        import torch.distributed as dist

        dist.destroy_process_group()
    except BaseException as e:
        # The queue's feeder thread flushes this before the process exits, so the parent reads it.
        results.put((rank, _FATAL, (f"rank {rank} died {stage}: {one_line(e)}", traceback.format_exc())))
        sys.exit(1)
