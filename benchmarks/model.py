"""Model-level benchmark (issue 8): the TP Llama block in three regimes, one process per GPU:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/model.py --out DIR [--quick] [--big]
        [--seqs 2048] [--variants inductor,fluxcompile,inductor_ro,fluxcompile_ro,zero_comm]

The block of ``fluxcompile/models/llama.py`` (dim 4096, FFN 14336, 32 heads; ``--big``: dim 8192, FFN 28672,
64 heads; ``--kv-heads 8``: grouped-query attention as Llama 3's), parallelized with PyTorch's TP API (DTensor ``parallelize_module``, torchtitan's plan), in:
  train    forward + backward (input and weight gradients), sequence parallel, batch 1, 2048 / 8192 tokens
  prefill  forward only, sequence parallel, batch 1, 2048 / 8192 tokens
  decode   forward only, no sequence parallel, batch 1 / 16 / 64 / 256 of one token, replayed from a CUDA
           graph that holds ``--graph-calls`` chained calls (like consecutive layers); no KV cache
each compiled, in the same run and from the same weights, with
  inductor     default Inductor
  async_tp     Inductor with PyTorch's async-TP (``_micro_pipeline_tp`` for this compile only, symmetric
               memory enabled for the TP group)
  fluxcompile  backend="fluxcompile"
  zero_comm    Inductor with every collective replaced by a local op of the same output shape (all-gather:
               the local shard repeated; reduce-scatter: the first rows; all-reduce: identity) — the bound
               that no overlap method can beat;
and, when --variants names them (not in the default), under CUDA graph trees (mode="reduce-overhead": the
options that mode sets, since torch.compile takes a mode or options and the census is an option):
  inductor_ro     default Inductor with reduce-overhead, the baseline of
  fluxcompile_ro  backend="fluxcompile" with reduce-overhead.
Every call of a reduce-overhead variant is a replay of its recorded graphs (the input copied into the graph's
own first); in decode each of the --graph-calls calls per timed run is such a call, on the same input.
Variants are timed in interleaved rounds (CUDA events), medians, the slowest rank. Speedup = T_inductor / T
(fluxcompile_ro: T_inductor_ro / T); gain captured = (T_inductor − T) / (T_inductor − T_zero_comm). Before
timing, every run checks each variant's outputs (and, in train, the input and weight gradients) against
Inductor's on fresh random inputs. Prints a table last (``== table``), writes model.json (after every case) and model.png to --out.
``--device cpu`` runs the same code on gloo (tests/test_model_bench.py).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import timing
import torch
import torch.distributed as dist
from torch._inductor import custom_graph_pass

REGIMES = ("train", "prefill", "decode")
# Reduce-overhead (CUDA graph tree) variants: outputs are overwritten by the next replay, so the numerics keep
# copies; decode calls them directly instead of capturing them in a graph of its own.
REDUCE_OVERHEAD = ("inductor_ro", "fluxcompile_ro")
VARIANTS = ("inductor", "async_tp", "fluxcompile", "zero_comm", *REDUCE_OVERHEAD)
DEFAULT_VARIANTS = ("inductor", "async_tp", "fluxcompile", "zero_comm")
BASELINE = {"fluxcompile_ro": "inductor_ro"}  # speedup over this variant; the others' over inductor
SIZES = {"train": (2048, 8192), "prefill": (2048, 8192), "decode": (1, 16, 64, 256)}
QUICK_SIZES = {"train": (8192,), "prefill": (8192,), "decode": (64,)}
# Cases the issue's acceptance bar names run first, so a run cut short by --budget-s still has them.
PRIORITY = [("train", 8192), ("prefill", 8192), ("decode", 16), ("decode", 64), ("decode", 1)]
FLUX_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce_rmsnorm")

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


# --------------------------------------------------------------------------------------------------------
# The zero-communication bound: a post-grad pass that turns collectives into local ops of the same shape.


def _is_collective(node: torch.fx.Node) -> bool:
    ns = getattr(node.target, "namespace", None)
    return ns in ("_c10d_functional", "c10d", "_dtensor") and node.target is not c10d.wait_tensor.default


def replace_collectives(graph: torch.fx.Graph) -> collections.Counter:
    """Replace every functional collective of a post-grad ``graph`` (and its wait) by a local op with the
    collective's output shape; returns how many of each kind. Raises on a collective it cannot replace, so
    the bound is never silently wrong.

    The local op keeps the data dependence on the collective's input (so the producer, e.g. the RMSNorm
    before an all-gather, is not dead-code eliminated) and costs about nothing: repeat fuses into the
    producer, the first-rows slice is a view.
    """
    from fluxcompile.fx_passes.graph_utils import call, is_call, shape

    counts: collections.Counter = collections.Counter()
    for node in list(graph.nodes):
        if node.op != "call_function" or not _is_collective(node):
            continue
        x = node.args[0]
        with graph.inserting_before(node):
            if node.target is c10d.all_gather_into_tensor.default:  # (x, group_size, group): dim-0 gather
                group_size = int(node.args[1])
                local = call(graph, aten.repeat.default, (x, [group_size] + [1] * (len(shape(x)) - 1)))
            elif node.target is c10d.reduce_scatter_tensor.default:  # (x, op, group_size, group): dim 0
                rows = shape(x)[0] // int(node.args[2])
                local = call(graph, aten.slice.Tensor, (x, 0, 0, rows))
            elif node.target is c10d.all_reduce.default:  # (x, op, group)
                local = x
            elif node.target is c10d.all_to_all_single.default and shape(node) == shape(x):
                local = x  # equal splits: same shape as the input
            else:
                raise RuntimeError(f"zero_comm: no local replacement for {node.format_node()}")
        for user in list(node.users):
            if is_call(user, c10d.wait_tensor.default):
                user.replace_all_uses_with(local)
                graph.erase_node(user)
        node.replace_all_uses_with(local)  # users other than a wait (none expected) read the local op
        graph.erase_node(node)
        counts[node.target.__name__.split(".")[0]] += 1
    graph.lint()
    return counts


class ZeroCommPass(custom_graph_pass.CustomGraphPass):
    """Inductor post-grad pre-pass running :func:`replace_collectives`; keeps the counts of each graph."""

    def __init__(self) -> None:
        self.graphs: list[dict[str, int]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(dict(replace_collectives(graph)))

    def uuid(self) -> Any:
        return custom_graph_pass.get_hash_for_files((os.path.abspath(__file__),))


def zero_comm_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """``torch.compile(m, backend=zero_comm_backend)``: Inductor with the collectives made local."""
    from torch._inductor.compile_fx import compile_fx

    patches = dict(options or {})
    patches["post_grad_custom_pre_pass"] = patches.get("post_grad_custom_pre_pass") or ZeroCommPass()
    # compile_fx keeps config_patches for the backward graph too (compiled at the first backward).
    return compile_fx(gm, example_inputs, config_patches=patches)


class Census(custom_graph_pass.CustomGraphPass):
    """Post-grad post-pass (after async-TP's micro-pipeline pass) that only counts, per graph, the
    collectives left and the fused ops present: whether a variant really fused (async-TP silently does
    nothing without symmetric memory) and whether zero_comm left nothing. ``uuid`` None: never cached."""

    def __init__(self) -> None:
        self.graphs: list[dict[str, Any]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        kind = (
            "backward"
            if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
            else "forward"
        )
        c: collections.Counter = collections.Counter()
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            ns = getattr(n.target, "namespace", None)
            if _is_collective(n):
                c["collectives"] += 1
            elif ns in ("symm_mem", "fluxcompile"):
                c[ns] += 1
        self.graphs.append({"kind": kind, **c})

    def uuid(self) -> Any:
        return None

    def totals(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for g in self.graphs:
            d = out.setdefault(g["kind"], {})
            for k, v in g.items():
                if k != "kind":
                    d[k] = d.get(k, 0) + v
        return out


# --------------------------------------------------------------------------------------------------------
# Variants, timing, numerics.


def compile_variant(name: str, module: torch.nn.Module, census: Census, zero: ZeroCommPass | None = None) -> Callable:
    """``module`` compiled as variant ``name``. Every variant gets the counting post-pass (it changes
    nothing); async-TP's flag is an Inductor config patch of this compile only (forward and backward), so
    it never leaks into the other variants; dynamic=False so a second size never compiles symbolic. The
    ``_ro`` variants add what ``mode="reduce-overhead"`` sets (CUDA graph trees)."""
    opts: dict[str, Any] = {"post_grad_custom_post_pass": census}
    if name in REDUCE_OVERHEAD:
        from torch._inductor import list_mode_options

        opts.update(list_mode_options("reduce-overhead"))
        name = name.removesuffix("_ro")
    if name == "inductor":
        return torch.compile(module, backend="inductor", options=opts, dynamic=False)
    if name == "async_tp":
        return torch.compile(module, backend="inductor", options={**opts, "_micro_pipeline_tp": True}, dynamic=False)
    if name == "fluxcompile":
        import fluxcompile  # noqa: F401  (registers the backend without the entry point)

        return torch.compile(module, backend="fluxcompile", options=opts, dynamic=False)
    if name == "zero_comm":
        opts["post_grad_custom_pre_pass"] = zero or ZeroCommPass()
        return torch.compile(module, backend=zero_comm_backend, options=opts, dynamic=False)
    raise ValueError(f"unknown variant {name!r}")


def timed_rounds(
    fns: dict[str, Callable[[], object]],
    warmup: int,
    rounds: int,
    per_round: int,
    device: str,
    host: dict[str, float] | None = None,
) -> dict[str, float]:
    """µs per call of each fn: interleaved rounds (each round runs ``per_round`` calls of every fn in turn,
    so drift hits all alike), the median over a fn's calls, then the slowest rank. CUDA events on GPU,
    perf_counter on CPU. On GPU, ``host`` (if given) receives each fn's median host time per call (the
    time to enqueue it): where that is near the GPU time, the GPU waits for the host."""
    cuda = device == "cuda"
    return timing.interleaved_us(fns, warmup, rounds, per_round, cuda=cuda, host=host if cuda else None)


def _errors(got: Any, ref: Any, names: list[str]) -> dict[str, float]:
    """Relative errors of an output (decode/prefill) or of (output, input grad, weight grads) (train)."""
    from fluxcompile.testing.numerics import grad_errors, rel_err

    if isinstance(ref, torch.Tensor):
        return {"output": rel_err(got, ref)}
    out = {"output": rel_err(got[0], ref[0]), "input_grad": rel_err(got[1][0], ref[1][0])}
    pairs = [(n, g, r) for n, g, r in zip(names, got[1][1:], ref[1][1:])]
    out.update({f"grad {n}": e for n, e in grad_errors(pairs).items()})
    return out


def _agree(failed: dict[str, str]) -> dict[str, str]:
    """Failures of every rank, on every rank: a variant failing anywhere is dropped everywhere (ranks must
    run the same collectives)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, failed)
    return {k: v for f in every for k, v in f.items()}


