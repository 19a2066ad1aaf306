"""Reference models parallelized with PyTorch's own TP API (demo, tests, benchmarks)."""
