"""Compiling for a test: every graph goes through the rewrite pass."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def fresh_compiles() -> Iterator[None]:
    """Inductor's FX graph cache and AOTAutograd's cache off, so every graph really goes through the rewrite pass
    (and its compile-time choices) instead of coming back from a cache."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield
