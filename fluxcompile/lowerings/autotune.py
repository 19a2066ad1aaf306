"""The rank-synchronized autotuner: one choice per fused-op call signature, the same on every rank.

``pick(op_name, args, group_name)`` returns the ``Choice`` to run. Every rank of the group must pick the
same one, since their communication has to match; so each step that could differ between ranks is agreed
on the group:

1. **Memo.** A per-process dict keyed by the call signature (``cache_key``). A hit costs no collective.
2. **Disk cache.** ``<config.cache_dir or ~/.cache/fluxcompile>/autotune/<op>-<hash>.json`` holds the
   winner and its timings. Ranks may see different disks, so every rank tells the others what it found
   (and which choices it supports, in the same message); the cached winner is used only if every rank
   has the same one and every rank supports it.
3. **Tuning.** The candidates are the choices every rank supports, a choice with launch variants standing for
   those its tuning table gives the call (``choices.Launches``: its entry, or a few to time). For each, in ``choices_for`` order,
   the ranks meet at a barrier, then run it ``WARMUP`` times; then, in ``ROUNDS`` interleaved rounds over
   the candidates, time it ``ITERS`` times in all (CUDA events on GPU, ``perf_counter`` on CPU), so clock
   drift during tuning hits every candidate alike (each round with the GPU queued ``QUEUE_US`` ahead, so
   the GPU's time is measured, not the host's launch latency). On GPU the host's time per call is measured
   too, and a rank's time is the larger of the two medians (``cost``): a call whose host work outlasts its
   GPU work paces the step at its host time, since every later launch waits behind it. The all-reduced MAX
   over ranks is the candidate's time (the slowest rank is what the step waits for). An exception makes that rank's time
   +inf, hence the candidate's. The winner is the smallest finite time, ties going to the earlier
   candidate; if nothing finished, ``"reference"``. Rank 0 writes the cache file (atomically) before
   any rank returns. Calls that run inside CUDA graphs in practice (``time_in_cuda_graphs``: decode) are
   timed as replays of a graph of ``GRAPH_CALLS`` captured calls instead of eager calls, each call reading
   the next of enough copies of the tensor arguments that none is in L2 (``cold_copies``): a decoding model
   streams every layer's weight from HBM, while one call repeated finds its weight in L2 and favours the
   choices whose loads keep it there.

With ``config.autotune`` off, nothing is timed and no cache is used: the first choice, in
``config.implementations`` order, that every rank supports wins.

Rules for callers and choices:
* ``pick`` is a collective on a memo miss: every rank must call it, in the same order, with arguments
  whose keys are equal across ranks, or the ranks' memo hits differ and one waits forever. Ops with
  per-rank sizes (all_to_all's splits) should pick once per compiled node and keep the ``Choice``.
* A choice's ``fn`` must raise before its first collective or not at all (check in ``supports``):
  a rank that drops out in the middle leaves the others waiting inside the collective. Exceptions are
  still caught, so a choice failing alike on all ranks is simply dropped.
* Never tune during CUDA graph capture (it synchronizes and times): warm up before capturing. Under
  capture a memo hit is returned as usual, a miss raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import config
from ..symm_mem.groups import process_group
from ..symm_mem.persistent import persistent
from ..symm_mem.topology import no_peer_access
from ..version import __version__
from . import compiled as _compiled
from . import decomposition
from .choices import REFERENCE, Choice, choices_for

log = logging.getLogger("fluxcompile.autotune")

# Runs per candidate: warm-up (compilation, allocator, NCCL communicators), then timed runs.
WARMUP = 3
ITERS = 12
ROUNDS = 3  # the timed runs are interleaved over the candidates in this many rounds

# Each timed round starts with the GPU queued this far ahead (a sleep kernel), so the host enqueues the
# round while the GPU is busy and the events time the GPU's work, as in a model step whose host runs ahead.
# From an idle GPU the first calls of a round wait for the host instead, and choices whose GPU times differ
# clearly are ranked by host noise, differently per run.
QUEUE_US = 3000.0
TIMING = "gpu-queued+host, graphs on cold copies"  # in the cache key: winners timed another way are tuned again

GRAPH_CALLS = 10  # calls per captured graph when a call signature is timed as CUDA graph replays
MAX_COLD_COPIES = 8  # extra copies of a graph-timed call's tensor arguments, at most

# op name -> predicate on the call's args: True when such calls run inside CUDA graphs in practice (decode
# under vLLM), so candidates are timed as graph replays. Timed eagerly, a decode-sized call measures the
# host's launch path instead of the GPU's work, and picks the choice with the fewest launches, not the
# fastest under graphs.
_graph_timed: dict[str, Any] = {}

_memo: dict[str, Choice] = {}
# Hot path: a cheap tuple of exactly what the call looks like -> its winner. It is finer than the JSON
# key (group name, exact strides, the config's change counter), so a miss here only falls back to ``_memo``: no
# new collective.
_fast: dict[tuple, Choice] = {}


def time_in_cuda_graphs(op_name: str, predicate: Any) -> None:
    """Time ``op_name``'s candidates as CUDA graph replays for calls where ``predicate(args)`` is true."""
    _graph_timed[op_name] = predicate


