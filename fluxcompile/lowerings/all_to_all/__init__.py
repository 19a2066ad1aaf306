"""fluxcompile.all_to_all_matmul and fluxcompile.matmul_all_to_all: their choices. Their fused kernels register
here, as the other ops' do in their folders; a call no fused choice takes runs the reference implementation
(``all_to_all_single`` + matmuls, registered by lowerings/choices.py).

Choices, in registration order:
* ``triton`` (one choice per op: its launches ``triton:<tile>`` and, for the dispatch, ``triton:<tile>-split`` and
  ``triton:<tile>-pull<N>``, a few timed per call: ``DISPATCH_TIMED``, ``COMBINE_TIMED``) (triton.py, family ``moe``,
  off by default: ``FLUXCOMPILE_IMPLEMENTATIONS=+moe``): the persistent Triton grouped GEMM of kernels/grouped_gemm.py with the
  all-to-all built in; the dispatch pulls its rows from the peers' symmetric send buffers in the GEMM's launch
  (``-split``: in a launch of its own), the combine's epilogue stores every row at its final place in its
  destination's receive buffer. Expert weights (``[E, K, N]``, grouped by ``offs`` or equal groups) only: dense
  weights are declined;
* ``cutlass`` (its launches ``cutlass:<variant>-pull<N>``, ``cutlass.TIMED`` timed per call) (cutlass.py, family
  ``moe``, experimental), the dispatch only: N programs on the
  side stream pull the experts' rows in their order (Flux's permuting copy), a flag per block of rows, while the
  experts' CUTLASS grouped GEMM (kernels/cutlass_grouped.py) waits per tile for its blocks; bf16, ``offs`` only;
* ``vdev`` (vdev.py, family ``moe``, experimental), both ops: torch's NVSHMEM all-to-all
  (``symm_mem.all_to_all_vdev``) as the exchange and the reference's matmuls, with the NVSHMEM backend only: the
  exchange that reaches peers on other hosts;
* ``reference`` (NCCL ``all_to_all_single`` + matmuls, registered by lowerings/choices.py).

Their CUDA implementations ask the rank-synchronized autotuner for one choice per call signature and run it. The
signature leaves out what differs between ranks and between calls of a layer (the split sizes, the exchanged
rows' count): every rank then hits or misses the autotuner's memo alike, and a new routing is no new tuning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..autotune import pick
from ..choices import Choice, Launches, register_choice
from ..direct_calls import cuda_impl
from . import triton, vdev

OPS = ("all_to_all_matmul", "matmul_all_to_all")

register_choice(OPS[0], Choice(vdev.NAME, *vdev.make_dispatch(), family="moe", remote_peers=True))
register_choice(OPS[1], Choice(vdev.NAME, *vdev.make_combine(), family="moe", remote_peers=True))

if triton.gg is not None:
    from . import cutlass

    _dispatch = Launches.timed(triton.DISPATCH_TIMED, triton.make_dispatch)
    register_choice(OPS[0], Choice(triton.NAME, *triton.make_dispatch(triton.DISPATCH_TIMED[0]), family="moe", launches=_dispatch))
    _cutlass = Launches.timed(cutlass.TIMED, cutlass.make)
    register_choice(OPS[0], Choice(cutlass.NAME, *cutlass.make(cutlass.TIMED[0]), family="moe", launches=_cutlass))
    _combine = Launches.timed(triton.COMBINE_TIMED, triton.make_combine)
    register_choice(OPS[1], Choice(triton.NAME, *triton.make_combine(triton.COMBINE_TIMED[0]), family="moe", launches=_combine))


# The dispatch choices' keyword arguments of a call that does not read the exchanged rows (its own signature).
_WITHOUT_A = {"return_A": False}


def _rows_free(t: Tensor | None) -> Any:
    """A tensor whose row count varies between ranks and calls, by everything else."""
    if t is None:
        return None
    return (t.dtype, t.shape[1:], None if t.is_contiguous() else t.stride()[1:])  # no formatting: a hot path


@cuda_impl(OPS[0], probe=lambda args: args[0])
def all_to_all_matmul_cuda(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int], group_name: str, A_scale: Tensor | None = None,
    B_scales: Sequence[Tensor] | None = None, out_dtype=None, use_fast_accum: bool = False,
    offs: Tensor | None = None, row_index: Tensor | None = None, return_A: bool = True, choice: str = "",
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """The op's CUDA implementation: the compiled choice, else the autotuner's for this call signature (a call
    with ``return_A`` False is tuned apart: a choice may skip producing the exchanged rows)."""
    args = (A, list(Bs), list(biases), list(output_split_sizes), list(input_split_sizes), group_name, A_scale,
            None if B_scales is None else list(B_scales), out_dtype, use_fast_accum, offs, row_index)  # fmt: skip
    key = (_rows_free(A), list(Bs), [b is None for b in biases], len(output_split_sizes), group_name,
           _rows_free(A_scale), B_scales is None, out_dtype, use_fast_accum, _rows_free(offs), _rows_free(row_index))  # fmt: skip
    if return_A:
        return pick(OPS[0], args, group_name, compiled=choice, key_args=key).fn(*args)
    return pick(OPS[0], args, group_name, compiled=choice, key_args=key, kwargs=_WITHOUT_A).fn(*args, **_WITHOUT_A)


@cuda_impl(OPS[1], probe=lambda args: args[0][0])
def matmul_all_to_all_cuda(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int],
    output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], group_name: str,
    A_scales: Sequence[Tensor] | None = None, B_scales: Sequence[Tensor] | None = None, out_dtype=None,
    use_fast_accum: bool = False, offs: Tensor | None = None, row_index: Tensor | None = None,
    accumulate: bool = False, choice: str = "",
) -> Tensor:  # fmt: skip
    """The op's CUDA implementation: the compiled choice, else the autotuner's for this call signature."""
    args = (list(As), list(Bs), bias, list(out_shape), list(output_split_sizes), list(input_split_sizes), group_name,
            None if A_scales is None else list(A_scales), None if B_scales is None else list(B_scales), out_dtype,
            use_fast_accum, offs, row_index, accumulate)  # fmt: skip
    key = ([_rows_free(a) for a in As], list(Bs), bias, list(out_shape[1:]), len(output_split_sizes), group_name,
           A_scales is None, B_scales is None, out_dtype, use_fast_accum, _rows_free(offs), _rows_free(row_index),
           accumulate)  # fmt: skip
    return pick(OPS[1], args, group_name, compiled=choice, key_args=key).fn(*args)
