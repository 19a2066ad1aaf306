"""Choices made at compile time (fx_passes/decide.py), on gloo ranks with timings mocked (on CPU every real
fused choice declines, so a fused winner is a fake choice that computes with the op's reference).

* A site whose unfused collective + matmul win compiles to the code plain Inductor writes: the same extern
  kernels and collectives in the same order, no fluxcompile op.
* A site whose fused choice wins calls the fused op, and its first call runs the winner from the memo that the
  compile-time tuning left, without tuning again.
* The decision is the autotuner's MAX over the ranks, so ranks whose own timings prefer different choices
  still compile the same code; a disk cache on one rank only means tuning again on all, not a hang; groups
  that compile different graphs agree per site within their own group.

Every compile here runs with Inductor's caches off (``fresh_compiles``): the disk cache asymmetry covered by the
compiles is the autotuner's. A rank whose own FX graph cache hits skips the pass, and with it the site's
agreement, while a rank that misses runs it: the ranks first meet on the store, so the rank that misses ends its
compile with an error naming the cause (``test_a_rank_that_skips_the_site_is_an_error``) before any collective.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import assert_close, fresh_compiles
from torch._inductor.utils import run_and_get_code

import fluxcompile
from fluxcompile import config, ops
from fluxcompile.lowerings import Choice, autotune, clear_memo, register_choice
from fluxcompile.lowerings import choices as registry

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
KEPT = "autotuned at compile time"  # the start of the report's reason for a site whose decomposition won
# Per-process call counts of the fake choices, by op.
CALLS: collections.Counter[str] = collections.Counter()


def _tp(x, w1, w2, w3, group):
    """The three sites: all_gather + mm, mm + reduce_scatter, mm + all_reduce (with a pointwise op between)."""
    h = funcol.all_gather_tensor(x, 0, group) @ w1
    y = funcol.reduce_scatter_tensor(torch.relu(h) @ w2, "sum", 0, group)
    return funcol.all_reduce(y @ w3, "sum", group)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    return tuple(torch.randn(*s, generator=g) for s in ((4, 16), (16, 32), (32, 16), (16, 8)))


# ---------------------------------------------------------------------------------------------
# The generated code, normalized.

_KERNEL = re.compile(r"\b(?:cpp_fused|triton|kernel)_\w+")
_CALL = re.compile(r"\b(extern_kernels\.\w+|torch\.ops\.[\w.]+|kernel\d+)\(")


def _body(code: str) -> list[str]:
    """The lines of the wrapper's ``call`` function with comments dropped, buffers and generated kernels renamed
    in order of first appearance (``buf7`` -> ``b0``, ``cpp_fused_relu_0`` -> ``kernel0``), hashes and paths
    blanked: what two compilations of one graph share, whatever Inductor numbered."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*def call\(", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    names: dict[str, str] = {}

    def rename(prefix: str) -> Callable[[re.Match], str]:
        def sub(m: re.Match) -> str:
            return names.setdefault(m.group(0), f"{prefix}{sum(v.startswith(prefix) for v in names.values())}")

        return sub

    out = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        line = re.sub(r"\bbuf\d+\b", rename("b"), line)
        line = _KERNEL.sub(rename("kernel"), line)
        line = re.sub(r"\b[0-9a-f]{32,}\b", "<hash>", line)
        line = re.sub(r"(/[\w.-]+)+\.(py|so|cpp)\b", "<path>", line)
        out.append(line)
    return out


def _calls(body: list[str]) -> list[str]:
    """The extern kernels, collectives, fused ops and generated kernels that ``call`` runs, in order."""
    return [re.sub(r"^kernel\d+$", "kernel", name) for line in body for name in _CALL.findall(line)]


def _compile(fn, backend: str, *args, compiled: list | None = None):
    """Compile ``fn`` afresh and run it once: its output, the normalized ``call`` of its wrapper, and the report
    entries (fused op, detail); the compiled function is appended to ``compiled``."""
    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, backend=backend)
    with fresh_compiles(), fluxcompile.collect_reports() as rep:
        out, codes = run_and_get_code(compiled_fn, *args)
    (code,) = codes
    if compiled is not None:
        compiled.append(compiled_fn)
    return out, _body(code), [(e.fused_op, e.detail) for e in rep.entries()]


# ---------------------------------------------------------------------------------------------
# Fake fused choices and mocked timings.


