"""fluxcompile.schedules on GPUs: every library program through the interpreter kernel against
torch.distributed (NCCL) on fresh random data, ragged sizes, bf16 and fp32, outputs poisoned with NaN;
1000 eager calls and CUDA graph replays with inputs changed in place (a stale epoch or a missing ack
would let a rank read the previous call's data); a second process group of the same ranks; the public
helpers; and the bounded wait's error when a peer never comes."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import assert_on_every_rank, poison_allocator, shared_seed

from fluxcompile import schedules
from fluxcompile.schedules import gpu_executor, library
from fluxcompile.schedules.collectives import library_plan
from fluxcompile.schedules.gpu_executor import run_plan
from fluxcompile.testing.numerics import elementwise_mismatch

DTYPES = (torch.bfloat16, torch.float32)
ROWS = (1, 7, 1000, 4099, 65544)  # elements per chunk: vector and scalar paths, one to many programs


def _world() -> int:
    return dist.get_world_size()


def _names() -> list[str]:
    """Every library program for this world (collected before the group exists: WORLD_SIZE from torchrun);
    the hierarchical ones as every nodes x GPUs split of it."""
    R = int(os.environ.get("WORLD_SIZE", "2"))
    names = list(library.FLAT)
    for name in library.HIERARCHICAL:
        names += [f"{name}:{R // g}x{g}" for g in range(1, R + 1) if R % g == 0]
    return names


def _input(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
    return torch.randn(numel, device="cuda", dtype=torch.float32, generator=g).to(dtype)


def _reference(collective: str, x: torch.Tensor, group=None) -> torch.Tensor | None:
    R = dist.get_world_size(group)
    if collective == "all_reduce":
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y
    if collective == "all_gather":
        y = x.new_empty(R * x.numel())
        dist.all_gather_into_tensor(y, x, group=group)
        return y
    if collective == "reduce_scatter":
        y = x.new_empty(x.numel() // R)
        dist.reduce_scatter_tensor(y, x, group=group)
        return y
    if collective == "all_to_all":
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group)
        return y
    if collective == "all_to_next":
        ys = [torch.empty_like(x) for _ in range(R)]
        dist.all_gather(ys, x, group=group)
        r = dist.get_rank(group)
        return None if r == 0 else ys[r - 1]
    raise AssertionError(collective)


def _check(got: torch.Tensor, want: torch.Tensor | None, what: str) -> None:
    """Every rank checks its own output, then all ranks fail together (with every failing rank's message),
    so a rank that fails does not leave the others waiting in the test's next collective."""
    assert_on_every_rank(None if want is None else elementwise_mismatch(got, want, what))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", _names())
def test_library_program_matches_nccl(name, dtype):
    plan = library_plan(name, _world())
    for rows in ROWS:
        numel = plan.in_chunks * rows
        x = _input(numel, dtype, shared_seed())
        ref = _reference(plan.collective, x.float() if dtype == torch.bfloat16 else x)
        out_numel = plan.out_chunks * rows
        for call in range(2):  # the second call reuses tables, flags and mailbox at the next epoch
            poison_allocator(1 << 26)
            out = torch.full((out_numel,), float("nan"), device="cuda", dtype=dtype)
            got = run_plan(plan, x, None, out)
            _check(got, ref if ref is None else ref.to(dtype), f"{name} {dtype} rows={rows} call {call}")
    gpu_executor.check_errors()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_helpers_and_shapes(dtype):
    R = _world()
    x = _input(R * 6 * 128, dtype, shared_seed()).view(R * 6, 128)
    y = schedules.all_reduce(x)
    assert y.shape == x.shape
    _check(y, _reference("all_reduce", x.float()).to(dtype), "all_reduce helper")
    y = schedules.all_reduce(x, program="two_shot")
    _check(y, _reference("all_reduce", x.float()).to(dtype), "two-shot helper")
    g = schedules.all_gather(x)
    assert g.shape == (R * R * 6, 128)
    _check(g, _reference("all_gather", x), "all_gather helper")
    s = schedules.reduce_scatter(x, program="ring")
    assert s.shape == (6, 128)
    _check(s, _reference("reduce_scatter", x.float()).to(dtype), "reduce_scatter helper")
    a = schedules.all_to_all(x)
    _check(a, _reference("all_to_all", x), "all_to_all helper")
    prog = library.ring_all_reduce(R)
    _check(schedules.run(prog, x, dist.group.WORLD), _reference("all_reduce", x.float()).to(dtype), "run(Program)")


@pytest.mark.peers  # at one rank every size divides
def test_validation_errors():
    x = torch.ones(10, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        schedules.all_reduce(x)
    x = torch.ones(8, 8, device="cuda").t()
    with pytest.raises(ValueError, match="contiguous"):
        schedules.all_reduce(x)
    with pytest.raises(ValueError, match="do not divide"):
        schedules.all_reduce(torch.ones(_world() * 3 + 1, device="cuda"), program="two_shot")
    other = library_plan("one_shot_all_reduce", _world() + 1)
    with pytest.raises(ValueError, match="ranks"):
        run_plan(other, torch.ones(8, device="cuda"))


def _integers(numel: int, call: int, r: int | None = None) -> torch.Tensor:
    """Exact in bf16 and fp32 (sums too): small integers that differ per rank and call."""
    r = dist.get_rank() if r is None else r
    return ((torch.arange(numel, device="cuda") * 7 + 13 * r + call) % 61 - 30).float()


@pytest.mark.parametrize("name", ["one_shot_all_reduce", "two_shot_all_reduce", "direct_all_gather", "ring_all_reduce"])
def test_repeated_calls_with_inputs_changed_in_place(name):
    """1000 eager calls back to back (no host synchronization), each checked on the device."""
    R = _world()
    plan = library_plan(name, R)
    numel = plan.in_chunks * 4096
    x = torch.empty(numel, device="cuda")
    bad = torch.zeros((), device="cuda")
    for call in range(1000):
        x.copy_(_integers(numel, call))
        got = run_plan(plan, x)
        if plan.collective == "all_gather":
            want = torch.cat([_integers(numel, call, q) for q in range(R)])
        else:
            want = sum(_integers(numel, call, q) for q in range(R))
        bad += (got != want).sum()
    gpu_executor.check_errors()
    assert int(bad) == 0, f"{name}: {int(bad)} wrong elements over 1000 calls"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["one_shot_all_reduce", "two_shot_all_reduce", "direct_all_to_all"])
def test_cuda_graph_replay(name, dtype):
    R = _world()
    plan = library_plan(name, R)
    numel = plan.in_chunks * 8192
    x = torch.empty(numel, device="cuda", dtype=dtype)
    outs = [torch.empty(plan.out_chunks * 8192, device="cuda", dtype=dtype) for _ in range(4)]
    x.copy_(_integers(numel, 0))
    run_plan(plan, x, None, outs[0])  # warm up: tables, mailbox, compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for o in outs:  # several calls per graph, as the benchmark does
                run_plan(plan, x, None, o)
    torch.cuda.current_stream().wait_stream(stream)
    bad = torch.zeros((), device="cuda")
    for rep in range(1000):
        x.copy_(_integers(numel, rep))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        want = _reference(plan.collective, x.float())
        for o in outs:
            bad += (o.float() != want).sum()
    gpu_executor.check_errors()
    assert int(bad) == 0, f"{name} {dtype}: {int(bad)} wrong elements over 1000 replays"


def test_second_group_of_the_same_ranks():
    R = _world()
    group = dist.new_group(list(range(R)))
    plan = library_plan("one_shot_all_reduce", R)
    for call in range(50):  # interleaved on both groups: separate epochs, flags and mailboxes
        x = _integers(4096, call)
        a = run_plan(plan, x, group)
        b = run_plan(plan, x * 2, dist.group.WORLD)
        want = _reference("all_reduce", x)
        torch.testing.assert_close(a, want)
        torch.testing.assert_close(b, want * 2)
    gpu_executor.check_errors()


def _timeout_mismatch(pattern: str) -> str | None:
    """None if the schedule kernel recorded a timeout whose message matches ``pattern``, else what went wrong."""
    try:
        gpu_executor.check_errors()
    except RuntimeError as ex:
        return None if re.search(pattern, str(ex)) else f"the timeout error does not match {pattern!r}: {ex}"
    return "no timeout was recorded"


def _forget_channel(group: dist.ProcessGroup) -> None:
    """Drop this rank's channel of a broken group, its error words cleared, so later checks stay clean."""
    ch = gpu_executor._channels.pop((group.group_name, torch.cuda.current_device()), None)
    if ch is not None:
        ch.errors.clear()


@pytest.mark.peers  # a peer that never arrives
def test_bounded_wait_names_the_missing_peer():
    """On a group of its own: rank 0 calls once more than its peers; its wait for a peer's message times
    out and the error names the ranks and the signal, not a threadblock dependency stuck behind that wait.
    Every rank reports together (and rank 0 cleans up whatever happens), so a failure on rank 0 does not
    leave the others waiting in the test's last collective."""
    R = _world()
    group = dist.new_group(list(range(R)))
    plan = library_plan("one_shot_all_reduce", R)
    x = torch.ones(4096, device="cuda")
    run_plan(plan, x, group)  # every rank: set up and synchronized
    torch.cuda.synchronize()
    dist.barrier()
    error = None
    if dist.get_rank() == 0:
        try:
            run_plan(plan, x, group, max_spin=20_000)
            error = _timeout_mismatch(r"rank 0 of group .* timed out waiting for rank \d+'s message")
        except Exception as ex:  # reported below with the other ranks' results
            error = f"{type(ex).__name__}: {ex}"
        try:
            _forget_channel(group)  # the group is broken now
        except Exception as ex:  # a broken cleanup is reported too, never raised past the others' collective
            error = f"{error or ''} cleanup: {type(ex).__name__}: {ex}".strip()
    assert_on_every_rank(error)
