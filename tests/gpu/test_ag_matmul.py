"""all_gather_matmul on GPUs: each implementation against the reference, in eager and in CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import poison_allocator, require_sequencer, shared_seed

from fluxcompile import config, ops
from fluxcompile.lowerings.all_gather_matmul import cublas_pipelined as pipelined
from fluxcompile.lowerings.all_gather_matmul import triton as triton_choice
from fluxcompile.testing.numerics import assert_close

BF16 = torch.bfloat16
pytestmark = pytest.mark.peers  # the choices under test decline a 1-rank group
REF = ops.REFERENCES["all_gather_matmul"]  # the oracle: NCCL all-gather + cuBLAS


def _inputs(shard_shape, ns, bias, gen_seed):
    g = torch.Generator(device="cuda").manual_seed(gen_seed + 7919 * dist.get_rank())
    k = shard_shape[-1]
    A = torch.randn(shard_shape, device="cuda", dtype=BF16, generator=g)
    # Weights and biases equal on all ranks is not required: each rank multiplies by its own shard.
    Bs = [torch.randn(k, n, device="cuda", dtype=BF16, generator=g) / k**0.5 for n in ns]
    biases = [torch.randn(n, device="cuda", dtype=BF16, generator=g) if bias else None for n in ns]
    return A, Bs, biases


CASES = [
    # shard shape, gather dim, weight widths, bias
    ((512, 256), 0, (384,), False),
    ((333, 200), 0, (96, 40, 264), True),  # ragged rows and widths, three weights (q, k, v)
    ((1, 77, 128), 1, (128, 64), True),  # sequence-parallel [1, S/w, K], gathered on the sequence dim
    ((4, 64, 128), 0, (256,), False),  # ND shard gathered on dim 0
    ((330, 128), 0, (200, 56), True),  # ragged rows whose slots still abut (the lead variants run)
]


VARIANTS = {
    "split": {},
    "concurrent": {"concurrent": True},
    "unsplit": {"unsplit": True},
    "lead2": {"lead": 2},
    "lead4": {"lead": 4},
    "stages2": {"groups": 2},  # off by default (family ag_stages, added here)
    "stages3": {"groups": 3},
}


def _skip_if_declined(variant: str, args: tuple) -> None:
    d = VARIANTS[variant].get("lead")
    if d:
        reason = pipelined.lead_supports(d)(*args)
        if reason is not None:
            pytest.skip(f"lead{d} declines: {reason}")
    g = VARIANTS[variant].get("groups")
    if g:
        reason = pipelined.stages_supports(g)(*args)
        if reason is not None:
            pytest.skip(f"stages{g} declines: {reason}")


def _gather_matmul(variant: str, args: tuple, return_A: bool = True):
    """The variant's all_gather_matmul (C++ sequencer)."""
    return pipelined.all_gather_matmul(*args, **VARIANTS[variant], return_A=return_A)


def _check_gathered(got_A, ref_A, return_A: bool, what: str) -> None:
    """The gathered operand as the reference has it, or None where the caller did not ask for it."""
    if return_A:
        assert_close(got_A, ref_A, 0.0, what)
    else:
        assert got_A is None, f"{what}: returned with return_A=False"


@pytest.fixture(autouse=True)
def _stages_enabled():
    with config.patch(implementations=("+ag_stages",)):
        yield


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(("shape", "dim", "ns", "bias"), CASES)
def test_pipelined_matches_reference(shape, dim, ns, bias, variant):
    require_sequencer()
    group = dist.group.WORLD
    A, Bs, biases = _inputs(shape, ns, bias, shared_seed())
    args = (A, Bs, biases, dim, group.size(), group.group_name)
    assert pipelined.supports(*args) is None
    _skip_if_declined(variant, args)
    ref_A, ref_outs = REF(*args)
    for call in range(3):  # repeated calls reuse the workspace: stale data must never show
        poison_allocator()
        return_A = call != 1  # the second call does not ask for the gathered operand
        got_A, got_outs = _gather_matmul(variant, args, return_A)
        _check_gathered(got_A, ref_A, return_A, "gathered A")
        for i, (o, r) in enumerate(zip(got_outs, ref_outs)):
            assert o.shape == r.shape and o.stride() == r.stride()
            assert_close(o, r, 1e-2, f"out {i}")
        A.normal_()
        args = (A, Bs, biases, dim, group.size(), group.group_name)
        ref_A, ref_outs = REF(*args)