def _fake(op: str) -> Choice:
    """A fused choice that supports CPU tensors and computes with the op's reference; counts its calls."""
    reference = ops.REFERENCES[op]

    def fn(*args, **kwargs):  # kwargs: all_gather_matmul's return_A
        CALLS[op] += 1
        return reference(*args, **kwargs)

    return Choice(f"fake:{op}", fn)


@contextlib.contextmanager
def _fake_choices(cache: str, times: dict[str, Any] | None) -> Iterator[dict[str, mock.MagicMock]]:
    """Each op of ``OPS`` gains the choice ``fake:<op>``; only it and the reference are allowed; sites are chosen
    at compile time. ``times[op] = (fake ms, reference ms)`` (or a function of the call's arguments giving them) is
    this rank's timing of the two (``_benchmark`` mocked); None times them for real. Yields the mocks of ``_benchmark`` and ``_select`` (call counts)."""
    CALLS.clear()
    clear_memo()
    for op in OPS:
        register_choice(op, _fake(op))

    def bench(candidates, args, group, device, graphs=False):
        (op,) = {c.name.removeprefix("fake:") for c in candidates if c.name.startswith("fake:")}
        timing = times[op]
        fake_ms, reference_ms = timing(args) if callable(timing) else timing
        return [fake_ms if c.name.startswith("fake:") else reference_ms for c in candidates]

    timing = (
        mock.patch.object(autotune, "_benchmark", side_effect=bench)
        if times is not None
        else mock.patch.object(autotune, "_benchmark", wraps=autotune._benchmark)
    )
    try:
        with (
            config.patch(implementations=("fake", "reference"), choose_at_compile="always", cache_dir=cache),
            mock.patch.object(autotune, "WARMUP", 1),
            mock.patch.object(autotune, "ITERS", 3),
            timing as benchmark,
            mock.patch.object(autotune, "_select", wraps=autotune._select) as select,
        ):
            yield {"benchmark": benchmark, "select": select}
    finally:
        for op in OPS:  # the rank processes outlive a test
            registry._REGISTRY[op].pop(f"fake:{op}", None)
        clear_memo()


@contextlib.contextmanager
def _fused_ops_choose_on_cpu() -> Iterator[None]:
    """The fused ops' CPU kernels become their CUDA implementations (which run the autotuner's choice), so a CPU
    run takes the path a GPU run takes; by default the CPU runs the reference."""
    from fluxcompile.lowerings.all_gather_matmul import all_gather_matmul_cuda
    from fluxcompile.lowerings.matmul_all_reduce import matmul_all_reduce_cuda
    from fluxcompile.lowerings.matmul_reduce_scatter import matmul_reduce_scatter_cuda

    with torch.library._scoped_library("fluxcompile", "IMPL") as lib:
        lib.impl("all_gather_matmul", all_gather_matmul_cuda, "CPU")
        lib.impl("matmul_reduce_scatter", matmul_reduce_scatter_cuda, "CPU")
        lib.impl("matmul_all_reduce", matmul_all_reduce_cuda, "CPU")
        yield


# ---------------------------------------------------------------------------------------------
# Rank functions.


def forced_to_lose(cache: str) -> dict[str, object]:
    """The reference wins every site (every real fused choice declines CPU tensors): plain Inductor's code."""
    group = dist.group.WORLD
    args = (*_inputs(), group)
    expected = _tp(*args)
    result = {}
    with config.patch(choose_at_compile="always", cache_dir=cache):
        clear_memo()
        out, result["fluxcompile"], result["report"] = _compile(_tp, "fluxcompile", *args)
        assert_close(out, expected, 1e-5, "fluxcompile, sites kept")
        out, result["inductor"], _ = _compile(_tp, "inductor", *args)
        assert_close(out, expected, 1e-5, "inductor")
    with config.patch(cache_dir=cache):  # "cuda", the default: CPU sites are rewritten, chosen at run time
        out, result["rewritten"], result["rewritten_report"] = _compile(_tp, "fluxcompile", *args)
        assert_close(out, expected, 1e-5, "fluxcompile, sites rewritten")
    return result


