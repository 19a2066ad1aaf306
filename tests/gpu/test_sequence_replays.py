"""The C++ sequences' CUDA-graph replays (csrc/replays.h; config.sequence_graphs).

A call whose arguments were seen before is captured once and replayed from then on. Every call here gets
fresh values in the same input tensors, so an output the replay failed to write would still hold the
previous call's (different) result. Any world size: at one rank the sequences have no peers, which still
checks the capture, the keys and the replays; at two or more they also cross NVLink.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import require_sequencer, shared_seed

import fluxcompile
from fluxcompile import ops
from fluxcompile.kernels import sequencer
from fluxcompile.lowerings.all_gather_matmul import cublas_pipelined as ag_pipelined
from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined as rs_pipelined
from fluxcompile.testing.numerics import assert_close

BF16 = torch.bfloat16

# (op, variant) -> the sequence's entry and its keyword arguments
RS = {
    "split": (rs_pipelined.matmul_reduce_scatter, {}),
    "push": (rs_pipelined.matmul_reduce_scatter, {"push": True}),
    "unsplit": (rs_pipelined.matmul_reduce_scatter, {"unsplit": True}),
    "tail2": (rs_pipelined.matmul_reduce_scatter, {"tail": 2}),
    "stages2": (rs_pipelined.matmul_reduce_scatter, {"groups": 2}),
    "addmm": (rs_pipelined.matmul_reduce_scatter, {"addmm": True}),  # two ranks only (else skipped)
    "pushadd": (rs_pipelined.matmul_reduce_scatter, {"push": True, "addmm": True}),  # two ranks only
}
AG = {
    "split": (ag_pipelined.all_gather_matmul, {}),
    "concurrent": (ag_pipelined.all_gather_matmul, {"concurrent": True}),
    "unsplit": (ag_pipelined.all_gather_matmul, {"unsplit": True}),
    "lead2": (ag_pipelined.all_gather_matmul, {"lead": 2}),
    "stages2": (ag_pipelined.all_gather_matmul, {"groups": 2}),
}
CASES = [("rs", v) for v in RS] + [("ag", v) for v in AG]


class Call:
    """One op's call on fixed tensors: ``refresh`` draws new values into them, ``run`` calls the variant,
    ``reference`` computes the expected result, ``check`` compares."""

    def __init__(self, op: str, variant: str, rows: int = 256, seed: int = 0) -> None:
        group = dist.group.WORLD
        w = group.size()
        g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
        self.op = op
        self.fn, self.kw = (RS if op == "rs" else AG)[variant]
        if op == "rs":
            m, n, k = w * rows, 192, 128
            self.args = (
                [torch.randn(m, k, device="cuda", dtype=BF16, generator=g)],
                [torch.randn(k, n, device="cuda", dtype=BF16, generator=g) / k**0.5],
                torch.randn(n, device="cuda", dtype=BF16, generator=g),
                [m, n], 0, "sum", w, group.group_name,
            )  # fmt: skip
        else:
            k = 128
            self.args = (
                torch.randn(rows, k, device="cuda", dtype=BF16, generator=g),
                [torch.randn(k, n, device="cuda", dtype=BF16, generator=g) / k**0.5 for n in (160, 64)],
                [torch.randn(160, device="cuda", dtype=BF16, generator=g), None],
                0, w, group.group_name,
            )  # fmt: skip

    def refresh(self) -> None:
        (self.args[0][0] if self.op == "rs" else self.args[0]).normal_()

    def run(self):
        return self.fn(*self.args, **self.kw)

    def reference(self):
        return ops.REFERENCES["matmul_reduce_scatter" if self.op == "rs" else "all_gather_matmul"](*self.args)

    def step(self, what: str) -> None:
        """Fresh inputs, one call, checked against the reference. Nothing is kept, so the next call's outputs
        land at the same addresses and its key repeats."""
        self.refresh()
        ref = self.reference()
        self.check(self.run(), ref, what)

    def check(self, got, ref, what: str) -> None:
        if self.op == "rs":
            assert_close(got, ref, 1e-2, what)
            return
        assert_close(got[0], ref[0], 0.0, f"{what}: gathered A")
        for i, (o, r) in enumerate(zip(got[1], ref[1])):
            assert_close(o, r, 1e-2, f"{what}: out {i}")


def _call_or_skip(op: str, variant: str, rows: int = 256) -> Call:
    require_sequencer()
    call = Call(op, variant, rows, shared_seed())
    try:
        call.run()  # first sight: issued directly; also makes the workspace and flags
    except ValueError as e:  # a variant that does not apply here (e.g. stages with no peers)
        pytest.skip(f"{op} {variant}: {e}")
    torch.cuda.synchronize()
    return call


def _stats() -> dict[str, int | str | None]:
    """The replay counters and, under "why", the last capture failure's reason (None: none failed)."""
    return {**sequencer.replay_stats(), "why": sequencer.capture_failure()}


