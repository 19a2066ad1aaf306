"""matmul_reduce_scatter with the persistent Triton kernel (kernels/gemm_rs.py): one GEMM launch whose epilogue
stores every tile into the owner's symmetric slot and flags it, then the owner's reduction kernel.

Per call, on rank r: ``gemm_rs_kernel`` (tiles of owners r+1, r+2, ... first, own rows last; release flags
with the call's epoch) -> ``rs_reduce_kernel`` (bounded acquire waits per tile, fp32 sum of the slots). The
epoch counter lives on the device (graph replays advance it), data slots alternate by its parity, and
nothing is reset between calls. A wait that times out records (rank, peer, tile, epoch) in error words
(``symm_mem.ErrorWords``) copied to pinned host memory at the end of the call and checked at the start of the
next one (no synchronization on the hot path), or after every call with ``config.check_signals``.

Off by default (family ``triton_rs``): it runs only where ``config.implementations`` has its family
(FLUXCOMPILE_IMPLEMENTATIONS=+triton_rs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...symm_mem import Comm, ErrorSpec, FlagArray, capturing, comm_for, persistent
from ...symm_mem.exchange import slot_bytes
from .layout import layout_supports, row_layout

try:
    from ...kernels import gemm_rs
except ImportError:  # no Triton: the choices are not registered (__init__.py)
    gemm_rs = None

VARIANTS = gemm_rs.VARIANTS if gemm_rs is not None else {}  # the kernel's tile variants
# The one registered as a choice (``triton:<variant>``): the portable path (HIP); no table timed the others.
PORTABLE = next(iter(VARIANTS), None)
TAG = "matmul_reduce_scatter.triton"
_ERRORS = ErrorSpec(8, "the Triton matmul_reduce_scatter", per_group=True)  # kernels/gemm_rs.py's layout
_states: dict[Comm, Tensor] = {}  # the epoch counter of a context (int32 [2]), advanced by the kernel


def supports(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias, out_shape, scatter_dim, reduce_op, group_size, group_name
) -> str | None:
    if len(As) > gemm_rs.MAX_PRODUCTS:
        return f"more than {gemm_rs.MAX_PRODUCTS} products"
    # The same row layout as the cuBLAS choice (each owner's rows one contiguous block).
    return layout_supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size)


def make(name: str):
    variant = VARIANTS[name]

    def supports_variant(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
        why = supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)
        if why is None:
            _, n, rows, _ = row_layout(out_shape, scatter_dim, group_size)
            tm, tn = gemm_rs.n_tiles(rows, n, variant.block)
            if tm * tn > gemm_rs.MAX_TILES:
                return f"{tm * tn} tiles per rank exceed the {gemm_rs.MAX_TILES} flags"
        return why

    def run(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name):
        return matmul_reduce_scatter(
            As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name, variant=variant
        )

    return run, supports_variant


def matmul_reduce_scatter(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int], scatter_dim: int,
    reduce_op: str, group_size: int, group_name: str,
    *,
    variant: gemm_rs.Variant | None = None,
) -> Tensor:
    variant = variant if variant is not None else gemm_rs.VARIANTS[gemm_rs.DEFAULT]
    _, n, rows, shape = row_layout(out_shape, scatter_dim, group_size)
    dtype = As[0].dtype
    es = torch.empty((), dtype=dtype).element_size()
    slot_elems = slot_bytes(rows * n * es) // es
    comm = comm_for(
        group_name, TAG, world=group_size, data_bytes=2 * group_size * slot_elems * es,
        flag_bytes=4 * group_size * gemm_rs.MAX_TILES, errors=_ERRORS,
    )  # fmt: skip
    ws, fws = comm.data, comm.flags
    rank, world = comm.rank, comm.world
    # The parities are the two halves of the *buffer*, not of this call's request: a call of another shape
    # then still writes a half that no owner may be reading (see kernels/gemm_rs.py on parities).
    parity_elems = (ws.nbytes // 2) // 256 * 256 // es
    comm.init_flags(FlagArray(fws, 0, world * gemm_rs.MAX_TILES), 0)
    state = _state(comm)
    peer_data, peer_flags = comm.addresses(ws), comm.addresses(fws)
    what = f"the Triton matmul_reduce_scatter ({variant.block})"
    comm.errors.check_previous(what, _checker(group_name))

    out = torch.empty(shape, dtype=dtype, device=As[0].device)
    gemm_rs.gemm_rs(
        list(As), list(Bs), bias.reshape(-1).contiguous() if bias is not None else None, out.view(rows, n),
        peer_data, peer_flags, slot_elems, parity_elems, state, comm.errors.err, rank, world,
        block=variant.block, group_m=variant.group_m, num_warps=variant.num_warps, num_stages=variant.num_stages,
    )  # fmt: skip
    comm.errors.report(what, _checker(group_name))
    return out


def _state(comm: Comm) -> Tensor:
    """The epoch counter of ``comm`` (made on its first call, eagerly, outside any CUDA graph pool)."""
    state = _states.get(comm)
    if state is None:
        if capturing(comm.flags.buffer.device):
            raise RuntimeError("fluxcompile: run the Triton matmul_reduce_scatter once eagerly before graph capture")
        state = _states[comm] = persistent(
            lambda: torch.zeros(2, dtype=torch.int32, device=comm.flags.buffer.device),
            "the Triton matmul_reduce_scatter's state",
        )
    return state


@functools.cache
def _checker(group_name: str) -> Callable[[Tensor, str], None]:
    """The error words' check: kernels/gemm_rs.py's ``check_error``, naming the group."""
    return lambda words, what: gemm_rs.check_error(words, group_name)