def clear_memo() -> None:
    """Forget the winners of this process (the disk cache stays)."""
    _memo.clear()
    _fast.clear()


_Tensor = torch.Tensor
_PLAIN = frozenset({int, float, bool, str, type(None)})


def _describe_fast(x: Any) -> Any:
    if isinstance(x, _Tensor):
        return (x.dtype, x.is_cuda, x.shape, x.stride())  # the cheapest exact description
    if isinstance(x, (list, tuple)):
        return tuple(map(_describe_fast, x))
    return x


def _fast_key(op_name: str, args: tuple, group_name: str, key_extra: str) -> tuple:
    # Runs on every call of a fused op (its host time is the op's overhead): one flat pass over the args,
    # which nest one level deep (lists of tensors), with exact-type tests first (cheaper than isinstance
    # chains); anything else (tensor subclasses, deeper nesting) takes _describe_fast.
    parts: list[Any] = [op_name, group_name, key_extra, config.version]
    append = parts.append
    for x in args:
        t = type(x)
        if t in _PLAIN:
            append(x)
        elif t is _Tensor:
            append((x.dtype, x.is_cuda, x.shape, x.stride()))
        elif t is list or t is tuple:
            append(
                tuple(
                    [(y.dtype, y.is_cuda, y.shape, y.stride()) if type(y) is _Tensor else _describe_fast(y) for y in x]
                )
            )
        else:
            append(_describe_fast(x))
    return tuple(parts)


def cache_dir() -> Path:
    return Path(config.cache_dir or "~/.cache/fluxcompile").expanduser() / "autotune"


def cache_path(op_name: str, key: str) -> Path:
    return cache_dir() / f"{op_name}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def cache_key(
    op_name: str, args: tuple, group_name: str, key_extra: str = "", kwargs: dict[str, Any] | None = None
) -> str:
    """The call signature that a winner is valid for, as a JSON string (the memo key, hashed for the file)."""
    candidates = [c for choice in choices_for(op_name) for c in choice.candidates(*args)]
    return _key(op_name, args, group_name, _with_kwargs(key_extra, kwargs), candidates)


