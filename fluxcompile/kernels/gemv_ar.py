"""Launcher of the CUDA GEMV -> all-reduce (-> residual add + RMSNorm) kernel of csrc/gemv_ar.cu, for decode-sized
m (at most ``MAX_M`` rows): the GEMV-shaped sibling of kernels/gemm_ar.py, following the same protocol over
symmetric data and flag workspaces (csrc/gemv_ar.cu's header says why it is race-free) and filling error words of
the same layout (``gemm_ar.check_error`` reads them).

``MODES``: one-shot, two-shot, and one-shot whose partials travel as LL words or LL128 lines (data and epoch
together: no fence and no flag per tile on the writer's side), each with the kernel's ``ll`` argument. The
extension is built on first use (extensions.py); :func:`unavailable` says why it cannot be here.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from . import extensions

TILE_N = 32  # csrc/gemv_ar.h kGemvTileN: output columns per tile
MAX_M = 64  # csrc/gemv_ar.h kGemvMaxM: rows of one tile (all of m)
MODES = {"oneshot": 0, "twoshot": 0, "oneshot-ll": 1, "oneshot-ll128": 2}


def load() -> ModuleType:
    """The built ``gemv_ar`` module (built on first use); raises :class:`extensions.Unavailable`."""
    return extensions.load("gemv_ar")


def unavailable() -> str | None:
    """Why the kernel cannot run here (None if it may)."""
    try:
        load()
    except extensions.Unavailable as e:
        return f"csrc/gemv_ar unavailable: {e}"
    return None


def ll128_bytes(m: int, n: int) -> int:
    """An LL128 partial's bytes (csrc/gemv_ar.cu): ceil(4 m / 7) lines of 128 bytes per tile of 32 columns."""
    return -(-n // TILE_N) * -(-m * TILE_N // 8 // 7) * 128


def slot_need(m: int, n: int, itemsize: int) -> int:
    """The bytes a slot of the kernel's data workspace must hold for an [m, n] output: the partial, and half an
    LL128 partial (an LL region is two slots; a ragged last tile's lines may pass the partial's bytes twice)."""
    return max(m * n * itemsize, -(-ll128_bytes(m, n) // 2))


def gemv_ar(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    out: Tensor,
    peer_data: int,
    peer_flags: int,
    slot_bytes: int,
    state: Tensor,
    err: Tensor,
    rank: int,
    world: int,
    *,
    mode: str,
    timeout_ns: int,
    tail: tuple[Tensor, Tensor, Tensor, float, bool] | None = None,
) -> None:
    """Launch the kernel on the current stream: ``out = all_reduce(a @ b + bias)`` (or, with ``tail = (normed,
    residual, weight, eps, weight_after_cast)``, ``out = residual + all_reduce(...)`` and ``normed = RMSNorm(out) *
    weight``).

    a ``[m, k]`` with unit column stride, b ``[k, n]`` in nn.Linear layout (``W.t()``, unit stride along k), both
    16-byte aligned; out and normed contiguous ``[m, n]``; peer_data/peer_flags: device addresses of the int64
    ``[world]`` tables of every rank's data and flag workspaces as mapped here; slot_bytes: the data workspace's
    slot size; state: int32 ``[4]`` of this rank; err: int32 error words; timeout_ns: the bound of each wait.
    """
    two_shot, ll = mode == "twoshot", MODES[mode]
    m, k = a.shape
    n = b.shape[1]
    n_tiles = -(-n // TILE_N)
    grid = n_tiles  # the launcher lowers it to the CTAs that fit on the GPU at once
    if tail is not None:
        normed, residual, weight, eps, weight_after_cast = tail
        # Contiguous and 16-byte aligned (the kernel reads 16-byte vectors); kept alive until after the launch.
        residual, weight = (
            t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
            for t in (residual, weight)
        )
        tail_ptrs = (normed.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, weight_after_cast)
    else:
        tail_ptrs = (0, 0, 0, 0.0, False)
    load().launch(
        a.data_ptr(), b.data_ptr(), bias.data_ptr() if bias is not None else 0, out.data_ptr(), *tail_ptrs,
        peer_data, peer_flags, slot_bytes, state.data_ptr(), err.data_ptr(),
        m, n, k, a.stride(0), b.stride(1), rank, world, two_shot, ll, n_tiles, timeout_ns,
        0 if a.dtype == torch.bfloat16 else 1, grid, torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip
