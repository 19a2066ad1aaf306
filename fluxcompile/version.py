"""The package's version, in a module of its own so that any part of the package can read it without importing
the package root (which imports everything)."""

__version__ = "0.1.0"
