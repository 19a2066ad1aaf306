"""The MoE kernels (kernels/grouped_gemm.py) against torch, interleaved round after round.

    python benchmarks/moe.py [--layers mixtral,fine] [--rounds 10] [--out DIR]                  # (a) one GPU
    torchrun --nproc-per-node N benchmarks/moe.py --peers [--out DIR]                           # (b) N GPUs
    torchrun --nproc-per-node N benchmarks/moe.py --peers --vdev [--out DIR]                    # (b) + all_to_all_vdev
    TRITON_INTERPRET=1 python benchmarks/moe.py --smoke                                         # the script, on CPU

Layers (bf16): ``mixtral`` d 4096, FFN 14336, 8 experts, top-2, 4096 tokens per rank; ``fine`` d 2048, FFN 1408,
64 experts, top-6, 8192 tokens per rank. Routing ``balanced`` (each token's k experts uniform at random) or
``skewed`` (expert e drawn with weight 1 / (e + 1), a Zipf-like load: the first experts get most rows, the last
few almost none).

(a) One GPU, compute only, every expert local (E groups over tokens x k rows): the w1+w3 GEMM (one launch, two
weights sharing each A tile) against two ``torch._grouped_mm`` calls, and the w2 GEMM against one; weights stored
as torchtitan stores them ([E, N, K], used transposed). Every variant is swept with short timings; the best three
and the default are then timed in ``--rounds`` interleaved rounds with the baseline (medians; ratio = ours /
torch). Tables: ``x`` (rows already in the experts' order: the bar, within 5%), ``gather`` (rows picked through a
permutation: ours gathers in the mainloop, torch indexes first), ``kn`` (weights stored [E, K, N]). Each timed
configuration is checked against torch first (poisoned outputs, relative error).

(b) Several GPUs (torchrun), expert parallel over the group: experts split evenly over the ranks, every rank has
the layer's tokens; the dispatch (all_to_all_matmul with w1, w3, ``row_index`` and ``offs``, as the fx pass
rewrites torchtitan's layer) and the combine (matmul_all_to_all with w2) through the registered ``triton:<variant>``
choices (and ``cutlass:<variant>-pull<N>``: the CUTLASS dispatch without the exchanged rows, as a compiled layer
calls it, beside the default Triton combine) against their references (NCCL ``all_to_all_single`` + index + ``torch._grouped_mm``: the reference choice)
and, with ``--vdev``, against ``torch.ops.symm_mem.all_to_all_vdev`` (NVSHMEM backend) + index + grouped_mm where
the torch has it; beside them "compute only (no exchange)": the references' gathers, GEMMs and scatters alone, the
floor of any overlap built on torch's GEMMs (so (NCCL - compute only) / NCCL is the most that hiding the exchange
can save). Every rank draws the routing of every rank from one seed and checks that the ranks' split lists
describe one exchange (an error names the pairs that differ). Interleaved rounds behind a barrier, each rank's
median, the slowest rank reported; outputs checked against the references.

Writes ``moe-gemm.json``/``moe-gemm.txt`` (a) or ``moe-peers.json``/``moe-peers.txt`` (b) into ``--out`` and prints
the table after ``== moe table``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import statistics
import sys

import timing
import torch

from fluxcompile import config, ops
from fluxcompile.kernels import cutlass_grouped
from fluxcompile.kernels import grouped_gemm as gg
from fluxcompile.lowerings.all_to_all import cutlass as cutlass_moe
from fluxcompile.lowerings.all_to_all import triton as moe
from fluxcompile.symm_mem import Comm

CUTLASS = "cutlass:"  # the variants of the experts' CUTLASS grouped GEMM (kernels/cutlass_grouped.py), in (a)

LAYERS = {  # d, ffn, experts, top-k, tokens per rank
    "mixtral": (4096, 14336, 8, 2, 4096),
    "fine": (2048, 1408, 64, 6, 8192),
}
SMOKE_LAYERS = {"mixtral": (64, 96, 4, 2, 48), "fine": (32, 48, 8, 3, 64)}
DEVICE = "cuda"
DTYPE = torch.bfloat16


# --- helpers -----------------------------------------------------------------------------------------------------


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_us(fn, iters: int) -> float:
    return timing.time_us(fn, iters, cuda=DEVICE == "cuda")


def iters_for(flops: float) -> int:
    if DEVICE != "cuda":
        return 1
    est_us = flops / 700e12 * 1e6
    return max(2, min(50, int(3000 / max(est_us, 1))))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def routing(g: torch.Generator, tokens: int, experts: int, k: int, kind: str) -> torch.Tensor:
    """Expert ids ``[tokens, k]`` (distinct per token): uniform, or weighted 1 / (e + 1)."""
    w = torch.ones(experts) if kind == "balanced" else 1.0 / torch.arange(1, experts + 1, dtype=torch.float)
    return torch.multinomial(w.expand(tokens, experts), k, replacement=False, generator=g)


def weight(g, E: int, k: int, n: int, layout: str) -> torch.Tensor:
    """``[E, k, n]`` scaled by 1/sqrt(k): stored so (``kn``) or as ``[E, n, k]``, transposed (``nk``, torchtitan)."""
    if layout == "nk":
        w = (torch.randn(E, n, k, generator=g) / k**0.5).to(device=DEVICE, dtype=DTYPE)
        return w.transpose(1, 2)
    return (torch.randn(E, k, n, generator=g) / k**0.5).to(device=DEVICE, dtype=DTYPE)


def table_line(r: dict) -> str:
    dflt = f"  default x{r['default_ratio']:.3f}" if r.get("default_ratio") is not None else ""
    return (
        f"{r['table']:7s} {r['layer']:8s} {r['gemm']:5s} {r['routing']:9s} {r['rows']:7d} {r['torch_us']:10.1f} "
        f"{r['ours_us']:10.1f} {r['ratio']:6.3f}  [{r['variant']}]{dflt}  rel {r['rel_err']:.1e}"
    )


# --- (a) one GPU: the grouped GEMM alone --------------------------------------------------------------------------


class Gemm:
    """One grouped GEMM problem: ``X [R, K]`` (or ``a`` gathered through ``row_index``), weights, ``offs``."""

    def __init__(self, g, layer: str, gemm: str, kind: str, table: str):
        d, ffn, E, k, tokens = (SMOKE_LAYERS if DEVICE != "cuda" else LAYERS)[layer]
        self.layer, self.gemm, self.kind, self.table = layer, gemm, kind, table
        ids = routing(g, tokens, E, k, kind)
        sizes = torch.bincount(ids.reshape(-1), minlength=E)
        self.R = tokens * k
        self.offs = torch.cumsum(sizes, 0).to(device=DEVICE, dtype=torch.int32)
        K, N = (d, ffn) if gemm == "w13" else (ffn, d)
        layout = "kn" if table == "kn" else "nk"
        self.Bs = [weight(g, E, K, N, layout) for _ in range(2 if gemm == "w13" else 1)]
        self.a = torch.randn(self.R, K, generator=g).to(device=DEVICE, dtype=DTYPE)
        self.row_index = None
        if table == "gather":
            self.row_index = torch.randperm(self.R, generator=g).to(DEVICE)
        self.flops = 2.0 * self.R * K * N * len(self.Bs)

    def torch_fn(self):
        x = self.a if self.row_index is None else self.a[self.row_index]
        return [torch._grouped_mm(x, b, offs=self.offs) for b in self.Bs]

    def ours(self, variant: str):
        if variant.startswith(CUTLASS):  # the experts' CUTLASS grouped GEMM: one call per weight, rows in order
            if self.row_index is not None:
                raise ValueError("the CUTLASS grouped GEMM takes rows already in the experts' order")
            outs = [torch.empty(self.R, b.shape[2], device=DEVICE, dtype=DTYPE) for b in self.Bs]
            for b, out in zip(self.Bs, outs):
                cutlass_grouped.grouped_mm(self.a, b, self.offs, out, variant=variant[len(CUTLASS) :])
            return outs
        return gg.grouped_gemm(
            self.a, self.Bs, offs=self.offs, row_index=self.row_index, variant=variant, tma=DEVICE != "cuda" or None
        )

    def check(self, variant: str) -> float:
        if DEVICE == "cuda":
            poison = torch.empty(1 << 27, dtype=torch.bfloat16, device="cuda")
            poison.fill_(float("nan"))
            del poison
        outs, refs = self.ours(variant), self.torch_fn()
        return max(rel_err(o, r) for o, r in zip(outs, refs))


def sweep(p: Gemm, variants: list[str], keep: int) -> list[str]:
    """The ``keep`` fastest variants by a short timing, plus the default if it is not among them (last)."""
    it = max(1, iters_for(p.flops) // 2)
    timed = []
    for v in variants:
        try:
            p.ours(v)
            timed.append((time_us(lambda v=v: p.ours(v), it), v))
        except Exception as e:  # a variant that cannot run this problem (compile error, resources)
            print(f"   skip {v}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    timed.sort()
    out = [v for _, v in timed[:keep]]
    if gg.DEFAULT not in out and any(v == gg.DEFAULT for _, v in timed):
        out.append(gg.DEFAULT)
    return out


def interleaved(p: Gemm, cands: list[str], rounds: int) -> tuple[float, list[float]]:
    it = iters_for(p.flops)
    p.torch_fn()
    for c in cands:
        p.ours(c)
    base, ours = [], [[] for _ in cands]
    for _ in range(rounds):
        base.append(time_us(p.torch_fn, it))
        for i, c in enumerate(cands):
            ours[i].append(time_us(lambda c=c: p.ours(c), it))
    return statistics.median(base), [statistics.median(o) for o in ours]


def one_gpu(args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    variants = args.variants.split(",") if args.variants else list(gg.VARIANTS)
    if not args.variants and DEVICE == "cuda" and cutlass_grouped.unavailable() is None:
        variants += [CUTLASS + v for v in cutlass_grouped.GROUPED_VARIANTS]
    rows = []
    tables = ["x", *[t for t in args.tables.split(",") if t]]
    for table in tables:
        for layer in args.layers.split(","):
            for gemm in ("w13", "w2"):
                for kind in ("balanced", "skewed"):
                    p = Gemm(g, layer, gemm, kind, table)
                    cands = sweep(p, variants, 3)
                    errs = {c: p.check(c) for c in cands}
                    bad = {c: e for c, e in errs.items() if not e < 2e-2}
                    if bad:
                        print(f"   WRONG results {layer} {gemm} {kind} {table}: {bad}", flush=True)
                    cands = [c for c in cands if c not in bad]
                    if not cands:
                        continue
                    base, ours = interleaved(p, cands, args.rounds)
                    i = min(range(len(cands)), key=lambda j: ours[j])
                    d = cands.index(gg.DEFAULT) if gg.DEFAULT in cands else None
                    row = dict(
                        table=table, layer=layer, gemm=gemm, routing=kind, rows=p.R, torch_us=base, ours_us=ours[i],
                        ratio=ours[i] / base, variant=cands[i], rel_err=errs[cands[i]],
                        default_ratio=ours[d] / base if d is not None else None,
                        others={c: o / base for c, o in zip(cands, ours)},
                    )  # fmt: skip
                    rows.append(row)
                    print("   " + table_line(row), flush=True)
                    del p
    return rows


# --- (b) several GPUs: the fused ops against NCCL (and all_to_all_vdev) -------------------------------------------


class EpLayer:
    """This rank's share of an expert-parallel MoE layer: routing of every rank's tokens (``g``, seeded alike on
    every rank), this rank's sorted token copies ``A``, split sizes, the permutation and group ends of what it
    receives.

    ``g`` gives the same draws on every rank, layer after layer: the routing, and one seed. This rank's tensors
    (``h`` has as many rows as the rank receives) come from a generator of its own, seeded from it and the rank."""

    def __init__(self, g, layer: str, kind: str, rank: int, world: int):
        d, ffn, E, k, tokens = (SMOKE_LAYERS if DEVICE != "cuda" else LAYERS)[layer]
        if E % world:
            raise ValueError(f"{E} experts do not split over {world} ranks")
        EL = E // world
        self.layer, self.kind, self.d, self.ffn, self.EL = layer, kind, d, ffn, EL
        # counts[s, e]: token copies of rank s for expert e (global ids), from every rank's routing
        counts = torch.stack([torch.bincount(routing(g, tokens, E, k, kind).reshape(-1), minlength=E)
                              for _ in range(world)])  # fmt: skip
        own = torch.Generator().manual_seed(int(torch.randint(1 << 62, (1,), generator=g)) + rank)
        self.send = counts[rank].view(world, EL).sum(1).tolist()  # rows to each rank
        recv_counts = counts[:, rank * EL : (rank + 1) * EL]  # [source, local expert]
        self.recv = recv_counts.sum(1).tolist()
        n = sum(self.recv)
        self.row_index = permute_indices(recv_counts, n).to(DEVICE)
        self.offs = torch.cumsum(recv_counts.sum(0), 0).to(device=DEVICE, dtype=torch.int32)
        self.A = torch.randn(tokens * k, d, generator=own).to(device=DEVICE, dtype=DTYPE)
        self.w = [weight(own, EL, d, ffn, "nk") for _ in range(2)]
        self.w2 = weight(own, EL, ffn, d, "nk")
        self.h = torch.randn(n, ffn, generator=own).to(device=DEVICE, dtype=DTYPE)
        self.flops_d = 2.0 * n * d * ffn * 2
        self.flops_c = 2.0 * n * d * ffn


def ep_layers(layers: list[str], rank: int, world: int, routings: tuple[str, ...] = ("balanced", "skewed")):
    """This rank's ``EpLayer`` of every layer, balanced then skewed, in the order (b) runs them. Routings not asked
    for are drawn too, so a layer's routing is the same whichever routings a run times."""
    g = torch.Generator().manual_seed(1234)  # the same routing on every rank
    for layer in layers:
        for kind in ("balanced", "skewed"):
            L = EpLayer(g, layer, kind, rank, world)
            if kind in routings:
                yield L
            del L


