"""The MoE ops' ``vdev`` choice (lowerings/all_to_all/vdev.py: torch's NVSHMEM all-to-all as the exchange) on CPU:
its registration and where it declines. Between processes with the NVSHMEM backend: tests/gpu/test_nvshmem_pes.py."""

from __future__ import annotations

import torch

from fluxcompile import config, ops
from fluxcompile.lowerings import all_to_all  # noqa: F401  (registers the choices)
from fluxcompile.lowerings.all_to_all import vdev
from fluxcompile.lowerings.choices import _REGISTRY

OPS = ("all_to_all_matmul", "matmul_all_to_all")


def test_registered_for_both_ops():
    for op in OPS:
        choice = _REGISTRY[op][vdev.NAME]
        assert choice.family == "moe" and choice.remote_peers and choice.symmetric_memory


def _dispatch_args(dtype=torch.bfloat16, scaled=False):
    A = torch.randn(8, 16).to(dtype)
    Bs = [torch.randn(2, 16, 8).to(dtype)]
    offs = torch.tensor([4, 8], dtype=torch.int32)
    return (A, Bs, [None], [], [], "g", torch.ones(8, 1) if scaled else None, None, None, False, offs, None)


def test_declines():
    supports = vdev.make_dispatch()[1]
    with config.patch(symm_mem_backend="cuda"):
        assert supports(*_dispatch_args()) == "all_to_all_vdev needs symm_mem_backend 'nvshmem'"
    with config.patch(symm_mem_backend="nvshmem"):
        assert "scaled matmuls" in supports(*_dispatch_args(scaled=True))
        assert supports(*_dispatch_args(dtype=torch.float64)) == "dtype torch.float64"
        assert supports(*_dispatch_args()) == "not on a CUDA device"
    combine = vdev.make_combine()[1]
    args = ([torch.randn(8, 8)], [torch.randn(8, 16)], None, [8, 16], [], [], "g")
    with config.patch(symm_mem_backend="cuda"):
        assert combine(*args) == "all_to_all_vdev needs symm_mem_backend 'nvshmem'"


def test_matmul_halves_match_the_references():
    """The reference's halves that vdev runs around its exchange: at one rank (the exchange an identity) they give
    the reference's results."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(12, 16, generator=g)
    Bs = [torch.randn(3, 16, 8, generator=g), torch.randn(3, 16, 8, generator=g)]
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)
    got = ops.dispatch_matmuls(A, Bs, [None, None], offs=offs)
    want = [torch._grouped_mm(A, b, offs=offs) for b in Bs] if hasattr(torch, "_grouped_mm") else None
    if want is not None:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    dense = [torch.randn(16, 8, generator=g)]
    torch.testing.assert_close(ops.dispatch_matmuls(A, dense, [None])[0], A @ dense[0])
    P = ops.combine_matmuls([A], dense, None, [12, 8])
    torch.testing.assert_close(P, A @ dense[0])
    row_index = torch.tensor([3, 0, 12, 7], dtype=torch.long)
    Pe = ops.combine_matmuls([A[:4]], [dense[0]], None, [12, 8], row_index=row_index)
    want = torch.zeros(13, 8)
    want[row_index] = A[:4] @ dense[0]
    torch.testing.assert_close(Pe, want[:12])
