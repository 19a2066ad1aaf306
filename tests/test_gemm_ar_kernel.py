"""kernels/gemm_ar.py under Triton's CPU interpreter: one-shot and two-shot, ragged m and n, bias, the
RMSNorm tail (both weight orders), two calls in a row (epochs and parities, flags never reset), what the
rank pushes into its peers' buffers, and a stale flag that must time out with an error naming the signal.
(Its waits against real peers, CUDA graph replays and speed are checked on GPUs: tests/gpu/test_decode_ar.py.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_gemm_ar_kernel_in_interpreter():
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "kernel_checks", "gemm_ar_interpreted.py"), str(seed)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"seed {seed}:\n{out.stderr[-4000:]}"
    results = json.loads(out.stdout.strip().splitlines()[-1])
    stale = {name: results.pop(name) for name in ("stale one-shot", "stale two-shot")}
    assert len(results) == 9
    for name, err in results.items():
        assert err <= 1e-5, f"{name}: relative error {err:.2e} (seed {seed})"
    for name, msg in stale.items():
        assert "rank 0 of group test timed out waiting for rank 1's partial tile 0" in msg, f"{name}: {msg}"
        assert "epoch 2" in msg, msg