def forced_to_win(cache: str) -> dict[str, object]:
    """The fake choices win every site: the fused ops are compiled, and their calls run the fake choices from
    the memo the compile-time tuning filled."""
    group = dist.group.WORLD
    args = (*_inputs(), group)
    expected = _tp(*args)
    with _fake_choices(cache, {op: (1.0, 5.0) for op in OPS}) as mocks, _fused_ops_choose_on_cpu():
        compiled: list = []
        out, body, report = _compile(_tp, "fluxcompile", *args, compiled=compiled)
        compiled_calls = dict(CALLS)  # the first run, right after compiling
        tunings = (mocks["select"].call_count, mocks["benchmark"].call_count)
        assert_close(out, expected, 1e-5, "first run")
        with fresh_compiles(), fluxcompile.collect_reports() as rep:
            for seed in (1, 2):
                new = (*_inputs(seed), group)
                assert_close(compiled[0](*new), _tp(*new), 1e-5, f"run with seed {seed}")
        assert not rep.graphs, "recompiled"
        return {
            "body": body,
            "report": report,
            "first_run_calls": compiled_calls,
            "calls": dict(CALLS),
            "tunings_at_compile": tunings,
            "tunings": (mocks["select"].call_count, mocks["benchmark"].call_count),
        }


# Rank 0's and rank 1's timings (fake ms, reference ms): each site's decision goes against one rank's own.
SPLIT_TIMES = {
    # Rank 1 alone would keep the site (3 < 4); the MAX over ranks says fused (4 < 8).
    "all_gather_matmul": ((1.0, 8.0), (4.0, 3.0)),
    # Rank 0 alone would fuse (1 < 5); the MAX says reference (5 < 9).
    "matmul_reduce_scatter": ((1.0, 5.0), (9.0, 5.0)),
    # Rank 0 alone would keep (3 < 4), rank 1 alone would fuse (2 < 8); the MAX says fused (4 < 8).
    "matmul_all_reduce": ((4.0, 3.0), (2.0, 8.0)),
}


def rank_dependent_timings(cache: str) -> dict[str, object]:
    rank = dist.get_rank()
    group = dist.group.WORLD
    args = (*_inputs(), group)
    mine = {op: t[rank] for op, t in SPLIT_TIMES.items()}
    with _fake_choices(os.path.join(cache, f"rank{rank}"), mine) as mocks:
        out, body, report = _compile(_tp, "fluxcompile", *args)
        assert_close(out, _tp(*args), 1e-5, "rank-dependent timings")
        return {"body": body, "report": report, "tunings": mocks["benchmark"].call_count}


def _ag_mm(x, w, group):
    return funcol.all_gather_tensor(x, 0, group) @ w


def cache_on_one_rank(cache: str) -> list[dict[str, object]]:
    """Each rank has a cache directory of its own (separate machines); only rank 0 writes cache files."""
    rank = dist.get_rank()
    group = dist.group.WORLD
    mine = os.path.join(cache, f"rank{rank}")
    g = torch.Generator().manual_seed(rank)
    args = (torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g), group)
    files = Path(mine) / "autotune"
    seen = []

    def compile_once(fake_ms: float, reference_ms: float, note: str) -> None:
        with _fake_choices(mine, {"all_gather_matmul": (fake_ms, reference_ms)}) as mocks:
            out, body, report = _compile(_ag_mm, "fluxcompile", *args)
            assert_close(out, _ag_mm(*args), 1e-5, note)
            seen.append(
                {
                    "note": note,
                    "calls": _calls(body),
                    "report": report,
                    "tunings": mocks["benchmark"].call_count,
                    "files": sorted(p.name for p in files.glob("*.json")),
                }
            )

    compile_once(1.0, 5.0, "no cache anywhere: tuned, fused")  # rank 0 writes its cache (winner fake)
    compile_once(5.0, 1.0, "cache on rank 0 only: tuned again, kept")  # rank 0's cache (fake) is not used
    dist.barrier()
    if rank == 1:  # now rank 1 has rank 0's file too (winner reference)
        shutil.copytree(Path(cache) / "rank0", mine, dirs_exist_ok=True)
    dist.barrier()
    compile_once(1.0, 5.0, "the same cache on both: used, not tuned, kept")
    return seen


def _group_a(x, w, group):
    return funcol.all_gather_tensor(x, 0, group) @ w


def _group_b(x, w1, w2, group):
    y = funcol.reduce_scatter_tensor(x @ w1, "sum", 0, group)
    return funcol.all_reduce(y @ w2, "sum", group)


