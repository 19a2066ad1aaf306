"""Choices made at compile time (fx_passes/decide.py) with real benchmarking, at any world size (one GPU too).

While Inductor compiles, every matched site on CUDA tensors is autotuned on real tensors shaped like its
operands (``config.choose_at_compile="cuda"``, the default): the unfused collective + matmul winning keeps the
original ops, a fused winner rewrites the site and its op finds the winner in the process memo at its first
call. Checked on a tensor-parallel Llama block (``fluxcompile.models.llama``'s weights, torchtitan's plan)
whose collectives are written out as functional collectives, since DTensor emits none on a one-rank mesh:

* decode (a few one-token sequences, no sequence parallelism: row-parallel all-reduces, so
  ``all_reduce_rmsnorm`` and ``matmul_all_reduce`` sites), prefill (sequence parallel: all-gathers and
  reduce-scatters) and prefill training (forward + backward): output and gradients against eager in bf16;
  every site fused or kept with the compile-time reason; the generated code calls as many fused ops as the
  report fused and a collective for every kept site; all tuning done while compiling (none at the first call);
  at one rank the reduce-scatters are kept (every fused choice declines one rank) and an all-gather fuses only
  as PyTorch's ``torch_symm_mem`` op (the one fused all-gather choice that takes one rank);
* ``mode="reduce-overhead"`` on the decode block: 1,000 CUDA-graph-tree replays with fresh values in the same
  input tensor, every step against eager (its relative error on the GPU; every 50th element by element), the
  output poisoned after each step; with choices made at compile time and with every site rewritten into its
  fused op (``choose_at_compile="never"``).
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_helpers import assert_on_every_rank, shared_seed
from torch import nn
from torch._inductor.utils import run_and_get_code

import fluxcompile
from fluxcompile import lowerings
from fluxcompile.fx_passes import decide
from fluxcompile.lowerings import autotune
from fluxcompile.models.llama import Block, BlockArgs
from fluxcompile.testing import fresh_compiles
from fluxcompile.testing.numerics import TOLERANCE, elementwise_mismatch, grad_errors, rel_err

BF16 = torch.bfloat16
DIM, HEADS, FFN = 1024, 16, 2816  # the demo's block; every local size a multiple of 8 up to 8 ranks
DECODE_ROWS = 8  # decode: this many sequences of one token each (m = 8: the GEMV's range)
PREFILL_TOKENS = 512  # prefill: one sequence of this many tokens, split over the ranks
STEPS = 1000  # reduce-overhead replays
FULL_EVERY = 50  # ... every this many compared element by element
FUSED_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce_rmsnorm")
COMPILE_TIME = "autotuned at compile time"  # how decide.py's reasons for a kept site begin
COMPILE_TIME = "compile time"  # a tuning run that decide.py asked for while Inductor compiled

c10d = torch.ops._c10d_functional


# --------------------------------------------------------------------------------------------------------
# The block, tensor-parallel with explicit functional collectives (what funcol and DTensor emit, on dim 0).


def _all_gather(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group_name))


def _reduce_scatter(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", world, group_name))


class _Gather(torch.autograd.Function):
    """Sequence-parallel entry: all-gather the rows; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
        ctx.world, ctx.group_name = world, group_name
        return _all_gather(x, world, group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad.contiguous(), ctx.world, ctx.group_name), None, None


