"""The choice registry and the rank-synchronized autotuner, on 2 gloo ranks with fake choices that sleep
a different time on each rank (so the per-rank winners differ and only the MAX-reduced one is right)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fluxcompile import config, ops
from fluxcompile.lowerings import (
    Choice,
    autotune,
    cache_key,
    cache_path,
    choices_for,
    clear_memo,
    pick,
    register_choice,
)
from fluxcompile.lowerings import choices as registry
from fluxcompile.lowerings.choices import Launches

# Per-process call counts of the fake choices' fns and supports ("<name>" and "<name>.supports").
CALLS: collections.Counter[str] = collections.Counter()
RUNS = 1 + 3  # WARMUP + ITERS below


def _fake(
    name: str, ms: tuple[float, float], fail_on: tuple[int, ...] = (), decline_on: tuple[int, ...] = ()
) -> Choice:
    """A choice that sleeps ``ms[rank]``, raises on the ranks in ``fail_on``, declines on ``decline_on``."""

    def fn(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
        CALLS[name] += 1
        if dist.get_rank() in fail_on:
            raise RuntimeError(f"{name} fails on this rank")
        time.sleep(ms[dist.get_rank()] / 1e3)
        return x

    def supports(x: torch.Tensor, dim: int, group_name: str) -> str | None:
        CALLS[name + ".supports"] += 1
        return "declined on this rank" if dist.get_rank() in decline_on else None

    return Choice(name, fn, supports)


def _register(op: str, *choices: Choice) -> None:
    registry._REGISTRY.pop(op, None)  # the rank processes outlive a test
    for c in choices:
        register_choice(op, c)


@contextlib.contextmanager
def _tuning(cache: str, autotune_on: bool = True) -> Iterator[None]:
    CALLS.clear()
    clear_memo()
    with (
        config.patch(cache_dir=cache, implementations=("fake", "reference"), autotune=autotune_on),
        mock.patch.object(autotune, "WARMUP", 1),
        mock.patch.object(autotune, "ITERS", 3),
    ):
        yield


def _args() -> tuple:
    return (torch.ones(4, 8), 1, dist.group.WORLD.group_name)


def _files(cache: str) -> list[Path]:
    return sorted((Path(cache) / "autotune").glob("*.json"))


# A is fastest on rank 0 and C on rank 1, but B has the smallest max over the ranks.
def _abc(op: str) -> None:
    _register(
        op,
        _fake("fake:a", (2, 60)),
        _fake("fake:b", (20, 20)),
        _fake("fake:c", (60, 2)),
        _fake("reference", (90, 90)),
    )


# ---------------------------------------------------------------------------------------------
# Rank functions.


def max_reduced_winner(cache: str) -> tuple[str, dict, dict]:
    _abc("test_op_max")
    with _tuning(cache):
        choice = pick("test_op_max", _args(), dist.group.WORLD.group_name)
        (file,) = _files(cache)  # written by rank 0 before pick returned
        return choice.name, dict(CALLS), json.loads(file.read_text())


def tuned_on_the_persistent_worker(cache: str) -> tuple[bool, bool]:
    """Whether every timed call ran on symm_mem.persistent's worker, and whether the chosen fn, called after,
    ran on the caller's thread."""
    import threading

    from fluxcompile.symm_mem import persistent

    threads: list[int] = []

    def fn(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
        threads.append(threading.get_ident())
        return x

    _register("test_op_worker", Choice("fake:a", fn), Choice("reference", fn))
    with _tuning(cache):
        choice = pick("test_op_worker", _args(), dist.group.WORLD.group_name)
        tuned, threads[:] = list(threads), []
        choice.fn(*_args())
    worker = persistent(threading.get_ident)
    return bool(tuned) and set(tuned) == {worker}, threads == [threading.get_ident()]


def failures_and_declines(cache: str) -> tuple[str, dict, dict, str]:
    _register(
        "test_op_fail",
        _fake("fake:raises", (1, 1), fail_on=(1,)),  # fastest, but raises on rank 1
        _fake("fake:declined", (1, 1), decline_on=(0,)),  # fastest, but rank 0 does not support it
        _fake("fake:ok", (15, 15)),
        _fake("reference", (40, 40)),
    )
    _register("test_op_all_fail", _fake("fake:x", (1, 1), fail_on=(0,)), _fake("reference", (1, 1), fail_on=(1,)))
    with _tuning(cache):
        choice = pick("test_op_fail", _args(), dist.group.WORLD.group_name)
        (file,) = _files(cache)  # written by rank 0 before pick returned
        calls = dict(CALLS)
        fallback = pick("test_op_all_fail", _args(), dist.group.WORLD.group_name)
        return choice.name, calls, json.loads(file.read_text()), fallback.name


def disk_cache_reused(cache: str) -> tuple[str, str, dict, dict, tuple]:
    _abc("test_op_cache")
    group = dist.group.WORLD.group_name
    with _tuning(cache):
        first = pick("test_op_cache", _args(), group)
        clear_memo()
        CALLS.clear()
        second = pick("test_op_cache", _args(), group)
        from_disk = dict(CALLS)  # supports ran (the agreement), the fns did not
        CALLS.clear()
        pick("test_op_cache", _args(), group)
        from_memo = dict(CALLS)  # nothing ran at all
        (file,) = _files(cache)
        if dist.get_rank() == 0:
            file.write_text("{not json")
        dist.barrier()
        clear_memo()
        CALLS.clear()
        third = pick("test_op_cache", _args(), group)  # an unreadable file is no cache: tuned again
        rewritten = json.loads(file.read_text())["winner"]
        return first.name, second.name, from_disk, from_memo, (third.name, CALLS["fake:a"], rewritten)


def cache_on_one_rank(cache: str) -> list[tuple[str, bool]]:
    """Each rank has its own cache directory (as on separate machines)."""
    _abc("test_op_split")
    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    mine = os.path.join(cache, f"rank{rank}")
    seen = []

    def set_cache(winners: tuple[str | None, str | None]) -> None:
        """Give each rank a cache file with the given winner (None: no file), then pick afresh."""
        key = cache_key("test_op_split", _args(), group)
        path = cache_path("test_op_split", key)
        if winners[rank] is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"key": json.loads(key), "winner": winners[rank], "max_ms": {}}))
        dist.barrier()
        clear_memo()
        CALLS.clear()
        seen.append((pick("test_op_split", _args(), group).name, CALLS["fake:a"] > 0))

    with _tuning(mine):
        seen.append((pick("test_op_split", _args(), group).name, True))
        seen.append(("files", len(_files(mine))))  # only rank 0 writes
        set_cache(("fake:a", None))  # only rank 0 has a file (and a stale winner): retune
        set_cache(("fake:a", "fake:c"))  # both have one, but different: retune
        set_cache(("fake:c", "fake:c"))  # the same on both: used, although not the fastest
    return seen


