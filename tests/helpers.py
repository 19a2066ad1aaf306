"""Helpers used inside rank processes by the tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (NaN never passes)."""
    a, b = _local(a).double(), _local(b).double()
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    den = b.norm().item()
    err = (a - b).norm().item() / (den if den > 0 else 1.0)
    return float("inf") if err != err else err


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = rel_err(a, b)
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.0e}")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def fresh_compiles() -> Iterator[None]:
    """Compile caches off, so every graph really goes through the rewrite pass."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


def assert_grads_close(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], tol: float) -> None:
    """Compare gradients; one whose reference is at rounding-noise level (e.g. the key bias of softmax
    attention, whose true gradient is 0) is measured against 1% of the whole model's RMS gradient instead."""
    refs = [_local(b).double() for _, _, b in pairs]
    total = sum(r.numel() for r in refs)
    rms = (sum(float(r.pow(2).sum()) for r in refs) / max(total, 1)) ** 0.5
    for (name, a, _b), ref in zip(pairs, refs):
        scale = max(ref.norm().item(), rms * ref.numel() ** 0.5 * 1e-2)
        err = (_local(a).double() - ref).norm().item() / (scale or 1.0)
        if not err <= tol:
            raise AssertionError(f"grad of {name}: relative error {err:.3e} > {tol:.0e}")
