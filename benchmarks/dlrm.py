"""The DLRM kernel (kernels/embedding_bag.py) against torch's embedding_bag, interleaved round after round.

    python benchmarks/dlrm.py [--dtypes fp32,bf16] [--rounds 10] [--out DIR]               # (a) one GPU, pooling
    torchrun --nproc-per-node N benchmarks/dlrm.py --peers [--out DIR]                     # (b) N GPUs, the op
    torchrun --nproc-per-node N benchmarks/dlrm.py --peers --training [--put] [--out DIR]  # (c) N GPUs, training

(a) One GPU, pooling only, as one rank pools it: the DLRM of 4096 samples per rank, tables of 1M x 128 rows, 32
lookups per bag (uniform random indices, int64), sum; shapes: world 1 (32 tables, 4096 bags) and the TP=8 rank (4
local tables, 4096 x 8 bags). Ours: the choice's one-rank path (``embedding_bag_all_to_all_on(None, ...)``: one
launch for all tables, the output allocated per call, as the op does), every variant swept with short timings, then
the best three and the default timed in interleaved rounds with the baselines: ``F.embedding_bag`` per table (the
outputs left apart: the bar), the same + ``torch.cat`` (what the op's reference computes), ``nn.EmbeddingBag`` per
table. Medians; the ratio is ours / the fastest baseline. Correctness first: every variant against torch (sum and
mean, both include_last_offset, ragged bags), then each timed shape's output.

(b) Several GPUs: every rank pools the global batch (4096 x world) for its 32 / world tables, batch chunk r goes to
rank r: the fused choice (``triton:<variant>``, symmetric memory) against embedding_bag + cat + NCCL
``all_to_all_single``, interleaved, medians of each rank, the slowest rank reported; outputs compared.

(c) Several GPUs, the training step's embedding stage (forward + backward) as (b) lays it out, sum pooling, the
pooled rows' gradients random: ``nccl`` (what ``nn.EmbeddingBag`` + ``all_to_all_single`` run: aten's
``_embedding_bag`` per table, ``cat``, NCCL all-to-all; NCCL all-to-all of the gradients, aten's dense
``_embedding_bag_backward`` per table), ``unfused`` (our kernels beside NCCL: the pooling kernel and the scatter
of one rank, each NCCL all-to-all apart), ``fused`` (both fused ops, the forward with the bookkeeping a training
graph's rewrite asks of it), ``fused-nobook`` (the same without it).
Gradients compared with ``nccl``'s. Bar: fused <= 0.7 x nccl and < unfused at every world size.

Writes ``dlrm-pool.json`` / ``dlrm-peers.json`` / ``dlrm-training-w<N>.json`` and a readable ``.txt`` of each into
``--out``, and prints the table after ``== dlrm table``. (c) takes ``--rows`` 131072 unless given: the dense
gradients' zero fill of 1M-row tables would be most of what it times.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import time

import timing
import torch
import torch.nn.functional as F

from fluxcompile import config, ops
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import embedding_bag as eb
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import triton as lo_bw
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo

ROWS, DIM, LOOKUPS, BATCH, TABLES = 1 << 20, 128, 32, 4096, 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The sweep: bags per program x positions per step x warps (rows in flight per program: block_b x unroll).
SWEEP = {
    eb.name_of(v): v
    for v in (eb.Variant(b, u, w) for b, u, w in itertools.product((2, 4, 8, 16, 32), (2, 4, 8), (4, 8)))
    if 16 <= v.block_b * v.unroll <= 128 and 32 <= v.block_b * v.unroll * DIM // (32 * v.num_warps) <= 128
}
SWEEP.update(eb.VARIANTS)


DEVICE = "cuda"  # --smoke: "cpu" (Triton's interpreter, tiny sizes: the script's own check, no timing meaning)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"


def time_us(fn, iters: int) -> float:
    return timing.time_us(fn, iters, cuda=DEVICE == "cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    err = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    return err if err == err else float("inf")


class Problem:
    """One rank's pooling: ``tables`` of ``weights`` (views of one allocation), ``bags`` bags of ``LOOKUPS``."""

    def __init__(self, weights: list[torch.Tensor], bags: int, g: torch.Generator, lookups: int = LOOKUPS):
        self.weights, self.bags = weights, bags
        dev = weights[0].device
        n = bags * lookups
        self.indices = [torch.randint(0, w.shape[0], (n,), generator=g).to(dev) for w in weights]
        self.offsets = [torch.arange(0, n, lookups, device=dev) for _ in weights]
        # nn.EmbeddingBag over the same storage (from_pretrained wraps the tensor, no copy)
        self.modules = [torch.nn.EmbeddingBag.from_pretrained(w, freeze=True, mode="sum") for w in weights]
        self.out_shape = [bags, len(weights) * weights[0].shape[1]]

    def ours(self, variant: str, mode: int = 0) -> torch.Tensor:
        return lo.embedding_bag_all_to_all_on(
            None, self.weights, self.indices, self.offsets, mode, False, self.out_shape, [], [], variant=SWEEP[variant]
        )

    def torch_loop(self) -> list[torch.Tensor]:
        return [F.embedding_bag(i, w, o, mode="sum") for w, i, o in zip(self.weights, self.indices, self.offsets)]

    def torch_cat(self) -> torch.Tensor:
        return torch.cat(self.torch_loop(), dim=1)

    def torch_modules(self) -> list[torch.Tensor]:
        return [m(i, o) for m, i, o in zip(self.modules, self.indices, self.offsets)]

    def bytes_moved(self) -> int:
        w = self.weights[0]
        return len(self.weights) * self.bags * (LOOKUPS * w.shape[1] * w.element_size() + w.shape[1] * w.element_size())

    def iters(self) -> int:
        if DEVICE != "cuda":
            return 1
        est_us = self.bytes_moved() / 2.5e12 * 1e6
        return max(3, min(50, int(20000 / max(est_us, 1))))


