"""Helpers to run code on several ranks (tests, the demo, benchmarks)."""

from .compiles import fresh_compiles
from .ranks import RankPool, free_port

__all__ = ["RankPool", "free_port", "fresh_compiles"]
