"""What the fused choices ask of a scaled call's arguments (fp8 matmuls, ops.py "Scaled matmuls"), shared by the
op folders whose choices run ``torch._scaled_mm`` per piece: fp8 operands, float32 scales that are tensor-wise or
row-wise ([rows, 1] for A, [1, N] for B), a bf16/fp16/fp32 product, biases of the product's dtype."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
PRODUCT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rowwise(scale: Tensor) -> bool:
    return scale.numel() > 1


def scaling_supports(
    As: Sequence[Tensor],
    Bs: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    A_scales: Sequence[Tensor],
    B_scales: Sequence[Tensor],
    out_dtype: torch.dtype | None,
) -> str | None:
    """None when every ``_scaled_mm(As[i], Bs[i], A_scales[i], B_scales[i], biases[i], out_dtype=out_dtype)`` is one
    a choice can split by rows, else why not (the same answer on every rank)."""
    if out_dtype not in PRODUCT_DTYPES:
        return f"scaled matmuls into {out_dtype} (fp8 products are not split; want bf16, fp16 or fp32)"
    for a, b, sa, sb in zip(As, Bs, A_scales, B_scales):
        if a.dtype not in FP8 or b.dtype not in FP8:
            return f"scaled matmul of {a.dtype} x {b.dtype} (want fp8 e4m3/e5m2 operands)"
        if a.dtype == b.dtype == getattr(torch, "float8_e5m2", None):
            return "e5m2 x e5m2 (no fp8 GEMM takes it)"
        if sa.dtype != torch.float32 or sb.dtype != torch.float32:
            return "scales that are not float32"
        if rowwise(sa) != rowwise(sb):
            return "a tensor-wise scale with a row-wise one"
        if rowwise(sb) and sb.numel() != b.shape[-1]:
            return f"a B scale of {sb.numel()} elements for {b.shape[-1]} columns"
    if any(x is not None and x.dtype != out_dtype for x in biases):
        return "a bias not in the product's dtype"
    return None


def sequence_args(
    n: int, A_scales: Sequence[Tensor] | None, B_scales: Sequence[Tensor] | None, out_dtype: torch.dtype | None,
    use_fast_accum: bool,
) -> tuple[list[Tensor], list[Tensor], torch.dtype | None, bool]:  # fmt: skip
    """The four scaling arguments of the C++ sequences (csrc/sequences.h, ``Scaling``) for ``n`` matmuls: empty
    lists for plain ones."""
    if B_scales is None:
        return [], [], None, False
    return list(A_scales), list(B_scales), out_dtype, bool(use_fast_accum)
