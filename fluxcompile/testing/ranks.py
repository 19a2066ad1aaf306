"""A pool of rank processes that runs one function on every rank, for tests and the demo.

Starting processes and a process group costs seconds, so the pool keeps them: ``pool.run(fn, *args)``
sends ``fn`` (a module-level function, found again by file and name in the workers) to every rank, and
returns the per-rank results or raises with every failing rank's traceback. A run that does not finish
in time kills the pool, so a hang becomes an error naming the ranks that did not answer.
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 600.0) -> None:
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, backend, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results in rank order."""
        if not self.alive():
            raise RuntimeError("RankPool: the rank processes are gone (an earlier run hung or crashed)")
        task = (fn.__module__, os.path.abspath(inspect.getfile(fn)), fn.__name__, args)
        for q in self._tasks:
            q.put(task)
        results: dict[int, tuple[bool, Any]] = {}
        limit = timeout_s or self.timeout_s
        try:
            while len(results) < self.world_size:
                rank, ok, value = self._results.get(timeout=limit)
                results[rank] = (ok, value)
        except queue.Empty:
            missing = sorted(set(range(self.world_size)) - set(results))
            self.close()
            raise TimeoutError(f"RankPool: ranks {missing} did not finish {fn.__name__} within {limit:.0f} s") from None
        errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(results.items()) if not ok]
        if errors:
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [results[r][1] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

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


def _worker(rank: int, world_size: int, port: int, backend: str, tasks: Any, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    # Two ranks on a two-core machine: one thread each, or they fight over the cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
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
    dist.destroy_process_group()