class _Scatter(torch.autograd.Function):
    """Sequence-parallel exit: reduce-scatter the partial sums; the backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
        ctx.world, ctx.group_name = world, group_name
        return _reduce_scatter(x, world, group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad.contiguous(), ctx.world, ctx.group_name), None, None


def _shard(linear: nn.Linear, dim: int, rank: int, world: int) -> nn.Linear:
    """This rank's part of ``linear``: output features (dim 0, column-parallel) or input features (dim 1,
    row-parallel)."""
    w = linear.weight.detach().chunk(world, dim)[rank]
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
    return out


class TPBlock(nn.Module):
    """``fluxcompile.models.llama.Block`` sharded over ``group`` as torchtitan's plan does it, on 2-D
    activations ``[tokens, dim]``: q, k, v, w1, w3 column-parallel; wo, w2 row-parallel.

    Without sequence parallelism (decode) the input is replicated, every token its own sequence, and the
    row-parallel outputs are all-reduced (inference only: no gradient flows through the all-reduces). With it
    (prefill, training) the input is this rank's rows of one sequence, all-gathered before the attention and
    the feed-forward and reduce-scattered after them, with their backward collectives."""

    def __init__(self, full: Block, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        rank, world = group.rank(), group.size()
        self.world, self.group_name, self.sp = world, group.group_name, sequence_parallel
        self.head_dim = full.attention.head_dim
        a, f = full.attention, full.feed_forward
        self.attention_norm = copy.deepcopy(full.attention_norm)
        self.ffn_norm = copy.deepcopy(full.ffn_norm)
        self.wq, self.wk, self.wv = (_shard(w, 0, rank, world) for w in (a.wq, a.wk, a.wv))
        self.wo = _shard(a.wo, 1, rank, world)
        self.w1, self.w3 = (_shard(w, 0, rank, world) for w in (f.w1, f.w3))
        self.w2 = _shard(f.w2, 1, rank, world)

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self.world, self.group_name) if self.sp else x

    def _leave(self, y: torch.Tensor) -> torch.Tensor:
        if self.sp:
            return _Scatter.apply(y, self.world, self.group_name)
        return c10d.wait_tensor(c10d.all_reduce(y, "sum", self.group_name))

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter(x)
        t = x.shape[0]
        b, s = (1, t) if self.sp else (t, 1)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self._leave(self.wo(o.transpose(1, 2).reshape(t, -1)))

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter(x)
        return self._leave(self.w2(F.silu(self.w1(x)) * self.w3(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self._attention(self.attention_norm(x))
        return h + self._feed_forward(self.ffn_norm(h))


def tp_block(
    seed: int, group: dist.ProcessGroup, sequence_parallel: bool, device: str = "cuda", dtype: torch.dtype = BF16
) -> TPBlock:
    """The same full block on every rank (``seed``), sharded for this rank."""
    torch.manual_seed(seed)
    full = Block(BlockArgs(dim=DIM, n_heads=HEADS, ffn_dim=FFN)).to(device, dtype)
    return TPBlock(full, group, sequence_parallel)


def block_input(seed: int, group: dist.ProcessGroup, case: str, device: str = "cuda", dtype: torch.dtype = BF16):
    """The block's input on this rank: decode ``[DECODE_ROWS, DIM]`` replicated; prefill/train this rank's
    rows of ``[PREFILL_TOKENS, DIM]``; and a gradient of the output's shape (train)."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows = DECODE_ROWS if case == "decode" else PREFILL_TOKENS
    x = torch.randn(rows, DIM, device=device, dtype=dtype, generator=g)
    gy = torch.randn(rows, DIM, device=device, dtype=dtype, generator=g)
    if case != "decode":
        x, gy = x.chunk(group.size())[group.rank()].contiguous(), gy.chunk(group.size())[group.rank()].contiguous()
    return x, gy


# --------------------------------------------------------------------------------------------------------
# What the compile did.


class Tuning:
    """Records, while installed, every compile-time decision (``pick`` as decide.py calls it: op, winner)
    and every tuning run of the autotuner (``autotune._select``: op, and ``COMPILE_TIME`` where decide.py's
    choosing thread asked for it, else "run time"; every run itself is on symm_mem.persistent's worker)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.picks: list[tuple[str, str]] = []
        self.selects: list[tuple[str, str]] = []
        pick, select, choose = lowerings.pick, autotune._select, decide._on_fresh_thread
        self._choosing = 0

        def recording_pick(op_name: str, *args: Any, **kwargs: Any):
            choice = pick(op_name, *args, **kwargs)
            self.picks.append((op_name, choice.name))
            return choice

        def recording_select(op_name: str, *args: Any, **kwargs: Any):
            self.selects.append((op_name, COMPILE_TIME if self._choosing else "run time"))
            return select(op_name, *args, **kwargs)

        def recording_choose(fn: Any, device: torch.device) -> Any:
            self._choosing += 1
            try:
                return choose(fn, device)
            finally:
                self._choosing -= 1

        # decide.py imports pick from fluxcompile.lowerings at every decision; the ops' own CUDA
        # implementations bound autotune.pick at import (not recorded here) and reach _select through it.
        monkeypatch.setattr(lowerings, "pick", recording_pick)
        monkeypatch.setattr(autotune, "_select", recording_select)
        monkeypatch.setattr(decide, "_on_fresh_thread", recording_choose)

    def at_run_time(self) -> list[tuple[str, str]]:
        return [s for s in self.selects if s[1] != COMPILE_TIME]


_CALL = re.compile(r"extern_kernels\.fluxcompile_(\w+)\(|torch\.ops\.fluxcompile\.(\w+)\.default\(")
_COLLECTIVE = re.compile(r"torch\.ops\._c10d_functional\.(?!wait_tensor)(\w+)\.default\(")


def fused_calls(codes: list[str]) -> Counter:
    """Calls of each fused op in Inductor's generated code (direct entries or through torch.ops)."""
    return Counter(a or b for code in codes for a, b in _CALL.findall(code))