def correctness(dtype: torch.dtype, g: torch.Generator) -> list[str]:
    """Every sweep variant against torch on small ragged tables (sum and mean, include_last_offset both ways)."""
    lines = []
    weights = [torch.randn(n, DIM, generator=g).to(DEVICE, dtype) for n in (1000, 3000, 77)]
    bags = 513 if DEVICE == "cuda" else 9
    lens = torch.randint(0, 40 if DEVICE == "cuda" else 6, (len(weights), bags), generator=g)
    lens[:, :3] = 0
    indices, offsets = [], []
    for t, w in enumerate(weights):
        o = torch.cat([torch.zeros(1, dtype=torch.long), lens[t].cumsum(0)])
        indices.append(torch.randint(0, w.shape[0], (int(o[-1]),), generator=g).to(DEVICE))
        offsets.append(o.to(DEVICE))
    worst = 0.0
    for v in SWEEP.values():
        for mode, last in ((0, False), (1, True), (0, True)):
            offs = offsets if last else [o[:-1] for o in offsets]
            want = ops.pooled_rows([w.float() for w in weights], indices, offs, mode, last)
            got = lo.embedding_bag_all_to_all_on(
                None, weights, indices, offs, mode, last, [bags, len(weights) * DIM], [], [], variant=v
            )
            worst = max(worst, rel(got, want))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    lines.append(f"{'ok ' if worst <= tol else 'BAD'} {len(SWEEP)} variants {str(dtype)[6:]}: worst rel {worst:.1e}")
    if worst > tol:
        raise SystemExit("\n".join(lines))
    return lines


