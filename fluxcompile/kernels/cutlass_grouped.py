"""Launcher of the experts' CUTLASS grouped GEMM (csrc/cutlass_grouped.cuh): CUTLASS's own Hopper ptr-array
grouped kernel, the one ``torch._grouped_mm`` runs on sm_90, for the MoE choices to build on: the groups' shapes,
pointers and strides are written on the device from ``offs`` by a small kernel before it (no host
synchronization; CUDA graphs replay it with whatever ``offs`` holds then).

``GROUPED_VARIANTS`` (cutlass_grouped_build.py, the build spec) lists the tile configurations, each compiled into the
``cutlass_grouped`` extension; a call picks one by name. Without CUTLASS's headers, or off Hopper,
:func:`flux_gemm's unavailable <fluxcompile.kernels.cutlass_gemm.unavailable>` gives the reason.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..config import config
from . import extensions
from .cutlass_gemm import unavailable
from .cutlass_grouped_build import GROUPED_VARIANTS
from .stream_scratch import StreamScratch

__all__ = ["ERR_WORDS", "GROUPED_VARIANTS", "check_error", "grouped_mm", "operands_unsupported", "unavailable"]

ERR_WORDS = 6  # csrc/cutlass_grouped.h GroupedSync::err


def load():
    """The built extension (extensions.load raises Unavailable with the reason)."""
    return extensions.load("cutlass_grouped")


@functools.cache
def _index(name: str) -> int:
    return list(load().names()).index(name)


def operands_unsupported(a: Tensor, b: Tensor, offs: Tensor, out: Tensor) -> str | None:
    """Why ``out[group g's rows] = a[group g's rows] @ b[g]`` does not fit the kernel (None if it does): bf16 ``a``
    ``[R, K]`` row-major, ``b`` ``[E, K, N]`` row-major or the transpose of an ``[E, N, K]`` row-major one, int32
    ``offs`` ``[E]`` on the device, ``out`` ``[R, N]`` row-major bf16; 16-byte aligned rows."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        return f"dtypes {a.dtype} x {b.dtype} -> {out.dtype} (bf16 only)"
    if a.dim() != 2 or b.dim() != 3 or out.dim() != 2 or out.shape != (a.shape[0], b.shape[2]) or b.shape[1] != a.shape[1]:
        return "shapes that are not [R, K] x [E, K, N] -> [R, N]"
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != b.shape[0] or offs.device != a.device:
        return "offs that is not int32 [E] on the operands' device"
    for t, what in ((a, "A"), (out, "the output")):
        if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            return f"{what} is not row-major with 16-byte aligned rows"
    if weight_layout(b) is None:
        return "a weight that is neither [E, K, N] row-major nor the transpose of an [E, N, K] row-major one"
    if b.data_ptr() % 16 or b.stride(0) % 8 or b.shape[1] % 8 or b.shape[2] % 8:
        return "weight dims or strides not 16-byte aligned"
    return None


def weight_layout(b: Tensor) -> str | None:
    """``"kn"``: b[g, k, n] at g * s0 + k * s1 + n; ``"nk"`` (K-major, the transpose of [E, N, K]): at
    g * s0 + n * s2 + k."""
    if b.stride(2) == 1 and b.stride(1) >= b.shape[2]:
        return "kn"
    if b.stride(1) == 1 and b.stride(2) >= b.shape[1]:
        return "nk"
    return None


# The groups' arrays and CUTLASS's workspace: calls on one stream run one after another.
_scratch = StreamScratch("the CUTLASS grouped GEMM's workspace", 1 << 16)


@functools.cache
def _workspace_bytes(which: int, groups: int, sm_count: int, device: int) -> int:
    q = [0, 0, 0, 0, 0, 1, 0, 0, 0, groups, 8, 8, sm_count, device, 0]
    return int(load().workspace_bytes(which, q))


def grouped_mm(
    a: Tensor,
    b: Tensor,
    offs: Tensor,
    out: Tensor,
    *,
    variant: str,
    sm_count: int = 0,
    wait: tuple[Tensor, int, Tensor] | None = None,
    err: Tensor | None = None,
    rank: int = 0,
) -> Tensor:
    """``out[offs[g - 1]:offs[g]] = a[offs[g - 1]:offs[g]] @ b[g]`` on the current stream (``torch._grouped_mm``'s
    groups; rows past ``offs[-1]`` are left as they are) with the variant ``variant`` (a name of
    GROUPED_VARIANTS); :func:`operands_unsupported` says what fits.

    wait: (flags, block_rows, epoch), the dispatch's: int32 ``flags`` (one per block of ``block_rows`` rows of
      ``a``) and ``epoch`` (one int32 on the device, read by the kernel): a tile loads its rows once the flag of
      every block they overlap is at least the epoch (bounded by ``config.wait_timeout_s``; a timeout fills
      ``err``, int32 [ERR_WORDS], as :func:`check_error` reads it)."""
    if variant not in GROUPED_VARIANTS:
        raise ValueError(f"fluxcompile: no CUTLASS grouped variant {variant!r}")
    if (why := operands_unsupported(a, b, offs, out)) is not None:
        raise ValueError(f"fluxcompile: the CUTLASS grouped GEMM does not take {why}")
    if wait is not None:
        flags, block_rows, epoch = wait
        if err is None or err.dtype != torch.int32 or err.numel() < ERR_WORDS:
            raise ValueError("fluxcompile: the grouped GEMM's waits need int32 error words")
        if flags.dtype != torch.int32 or epoch.dtype != torch.int32 or block_rows <= 0:
            raise ValueError("fluxcompile: the grouped GEMM waits on int32 flags and an int32 epoch word")
        if flags.numel() * block_rows < a.shape[0]:
            raise ValueError("fluxcompile: the grouped GEMM's flags do not cover every block of rows")
    layout = weight_layout(b)
    device = a.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch._C._cuda_getCurrentRawStream(index)
    which = _index(variant)
    groups = b.shape[0]
    ws = _scratch.address(device, stream, _workspace_bytes(which, groups, sm_count, index))
    q = [
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(1) if layout == "kn" else b.stride(2), b.stride(0),
        int(layout == "nk"), out.data_ptr(), out.stride(0), offs.data_ptr(), groups, b.shape[2], b.shape[1],
        sm_count, index, ws,
    ]  # fmt: skip
    if wait is not None:
        q += [wait[0].data_ptr(), wait[1], wait[2].data_ptr(), err.data_ptr(), rank, int(config.wait_timeout_s * 1e9)]
    load().run(which, q, stream)
    return out


def check_error(err: Tensor, what: str) -> None:
    """Raise if a wait of the kernel timed out (reads ``err``: a host synchronization)."""
    words = [int(x) for x in err[:ERR_WORDS].tolist()]
    if words[0]:
        raise RuntimeError(
            f"fluxcompile: {what}: rank {words[1]} timed out waiting for block {words[3]} of the experts' rows "
            f"(its flag never reached epoch {words[4]}): did the dispatch's copy run?"
        )