def pick(
    op_name: str,
    args: tuple,
    group_name: str,
    key_extra: str = "",
    compiled: str = "",
    key_args: tuple | None = None,
    kwargs: dict[str, Any] | None = None,
    decomposed: bool = False,
) -> Choice:
    """The choice to run ``op_name(*args)`` with, identical on every rank of ``group_name``.

    ``compiled`` is the op's compiled choice (lowerings/compiled.py): when given, it decides, with no tuning and
    no collective. Otherwise a collective on a memo miss (see the module docstring for what that asks of
    callers). ``key_args`` (default ``args``) is what the call signature is made of: an op whose arguments differ
    between ranks or calls (an all-to-all's split sizes and row counts) passes what is equal on every rank and
    stable across its calls, so every rank hits or misses the memo alike and a new routing is no new tuning.
    ``kwargs``: the keyword arguments the caller passes to the choice's ``fn`` beside ``args`` (an op's flags,
    e.g. all_gather_matmul's ``return_A``); the candidates are timed with them, and they are part of the call
    signature (empty or None: the key of a call without them). ``decomposed``: the site's original ops are the
    alternative (the compile-time choice, fx_passes/decide.py): the reference candidate is timed as Inductor's
    generated code issues them (lowerings/decomposition.py), and the choice is memoized and cached apart.
    """
    key_args = args if key_args is None else key_args
    if decomposed:
        key_extra = f"{key_extra}|decomposed"
    fast = _fast_key(op_name, key_args, group_name, f"{key_extra}|{compiled}" if compiled else key_extra)
    if kwargs:
        fast += tuple(kwargs.items())
    hit = _fast.get(fast)
    if hit is not None:
        return hit
    if compiled:
        choice = _compiled.resolve(op_name, compiled, args)
        _fast[fast] = choice
        return choice
    candidates = [c for choice in choices_for(op_name) for c in choice.candidates(*args)]
    if not candidates:
        raise RuntimeError(f"fluxcompile: no implementation of {op_name!r} is registered and allowed")
    if decomposed and op_name in decomposition.FUNCTIONS:
        fn = decomposition.FUNCTIONS[op_name]
        candidates = [dataclasses.replace(c, fn=fn) if c.name == REFERENCE else c for c in candidates]
    key = _key(op_name, key_args, group_name, _with_kwargs(key_extra, kwargs), candidates)
    memo_key = key if config.autotune else key + "|fixed"
    choice = _memo.get(memo_key)
    if choice is not None:
        _fast[fast] = choice
        return choice
    if _capturing():
        raise RuntimeError(
            f"fluxcompile: {op_name} needs autotuning during CUDA graph capture, which cannot time or "
            "synchronize; run the model once (warm-up) before capturing, with the same shapes"
        )
    group = process_group(group_name)
    device = _collective_device(group, args)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        # On persistent's worker: whatever tuning leaves behind (the choices' state and workspaces, the tensors
        # NCCL keeps of its collectives) stays out of the caller's CUDA graph pool (reduce-overhead's warm-up).
        choice = persistent(
            lambda: _select(op_name, args, candidates, key, group, device, kwargs or {}), f"tuning {op_name}"
        )
    _memo[memo_key] = choice
    _fast[fast] = choice
    return choice


# ---------------------------------------------------------------------------------------------
# Selection.


def _select(
    op_name: str,
    args: tuple,
    candidates: list[Choice],
    key: str,
    group: dist.ProcessGroup,
    device: torch.device,
    kwargs: dict[str, Any],
) -> Choice:
    names = [c.name for c in candidates]
    path = cache_path(op_name, key)
    cached = _read_cache(path, key) if config.autotune else None
    # Symmetric-memory choices decline alike on every rank where the group's ranks are not all reachable by P2P.
    no_peers = no_peer_access(group) if any(c.symmetric_memory for c in candidates) else None
    reasons = [c.peers_decline(no_peers) or c.declines(*args) for c in candidates]
    # One message per rank: its registry (must match), its cached winner, its reasons to decline.
    infos: list[Any] = [None] * group.size()
    dist.all_gather_object(infos, (names, cached, reasons), group=group)
    for rank, (other_names, _, _) in enumerate(infos):
        if other_names != names:
            raise RuntimeError(
                f"fluxcompile: {op_name} choices differ between ranks: {names} here, {other_names} on rank {rank}"
            )
    # A choice declined by any rank is out everywhere (the AND of the ranks' support masks).
    declined: dict[str, str] = {}
    for rank, (_, _, their_reasons) in enumerate(infos):
        for name, reason in zip(names, their_reasons):
            if reason is not None and name not in declined:
                declined[name] = f"{reason} (rank {rank})"
    supported = [c for c in candidates if c.name not in declined]
    by_name = {c.name: c for c in candidates}
    fallback = by_name.get(REFERENCE)

    if not config.autotune:
        choice = supported[0] if supported else fallback
        if choice is None:
            raise RuntimeError(f"fluxcompile: no choice of {op_name} supports these arguments: {declined}")
        log.info("%s: %s (autotuning off; declined: %s)", op_name, choice.name, declined or "none")
        return choice

    agreed = {info[1] for info in infos}
    if len(agreed) == 1 and cached in by_name and cached not in declined:
        log.debug("%s: %s (cache %s)", op_name, cached, path)
        return by_name[cached]

    graphs = _run_device(args).type == "cuda" and bool(_graph_timed.get(op_name, lambda a: False)(args))
    timed = [_with_call_kwargs(c, kwargs) for c in supported] if kwargs else supported
    local = _benchmark(timed, args, group, device, graphs)
    worst = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(worst, dist.ReduceOp.MAX, group=group)
    times = worst.tolist()
    finite = [i for i, t in enumerate(times) if math.isfinite(t)]
    if finite:
        winner = supported[min(finite, key=lambda i: (times[i], i))]
    elif fallback is not None:
        winner = fallback
    else:
        raise RuntimeError(f"fluxcompile: every choice of {op_name} failed and it has no {REFERENCE!r} choice")
    _log_table(op_name, winner, supported, local, times, declined, cached, agreed)
    if group.rank() == 0:
        _write_cache(path, key, winner.name, {c.name: t for c, t in zip(supported, times)})
    # Ranks sharing rank 0's disk that look the key up again (a new process) must find the file.
    _barrier(group, device)
    return winner


