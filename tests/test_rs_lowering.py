"""matmul_reduce_scatter's lowering on CPU: the registered choices, the row layout, and that every GPU choice
declines what it cannot do with a reason (the same on every rank: it looks at shapes, dtypes and flags only).
Their runs are checked on GPUs: tests/gpu/test_rs_matmul.py."""

from __future__ import annotations

import pytest
import torch

from fluxcompile import config
from fluxcompile.lowerings import choices_for
from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined as rs_cublas_pipelined
from fluxcompile.lowerings.matmul_reduce_scatter import layout as rs_layout
from fluxcompile.lowerings.matmul_reduce_scatter import torch_symm_mem
from fluxcompile.lowerings.matmul_reduce_scatter import triton as rs_triton

BF16 = torch.bfloat16


def _args(m=8, k=16, n=12, products=1, bias=False, out_shape=None, dim=0, op="sum", world=2, dtype=BF16):
    As = [torch.randn(m, k, dtype=dtype) for _ in range(products)]
    Bs = [torch.randn(k, n, dtype=dtype) for _ in range(products)]
    b = torch.randn(n, dtype=dtype) if bias else None
    return (As, Bs, b, list(out_shape or (m, n)), dim, op, world, "0")


def test_choices_registered_and_cuda_impl():
    with config.patch(implementations=("+triton_rs",)):
        names = [c.name for c in choices_for("matmul_reduce_scatter")]
    for want in ("cublas_pipelined", "cublas_pipelined:push", "torch_symm_mem", "reference"):
        assert want in names
    assert f"triton:{rs_triton.PORTABLE}" in names  # one Triton choice: the portable path
    assert len([n for n in names if n.startswith("triton:")]) == 1
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fluxcompile::matmul_reduce_scatter", "CUDA")


def test_row_layout():
    assert rs_layout.row_layout([1, 8, 16], 1, 2) == (8, 16, 4, [1, 4, 16])
    assert rs_layout.row_layout([12, 5], -2, 3) == (12, 5, 4, [4, 5])


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(op="avg"), "only 'sum'"),
        (dict(world=1), "one rank"),
        (dict(m=16, out_shape=(2, 8, 12), dim=1), "leading dim"),
        (dict(out_shape=(8, 12), dim=1), "not a row dim"),
        (dict(m=9, out_shape=(9, 12)), "does not split"),
        (dict(out_shape=(4, 12)), "shapes do not match"),
        (dict(), "needs CUDA"),
        (dict(products=2, bias=True, m=8, out_shape=(1, 8, 12), dim=1), "needs CUDA"),  # supported form, CPU
    ],
)
def test_cublas_pipelined_declines(kwargs, reason):
    why = rs_cublas_pipelined.supports(*_args(**kwargs))
    assert why is not None and reason in why, why


def test_cublas_pipelined_declines_mixed_dtypes_and_bias_rows():
    As, Bs, _, shape, dim, op, world, group = _args()
    assert "mixed" in rs_cublas_pipelined.supports(As, [Bs[0].float()], None, shape, dim, op, world, group)
    rows_bias = torch.randn(8, 12, dtype=BF16)
    assert "bias with rows" in rs_cublas_pipelined.supports(As, Bs, rows_bias, shape, dim, op, world, group)


def test_torch_symm_mem_declines():
    sup = torch_symm_mem.supports
    assert "no bias" in sup(*_args(bias=True))
    assert "one product" in sup(*_args(products=2))
    assert "'sum' and 'avg'" in sup(*_args(op="max"))
    assert "needs CUDA" in sup(*_args())
    # Interleaved rows are fine for PyTorch's op (it moves the scatter dim first): only the device stops it.
    assert "needs CUDA" in sup(*_args(m=16, out_shape=(2, 8, 12), dim=1))


def test_triton_declines_unless_enabled():
    _, sup = rs_triton.make("128x256x64")
    assert not any(c.family == "triton_rs" for c in choices_for("matmul_reduce_scatter"))  # off: not offered
    with config.patch(implementations=("+triton_rs",)):
        choice = {c.name: c for c in choices_for("matmul_reduce_scatter")}["triton:128x256x64"]
    assert choice.family == "triton_rs"
    assert "FLUXCOMPILE_IMPLEMENTATIONS=+triton_rs) enables it" in choice.declines(*_args())
    with config.patch(implementations=("+triton_rs",)):
        assert choice.declines(*_args()) == sup(*_args())
        _check_triton_rules(sup)


def _check_triton_rules(sup) -> None:
    assert "more than 4 products" in sup(*_args(products=5))
    assert "needs CUDA" in sup(*_args(products=2, bias=True))  # beyond the flag: the cuBLAS choice's checks
