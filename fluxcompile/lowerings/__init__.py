"""Lowerings of the fused ops: one folder per op (its choices and its CUDA implementation), and the machinery
they share: the choice registry (choices.py), the rank-synchronized autotuner with its disk cache (autotune.py),
and the direct calls from Inductor's generated code (direct_calls.py)."""

from . import (  # noqa: F401  (register their choices and CUDA implementations)
    all_gather_matmul,
    all_to_all,
    all_to_all_embedding_bag_backward,
    embedding_bag_all_to_all,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from .autotune import cache_key, cache_path, clear_memo, pick
from .choices import REFERENCE, Choice, choices_for, register_choice

__all__ = ["REFERENCE", "Choice", "cache_key", "cache_path", "choices_for", "clear_memo", "pick", "register_choice"]
