"""The fp8 (scaled) choices of all_gather_matmul and matmul_reduce_scatter on GPUs, against the reference (NCCL +
``torch._scaled_mm``): tensor-wise and row-wise scales, bias, ragged rows, two products, e4m3 x e5m2 (the
backward's gradients), repeated calls on poisoned memory, and a CUDA graph replayed on fresh inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import poison_allocator, require_sequencer, shared_seed

from fluxcompile import ops
from fluxcompile.lowerings import choices_for
from fluxcompile.lowerings.choices import scaled
from fluxcompile.testing.numerics import assert_close

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
pytestmark = pytest.mark.peers  # the choices under test decline a 1-rank group

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
AG_CHOICES = ["cublas_pipelined", "cublas_pipelined:concurrent", "cublas_pipelined:unsplit", "torch_symm_mem"]
RS_CHOICES = ["cublas_pipelined", "cublas_pipelined:push", "cublas_pipelined:unsplit", "cublas_pipelined:tail2",
              "torch_symm_mem"]  # fmt: skip

# (name, rows per rank, K, N per weight, bias, row-wise, A dtype)
AG_CASES = [
    ("tensorwise", 512, 256, (384,), False, False, E4M3),
    ("ragged-bias-qkv", 333, 128, (96, 48, 256), True, False, E4M3),
    ("grad-e5m2", 200, 256, (128,), False, False, E5M2),
    ("rowwise", 256, 128, (256,), False, True, E4M3),  # only PyTorch's choice gathers row-wise A scales
]
RS_CASES = [
    ("tensorwise", 512, (256,), 384, False, False, E4M3),
    ("ragged-bias", 333, (128,), 208, True, False, E4M3),
    ("rowwise-bias", 256, (256,), 128, True, True, E4M3),
    ("two-products-grad", 200, (128, 256), 256, False, False, E5M2),  # the backward's g1 @ W1 + g3 @ W3
]


def _fp8(shape, dtype, g, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)


def _scale(shape, g) -> torch.Tensor:
    return torch.rand(shape, device="cuda", generator=g) * 0.5 + 0.75


def _weight(k: int, n: int, g) -> torch.Tensor:
    return _fp8((n, k), E4M3, g, 0.5).t()  # column-major, as _scaled_mm takes it (nn.Linear's weight.t())


def _ag_args(case, seed):
    _, rows, k, ns, bias, rowwise, dtype = case
    group = dist.group.WORLD
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
    A = _fp8((rows, k), dtype, g)
    Bs = [_weight(k, n, g) for n in ns]
    biases = [torch.randn(n, device="cuda", dtype=BF16, generator=g) if bias else None for n in ns]
    A_scale = _scale((rows, 1) if rowwise else (), g)
    B_scales = [_scale((1, n) if rowwise else (), g) for n in ns]
    return (A, Bs, biases, 0, group.size(), group.group_name, A_scale, B_scales, BF16, True)


def _rs_args(case, seed):
    _, rows, ks, n, bias, rowwise, dtype = case
    group = dist.group.WORLD
    m = rows * group.size()
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * dist.get_rank())
    As = [_fp8((m, k), dtype, g) for k in ks]
    Bs = [_weight(k, n, g) for k in ks]
    b = torch.randn(n, device="cuda", dtype=BF16, generator=g) if bias else None
    A_scales = [_scale((m, 1) if rowwise else (), g) for _ in ks]
    B_scales = [_scale((1, n) if rowwise else (), g) for _ in ks]
    return (As, Bs, b, [m, n], 0, "sum", group.size(), group.group_name, A_scales, B_scales, BF16, False)


def _choice(op: str, name: str):
    if name.startswith("cublas_pipelined"):
        require_sequencer()
    return {c.name: c for c in choices_for(scaled(op))}[name]


def _outs(op: str, result) -> list[torch.Tensor]:
    return list(result[1]) if op == AG else [result]


def _refresh(op: str, args) -> None:
    """New values in the same tensors (what a CUDA graph replays on)."""
    for a in [args[0]] if op == AG else args[0]:
        a.copy_(torch.randn(a.shape, device="cuda").to(a.dtype))


def _check(op: str, name: str, args) -> None:
    choice = _choice(op, name)
    why = choice.declines(*args)
    if why is not None:
        if (name != "torch_symm_mem" and "row-wise A scale" in why) or (
            name == "torch_symm_mem" and "one product" in why
        ):
            pytest.skip(f"{name}: {why}")
        if ":tail" in name and "is under 64" in why:
            pytest.skip(f"{name}: {why}")
        raise AssertionError(f"{name} declines: {why}")
    ref_fn = ops.REFERENCES[op]
    for call in range(3):  # repeated calls reuse the workspace and flags: stale data must never show
        poison_allocator()
        got, ref = _outs(op, choice.fn(*args)), _outs(op, ref_fn(*args))
        for i, (o, r) in enumerate(zip(got, ref)):
            assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
            assert_close(o, r, 1e-2, f"{name} out {i} call {call}")
        if op == AG:
            got_A = choice.fn(*args)[0]
            assert torch.equal(got_A.view(torch.uint8), ref_fn(*args)[0].view(torch.uint8)), "gathered fp8 bytes"
        _refresh(op, args)
    # A CUDA graph of the call (after the eager calls made its workspace, flags and plan), replayed on new inputs.
    if name == "torch_symm_mem":
        return
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _outs(op, choice.fn(*args))
    for replay in range(2):
        _refresh(op, args)
        for o in captured:
            o.fill_(float("nan"))
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, r) in enumerate(zip(captured, _outs(op, ref_fn(*args)))):
            assert_close(o, r, 1e-2, f"{name} out {i} replay {replay}")


@pytest.mark.parametrize("name", AG_CHOICES)
@pytest.mark.parametrize("case", AG_CASES, ids=[c[0] for c in AG_CASES])
def test_scaled_all_gather_matmul(name, case):
    _check(AG, name, _ag_args(case, shared_seed()))


@pytest.mark.parametrize("name", RS_CHOICES)
@pytest.mark.parametrize("case", RS_CASES, ids=[c[0] for c in RS_CASES])
def test_scaled_matmul_reduce_scatter(name, case):
    _check(RS, name, _rs_args(case, shared_seed()))


def test_scaled_dispatch_through_the_op():
    """The op's CUDA implementation with scales picks a scaled choice (autotuned) and matches the reference."""
    args = _rs_args(RS_CASES[0], shared_seed())
    got = ops.op(RS)(*args)
    assert_close(got, ops.REFERENCES[RS](*args), 1e-2, "dispatched scaled reduce-scatter")
    a = _ag_args(AG_CASES[0], shared_seed())
    got = ops.op(AG)(*a[:6], A_scale=a[6], B_scales=a[7], out_dtype=a[8], use_fast_accum=a[9])
    ref = ops.REFERENCES[AG](*a)
    for o, r in zip(got[1], ref[1]):
        assert_close(o, r, 1e-2, "dispatched scaled all-gather")
