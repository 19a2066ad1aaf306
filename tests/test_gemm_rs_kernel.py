"""kernels/gemm_rs.py under Triton's CPU interpreter: ragged rows and N, one to four products (own K and
strides each), per-rank bias, 2 to 4 ranks, two calls in a row (epochs and parities, flags never reset), what
the rank stores into its peers' slots and flags, the tile order (peers from rank + 1 on, own rows last), and a
stale flag that must time out with an error naming rank and signal. (Its waits against real peers, CUDA graph
replays and speed are checked on GPUs: tests/gpu/test_rs_matmul.py.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_gemm_rs_kernel_in_interpreter():
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "kernel_checks", "gemm_rs_interpreted.py"), str(seed)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"seed {seed}:\n{out.stderr[-4000:]}"
    results = json.loads(out.stdout.strip().splitlines()[-1])
    stale = results.pop("stale")
    assert len(results) == 6
    for name, err in results.items():
        assert err <= 1e-5, f"{name}: relative error {err:.2e} (seed {seed})"
    assert "rank 0 of group test timed out in matmul_reduce_scatter waiting for rank 1's partial tile 2" in stale, stale
    assert "epoch 2" in stale, stale


def test_gemm_rs_compiles_for_sm90(tmp_path, monkeypatch):
    """Triton's front end and ptxas on both kernels (no GPU needed): what the interpreter cannot catch."""
    from test_kernels_compile import compile_sm90

    from fluxcompile.kernels.gemm_rs import MAX_TILES, gemm_rs_kernel, rs_reduce_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptrs = "a0 a1 a2 a3 b0 b1 b2 b3 bias".split()
    types = {
        **{p: "*bf16" for p in ptrs},
        "peer_data": "*i64", "peer_flags": "*i64", "state": "*i32", "trace": "*i32",
    }  # fmt: skip
    const = dict(
        HAS_BIAS=True, NUM_PRODUCTS=2, IEEE=False, TRACE=False, FLAG_STRIDE=MAX_TILES, NUM_PROGS=132,
        BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8,
    )  # fmt: skip
    k = compile_sm90(gemm_rs_kernel, const, types, num_warps=8, num_stages=3)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "the dot is not on Hopper's wgmma path"
    assert "sys.release" in ptx, "the flag store is not a system-scope release"
    assert k.metadata.shared <= 227 * 1024
    types = {"out": "*bf16", "peer_data": "*i64", "peer_flags": "*i64", "state": "*i32", "err": "*i32"}
    r = compile_sm90(
        rs_reduce_kernel, dict(FLAG_STRIDE=MAX_TILES, NUM_PROGS=264, BLOCK_M=128, BLOCK_N=256), types, 8, 1
    )
    assert "sys.acquire" in r.asm["ptx"], "the flag wait is not a system-scope acquire"