def collective_calls(codes: list[str]) -> int:
    return sum(len(_COLLECTIVE.findall(code)) for code in codes)


def check_decisions(rep: Any, tuning: Tuning, codes: list[str], world: int) -> list[str]:
    """What every test here asserts about a compile under ``choose_at_compile="cuda"``; returns the failures."""
    errors: list[str] = []
    entries = rep.entries()
    if not entries:
        return [f"no collective reached the rewrite pass:\n{rep.format()}"]
    # Every site was matched and decided at compile time, in order: one decision per report entry.
    if len(tuning.picks) != len(entries):
        errors.append(f"{len(tuning.picks)} compile-time decisions for {len(entries)} sites")
    for e, (op, winner) in zip(entries, tuning.picks):
        if e.fused:
            if e.fused_op != op or winner == lowerings.REFERENCE:
                errors.append(f"{e.line().strip()}: decided {op} -> {winner}")
            if not any(f"'{winner}'" in code for code in codes):
                errors.append(f"{e.line().strip()}: the winner {winner!r} is not written into the generated call")
        elif not e.detail.startswith(COMPILE_TIME) or winner != lowerings.REFERENCE:
            errors.append(f"kept without the compile-time reason (decided {op} -> {winner}): {e.line().strip()}")
        if world == 1 and op == "matmul_reduce_scatter" and e.fused:
            errors.append(f"a reduce-scatter fused at one rank ({winner}): {e.line().strip()}")
        if world == 1 and op == "all_gather_matmul" and e.fused and winner != "torch_symm_mem":
            # every other all-gather choice overlaps with peers and declines a one-rank group
            errors.append(f"an all-gather fused at one rank as {winner}: {e.line().strip()}")
    # The generated code: a fused op call per fused site and none for a kept one; a collective per kept site.
    fused = Counter(e.fused_op for e in entries if e.fused)
    calls = fused_calls(codes)
    for op in FUSED_OPS:
        if calls[op] != fused[op]:
            errors.append(f"{op}: {calls[op]} call(s) in the generated code, {fused[op]} site(s) fused")
    kept = sum(not e.fused for e in entries)
    if collective_calls(codes) != kept:
        errors.append(f"{collective_calls(codes)} collective call(s) in the generated code, {kept} site(s) kept")
    # All tuning happened while compiling: the fused ops' first calls found their winners in the memo.
    if tuning.at_run_time():
        errors.append(f"tuned again at run time: {tuning.at_run_time()}")
    return errors


# --------------------------------------------------------------------------------------------------------
# The compile path with real benchmarking.


@pytest.mark.parametrize("case", ["decode", "prefill", "train"])
def test_sites_decided_at_compile_time(case, tmp_path, monkeypatch):
    """decode: inference, replicated input, all-reduce sites; prefill: inference, sequence parallel,
    all-gather and reduce-scatter sites; train: prefill forward + backward (the backward's collectives too)."""
    try:
        errors = decisions_case(case, tmp_path, monkeypatch)
    finally:
        torch._dynamo.reset()  # the compiled graphs and their buffers go before the next test
    assert_on_every_rank("\n".join(errors) or None)


