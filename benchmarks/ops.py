"""Op-level benchmark in the Flux paper's terms (section 2.3), one process per GPU:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/ops.py [--out DIR] [--no-triton-gemm]

For each shape: the best non-split GEMM (the faster of cuBLAS and the best Triton GEMM Inductor's
max-autotune finds for the same local shape), NCCL + cuBLAS, PyTorch async-TP (torch.ops.symm_mem) and
fluxcompile, all in one run. Effective communication time ECT = time − GEMM time; overlap efficiency
= 1 − ECT / ECT(NCCL + cuBLAS). The methods are timed in interleaved rounds (drift hits all alike);
times are medians over iterations of the slowest rank. Prints a table,
writes ops.json and a plot like the paper's Figure 13 into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import ops_decode
import ops_fp8
import ops_rs
import torch
import torch.distributed as dist
from overlap import check_numerics, overlap_row, run_shapes

# (n, k) with the whole n; weights column-sharded: each rank holds [k, n / world].
AG_SHAPES = [
    ("GPT-3 (Flux)", 1024, 49152, 12288),
    ("GPT-3 (Flux)", 4096, 49152, 12288),
    ("GPT-3 (Flux)", 8192, 49152, 12288),
    ("Llama-3-8B gate+up", 2048, 28672, 4096),
    ("Llama-3-8B gate+up", 8192, 28672, 4096),
]


def bench_all_gather_matmul(args: argparse.Namespace) -> list[dict]:
    return run_shapes(AG_SHAPES, _ag_shape, args)


def _ag_shape(args: argparse.Namespace, group: str, model: str, m: int, n: int, k: int) -> dict:
    from fluxcompile.lowerings.all_gather_matmul import cublas_pipelined as pipelined

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank * 1000 + int.from_bytes(os.urandom(2), "little"))  # fresh inputs every run
    a_shard = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n // world, device="cuda", dtype=torch.bfloat16) / k**0.5
    a_full = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    dist.all_gather_into_tensor(a_full, a_shard)

    def nccl_cublas():
        buf = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(buf, a_shard)
        return buf @ b

    def async_tp():
        return torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, group)

    def pipelined_only():
        return pipelined.all_gather_matmul(a_shard, [b], [None], 0, world, group)

    def ours():  # what a compiled model runs: the fused op, autotuned across its choices
        return torch.ops.fluxcompile.all_gather_matmul(a_shard, [b], [None], 0, world, group)

    # Numerics first: every method against the gathered GEMM in fp32.
    ref = a_full.float() @ b.float()
    check_numerics(
        {
            "nccl": nccl_cublas,
            "async_tp": lambda: async_tp()[1][0],
            "pipelined": lambda: pipelined_only()[1][0],
            "fluxcompile": lambda: ours()[1][0],
        },
        ref,
        f"m={m} n={n} k={k}",
    )
    methods = {"nccl_cublas": nccl_cublas, "async_tp": async_tp, "fluxcompile": ours}
    methods.update(_cutlass_methods(args, a_shard, a_full, b, ref, group))
    tune_args = (a_shard, [b], [None], 0, world, group)
    return overlap_row(
        args, "all_gather_matmul", group, model, (m, n, k), (a_full, b), methods, pipelined_only, tune_args
    )


def _cutlass_methods(args, a_shard, a_full, b, ref, group: str) -> dict:
    """The CUTLASS all-gather choice ``cutlass:<args.cutlass_variant>`` (a variant, optionally with a launch
    option) forced (``cutlass``, gathered operand returned as the op's default does; ``cutlass_noA`` without it)
    and the same variant's GEMM alone over the gathered rows with every arrival flag preset (``cutlass_alone``):
    their difference is the protocol's cost.
    Empty where the choice declines."""
    from fluxcompile.kernels import cutlass_gemm
    from fluxcompile.lowerings.all_gather_matmul import cutlass as ag_cutlass

    name = args.cutlass_variant
    world, rank = dist.get_world_size(), dist.get_rank()
    call = (a_shard, [b], [None], 0, world, group)
    why = ag_cutlass.supports(*call) if name else "no --cutlass-variant"
    if why is not None:
        if rank == 0:
            print(f"cutlass:{name} left out: {why}", flush=True)
        return {}
    variant, launch = ag_cutlass.parse(name)
    rows = a_shard.shape[0]
    tile_m = cutlass_gemm.VARIANTS[variant].tile[0]
    chunk_rows, chunks = ag_cutlass.chunking(rows, tile_m, launch.chunks)
    flags = torch.ones(world * chunks, dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    out = torch.empty(a_full.shape[0], b.shape[1], device="cuda", dtype=b.dtype)
    local = (a_shard, rank * rows) if rows % tile_m == 0 else None

    def forced(return_A: bool = True):
        return ag_cutlass.all_gather_matmul(*call, variant=variant, launch=launch, return_A=return_A)

    def alone():
        return cutlass_gemm.gemm(a_full, b, out, variant=variant, wait=(flags, rows, chunk_rows, rank), err=err,
                                 rank=rank, rotate=(0, rank * rows), local=local, raster=launch.raster,
                                 group_m=launch.group_m)  # fmt: skip

    check_numerics({"cutlass": lambda: forced()[1][0], "cutlass_alone": alone}, ref, f"cutlass:{name}")
    return {"cutlass": forced, "cutlass_noA": lambda: forced(False), "cutlass_alone": alone}


def table(rows: list[dict]) -> str:
    head = (
        f"{'op':<18} {'m':>5} {'n':>6} {'k':>6} {'cuBLAS':>8} {'Triton':>8} {'NCCL+mm':>8} {'asyncTP':>8} "
        f"{'ours':>8} {'OE asyncTP':>10} {'OE ours':>8}  {'choice':<16} {'pipelined med/min/max/graph':>28}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['op']:<18} {r['m']:>5} {r['n']:>6} {r['k']:>6} {r['cublas']:8.1f} {r['triton']:8.1f} "
            f"{r['nccl_cublas']:8.1f} {r['async_tp']:8.1f} {r['fluxcompile']:8.1f} {r['oe_async_tp']:10.0%} {r['oe_fluxcompile']:8.0%}"
            f"  {r['choice']:<16} {r['pipelined']:6.0f}/{r['pipelined_min']:.0f}/{r['pipelined_max']:.0f}/{r['pipelined_graph']:.0f}"
            f"  host µs ours {r.get('host_fluxcompile', 0):.0f}, NCCL+mm {r.get('host_nccl_cublas', 0):.0f}"
        )
    for r in rows:
        if "cutlass" in r:
            oe = 1 - (r["cutlass"] - r["gemm"]) / (r["nccl_cublas"] - r["gemm"])
            no_a = f"without the gathered A {r['cutlass_noA']:.1f}, " if "cutlass_noA" in r else ""
            lines.append(
                f"  cutlass, {r['op']} m={r['m']} n={r['n']} k={r['k']} (µs): forced {r['cutlass']:.1f} (OE {oe:.0%}), "
                f"{no_a}GEMM alone with flags preset {r['cutlass_alone']:.1f}, "
                f"protocol cost {r['cutlass'] - r['cutlass_alone']:.1f}"
            )
    for r in rows:
        if "bytes" in r:  # fp8 rows (ops_fp8.py): what a rank receives, and its time at NVLink's 450 GB/s a direction
            lines.append(
                f"  bytes, {r['op']} m={r['m']} n={r['n']} k={r['k']}: {r['bytes'] / 1e6:.1f} MB received a rank, "
                f"floor {r['bytes'] / 450e3:.1f} µs at 450 GB/s; GEMM {r['gemm']:.1f} µs"
            )
    for r in rows:
        if r.get("choices_ms"):
            times = ", ".join(f"{n} {t * 1e3:.0f}" for n, t in r["choices_ms"].items() if t is not None)
            lines.append(f"  autotuner, {r['op']} m={r['m']} n={r['n']} k={r['k']} (µs): {times}")
    for op in sorted({r["op"] for r in rows}):
        sel = [r for r in rows if r["op"] == op]
        lines.append(
            f"{op}: mean overlap efficiency fluxcompile {statistics.mean(r['oe_fluxcompile'] for r in sel):.0%} "
            f"({_median_oe(sel, 'oe_fluxcompile')}), async-TP {statistics.mean(r['oe_async_tp'] for r in sel):.0%} "
            f"({_median_oe(sel, 'oe_async_tp')}); "
            f"slower than NCCL+cuBLAS: {sum(r['fluxcompile'] > r['nccl_cublas'] for r in sel)} of {len(sel)}"
        )
    return "\n".join(lines)


def _median_oe(rows: list[dict], key: str) -> str:
    """The median of the rows' overlap efficiencies, over those defined (a row's OE is NaN where its cuBLAS
    baseline ran longer than NCCL+cuBLAS), as the summary prints it."""
    defined = [r[key] for r in rows if not math.isnan(r[key])]
    text = f"median {statistics.median(defined):.0%}" if defined else "no median"
    return text + (f" of {len(defined)} defined" if len(defined) < len(rows) else "")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"all_gather_matmul": "AG+GEMM", "matmul_reduce_scatter": "GEMM+RS", "matmul_all_reduce": "GEMM+AR"}
    labels = [f"{short.get(r['op'], r['op'])}\nm={r['m']}\n{r['n']}x{r['k']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["oe_async_tp"] * 100 for r in rows], w, label="PyTorch async-TP")
    ax.bar([i + w / 2 for i in x], [r["oe_fluxcompile"] * 100 for r in rows], w, label="fluxcompile")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("overlap efficiency (%)")
    ax.set_title(f"Overlap efficiency vs NCCL+cuBLAS, {torch.cuda.get_device_name()} x{dist.get_world_size()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the methods (drift control)")
    p.add_argument("--no-triton-gemm", dest="triton_gemm", action="store_false")
    p.add_argument(
        "--queued-us",
        type=float,
        default=0.0,
        help="GPU sleep before each timed round, so the host enqueues ahead and only GPU time is measured "
        "(default 0: rounds start from an idle GPU and host latency counts)",
    )
    p.add_argument(
        "--cold-weights",
        action="store_true",
        help="decode: every call reads the next of enough weight copies that none is in L2 (as in a model)",
    )
    p.add_argument(
        "--ops", default="ag,rs,decode", help="comma-separated: ag, rs (ops_rs.py), fp8 (ops_fp8.py), decode (ops_decode.py)"
    )
    p.add_argument(
        "--cutlass-variant",
        default="128x256x64_c2x1",
        help="the CUTLASS choice (<variant>[:<launch option>], the option for the all-gather only) timed forced and "
        "alone (empty: left out)",
    )
    args = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rows, extra_tables = [], []
    for name in args.ops.split(","):
        if name == "ag":
            rows += bench_all_gather_matmul(args)
        elif name == "rs":  # same columns as all-gather: one table, one plot
            rows += ops_rs.bench(args)
        elif name == "fp8":  # the same shapes in fp8 (ops_fp8.py), same columns
            rows += ops_fp8.bench(args, AG_SHAPES, ops_rs.RS_SHAPES)
        elif name == "decode":  # CUDA-graph timings with their own columns
            extra_tables.append(ops_decode.table(ops_decode.bench(args)))
        else:
            raise SystemExit(f"unknown --ops entry {name!r}")
    if dist.get_rank() == 0 and rows:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ops.json"), "w") as f:
            json.dump(rows, f, indent=1)
        try:
            plot(rows, os.path.join(args.out, "ops.png"))
        except Exception as e:
            print(f"plot failed: {e}")
        q = args.queued_us
        mode = f"GPU queued {q:.0f} µs ahead of each round" if q else "rounds from an idle GPU"
        print(f"== table (µs; OE = overlap efficiency vs NCCL+cuBLAS; {mode}) ==")
        print(table(rows), flush=True)
    if dist.get_rank() == 0 and extra_tables:
        print("== table (decode) ==\n" + "\n".join(extra_tables), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