def _steps(op: str, variant: str, limit: int, n: int) -> dict[str, int | str | None]:
    """``n`` checked calls with config.sequence_graphs = ``limit``; the replay counters over them (``_stats``)."""
    with fluxcompile.config.patch(sequence_graphs=limit):
        call = _call_or_skip(op, variant)
        sequencer.clear_replays()
        for i in range(n):
            call.step(f"{op} {variant} call {i}")
        return _stats()


@pytest.mark.parametrize(("op", "variant"), CASES)
def test_replays_match_reference(op, variant):
    stats = _steps(op, variant, 64, 8)
    # Two sightings before a capture; even if the outputs alternated between two addresses, calls 4..7 replay.
    assert stats["captures"] >= 1 and stats["replays"] >= 4 and stats["failed"] == 0, stats


@pytest.mark.parametrize(("op", "variant"), [("rs", "split"), ("ag", "split")])
def test_replays_off(op, variant):
    stats = _steps(op, variant, 0, 4)
    assert stats["captures"] == 0 and stats["replays"] == 0 and stats["direct"] == 4, stats


@pytest.mark.parametrize("op", ["rs", "ag"])
def test_replay_limit(op):
    """At the limit, new signatures run directly (and stay correct); the one graph held keeps replaying."""
    with fluxcompile.config.patch(sequence_graphs=1):
        calls = [_call_or_skip(op, "split", rows) for rows in (256, 192)]
        sequencer.clear_replays()
        for i in range(12):
            calls[i % 2].step(f"{op} call {i}")
        stats = _stats()
    assert stats["graphs"] == 1 and stats["replays"] >= 1 and stats["direct"] >= 6, stats


def _on_a_thread(fn: Callable[[], None]) -> None:
    """``fn()`` on a new thread (on this thread's device); its exception is raised here."""
    device, errors = torch.cuda.current_device(), []

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            fn()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, name="sequence-replays")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _second_key(variant: str, before: Callable[[], None], thread: bool) -> dict[str, int | str | None]:
    """The rs ``variant``'s calls on one signature (captured at its second call, so the capture stream exists),
    then ``before()``, then calls on a second signature (on a thread of their own if ``thread``); the counters."""
    with fluxcompile.config.patch(sequence_graphs=64):
        first, second = (_call_or_skip("rs", variant, rows) for rows in (256, 192))
        sequencer.clear_replays()
        for i in range(3):
            first.step(f"rs {variant} call {i}")
        before()

        def steps() -> None:
            for i in range(3):
                second.step(f"rs {variant}, second signature, call {i}")

        if thread:
            _on_a_thread(steps)
        else:
            steps()
        return _stats()


@pytest.mark.parametrize("variant", ["split", "push"])
def test_capture_after_cublas_workspaces_were_dropped(variant):
    """torch drops every cuBLAS workspace at torch._C._cuda_clearCublasWorkspaces() (Inductor's CUDA graph trees
    call it around each recording), the capture stream's too: a later capture must not make them."""
    stats = _second_key(variant, torch._C._cuda_clearCublasWorkspaces, thread=False)
    assert stats["captures"] >= 2 and stats["failed"] == 0, stats


@pytest.mark.parametrize("variant", ["split", "push"])
def test_capture_on_another_thread(variant):
    """torch keeps a cuBLAS workspace per (handle, stream) and a handle per thread: a capture on a thread other
    than the one that made the capture stream must not make its workspaces either."""
    stats = _second_key(variant, lambda: None, thread=True)
    assert stats["captures"] >= 2 and stats["failed"] == 0, stats


@pytest.mark.parametrize(("op", "variant"), [("rs", "split"), ("rs", "push"), ("ag", "split"), ("ag", "lead2")])
def test_inside_a_users_graph_capture(op, variant):
    """Under the caller's own capture (vLLM decode) the sequence goes into that graph as it is: no capture of
    ours is begun inside it, and its replays, and an eager call after them, are right."""
    with fluxcompile.config.patch(sequence_graphs=64):
        call = _call_or_skip(op, variant)
        call.run()  # a second sight: captured and replayed
        torch.cuda.synchronize()
        before = _stats()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = call.run()
        during = _stats()
        assert during["captures"] == before["captures"] and during["direct"] == before["direct"] + 1, (before, during)
        for i in range(4):
            call.refresh()
            graph.replay()
            call.check(static, call.reference(), f"{op} {variant} replay {i} of the user's graph")
        call.step(f"{op} {variant} eager after the user's graph")
