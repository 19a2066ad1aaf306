"""What the op-level benchmarks (ops.py's all-gather rows, ops_rs.py, ops_decode.py) share: the timing of their
methods under ``--queued-us``, the numerics check, and one overlap-efficiency table row of a fused op.

``--queued-us``: a GPU sleep of this long is enqueued before each timed round, so the host enqueues the round
while the GPU is busy and the timings are the GPU's alone (as inside a model step whose GPU work is ahead of its
host). 0 (default): each round starts from an idle GPU, so a method's host latency shows in it.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable

import timing
import torch
import torch.distributed as dist

from fluxcompile.lowerings.autotune import queue_gpu


def queued_us(args: argparse.Namespace) -> float:
    """The run's ``--queued-us`` (0 where the script has no such option)."""
    return getattr(args, "queued_us", 0.0)


def timed(fn: Callable[[], object], args: argparse.Namespace, spread: dict | None = None) -> float:
    """Median per-iteration time (µs) of the slowest rank over ``args.iters`` calls, ranks started together;
    ``spread`` gets this rank's min and max."""
    pairs: dict[str, tuple[float, float]] = {}
    us = queued_us(args)
    t = timing.interleaved_us({"fn": fn}, args.warmup, 1, args.iters, before_round=lambda: queue_gpu(us), spread=pairs)
    if spread is not None:
        spread.update(min=pairs["fn"][0], max=pairs["fn"][1])
    return t["fn"]


def timed_interleaved(
    fns: dict[str, Callable[[], object]], args: argparse.Namespace, host: dict | None = None
) -> dict[str, float]:
    """Like :func:`timed` for several methods at once, measured in interleaved rounds (``args.rounds`` rounds,
    each timing ``args.iters // args.rounds`` iterations of every method in turn), so clock and thermal drift
    during the run hit all methods alike: the median over all of a method's iterations, then the slowest rank.
    ``host`` (if given) gets each method's median host time per call (µs to enqueue it, slowest rank): a method
    whose host time is near its GPU time is host-bound."""
    us = queued_us(args)
    per_round = max(1, args.iters // args.rounds)
    return timing.interleaved_us(
        fns, args.warmup, args.rounds, per_round, before_round=lambda: queue_gpu(us), host=host
    )


def triton_gemm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """Inductor's best Triton GEMM for this shape (max-autotune, Triton backend only)."""
    torch._dynamo.reset()
    try:
        fn = torch.compile(
            lambda x, y: x @ y,
            mode=None,
            options={"max_autotune": True, "max_autotune_gemm_backends": "TRITON", "triton.cudagraphs": False},
        )
        fn(a, b)
        return lambda: fn(a, b)
    except Exception as e:  # no Triton GEMM for this shape: cuBLAS alone is the floor
        print(f"triton gemm failed: {e}")
        return None


def run_shapes(shapes: list[tuple], measure: Callable[..., dict], args: argparse.Namespace) -> list[dict]:
    """``measure(args, group, *shape)`` for every shape on the world group, each row printed as it lands."""
    from torch.distributed import _symmetric_memory as symm

    group = dist.group.WORLD.group_name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        symm.enable_symm_mem_for_group(group)  # async-TP does nothing without it (2.11 and 2.13)
    rows = []
    for shape in shapes:
        rows.append(measure(args, group, *shape))
        if dist.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    return rows


def check_numerics(fns: dict[str, Callable[[], torch.Tensor]], ref: torch.Tensor, label: str) -> None:
    """Every method's output against the fp32 reference, before anything is timed."""
    for name, fn in fns.items():
        out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise AssertionError(f"{name} {label}: relative error {err:.2e}")


def overlap_row(
    args: argparse.Namespace,
    op: str,
    group: str,
    model: str,
    mnk: tuple[int, int, int],
    gemm_operands: tuple[torch.Tensor, torch.Tensor],
    methods: dict[str, Callable[[], object]],
    pipelined: Callable[[], object],
    tune_args: tuple,
    gemm: Callable[[], object] | None = None,
    tune_op: str | None = None,
) -> dict:
    """One table row: the local GEMM (cuBLAS and Inductor's best Triton GEMM on ``gemm_operands``) and
    ``methods`` (nccl_cublas, async_tp, fluxcompile) timed in interleaved rounds, the zero-copy or pipelined
    choice alone (median/min/max and from a CUDA graph), the autotuner's pick and its per-choice times, and
    each method's overlap efficiency against NCCL+cuBLAS. ``gemm``: the local GEMM where it is not ``a @ b``
    (fp8: ``torch._scaled_mm``; no Triton GEMM then); ``tune_op``: the autotuner's key where it is not ``op``
    (the op's scaled calls)."""
    from fluxcompile.lowerings import autotune

    a, b = gemm_operands
    tg = triton_gemm(a, b) if args.triton_gemm and gemm is None else None
    timed_methods = {"cublas": gemm or (lambda: a @ b), **methods}
    if tg is not None:
        timed_methods["triton"] = tg
    host: dict[str, float] = {}
    t = timed_interleaved(timed_methods, args, host)
    t["host_fluxcompile"], t["host_nccl_cublas"] = host.get("fluxcompile", 0.0), host.get("nccl_cublas", 0.0)
    t.setdefault("triton", float("inf"))
    t["gemm"] = min(t["cublas"], t["triton"])
    spread: dict = {}
    t["pipelined"] = timed(pipelined, args, spread)
    t["pipelined_min"], t["pipelined_max"] = spread["min"], spread["max"]
    t["pipelined_graph"] = graph_time(pipelined, args)
    t["choice"] = autotune.pick(tune_op or op, tune_args, group).name
    t["choices_ms"] = tuned_times(tune_op or op, tune_args, group)
    ect_nccl = t["nccl_cublas"] - t["gemm"]
    m, n, k = mnk
    row = {"op": op, "model": model, "m": m, "n": n, "k": k, "queued_us": queued_us(args), **t}
    for meth in ("async_tp", "fluxcompile"):
        row[f"oe_{meth}"] = 1 - (t[meth] - t["gemm"]) / ect_nccl if ect_nccl > 0 else float("nan")
    return row


def tuned_times(op: str, tune_args: tuple, group: str) -> dict:
    """The autotuner's own timings of every choice (max over ranks, ms), from its cache file."""
    from fluxcompile.lowerings import autotune

    try:
        with open(autotune.cache_path(op, autotune.cache_key(op, tune_args, group))) as f:
            return json.load(f)["max_ms"]
    except (OSError, KeyError, ValueError):
        return {}


def graph_time(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Time of ``fn`` replayed from a CUDA graph: the GPU's share without host launch cost."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, args)