def _with_call_kwargs(choice: Choice, kwargs: dict[str, Any]) -> Choice:
    """``choice`` whose ``fn`` is called with ``kwargs`` (a timed candidate, as the caller will call it)."""
    return dataclasses.replace(choice, fn=functools.partial(choice.fn, **kwargs))


def _benchmark(
    candidates: list[Choice], args: tuple, group: dist.ProcessGroup, device: torch.device, graphs: bool = False
) -> list[float]:
    """This rank's median time (ms) of each candidate, +inf where it raised; all ranks run in lockstep.
    With ``graphs``, each candidate's ``GRAPH_CALLS`` calls, on the argument sets of ``_cold_arg_sets`` in
    turn, are captured once (after a warm-up on every set) and a timed run is one replay, divided by the
    calls; a candidate that cannot be captured is dropped.

    The timed runs are spread over ``ROUNDS`` interleaved rounds (each round times every candidate in
    turn), so a GPU's clock drifting during tuning (power, heat under long GEMMs) hits all candidates alike
    instead of favouring whichever ran while the chip was cool."""
    run_device = _run_device(args)
    sets = _cold_arg_sets(args, run_device) if graphs else [args]
    samples: list[list[float] | None] = []
    host: list[list[float]] = [[] for _ in candidates]
    for choice in candidates:  # warm-up: compilation, workspaces, communicators
        _barrier(group, device)
        _synchronize(run_device)
        warm = _run(choice, args, run_device, max(WARMUP, len(sets)), None, in_turn(choice.fn, sets))
        samples.append([] if warm else None)
    runners: list[Any] = [None] * len(candidates)  # None: _run calls the choice itself
    if graphs:
        for i, choice in enumerate(candidates):
            _barrier(group, device)
            runners[i] = _captured(choice, sets, run_device) if samples[i] is not None else None
            if runners[i] is None:
                samples[i] = None
    rounds = max(1, min(ROUNDS, ITERS))
    for r in range(rounds):
        iters = ITERS // rounds + (r < ITERS % rounds)
        for i, choice in enumerate(candidates):
            _barrier(group, device)  # every rank, every candidate: a failed one still meets the others
            _synchronize(run_device)
            got = samples[i]
            if got is not None and not _run(choice, args, run_device, iters, got, runners[i], host[i]):
                samples[i] = None
    per_call = GRAPH_CALLS if graphs else 1
    return [cost(x, h) / per_call if x else math.inf for x, h in zip(samples, host)]


def cost(device_ms: list[float], host_ms: list[float]) -> float:
    """A candidate's time on one rank from its timed calls: the median device time, or the median host time
    per call where that is larger (the host then paces the step). ``host_ms`` may be empty (not measured)."""
    t = statistics.median(device_ms)
    return max(t, statistics.median(host_ms)) if host_ms else t


