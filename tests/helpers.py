"""Helpers used inside rank processes by the tests."""

from __future__ import annotations

from fluxcompile.testing import fresh_compiles
from fluxcompile.testing.numerics import assert_close, assert_grads_close, rel_err

__all__ = ["assert_close", "assert_grads_close", "fresh_compiles", "rel_err"]