def sweep(p: Problem, keep: int) -> list[str]:
    it = max(2, p.iters() // 3)
    timed = []
    for name in SWEEP:
        p.ours(name)
        timed.append((time_us(lambda name=name: p.ours(name), it), name))
    timed.sort()
    cands = [n for _, n in timed[:keep]]
    if eb.DEFAULT not in cands:
        cands.append(eb.DEFAULT)
    return cands


def interleaved(p: Problem, cands: list[str], rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    it = p.iters()
    base_fns = {"embedding_bag": p.torch_loop, "embedding_bag+cat": p.torch_cat, "nn.EmbeddingBag": p.torch_modules}
    for f in base_fns.values():
        f()
    for c in cands:
        p.ours(c)
    base = {k: [] for k in base_fns}
    ours = {c: [] for c in cands}
    for _ in range(rounds):
        for k, f in base_fns.items():
            base[k].append(time_us(f, it))
        for c in cands:
            ours[c].append(time_us(lambda c=c: p.ours(c), it))
    return {k: statistics.median(v) for k, v in base.items()}, {c: statistics.median(v) for c, v in ours.items()}


def host_us(fn, n: int = 100) -> float:
    """Host µs per call (the time to enqueue it) over ``n`` back-to-back calls, after one call."""
    fn()
    _sync()
    us = timing.time_us(fn, n, cuda=False)
    _sync()
    return us


def pool_main(args) -> None:
    g = torch.Generator().manual_seed(0)
    rows, lines = [], []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"== device {_device_name()} torch {torch.__version__}")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        say(f"== correctness {dname}")
        for line in correctness(dtype, g):
            say(line)
        t0 = time.time()
        store = torch.empty(TABLES, args.rows, DIM, dtype=dtype, device=DEVICE)
        for t in range(TABLES):
            store[t].normal_()
        weights = list(store.unbind(0))
        say(f"== {TABLES} tables of {args.rows} x {DIM} {dname} ({store.numel() * store.element_size() / 2**30:.1f} GiB,"
            f" {time.time() - t0:.1f} s)")  # fmt: skip
        shapes = [("world1", weights, args.batch), ("tp8-rank", weights[: TABLES // 8], args.batch * 8)]
        for label, ws, bags in shapes:
            p = Problem(ws, bags, g)
            cands = sweep(p, 3)
            err = rel(p.ours(cands[0]), p.torch_cat())
            err_default = rel(p.ours(eb.DEFAULT), p.torch_cat())
            base, ours = interleaved(p, cands, args.rounds)
            host_ours = host_us(functools.partial(p.ours, min(ours, key=ours.get)))
            host_torch = host_us(p.torch_loop)
            best_base = min(base, key=base.get)
            best = min(ours, key=ours.get)
            row = dict(
                dtype=dname, shape=label, tables=len(ws), bags=bags, rows=args.rows, dim=DIM, lookups=LOOKUPS,
                baselines_us=base, baseline=best_base, baseline_us=base[best_base], ours_us=ours, best=best,
                best_us=ours[best], ratio=ours[best] / base[best_base], default_us=ours[eb.DEFAULT],
                default_ratio=ours[eb.DEFAULT] / base[best_base], rel_err=err, rel_err_default=err_default,
                best_tbps=p.bytes_moved() / ours[best] / 1e6, baseline_tbps=p.bytes_moved() / base[best_base] / 1e6,
                host_us_ours=host_ours, host_us_torch=host_torch,
                candidates=cands,
            )  # fmt: skip
            rows.append(row)
            say(f"   {dname} {label}: T={len(ws)} B={bags}: torch {base[best_base]:8.1f} us ({best_base})  ours "
                f"{ours[best]:8.1f} us x{row['ratio']:.3f} [{best}]  default x{row['default_ratio']:.3f}  "
                f"rel {err:.1e}")  # fmt: skip
            del p
        del weights, store
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    say("\n== dlrm table (pooling on one GPU; median of interleaved rounds; ratio = ours / fastest torch)")
    say(f"{'dtype':5s} {'shape':9s} {'T':>3s} {'bags':>6s} {'torch us':>9s} {'baseline':17s} {'ours us':>9s} "
        f"{'ratio':>6s} {'default':>7s} {'TB/s':>5s} {'host us':>13s}  best")  # fmt: skip
    for r in rows:
        say(f"{r['dtype']:5s} {r['shape']:9s} {r['tables']:3d} {r['bags']:6d} {r['baseline_us']:9.1f} "
            f"{r['baseline']:17s} {r['best_us']:9.1f} {r['ratio']:6.3f} {r['default_ratio']:7.3f} "
            f"{r['best_tbps']:5.2f} {r['host_us_ours']:6.1f}/{r['host_us_torch']:6.1f}  {r['best']}")  # fmt: skip
    bar = all(r["ratio"] <= 1.05 for r in rows)
    say(f"bar (ours within 5% of torch on every shape): {'met' if bar else 'NOT met'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dlrm-pool.json"), "w") as f:
        json.dump(dict(device=_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "dlrm-pool.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


# --- (b) several GPUs ---------------------------------------------------------------------------------------------


def _start_peers() -> tuple:
    """This process's NCCL rank of torchrun's group: (dist, group, world, rank, lines, say), ``say`` printing on
    rank 0 and keeping its lines for the .txt."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    lines: list[str] = []

    def say(s: str) -> None:
        if rank == 0:
            print(s, flush=True)
            lines.append(s)

    return dist, dist.group.WORLD, world, rank, lines, say


def _local_tables(tables: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``tables`` random tables of ``rows`` x ``DIM`` on the GPU, one allocation."""
    store = torch.empty(tables, rows, DIM, dtype=dtype, device="cuda")
    for t in range(tables):
        store[t].normal_()
    return store


def peers_main(args) -> None:
    dist, group, world, rank, lines, say = _start_peers()
    rows = []
    say(f"== {world} x {torch.cuda.get_device_name()} torch {torch.__version__}")
    g = torch.Generator().manual_seed(rank)
    with config.patch(implementations=IMPLEMENTATIONS):  # every family, dlrm among them
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            t_local = max(1, TABLES // world)
            store = _local_tables(t_local, args.rows, dtype)
            bags = args.batch * world
            p = Problem(list(store.unbind(0)), bags, g)
            out_shape = p.out_shape

            def fused(variant, p=p, out_shape=out_shape):
                return lo.embedding_bag_all_to_all(
                    p.weights, p.indices, p.offsets, 0, False, out_shape, [], [], group.group_name,
                    variant=SWEEP.get(variant) or eb.VARIANTS[variant],
                )

            def baseline(p=p):
                P = p.torch_cat()
                out = torch.empty_like(P)
                dist.all_to_all_single(out, P, group=group)
                return out

            variants = [eb.DEFAULT, *[v for v in args.variants.split(",") if v and v != eb.DEFAULT]]
            for v in variants:
                err = rel(fused(v), baseline())
                if err > (1e-5 if dtype == torch.float32 else 1e-2):
                    raise SystemExit(f"rank {rank}: {v} differs from the baseline: rel {err:.2e}")
            it = p.iters()
            fns = {"nccl": baseline, **{f"triton:{v}": (lambda v=v: fused(v)) for v in variants}}
            samples = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    dist.barrier(group=group)
                    samples[k].append(time_us(f, it))
            med = {k: statistics.median(v) for k, v in samples.items()}
            gathered: list = [None] * world
            dist.all_gather_object(gathered, med, group=group)
            worst = {k: max(m[k] for m in gathered) for k in fns}
            row = dict(dtype=dname, world=world, tables_per_rank=t_local, bags=bags, rows=args.rows, us=worst)
            rows.append(row)
            say(f"   {dname}: " + "  ".join(f"{k} {v:8.1f} us" for k, v in worst.items()))
            del p, store
            torch.cuda.empty_cache()
    say(f"\n== dlrm table ({world} GPUs: the slowest rank's median; ratio = fused / embedding_bag + NCCL)")
    for r in rows:
        base = r["us"]["nccl"]
        say(f"{r['dtype']:5s} T/rank={r['tables_per_rank']:3d} bags={r['bags']:6d} nccl {base:9.1f} us  "
            + "  ".join(f"{k} x{v / base:.3f}" for k, v in r["us"].items() if k != "nccl"))  # fmt: skip
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dlrm-peers.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), world=world, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "dlrm-peers.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


class Training:
    """One rank's embedding stage in training (see the module, (c)): its tables, the global batch's bags, the
    gradients of the rows it receives."""

    def __init__(self, p: Problem, group, g: torch.Generator):
        self.p, self.group = p, group
        self.name = group.group_name
        self.rows = [w.shape[0] for w in p.weights]
        self.grad_out = torch.randn(p.out_shape, generator=g).to(p.weights[0])  # this rank's received rows' grads

    def _bookkeeping(self, weights) -> list[tuple]:
        return [torch.ops.aten._embedding_bag(w, i, o, False, 0, False, None, False)
                for w, i, o in zip(weights, self.p.indices, self.p.offsets)]  # fmt: skip

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def _backward(self, G: torch.Tensor, book: list[tuple]) -> list[torch.Tensor]:
        per = G.view(G.shape[0], len(self.rows), -1)
        return [
            torch.ops.aten._embedding_bag_backward(per[:, t], self.p.indices[t], self.p.offsets[t], b[1], b[2], b[3],
                                                   n, False, 0, False, None)
            for t, (b, n) in enumerate(zip(book, self.rows))
        ]  # fmt: skip

    def nccl(self) -> list[torch.Tensor]:
        return self.nccl_backward(self.nccl_forward())

    def nccl_forward(self) -> list[tuple]:
        book = self._bookkeeping(self.p.weights)
        self._exchange(torch.cat([b[0] for b in book], dim=1))
        return book

    def nccl_backward(self, book: list[tuple] | None = None) -> list[torch.Tensor]:
        if book is None:  # timed alone: the forward's bookkeeping of the first call
            book = self._nccl_book = getattr(self, "_nccl_book", None) or self._bookkeeping(self.p.weights)
        return self._backward(self._exchange(self.grad_out), book)

    def unfused(self) -> list[torch.Tensor]:
        p = self.p
        P = lo.embedding_bag_all_to_all_on(None, p.weights, p.indices, p.offsets, 0, False, p.out_shape, [], [])
        self._exchange(P)
        G = self._exchange(self.grad_out)
        sizes = [torch.empty(0, dtype=torch.int64, device=G.device)] * len(self.rows)  # sum: not read
        return lo_bw.all_to_all_embedding_bag_backward_on(None, G, p.indices, p.offsets, sizes, self.rows, 0, [], [])

    def fused(self, book: bool = True) -> list[torch.Tensor]:
        return self.fused_backward(self.fused_forward(book))

    def fused_forward(self, book: bool = True) -> tuple:
        p = self.p
        fwd = torch.ops.fluxcompile.embedding_bag_all_to_all.default
        _, o2b, sizes, maxi = fwd(p.weights, p.indices, p.offsets, 0, False, p.out_shape, [], [], self.name,
                                  bookkeeping=book, choice=f"triton:{eb.DEFAULT}")  # fmt: skip
        if not book:
            o2b = sizes = maxi = [torch.empty(0, dtype=torch.int64, device=self.grad_out.device)] * len(self.rows)
        return o2b, sizes, maxi

    def fused_put(self) -> list[torch.Tensor]:
        """Forward and backward in their put-with-signal form (choices ``put``; the NVSHMEM backend)."""
        p = self.p
        with config.patch(exchange_transport="put"):
            fwd = torch.ops.fluxcompile.embedding_bag_all_to_all.default
            _, o2b, sizes, maxi = fwd(p.weights, p.indices, p.offsets, 0, False, p.out_shape, [], [], self.name,
                                      bookkeeping=True, choice=f"put:{eb.DEFAULT}")  # fmt: skip
            bwd = torch.ops.fluxcompile.all_to_all_embedding_bag_backward.default
            return bwd(self.grad_out, p.indices, p.offsets, o2b, sizes, maxi, self.rows, False, 0, [], [], self.name,
                       choice="put")  # fmt: skip

    def put_declines(self) -> str | None:
        """Why the put choices would not run here (the op would run its reference instead)."""
        from fluxcompile.lowerings import choices_for

        p = self.p
        choice = {c.name: c for c in choices_for("embedding_bag_all_to_all")}[f"put:{eb.DEFAULT}"]
        with config.patch(exchange_transport="put"):
            return choice.declines(p.weights, p.indices, p.offsets, 0, False, p.out_shape, [], [], self.name)

    def fused_backward(self, book: tuple | None = None) -> list[torch.Tensor]:
        if book is None:  # timed alone: the forward's bookkeeping of the first call
            book = self._fused_book = getattr(self, "_fused_book", None) or self.fused_forward()
        p = self.p
        bwd = torch.ops.fluxcompile.all_to_all_embedding_bag_backward.default
        return bwd(self.grad_out, p.indices, p.offsets, *book, self.rows, False, 0, [], [], self.name,
                   choice="triton")  # fmt: skip


def training_main(args) -> None:
    dist, group, world, rank, lines, say = _start_peers()
    rows = []
    say(f"== {world} x {torch.cuda.get_device_name()} torch {torch.__version__} (training: forward + backward)")
    g = torch.Generator().manual_seed(rank)
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=False):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            t_local = max(1, TABLES // world)
            store = _local_tables(t_local, args.rows, dtype)
            p = Problem(list(store.unbind(0)), args.batch * world, g)
            tr = Training(p, group, g)
            fns = {"nccl": tr.nccl, "unfused": tr.unfused, "fused": tr.fused, "fused-nobook": lambda tr=tr: tr.fused(False),
                   "nccl-fwd": tr.nccl_forward, "nccl-bwd": tr.nccl_backward, "fused-fwd": tr.fused_forward,
                   "fused-bwd": tr.fused_backward}  # fmt: skip
            if args.put:  # the put-with-signal form (issue 58)
                why = tr.put_declines()
                if why is not None:
                    raise SystemExit(f"rank {rank}: --put: the put choice declines: {why}")
                fns["fused-put"] = tr.fused_put
            want = tr.nccl()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            for k in ("unfused", "fused", "fused-nobook", *(("fused-put",) if args.put else ())):
                err = max(rel(a, b.to(a.dtype)) for a, b in zip(fns[k](), want))
                if err > tol:
                    raise SystemExit(f"rank {rank}: {k} differs from nccl: rel {err:.2e}")
            del want
            it = max(3, p.iters() // 2)
            samples = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    dist.barrier(group=group)
                    samples[k].append(time_us(f, it))
            med = {k: statistics.median(v) for k, v in samples.items()}
            spread = {k: (min(v), max(v)) for k, v in samples.items()}
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (med, spread), group=group)
            worst = {k: max(m[0][k] for m in gathered) for k in fns}
            row = dict(dtype=dname, world=world, tables_per_rank=t_local, bags=p.bags, rows=args.rows, us=worst,
                       spread_rank0=spread, rounds=args.rounds)  # fmt: skip
            rows.append(row)
            say(f"   {dname}: " + "  ".join(f"{k} {v:8.1f} us" for k, v in worst.items()))
            del p, tr, store
            torch.cuda.empty_cache()
    say(f"\n== dlrm table (training, {world} GPUs: the slowest rank's median; ratios to nccl and to unfused)")
    met = True
    for r in rows:
        us = r["us"]
        vs_nccl, vs_unfused = us["fused"] / us["nccl"], us["fused"] / us["unfused"]
        met &= vs_nccl <= 0.7 and vs_unfused < 1.0
        say(f"{r['dtype']:5s} T/rank={r['tables_per_rank']:3d} bags={r['bags']:6d} nccl {us['nccl']:9.1f} us  "
            f"unfused {us['unfused']:9.1f}  fused {us['fused']:9.1f} (x{vs_nccl:.3f} nccl, x{vs_unfused:.3f} unfused)"
            f"  fused-nobook {us['fused-nobook']:9.1f}")  # fmt: skip
        say(f"      parts: forward nccl {us['nccl-fwd']:9.1f} fused {us['fused-fwd']:9.1f}; backward nccl "
            f"{us['nccl-bwd']:9.1f} fused {us['fused-bwd']:9.1f} us")  # fmt: skip
        if "fused-put" in us:
            say(f"      put-with-signal form: {us['fused-put']:9.1f} us (x{us['fused-put'] / us['nccl']:.3f} nccl, "
                f"x{us['fused-put'] / us['fused']:.3f} the P2P form)")  # fmt: skip
    say(f"bar (fused <= 0.7 x nccl and < unfused): {'met' if met else 'NOT met'} at {world} GPU(s)")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"dlrm-training-w{world}.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), world=world, rows=rows), f, indent=1)
        with open(os.path.join(args.out, f"dlrm-training-w{world}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", action="store_true", help="(b): the op between the GPUs of torchrun's processes")
    ap.add_argument("--training", action="store_true", help="(c): with --peers, forward + backward")
    ap.add_argument("--put", action="store_true",
                    help="(c): also the put-with-signal form (needs FLUXCOMPILE_SYMM_MEM_BACKEND=nvshmem)")  # fmt: skip
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--rows", type=int, default=0, help=f"rows per table (default {ROWS}; (c): 131072)")
    ap.add_argument("--batch", type=int, default=BATCH, help="samples per rank")
    ap.add_argument("--variants", default="", help="(b) variants besides the default (names of the sweep)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--smoke", action="store_true", help="(a) on the CPU in Triton's interpreter, tiny sizes")
    args = ap.parse_args()
    if args.smoke:
        global DEVICE, TABLES, DIM, SWEEP
        DEVICE, TABLES, DIM = "cpu", 8, 16
        args.rows, args.batch, args.rounds = 64, 4, 2
        SWEEP = {k: SWEEP[k] for k in (eb.DEFAULT, "b16u4w8")}
    torch.manual_seed(0)
    args.rows = args.rows or (1 << 17 if args.training else ROWS)
    if args.peers and args.training:
        training_main(args)
    elif args.peers:
        peers_main(args)
    else:
        pool_main(args)


if __name__ == "__main__":
    main()
