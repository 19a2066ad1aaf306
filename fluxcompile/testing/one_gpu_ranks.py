"""Several ranks of a group simulated on one GPU: each rank's calls run on its own main and side streams, with a
share of the SMs, over symmetric workspaces that are slices of one allocation. The protocols of the CUTLASS, MoE
and DLRM choices run unchanged against it: their communication context (``symm_mem.Comm``) takes the workspaces,
the side stream, the SM count and the flag initialization explicitly.

    ranks = OneGpuRanks(world, data_bytes, flag_bytes, tag="ag")
    outs = ranks.run(lambda r, comm: all_gather_matmul_on(comm, A[r], ...))       # eager: every rank at once
    graph, outs = ranks.capture(lambda r, comm: ...)                               # one CUDA graph of all ranks
    graph.replay(); ranks.wait()

What it checks: the protocol's logic (flags, slots, chunk order, resets, graph replays) with real concurrency
between the ranks' kernels and copies. What it does not: NVLink's ordering (every "peer" shares one L2) and
times between GPUs (each rank has a share of one GPU; "peer" copies are same-device copies).

Symmetric memory stand-in: a workspace is one allocation of ``world`` equal buffers; rank r's
``symm_mem.Workspace`` has ``buffer`` = its slice and a ``handle`` (``symm_mem.LocalHandle``) whose ``buffer_ptrs``
and ``get_buffer(rank, shape, dtype, offset_elems)`` address every rank's slice, so ``Workspace.view``,
``FlagArray`` and ``exchange.send`` work unchanged. Flags are set on every rank at once by :meth:`init_flags`
(the one-process form of ``symm_mem.init_flags``).

SMs: each rank's persistent GEMM gets ``((SMs - RESERVED_SMS) // world) // 2 * 2`` SMs (even: 2-CTA clusters),
so every rank's CTAs are resident together and a few SMs stay free: a same-device copy (every "peer" push here)
may run as a kernel, and a GEMM waiting for a chunk must never hold the SM its copy needs.

The stream-K GEMMs' scratch is per stream in kernels/cutlass_gemm.py, so the ranks' concurrent GEMMs never
share it.

Launch order: every simulated rank shares one CUDA context, and loading a kernel's module (Triton's first launch
of a specialization, a lazily loaded library kernel) waits until the device's queued work has drained while it
holds the context's lock. A rank whose thread loads a module after a peer has queued a kernel that waits for this
rank's next launch stalls until that wait times out (between GPUs each process has its own context and nothing
stalls). ``launches`` names the protocol's launch functions (``(module, name)`` pairs, listed per protocol in
testing/launches.py, patched while a call runs): they pass a :class:`Turnstile`, so a rank's k-th launch (its
compilation and module load included) comes after every rank's (k-1)-th and after the k-th of the ranks before it. A protocol whose launch needs no peer's
launch of the same or a later position (tests/kernel_checks/moe_protocol_interpreted.py checks the MoE
protocols so) then only ever queues waits that the queued work satisfies, and every load's drain ends.

Importing this module needs no GPU (the allocations go to ``device``; streams are made on first use).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..symm_mem import Comm, ErrorWords, FlagArray, LocalHandle, Workspace

RESERVED_SMS = 24
_ALIGN = 1 << 16  # bytes between ranks' buffers in one allocation


_made_streams: list[Any] = []  # the harness's own streams, kept for the process's life (graphs may hold them)


def _new_stream(priority: int) -> torch.cuda.Stream:
    """A new non-blocking CUDA stream of its own (cudaStreamCreateWithPriority through the CUDA runtime that torch
    loaded), not one of torch's pooled streams: the driver assigns hardware queues round-robin as streams are
    made, and torch's pools were made all at once, 32 of each priority over the same queues. Falls back to a
    pooled stream where the runtime is not found."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return torch.cuda.Stream(priority=priority)
    handle = ctypes.c_void_p()
    if rt.cudaStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(1), ctypes.c_int(priority)) != 0:
        return torch.cuda.Stream(priority=priority)
    stream = torch.cuda.ExternalStream(handle.value)
    _made_streams.append(stream)
    return stream