def autotune_off(cache: str) -> tuple[str, str, dict, int]:
    _register(
        "test_op_fixed",
        _fake("fake:a", (1, 1), decline_on=(1,)),
        _fake("fake:b", (50, 50)),
        _fake("other:x", (1, 1), decline_on=(0,)),
        _fake("other:y", (50, 50)),
        _fake("reference", (1, 1)),
    )
    group = dist.group.WORLD.group_name
    with _tuning(cache, autotune_on=False):
        first = pick("test_op_fixed", _args(), group)
        with config.patch(implementations=("other", "fake")):
            other = pick("test_op_fixed", _args(), group)
        return first.name, other.name, dict(CALLS), len(_files(cache))


def keys() -> dict[str, bool]:
    _abc("test_op_key")
    g = dist.group.WORLD.group_name
    x = torch.ones(4, 8)
    with _tuning(""):
        base = cache_key("test_op_key", (x, 1, g), g)
        differs = {
            "same args": cache_key("test_op_key", (torch.zeros(4, 8), 1, g), g) != base,
            "shape": cache_key("test_op_key", (torch.ones(8, 8), 1, g), g) != base,
            "dtype": cache_key("test_op_key", (x.half(), 1, g), g) != base,
            "layout": cache_key("test_op_key", (torch.ones(8, 4).t(), 1, g), g) != base,
            "int arg": cache_key("test_op_key", (x, 0, g), g) != base,
            "key_extra": cache_key("test_op_key", (x, 1, g), g, key_extra="bias") != base,
            "kwargs": cache_key("test_op_key", (x, 1, g), g, kwargs={"return_A": False}) != base,
            "same args, empty kwargs": cache_key("test_op_key", (x, 1, g), g, kwargs={}) != base,
        }
        with config.patch(implementations=("reference",)):
            differs["choices"] = cache_key("test_op_key", (x, 1, g), g) != base
        differs["group name hidden"] = f'"{g}"' not in base and "<group>" in base
        differs["world size"] = '"world_size": 2' in base
        differs["cache file under cache_dir"] = str(cache_path("test_op_key", base)).startswith(
            os.path.expanduser("~/.cache/fluxcompile/autotune/test_op_key-")
        )
        return differs


