"""The experts' CUTLASS grouped GEMM (kernels/cutlass_grouped.py, csrc/cutlass_grouped.cuh) against
``torch._grouped_mm`` on one GPU: ragged and empty groups, both weight layouts, outputs poisoned (every row of a
group written, rows past the last group untouched), and a CUDA graph replayed with new operands and new group ends
(the groups live on the device: a replay takes the routing it finds)."""

from __future__ import annotations

import pytest
import torch

from fluxcompile.kernels import cutlass_grouped
from fluxcompile.testing.numerics import TOLERANCE, assert_close

pytestmark = pytest.mark.skipif(
    cutlass_grouped.unavailable() is not None, reason=f"CUTLASS kernels: {cutlass_grouped.unavailable()}"
)

BF16 = torch.bfloat16
TOL = TOLERANCE[BF16]
E, K, N = 8, 512, 768


def _weights(layout: str) -> torch.Tensor:
    if layout == "kn":
        return (torch.randn(E, K, N, device="cuda") / K**0.5).to(BF16)
    return (torch.randn(E, N, K, device="cuda") / K**0.5).to(BF16).transpose(1, 2)


def _offs(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


@pytest.mark.parametrize("variant", list(cutlass_grouped.GROUPED_VARIANTS))
@pytest.mark.parametrize("layout", ("kn", "nk"))
def test_grouped_mm_matches_torch(variant, layout):
    b = _weights(layout)
    assert cutlass_grouped.weight_layout(b) == layout
    for sizes in ([300, 0, 1, 513, 128, 77, 0, 200], [0] * 7 + [640], [64] * 8):
        offs = _offs(sizes)
        rows = sum(sizes) + 37  # rows past the last group stay as they are
        a = torch.randn(rows, K, device="cuda", dtype=BF16)
        out = torch.full((rows, N), float("nan"), device="cuda", dtype=BF16)
        cutlass_grouped.grouped_mm(a, b, offs, out, variant=variant)
        want = torch._grouped_mm(a[: sum(sizes)], b, offs=offs)
        assert_close(out[: sum(sizes)], want.float(), TOL, f"{variant} {layout} {sizes}")
        assert out[sum(sizes) :].isnan().all(), "rows past the last group were written"


@pytest.mark.parametrize("variant", list(cutlass_grouped.GROUPED_VARIANTS)[:1])
def test_grouped_mm_graph_replays_new_routing(variant):
    b = _weights("nk")
    rows = 1024
    a = torch.randn(rows, K, device="cuda", dtype=BF16)
    offs = _offs([128] * E)
    out = torch.empty(rows, N, device="cuda", dtype=BF16)
    cutlass_grouped.grouped_mm(a, b, offs, out, variant=variant)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cutlass_grouped.grouped_mm(a, b, offs, out, variant=variant)
    for sizes in ([1024] + [0] * 7, [100, 200, 0, 300, 24, 200, 100, 100]):
        a.copy_(torch.randn_like(a))
        offs.copy_(_offs(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, torch._grouped_mm(a, b, offs=offs).float(), TOL, f"{variant} replay {sizes}")


@pytest.mark.parametrize("variant", list(cutlass_grouped.GROUPED_VARIANTS))
def test_grouped_mm_waits_for_its_blocks_of_rows(variant):
    """The dispatch's waits: flags already at the epoch (nothing awaited), then flags raised by the copy engine
    after a delay on another stream while the GEMM (on 16 SMs, the rest free) waits, then a graph replay at the next
    epoch; the output equals torch's each time."""
    b = _weights("nk")
    sizes = [300, 0, 1, 513, 128, 77, 0, 200]
    offs = _offs(sizes)
    rows, block = sum(sizes), 64
    a = torch.randn(rows, K, device="cuda", dtype=BF16)
    flags = torch.ones(-(-rows // block), dtype=torch.int32, device="cuda")
    epoch = torch.ones(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_grouped.ERR_WORDS, dtype=torch.int32, device="cuda")
    kw = dict(variant=variant, wait=(flags, block, epoch), err=err, sm_count=16)
    out = torch.full((rows, N), float("nan"), device="cuda", dtype=BF16)
    cutlass_grouped.grouped_mm(a, b, offs, out, **kw)
    assert_close(out, torch._grouped_mm(a, b, offs=offs).float(), TOL, f"{variant} flags preset")
    # epoch 2: the flags rise later, from pinned host memory through the copy engine on a side stream
    epoch.fill_(2)
    raised = torch.full_like(flags, 2, device="cpu").pin_memory()
    side = torch.cuda.Stream()
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # tens of milliseconds: the GEMM is launched and waiting meanwhile
        flags.copy_(raised, non_blocking=True)
    cutlass_grouped.grouped_mm(a, b, offs, out, **kw)
    torch.cuda.synchronize()
    cutlass_grouped.check_error(err, "test")
    assert_close(out, torch._grouped_mm(a, b, offs=offs).float(), TOL, f"{variant} flags raised late")
    # a CUDA graph of the call, replayed at epoch 3 with new rows (the epoch is read on the device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cutlass_grouped.grouped_mm(a, b, offs, out, **kw)
    epoch.fill_(3)
    flags.fill_(3)
    a.copy_(torch.randn_like(a))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    cutlass_grouped.check_error(err, "test")
    assert_close(out, torch._grouped_mm(a, b, offs=offs).float(), TOL, f"{variant} replay at the next epoch")


def test_grouped_mm_wait_timeout_names_the_block():
    from fluxcompile import config

    b = _weights("kn")
    offs = _offs([64] * E)
    a = torch.randn(512, K, device="cuda", dtype=BF16)
    out = torch.empty(512, N, device="cuda", dtype=BF16)
    flags = torch.zeros(8, dtype=torch.int32, device="cuda")
    flags[:5] = 1
    epoch = torch.ones(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(cutlass_grouped.ERR_WORDS, dtype=torch.int32, device="cuda")
    variant = next(iter(cutlass_grouped.GROUPED_VARIANTS))
    with config.patch(wait_timeout_s=0.2):
        cutlass_grouped.grouped_mm(a, b, offs, out, variant=variant, wait=(flags, 64, epoch), err=err, rank=3)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=r"rank 3 timed out waiting for block [5-7] of the experts' rows"):
        cutlass_grouped.check_error(err, "test")


def test_bad_operands_are_refused():
    b = _weights("kn")
    a = torch.randn(64, K, device="cuda", dtype=BF16)
    out = torch.empty(64, N, device="cuda", dtype=BF16)
    variant = next(iter(cutlass_grouped.GROUPED_VARIANTS))
    with pytest.raises(ValueError, match="int32"):
        cutlass_grouped.grouped_mm(a, b, _offs([8] * E).long(), out, variant=variant)
    with pytest.raises(ValueError, match="bf16"):
        cutlass_grouped.grouped_mm(a.half(), b.half(), _offs([8] * E), out.half(), variant=variant)
    with pytest.raises(ValueError, match="no CUTLASS grouped variant"):
        cutlass_grouped.grouped_mm(a, b, _offs([8] * E), out, variant="nope")
