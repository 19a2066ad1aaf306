"""Lowerings of the fused ops: the registry of implementations ("choices") and the rank-synchronized
autotuner that picks one per call signature, identically on every rank, with its disk cache."""

from . import (  # noqa: F401  (register their choices and CUDA implementations)
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from .autotune import cache_key, cache_path, clear_memo, pick
from .choices import REFERENCE, Choice, choices_for, register_choice

__all__ = ["REFERENCE", "Choice", "cache_key", "cache_path", "choices_for", "clear_memo", "pick", "register_choice"]