def reference_of_a_fused_op(cache: str) -> tuple[str, float]:
    """The real reference choice tunes (its collectives run in lockstep on both ranks) and runs right."""
    g = torch.Generator().manual_seed(0)
    As, Bs = [torch.randn(6, 16, generator=g)], [torch.randn(16, 8, generator=g)]
    args = (As, Bs, None, [6, 8], "sum", dist.group.WORLD.group_name)
    with _tuning(cache):
        choice = pick("matmul_all_reduce", args, dist.group.WORLD.group_name)
        out = choice.fn(*args)
    err = (out - ops.op("matmul_all_reduce")(*args)).abs().max().item()
    return choice.name, err


def call_kwargs(cache: str) -> tuple[str, str, str, list[bool], int]:
    """A call with keyword arguments for the choices (all_gather_matmul's return_A) is tuned apart, its
    candidates timed as it calls them: fake:a is the faster with the flag, fake:b without it."""
    seen: list[bool] = []

    def timed(ms_with: float, ms_without: float):
        def fn(x: torch.Tensor, dim: int, group_name: str, flag: bool = True) -> torch.Tensor:
            seen.append(flag)
            time.sleep((ms_with if flag else ms_without) / 1e3)
            return x

        return fn

    _register(
        "test_op_kwargs",
        Choice("fake:a", timed(2, 60)),
        Choice("fake:b", timed(20, 20)),
        Choice("reference", timed(90, 90)),
    )
    group = dist.group.WORLD.group_name
    with _tuning(cache):
        plain = pick("test_op_kwargs", _args(), group)
        flags_plain, seen[:] = list(seen), []
        without = pick("test_op_kwargs", _args(), group, kwargs={"flag": False})
        flags_without, seen[:] = list(seen), []
        again = pick("test_op_kwargs", _args(), group, kwargs={})  # no kwargs: the plain call's signature
        assert not seen, "an empty kwargs tuned again"
        assert set(flags_plain) == {True} and set(flags_without) == {False}, (flags_plain, flags_without)
        return plain.name, without.name, again.name, [bool(flags_plain), bool(flags_without)], len(_files(cache))


def all_gather_matmul_without_A(cache: str) -> tuple[bool, bool, bool, int]:
    """all_gather_matmul's implementation with return_A False (on CPU: the reference, chosen by the autotuner):
    no gathered tensor, the same products; its call signature is tuned apart from the one that returns it."""
    from fluxcompile.lowerings.all_gather_matmul import all_gather_matmul_cuda

    g = torch.Generator().manual_seed(dist.get_rank())
    group = dist.group.WORLD.group_name
    args = (torch.randn(4, 16, generator=g), [torch.randn(16, 8, generator=g)], [None], 0, 2, group)
    with _tuning(cache):
        gathered, outs = all_gather_matmul_cuda(*args)
        no_A, outs_without_A = all_gather_matmul_cuda(*args, return_A=False)
        choice = pick("all_gather_matmul", args, group, kwargs={"return_A": False})
        from_choice, _ = choice.fn(*args, return_A=False)
    return (
        gathered is not None and no_A is None,
        torch.equal(outs[0], outs_without_A[0]),
        choice.name == "reference" and from_choice is None,
        len(_files(cache)),
    )


def capture(cache: str) -> tuple[str, str]:
    _abc("test_op_capture")
    group = dist.group.WORLD.group_name
    with _tuning(cache):
        warm = pick("test_op_capture", _args(), group)
        with mock.patch.object(autotune, "_capturing", lambda: True):
            hit = pick("test_op_capture", _args(), group)  # memoized: fine under capture
            try:
                pick("test_op_capture", (torch.ones(2, 8), 1, group), group)
                return "no error", hit.name
            except RuntimeError as e:
                assert warm.name == hit.name
                return str(e), hit.name


# ---------------------------------------------------------------------------------------------
# Tests.