def _on_threads(call: Callable[[int], Any], world: int, timeout_s: float) -> list[Any]:
    """``[call(r) for r in range(world)]``, each on a thread of its own, as separate processes make their calls
    between GPUs. A rank's host call may block in the driver until the device's queued work has drained (loading a
    kernel's module, pinning host memory): threads alone do not end such a block while a queued kernel waits for
    the blocked rank; the launch order of :class:`Turnstile` does."""
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def run(r: int) -> None:
        try:
            results[r] = call(r)
        except BaseException as e:  # re-raised on the caller's thread
            errors[r] = e

    # Each thread runs in a copy of the caller's context (context variables such as Triton's allocator).
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(run, r), name=f"one-gpu-rank{r}")
        for r in range(world)
    ]
    for t in threads:
        t.start()
    for r, t in enumerate(threads):
        t.join(timeout_s)
        if t.is_alive():
            raise TimeoutError(f"OneGpuRanks: rank {r}'s host call did not return within {timeout_s:g} s")
    for e in errors:
        if e is not None:
            raise e
    return results


def _in_turns(
    call: Callable[[int], Any], world: int, launches: Sequence[tuple[Any, str]], timeout_s: float
) -> list[Any]:
    """:func:`_on_threads` with ``launches`` passing a :class:`Turnstile` (turns bounded by ``timeout_s``)."""
    turns = Turnstile(world, timeout_s)

    def rank_call(r: int) -> Any:
        with turns.rank(r):
            return call(r)

    with turns.patch(launches):
        return _on_threads(rank_call, world, timeout_s)