def cold_copies(nbytes: int, l2_bytes: int) -> int:
    """How many extra copies of ``nbytes`` of arguments keep every read of a call out of an ``l2_bytes`` L2
    when the calls read the original and the copies in turn: enough to fill twice the L2 (at most
    ``MAX_COLD_COPIES``), none where the arguments alone do."""
    if nbytes <= 0 or nbytes >= 2 * l2_bytes:
        return 0
    return min(MAX_COLD_COPIES, -(-2 * l2_bytes // nbytes))


def copy_args(args: tuple) -> tuple:
    """``args`` with every tensor (also inside lists and tuples) copied into new memory of the same strides."""

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    return copy(args)


def _cold_arg_sets(args: tuple, run_device: torch.device) -> list[tuple]:
    """``args`` and its ``cold_copies`` (none on CPU, or where the GPU has no memory left for them)."""
    if run_device.type != "cuda":
        return [args]
    nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in _tensors(args)}.values())
    extra = cold_copies(nbytes, torch.cuda.get_device_properties(run_device).L2_cache_size)
    try:
        return [args] + [copy_args(args) for _ in range(extra)]
    except torch.OutOfMemoryError:
        log.warning("no GPU memory for %d copies of %d bytes of arguments: timing them warm in L2", extra, nbytes)
        return [args]


def in_turn(fn: Callable[..., Any], sets: list[tuple]) -> Callable[[], Any]:
    """A call of ``fn`` on the next argument set each time (also the decode bench's methods on weight copies)."""
    it = itertools.cycle(sets)
    return lambda: fn(*next(it))