def test_choices_for_follows_config():
    _register("test_op_registry")
    for name in ("beta:v", "alpha:a", "reference", "alpha:b", "other"):
        register_choice("test_op_registry", Choice(name, print))
    register_choice("test_op_registry", Choice("alpha:c", print, family="gamma"))  # a family other than its kind
    with config.patch(implementations=("alpha", "reference", "beta")):
        assert [c.name for c in choices_for("test_op_registry")] == ["alpha:a", "alpha:b", "reference", "beta:v"]
    with config.patch(implementations=("beta", "gamma")):  # reference is always kept, last unless listed
        assert [c.name for c in choices_for("test_op_registry")] == ["beta:v", "alpha:c", "reference"]
        replaced = Choice("beta:v", repr)
        register_choice("test_op_registry", replaced)
        assert choices_for("test_op_registry")[0] is replaced
    assert choices_for("no_such_op") == []
    for op in ops.FUSED_OPS:  # every fused op has its reference impl as a choice
        assert choices_for(op)[-1].name == "reference", op
    for bad in ("", ":x", "triton:", " triton"):
        with pytest.raises(ValueError, match="bad choice name"):
            Choice(bad, print)
    assert Choice("triton:128x256x64-pull", print).family == "triton"  # the kind, unless given
    assert Choice("triton:128x256x64-pull", print, family="triton_ag").family == "triton_ag"
    with pytest.raises(ValueError, match="'triton' cannot name a family"):
        register_choice("test_op_registry", Choice("triton:x", print))  # "triton" was several families


def test_winner_is_argmin_of_max_over_ranks(ranks, tmp_path):
    results = ranks(2).run(max_reduced_winner, str(tmp_path))
    for name, calls, cached in results:
        assert name == "fake:b"
        assert all(calls[c] == RUNS for c in ("fake:a", "fake:b", "fake:c", "reference")), calls
        assert cached["winner"] == "fake:b"
        times = cached["max_ms"]
        assert times["fake:b"] < min(times["fake:a"], times["fake:c"], times["reference"]), times
        assert times["fake:a"] >= 60 and times["fake:c"] >= 60, times  # the slow rank's time


def test_tuning_runs_on_the_persistent_worker(ranks, tmp_path):
    """What tuning leaves behind (choices' state, NCCL's kept tensors) stays out of the caller's CUDA graph pool."""
    assert ranks(2).run(tuned_on_the_persistent_worker, str(tmp_path)) == [(True, True)] * 2


def test_failing_and_declined_choices_are_dropped_everywhere(ranks, tmp_path):
    results = ranks(2).run(failures_and_declines, str(tmp_path))
    for rank, (name, calls, cached, fallback) in enumerate(results):
        assert name == "fake:ok"
        assert cached["max_ms"]["fake:raises"] is None and "fake:declined" not in cached["max_ms"]
        assert calls["fake:raises"] == (RUNS if rank == 0 else 1)  # rank 1 stopped at its first failure
        assert calls.get("fake:declined", 0) == 0  # never run, not even on the rank that supports it
        assert fallback == "reference"  # nothing finished anywhere


def test_disk_cache_is_read_and_fns_not_rerun(ranks, tmp_path):
    for first, second, from_disk, from_memo, after_corruption in ranks(2).run(disk_cache_reused, str(tmp_path)):
        assert first == second == "fake:b"
        assert after_corruption == ("fake:b", RUNS, "fake:b")
        assert not any(k for k in from_disk if not k.endswith(".supports")), from_disk
        assert from_disk["fake:a.supports"] == 1
        assert from_memo == {}


def test_cache_on_some_ranks_only_means_retune(ranks, tmp_path):
    rank0, rank1 = ranks(2).run(cache_on_one_rank, str(tmp_path))
    assert rank0[1] == ("files", 1) and rank1[1] == ("files", 0)
    for seen in (rank0, rank1):
        # tuned; one rank cached: tuned again; caches disagree: tuned; caches agree: cached winner, no runs.
        assert seen[0] == ("fake:b", True) and seen[2:] == [("fake:b", True), ("fake:b", True), ("fake:c", False)]


def test_autotune_off_takes_first_supported_without_timing(ranks, tmp_path):
    for first, other, calls, files in ranks(2).run(autotune_off, str(tmp_path)):
        assert (first, other) == ("fake:b", "other:y")
        assert not any(k for k in calls if not k.endswith(".supports")), calls
        assert files == 0