def decisions_case(
    case: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, device: str = "cuda", dtype: torch.dtype = BF16,
    choose: str = "cuda",
) -> list[str]:  # fmt: skip
    """One case of the test above; returns its failures (``device``, ``dtype``, ``choose``: for runs of the
    same checks off the GPU)."""
    group = dist.group.WORLD
    world = group.size()
    torch._dynamo.reset()
    autotune.clear_memo()
    monkeypatch.setattr(fluxcompile.config, "cache_dir", str(tmp_path))  # nothing cached: every site is timed
    monkeypatch.setattr(fluxcompile.config, "autotune", True)
    monkeypatch.setattr(fluxcompile.config, "choose_at_compile", choose)
    seed = shared_seed() if device == "cuda" else 1234
    eager = tp_block(seed, group, case != "decode", device, dtype)
    model = copy.deepcopy(eager)
    x, gy = block_input(seed + 1, group, case, device, dtype)
    train = case == "train"
    x_eager, x_model = x.clone().requires_grad_(train), x.clone().requires_grad_(train)
    compiled = torch.compile(model, backend="fluxcompile", dynamic=False)
    tuning = Tuning(monkeypatch)

    def step() -> torch.Tensor:
        if not train:
            with torch.no_grad():
                return compiled(x_model)
        y = compiled(x_model)
        y.backward(gy)  # compiles the backward graph
        return y.detach()

    with fresh_compiles(), fluxcompile.collect_reports() as rep:
        out, codes = run_and_get_code(step)
    if train:
        ref = eager(x_eager)
        ref.backward(gy)
        ref = ref.detach()
    else:
        with torch.no_grad():
            ref = eager(x_eager)

    errors = check_decisions(rep, tuning, codes, world)
    kinds = {g.kind for g in rep.graphs}
    if train and "backward" not in kinds:
        errors.append(f"no backward graph in the report ({sorted(kinds)})")
    ops = {e.collective for e in rep.entries()}
    want = {"all_reduce"} if case == "decode" else {"all_gather_into_tensor", "reduce_scatter_tensor"}
    if ops != want:
        errors.append(f"collectives {sorted(ops)}, expected {sorted(want)}")
    tol = TOLERANCE[dtype]
    err = rel_err(out, ref)
    if not err <= tol:
        errors.append(f"output: relative error {err:.3e} > {tol:.0e}")
    if train:
        err = rel_err(x_model.grad, x_eager.grad)
        if not err <= tol:
            errors.append(f"input gradient: relative error {err:.3e} > {tol:.0e}")
        pairs = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters())]
        if any(g is None for _, g, _ in pairs):
            errors.append(f"missing gradients: {[n for n, g, _ in pairs if g is None]}")
        else:
            errors += [
                f"grad of {n}: relative error {e:.3e} > {tol:.0e}"
                for n, e in grad_errors(pairs).items()
                if not e <= tol
            ]
    # Real benchmarking: rank 0 wrote the winner and every supported choice's time of each tuned site.
    if group.rank() == 0:
        files = sorted((tmp_path / "autotune").glob("*.json"))
        if not files or len(files) != len(tuning.selects):
            errors.append(f"{len(files)} autotune cache file(s) under {tmp_path} for {len(tuning.selects)} tuning(s)")
        for f in files:
            data = json.loads(f.read_text())
            t = data["max_ms"].get(lowerings.REFERENCE)
            if not (isinstance(t, float) and t > 0):
                errors.append(f"{f.name}: the reference's time is {t!r} ({data['max_ms']})")
    if errors:
        errors.append(f"report:\n{rep.format()}")
    return errors


# --------------------------------------------------------------------------------------------------------
# Range-based dispatch: a symbolic row count.

DISPATCH_ROWS = (8, 128)  # tuned at these row counts (log-scale midpoint 33)


def test_symbolic_rows_dispatch_by_range(tmp_path, monkeypatch):
    """The decode block compiled with a symbolic token count: each site tuned at ``DISPATCH_ROWS`` while
    compiling, then kept (the unfused code won at both) or compiled with a table of choices by row count; calls
    at other row counts run without recompiling or tuning, each against eager."""
    try:
        errors = symbolic_rows_case(tmp_path, monkeypatch)
    finally:
        torch._dynamo.reset()
    assert_on_every_rank("\n".join(errors) or None)


