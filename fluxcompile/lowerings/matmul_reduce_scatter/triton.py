"""matmul_reduce_scatter with the persistent Triton kernel (kernels/gemm_rs.py): one GEMM launch whose epilogue
stores every tile into the owner's symmetric slot and flags it, then the owner's reduction kernel.

Per call, on rank r: ``gemm_rs_kernel`` (tiles of owners r+1, r+2, ... first, own rows last; release flags
with the call's epoch) -> ``rs_reduce_kernel`` (bounded acquire waits per tile, fp32 sum of the slots). The
epoch counter lives on the device (graph replays advance it), data slots alternate by its parity, and
nothing is reset between calls. A wait that times out records (rank, peer, tile, epoch) in error words
(``symm_mem.ErrorWords``) copied to pinned host memory at the end of the call and checked at the start of the
next one (no synchronization on the hot path), or after every call with ``config.check_signals``.

Experimental (family ``triton_rs``): it declines every call unless ``config.experimental_triton_rs``
(FLUXCOMPILE_EXPERIMENTAL_TRITON_RS=1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...symm_mem import ErrorWords, FlagArray, init_flags, persistent, workspace
from ...symm_mem.exchange import slot_bytes
from .cublas_pipelined import layout_supports, row_layout

try:
    from ...kernels import gemm_rs
except ImportError:  # no Triton: the choices are not registered (__init__.py)
    gemm_rs = None

VARIANTS = gemm_rs.VARIANTS if gemm_rs is not None else {}  # the kernel's tile variants, one choice each


@dataclasses.dataclass
class _State:
    """Per (device, flag buffer): the epoch counter, the error words, peer addresses."""

    state: Tensor
    errors: ErrorWords  # kernels/gemm_rs.py's layout
    peers: dict[int, tuple[Tensor, Tensor]] = dataclasses.field(default_factory=dict)  # data buffer -> addresses


_states: dict[tuple[int, int], _State] = {}


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
    ws = workspace(group_name, 2 * group_size * slot_elems * es, tag="matmul_reduce_scatter.triton", world=group_size)
    rank, world = ws.rank, ws.world_size
    # The parities are the two halves of the *buffer*, not of this call's request: a call of another shape
    # then still writes a half that no owner may be reading (see kernels/gemm_rs.py on parities).
    parity_elems = (ws.nbytes // 2) // 256 * 256 // es
    fws = workspace(group_name, 4 * world * gemm_rs.MAX_TILES, tag="matmul_reduce_scatter.triton.flags")
    init_flags(FlagArray(fws, 0, world * gemm_rs.MAX_TILES), 0)
    st = _state_for(fws)
    peer_data, peer_flags = _peers(st, ws, fws)
    what = f"the Triton matmul_reduce_scatter ({variant.block})"
    st.errors.check_previous(what, _checker(group_name))

    out = torch.empty(shape, dtype=dtype, device=As[0].device)
    gemm_rs.gemm_rs(
        list(As), list(Bs), bias.reshape(-1).contiguous() if bias is not None else None, out.view(rows, n),
        peer_data, peer_flags, slot_elems, parity_elems, st.state, st.errors.err, rank, world,
        block=variant.block, group_m=variant.group_m, num_warps=variant.num_warps, num_stages=variant.num_stages,
    )  # fmt: skip
    st.errors.report(what, _checker(group_name))
    return out


def _state_for(fws) -> _State:
    key = (torch.cuda.current_device(), fws.buffer.data_ptr())
    st = _states.get(key)
    if st is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fluxcompile: run the Triton matmul_reduce_scatter once eagerly before graph capture")
        errors = ErrorWords.make(torch.device("cuda", key[0]), 8, "the Triton matmul_reduce_scatter")
        st = _states[key] = persistent(
            lambda: _State(state=torch.zeros(2, dtype=torch.int32, device="cuda"), errors=errors),
            "the Triton matmul_reduce_scatter's state",
        )
    return st


def _peers(st: _State, ws, fws) -> tuple[Tensor, Tensor]:
    """Every rank's data and flag buffer address, as int64 device tensors (made once per data buffer, eagerly:
    a host-to-device copy cannot be captured)."""
    key = ws.buffer.data_ptr()
    if key not in st.peers:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fluxcompile: the Triton matmul_reduce_scatter's workspace changed during capture")
        st.peers[key] = persistent(
            lambda: (ws.addresses(), fws.addresses()), "the Triton matmul_reduce_scatter's address tables"
        )
    return st.peers[key]


@functools.cache
def _checker(group_name: str) -> Callable[[Tensor, str], None]:
    """The error words' check: kernels/gemm_rs.py's ``check_error``, naming the group."""
    return lambda words, what: gemm_rs.check_error(words, group_name)