def test_key_covers_shapes_dtypes_layout_and_args(ranks):
    for differs in ranks(2).run(keys):
        assert differs == {k: not k.startswith("same args") for k in differs}, differs


def test_all_gather_matmul_without_A(ranks, tmp_path):
    for result in ranks(2).run(all_gather_matmul_without_A, str(tmp_path)):
        assert result == (True, True, True, 2), result


def test_every_all_gather_matmul_choice_takes_return_A():
    """The op's implementation calls every choice with ``return_A`` as a keyword (the GPU choices run on GPUs
    only: their signatures are checked here)."""
    import inspect

    import fluxcompile.lowerings  # noqa: F401  (registers the choices)

    args = (torch.ones(4, 8), [torch.ones(8, 4)], [None], 0, 2, "group")
    names = []
    for choice in registry._REGISTRY["all_gather_matmul"].values():
        inspect.signature(choice.fn).bind(*args, return_A=False)
        names.append(choice.name.partition(":")[0])
    assert {"cublas_pipelined", "torch_symm_mem", "cutlass", "reference"} <= set(names), names


def test_call_kwargs_are_tuned_apart_and_timed_as_called(ranks, tmp_path):
    for plain, without, again, timed, files in ranks(2).run(call_kwargs, str(tmp_path)):
        assert (plain, without, again) == ("fake:a", "fake:b", "fake:a")
        assert timed == [True, True] and files == 2


def test_reference_choice_of_a_fused_op(ranks, tmp_path):
    for name, err in ranks(2).run(reference_of_a_fused_op, str(tmp_path)):
        assert name == "reference" and err == 0.0


def test_no_tuning_under_cuda_graph_capture(ranks, tmp_path):
    for message, hit in ranks(2).run(capture, str(tmp_path)):
        assert "warm-up" in message and "capture" in message, message
        assert hit == "fake:b"


def launch_variants(cache: str) -> tuple[str, list[str], str, str, str]:
    """A choice with launch variants as data: a call whose table gives two candidates times both as choices of
    their own (``fake:<variant>``); one whose table has an entry runs it untimed against the others; a compiled
    launch name resolves to that variant, an unknown one to the reference."""
    speeds = {"slow": (40, 40), "fast": (5, 5)}

    def make(variant: str):
        if variant not in speeds:
            raise ValueError(f"no launch {variant!r}")
        return _fake(f"fake:{variant}", speeds[variant]).fn, lambda *a: None

    def for_call(x, dim, group_name):
        return ["slow", "fast"] if x.shape[0] == 4 else ["slow"]

    base = Choice("fake", make("slow")[0], launches=Launches(for_call, make, "d1"))
    _register("test_op_launches", base, _fake("reference", (90, 90)))
    group = dist.group.WORLD.group_name
    with _tuning(cache):
        missed = pick("test_op_launches", _args(), group).name
        timed = sorted(k for k in CALLS if not k.endswith(".supports"))
        hit = pick("test_op_launches", (torch.ones(2, 8), 1, group), group).name
        compiled = pick("test_op_launches", _args(), group, compiled="fake:fast").name
        unknown = pick("test_op_launches", _args(), group, compiled="fake:gone").name
    return missed, timed, hit, compiled, unknown


def memo_fast_path(cache: str) -> tuple[str, int, int]:
    """The per-call path of a memoized signature builds no JSON key; a layout the fast path has not seen
    falls back to the memo without any collective (a rank alone there must not hang)."""
    from fluxcompile.lowerings import autotune

    _abc("test_op_fast")
    group = dist.group.WORLD.group_name
    row = torch.ones(1, 8)  # strides (8, 1)
    with _tuning(cache):
        first = pick("test_op_fast", (row, 1, group), group)
        with mock.patch.object(autotune, "_key", wraps=autotune._key) as key:
            for _ in range(5):
                assert pick("test_op_fast", (row, 1, group), group) is first
            slow_keys = key.call_count
        # Also contiguous (same JSON key), other exact strides (new fast key): only rank 0 asks.
        if dist.get_rank() == 0:
            same_row = torch.ones(8).as_strided((1, 8), (1, 1))
            assert same_row.is_contiguous() and same_row.stride() != row.stride()
            assert pick("test_op_fast", (same_row, 1, group), group) is first
        CALLS.clear()
        return first.name, slow_keys, sum(CALLS.values())