def _seed(device: str) -> int:
    s = torch.tensor([int.from_bytes(os.urandom(4), "little") % 2**31], device=device)
    dist.broadcast(s, 0)  # same weights and inputs on every rank, fresh every run
    return int(s.item())


@dataclasses.dataclass
class Shape:
    dim: int = 4096
    heads: int = 32
    ffn: int = 14336
    layers: int = 1
    kv_heads: int | None = None  # grouped-query attention (--kv-heads; None: as many as the query heads)


def build_model(shape: Shape, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The block (or ``layers`` blocks in sequence), unsharded, the same weights on every rank."""
    from fluxcompile.models.llama import Block, BlockArgs

    torch.manual_seed(_seed(device))
    with torch.device(device):  # initialized where it runs: seconds less on the CPU for the big variant
        args = BlockArgs(dim=shape.dim, n_heads=shape.heads, ffn_dim=shape.ffn, n_kv_heads=shape.kv_heads)
        blocks = [Block(args) for _ in range(shape.layers)]
    model = blocks[0] if shape.layers == 1 else torch.nn.Sequential(*blocks)
    return model.to(dtype)


def parallelize(model: torch.nn.Module, mesh: Any, sequence_parallel: bool, float8: str = "") -> torch.nn.Module:
    """TP over ``mesh``; ``float8`` (a torchao recipe the model was converted with): its TP styles where torchtitan
    uses them (tensor-wise: torchao's float8 styles; row-wise: PyTorch's plain ones)."""
    from fluxcompile.models.llama import Block, parallelize_block

    styles = float8 == "tensorwise"
    if isinstance(model, Block):
        return parallelize_block(model, mesh, sequence_parallel, styles)
    for block in model:
        parallelize_block(block, mesh, sequence_parallel, styles)
    return model


def convert_float8(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    """The model's linears as torchao's ``Float8Linear`` with ``recipe`` (tensorwise, rowwise), as torchtitan's
    float8 converter does."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def run_case(args: argparse.Namespace, mesh: Any, base: torch.nn.Module, regime: str, size: int) -> dict:
    """Compile every variant for one regime and size, check numerics against Inductor, time them."""
    import fluxcompile

    device, dtype = args.device, args.torch_dtype
    tp, rank = mesh.size(), mesh.get_local_rank()
    sp = regime != "decode"
    train = regime == "train"
    dim = args.shape.dim
    variants = [v for v in args.variants if not (v == "async_tp" and device != "cuda")]  # symm_mem: CUDA only
    row: dict[str, Any] = {"regime": regime, "size": size, "tokens": size if sp else 1, "batch": 1 if sp else size}
    row.update(us={}, host_us={}, compile_s={}, errors={}, failed={}, census={}, zero_comm={}, report={}, fused={})

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=device).manual_seed(seed)
        shp = (1, size, dim) if sp else (size, 1, dim)
        x = torch.randn(shp, device=device, dtype=dtype, generator=g)
        gy = torch.randn(shp, device=device, dtype=dtype, generator=g)
        if sp:  # each rank its sequence shard
            x, gy = x.chunk(tp, dim=1)[rank].contiguous(), gy.chunk(tp, dim=1)[rank].contiguous()
        return x.requires_grad_(train), gy

    x_warm, g_warm = inputs(_seed(device))
    mods: dict[str, torch.nn.Module] = {}
    calls: dict[str, Callable] = {}
    censuses: dict[str, Census] = {}
    zero = ZeroCommPass()
    failed: dict[str, str] = {}
    for name in variants:
        mods[name] = parallelize(copy.deepcopy(base), mesh, sp, args.float8)  # fresh copy, same weights
        censuses[name] = Census()
        t0 = time.time()
        try:
            compiled = compile_variant(name, mods[name], censuses[name], zero)
            with fluxcompile.collect_reports() as rep:
                _step(compiled, mods[name], x_warm, g_warm, train)  # compiles forward (and backward)
            _sync(device)
            calls[name] = compiled
            if name == "fluxcompile":
                row["report"] = rep.format()
                row["fused"] = _fused_counts(rep)
            elif name == "fluxcompile_ro":
                row["fused_ro"] = _fused_counts(rep)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"[:2000]
        row["compile_s"][name] = round(time.time() - t0, 1)
        if rank == 0:
            print(f"[{regime} {size}] compiled {name} in {row['compile_s'][name]} s", flush=True)
    for name in _agree(failed):
        calls.pop(name, None)
    row["failed"].update(_agree(failed))
    row["census"] = {n: c.totals() for n, c in censuses.items()}
    row["zero_comm"] = zero.graphs  # collectives made local, per graph

    # Numerics on fresh inputs, before timing: every variant against Inductor (zero_comm computes
    # something else by design and is left out).
    x, gy = inputs(_seed(device))
    names = [n for n, _ in mods["inductor"].named_parameters()] if "inductor" in mods else []
    outs = {}
    failed = {}
    for name in calls:
        if name != "zero_comm":
            try:  # a reduce-overhead variant records its CUDA graphs here (its second call)
                outs[name] = _step(calls[name], mods[name], x, gy, train, copy_out=name in REDUCE_OVERHEAD)
            except Exception as e:
                failed[name] = f"{type(e).__name__}: {e}"[:2000]
    failed = _agree(failed)
    for name in failed:
        calls.pop(name, None)
        outs.pop(name, None)
    row["failed"].update(failed)
    if "inductor" in outs:
        for name, got in outs.items():
            if name != "inductor":
                try:
                    row["errors"][name] = _errors(got, outs["inductor"], names)
                except Exception as e:  # e.g. a shape mismatch: a failed check, not a crashed run
                    row["errors"][name] = {f"check failed: {type(e).__name__}: {e}"[:300]: float("inf")}
    del outs

    fns: dict[str, Callable[[], object]] = {}
    graphs: dict[str, Any] = {}
    if regime == "decode":
        graphs, graph_errors, graph_failed = _decode_graphs(args, calls, x)
        row["failed"].update(graph_failed)
        for name, err in graph_errors.items():
            row["errors"].setdefault(name, {})["output (CUDA graph)"] = err
        n = max(1, args.graph_calls)
        fns = {name: g for name, g in graphs.items()}
    else:
        fns = {name: (lambda c=c, m=mods[name]: _step(c, m, x, gy, train)) for name, c in calls.items()}
        n = 1
    tol = TOLERANCE.get(dtype, 1e-2)
    row["tolerance"] = tol
    # fluxcompile's variants that were asked for (fluxcompile if none was) must run and match Inductor.
    checked = [v for v in ("fluxcompile", "fluxcompile_ro") if v in variants] or ["fluxcompile"]
    row["ok"] = (
        "inductor" in fns
        and all(v in fns for v in checked)
        and all(e <= tol for v in checked for e in row["errors"].get(v, {"missing": float("inf")}).values())
    )
    if fns:
        per_round = max(1, args.iters // args.rounds)
        host: dict[str, float] = {}
        t = timed_rounds(fns, args.warmup, args.rounds, per_round, device, host)
        row["us"] = {k: v / n for k, v in t.items()}
        row["host_us"] = {k: v / n for k, v in host.items()}
        if args.profile and device == "cuda":
            row["profile"] = {k: profile_kernels(fn, args.profile_top) for k, fn in fns.items() if k in args.profile}
            if rank == 0:
                for k, text in row["profile"].items():
                    print(f"-- profile, {regime} {size}, {k} (rank 0, one call; GPU µs by kernel):\n{text}", flush=True)
        if rank == 0 and host:
            print(
                f"[{regime} {size}] host µs per call (GPU µs): "
                + ", ".join(f"{k} {host[k] / n:.0f} ({t[k] / n:.0f})" for k in t),
                flush=True,
            )
    _derive(row)
    del fns, graphs, calls, mods
    return row


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def profile_kernels(fn: Callable[[], Any], top: int) -> str:
    """One call of ``fn`` under torch.profiler (after a warm call): the ``top`` kernels by total GPU time, with
    their counts, the total, and the call's wall time on the GPU (first kernel start to last kernel end)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.device_time)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    total = sum(sum(v) for v in by_name.values())
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) if kernels else 0
    lines = [f"   {sum(v):9.1f} {len(v):4d}  {name[:110]}" for name, v in rows[:top]]
    lines.append(f"   {total:9.1f}       total kernel time; GPU span {span:.1f} µs")
    return "\n".join(lines)


def _step(
    compiled: Callable, module: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, train: bool, copy_out: bool = False
) -> Any:
    """train: forward + backward, returning (output, grads of input and weights) without touching .grad;
    otherwise the output under no_grad. ``copy_out``: copies of them (a CUDA graph tree's outputs are
    overwritten by its next replay, any variant's)."""
    if not train:
        with torch.no_grad():
            y = compiled(x)
        return y.clone() if copy_out else y
    y = compiled(x)
    wrt = [x, *module.parameters()]
    grads = torch.autograd.grad(y, wrt, gy)
    if copy_out:
        return y.detach().clone(), tuple(g.clone() for g in grads)
    return y, grads


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _decode_graphs(
    args: argparse.Namespace, calls: dict[str, Callable], x: torch.Tensor
) -> tuple[dict[str, Callable[[], object]], dict[str, float], dict[str, str]]:
    """Per variant, ``--graph-calls`` chained calls (each call's output is the next one's input, like
    consecutive layers) captured in one CUDA graph after warm-up (fluxcompile's autotuner and workspaces
    must be done before capture). Returns the replay callables, the first call's output error against
    Inductor's after a replay on fresh inputs, and failures. On CPU: the same chain, run directly.

    The reduce-overhead variants (CUDA graph trees, recorded by the earlier calls) are not captured: their
    ``--graph-calls`` calls each replay the recorded graph on the same input (a chain would feed one replay's
    output, which the next replay overwrites, back into it)."""
    from fluxcompile.testing.numerics import rel_err

    n = max(1, args.graph_calls)
    static = {name: x.clone() for name in calls}
    first: dict[str, torch.Tensor] = {}
    trees = [name for name in calls if name in REDUCE_OVERHEAD]
    graphed = [name for name in calls if name not in REDUCE_OVERHEAD]

    def chain(name: str) -> torch.Tensor:
        y = static[name]
        with torch.no_grad():
            for i in range(n):
                y = calls[name](y)
                if i == 0:
                    first[name] = y
        return y

    def replays(name: str) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(n):
                y = calls[name](static[name])
        return y

    failed: dict[str, str] = {}
    runners: dict[str, Callable[[], object]] = {name: (lambda name=name: replays(name)) for name in trees}
    if args.device != "cuda":
        runners.update({name: (lambda name=name: chain(name)) for name in graphed})
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
            for name in graphed:
                for _ in range(2):
                    chain(name)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for name in graphed:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain(name)
                runners[name] = graph.replay
            except Exception as e:
                failed[name] = f"capture: {type(e).__name__}: {e}"[:2000]
        failed = _agree(failed)
        for name in failed:
            runners.pop(name, None)
        torch.cuda.synchronize()
    runners = {name: runners[name] for name in calls if name in runners}  # the variants' order
    # Fresh inputs into the static buffers, one replay each, then compare the first call's outputs.
    gen = torch.Generator(device=x.device).manual_seed(_seed(args.device))  # replicated: same on all ranks
    fresh = torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=gen)
    for name in runners:
        static[name].copy_(fresh)
        out = runners[name]()
        if name in REDUCE_OVERHEAD:  # the same as the first call's (same input), copied before another replay
            first[name] = out.clone()
        del out
    _sync(args.device)
    errors = {}
    if "inductor" in runners:
        for name in runners:
            if name not in ("inductor", "zero_comm"):
                errors[name] = rel_err(first[name], first["inductor"])
    return runners, errors, failed


def _fused_counts(rep: Any) -> dict[str, dict[str, int]]:
    """Per graph kind: how many collectives the report saw and how many became each fused op."""
    out: dict[str, dict[str, int]] = {}
    for g in rep.graphs:
        d = out.setdefault(g.kind, {"collectives": 0, "fused": 0})
        d["collectives"] += len(g.entries)
        d["fused"] += len(g.fused())
        for e in g.fused():
            d[e.fused_op] = d.get(e.fused_op, 0) + 1
    return out


def _derive(row: dict) -> None:
    """Speedups over Inductor and the share of the possible gain captured."""
    us = row["us"]
    ind, zero = us.get("inductor"), us.get("zero_comm")
    row["speedup"], row["gain"] = {}, {}
    for name in ("async_tp", "fluxcompile", "zero_comm", *REDUCE_OVERHEAD):
        t, base = us.get(name), us.get(BASELINE.get(name, "inductor"))
        if t is None or base is None:
            continue
        row["speedup"][name] = base / t
        if zero is not None and ind is not None and name in ("async_tp", "fluxcompile"):
            row["gain"][name] = (ind - t) / (ind - zero) if ind - zero > 0 else float("nan")


# --------------------------------------------------------------------------------------------------------
# Output.


def _size_label(r: dict) -> str:
    return f"{r['size']} tok" if r["regime"] != "decode" else f"b={r['size']}"


def _fused_label(r: dict, key: str = "fused") -> str:
    """fluxcompile's fused / seen collectives per graph kind, e.g. 'fwd 4/4 bwd 4/4' (``key`` "fused_ro":
    fluxcompile_ro's)."""
    short = {"forward": "fwd", "backward": "bwd", "inference": "inf"}
    parts = [f"{short.get(k, k)} {v['fused']}/{v['collectives']}" for k, v in r.get(key, {}).items()]
    return " ".join(parts) or "-"


def _async_label(r: dict) -> str:
    """async-TP's fused (symm_mem) ops and collectives left, summed over graphs, e.g. '4 fused, 0 left'."""
    c = r.get("census", {}).get("async_tp")
    if not c:
        return "-"
    fused = sum(v.get("symm_mem", 0) for v in c.values())
    left = sum(v.get("collectives", 0) for v in c.values())
    return f"{fused} fused, {left} left"


def table(rows: list[dict]) -> str:
    """One line per regime and size, then notes and the issue's bar. Times are µs per step (train: forward
    + backward; prefill: forward; decode: one block call)."""

    def f(v: float | None, fmt: str, width: int) -> str:
        return f"{v:{width}{fmt}}" if v is not None and v == v else f"{'-':>{width}}"

    head = (
        f"{'regime':<8} {'size':>9} {'inductor':>9} {'asyncTP':>9} {'flux':>9} {'zero-comm':>9} "
        f"{'x asyncTP':>9} {'x flux':>7} {'gain aTP':>8} {'gain flux':>9} {'max err':>8} {'ok':>3}  "
        f"{'flux fused':<16} asyncTP"
    )
    lines = [head]
    order = {r: i for i, r in enumerate(REGIMES)}
    rows = sorted(rows, key=lambda r: (order.get(r["regime"], 9), r["size"]))
    for r in rows:
        us, sp, gain = r["us"], r.get("speedup", {}), r.get("gain", {})
        errs = r["errors"].get("fluxcompile", {})
        worst = max(errs.values()) if errs else None
        lines.append(
            f"{r['regime']:<8} {_size_label(r):>9} {f(us.get('inductor'), '.1f', 9)} {f(us.get('async_tp'), '.1f', 9)} "
            f"{f(us.get('fluxcompile'), '.1f', 9)} {f(us.get('zero_comm'), '.1f', 9)} {f(sp.get('async_tp'), '.3f', 9)} "
            f"{f(sp.get('fluxcompile'), '.3f', 7)} {f(gain.get('async_tp'), '.0%', 8)} {f(gain.get('fluxcompile'), '.0%', 9)} "
            f"{f(worst, '.1e', 8)} {'yes' if r['ok'] else 'NO':>3}  {_fused_label(r):<16} {_async_label(r)}"
        )
    for r in rows:
        for name, why in r["failed"].items():
            lines.append(f"  FAILED {r['regime']} {_size_label(r)} {name}: {why.splitlines()[0][:200]}")
        zc = r.get("census", {}).get("zero_comm", {})
        left = sum(v.get("collectives", 0) for v in zc.values())
        if left:
            lines.append(f"  WARNING {r['regime']} {_size_label(r)}: zero_comm still has {left} collectives")
    ro_rows = [r for r in rows if any(v in r["us"] for v in REDUCE_OVERHEAD)]
    if ro_rows:  # CUDA graph trees: fluxcompile_ro against its own baseline, inductor_ro
        lines.append(
            f"reduce-overhead: {'regime':<8} {'size':>9} {'ind_ro':>9} {'flux_ro':>9} {'x flux_ro':>9} "
            f"{'x ind_ro':>8} {'max err':>8}  flux_ro fused   (x ind_ro: inductor_ro over inductor)"
        )
        for r in ro_rows:
            us, sp = r["us"], r.get("speedup", {})
            errs = r["errors"].get("fluxcompile_ro", {})
            worst = max(errs.values()) if errs else None
            lines.append(
                f"                 {r['regime']:<8} {_size_label(r):>9} {f(us.get('inductor_ro'), '.1f', 9)} "
                f"{f(us.get('fluxcompile_ro'), '.1f', 9)} {f(sp.get('fluxcompile_ro'), '.3f', 9)} "
                f"{f(sp.get('inductor_ro'), '.3f', 8)} {f(worst, '.1e', 8)}  {_fused_label(r, 'fused_ro')}"
            )
    # The issue's bar: never slower than Inductor; >= 70% of the gain at train/prefill 8192, decode b <= 64.
    slower = [f"{r['regime']} {_size_label(r)}" for r in rows if r.get("speedup", {}).get("fluxcompile", 1.0) < 1.0]
    bar = [
        r
        for r in rows
        if (r["regime"] != "decode" and r["size"] == 8192) or (r["regime"] == "decode" and r["size"] <= 64)
    ]
    short = [
        f"{r['regime']} {_size_label(r)}" for r in bar if not r.get("gain", {}).get("fluxcompile", float("nan")) >= 0.7
    ]
    if any("case_s" in r for r in rows):  # where the run's time went (compilation dominates)
        lines.append(
            "seconds per case (compile s per variant): "
            + "; ".join(
                f"{r['regime']} {_size_label(r)} {r.get('case_s', 0):.0f} "
                f"({', '.join(f'{k} {v:.0f}' for k, v in r.get('compile_s', {}).items())})"
                for r in rows
            )
        )
    lines.append(f"fluxcompile slower than Inductor: {', '.join(slower) or 'nowhere'}")
    if ro_rows:
        slower_ro = [
            f"{r['regime']} {_size_label(r)}" for r in ro_rows if r.get("speedup", {}).get("fluxcompile_ro", 1.0) < 1.0
        ]
        lines.append(f"fluxcompile_ro slower than inductor_ro: {', '.join(slower_ro) or 'nowhere'}")
    lines.append(
        f"gain captured >= 70% (train/prefill 8192, decode b<=64): {len(bar) - len(short)} of {len(bar)} measured"
        + (f"; short: {', '.join(short)}" if short else "")
    )
    lines.append(
        f"numerics (fluxcompile vs Inductor): {'all ok' if all(r['ok'] for r in rows) else 'MISMATCH or missing'}"
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Left: time relative to Inductor per variant; right: share of the possible gain captured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {r: i for i, r in enumerate(REGIMES)}
    rows = sorted(rows, key=lambda r: (order.get(r["regime"], 9), r["size"]))
    labels = [f"{r['regime']}\n{_size_label(r)}" for r in rows]
    x = list(range(len(rows)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    w = 0.27
    for i, (name, lab) in enumerate(
        (("async_tp", "PyTorch async-TP"), ("fluxcompile", "fluxcompile"), ("zero_comm", "zero-comm bound"))
    ):
        vals = [
            r["us"][name] / r["us"]["inductor"] if name in r["us"] and "inductor" in r["us"] else float("nan")
            for r in rows
        ]
        a1.bar([j + (i - 1) * w for j in x], vals, w, label=lab)
    a1.axhline(1.0, color="black", linewidth=0.8)
    a1.set_ylabel("time / Inductor time")
    a1.set_xticks(x, labels, fontsize=7)
    a1.legend(fontsize=7)
    for i, (name, lab) in enumerate((("async_tp", "PyTorch async-TP"), ("fluxcompile", "fluxcompile"))):
        vals = [r.get("gain", {}).get(name, float("nan")) * 100 for r in rows]
        a2.bar([j + (i - 0.5) * w for j in x], vals, w, label=lab)  # NaN (not measured): no bar
    a2.axhline(70, color="gray", linestyle="--", linewidth=0.8)
    a2.axhline(0, color="black", linewidth=0.8)
    a2.set_ylabel("gain captured (%)")
    a2.set_xticks(x, labels, fontsize=7)
    a2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# Driver.


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--quick", action="store_true", help="one size per regime: train/prefill 8192, decode 64")
    p.add_argument("--big", action="store_true", help="dim 8192, FFN 28672, 64 heads (70B-like)")
    p.add_argument("--layers", type=int, default=1, help="blocks in sequence")
    p.add_argument("--dim", type=int), p.add_argument("--heads", type=int), p.add_argument("--ffn", type=int)
    p.add_argument(
        "--kv-heads", dest="kv_heads", type=int,
        help="grouped-query attention: key/value heads (Llama 3 8B: 8 with 32 query heads); default: as many",
    )  # fmt: skip
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, inductor included, among {','.join(VARIANTS)} (default %(default)s); "
        "inductor_ro / fluxcompile_ro: Inductor / fluxcompile with mode='reduce-overhead' (CUDA graph trees)",
    )
    p.add_argument(
        "--seqs",
        help="train/prefill tokens, comma-separated (default 2048,8192; --quick 8192); "
        "--seqs 2048: the 2048-token step alone",
    )
    p.add_argument("--batches", help="decode batch sizes, comma-separated (default 1,16,64,256)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed calls per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the variants")
    p.add_argument("--graph-calls", type=int, default=8, help="decode: chained calls per CUDA graph")
    p.add_argument(
        "--budget-s", type=float, default=210.0, help="start no new case after this many seconds (a case: ~0.5-1 min)"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, float32 (tests)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    p.add_argument(
        "--profile", type=lambda v: v.split(","), default=[],
        help="comma-separated variants to profile once per case after timing (top kernels by GPU time)",
    )
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument(
        "--float8", choices=["", "tensorwise", "rowwise"], default="",
        help="torchao float8 training with this recipe (tensorwise: torchao's float8 TP styles, as torchtitan)",
    )
    a = p.parse_args(argv)
    a.shape = Shape(8192, 64, 28672, a.layers) if a.big else Shape(layers=a.layers)
    for f in ("dim", "heads", "ffn", "kv_heads"):
        if getattr(a, f) is not None:
            setattr(a.shape, f, getattr(a, f))
    a.torch_dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    sizes = dict(QUICK_SIZES if a.quick else SIZES)
    if a.seqs:
        sizes["train"] = sizes["prefill"] = tuple(int(s) for s in a.seqs.split(","))
    if a.batches:
        sizes["decode"] = tuple(int(s) for s in a.batches.split(","))
    a.variants = list(dict.fromkeys(v for v in a.variants.split(",") if v))  # in order, once each
    unknown = set(a.variants) - set(VARIANTS)
    if unknown or "inductor" not in a.variants:
        p.error(f"--variants must include inductor and be among {VARIANTS}")
    regimes = [r for r in a.regimes.split(",") if r]
    cases = [(r, s) for r in regimes for s in sizes[r]]
    a.cases = sorted(cases, key=lambda c: PRIORITY.index(c) if c in PRIORITY else len(PRIORITY))
    return a


def bench(args: argparse.Namespace) -> list[dict]:
    """Every case on the initialized default group; rows printed and model.json rewritten as they land."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    if args.device == "cuda" and "async_tp" in args.variants:
        from torch.distributed import _symmetric_memory as symm

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in newer torch, still required by 2.11
            symm.enable_symm_mem_for_group(mesh.get_group().group_name)  # async-TP does nothing without it
    # The same Block.forward code object serves every variant: room for them all; and no cache hits
    # between variants or runs, so every graph goes through its passes (reports and census complete).
    # Patched, not set, so a test process running this keeps its settings.
    with (
        torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64)),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        return _bench_cases(args, mesh)


def _bench_cases(args: argparse.Namespace, mesh: Any) -> list[dict]:
    rank = dist.get_rank()
    base = build_model(args.shape, args.device, args.torch_dtype)
    if args.float8:
        base = convert_float8(base, args.float8)
        if args.device == "cpu":  # gloo moves no fp8: the CPU tests' transport moves its gathers as bytes
            from fluxcompile.testing import fp8_gloo

            fp8_gloo.install()
    start = time.time()
    rows: list[dict] = []
    for regime, size in args.cases:
        go = torch.tensor([time.time() - start < args.budget_s], device=args.device)
        dist.broadcast(go, 0)  # rank 0's clock decides for all
        if not go.item():
            if rank == 0:
                print(f"budget of {args.budget_s:.0f} s spent: skipping {regime} {size}", flush=True)
            continue
        t0 = time.time()
        row = run_case(args, mesh, base, regime, size)
        row["case_s"] = round(time.time() - t0, 1)
        rows.append(row)
        torch._dynamo.reset()  # drop this case's compiled code before the next
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "report"}), flush=True)
            write_json(args, rows)
    return rows


def _meta(args: argparse.Namespace) -> dict:
    import platform

    m = {
        "torch": torch.__version__, "python": platform.python_version(), "world": dist.get_world_size(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "shape": dataclasses.asdict(args.shape), "dtype": str(args.torch_dtype), "argv": sys.argv[1:],
    }  # fmt: skip
    try:
        import triton

        m["triton"] = triton.__version__
    except ImportError:
        pass
    return m


def write_json(args: argparse.Namespace, rows: list[dict]) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump({"meta": _meta(args), "rows": rows}, f, indent=1, default=str)


def finish(args: argparse.Namespace, rows: list[dict]) -> str:
    """Rank 0: JSON, plot, reports; returns the text to print last."""
    write_json(args, rows)
    s = args.shape
    title = (
        f"TP Llama block dim {s.dim} FFN {s.ffn} {s.heads} heads"
        f"{f' ({s.kv_heads} key/value)' if s.kv_heads else ''} x{s.layers}, "
        f"{_meta(args)['device']} x{dist.get_world_size()}, torch {torch.__version__}"
    )
    try:
        plot(rows, os.path.join(args.out, "model.png"), title)
    except Exception as e:  # no matplotlib: the table and JSON still stand
        print(f"plot failed: {type(e).__name__}: {e}")
    lines = []
    for r in rows:
        if r.get("report"):
            lines.append(f"-- fluxcompile rewrite report, {r['regime']} {_size_label(r)} (rank 0):\n{r['report']}")
    lines.append(
        f"== table ({title}; µs per step, medians of the slowest rank; decode per block call from CUDA graphs) =="
    )
    lines.append(table(rows))
    return "\n".join(lines)


def main() -> None:
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=300))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rows = bench(args)
    code = 0
    if dist.get_rank() == 0:
        print(finish(args, rows), flush=True)
        code = 0 if rows and all(r["ok"] for r in rows) else 1
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
