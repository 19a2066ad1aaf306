"""Helpers used inside rank processes by the tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fluxcompile.testing.numerics import assert_close, assert_grads_close, rel_err

__all__ = ["assert_close", "assert_grads_close", "fresh_compiles", "rel_err"]


@contextlib.contextmanager
def fresh_compiles() -> Iterator[None]:
    """Compile caches off, so every graph really goes through the rewrite pass."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield
