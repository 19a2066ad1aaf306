"""Decode benchmark of matmul_all_reduce and all_reduce_rmsnorm (issue 5), one process per GPU, wired into
benchmarks/ops.py as ``--ops decode``; also runnable alone:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/ops_decode.py [--out DIR]

Llama-3-70B's row-parallel projections: n = 8192 output features, k = 28672 (down_proj) and 8192 (o_proj)
input features, the weight row-sharded (each rank holds ``[n, k / world]`` in nn.Linear's layout, B = W.t()),
m ∈ {1, 16, 64, 256} tokens, with and without the residual add + RMSNorm after the all-reduce.

Every method is timed as CUDA graph replays (``CALLS`` calls captured in one graph; the per-call time is a
replay's time divided by ``CALLS``), methods interleaved in rounds (``overlap.timed_interleaved``), medians of
the slowest rank:
  cublas          the local GEMM alone (the floor)
  nccl            cuBLAS, then NCCL's all-reduce (in place), then the tail in PyTorch ops
  torch_one_shot  cuBLAS into a symmetric buffer, then PyTorch's symm_mem one-shot all-reduce (+ tail ops)
  fluxcompile     the fused op as a compiled model runs it (autotuned over its choices)
  <choice>        each choice of the fused op that supports the shape (experimental ones enabled here)
  cuda_no_comm    the CUDA GEMV kernel on a one-rank group: its math and epilogue, no communication
  read_weight     one read of the weight (a sum): the bandwidth yardstick (GB/s of weight per pass listed)
ECT (effective communication time) = time − cuBLAS; the table gives each method's ECT as a fraction of
NCCL's. Fresh random inputs every run; every method's output is checked against the reference first.

``--cold-weights``: every call of every method reads the next of enough copies of the weight to fill twice the L2
cache (none for a weight that fills it twice alone), so no call finds its weight there, as in a decoding model
whose layers' weights stream from HBM. By default each method reads the same weight again, and a part of a weight
smaller than a few L2s may stay cached between calls (for the methods that do not read it with an evict-first
hint).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from overlap import timed_interleaved

CALLS = 20  # calls per captured graph
SHAPES = [  # (model, projection, n, k): full k; each rank holds k / world rows of B
    ("Llama-3-70B", "down_proj", 8192, 28672),
    ("Llama-3-70B", "o_proj", 8192, 8192),
]
MS = (1, 16, 64, 256)
EPS = 1e-5


def bench(args: argparse.Namespace) -> list[dict]:
    import fluxcompile
    from fluxcompile.config import IMPLEMENTATIONS

    # The decode kernels (families decode and gemv_peers, listed with every other) are what this benchmark is for.
    fluxcompile.config.implementations = IMPLEMENTATIONS
    rows = []
    for model, proj, n, k in SHAPES:
        for m in MS:
            for tail in (False, True):
                rows.append(_shape(args, model, proj, m, n, k, tail))
                if dist.get_rank() == 0:
                    print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0 and getattr(args, "out", None):
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ops_decode.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def weight_copies(W: torch.Tensor, cold: bool) -> list[torch.Tensor]:
    """``W``, and with ``cold`` the copies of it that keep its reads out of L2 when read in turn (the
    autotuner's rule for decode calls)."""
    from fluxcompile.lowerings import autotune

    if not cold:
        return [W]
    l2 = torch.cuda.get_device_properties(W.device).L2_cache_size
    return [W] + [W.clone() for _ in range(autotune.cold_copies(W.numel() * W.element_size(), l2))]


def _graph(fn) -> torch.cuda.CUDAGraph:
    fn()  # eager first: workspaces, compilation, autotuning
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    torch.cuda.synchronize()
    return graph


_solo: str | None = None


def _solo_group() -> str:
    """This rank alone as a group (every rank takes part in creating every rank's)."""
    global _solo
    if _solo is None:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _solo = groups[dist.get_rank()].group_name
    return _solo


def _shape(args: argparse.Namespace, model: str, proj: str, m: int, n: int, k: int, tail: bool) -> dict:
    from fluxcompile import ops
    from fluxcompile.lowerings import autotune, choices_for
    from fluxcompile.testing.numerics import rel_err

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    k_local = k // world
    torch.manual_seed(rank * 1000 + int.from_bytes(os.urandom(2), "little"))  # fresh inputs every run
    dt = torch.bfloat16
    A = torch.randn(m, k_local, device="cuda", dtype=dt)
    W = torch.randn(n, k_local, device="cuda", dtype=dt) / k**0.5  # nn.Linear layout
    Ws = weight_copies(W, getattr(args, "cold_weights", False))
    Bs = [w.t() for w in Ws]
    B = Bs[0]
    residual = torch.randn(m, n, device="cuda", dtype=dt)
    norm_w = torch.rand(n, device="cuda", dtype=dt) + 0.5
    op = "all_reduce_rmsnorm" if tail else "matmul_all_reduce"

    def args_with(b, group=group):
        if tail:
            return (None, [A], [b], None, [m, n], residual, norm_w, EPS, True, False, "sum", group)
        return ([A], [b], None, [m, n], "sum", group)

    all_args = [args_with(b) for b in Bs]  # per weight copy
    op_args = all_args[0]

    def with_tail(r):
        if not tail:
            return r
        h = residual + r
        return h, ops.rms_norm(h, norm_w, EPS, True, False)

    def nccl(b):
        P = A @ b
        dist.all_reduce(P)
        return with_tail(P)

    each_copy = autotune.in_turn  # a method: fn on the next weight copy's arguments each call
    one_each = [(b,) for b in Bs]

    choices = {c.name: c for c in choices_for(op)}
    methods = {
        "cublas": each_copy(lambda b: A @ b, one_each),
        "nccl": each_copy(nccl, one_each),
        "fluxcompile": each_copy(getattr(torch.ops.fluxcompile, op), all_args),
    }
    one_shot = choices.get("torch_symm_mem:one_shot")
    if one_shot is not None and one_shot.declines(*op_args) is None:
        methods["torch_one_shot"] = each_copy(one_shot.fn, all_args)
    # The CUDA kernel on a one-rank group: its GEMV (and epilogue) with no communication, so its ECT splits
    # into the kernel's math against cuBLAS and the cost of the exchange.
    gemv = choices.get("cuda:gemv-oneshot")
    if gemv is not None:
        solo_args = [args_with(b, _solo_group()) for b in Bs]
        if gemv.declines(*solo_args[0]) is None:
            methods["cuda_no_comm"] = each_copy(gemv.fn, solo_args)
    # A bandwidth yardstick: one read of the weight (a reduction), what a memory-bound GEMV cannot beat by much.
    methods["read_weight"] = each_copy(lambda w: w.sum(dtype=torch.float32), [(w,) for w in Ws])
    declined = {}
    for c in [x for registered in choices.values() for x in registered.candidates(*op_args)]:  # launches apart
        name = c.name
        why = c.declines(*op_args)
        if why is None:
            methods[name] = each_copy(c.fn, all_args)
        else:
            declined[name] = why

    # Numerics first (eager), against the reference; the fused op also tunes here.
    ref = ops.REFERENCES[op](*op_args)
    refs = ref if tail else (ref,)
    local = with_tail(A @ B)
    local_refs = local if tail else (local,)
    failed = {}
    for name, fn in methods.items():
        if name in ("cublas", "read_weight"):
            continue
        try:
            out = fn()
            outs = out if tail else (out,)
            err = max(rel_err(o, r) for o, r in zip(outs, local_refs if name == "cuda_no_comm" else refs))
            if not err <= 1e-2:
                failed[name] = f"relative error {err:.2e}"
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
    # A method failing on any rank is dropped on all (ranks must capture the same collectives).
    all_failed: list = [None] * world
    dist.all_gather_object(all_failed, failed)
    failed = {name: why for f in all_failed for name, why in f.items()}
    for name in failed:
        methods.pop(name, None)

    graphs = {name: _graph(fn) for name, fn in methods.items()}
    t = timed_interleaved({name: g.replay for name, g in graphs.items()}, args)
    per_call = {name: v / CALLS for name, v in t.items()}
    del graphs
    row = {
        "op": op, "model": model, "proj": proj, "m": m, "n": n, "k": k, "tail": tail,
        "choice": autotune.pick(op, op_args, group).name, "us": per_call, "failed": failed, "declined": declined,
        "weight_copies": len(Ws),
    }  # fmt: skip
    base = per_call["cublas"]
    # Weight bytes per µs of each memory-bound pass (GB/s): how far the GEMVs are from the HBM roofline.
    row["weight_gbps"] = {
        name: W.numel() * W.element_size() / (per_call[name] * 1e3)
        for name in ("read_weight", "cublas", "cuda_no_comm")
        if name in per_call
    }
    ect = {name: v - base for name, v in per_call.items() if name not in ("cublas", "read_weight")}
    row["ect_us"] = ect
    nccl_ect = ect.get("nccl", float("nan"))
    row["ect_vs_nccl"] = {name: (v / nccl_ect if nccl_ect > 0 else float("nan")) for name, v in ect.items()}
    return row


def table(rows: list[dict]) -> str:
    """Per shape: cuBLAS time, then each method's per-call time and ECT as a fraction of NCCL's."""
    lines = [
        f"{'op':<19} {'proj':<9} {'m':>4} {'k':>6} {'cuBLAS':>7} {'NCCL':>7} {'1shot':>7} {'ours':>7} "
        f"{'ECT NCCL':>8} {'ECT 1shot':>9} {'ECT ours':>8} {'ours/NCCL':>9} {'ours/1shot':>10}  choice"
    ]
    for r in rows:
        us, ect = r["us"], r["ect_us"]

        def f(d, key, width, fmt=".1f"):
            v = d.get(key)
            return f"{v:{width}{fmt}}" if v is not None else f"{'-':>{width}}"

        ours, one = ect.get("fluxcompile"), ect.get("torch_one_shot")
        vs_one = f"{ours / one:10.0%}" if ours is not None and one else f"{'-':>10}"
        lines.append(
            f"{r['op']:<19} {r['proj']:<9} {r['m']:>4} {r['k']:>6} {f(us, 'cublas', 7)} {f(us, 'nccl', 7)} "
            f"{f(us, 'torch_one_shot', 7)} {f(us, 'fluxcompile', 7)} {f(ect, 'nccl', 8)} {f(ect, 'torch_one_shot', 9)} "
            f"{f(ect, 'fluxcompile', 8)} {f(r['ect_vs_nccl'], 'fluxcompile', 9, '.0%')} {vs_one}  {r['choice']}"
        )
    lines.append("per choice, ECT µs (fraction of NCCL's):")
    for r in rows:
        parts = [
            f"{name} {v:.1f} ({r['ect_vs_nccl'][name]:.0%})"
            for name, v in sorted(r["ect_us"].items(), key=lambda kv: kv[1])
            if name not in ("nccl", "fluxcompile")
        ]
        bw = ", ".join(f"{name} {v:.0f}" for name, v in r.get("weight_gbps", {}).items())
        lines.append(
            f"  {r['op']} {r['proj']} m={r['m']}: " + ", ".join(parts) + (f"; weight GB/s: {bw}" if bw else "")
        )
        if r["failed"]:
            lines.append(f"    FAILED: {r['failed']}")
    copies = max((r.get("weight_copies", 1) for r in rows), default=1)
    lines.append(
        f"weights: cold (each call reads the next of {copies} copies a shape at most)"
        if copies > 1
        else "weights: the same each call (may stay partly in L2)"
    )
    for tail in (False, True):
        sel = [r for r in rows if r["tail"] == tail and "fluxcompile" in r["ect_vs_nccl"]]
        if sel:
            small = [r["ect_vs_nccl"]["fluxcompile"] for r in sel if r["m"] <= 64]
            beats = sum(r["ect_us"]["fluxcompile"] < r["ect_us"].get("torch_one_shot", float("inf")) for r in sel)
            lines.append(
                f"{'with' if tail else 'without'} tail: ECT ours/NCCL for m <= 64: max "
                f"{max(small) if small else float('nan'):.0%}, mean {statistics.mean(small) if small else float('nan'):.0%} "
                f"(target <= 25%); below PyTorch one-shot at {beats} of {len(sel)} shapes"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold-weights", action="store_true", help="every call reads a weight not in L2 (copies)")
    args = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rows = bench(args)
    if dist.get_rank() == 0:
        print("== table (decode) ==\n" + table(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
