"""The one-GPU rank harness's launch order (fluxcompile/testing/one_gpu_ranks.py), on CPU: the simulated ranks share
one CUDA context, where loading a kernel's module waits for every queued kernel. ``Device`` models that: a rank's
first launch of a kernel loads its module (each rank's thread compiles its own copy, as Triton's JIT does when
ranks race to a new specialization), and a load while a queued wait lacks a peer's launch stalls (on a GPU, until
the wait times out into the error words)."""

from __future__ import annotations

import threading
import time

import pytest

from fluxcompile.testing.one_gpu_ranks import Turnstile, _in_turns, _on_threads


class Device:
    """DLRM's protocol in miniature on one shared device: ``pool`` signals every peer, ``wait`` needs every
    peer's ``pool`` queued. Rank ``slow``'s first ``pool`` compiles until rank 0 has queued its wait (bounded)."""

    def __init__(self, world: int, slow: int):
        self.world, self.slow = world, slow
        self.lock = threading.Lock()
        self.pooled: set[int] = set()
        self.waiting: list[int] = []
        self.loaded: set[tuple[int, str]] = set()
        self.stalls: list[str] = []
        self.rank0_waits = threading.Event()

    def _load(self, r: int, kernel: str) -> None:
        if (r, kernel) in self.loaded:
            return
        if r == self.slow and kernel == "pool":
            self.rank0_waits.wait(0.5)  # compiling
        with self.lock:
            self.loaded.add((r, kernel))
            unmet = [q for q in self.waiting if len(self.pooled - {q}) < self.world - 1]
            if unmet:
                self.stalls.append(f"rank {r} loads {kernel} while rank {unmet[0]}'s wait lacks a peer's pool")

    def pool(self, r: int) -> None:
        self._load(r, "pool")
        with self.lock:
            self.pooled.add(r)

    def wait(self, r: int) -> None:
        self._load(r, "wait")
        with self.lock:
            self.waiting.append(r)
        if r == 0:
            self.rank0_waits.set()


def _call(dev: Device):
    def call(r: int) -> int:
        dev.pool(r)
        dev.wait(r)
        return r

    return call


def test_model_stalls_without_turns():
    """The failure of tests/gpu/test_dlrm_ranks.py and test_moe_ranks.py on one H100: rank 0 queues its wait
    while a peer still compiles the pooling kernel, whose load then waits for that wait."""
    dev = Device(2, slow=1)
    assert _on_threads(_call(dev), 2, timeout_s=10) == [0, 1]
    assert dev.stalls, "the model should stall without the turnstile"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("slow", [0, 1])
def test_turns_never_load_while_a_wait_lacks_a_launch(world, slow):
    dev = Device(world, slow=slow)
    launches = [(dev, "pool"), (dev, "wait")]
    assert _in_turns(_call(dev), world, launches, timeout_s=10) == list(range(world))
    assert not dev.stalls, dev.stalls
    assert dev.pool.__func__ is Device.pool and dev.wait.__func__ is Device.wait  # restored after the call


class Log:
    def __init__(self):
        self.order: list[tuple[int, int]] = []

    def launch(self, r: int, k: int) -> None:
        self.order.append((k, r))


def test_turnstile_orders_launches_round_robin():
    """A rank's k-th launch after every rank's (k-1)-th and the k-th of the ranks before it, whatever the host
    work between launches takes; ranks that return early hold no turn."""
    world = 4
    counts = [5, 2, 0, 5]  # rank 2 launches nothing, rank 1 returns after two launches
    log = Log()

    def call(r: int) -> None:
        for k in range(counts[r]):
            time.sleep(0.002 * ((3 * r + k) % 4))
            log.launch(r, k)

    _in_turns(call, world, [(log, "launch")], timeout_s=10)
    want = sorted((k, r) for r in range(world) for k in range(counts[r]))
    assert log.order == want


def test_turnstile_lets_other_threads_and_nested_launches_through():
    turns = Turnstile(2, timeout_s=5)
    seen = []

    def inner() -> None:
        seen.append("inner")

    wrapped_inner = turns.wrap(inner)

    def outer() -> None:
        wrapped_inner()  # inside rank 0's turn: at once
        seen.append("outer")

    wrapped_outer = turns.wrap(outer)
    wrapped_inner()  # no rank's thread: at once
    with turns.rank(0):
        wrapped_outer()
    assert seen == ["inner", "inner", "outer"]


