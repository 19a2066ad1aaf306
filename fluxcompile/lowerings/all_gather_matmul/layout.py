"""all_gather_matmul's layout rules, shared by its choices: each rank's rows are one block of the gathered
``[M, K]`` (a gather dim with no leading dims of size > 1), so a block's GEMM writes a row range of the outputs."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor


def layout_supports(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int,
    scaled: bool = False,
) -> str | None:  # fmt: skip
    """None when each rank's rows are one block of the gathered ``[M, K]`` and the operands suit per-block GEMMs
    into row ranges of the outputs (the layout every all-gather choice here relies on), else why not. ``scaled``:
    the matmuls are fp8 ``_scaled_mm``s, whose dtypes ``lowerings.scaling`` checks."""
    if not A.is_cuda:
        return "needs CUDA tensors"
    if group_size < 2:
        return "nothing to overlap with one rank"
    if math.prod(A.shape[:gather_dim]) != 1:
        # Each rank's rows would be interleaved in the flattened [M, K]: per-chunk products would land in
        # strided rows (a copy), so the reference does it better.
        return "gather dim has a leading dim of size > 1"
    if not scaled and (any(b.dtype != A.dtype for b in Bs) or any(x is not None and x.dtype != A.dtype for x in biases)):
        return "mixed dtypes"
    if any(x is not None and x.dim() > 1 and x.shape[0] != 1 for x in biases):
        return "a bias with rows (only [N] or [1, N] biases are split by rows)"
    return None


def shard_layout(A: Tensor, gather_dim: int, group_size: int) -> tuple[Tensor, int, int, list[int]]:
    """(contiguous shard, its rows, K, the gathered shape): the shard is one block of rows of the gathered
    ``[M, K]`` (``layout_supports`` checked the gather dim has no leading dims)."""
    A = A.contiguous()
    k = A.shape[-1]
    gathered_shape = list(A.shape)
    gathered_shape[gather_dim % A.dim()] *= group_size
    return A, A.numel() // k, k, gathered_shape