def two_groups(cache: str) -> dict[str, object]:
    """Ranks {0, 1} and {2, 3} compile different graphs (different sites, shapes and numbers of sites), each
    site tuned for real (fake choices timed against the reference) within its own group."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    group = groups[rank // 2]
    g = torch.Generator().manual_seed(rank)
    if rank < 2:
        fn, args = _group_a, (torch.randn(6, 16, generator=g), torch.randn(16, 8, generator=g), group)
    else:
        fn, args = _group_b, (torch.randn(8, 16, generator=g), torch.randn(16, 24, generator=g),
                              torch.randn(24, 4, generator=g), group)  # fmt: skip
    try:
        with _fake_choices(os.path.join(cache, f"rank{rank}"), None) as mocks:
            out, body, report = _compile(fn, "fluxcompile", *args)
            assert_close(out, fn(*args), 1e-5, f"group of rank {rank}")
            return {"calls": _calls(body), "report": report, "tunings": mocks["benchmark"].call_count}
    finally:
        for pg in groups:
            dist.destroy_process_group(pg)


def _small_wins(args) -> tuple[float, float]:
    """The fake all-gather choice wins below 32 local rows and loses from there."""
    return (1.0, 5.0) if args[0].shape[0] < 32 else (5.0, 1.0)


def symbolic_rows(cache: str, small_wins: bool) -> dict[str, object]:
    """An all-gather site whose row count is symbolic, tuned at compile time at 4 and 64 local rows: with the
    fake choice winning at 4 only, the compiled code dispatches on the row count; losing at both, the site keeps
    its original ops. Then calls at other row counts, with no recompile and no tuning."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(dist.get_rank())
    w = torch.randn(16, 8, generator=g)
    times = {"all_gather_matmul": _small_wins if small_wins else (5.0, 1.0)}
    with (
        _fake_choices(cache, times) as mocks,
        _fused_ops_choose_on_cpu(),
        config.patch(dispatch_rows=(4, 64)),
    ):
        x = torch.randn(6, 16, generator=g)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.reset()
        compiled = torch.compile(_ag_mm, backend="fluxcompile")
        with fresh_compiles(), fluxcompile.collect_reports() as rep:
            out, (code,) = run_and_get_code(compiled, x, w, group)
            assert_close(out, _ag_mm(x, w, group), 1e-5, "first call")
            tunings = mocks["select"].call_count
            calls = {}
            for rows in (3, 16, 40, 100):
                CALLS.clear()
                x = torch.randn(rows, 16, generator=g)
                assert_close(compiled(x, w, group), _ag_mm(x, w, group), 1e-5, f"{rows} rows")
                calls[rows] = CALLS["all_gather_matmul"]
        return {
            "report": [(e.fused_op, e.detail) for e in rep.entries()],
            "graphs": len(rep.graphs),
            "body": _body(code),
            "tunings": (tunings, mocks["select"].call_count),
            "calls": calls,
        }


def reference_host_cost(cache: str) -> dict[str, object]:
    """Real timings (no mocks): the fake all-gather choice costs 5 ms a call; the reference choice, the op's
    Python path, 20 ms (a stand-in for host time that Inductor's generated code does not pay); the original ops as
    Inductor issues them (lowerings/decomposition.py) cost neither. Compiled, the site keeps its original ops;
    picked at run time against the reference (what a fused op's call does), the fake choice wins."""
    import dataclasses
    import time

    from fluxcompile.lowerings import REFERENCE

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(dist.get_rank())
    args = (torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g), group)
    op = "all_gather_matmul"
    reference = ops.REFERENCES[op]

    def slow(delay_s: float) -> Callable[..., Any]:
        def fn(*a, **kw):
            time.sleep(delay_s)
            return reference(*a, **kw)

        return fn

    registered = registry._REGISTRY[op]
    clear_memo()
    register_choice(op, Choice(f"fake:{op}", slow(0.005)))
    try:
        with (
            config.patch(implementations=("fake", "reference"), choose_at_compile="always", cache_dir=cache),
            mock.patch.object(autotune, "WARMUP", 1),
            mock.patch.object(autotune, "ITERS", 3),
            mock.patch.dict(registered, {REFERENCE: dataclasses.replace(registered[REFERENCE], fn=slow(0.02))}),
        ):
            out, body, report = _compile(_ag_mm, "fluxcompile", *args)
            assert_close(out, _ag_mm(*args), 1e-5, "compiled")
            fused_args = (args[0], [args[1]], [None], 0, group.size(), group.group_name)
            at_run_time = autotune.pick(op, fused_args, group.group_name).name
        return {"calls": _calls(body), "report": report, "at_run_time": at_run_time}
    finally:
        registered.pop(f"fake:{op}", None)
        clear_memo()


