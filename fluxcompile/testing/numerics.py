"""Comparing results with eager: relative errors in float64, gradients at their model's scale."""

from __future__ import annotations

import torch

# Relative-error bounds against eager (the project's standard).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor, the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64; NaN or a shape mismatch never passes."""
    a, b = full(a).double(), full(b).double()
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    den = b.norm().item()
    err = (a - b).norm().item() / (den if den > 0 else 1.0)
    return float("inf") if err != err else err


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> float:
    err = rel_err(a, b)
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.0e}")
    return err


# Elementwise bounds (rtol; atol is 4x) for collectives checked element by element: bf16 sums that a ring
# rounds hop by hop differ from a once-rounded fp32 reference by a few bf16 ulps.
ELEMENTWISE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def elementwise_mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    """None if ``got`` matches ``want`` element by element within the bound of ``got``'s dtype (read before
    any upcast: a bf16 result gets bf16's bound, even against an fp32 reference), else why not. Unwritten
    (NaN) elements never pass."""
    tol = ELEMENTWISE_RTOL.get(got.dtype, 1e-5)
    g, w = got.reshape(-1).float(), want.reshape(-1).float()
    nans = int(torch.isnan(g).sum())
    if nans:
        return f"{what}: {nans} unwritten (NaN) output elements"
    try:
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * 4, msg=lambda m: f"{what}: {m}")
    except AssertionError as e:
        return str(e)
    return None


def grad_errors(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Relative error of each gradient. One whose reference is at rounding-noise level (the key bias of
    softmax attention, whose true gradient is 0) is measured against 1% of the model's RMS gradient."""
    refs = [full(b).double() for _, _, b in pairs]
    total = sum(r.numel() for r in refs)
    rms = (sum(float(r.pow(2).sum()) for r in refs) / max(total, 1)) ** 0.5
    errors = {}
    for (name, a, _), ref in zip(pairs, refs):
        scale = max(ref.norm().item(), rms * ref.numel() ** 0.5 * 1e-2)
        err = (full(a).double() - ref).norm().item() / (scale or 1.0)
        errors[name] = float("inf") if err != err else err
    return errors


def assert_grads_close(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], tol: float) -> None:
    for name, err in grad_errors(pairs).items():
        if not err <= tol:
            raise AssertionError(f"grad of {name}: relative error {err:.3e} > {tol:.0e}")
