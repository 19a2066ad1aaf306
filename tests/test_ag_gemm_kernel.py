"""kernels/ag_gemm.py under Triton's CPU interpreter: tiling over ranks in ring order, ragged rows, several
weights, bias, communication chunks vs tiles, and the bounded wait's error. (Its waits against real
peers and its speed are checked on GPUs.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_ag_gemm_kernel_in_interpreter():
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "kernel_checks", "ag_gemm_interpreted.py"), str(seed)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"seed {seed}:\n{out.stderr[-4000:]}"
    results = json.loads(out.stdout.strip().splitlines()[-1])
    timeout = results.pop("timeout")
    for name, err in results.items():
        assert err <= 1e-5, f"{name}: relative error {err:.2e} (seed {seed})"
    assert "rank 0 of group test timed out waiting for rank 1's chunk 1" in timeout, timeout