# ---------------------------------------------------------------------------------------------
# Tests.

PLAIN_CALLS = [
    "torch.ops._c10d_functional.all_gather_into_tensor.default",
    "torch.ops._c10d_functional.wait_tensor.default",
    "extern_kernels.mm",
    "kernel",  # relu
    "extern_kernels.mm",
    "torch.ops._c10d_functional.reduce_scatter_tensor.default",
    "torch.ops._c10d_functional.wait_tensor.default",
    "extern_kernels.mm",
    "torch.ops._c10d_functional.all_reduce_.default",
    "torch.ops._c10d_functional.wait_tensor.default",
]


def _fluxcompile_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if "fluxcompile" in c]


def test_site_forced_to_lose_compiles_to_plain_inductor(ranks, tmp_path):
    results = ranks(2).run(forced_to_lose, str(tmp_path))
    for r in results:
        ours, plain = r["fluxcompile"], r["inductor"]
        assert _calls(plain) == PLAIN_CALLS, _calls(plain)
        assert _calls(ours) == _calls(plain)
        assert ours == plain, "\n".join(ours)  # the whole call function, buffer and kernel names aside
        assert not _fluxcompile_calls(_calls(ours))
        assert [fused for fused, _ in r["report"]] == [None, None, None], r["report"]
        assert all(detail.startswith(KEPT) for _, detail in r["report"]), r["report"]
        # The comparison sees a rewrite: chosen at run time (the default on CPU), the fused ops are called.
        assert [fused for fused, _ in r["rewritten_report"]] == list(OPS)
        assert _fluxcompile_calls(_calls(r["rewritten"])) == [f"extern_kernels.fluxcompile_{op}" for op in OPS]
    assert results[0] == results[1]


def test_site_forced_to_win_calls_the_fused_choice(ranks, tmp_path):
    results = ranks(2).run(forced_to_win, str(tmp_path))
    for r in results:
        calls = _calls(r["body"])
        assert _fluxcompile_calls(calls) == [f"extern_kernels.fluxcompile_{op}" for op in OPS], calls
        assert not [c for c in calls if "_c10d_functional" in c or c == "extern_kernels.mm"], calls
        assert [fused for fused, _ in r["report"]] == list(OPS), r["report"]
        # Tuned once per site, while compiling; the calls found the winners in the memo.
        assert r["tunings_at_compile"] == r["tunings"] == (3, 3)
        # The winner is written into the call (the op's ``choice``): found there, not looked up.
        for op in OPS:
            assert any(f"fluxcompile_{op}(" in line and f"'fake:{op}'" in line for line in r["body"]), r["body"]
        assert r["first_run_calls"] == {op: 1 for op in OPS}
        assert r["calls"] == {op: 3 for op in OPS}
    assert results[0]["body"] == results[1]["body"]


def test_rank_dependent_timings_give_one_decision(ranks, tmp_path):
    results = ranks(2).run(rank_dependent_timings, str(tmp_path))
    for r in results:
        assert [fused for fused, _ in r["report"]] == ["all_gather_matmul", None, "matmul_all_reduce"], r["report"]
        assert r["report"][1][1].startswith(KEPT)
        assert _fluxcompile_calls(_calls(r["body"])) == [
            "extern_kernels.fluxcompile_all_gather_matmul",
            "extern_kernels.fluxcompile_matmul_all_reduce",
        ]
        assert "torch.ops._c10d_functional.reduce_scatter_tensor.default" in _calls(r["body"])
        assert r["tunings"] == 3
    assert results[0]["report"] == results[1]["report"]
    assert results[0]["body"] == results[1]["body"]


def test_the_references_python_host_cost_does_not_decide(ranks, tmp_path):
    """Timed against the reference's Python path the fake choice would win (5 < 20 ms); against the original ops
    as Inductor issues them it loses, and the compiled site keeps them."""
    results = ranks(2).run(reference_host_cost, str(tmp_path))
    for r in results:
        assert r["at_run_time"] == "fake:all_gather_matmul", r
        assert [fused for fused, _ in r["report"]] == [None], r["report"]
        assert r["report"][0][1].startswith(KEPT), r["report"]
        assert not _fluxcompile_calls(r["calls"]), r["calls"]
        assert "torch.ops._c10d_functional.all_gather_into_tensor.default" in r["calls"]


