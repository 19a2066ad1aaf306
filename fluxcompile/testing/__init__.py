"""Helpers to run code on several ranks (tests, the demo, benchmarks)."""

from .compiles import fresh_compiles
from .one_gpu_ranks import OneGpuRanks
from .ranks import RankPool, free_port

__all__ = ["OneGpuRanks", "RankPool", "free_port", "fresh_compiles"]
