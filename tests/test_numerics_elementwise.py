"""elementwise_mismatch, the element-by-element check of the GPU collective tests: a bf16 result gets bf16's
bound even against an fp32 reference (a ring's hop-by-hop bf16 rounding passes), a wrong or unwritten
element never does."""

from __future__ import annotations

import torch

from fluxcompile.testing.numerics import elementwise_mismatch


def _ring_sum_bf16(xs: list[torch.Tensor]) -> torch.Tensor:
    """A ring's reduction: each hop adds in fp32 and rounds the partial sum to bf16."""
    acc = xs[0].to(torch.bfloat16)
    for x in xs[1:]:
        acc = (acc.float() + x.to(torch.bfloat16).float()).to(torch.bfloat16)
    return acc


def test_bf16_ring_rounding_passes_against_fp32_reference():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1 << 16, generator=g).to(torch.bfloat16).float() for _ in range(8)]
    got = _ring_sum_bf16(xs)
    want = sum(xs)
    assert not torch.equal(got.float(), want.to(torch.bfloat16).float())  # the roundings do differ
    assert elementwise_mismatch(got, want, "ring") is None
    # The same bf16 values judged by fp32's bound fail: the bound must follow the result's dtype.
    assert elementwise_mismatch(got.float(), want, "as fp32") is not None


def test_wrong_or_unwritten_elements_fail():
    want = torch.randn(1000)
    got = want.clone()
    assert elementwise_mismatch(got, want, "same") is None
    got[17] += 1.0
    assert "same" in elementwise_mismatch(got, want, "same")
    got = want.to(torch.bfloat16)
    got[3] = float("nan")
    assert "1 unwritten (NaN)" in elementwise_mismatch(got, want, "nan")