class Turnstile:
    """The ranks' launches one at a time, in round-robin order of their positions: a rank's k-th launch (k from 0)
    starts once every rank before it has finished its k-th and every rank after it its (k-1)-th, or has returned
    (:meth:`rank` marks a rank's thread and, on leaving, its return). A launch from a thread that is no rank's, or
    from inside a launch, runs at once. A turn that does not come within ``timeout_s`` raises TimeoutError."""

    def __init__(self, world: int, timeout_s: float):
        self.world = world
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._finished = [0] * world  # launches each rank has finished
        self._returned = [False] * world
        self._local = threading.local()

    def _turn(self, r: int, k: int) -> bool:
        return all(
            self._returned[p] or self._finished[p] >= (k + 1 if p < r else k) for p in range(self.world) if p != r
        )

    @contextlib.contextmanager
    def rank(self, r: int) -> Iterator[None]:
        """The current thread makes rank ``r``'s call while this is entered."""
        self._local.rank, self._local.inside = r, False
        try:
            yield
        finally:
            self._local.rank = None
            with self._cond:
                self._returned[r] = True
                self._cond.notify_all()

    def wrap(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        """``launch``, passing the turnstile."""

        @functools.wraps(launch)
        def turn(*args, **kwargs):
            r = getattr(self._local, "rank", None)
            if r is None or self._local.inside:
                return launch(*args, **kwargs)
            with self._cond:
                k = self._finished[r]
                if not self._cond.wait_for(lambda: self._turn(r, k), timeout=self.timeout_s):
                    raise TimeoutError(
                        f"OneGpuRanks: rank {r}'s launch {k} ({getattr(launch, '__name__', launch)}) waited "
                        f"{self.timeout_s:g} s for its turn: launched so far {self._finished}, returned {self._returned}"
                    )
            self._local.inside = True
            try:
                return launch(*args, **kwargs)
            finally:
                self._local.inside = False
                with self._cond:
                    self._finished[r] += 1
                    self._cond.notify_all()

        return turn

    @contextlib.contextmanager
    def patch(self, launches: Sequence[tuple[Any, str]]) -> Iterator[None]:
        """Every ``getattr(owner, name)`` of ``launches`` wrapped while this is entered."""
        saved = [(owner, name, getattr(owner, name)) for owner, name in launches]
        try:
            for owner, name, fn in saved:
                setattr(owner, name, self.wrap(fn))
            yield
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


_delay_loaded: set[int] = set()


def load_delay_kernel(device: torch.device) -> None:
    """Load the module of ``torch.cuda._sleep``'s kernel (the delay of :meth:`OneGpuRanks.run`) once per device,
    from an eager call. CUDA loads a kernel's module at its first launch (lazy loading, the default) and the load
    waits for the device to drain: a delayed rank's first sleep, launched on its thread outside the turnstile while a
    peer's GEMM may already wait for this rank's pushes, would stall until that wait times out (a wait error of the
    peer). The first all-gather case of every run on an H100 failed with such an error at rank 0 while rank 1 is the
    delayed one (issue 69; the fix awaits its H100 run). Between GPUs each rank's process has its own context and
    nothing stalls. Under capture nothing is loaded (an eager call comes first)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _delay_loaded or torch.cuda.is_current_stream_capturing():
        return
    with torch.cuda.device(index):
        torch.cuda._sleep(1)
        torch.cuda.synchronize(index)
    _delay_loaded.add(index)


class SimulatedWorkspace:
    """One symmetric workspace of ``world`` ranks: one allocation (``alloc``), one ``Workspace`` per rank."""

    def __init__(self, world: int, nbytes: int, tag: str, device: torch.device, fill: int = 0):
        self.stride = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        self.alloc = torch.full((world * self.stride,), fill, dtype=torch.uint8, device=device)
        self.handle = LocalHandle([self.alloc[r * self.stride : (r + 1) * self.stride] for r in range(world)])
        self.ranks = [Workspace(tag, self.handle.buffers[r], self.handle, r, world) for r in range(world)]


class OneGpuRanks:
    """``world`` ranks on one device (see the module). ``data_bytes``/``flag_bytes``: each rank's data and flag
    workspace; data starts as 0xFF bytes (NaN in bf16 and fp16: a read of what nobody wrote shows), flags as 0.
    ``launches``: the protocol's launch functions that pass the :class:`Turnstile` in eager calls (see the
    module)."""

    def __init__(
        self,
        world: int,
        data_bytes: int,
        flag_bytes: int,
        tag: str = "one_gpu",
        device: torch.device | str | None = None,
        sm_count: int | None = None,
        launches: Sequence[tuple[Any, str]] = (),
    ):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self.world = world
        self.tag = tag
        self.data = SimulatedWorkspace(world, data_bytes, tag, self.device, fill=0xFF)
        self.flags = SimulatedWorkspace(world, flag_bytes, f"{tag}.flags", self.device)
        self._sm_count = sm_count
        self.launches = tuple(launches)
        self._initialized: set[tuple[int, int, int]] = set()
        self._init_lock = threading.Lock()
        self._streams: list[tuple[torch.cuda.Stream, torch.cuda.Stream]] | None = None
        self._comms: dict[int, Comm] = {}

    # -- the pieces of a rank's Comm

    def init_flags(self, flags: FlagArray, value: int) -> None:
        """Set a flag array on every rank, once per (workspace, offset): ``symm_mem.init_flags`` in one process.
        Synchronizes (eager only), so no rank's stream writes into the flags before they are set."""
        handle = flags.ws.handle
        key = (id(handle), flags.offset, flags.count)
        # Ranks' first calls run on threads at once: one of them sets the flags, the others wait for it here.
        # A second fill would wipe what a faster rank already signalled, and its synchronization would wait for
        # that rank's kernels, which may be waiting for this one.
        with self._init_lock:
            if key in self._initialized:
                return
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("fluxcompile: simulated flags must be initialized by an eager call before capture")
            for r in range(self.world):
                handle.get_buffer(r, (flags.count,), torch.int32, flags.offset // 4).fill_(value)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._initialized.add(key)

    @property
    def sm_count(self) -> int:
        """Each rank's SMs: an even share of the device's SMs, less RESERVED_SMS (see the module)."""
        if self._sm_count is None:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._sm_count = max(2, ((sms - RESERVED_SMS) // self.world) // 2 * 2)
        return self._sm_count

    def streams(self, rank: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(main, side) streams of ``rank``: made together, every rank's two in a row (:func:`_new_stream`), so
        the driver gives them consecutive hardware queues and, with CUDA_DEVICE_MAX_CONNECTIONS >= 2 * world,
        no two of them share one (a side stream's flag wait would hold a peer's GEMM queued behind it)."""
        if self._streams is None:
            with torch.cuda.device(self.device):
                self._streams = [(_new_stream(0), _new_stream(-1)) for _ in range(self.world)]
        return self._streams[rank]

    def comm(self, rank: int) -> Comm:
        """The communication context of ``rank`` (made on first use, eagerly: its error buffer is pinned), with
        error words of the CUTLASS GEMM's layout."""
        from ..kernels import cutlass_gemm

        if rank not in self._comms:
            self._comms[rank] = Comm(
                data=self.data.ranks[rank],
                flags=self.flags.ranks[rank],
                side=self.streams(rank)[1],
                errors=ErrorWords.make(self.device, cutlass_gemm.ERR_WORDS, "the CUTLASS choices"),
                sm_count=self.sm_count,
                init_flags=self.init_flags,
                group_name=self.tag,
            )
        return self._comms[rank]

    # -- running every rank's call

    def run(
        self,
        fn: Callable[[int, Any], Any],
        *,
        delay_rank: int | None = None,
        delay_ms: float = 5.0,
        sync: bool = True,
        timeout_s: float = 120.0,
    ) -> list[Any]:
        """``fn(rank, comm)`` of every rank, each on its main stream (current while it runs), forked from and
        joined back into the current stream; ``delay_rank``'s stream first sleeps ``delay_ms`` (approximately:
        GPU clock cycles at 2 GHz). With ``sync`` (ignored while capturing), waits for the device (bounded by
        ``timeout_s``). Eagerly, ``launches`` pass a :class:`Turnstile` (turns bounded by ``timeout_s``).
        Returns the ranks' results. ``config.check_signals`` must be off: it synchronizes inside a rank's call,
        before the next ranks have launched."""
        cur = torch.cuda.current_stream(self.device)
        # Every rank's context first: making one pins host memory, which waits for the device, and a rank that
        # waited for the GPU after an earlier rank's launch would leave that rank waiting for its data.
        comms = [self.comm(r) for r in range(self.world)]
        if delay_rank is not None:
            # The delay is launched on the rank's thread outside the turnstile: its kernel's module is loaded
            # here, before any rank launches (see load_delay_kernel).
            load_delay_kernel(self.device)
        for r in range(self.world):
            self.streams(r)[0].wait_stream(cur)

        def call(r: int) -> Any:
            with torch.cuda.device(self.device), torch.cuda.stream(self.streams(r)[0]):
                if r == delay_rank:
                    torch.cuda._sleep(int(delay_ms * 2e6))
                return fn(r, comms[r])

        if torch.cuda.is_current_stream_capturing():
            results = [call(r) for r in range(self.world)]  # one capture: its calls stay on this thread
        else:
            results = _in_turns(call, self.world, self.launches, timeout_s)
        for r in range(self.world):
            cur.wait_stream(self.streams(r)[0])
        if sync and not torch.cuda.is_current_stream_capturing():
            self.wait(timeout_s)
        return results

    def capture(self, fn: Callable[[int, Any], Any], **kwargs) -> tuple[torch.cuda.CUDAGraph, list[Any]]:
        """One CUDA graph of every rank's ``fn`` (as :meth:`run` issues them, ``kwargs`` included): replay it,
        then :meth:`wait`. Run ``fn`` eagerly first (workspaces, flags, scratch, Triton's compilation)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results = self.run(fn, sync=False, **kwargs)
        return graph, results

    def wait(self, timeout_s: float = 120.0) -> None:
        """Wait for the current stream (every rank's work was joined into it), polling: a protocol that hangs
        raises TimeoutError instead of blocking forever (the device stays blocked: end the process)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fluxcompile: simulated ranks ({self.tag}, world {self.world}) still running after "
                    f"{timeout_s:g} s: a flag is never set"
                )
            time.sleep(0.001)

    def errors(self) -> list[list[int]]:
        """Every rank's error words (synchronizes)."""
        return [[int(x) for x in self.comm(r).errors.err.tolist()] for r in range(self.world)]
