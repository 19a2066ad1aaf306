"""Collectives of fluxcompile.schedules (the plan-interpreter kernel) against NCCL, one process per GPU:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/collectives.py --out DIR

All-reduce, all-gather and all-to-all from 64 KiB to 256 MiB per rank (input bytes, bf16). Each method is
first checked against NCCL's result, then timed inside CUDA graphs (``--calls`` calls per graph, so launch
cost is not measured) in interleaved rounds (drift hits every method alike); a time is the median over
replays of the slowest rank, divided by the calls per graph. Prints a table (after a ``== table`` line),
writes collectives.json and collectives.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta

import timing
import torch
import torch.distributed as dist

import fluxcompile
from fluxcompile.schedules import gpu_executor
from fluxcompile.schedules.collectives import library_plan
from fluxcompile.schedules.gpu_executor import run_plan

METHODS = {  # collective -> library programs timed against NCCL
    "all_reduce": ["one_shot_all_reduce", "two_shot_all_reduce", "ring_all_reduce"],
    "all_gather": ["direct_all_gather", "ring_all_gather"],
    "all_to_all": ["direct_all_to_all"],
}
KIB = 1024


def nccl(collective: str, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    if collective == "all_reduce":
        return lambda: dist.all_reduce(out)  # in place on its own buffer (values do not matter when timing)
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, x)
    return lambda: dist.all_to_all_single(out, x)


def reference(collective: str, x: torch.Tensor) -> torch.Tensor:
    if collective == "all_reduce":
        y = x.float()
        dist.all_reduce(y)
        return y.to(x.dtype)
    if collective == "all_gather":
        y = x.new_empty(dist.get_world_size() * x.numel())
        dist.all_gather_into_tensor(y, x)
        return y
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    return y


def graph_of(fn: Callable[[], None], calls: int) -> torch.cuda.CUDAGraph:
    fn()  # warm up (first calls set up workspaces and compile, eagerly)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def timed_graphs(graphs: dict[str, torch.cuda.CUDAGraph], calls: int, rounds: int, per_round: int) -> dict[str, float]:
    """µs per call: median over replays of the slowest rank; methods interleaved round by round."""
    t = timing.interleaved_us({name: g.replay for name, g in graphs.items()}, 1, rounds, per_round)
    return {name: v / calls for name, v in t.items()}


def measure(collective: str, nbytes: int, args: argparse.Namespace) -> dict:
    R = dist.get_world_size()
    dtype = torch.bfloat16
    numel = nbytes // 2
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh every run
    x = torch.randn(numel, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    out_numel = numel * R if collective == "all_gather" else numel
    ref = reference(collective, x)
    fns: dict[str, Callable[[], None]] = {}
    nccl_out = torch.empty(out_numel, device="cuda", dtype=dtype)
    fns["nccl"] = nccl(collective, x, nccl_out)
    errors = {}
    for name in METHODS[collective]:
        plan = library_plan(name, R)
        if numel % plan.in_chunks:
            continue
        out = torch.empty(out_numel, device="cuda", dtype=dtype)
        out.fill_(float("nan"))
        run_plan(plan, x, None, out)
        tol = 5e-2 if collective == "all_reduce" else 0.0
        err = (out.float() - ref.float()).abs().max().item()
        errors[name] = err
        if not err <= tol * max(1.0, ref.float().abs().max().item()):  # NaN fails too
            raise AssertionError(f"{name} {collective} {nbytes} B: max error {err} vs NCCL")
        fns[name] = lambda plan=plan, out=out: run_plan(plan, x, None, out)
    gpu_executor.check_errors()
    calls = max(1, min(args.calls, (64 << 20) // max(nbytes, 1)))  # fewer calls per graph when large
    graphs = {k: graph_of(f, calls) for k, f in fns.items()}
    t = timed_graphs(graphs, calls, args.rounds, args.per_round)
    gpu_executor.check_errors()
    del graphs
    ours = {k: v for k, v in t.items() if k != "nccl"}
    best = min(ours, key=ours.get)
    return dict(
        collective=collective, bytes=nbytes, world=R, nccl_us=t["nccl"], times_us=ours, best=best,
        speedup=t["nccl"] / ours[best], max_error=errors, calls_per_graph=calls,
    )  # fmt: skip


def fmt_bytes(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // KIB} KiB"


def table(rows: list[dict]) -> str:
    names = sorted({k for r in rows for k in r["times_us"]})
    head = f"{'collective':<11} {'size':>8} {'nccl':>9} " + " ".join(f"{n[:18]:>18}" for n in names)
    lines = ["== table (µs per call, CUDA graphs, median of the slowest rank; speedup = NCCL / best)", head]
    for r in rows:
        cells = " ".join(f"{r['times_us'][n]:>18.1f}" if n in r["times_us"] else f"{'-':>18}" for n in names)
        lines.append(
            f"{r['collective']:<11} {fmt_bytes(r['bytes']):>8} {r['nccl_us']:>9.1f} {cells}  "
            f"best {r['best']} x{r['speedup']:.2f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = list(METHODS)
    fig, axes = plt.subplots(1, len(cols), figsize=(5 * len(cols), 4), squeeze=False)
    for ax, c in zip(axes[0], cols):
        rs = [r for r in rows if r["collective"] == c]
        if not rs:
            continue
        xs = [r["bytes"] for r in rs]
        ax.plot(xs, [r["nccl_us"] for r in rs], "k-o", label="NCCL")
        for n in METHODS[c]:
            pts = [(r["bytes"], r["times_us"][n]) for r in rs if n in r["times_us"]]
            if pts:
                ax.plot(*zip(*pts), "-o", label=n)
        ax.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="µs per call", title=c)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M,256M", help="bytes per rank (K/M suffixes)")
    p.add_argument("--collectives", default=",".join(METHODS))
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph (fewer above 3 MiB)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--slice-bytes", type=int, default=0, help="override the executor's bytes per program")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=300))
    if args.slice_bytes:
        fluxcompile.config.sched_slice_bytes = args.slice_bytes
    sizes = [int(s[:-1]) * {"K": KIB, "M": 1 << 20}[s[-1]] if s[-1] in "KM" else int(s) for s in args.sizes.split(",")]
    t0 = time.time()
    rows = []
    for c in args.collectives.split(","):
        for n in sizes:
            rows.append(measure(c, n, args))
            if dist.get_rank() == 0:
                r = rows[-1]
                print(f"{c} {fmt_bytes(n)}: nccl {r['nccl_us']:.1f} µs, {r['times_us']}", flush=True)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "collectives.json"), "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "device": torch.cuda.get_device_name()}, f, indent=1)
        plot(rows, os.path.join(args.out, "collectives.png"))
        print(f"({time.time() - t0:.0f} s)")
        print(table(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
