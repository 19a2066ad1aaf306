"""A pytest plugin that switches off the one-GPU harness's loading of the delay kernel before the ranks start
(``fluxcompile.testing.one_gpu_ranks.load_delay_kernel``): the harness as it was before that fix, to show the
all-gather case it fixed failing again, at its delayed call, on the same tree.

    PYTEST_ADDOPTS="-p lab.no_delay_preload" GPU_TESTS_x='tests/gpu/test_cutlass_ranks.py::...' \
        scripts/gpu-check gpu-tests-x
"""

from __future__ import annotations

from fluxcompile.testing import one_gpu_ranks


def pytest_configure(config) -> None:
    one_gpu_ranks.load_delay_kernel = lambda device: None