def test_turnstile_turn_is_bounded():
    """Rank 1 never launches nor returns in time: rank 0's second launch gives up with a TimeoutError."""
    turns = Turnstile(2, timeout_s=0.2)
    noop = turns.wrap(lambda: None)
    release = threading.Event()

    def rank1() -> None:
        with turns.rank(1):
            release.wait(5)

    t = threading.Thread(target=rank1)
    t.start()
    try:
        with turns.rank(0):
            noop()  # position 0: rank 1 (after rank 0) need not have launched
            with pytest.raises(TimeoutError, match="rank 0's launch 1"):
                noop()
    finally:
        release.set()
        t.join(5)


def test_protocols_launch_through_their_listed_functions():
    """The harness orders the launches that fluxcompile/testing/launches.py names (patched on their modules while a
    call runs): each is a function the protocol calls through its module, so the patch reaches every launch."""
    import inspect

    from fluxcompile.kernels import cutlass_grouped
    from fluxcompile.kernels import grouped_gemm as gg
    from fluxcompile.lowerings.all_to_all import cutlass as cutlass_moe
    from fluxcompile.lowerings.all_to_all import triton as moe
    from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo
    from fluxcompile.testing import launches

    dlrm = inspect.getsource(lo.protocol)
    assert [name for _, name in launches.DLRM] == ["publish", "fetch_offsets", "pool", "wait", "copy_out"]
    for owner, name in launches.DLRM:
        assert owner is lo.eb and callable(getattr(owner, name)) and f"eb.{name}(" in dlrm, name
    moe_src = "".join(
        inspect.getsource(f)
        for f in (moe.all_to_all_matmul_on, moe.stage_rows, moe.matmul_all_to_all_on, cutlass_moe.all_to_all_matmul_on)
    )
    for owner, name in launches.MOE:
        assert owner in (gg, cutlass_grouped) and callable(getattr(owner, name)), name
        prefix = "gg" if owner is gg else "cutlass_grouped"
        assert f"{prefix}.{name}(" in moe_src or f"{name}(" in inspect.getsource(gg.grouped_gemm), name


def test_cutlass_protocols_launch_through_their_listed_functions():
    """The CUTLASS choices' C++ sequences (their GEMMs load one kernel per layout and dtype at its first launch)
    go through the functions fluxcompile/testing/launches.py names."""
    import inspect

    from fluxcompile.kernels import cutlass_gemm
    from fluxcompile.lowerings.all_gather_matmul import cutlass as ag
    from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as rs
    from fluxcompile.testing import launches

    ag_src = inspect.getsource(ag.all_gather_matmul_on)
    assert launches.CUTLASS_ALL_GATHER == ((cutlass_gemm, "ag_sequence"),) and "cutlass_gemm.ag_sequence(" in ag_src
    rs_src = inspect.getsource(rs.matmul_reduce_scatter_on)
    assert launches.CUTLASS_REDUCE_SCATTER == ((cutlass_gemm, "rs_sequence"),) and "cutlass_gemm.rs_sequence(" in rs_src


def test_simulated_ranks_keep_protocol_states_of_their_own():
    """DLRM's per-rank state (epoch and counter targets) is keyed by the rank's flag buffer: the simulated ranks'
    buffers are slices of one allocation at distinct addresses, so each rank has its own state."""
    from types import SimpleNamespace

    from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo
    from fluxcompile.testing.one_gpu_ranks import OneGpuRanks

    sim = OneGpuRanks(4, 1024, lo.FLAG_BYTES, tag="dlrm-states", device="cpu")
    states = [lo.protocol_state(SimpleNamespace(flags=sim.flags.ranks[r]))[0] for r in range(4)]
    assert len({s.data_ptr() for s in states}) == 4
    assert all(lo.protocol_state(SimpleNamespace(flags=sim.flags.ranks[r]))[0] is states[r] for r in range(4))
