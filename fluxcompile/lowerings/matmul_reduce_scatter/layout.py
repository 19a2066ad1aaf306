"""matmul_reduce_scatter's layout rules, shared by its choices: each owner's rows are one block of the flattened
``[M, N]`` (a scatter dim with no leading dims of size > 1), so a block's GEMM computes one owner's part."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_WORLD = 64  # the handshake's flags


def row_layout(out_shape: Sequence[int], scatter_dim: int, group_size: int) -> tuple[int, int, int, list[int]]:
    """(M, N, rows per rank, this rank's output shape) for a scatter dim with no leading dims > 1, where the
    ranks' row blocks of the flattened ``[M, N]`` are contiguous: rank o's are rows ``o * rows ..``."""
    d = scatter_dim % len(out_shape)
    m, n = math.prod(out_shape[:-1]), out_shape[-1]
    shape = list(out_shape)
    shape[d] //= group_size
    return m, n, m // group_size, shape


def layout_supports(
    As: Sequence[Tensor],
    Bs: Sequence[Tensor],
    bias: Tensor | None,
    out_shape: Sequence[int],
    scatter_dim: int,
    reduce_op: str,
    group_size: int,
    scaled: bool = False,
) -> str | None:
    """None when each owner's rows are one block of the flattened ``[M, N]`` and the operands suit per-block
    GEMMs (the layout every reduce-scatter choice here relies on), else why not. ``scaled``: the matmuls are fp8
    ``_scaled_mm``s, whose dtypes ``lowerings.scaling`` checks."""
    if reduce_op != "sum":
        return f"reduce_op {reduce_op!r}: only 'sum' is implemented"
    if group_size < 2:
        return "nothing to overlap with one rank"
    if group_size > _MAX_WORLD:
        return f"more than {_MAX_WORLD} ranks"
    ndim = len(out_shape)
    if ndim < 2 or not -ndim <= scatter_dim < ndim or scatter_dim % ndim == ndim - 1:
        return f"scatter dim {scatter_dim} is not a row dim of a {ndim}-D output"
    d = scatter_dim % ndim
    if math.prod(out_shape[:d]) != 1:
        # Each rank's rows would be interleaved in the flattened [M, N]: per-owner GEMMs would need strided row
        # gathers (copies), so the reference does it better.
        return "scatter dim has a leading dim of size > 1 (the ranks' rows are interleaved)"
    if out_shape[d] % group_size:
        return f"dim {d} of size {out_shape[d]} does not split over {group_size} ranks"
    if not As or len(As) != len(Bs):
        return "need as many left as right operands"
    dtype = As[0].dtype
    if not scaled and (any(t.dtype != dtype for t in (*As, *Bs)) or (bias is not None and bias.dtype != dtype)):
        return "mixed dtypes"
    if not scaled and dtype not in _DTYPES:
        return f"dtype {dtype}"
    m, n = math.prod(out_shape[:-1]), out_shape[-1]
    for a, b in zip(As, Bs):
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != m or b.shape[1] != n or a.shape[1] != b.shape[0]:
            return "operand shapes do not match out_shape"
    if bias is not None and tuple(bias.shape) not in ((n,), (1, n)):
        return "a bias with rows (only [N] or [1, N] biases are split by rows)"
    tensors = [*As, *Bs, *([bias] if bias is not None else [])]
    if not all(t.is_cuda for t in tensors):
        return "needs CUDA tensors"
    if len({t.device for t in tensors}) > 1:
        return "operands on several devices"
    return None
