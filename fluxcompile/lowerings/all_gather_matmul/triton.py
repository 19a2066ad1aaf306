"""all_gather_matmul with the persistent Triton kernel (kernels/ag_gemm.py): one GEMM launch whose
remote tiles wait for their communication chunk, fed by copy-engine pushes chunk by chunk.

Per call, on rank r (peers p in the exchange's gather send order, symm_mem/exchange.py):
  side stream:  for p: wait done_p -> for each chunk c: copy our rows of chunk c into slot r of p's
                symmetric buffer (peer-to-peer, copy engine) -> set arrived[r, c] on p
  main stream:  one kernel launch (local tiles at once; remote tiles spin-wait, bounded, on arrived[p, c]; the
                tiles of the first N-tile column also store the A rows they load into the gathered output,
                unless the caller does not read it: ``return_A`` False) -> clear our arrived flags -> set done_r
                on every p
A wait that times out records (source rank, chunk) in error words (``symm_mem.ErrorWords``) copied to pinned host
memory at the end of the call and checked at the start of the next one (no synchronization on the hot path),
or after every call with ``config.check_signals``.

Off by default (family ``triton_ag``): it runs only where ``config.implementations`` has its family
(FLUXCOMPILE_IMPLEMENTATIONS=+triton_ag).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...symm_mem import ErrorSpec, FlagArray, comm_for, stream_write
from ...symm_mem.exchange import gather_send_order, send
from .layout import layout_supports, shard_layout

try:
    from ...kernels import ag_gemm
except ImportError:  # no Triton: the choices are not registered (__init__.py)
    ag_gemm = None

_ARRIVED_FLAGS = 1 << 17  # int32 flags for world * chunks; `done` flags follow them
_FLAG_BYTES = 4 * _ARRIVED_FLAGS + 4096
TAG = "ag_triton"
_ERRORS = ErrorSpec(ag_gemm.ERR_WORDS if ag_gemm is not None else 0, "the Triton all_gather_matmul")  # per device
VARIANTS = ag_gemm.VARIANTS if ag_gemm is not None else {}  # the kernel's tile variants
# The one registered as a choice (``triton:<variant>``): the portable path (HIP); no table timed the others.
PORTABLE = next(iter(VARIANTS), None)


def supports(A: Tensor, Bs: Sequence[Tensor], biases, gather_dim: int, group_size: int, group_name: str) -> str | None:
    if len(Bs) > 4:
        return "more than 4 weights"
    if any(x is not None and x.dim() != 1 for x in biases):
        return "a bias that is not [N]"
    # The same layout of the gathered rows as the cuBLAS choice (rank blocks of contiguous rows).
    return layout_supports(A, Bs, biases, gather_dim, group_size)


def make(name: str):
    variant = VARIANTS[name]

    def supports_variant(A, Bs, biases, gather_dim, group_size, group_name) -> str | None:
        why = supports(A, Bs, biases, gather_dim, group_size, group_name)
        if why is None and variant.tma:
            if torch.cuda.get_device_capability(A.device)[0] < 9:
                return "TMA needs a Hopper or newer GPU"
            a = A.contiguous().view(-1, A.shape[-1])
            why = ag_gemm.tma_unsupported(a, a.numel(), Bs)
        return why

    def run(A, Bs, biases, gather_dim, group_size, group_name, return_A=True):
        return all_gather_matmul(A, Bs, biases, gather_dim, group_size, group_name, variant=variant, return_A=return_A)

    return run, supports_variant


def all_gather_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str,
    *,
    variant: ag_gemm.Variant | None = None,
    return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:
    variant = variant if variant is not None else ag_gemm.VARIANTS[ag_gemm.DEFAULT]
    block, chunks = variant.block, variant.chunks
    A, rows, k, gathered_shape = shard_layout(A, gather_dim, group_size)
    chunk_rows = max(block[0], -(-rows // chunks))
    n_chunks = -(-rows // chunk_rows)
    nbytes = group_size * rows * k * A.element_size()
    comm = comm_for(group_name, TAG, data_bytes=nbytes, flag_bytes=_FLAG_BYTES, errors=_ERRORS)
    ws, fws = comm.data, comm.flags
    rank, world = comm.rank, comm.world
    if world * n_chunks > _ARRIVED_FLAGS:
        raise ValueError(f"fluxcompile: {world} x {n_chunks} chunks exceed the flag space")
    arrived_all, done = FlagArray(fws, 0, _ARRIVED_FLAGS), FlagArray(fws, 4 * _ARRIVED_FLAGS, world)
    comm.init_flags(arrived_all, 0)
    comm.init_flags(done, 1)
    errors, check = comm.errors, _checker(rank, group_name)
    what = f"the Triton all_gather_matmul ({variant.block})"
    errors.check_previous(what, check)

    main, side = torch.cuda.current_stream(), comm.side
    slots = ws.view(rank, (world, rows, k), A.dtype)  # slot s: rows pushed by rank s
    arrived = fws.view(rank, (world, n_chunks), torch.int32)
    a_local = A.view(rows, k)
    A_gathered = torch.empty(gathered_shape, dtype=A.dtype, device=A.device) if return_A else None
    outs = [torch.empty(world * rows, b.shape[1], dtype=A.dtype, device=A.device) for b in Bs]
    send_to = gather_send_order(rank, world)  # shards land in the order the kernel's tiles take them

    side.wait_stream(main)
    with torch.cuda.stream(side):
        for p in send_to:
            peer_slot = ws.view(p, (rows, k), A.dtype, rank * rows * k * A.element_size())
            chunks = [(c * chunk_rows, min(rows, (c + 1) * chunk_rows)) for c in range(n_chunks)]
            pieces = [
                (peer_slot[lo:hi], a_local[lo:hi], fws.handle.buffer_ptrs[p] + 4 * (rank * n_chunks + c))
                for c, (lo, hi) in enumerate(chunks)
            ]
            send(side, done.addr(rank, p), pieces)

    # The kernel also writes the gathered rows into A_gathered (no copy kernel after it); without it, nothing.
    ag_gemm.ag_gemm(
        a_local, slots, arrived, Bs, biases, rank, world, chunk_rows, errors.err,
        block=block, outs=outs, a_out=A_gathered, tma=variant.tma, group_m=variant.group_m,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )  # fmt: skip
    arrived.zero_()  # every wait of this call is over: the next call starts from 0
    main.wait_stream(side)
    for p in send_to:
        stream_write(main, done.addr(p, rank), 1)
    errors.report(what, check)
    return A_gathered, outs


@functools.cache
def _checker(rank: int, group_name: str) -> Callable[[Tensor, str], None]:
    """The error words' check: kernels/ag_gemm.py's ``check_error``, naming the rank and the group."""
    return lambda words, what: ag_gemm.check_error(words, rank, group_name)
