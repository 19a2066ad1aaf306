"""``import fluxcompile`` alone must register the fused ops' CUDA implementations: a compiled model never
imports fluxcompile.lowerings itself, and without them its fused ops silently run the reference."""

from __future__ import annotations

import subprocess
import sys


def test_import_registers_cuda_implementations():
    code = (
        "import torch, fluxcompile\n"
        "for op in ('all_gather_matmul', 'matmul_reduce_scatter', 'matmul_all_reduce', 'all_reduce_rmsnorm'):\n"
        "    assert torch._C._dispatch_has_kernel_for_dispatch_key(f'fluxcompile::{op}', 'CUDA'), op\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