def layer_iters(L: EpLayer, recvs: list[list[int]]) -> tuple[int, int]:
    """Timed iterations of the dispatch and the combine, from the rank that receives the most rows: the same on
    every rank (each iteration is a collective call; ranks timing different counts would wait for each other)."""
    scale = max(map(sum, recvs)) / max(sum(L.recv), 1)
    return iters_for(L.flops_d * scale), iters_for(L.flops_c * scale)


def split_mismatch(sends: list[list[int]], recvs: list[list[int]]) -> str | None:
    """Where the ranks' split lists do not describe one exchange (rank s sends rank r ``sends[s][r]`` rows, rank r
    expects ``recvs[r][s]`` from s), or None."""
    world = len(sends)
    bad = [f"rank {s} sends rank {r} {sends[s][r]} rows, rank {r} expects {recvs[r][s]}"
           for s in range(world) for r in range(world) if sends[s][r] != recvs[r][s]]  # fmt: skip
    return "; ".join(bad) or None


def permute_indices(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows received ``[source][local expert]`` -> ``[local expert][source]`` (models/moe.py's)."""
    from fluxcompile.models.moe import permute_indices as pi

    return pi(counts, total)


def _dispatch_args(L: EpLayer, group_name: str) -> tuple:
    return (L.A, L.w, [None, None], L.recv, L.send, group_name, None, None, None, False, L.offs, L.row_index)


def _combine_args(L: EpLayer, group_name: str) -> tuple:
    y = sum(L.recv)
    return ([L.h], [L.w2], None, [y, L.d], L.send, L.recv, group_name, None, None, None, False, L.offs, L.row_index,
            False)  # fmt: skip


COMPUTE = "compute only (no exchange)"


def compute_only(L: EpLayer, a_ex: torch.Tensor):
    """(dispatch, combine) of the references' local work alone: the dispatch's row gather and expert GEMMs on the
    rows NCCL delivered (``a_ex``), the combine's expert GEMM and row scatter before its exchange. Their time is the
    floor of any overlap built on torch's GEMMs."""
    k = a_ex.shape[-1]
    y = sum(L.recv)

    def dispatch():
        x = ops.gather_rows(a_ex.reshape(-1, k), L.row_index)
        return a_ex, [ops.expert_matmul(x, w, None, L.offs) for w in L.w]

    def combine():
        p = ops.expert_matmul(L.h, L.w2, None, L.offs)
        return ops.scatter_rows(p, L.row_index, y, False).view(y, L.d)

    return dispatch, combine


class Vdev:
    """NCCL's role played by ``torch.ops.symm_mem.all_to_all_vdev`` (NVSHMEM): symmetric input, output and split
    buffers sized for the worst case, the rows copied in and viewed out."""

    def __init__(self, L: EpLayer, group_name: str, world: int):
        import torch.distributed._symmetric_memory as symm

        d, ffn = L.d, L.ffn
        rows = L.A.shape[0]
        self.world, self.group = world, group_name
        self.inp = symm.empty(rows * max(d, ffn), dtype=DTYPE, device=DEVICE)
        self.out = symm.empty(world * rows * max(d, ffn), dtype=DTYPE, device=DEVICE)
        self.in_splits = symm.empty(world, dtype=torch.int64, device=DEVICE)
        self.out_so = symm.empty((2, world), dtype=torch.int64, device=DEVICE)
        for t in (self.inp, self.out, self.in_splits, self.out_so):
            symm.rendezvous(t, group_name)
        self.splits_d = torch.tensor([s * d for s in L.send], dtype=torch.int64, device=DEVICE)
        self.splits_c = torch.tensor([s * d for s in L.recv], dtype=torch.int64, device=DEVICE)
        self.L = L

    def exchange(self, x: torch.Tensor, splits: torch.Tensor, rows_out: int) -> torch.Tensor:
        self.inp[: x.numel()].copy_(x.reshape(-1))
        self.in_splits.copy_(splits)
        torch.ops.symm_mem.all_to_all_vdev(self.inp, self.out, self.in_splits, self.out_so, self.group)
        return self.out[: rows_out * x.shape[-1]].view(rows_out, x.shape[-1])

    def dispatch(self):
        L = self.L
        a_ex = self.exchange(L.A, self.splits_d, sum(L.recv))
        x = ops.gather_rows(a_ex, L.row_index)
        return a_ex, [torch._grouped_mm(x, w, offs=L.offs) for w in L.w]

    def combine(self):
        L = self.L
        p = torch._grouped_mm(L.h, L.w2, offs=L.offs)
        y = ops.scatter_rows(p, L.row_index, sum(L.recv), False)
        return self.exchange(y, self.splits_c, L.A.shape[0]).clone()


_smoke_comms: dict[str, Comm] = {}


def _choices(name: str, world: int):
    """The registered choices' functions of ``triton:<name>`` (with --smoke: the protocols over a one-rank CPU
    stand-in of symmetric memory, the same code below the ``Comm``)."""
    if DEVICE == "cuda":
        return moe.make_dispatch(name)[0], moe.make_combine(moe.tile_variant(name))[0]
    from fluxcompile.testing.one_gpu_ranks import OneGpuRanks

    if not _smoke_comms:
        for tag in ("d", "c"):
            r = OneGpuRanks(1, 1 << 20, gg.FLAG_BYTES, tag=tag, device="cpu")
            _smoke_comms[tag] = Comm(
                data=r.data.ranks[0], flags=r.flags.ranks[0], errors=moe.make_errors(torch.device("cpu")),
                group_name="smoke", sm_count=1, init_flags=r.init_flags, max_spin=10_000,
            )  # fmt: skip

    def run_d(A, Bs, biases, out_splits, in_splits, group, *rest):
        offs, row_index = rest[4], rest[5]
        return moe.all_to_all_matmul_on(_smoke_comms["d"], A, Bs, out_splits, in_splits, offs, row_index, variant=name)

    def run_c(As, Bs, bias, out_shape, out_splits, in_splits, group, *rest):
        offs, row_index, acc = rest[4], rest[5], rest[6]
        return moe.matmul_all_to_all_on(
            _smoke_comms["c"], As[0], Bs[0], out_shape, out_splits, in_splits, offs, row_index, acc,
            variant=moe.tile_variant(name),
        )  # fmt: skip

    return run_d, run_c


BEST = "best per op (autotuned)"


def layer_sums(rows: list[dict]) -> list[dict]:
    """Per layer and routing: each candidate's dispatch + combine, and ``BEST``, the fastest of NCCL and the fused
    (``triton:``) choices for each op (what a compiled layer runs; never the compute-only bound or all_to_all_vdev);
    ratios against NCCL's sum."""
    out = []
    for layer, routing in dict.fromkeys((r["layer"], r["routing"]) for r in rows):
        us = {}
        for r in rows:
            if (r["layer"], r["routing"]) == (layer, routing):
                us.setdefault(r["candidate"], {})[r["op"]] = r["us"]
        whole = {c: t["dispatch"] + t["combine"] for c, t in us.items() if {"dispatch", "combine"} <= set(t)}
        runnable = [c for c in us if c == "nccl" or c.startswith(("triton:", CUTLASS))]
        whole[BEST] = sum(min(us[c][op] for c in runnable if op in us[c]) for op in ("dispatch", "combine"))
        for c, t in whole.items():
            out.append(dict(layer=layer, routing=routing, candidate=c, us=t, ratio=t / whole["nccl"]))
    return out


def progress(what: str) -> None:
    """Rank 0's step, on stderr (where a hang stopped; the table goes to stdout)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"   .. {what}", file=sys.stderr, flush=True)


def peers(args) -> list[dict]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    vdev_ok = None
    if args.vdev:
        vdev_ok = hasattr(torch.ops.symm_mem, "all_to_all_vdev") or "no torch.ops.symm_mem.all_to_all_vdev"
    variants = args.peer_variants.split(",")
    rows = []
    for L in ep_layers(args.layers.split(","), rank, world, tuple(args.routings.split(","))):
        layer, kind = L.layer, L.kind
        lists = [None] * world
        dist.all_gather_object(lists, (L.send, L.recv))  # every rank sees every list: one verdict
        why = split_mismatch([s for s, _ in lists], [r for _, r in lists])
        if why:
            raise RuntimeError(f"benchmarks/moe.py: {layer} {kind}: the ranks' split sizes disagree: {why}")
        dargs, cargs = _dispatch_args(L, group), _combine_args(L, group)
        cands = {
            "nccl": (
                lambda da=dargs: ops.REFERENCES["all_to_all_matmul"](*da),
                lambda ca=cargs: ops.REFERENCES["matmul_all_to_all"](*ca),
            )
        }
        ref_d, ref_c = cands["nccl"][0](), cands["nccl"][1]()
        if vdev_ok is True and DEVICE == "cuda":
            try:
                v = Vdev(L, group, world)
                got_d, got_c = v.dispatch(), v.combine()
                if not torch.equal(got_d[0], ref_d[0]) or rel_err(got_c, ref_c) > 2e-2:
                    raise RuntimeError("all_to_all_vdev results differ from NCCL's")
                cands["vdev"] = (v.dispatch, v.combine)
            except Exception as e:
                vdev_ok = f"{type(e).__name__}: {str(e)[:200]}"
        for name in variants:
            if name.startswith(CUTLASS):  # the CUTLASS dispatch, as a compiled layer calls it (return_A False)
                run_d, run_c = cutlass_moe.make(name[len(CUTLASS) :])[0], moe.make_combine(gg.DEFAULT)[0]
                cands[name] = (lambda r=run_d, da=dargs: r(*da, return_A=False), lambda r=run_c, ca=cargs: r(*ca))
                continue
            run_d, run_c = _choices(name, world)
            cands[f"triton:{name}"] = (lambda r=run_d, da=dargs: r(*da), lambda r=run_c, ca=cargs: r(*ca))
        errs = {}
        for name, (fd, fc) in cands.items():
            progress(f"{layer} {kind}: checking {name}")
            a_ex, outs = fd()
            out = fc()
            exact = a_ex is None or torch.equal(a_ex, ref_d[0])  # None: not asked for (the products are checked)
            e = max([rel_err(o, r) for o, r in zip(outs, ref_d[1])] + [rel_err(out, ref_c)])
            errs[name] = e if exact else float("inf")
        # The bound: the reference's local work alone (no exchange), what no overlap can beat with torch's GEMMs.
        cd, cc = compute_only(L, ref_d[0])
        errs[COMPUTE] = max(rel_err(o, r) for o, r in zip(cd()[1], ref_d[1]))
        cands[COMPUTE] = (cd, cc)
        exchanged = torch.empty_like(ref_c)
        dist.all_to_all_single(exchanged, cc(), L.send, L.recv)
        errs[COMPUTE] = max(errs[COMPUTE], rel_err(exchanged, ref_c))
        sync()
        times = {(name, op): [] for name in cands for op in ("dispatch", "combine")}
        it_d, it_c = layer_iters(L, [r for _, r in lists])
        for rd in range(args.rounds):
            for name, (fd, fc) in cands.items():
                for op, fn, it in (("dispatch", fd, it_d), ("combine", fc, it_c)):
                    progress(f"{layer} {kind}: round {rd}, {op} {name} x{it}")
                    dist.barrier()
                    times[(name, op)].append(time_us(fn, it))
        med = torch.tensor([statistics.median(times[key]) for key in times], dtype=torch.float64, device=DEVICE)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank is what the step waits for
        errt = torch.tensor([errs[n] for n in cands], dtype=torch.float64, device=DEVICE)
        dist.all_reduce(errt, op=dist.ReduceOp.MAX)
        for (name, op), us in zip(times, med.tolist()):
            base = med.tolist()[list(times).index(("nccl", op))]
            row = dict(layer=layer, routing=kind, op=op, world=world, candidate=name, us=us, ratio=us / base,
                       rel_err=float(errt[list(cands).index(name)]), rows_recv=sum(L.recv))  # fmt: skip
            rows.append(row)
            if rank == 0:
                print(f"   {layer:8s} {kind:9s} {op:8s} {name:32s} {us:10.1f} us  x{us / base:.3f} vs NCCL  "
                      f"rel {row['rel_err']:.1e}", flush=True)  # fmt: skip
        del L
    if rank == 0 and args.vdev:
        print(f"   all_to_all_vdev: {'timed' if vdev_ok is True else vdev_ok}", flush=True)
    return rows


# --- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    global DEVICE, DTYPE
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="mixtral,fine")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--routings", default="balanced,skewed", help="(b): which routings to time")
    ap.add_argument("--variants", default="", help="(a): comma-separated subset of VARIANTS (default: all)")
    ap.add_argument("--tables", default="gather,kn", help="(a): secondary tables beside 'x' ('' for none)")
    ap.add_argument("--peers", action="store_true", help="(b): under torchrun, the fused ops against NCCL")
    ap.add_argument("--vdev", action="store_true", help="(b): also torch.ops.symm_mem.all_to_all_vdev (NVSHMEM)")
    ap.add_argument(
        "--peer-variants",
        default=f"{gg.DEFAULT},{gg.DEFAULT}{moe.SPLIT},128x256x64-w8s3,{CUTLASS}128x128x64_c1x2_pp-pull16,"
        f"{CUTLASS}128x256x64_c2x1-pull16",
        help="(b): triton variants, and cutlass:<variant>-pull<N> (the CUTLASS dispatch with the Triton combine)",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny sizes: the script only")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    if args.smoke:
        DEVICE, DTYPE = "cpu", torch.float16  # the interpreter's tl.dot is wrong in bf16
        args.rounds = min(args.rounds, 2)
        gg.VARIANTS["smoke"] = gg.Variant((16, 32, 16), num_warps=4, num_stages=2)
        gg.DEFAULT = "smoke"
        args.variants = "smoke"
        args.peer_variants = "smoke,smoke-split"
    os.makedirs(args.out, exist_ok=True)
    lines = []
    if args.peers:
        import torch.distributed as dist

        # torchrun ends a hung step with SIGTERM: every worker prints where it waits first.
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

        if DEVICE == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            if args.vdev:
                try:
                    import torch.distributed._symmetric_memory as symm

                    symm.set_backend("NVSHMEM")
                except Exception as e:
                    print(f"   NVSHMEM backend: {type(e).__name__}: {e}", flush=True)
        else:
            dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29533")
        name = "moe-peers"
        with config.patch(implementations=("+moe",)):
            rows = peers(args)
        if dist.get_rank() == 0:
            lines.append(f"== moe table (ranks {dist.get_world_size()}, slowest rank's median, ratio vs NCCL)")
            for r in rows:
                lines.append(f"{r['layer']:8s} {r['routing']:9s} {r['op']:8s} {r['candidate']:32s} {r['us']:10.1f} "
                             f"x{r['ratio']:.3f}  rel {r['rel_err']:.1e}")  # fmt: skip
            lines.append("== moe layers (dispatch + combine, ratio vs NCCL)")
            lines += [f"{s['layer']:8s} {s['routing']:9s} {s['candidate']:32s} {s['us']:10.1f} x{s['ratio']:.3f}"
                      for s in layer_sums(rows)]  # fmt: skip
        dist.destroy_process_group()
        if rows and int(os.environ.get("RANK", "0")) == 0:
            _write(args.out, name, rows, lines)
        return
    print(f"== device {_device()}, torch {torch.__version__}, variants {list(gg.VARIANTS)}", flush=True)
    rows = one_gpu(args)
    lines.append("== moe table (median of interleaved rounds; ratio = ours / torch._grouped_mm)")
    head = f"{'table':7s} {'layer':8s} {'gemm':5s} {'routing':9s} {'rows':>7s} {'torch us':>10s} {'ours us':>10s}"
    lines.append(f"{head} {'ratio':>6s}  variant")
    lines += [table_line(r) for r in rows]
    for table in dict.fromkeys(r["table"] for r in rows):
        rs = [r["ratio"] for r in rows if r["table"] == table]
        ds = [r["default_ratio"] for r in rows if r["table"] == table and r["default_ratio"] is not None]
        gm = math.exp(sum(map(math.log, rs)) / len(rs))
        dflt = f"; default {gg.DEFAULT}: geomean {math.exp(sum(map(math.log, ds)) / len(ds)):.3f}" if ds else ""
        lines.append(f"geomean {table}: {gm:.3f}  worst {max(rs):.3f}  ({len(rs)} shapes){dflt}")
    _write(args.out, "moe-gemm", rows, lines)


def _device() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"


def _write(out: str, name: str, rows: list[dict], lines: list[str]) -> None:
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    with open(os.path.join(out, f"{name}.txt"), "w") as f:
        f.write(f"device {_device()}, torch {torch.__version__}\n{text}\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(dict(device=_device(), torch=torch.__version__, rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