def test_launch_variants_are_timed_as_choices_and_resolve_by_name(ranks, tmp_path):
    for missed, timed, hit, compiled, unknown in ranks(2).run(launch_variants, str(tmp_path)):
        assert missed == "fake:fast" and timed == ["fake:fast", "fake:slow", "reference"]
        assert hit == "fake:slow" and compiled == "fake:fast" and unknown == "reference"


def test_memoized_calls_take_the_fast_path(ranks, tmp_path):
    for name, slow_keys, runs in ranks(2).run(memo_fast_path, str(tmp_path)):
        assert name.startswith("fake:") and slow_keys == 0 and runs == 0


def test_fast_key_describes_tensors_exactly_in_every_form():
    from fluxcompile.lowerings.autotune import _fast_key

    a, b = torch.randn(4, 6), torch.randn(6, 3)

    def key(*args):
        return _fast_key("op", args, "g", "")

    base = key([a], [b], None, [4, 3], 0, "sum", 2, "g")
    # A Parameter, a tuple instead of a list, a nested list: the same description, never the object's identity.
    assert key([torch.nn.Parameter(a.clone())], [b], None, [4, 3], 0, "sum", 2, "g") == base
    assert key((a,), (b,), None, (4, 3), 0, "sum", 2, "g") == base
    assert key([[a]], [b], None, [4, 3], 0, "sum", 2, "g") == key([[a.clone()]], [b], None, [4, 3], 0, "sum", 2, "g")
    # What a choice's support depends on changes the key: strides, dtype, shape, a bias, a scalar.
    assert key([a.t().contiguous().t()], [b], None, [4, 3], 0, "sum", 2, "g") != base
    assert key([a.double()], [b], None, [4, 3], 0, "sum", 2, "g") != base
    assert key([a[:3]], [b], None, [3, 3], 0, "sum", 2, "g") != base
    assert key([a], [b], torch.zeros(3), [4, 3], 0, "sum", 2, "g") != base
    assert key([a], [b], None, [4, 3], 1, "sum", 2, "g") != base


def test_cost_is_the_slower_of_device_and_host():
    """A call whose host work outlasts its GPU work is ranked by its host time: a choice 30% faster on the
    GPU but with four times the host cost loses to one whose host keeps up."""
    assert autotune.cost([1.0, 1.2, 0.8], []) == 1.0  # host not measured (CPU, where the time is the host's)
    assert autotune.cost([1.0, 1.2, 0.8], [0.2, 0.3, 0.25]) == 1.0  # host hidden behind the GPU
    assert autotune.cost([1.0, 1.2, 0.8], [1.5, 1.7, 1.6]) == 1.6  # host-bound
    heavy_host = autotune.cost([0.74] * 3, [1.24] * 3)
    light_host = autotune.cost([0.76] * 3, [0.25] * 3)
    assert light_host < heavy_host


def test_cold_copies_fill_twice_the_l2():
    """Graph-timed (decode) calls read copies of their arguments in turn: enough that the copies fill twice
    the L2, none when the arguments fill it twice alone, never more than MAX_COLD_COPIES."""
    mib = 1 << 20
    assert autotune.cold_copies(64 * mib, 50 * mib) == 2  # TP=2 o_proj's weight on an H100
    assert autotune.cold_copies(32 * mib, 50 * mib) == 4  # TP=4's
    assert autotune.cold_copies(100 * mib, 50 * mib) == 0
    assert autotune.cold_copies(235 * mib, 50 * mib) == 0
    assert autotune.cold_copies(1024, 50 * mib) == autotune.MAX_COLD_COPIES
    assert autotune.cold_copies(0, 50 * mib) == 0


def test_copy_args_copies_every_tensor_with_its_strides():
    w = torch.randn(6, 4)
    a, res = torch.randn(3, 6), torch.randn(3, 4)[:, ::2]
    args = ([a], [w.t()], None, [3, 4], res, 1e-5, "sum", "g")
    got = autotune.copy_args(args)
    assert type(got) is tuple and type(got[0]) is list and len(got) == len(args)
    for x, y in zip(autotune._tensors(args), autotune._tensors(got)):
        assert y.data_ptr() != x.data_ptr()
        assert y.stride() == x.stride() and y.dtype == x.dtype and torch.equal(y, x)
    assert got[2:4] == (None, [3, 4]) and got[5:] == (1e-5, "sum", "g")