def symbolic_rows_case(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    group = dist.group.WORLD
    torch._dynamo.reset()
    autotune.clear_memo()
    monkeypatch.setattr(fluxcompile.config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(fluxcompile.config, "dispatch_rows", DISPATCH_ROWS)
    seed = shared_seed()
    model = tp_block(seed, group, False)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    compiled = torch.compile(model, backend="fluxcompile", dynamic=True)
    tuning = Tuning(monkeypatch)
    errors: list[str] = []
    with torch.no_grad(), fresh_compiles(), fluxcompile.collect_reports() as rep:
        for i, rows in enumerate((16, 3, 33, 100, 300)):
            x = torch.randn(rows, DIM, device="cuda", dtype=BF16, generator=g)
            if i == 0:
                out, codes = run_and_get_code(compiled, x)
            else:
                out = compiled(x)
            err = rel_err(out, model(x))
            if not err <= TOLERANCE[BF16]:
                errors.append(f"{rows} rows: relative error {err:.3e}")
    if len(rep.graphs) != 1:
        errors.append(f"{len(rep.graphs)} graphs compiled for 5 row counts")
    entries = rep.entries()
    if len(tuning.picks) != len(DISPATCH_ROWS) * len(entries):
        errors.append(f"{len(tuning.picks)} compile-time picks for {len(entries)} sites at {DISPATCH_ROWS}")
    if tuning.at_run_time():
        errors.append(f"tuned again at run time: {tuning.at_run_time()}")
    for e in entries:
        if e.fused:
            spec = e.detail.rsplit(": ", 1)[-1]
            if "range-based dispatch" not in e.detail or not any(f"'{spec}'" in code for code in codes):
                errors.append(f"fused without its table in the generated call: {e.line().strip()}")
        elif not e.detail.startswith(f"{COMPILE_TIME} at rows"):
            errors.append(f"kept without the range reason: {e.line().strip()}")
    if errors:
        errors.append(f"report:\n{rep.format()}")
    return errors


# --------------------------------------------------------------------------------------------------------
# vLLM's way: one graph compiled for a symbolic token count, one CUDA graph captured per batch size.

BATCH_SIZES = (2, 3, 8, 16, 40, 64)  # captured, as vLLM captures its cudagraph_capture_sizes (1 would specialize)
PIECEWISE_REPLAYS = 100  # replays per batch size, each with fresh values in the captured input


@pytest.mark.parametrize("choose", ["cuda", "never"])
def test_captured_per_batch_size(choose, tmp_path, monkeypatch):
    """The decode block compiled once with a symbolic token count (``cuda``: range-based dispatch decided while
    compiling; ``never``: every site rewritten, its op tuned at its first call), then, as vLLM's CUDAGraphWrapper
    does, for each batch size a warm-up call and a ``torch.cuda.graph`` capture of the compiled function, then
    replays with fresh inputs copied into the captured input, each against eager with the output poisoned after.
    No tuning happens under capture or replay."""
    try:
        errors = captured_per_batch_size_case(choose, tmp_path, monkeypatch)
    finally:
        torch._dynamo.reset()
    assert_on_every_rank("\n".join(errors) or None)


def captured_per_batch_size_case(choose: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    group = dist.group.WORLD
    torch._dynamo.reset()
    autotune.clear_memo()
    monkeypatch.setattr(fluxcompile.config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(fluxcompile.config, "choose_at_compile", choose)
    monkeypatch.setattr(fluxcompile.config, "dispatch_rows", DISPATCH_ROWS)
    seed = shared_seed()
    model = tp_block(seed, group, False)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    compiled = torch.compile(model, backend="fluxcompile", dynamic=True)
    errors: list[str] = []
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
    pool = torch.cuda.graph_pool_handle()
    tuning = Tuning(monkeypatch)
    with torch.no_grad(), fresh_compiles(), fluxcompile.collect_reports() as rep:
        for bs in BATCH_SIZES:
            x = torch.randn(bs, DIM, device="cuda", dtype=BF16, generator=g)
            compiled(x)  # warm-up: compiles once (first size), chooses at run time under "never"
            torch.cuda.synchronize()
            before = (len(tuning.picks), len(tuning.selects))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = compiled(x)
            graphs[bs] = (graph, x, out)
            if (len(tuning.picks), len(tuning.selects)) != before:
                errors.append(f"batch {bs}: tuned under capture {tuning.selects} {tuning.picks}")
        for step in range(PIECEWISE_REPLAYS):
            for bs, (graph, x, out) in graphs.items():
                x.copy_(torch.randn(x.shape, device="cuda", dtype=BF16, generator=g))
                graph.replay()
                err = rel_err(out, model(x))
                if not err <= TOLERANCE[BF16]:
                    errors.append(f"batch {bs}, replay {step}: relative error {err:.3e}")
                out.fill_(float("nan"))
    if choose == "cuda" and tuning.at_run_time():
        errors.append(f"tuned at run time: {tuning.at_run_time()}")
    if len(rep.graphs) != 1:
        errors.append(f"{len(rep.graphs)} graphs compiled for {len(BATCH_SIZES)} batch sizes")
    if errors:
        errors = [*errors[:10], f"report:\n{rep.format()}"]
    return errors


# --------------------------------------------------------------------------------------------------------
# CUDA graph trees: mode="reduce-overhead".


def _recorded_graphs() -> int:
    """CUDA graphs the cudagraph-tree manager of this device holds (recorded, not warm-up runs)."""
    from torch._inductor import cudagraph_trees

    mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if mgr is None else sum(len(nodes) for nodes in mgr.roots.values())


@pytest.mark.parametrize("choose", ["cuda", "never"])
def test_reduce_overhead_replays_with_fresh_inputs(choose, tmp_path, monkeypatch):
    """The decode block under CUDA graph trees: compile + warm-up + recording, then ``STEPS`` replays with new
    values copied into the same input tensor, each against eager. ``never``: every site rewritten into its
    fused op, tuned at its first (warm-up) call, captured and replayed inside the trees."""
    try:
        errors = replays_case(choose, tmp_path, monkeypatch)
    finally:
        torch._dynamo.reset()  # also the CUDA graph trees and their memory pool
    assert_on_every_rank("\n".join(errors) or None)


def replays_case(
    choose: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, device: str = "cuda", dtype: torch.dtype = BF16,
    steps: int = STEPS,
) -> list[str]:  # fmt: skip
    """The test above; returns its failures (``device``, ``dtype``, ``steps``: for runs off the GPU, where
    Inductor compiles no CUDA graph)."""
    from torch._dynamo.utils import counters

    group = dist.group.WORLD
    cuda = device == "cuda"
    torch._dynamo.reset()
    autotune.clear_memo()
    monkeypatch.setattr(fluxcompile.config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(fluxcompile.config, "autotune", True)
    monkeypatch.setattr(fluxcompile.config, "choose_at_compile", choose)
    seed = shared_seed() if cuda else 1234
    model = tp_block(seed, group, False, device, dtype)
    x, _ = block_input(seed + 1, group, "decode", device, dtype)
    g = torch.Generator(device=device).manual_seed(seed + 2)  # the same fresh inputs on every rank
    compiled = torch.compile(model, backend="fluxcompile", mode="reduce-overhead", dynamic=False)
    tuning = Tuning(monkeypatch)
    counters.clear()
    tol = TOLERANCE[dtype]
    errors: list[str] = []
    errs = torch.full((steps,), float("nan"), device=device, dtype=torch.float64)
    with torch.no_grad():
        with fresh_compiles(), fluxcompile.collect_reports() as rep:
            first, codes = run_and_get_code(compiled, x)  # compile, then the trees' warm-up run
        err = rel_err(first, model(x))
        if not err <= tol:
            errors.append(f"warm-up call: relative error {err:.3e} > {tol:.0e}")
        del first
        compiled(x)  # recorded
        for i in range(steps):
            x.copy_(torch.randn(x.shape, device=device, dtype=dtype, generator=g))
            out = compiled(x)  # a replay, after the input was copied into the graph's own
            ref = model(x)
            d, r = out.double(), ref.double()
            errs[i] = (d - r).norm() / r.norm()  # NaN (an unwritten poisoned element) never passes below
            if i % FULL_EVERY == 0 or i == steps - 1:
                if why := elementwise_mismatch(out, ref, f"replay {i}"):
                    errors.append(why)
            out.fill_(float("nan"))  # poison: the next replay writes this memory again, all of it
            del out, ref, d, r
    bad = [(i, e) for i, e in enumerate(errs.tolist()) if not e <= tol]  # .tolist() waits for the GPU
    if bad:
        shown = ", ".join(f"{i}: {e:.3e}" for i, e in bad[:10])
        errors.append(f"{len(bad)} of {steps} replays off by more than {tol:.0e} (step: relative error) {shown}")
    if cuda:
        skips = counters["inductor"]["cudagraph_skips"]
        if skips:
            errors.append(f"CUDA graphs skipped {skips} time(s) (the cudagraphs log says why)")
        if not _recorded_graphs():
            errors.append("no CUDA graph recorded by the cudagraph trees")

    entries = rep.entries()
    if {e.collective for e in entries} != {"all_reduce"}:
        errors.append(f"collectives {sorted({e.collective for e in entries})}, expected the all-reduces")
    if choose == "never":
        # Every site rewritten; the fused ops chose at their first call (the trees' warm-up, before capture).
        fused = Counter(e.fused_op for e in entries if e.fused)
        if fused != Counter({"all_reduce_rmsnorm": 1, "matmul_all_reduce": 1}):
            errors.append(f"fused {dict(fused)}, expected one all_reduce_rmsnorm and one matmul_all_reduce")
        if tuning.picks:
            errors.append(f"decided at compile time under choose_at_compile='never': {tuning.picks}")
        calls = fused_calls(codes)
        if calls != fused:
            errors.append(f"fused op calls in the generated code {dict(calls)}, report {dict(fused)}")
    else:
        errors += check_decisions(rep, tuning, codes, group.size())
    if errors:
        errors.append(f"report:\n{rep.format()}")
    return errors