def test_pipelined_declines_interleaved_rows():
    A = torch.randn(2, 8, 16, device="cuda", dtype=BF16)
    reason = pipelined.supports(A, [torch.randn(16, 8, device="cuda", dtype=BF16)], [None], 1, 2, "0")
    assert reason and "leading dim" in reason


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pipelined_in_cuda_graph(variant):
    require_sequencer()
    group = dist.group.WORLD
    A, Bs, biases = _inputs((256, 512), (640, 128), True, shared_seed())
    args = lambda: (A, Bs, biases, 0, group.size(), group.group_name)  # noqa: E731
    _gather_matmul(variant, args())  # warm-up: workspace made outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_A, static_outs = _gather_matmul(variant, args())
    for _ in range(5):
        A.copy_(torch.randn_like(A))  # fresh inputs, same addresses
        graph.replay()
        ref_A, ref_outs = REF(*args())
        assert_close(static_A, ref_A, 0.0, "gathered A (graph)")
        for i, (o, r) in enumerate(zip(static_outs, ref_outs)):
            assert_close(o, r, 1e-2, f"out {i} (graph)")


def test_second_group_gets_its_own_workspace():
    from fluxcompile.symm_mem import workspace

    world = dist.group.WORLD
    other = dist.new_group(list(range(world.size())))
    A, Bs, biases = _inputs((128, 64), (32,), False, shared_seed())
    for g in (world, other):
        got_A, got = pipelined.all_gather_matmul(A, Bs, biases, 0, g.size(), g.group_name)
        ref_A, ref = REF(A, Bs, biases, 0, g.size(), g.group_name)
        assert_close(got_A, ref_A, 0.0, f"gathered A, group {g.group_name}")
        assert_close(got[0], ref[0], 1e-2, f"group {g.group_name}")
    w1 = workspace(world.group_name, 1, tag="all_gather_matmul")
    w2 = workspace(other.group_name, 1, tag="all_gather_matmul")
    assert w1.buffer.data_ptr() != w2.buffer.data_ptr()


def test_torch_symm_mem_return_A():
    """PyTorch's fused_all_gather_matmul takes return_A itself: the choice passes it."""
    from fluxcompile.lowerings.all_gather_matmul import torch_symm_mem

    group = dist.group.WORLD
    A, Bs, _ = _inputs((256, 128), (192, 64), False, shared_seed())
    args = (A, Bs, [None, None], 0, group.size(), group.group_name)
    why = torch_symm_mem.supports(*args)
    if why is not None:
        pytest.skip(why)
    ref_A, ref = REF(*args)
    for return_A in (True, False):
        got_A, got = torch_symm_mem.all_gather_matmul(*args, return_A=return_A)
        _check_gathered(got_A, ref_A, return_A, f"gathered A (return_A={return_A})")
        for i, (o, r) in enumerate(zip(got, ref)):
            assert_close(o, r, 1e-2, f"out {i} (return_A={return_A})")


# The Triton choice, off by default (kernels/ag_gemm.py): validated here before it may be enabled by default.
TRITON_VARIANTS = sorted(triton_choice.VARIANTS)


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
@pytest.mark.parametrize(("shape", "dim", "ns", "bias"), CASES)
def test_triton_matches_reference(monkeypatch, variant, shape, dim, ns, bias):
    monkeypatch.setattr(config, "implementations", ("+triton_ag",))
    monkeypatch.setattr(config, "check_signals", True)  # a timed-out wait fails the test at once
    group = dist.group.WORLD
    A, Bs, biases = _inputs(shape, ns, bias, shared_seed())
    args = (A, Bs, biases, dim, group.size(), group.group_name)
    run, supports = triton_choice.make(variant)
    assert supports(*args) is None
    for call in range(3):
        poison_allocator()
        return_A = call != 1  # the second call does not ask for the gathered operand: the kernel stores no A
        got_A, got = run(*args, return_A=return_A)
        ref_A, ref = REF(*args)
        _check_gathered(got_A, ref_A, return_A, "gathered A")
        for i, (o, r) in enumerate(zip(got, ref)):
            assert_close(o, r, 1e-2, f"{variant} out {i}")
        A.normal_()


def test_triton_in_cuda_graph(monkeypatch):
    monkeypatch.setattr(config, "implementations", ("+triton_ag",))
    group = dist.group.WORLD
    A, Bs, biases = _inputs((256, 512), (640, 128), True, shared_seed())
    args = (A, Bs, biases, 0, group.size(), group.group_name)
    run, _ = triton_choice.make(TRITON_VARIANTS[0])
    run(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_A, static_outs = run(*args)
    for _ in range(5):
        A.copy_(torch.randn_like(A))
        graph.replay()
        ref_A, ref = REF(*args)
        assert_close(static_A, ref_A, 0.0, "gathered A (graph)")
        for i, (o, r) in enumerate(zip(static_outs, ref)):
            assert_close(o, r, 1e-2, f"out {i} (graph)")
