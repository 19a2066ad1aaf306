"""The all-gather's shard produced straight into symmetric memory (lowerings/comm_buffers.py) on GPUs.

Any world size (one GPU too), with every matched site rewritten (``choose_at_compile="never"``: at one rank the
compile-time choice would keep it):

* a shard produced by an Inductor kernel (an RMSNorm, a relu) with static sizes: the generated code allocates its
  buffer with ``empty_strided_p2p`` and hands that buffer to the fused op; outputs equal eager on fresh inputs;
* a shard that is a graph input, or has symbolic sizes: no ``empty_strided_p2p``, outputs still right;
* ``mode="reduce-overhead"``: replays with new values in the input, each against eager.

Between ranks only (``peers``), where torch tells symmetric tensors apart (``is_symm_mem_tensor``): async_input_mm's
pull path, peers reading the shard straight from its owner's symmetric A, eager and in a CUDA graph, with A
rewritten right after each call (a peer still pulling would read the next call's values); and a compiled model
running that choice.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import assert_on_every_rank, shared_seed
from torch import nn
from torch._inductor.utils import run_and_get_code

import fluxcompile
from fluxcompile import ops
from fluxcompile.lowerings import autotune
from fluxcompile.lowerings.all_gather_matmul import async_input_mm
from fluxcompile.symm_mem.tensors import can_tell_symmetric
from fluxcompile.testing import fresh_compiles
from fluxcompile.testing.numerics import rel_err

BF16 = torch.bfloat16
TOL = 1e-2
REPLAYS = 50
DIM, N = 256, 384
REF = ops.REFERENCES["all_gather_matmul"]
# Where torch cannot tell a symmetric tensor, no choice could read the shard there, so none is realized.
SYMMETRIC = can_tell_symmetric()
c10d = torch.ops._c10d_functional
_P2P = re.compile(r"\b(\w+) = empty_strided_p2p\(")
_FUSED = re.compile(
    r"(?:extern_kernels\.fluxcompile_all_gather_matmul|torch\.ops\.fluxcompile\.all_gather_matmul\.default)\("
    r"(?:reinterpret_tensor\()?(\w+)"
)


class _Gather(nn.Module):
    """``producer(x)`` all-gathered on the rows, then one matmul (a column-parallel linear, sequence parallel)."""

    def __init__(self, producer: str, world: int, group_name: str, seed: int) -> None:
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.producer, self.world, self.group_name = producer, world, group_name
        self.norm = nn.RMSNorm(DIM, eps=1e-6, device="cuda", dtype=BF16)
        self.w = nn.Parameter(torch.randn(DIM, N, device="cuda", dtype=BF16, generator=g) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = {"rmsnorm": self.norm, "relu": torch.relu, "input": lambda t: t}[self.producer](x)
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(h, self.world, self.group_name))
        return gathered @ self.w


def _fresh(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
    return torch.randn(rows, DIM, device="cuda", dtype=BF16, generator=g)


def _setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, **fields: Any) -> None:
    torch._dynamo.reset()
    autotune.clear_memo()
    monkeypatch.setattr(fluxcompile.config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(fluxcompile.config, "choose_at_compile", "never")
    for name, value in fields.items():
        monkeypatch.setattr(fluxcompile.config, name, value)


def _p2p_shard_of_fused(code: str) -> tuple[list[str], list[str]]:
    """(buffers allocated with empty_strided_p2p, the first argument of each fused op call)."""
    return _P2P.findall(code), _FUSED.findall(code)


def _check_code(code: str, want_p2p: bool) -> list[str]:
    p2p, shards = _p2p_shard_of_fused(code)
    errors = []
    if len(shards) != 1:
        errors.append(f"{len(shards)} fused all_gather_matmul call(s) in the generated code, expected 1")
    if want_p2p and not (p2p and shards and shards[0] in p2p):
        errors.append(f"the fused op's shard {shards} is not a buffer allocated with empty_strided_p2p {p2p}")
    if not want_p2p and p2p:
        errors.append(f"buffers allocated with empty_strided_p2p: {p2p}")
    return errors


def _run_case(producer: str, dynamic: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[str]:
    group = dist.group.WORLD
    _setup(monkeypatch, tmp_path)
    seed = shared_seed()
    model = _Gather(producer, group.size(), group.group_name, seed)
    rows = 128
    x = _fresh(rows, seed + 1)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(model, backend="fluxcompile", dynamic=dynamic)
    with torch.no_grad(), fresh_compiles():
        out, codes = run_and_get_code(compiled, x)
        want = producer != "input" and not dynamic and SYMMETRIC
        errors = _check_code("\n".join(codes), want_p2p=want)
        for i in range(5):
            err = rel_err(out, model(x))
            if not err <= TOL:
                errors.append(f"call {i}: relative error {err:.3e} > {TOL:.0e}")
            x = _fresh(rows + (64 * (i + 1) if dynamic else 0), seed + 2 + i)
            out = compiled(x)
    if errors:
        errors.append("generated code:\n" + "\n".join(codes))
    return errors


@pytest.mark.parametrize(
    ("producer", "dynamic"), [("rmsnorm", False), ("relu", False), ("input", False), ("rmsnorm", True)]
)
def test_shard_produced_in_symmetric_memory(producer, dynamic, monkeypatch, tmp_path):
    try:
        errors = _run_case(producer, dynamic, monkeypatch, tmp_path)
    finally:
        torch._dynamo.reset()
    assert_on_every_rank("\n".join(errors) or None)


def _replays(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[str]:
    from torch._dynamo.utils import counters

    group = dist.group.WORLD
    _setup(monkeypatch, tmp_path)
    seed = shared_seed()
    model = _Gather("rmsnorm", group.size(), group.group_name, seed)
    x = _fresh(128, seed + 1)
    counters.clear()
    compiled = torch.compile(model, backend="fluxcompile", mode="reduce-overhead", dynamic=False)
    errors: list[str] = []
    with torch.no_grad(), fresh_compiles():
        first, codes = run_and_get_code(compiled, x)  # compile, then the trees' warm-up run
        errors += _check_code("\n".join(codes), want_p2p=SYMMETRIC)
        err = rel_err(first, model(x))
        if not err <= TOL:
            errors.append(f"warm-up call: relative error {err:.3e} > {TOL:.0e}")
        del first
        compiled(x)  # recorded
        for i in range(REPLAYS):
            x.copy_(_fresh(128, seed + 2 + i))
            out = compiled(x)
            err = rel_err(out, model(x))
            if not err <= TOL:
                errors.append(f"replay {i}: relative error {err:.3e} > {TOL:.0e}")
            out.fill_(float("nan"))  # the next replay must write it all again
            del out
    if counters["inductor"]["cudagraph_skips"]:
        errors.append(f"CUDA graphs skipped {counters['inductor']['cudagraph_skips']} time(s)")
    return errors


def test_reduce_overhead_replays(monkeypatch, tmp_path):
    try:
        errors = _replays(monkeypatch, tmp_path)
    finally:
        torch._dynamo.reset()
    assert_on_every_rank("\n".join(errors) or None)


# --------------------------------------------------------------------------------------------------------
# Between ranks: async_input_mm's pull path.


def _symmetric(rows: int) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm

    return symm.empty(rows, DIM, dtype=BF16, device=torch.device("cuda", torch.cuda.current_device()))


def _skip_without_symmetric_check() -> None:
    if not can_tell_symmetric():
        pytest.skip(f"torch {torch.__version__} has no is_symm_mem_tensor: every shard is copied")


def _pull_args(rows: int, seed: int) -> tuple:
    _skip_without_symmetric_check()
    group = dist.group.WORLD
    A = _symmetric(rows)
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = torch.randn(DIM, N, device="cuda", dtype=BF16, generator=g) / DIM**0.5
    args = (A, [b], [None], 0, group.size(), group.group_name)
    why = async_input_mm.supports(*args)
    if why is not None and "not in this torch" in why:
        pytest.skip(why)
    assert why is None, why
    return args


def _check_calls(
    args: tuple, inputs: list[torch.Tensor], results: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[str]:
    errors = []
    for i, (x, (got_A, got)) in enumerate(zip(inputs, results)):
        ref_A, ref = REF(x, *args[1:])
        if not torch.equal(got_A, ref_A):
            errors.append(f"call {i}: gathered A differs from the all-gather of the inputs")
        err = rel_err(got, ref[0])
        if not err <= TOL:
            errors.append(f"call {i}: relative error {err:.3e} > {TOL:.0e}")
    return errors


@pytest.mark.peers
def test_async_input_mm_pulls_from_symmetric_shards():
    seed = shared_seed()
    args = _pull_args(256, seed)
    A = args[0]
    source = async_input_mm.symmetric_source(A, args[-1])
    errors = [] if source is not None else ["the symmetric shard was not recognized (no pull path in this torch?)"]
    inputs = [_fresh(256, seed + 1 + i) for i in range(8)]
    results = []
    for x in inputs:  # back to back: A is rewritten right after each call, as the next producer would
        A.copy_(x)
        got_A, got = async_input_mm.all_gather_matmul(*args)
        results.append((got_A, got[0]))
    A.fill_(float("nan"))
    errors += _check_calls(args, inputs, results)
    assert_on_every_rank("\n".join(errors) or None)


@pytest.mark.peers
def test_async_input_mm_pulls_in_a_cuda_graph():
    seed = shared_seed()
    args = _pull_args(256, seed)
    A = args[0]
    A.copy_(_fresh(256, seed))
    async_input_mm.all_gather_matmul(*args)  # eager first: flags, rendezvous
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_A, static_outs = async_input_mm.all_gather_matmul(*args)
    inputs = [_fresh(256, seed + 1 + i) for i in range(5)]
    results = []
    for x in inputs:
        A.copy_(x)
        graph.replay()
        results.append((static_A.clone(), static_outs[0].clone()))
    A.fill_(float("nan"))
    assert_on_every_rank("\n".join(_check_calls(args, inputs, results)) or None)


@pytest.mark.peers
def test_compiled_model_runs_the_pull_path(monkeypatch, tmp_path):
    """The compiled RMSNorm -> all-gather -> matmul with async_input_mm as the fixed choice: its shard comes from
    empty_strided_p2p, and the op takes the pull path on it."""
    _skip_without_symmetric_check()
    group = dist.group.WORLD
    try:
        _setup(monkeypatch, tmp_path, autotune=False, implementations=("async_input_mm", "reference"))
        seed = shared_seed()
        model = _Gather("rmsnorm", group.size(), group.group_name, seed)
        pulled: list[bool] = []
        gather = async_input_mm.symmetric_source

        def recording(a: torch.Tensor, group_name: str):
            source = gather(a, group_name)
            pulled.append(source is not None)
            return source

        monkeypatch.setattr(async_input_mm, "symmetric_source", recording)
        compiled = torch.compile(model, backend="fluxcompile", dynamic=False)
        errors: list[str] = []
        with torch.no_grad(), fresh_compiles():
            x = _fresh(256, seed + 1)
            out, codes = run_and_get_code(compiled, x)
            errors += _check_code("\n".join(codes), want_p2p=True)
            for i in range(5):
                err = rel_err(out, model(x))
                if not err <= TOL:
                    errors.append(f"call {i}: relative error {err:.3e} > {TOL:.0e}")
                x = _fresh(256, seed + 2 + i)
                out = compiled(x)
        if not pulled or not all(pulled):
            errors.append(f"async_input_mm calls that pulled from the symmetric shard: {pulled}")
    finally:
        torch._dynamo.reset()
    assert_on_every_rank("\n".join(errors) or None)