def _captured(choice: Choice, sets: list[tuple], run_device: torch.device) -> Any:
    """``GRAPH_CALLS`` calls of ``choice``, on ``sets`` in turn, captured in one CUDA graph (its replay), or
    None if capture failed."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(run_device), torch.cuda.graph(graph):
            for i in range(GRAPH_CALLS):
                choice.fn(*sets[i % len(sets)])
        graph.replay()  # the first replay uploads the graph; keep it out of the timings
        torch.cuda.synchronize(run_device)
        return graph.replay
    except Exception as e:
        log.warning("choice %s cannot be captured in a CUDA graph: %s: %s", choice.name, type(e).__name__, e)
        return None


def _run(
    choice: Choice,
    args: tuple,
    run_device: torch.device,
    iters: int,
    samples: list[float] | None,
    fn: Any = None,
    host: list[float] | None = None,
) -> bool:
    """Run ``choice`` (or ``fn``: its captured graph's replay, or its calls on argument sets in turn) ``iters``
    times, appending each time (ms) to ``samples`` unless None, and on GPU each call's host time (ms) to ``host``
    unless None; False if it raised."""
    fn = fn or functools.partial(choice.fn, *args)
    try:
        if samples is None:
            for _ in range(iters):
                fn()
            _synchronize(run_device)
        elif run_device.type == "cuda":
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
            ]
            queue_gpu(QUEUE_US, run_device)
            clock = time.perf_counter
            for start, end in events:
                t0 = clock()
                start.record()
                fn()
                end.record()
                if host is not None:
                    host.append((clock() - t0) * 1e3)
            torch.cuda.synchronize(run_device)
            samples += [start.elapsed_time(end) for start, end in events]
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return True
    except Exception as e:
        log.warning("choice %s failed on this rank: %s: %s", choice.name, type(e).__name__, e)
        return False


def queue_gpu(us: float, device: torch.device | None = None) -> None:
    """Keep the GPU busy for about ``us`` µs (a sleep kernel on the current stream), so that what the host
    enqueues next is timed on the GPU alone (also benchmarks/ops.py's ``--queued-us``)."""
    if us > 0:
        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        khz = getattr(props, "clock_rate", 0) or 1_980_000
        torch.cuda._sleep(int(us * khz / 1000))


def _barrier(group: dist.ProcessGroup, device: torch.device) -> None:
    # A tiny all_reduce on the device the group talks through; .item() makes the host wait for it.
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag, group=group)
    flag.item()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _log_table(op_name, winner, candidates, local, times, declined, cached, agreed) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    why = (
        "no cache"
        if agreed == {None}
        else f"caches disagree ({sorted(map(str, agreed))})"
        if len(agreed) > 1
        else f"cached {cached} not usable"
    )
    lines = [f"{op_name}: tuned {len(candidates)} choice(s) ({why}), winner {winner.name}"]
    lines.append(f"  {'choice':<40} {'this rank ms':>12} {'max ms':>10}")
    for c, mine, worst in zip(candidates, local, times):
        lines.append(f"  {c.name:<40} {_ms(mine):>12} {_ms(worst):>10}")
    lines.extend(f"  {name:<40} declined: {reason}" for name, reason in declined.items())
    log.info("\n".join(lines))


def _ms(t: float) -> str:
    return f"{t:.4f}" if math.isfinite(t) else "failed"


# ---------------------------------------------------------------------------------------------
# The key.


def _with_kwargs(key_extra: str, kwargs: dict[str, Any] | None) -> str:
    """``key_extra`` with the call's keyword arguments (by name), unchanged where there are none."""
    if not kwargs:
        return key_extra
    return "|".join([key_extra, *(f"{name}={value!r}" for name, value in sorted(kwargs.items()))])


def _key(op_name: str, args: tuple, group_name: str, key_extra: str, candidates: list[Choice]) -> str:
    group = process_group(group_name)
    run_device = _run_device(args)
    key = {
        "op": op_name,
        "args": _describe(args, group_name),
        "extra": key_extra,
        "world_size": group.size(),
        "device": torch.cuda.get_device_name(run_device) if run_device.type == "cuda" else "cpu",
        "topology": _topology(group, run_device),
        # A new or removed choice, or settings under which choices decline or compute otherwise, mean tuning
        # again.
        "choices": [c.name for c in candidates],
        "config": json.loads(config.tuning_fingerprint()),
        "fluxcompile": __version__,
        "torch": torch.__version__,
        "timing": TIMING,
    }
    return json.dumps(key, sort_keys=True)


def _describe(x: Any, group_name: str) -> Any:
    """A JSON-able description of an argument: tensors by dtype, shape and layout, not by value."""
    if isinstance(x, torch.Tensor):
        if x.is_contiguous():
            layout = "contiguous"
        elif x.dim() >= 2 and x.transpose(-1, -2).is_contiguous():
            layout = "transposed"
        else:
            layout = f"strides{list(x.stride())}"
        return f"tensor({str(x.dtype).removeprefix('torch.')}, {list(x.shape)}, {layout}, {x.device.type})"
    if isinstance(x, (list, tuple)):
        return [_describe(v, group_name) for v in x]
    if isinstance(x, str) and x == group_name:
        return "<group>"  # group names are per-process labels; world size and topology describe the group
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def _topology(group: dist.ProcessGroup, run_device: torch.device) -> str:
    backend = dist.get_backend(group)
    if run_device.type != "cuda":
        return f"{backend} x{group.size()}"
    return f"{backend} x{group.size()}, {torch.cuda.device_count()} local GPUs, p2p {_local_p2p()}"


@functools.lru_cache(maxsize=1)
def _local_p2p() -> str:
    """Whether this host's GPUs reach each other directly: "all", "none" or "partial" (a proxy for the group's)."""
    n = torch.cuda.device_count()
    pairs = [torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j]
    if not pairs:
        return "n/a"
    return "all" if all(pairs) else "none" if not any(pairs) else "partial"


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _run_device(args: tuple) -> torch.device:
    """Where the op runs: the first CUDA tensor argument's device, else the CPU."""
    return next((t.device for t in _tensors(args) if t.device.type == "cuda"), torch.device("cpu"))


def _collective_device(group: dist.ProcessGroup, args: tuple) -> torch.device:
    """Where the small agreement collectives can run: CPU when the group has a CPU backend (gloo, also
    in "cpu:gloo,cuda:nccl"), else the args' GPU or the current one (NCCL needs CUDA tensors)."""
    backend = dist.get_backend(group)
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    run_device = _run_device(args)
    return run_device if run_device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------------
# The disk cache.


def _read_cache(path: Path, key: str) -> str | None:
    """The cached winner's name, or None when there is no file or it is unreadable or for another key."""
    try:
        data = json.loads(path.read_text())
        if json.dumps(data["key"], sort_keys=True) == key and isinstance(data["winner"], str):
            return data["winner"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable autotune cache %s: %s", path, e)
    return None


def _write_cache(path: Path, key: str, winner: str, times: dict[str, float]) -> None:
    data = {
        "key": json.loads(key),
        "winner": winner,
        "max_ms": {name: t if math.isfinite(t) else None for name, t in times.items()},  # None: failed
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write a temporary file and rename it, so a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        # A read-only or full disk costs a retune next time, never the run.
        log.warning("could not write autotune cache %s: %s", path, e)
