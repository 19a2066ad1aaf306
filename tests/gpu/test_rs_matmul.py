"""matmul_reduce_scatter on GPUs: each choice against the reference on fresh inputs, in poisoned memory,
repeatedly, with shapes alternating without synchronization, in CUDA graphs, on a second group, and through
the op's CUDA dispatch (autotuned)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import poison_allocator, require_sequencer, shared_seed

from fluxcompile import config, ops
from fluxcompile.lowerings import choices_for
from fluxcompile.lowerings.matmul_reduce_scatter import triton as triton_choice
from fluxcompile.symm_mem import workspace
from fluxcompile.testing.numerics import assert_close

BF16 = torch.bfloat16
pytestmark = pytest.mark.peers  # the choices under test decline a 1-rank group
OP = "matmul_reduce_scatter"
REF = ops.REFERENCES[OP]  # the oracle: cuBLAS + NCCL reduce-scatter

# The Triton choice, off by default (kernels/gemm_rs.py): validated here before it may be enabled by default.
TRITON = [f"triton:{triton_choice.PORTABLE}"]  # the one registered
CHOICES = ["cublas_pipelined", "cublas_pipelined:push", "cublas_pipelined:unsplit", "cublas_pipelined:addmm",
           "cublas_pipelined:pushadd", "cublas_pipelined:tail2",
           "cublas_pipelined:tail8", "cublas_pipelined:stages2", "cublas_pipelined:stages3", "torch_symm_mem",
           *TRITON]  # fmt: skip
TAGS = {"cublas_pipelined": "matmul_reduce_scatter", "triton": "matmul_reduce_scatter.triton"}

# (name, rows per rank, form, N, K of each product, bias); forms: "2d" [M, N] on dim 0, "sp" [1, M, N] on
# dim 1 (sequence parallel), "3d" [2 * world, M / (2 * world), N] on dim 0 (leading dims that keep rows whole).
CASES = [
    ("plain", 512, "2d", 384, (256,), False),
    ("ragged-bias", 333, "2d", 200, (96,), True),  # ragged rows and N
    ("sp-bias", 77, "sp", 128, (128,), True),
    ("two-products", 200, "2d", 264, (128, 192), True),  # the backward's g1 @ W1 + g3 @ W3
    ("3d", 128, "3d", 96, (64,), False),
]


def _case_args(case, group, seed):
    _, rows, form, n, ks, bias = case
    w = group.size()
    m = w * rows
    out_shape, dim = {"2d": ([m, n], 0), "sp": ([1, m, n], 1), "3d": ([2 * w, rows // 2, n], 0)}[form]
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
    # Every rank has its own operands and bias (the contract adds each rank's bias into its partial).
    As = [torch.randn(m, k, device="cuda", dtype=BF16, generator=g) for k in ks]
    Bs = [torch.randn(k, n, device="cuda", dtype=BF16, generator=g) / k**0.5 for k in ks]
    Bs = [b.t().contiguous().t() if i % 2 else b for i, b in enumerate(Bs)]  # nn.Linear layout too
    b = torch.randn(n, device="cuda", dtype=BF16, generator=g) if bias else None
    return (As, Bs, b, out_shape, dim, "sum", w, group.group_name)


def _refresh(args) -> None:
    """Fresh values in the same tensors (what a CUDA graph replays on)."""
    for a in args[0]:
        a.normal_()
    if args[2] is not None:
        args[2].normal_()


def _choice(name: str, monkeypatch):
    if name.startswith("cublas_pipelined"):
        require_sequencer()
    if ":stages" in name:
        monkeypatch.setattr(config, "implementations", ("+rs_stages",))  # off by default: validated here
    if name.startswith("triton:"):
        monkeypatch.setattr(config, "implementations", ("+triton_rs",))
        monkeypatch.setattr(config, "check_signals", True)  # a timed-out wait fails the test at once
    return {c.name: c for c in choices_for(OP)}[name]


def _supported_or_skip(choice, args) -> None:
    why = choice.supports(*args)
    if why is not None:
        if choice.name == "torch_symm_mem" and (args[2] is not None or len(args[0]) > 1):
            pytest.skip(f"torch_symm_mem: {why}")
        if (":tail" in choice.name or ":pushadd" in choice.name) and "is under 64" in why:
            pytest.skip(f"{choice.name}: {why}")
        if (":addmm" in choice.name or ":pushadd" in choice.name) and "two ranks only" in why:
            pytest.skip(f"{choice.name}: {why}")
        raise AssertionError(f"{choice.name} declines: {why}")


def _poison_workspace(name: str, group_name: str) -> None:
    """NaN (all-ones bytes) over this rank's slots, with every rank idle: a slot a call forgets shows."""
    tag = TAGS[name.partition(":")[0]] if not name.startswith("torch") else None
    if tag is None:
        return
    torch.cuda.synchronize()
    dist.barrier()
    workspace(group_name, 1, tag=tag).buffer.fill_(255)
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.parametrize("name", CHOICES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_choice_matches_reference(monkeypatch, name, case):
    choice = _choice(name, monkeypatch)
    args = _case_args(case, dist.group.WORLD, shared_seed())
    _supported_or_skip(choice, args)
    for i in range(3):  # repeated calls reuse the workspace and flags: stale data must never show
        if i:
            _poison_workspace(name, args[-1])
        poison_allocator()
        got = choice.fn(*args)
        ref = REF(*args)
        assert got.shape == ref.shape and got.stride() == ref.stride() and got.dtype == ref.dtype
        assert_close(got, ref, 1e-2, f"{name} {case[0]} call {i}")
        _refresh(args)


@pytest.mark.parametrize(
    "name", ["cublas_pipelined", "cublas_pipelined:push", "cublas_pipelined:unsplit", "cublas_pipelined:addmm",
             "cublas_pipelined:pushadd", "cublas_pipelined:tail8", "cublas_pipelined:stages2", TRITON[0]]
)  # fmt: skip
def test_alternating_shapes_without_sync(monkeypatch, name):
    """Calls of different shapes back to back (other slot offsets), no host synchronization between them:
    the done handshake (cuBLAS) / parity slots (Triton) must keep a fast rank off slots still being read."""
    choice = _choice(name, monkeypatch)
    group = dist.group.WORLD
    seed = shared_seed()
    cases = [_case_args(CASES[0], group, seed), _case_args(CASES[3], group, seed + 1)]
    for args in cases:
        _supported_or_skip(choice, args)
        choice.fn(*args)  # warm-up: workspace at its largest
    torch.cuda.synchronize()
    outs, refs = [], []
    for i in range(6):
        args = cases[i % 2]
        _refresh(args)
        refs.append(REF(*args))  # NCCL on the same stream, between the calls
        outs.append(choice.fn(*args))
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert_close(o, r, 1e-2, f"{name} call {i}")


@pytest.mark.parametrize(
    "name", ["cublas_pipelined", "cublas_pipelined:push", "cublas_pipelined:unsplit", "cublas_pipelined:addmm",
             "cublas_pipelined:pushadd", "cublas_pipelined:tail2", "cublas_pipelined:stages2", "torch_symm_mem",
             TRITON[0]]
)  # fmt: skip
def test_in_cuda_graph(monkeypatch, name):
    choice = _choice(name, monkeypatch)
    case = CASES[2] if name != "torch_symm_mem" else ("sp", 77, "sp", 128, (128,), False)
    if ":tail" in name or ":pushadd" in name:
        case = CASES[1]  # 333 rows: a ragged tail of 128 (pushadd: 128 rows first, 205 with the peer's)
    args = _case_args(case, dist.group.WORLD, shared_seed())
    _supported_or_skip(choice, args)
    choice.fn(*args)  # warm-up: creates the workspace and flags outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = choice.fn(*args)
    for i in range(5):
        _refresh(args)
        static_out.fill_(float("nan"))
        graph.replay()
        ref = REF(*args)
        assert_close(static_out, ref, 1e-2, f"{name} replay {i}")
    # An eager call after the replays still agrees (flags/epochs left consistent by the graph).
    _refresh(args)
    assert_close(choice.fn(*args), REF(*args), 1e-2, f"{name} eager after graph")


@pytest.mark.parametrize("name", ["cublas_pipelined", "cublas_pipelined:unsplit", TRITON[0]])
def test_second_group_gets_its_own_workspace(monkeypatch, name):
    choice = _choice(name, monkeypatch)
    world = dist.group.WORLD
    other = dist.new_group(list(range(world.size())))
    seed = shared_seed()
    for g in (world, other, world):
        args = _case_args(CASES[1], g, seed)
        _supported_or_skip(choice, args)
        assert_close(choice.fn(*args), REF(*args), 1e-2, f"group {g.group_name}")
    tag = TAGS[name.partition(":")[0]]
    w1 = workspace(world.group_name, 1, tag=tag)
    w2 = workspace(other.group_name, 1, tag=tag)
    assert w1.buffer.data_ptr() != w2.buffer.data_ptr()


def test_dispatch_picks_a_choice_and_matches_reference():
    """Through torch.ops.fluxcompile (the autotuner picks, the same on every rank), then in a CUDA graph."""
    from fluxcompile.lowerings import autotune

    args = _case_args(CASES[3], dist.group.WORLD, shared_seed())
    poison_allocator()
    got = torch.ops.fluxcompile.matmul_reduce_scatter(*args)
    assert_close(got, REF(*args), 1e-2, "dispatch")
    picked = torch.tensor([ord(c) for c in autotune.pick(OP, args, args[-1]).name.ljust(40)], device="cuda")
    everyone = [torch.empty_like(picked) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, picked)
    assert all(torch.equal(picked, x) for x in everyone), "ranks picked different choices"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.fluxcompile.matmul_reduce_scatter(*args)
    for i in range(3):
        _refresh(args)
        graph.replay()
        assert_close(static_out, REF(*args), 1e-2, f"dispatch replay {i}")
