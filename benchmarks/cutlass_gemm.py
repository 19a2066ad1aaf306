"""The Flux-style CUTLASS GEMM (csrc/flux_gemm.cuh) against cuBLAS on one GPU, interleaved round after round.

    python benchmarks/cutlass_gemm.py [--ops ag,rs] [--tp 2,8] [--rounds 10] [--gap-us US --burst N] [--out DIR]

Shapes: the op-level benchmark's five (m, n, k) per op (benchmarks/ops.py, ops_rs.py) as one rank's local GEMM at
each TP: all-gather m x n/TP x k, reduce-scatter m x n x k/TP. The kernel runs as the fused ops run it: the
all-gather's waits on chunk flags (preset to 1, so nothing is awaited) with the tile order of rank 0, the
reduce-scatter's per-tile counter signals with its tile order; the owner's reduction of the slots (TP partials of
m/TP x n, fp32 sum) is timed apart. Per shape: a sweep of every variant x raster order x swizzle (short timings)
picks four candidates, then ``--rounds`` rounds time cuBLAS and each candidate on the same operands in turn;
reported: medians, the best candidate's ratio to cuBLAS, geometric means per op. Then the same for fp16, a bias
and the other weight layout ([K, N] row-major).
First, a correctness pass: every variant against an fp32 reference with a poisoned output, ragged m, both dtypes
and layouts, bias, the wait path and the counters' final values.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time

import torch
from timing import time_us

from fluxcompile.kernels import cutlass_gemm as cg
from fluxcompile.lowerings.autotune import queue_gpu

AG = [(1024, 49152, 12288), (4096, 49152, 12288), (8192, 49152, 12288), (2048, 28672, 4096), (8192, 28672, 4096)]
RS = [(1024, 12288, 49152), (4096, 12288, 49152), (8192, 12288, 49152), (2048, 4096, 14336), (8192, 4096, 14336)]
RASTERS = ("auto", "m", "n")
SWIZZLES = (1, 2, 4, 8)


def local_shapes(ops: list[str], tps: list[int]) -> list[tuple[str, int, int, int, int]]:
    out = []
    for op in ops:
        for tp in tps:
            for m, n, k in AG if op == "ag" else RS:
                out.append((op, tp, m, n // tp, k) if op == "ag" else (op, tp, m, n, k // tp))
    return out


class Problem:
    """Operands of one local GEMM and the flags/counters its fused op uses. ``scaling`` ("tensor" or "row"): e4m3
    operands with float32 scales (one each, or one per row of A and per column of B), a bf16 output, against
    ``torch._scaled_mm`` with ``use_fast_accum=fast``."""

    def __init__(self, op: str, tp: int, m: int, n: int, k: int, dtype=torch.bfloat16, layout="nk", bias=False,
                 scaling: str | None = None, fast: bool = True):  # fmt: skip
        self.op, self.tp, self.m, self.n, self.k = op, tp, m, n, k
        self.scaling, self.fast = scaling, fast
        out_dtype = dtype
        if scaling is not None:
            dtype, out_dtype = torch.float8_e4m3fn, torch.bfloat16
            self.a = (torch.randn(m, k, device="cuda") * 4).to(dtype)
            w = (torch.randn(n, k, device="cuda") * 4).to(dtype)
            rows, cols = (m, n) if scaling == "row" else (1, 1)
            self.scale_a = torch.rand(rows, 1, device="cuda") / 4 + 0.01
            self.scale_b = torch.rand(1, cols, device="cuda") / (4 * math.sqrt(k)) + 0.001
            if scaling == "tensor":
                self.scale_a, self.scale_b = self.scale_a.reshape(()), self.scale_b.reshape(())
        else:
            self.a = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
        self.b = w.t() if layout == "nk" else w.t().contiguous()
        self.bias = torch.randn(n, device="cuda", dtype=out_dtype) if bias else None
        self.out = torch.empty(m, n, device="cuda", dtype=out_dtype)
        self.ref_out = torch.empty(m, n, device="cuda", dtype=out_dtype)
        self.err = torch.zeros(cg.ERR_WORDS, dtype=torch.int32, device="cuda")
        rows = m // tp
        self.rows = rows
        if op == "ag":
            chunks = 4
            self.chunk_rows = -(-rows // chunks)
            self.flags = torch.ones(tp * chunks, dtype=torch.int32, device="cuda")
        else:
            self.counters = torch.zeros(tp, dtype=torch.int32, device="cuda")

    def cublas(self) -> None:
        if self.scaling is not None:
            torch._scaled_mm(self.a, self.b, self.scale_a, self.scale_b, self.bias, out_dtype=torch.bfloat16,
                             use_fast_accum=self.fast, out=self.ref_out)  # fmt: skip
        elif self.bias is None:
            torch.mm(self.a, self.b, out=self.ref_out)
        else:
            torch.addmm(self.bias, self.a, self.b, out=self.ref_out)

    def ours(self, variant: str, raster: str, swizzle: int) -> None:
        kw = dict(variant=variant, raster=raster, swizzle=swizzle, err=self.err)
        if self.scaling is not None:
            kw.update(scales=(self.scale_a, self.scale_b), fast_accum=self.fast)
        if self.op == "ag":
            kw.update(wait=(self.flags, self.rows, self.chunk_rows, 0), rotate=(0, 0))
        elif not cg.VARIANTS[variant].stream_k:
            kw.update(signal=(self.counters, self.rows, 0), rotate=(0, self.rows))
        cg.gemm(self.a, self.b, self.out, self.bias, **kw)


GAP_US = 0.0  # --gap-us: a GPU sleep before each timed batch (the op-level benchmark's queued rounds)
BURST = 0  # --burst: calls per timed batch (0: about 3 ms of GPU work)


def iters_for(p: Problem) -> int:
    if BURST:
        return BURST
    est_us = 2 * p.m * p.n * p.k / 700e12 * 1e6
    return max(2, min(50, int(3000 / max(est_us, 1))))


def timed(fn, iters: int) -> float:
    """``time_us`` after a GPU sleep of ``GAP_US``, so each batch starts from the clocks a gap leaves."""
    if GAP_US:
        torch.cuda.synchronize()
        queue_gpu(GAP_US)
    return time_us(fn, iters)


def sweep(p: Problem, configs, keep: int) -> list[tuple]:
    """The ``keep`` fastest configs by a short timing, plus the fastest with the default launch (raster "auto",
    swizzle 1) if it is not among them (last)."""
    it = max(2, iters_for(p) // 2)
    timings = []
    for cfg in configs:
        try:
            p.ours(*cfg)
            timings.append((timed(lambda cfg=cfg: p.ours(*cfg), it), cfg))
        except RuntimeError as e:  # a variant that cannot implement this problem
            print(f"   skip {cfg}: {str(e)[:100]}", flush=True)
    timings.sort(key=lambda x: x[0])
    out = [cfg for _, cfg in timings[:keep]]
    default = next((cfg for _, cfg in timings if cfg[1:] == ("auto", 1)), None)
    if default is not None and default not in out:
        out.append(default)
    return out


def interleaved(p: Problem, cands: list[tuple], rounds: int) -> tuple[float, list[float]]:
    it = iters_for(p)
    p.cublas()
    for c in cands:
        p.ours(*c)
    base, ours = [], [[] for _ in cands]
    for _ in range(rounds):
        base.append(timed(p.cublas, it))
        for i, c in enumerate(cands):
            ours[i].append(timed(lambda c=c: p.ours(*c), it))
    return statistics.median(base), [statistics.median(o) for o in ours]


def check(p: Problem, cfg: tuple) -> float:
    p.out.fill_(float("nan"))
    if p.op == "rs":
        p.counters.zero_()
    p.ours(*cfg)
    p.ref_out.fill_(float("nan"))
    p.cublas()
    ref = p.a.float() @ p.b.float()
    if p.scaling is not None:
        ref = ref * p.scale_a * p.scale_b
    ref = ref + (p.bias.float() if p.bias is not None else 0)
    rel = float((p.out.float() - ref).norm() / ref.norm())
    if p.scaling is not None:  # against torch._scaled_mm on the same operands too
        rel = max(rel, float((p.out.float() - p.ref_out.float()).norm() / p.ref_out.float().norm()))
    if p.op == "rs" and not cg.VARIANTS[cfg[0]].stream_k:
        want = cg.tiles_per_chunk(cfg[0], p.m, p.n, p.rows, 0)
        got = p.counters.tolist()
        assert got == want, f"counters {got} != {want} ({cfg})"
    assert not torch.isnan(p.out).any(), f"unwritten tiles ({cfg})"
    assert int(p.err[0]) == 0, f"error words {p.err.tolist()}"
    return rel


def correctness_fp8() -> list[str]:
    """Every fp8 variant, each scaling with and without fast accumulation, ragged m, bias, against an fp32
    reference and ``torch._scaled_mm``; the wait and signal paths too."""
    lines = []
    for name in cg.variants(fp8=True):
        for scaling, fast, bias, op in [
            ("tensor", True, False, "ag"), ("tensor", False, True, "rs"),
            ("row", True, True, "ag"), ("row", False, False, "rs"),
        ]:  # fmt: skip
            if not fast and not cg.VARIANTS[name].promotes:
                continue
            if cg.VARIANTS[name].stream_k:
                op = "ag"  # stream-K variants do not signal per tile
            p = Problem(op, 2, 1000, 768, 512, bias=bias, scaling=scaling, fast=fast)
            rel = check(p, (name, "auto", 1))
            ok = rel < 1e-2
            lines.append(f"{'ok ' if ok else 'BAD'} {name:26s} {scaling:6s} fast={fast:d} bias={bias:d} {p.op} rel={rel:.2e}")
            if not ok:
                raise SystemExit("\n".join(lines))
    return lines


def correctness() -> list[str]:
    lines = []
    for name in cg.variants():
        for dtype, layout, bias, op in [
            (torch.bfloat16, "nk", False, "ag"), (torch.bfloat16, "kn", True, "rs"),
            (torch.float16, "nk", True, "rs"), (torch.float16, "kn", False, "ag"),
        ]:  # fmt: skip
            p = Problem(op, 2, 1000, 768, 512, dtype, layout, bias)
            rel = check(p, (name, "auto", 1))
            ok = rel < 1e-2
            lines.append(
                f"{'ok ' if ok else 'BAD'} {name:22s} {str(dtype)[6:]:8s} {layout} bias={bias:d} {op} rel={rel:.2e}"
            )
            if not ok:
                raise SystemExit("\n".join(lines))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="ag,rs")
    ap.add_argument("--tp", default="2,8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--variants", default="", help="comma-separated subset of VARIANTS")
    ap.add_argument("--extras", default="fp16,bias,kn", help="secondary tables ('' for none)")
    ap.add_argument("--gap-us", type=float, default=0.0, help="GPU sleep before each timed batch (µs)")
    ap.add_argument("--burst", type=int, default=0, help="calls per timed batch (0: about 3 ms of work)")
    ap.add_argument("--shapes", default="", help="comma-separated m values to keep (default: all)")
    ap.add_argument("--fp8", default="", help="scalings of an fp8 run instead of bf16: tensor, row, tensor-slow, "
                    "row-slow (slow: without fast accumulation); the first is the main table, the rest extras")
    ap.add_argument("--baseline-kernels", action="store_true", help="print the kernels the baseline launches per "
                    "shape (torch.profiler) and stop; the extension is not built")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    global GAP_US, BURST
    GAP_US, BURST = args.gap_us, args.burst
    torch.manual_seed(0)
    if args.baseline_kernels:
        return baseline_kernels(args)
    t0 = time.time()
    cg.load()
    print(f"== build/load {time.time() - t0:.1f} s; variants {list(cg.load().names())}", flush=True)
    print("== correctness", flush=True)
    fp8 = [f for f in args.fp8.split(",") if f]
    print("\n".join(correctness_fp8() if fp8 else correctness()), flush=True)
    if fp8:
        return run_fp8(args, fp8)

    p = Problem("ag", 2, 256, 256, 256)
    cfg = (next(iter(cg.VARIANTS)), "auto", 1)
    for _ in range(10):
        p.ours(*cfg)
    torch.cuda.synchronize()
    host_us = time_us(lambda p=p, cfg=cfg: p.ours(*cfg), 200, cuda=False)
    torch.cuda.synchronize()
    mm_host_us = time_us(p.cublas, 200, cuda=False)
    print(f"== host time per call: ours {host_us:.1f} us, torch.mm {mm_host_us:.1f} us")
    torch.cuda.synchronize()

    variants = args.variants.split(",") if args.variants else cg.variants()
    configs = list(itertools.product(variants, RASTERS, SWIZZLES))
    rows, best_cfgs = [], {}
    for op, tp, m, n, k in local_shapes(args.ops.split(","), [int(t) for t in args.tp.split(",")]):
        if args.shapes and str(m) not in args.shapes.split(","):
            continue
        p = Problem(op, tp, m, n, k)
        cands = sweep(p, configs, 4)
        best_cfgs[(op, tp, m, n, k)] = cands
        rel = check(p, cands[0])
        base, ours = interleaved(p, cands, args.rounds)
        i = min(range(len(cands)), key=lambda j: ours[j])
        d = max(j for j in range(len(cands)) if cands[j][1:] == ("auto", 1)) if any(
            c[1:] == ("auto", 1) for c in cands) else None  # fmt: skip
        row = dict(table="bf16", op=op, tp=tp, m=m, n=n, k=k, config="/".join(map(str, cands[i])), cublas_us=base,
                   ours_us=ours[i], ratio=ours[i] / base, rel_err=rel, others=[o / base for o in ours],
                   default_ratio=ours[d] / base if d is not None else None,
                   default_config="/".join(map(str, cands[d])) if d is not None else None)  # fmt: skip
        if op == "rs":
            slots = torch.randn(tp, m // tp, n, device="cuda", dtype=torch.bfloat16)
            red = torch.empty(m // tp, n, device="cuda", dtype=torch.bfloat16)
            torch.sum(slots, 0, out=red)
            row["reduce_us"] = time_us(lambda s=slots, r=red: torch.sum(s, 0, out=r), 10)
        rows.append(row)
        dflt = f"default launch x{row['default_ratio']:.3f} [{row['default_config']}]" if d is not None else ""
        print(f"   {op} tp{tp} {m}x{n}x{k}: cuBLAS {base:8.1f} us  ours {ours[i]:8.1f} us  x{ours[i] / base:.3f}  "
              f"[{row['config']}]  rel {rel:.1e}  {dflt}", flush=True)  # fmt: skip
        del p
    for extra in [e for e in args.extras.split(",") if e]:
        for (op, tp, m, n, k), cands in best_cfgs.items():
            kw = {"fp16": dict(dtype=torch.float16), "bias": dict(bias=True), "kn": dict(layout="kn")}[extra]
            p = Problem(op, tp, m, n, k, **kw)
            cands = sweep(p, configs, 4)
            rel = check(p, cands[0])
            base, ours = interleaved(p, cands, args.rounds)
            i = min(range(len(cands)), key=lambda j: ours[j])
            rows.append(dict(table=extra, op=op, tp=tp, m=m, n=n, k=k, config="/".join(map(str, cands[i])),
                             cublas_us=base, ours_us=ours[i], ratio=ours[i] / base, rel_err=rel))  # fmt: skip
            print(f"   [{extra}] {op} tp{tp} {m}x{n}x{k}: x{ours[i] / base:.3f} [{rows[-1]['config']}]", flush=True)
            del p

    print("\n== cutlass table (median of interleaved rounds; ratio = ours / cuBLAS)")
    print(f"{'table':6s} {'op':3s} {'tp':>3s} {'m':>6s} {'n':>6s} {'k':>6s} {'cuBLAS us':>10s} {'ours us':>10s} "
          f"{'ratio':>6s} {'reduce us':>9s}  config")  # fmt: skip
    for r in rows:
        red = f"{r['reduce_us']:9.1f}" if "reduce_us" in r else " " * 9
        print(f"{r['table']:6s} {r['op']:3s} {r['tp']:3d} {r['m']:6d} {r['n']:6d} {r['k']:6d} {r['cublas_us']:10.1f} "
              f"{r['ours_us']:10.1f} {r['ratio']:6.3f} {red}  {r['config']}")  # fmt: skip
    for table in dict.fromkeys(r["table"] for r in rows):
        for op in ("ag", "rs"):
            rs = [r["ratio"] for r in rows if r["table"] == table and r["op"] == op]
            if rs:
                gm = math.exp(sum(map(math.log, rs)) / len(rs))
                print(f"geomean {table:5s} {op}: {gm:.3f}  worst {max(rs):.3f}  ({len(rs)} shapes)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cutlass.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


def baseline_kernels(args) -> None:
    """Per shape (and ``--fp8`` scaling, or bf16): the GPU kernels one baseline call launches, with their times."""
    from torch.profiler import ProfilerActivity, profile

    specs = [f for f in args.fp8.split(",") if f] or [None]
    tps = [int(t) for t in args.tp.split(",")]
    for spec in specs:
        for op, tp, m, n, k in local_shapes(args.ops.split(","), tps):
            if args.shapes and str(m) not in args.shapes.split(","):
                continue
            p = Problem(op, tp, m, n, k, **(fp8_kw(spec) if spec else {}))
            for _ in range(3):
                p.cublas()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    p.cublas()
                torch.cuda.synchronize()
            kernels = [(e.key, e.device_time_total / e.count) for e in prof.key_averages() if e.device_time_total > 0]
            names = "; ".join(f"{name} {us:.1f} us" for name, us in kernels)
            print(f"   [{spec or 'bf16'}] {op} tp{tp} {m}x{n}x{k}: {names}", flush=True)


def fp8_kw(spec: str) -> dict:
    scaling, _, slow = spec.partition("-")
    if scaling not in ("tensor", "row") or slow not in ("", "slow"):
        raise SystemExit(f"--fp8: unknown scaling {spec!r}")
    return dict(scaling=scaling, fast=not slow)


def run_fp8(args, specs: list[str]) -> None:
    """The fp8 tables: per scaling, the local shapes against ``torch._scaled_mm`` (interleaved rounds)."""
    variants = args.variants.split(",") if args.variants else cg.variants(fp8=True)
    rows = []
    tps = [int(t) for t in args.tp.split(",")]
    for i_spec, spec in enumerate(specs):
        usable = [v for v in variants if fp8_kw(spec)["fast"] or cg.VARIANTS[v].promotes]
        configs = list(itertools.product(usable, RASTERS, SWIZZLES))
        for op, tp, m, n, k in local_shapes(args.ops.split(","), tps if i_spec == 0 else tps[:1]):
            if args.shapes and str(m) not in args.shapes.split(","):
                continue
            p = Problem(op, tp, m, n, k, **fp8_kw(spec))
            cands = sweep(p, configs, 4)
            rel = check(p, cands[0])
            base, ours = interleaved(p, cands, args.rounds)
            i = min(range(len(cands)), key=lambda j: ours[j])
            rows.append(dict(table=spec, op=op, tp=tp, m=m, n=n, k=k, config="/".join(map(str, cands[i])),
                             cublas_us=base, ours_us=ours[i], ratio=ours[i] / base, rel_err=rel,
                             others=[o / base for o in ours]))  # fmt: skip
            print(f"   [{spec}] {op} tp{tp} {m}x{n}x{k}: _scaled_mm {base:8.1f} us  ours {ours[i]:8.1f} us  "
                  f"x{ours[i] / base:.3f}  [{rows[-1]['config']}]  rel {rel:.1e}", flush=True)  # fmt: skip
            del p
    print("\n== cutlass fp8 table (median of interleaved rounds; ratio = ours / torch._scaled_mm)")
    for r in rows:
        print(f"{r['table']:12s} {r['op']:3s} {r['tp']:3d} {r['m']:6d} {r['n']:6d} {r['k']:6d} {r['cublas_us']:10.1f} "
              f"{r['ours_us']:10.1f} {r['ratio']:6.3f}  {r['config']}")  # fmt: skip
    for table in dict.fromkeys(r["table"] for r in rows):
        rs = [r["ratio"] for r in rows if r["table"] == table]
        gm = math.exp(sum(map(math.log, rs)) / len(rs))
        print(f"geomean {table}: {gm:.3f}  worst {max(rs):.3f}  ({len(rs)} shapes)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cutlass-fp8.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
