"""What the fused choices ask of a scaled (fp8) call's arguments (lowerings/scaling.py): each unsupported case
declines with its reason, so the site keeps the reference or another choice."""

from __future__ import annotations

import pytest
import torch

from fluxcompile.lowerings.scaling import scaling_supports, sequence_args

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16


def _call(a_dtype=E4M3, b_dtype=E4M3, sa=(), sb=(), out=BF16, bias_dtype=None, scale_dtype=torch.float32):
    a = torch.zeros(8, 16).to(a_dtype)
    b = torch.zeros(6, 16).to(b_dtype).t()
    bias = torch.zeros(6, dtype=bias_dtype) if bias_dtype else None
    return [a], [b], [bias], [torch.ones(sa, dtype=scale_dtype)], [torch.ones(sb, dtype=scale_dtype)], out


def test_supported_forms():
    assert scaling_supports(*_call()) is None
    assert scaling_supports(*_call(sa=(8, 1), sb=(1, 6))) is None
    assert scaling_supports(*_call(a_dtype=E5M2, bias_dtype=BF16)) is None  # the backward's e5m2 gradients


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"out": None}, "fp8 products are not split"),
        ({"a_dtype": BF16}, "want fp8 e4m3/e5m2 operands"),
        ({"a_dtype": E5M2, "b_dtype": E5M2}, "e5m2 x e5m2"),
        ({"scale_dtype": torch.float64}, "not float32"),
        ({"sa": (8, 1)}, "a tensor-wise scale with a row-wise one"),
        ({"sa": (8, 1), "sb": (1, 5)}, "5 elements for 6 columns"),
        ({"bias_dtype": torch.float32}, "not in the product's dtype"),
    ],
)
def test_declines_with_the_reason(kw, why):
    reason = scaling_supports(*_call(**kw))
    assert reason is not None and why in reason, reason


def test_sequence_args():
    assert sequence_args(2, None, None, None, False) == ([], [], None, False)
    s = [torch.ones(())] * 2
    assert sequence_args(2, s, s, BF16, 1) == (s, s, BF16, True)