def test_cache_on_one_rank_does_not_hang(ranks, tmp_path):
    rank0, rank1 = ranks(2).run(cache_on_one_rank, str(tmp_path), timeout_s=180)
    fused, kept = ["extern_kernels.fluxcompile_all_gather_matmul"], []
    expected = [(fused, "all_gather_matmul", 1), (kept, None, 1), (kept, None, 0)]
    for seen in (rank0, rank1):
        got = [(_fluxcompile_calls(s["calls"]), s["report"][0][0], s["tunings"]) for s in seen]
        assert got == expected, [s["note"] for s in seen]
    assert [len(s["files"]) for s in rank0] == [1, 1, 1] and [len(s["files"]) for s in rank1] == [0, 0, 1]
    assert [(s["calls"], s["report"]) for s in rank0] == [(s["calls"], s["report"]) for s in rank1]


def test_groups_compiling_different_graphs_do_not_hang(ranks, tmp_path):
    results = ranks(4).run(two_groups, str(tmp_path), timeout_s=240)
    for pair, sites in ((results[:2], ["all_gather_into_tensor"]), (results[2:], ["reduce_scatter", "all_reduce"])):
        a, b = pair
        assert a["calls"] == b["calls"] and a["report"] == b["report"]
        assert a["tunings"] == b["tunings"] == len(sites)  # one real tuning per site, within the group
        assert len(a["report"]) == len(sites)
        for fused, detail in a["report"]:
            assert fused is not None or detail.startswith(KEPT), a["report"]
    assert results[0]["calls"] != results[2]["calls"]


def _meet_alone(timeout_s: float) -> str:
    """Rank 1 reaches a site's meeting; rank 0 never does (as when Inductor replays the graph from its cache)."""
    from fluxcompile.fx_passes import decide

    group = dist.new_group([0, 1])  # a group of its own, so no later meeting on the world group is off by one
    if dist.get_rank() == 0:
        return ""
    try:
        decide._meet(group.group_name, "all_gather_matmul[(4, 16)]", timeout_s)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _meet_at(site: str) -> str:
    from fluxcompile.fx_passes import decide

    group = dist.new_group([0, 1])  # a group of its own: its meetings count from 1 on every rank
    try:
        decide._meet(group.group_name, site, 30.0)
    except RuntimeError as e:
        return str(e)
    return "met"


def test_a_rank_that_skips_the_site_is_an_error(ranks):
    """The ranks of a group meet on the store before any tuning collective: a rank left alone ends with an error
    that names the site and the cause, and ranks at different sites too."""
    results = ranks(2).run(_meet_alone, 2.0)
    assert results[0] == ""
    assert "rank 1" in results[1] and "waited 2 s" in results[1] and "Inductor's cache" in results[1], results[1]
    assert ranks(2).run(_meet_at, "same site") == ["met", "met"]
    sites = ranks(2).run(_meet_at_rank_site)
    assert all("compile different sites" in r for r in sites), sites


def _meet_at_rank_site() -> str:
    return _meet_at(f"site of rank {dist.get_rank()}")


def test_symbolic_rows_dispatch_by_range(ranks, tmp_path):
    for r in ranks(2).run(symbolic_rows, str(tmp_path), True):
        ((fused, detail),) = r["report"]
        assert fused == "all_gather_matmul" and "range-based dispatch" in detail, detail
        # Tuned at 4 and 64 rows while compiling; 17 is their log-scale midpoint.
        assert any("'fake:all_gather_matmul;17:reference'" in line for line in r["body"]), r["body"]
        assert r["tunings"] == (2, 2), "tuned at run time"
        assert r["calls"] == {3: 1, 16: 1, 40: 0, 100: 0}
        assert r["graphs"] == 1, "recompiled"


def test_symbolic_rows_losing_everywhere_keep_the_original_ops(ranks, tmp_path):
    for r in ranks(2).run(symbolic_rows, str(tmp_path), False):
        ((fused, detail),) = r["report"]
        assert fused is None and detail.startswith(KEPT), detail
        assert not _fluxcompile_calls(_calls(r["body"])), r["body"]
        assert r["calls"] == {3: 0, 16: 0, 40: 0, 100: 0}
