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
