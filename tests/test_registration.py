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


_COMPILE_AG = """
import sys, torch
if sys.argv[1] == "broken":
    sys.modules["fluxcompile.lowerings.all_gather_matmul"] = None  # that part of the lowerings fails to load
import fluxcompile
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
group = dist.group.WORLD
def f(x, w):
    return funcol.all_gather_tensor(x, 0, group) @ w
x, w = torch.randn(2, 8, 16), torch.randn(16, 4)
with fluxcompile.collect_reports() as rep:
    out = torch.compile(f, backend="fluxcompile")(x, w)
torch.testing.assert_close(out, f(x, w))
registered = torch._C._dispatch_has_kernel_for_dispatch_key("fluxcompile::all_gather_matmul", "CUDA")
print("fused", rep.count("all_gather_matmul"), "registered", registered)
dist.destroy_process_group()
"""


def test_compiled_code_follows_what_is_registered(tmp_path):
    """Generated code calls the fused ops' CUDA implementations directly. A process whose lowerings failed to
    load (in part) must not replay, from Inductor's cache, code compiled where they loaded: it compiles anew and
    calls what is registered."""
    import os

    from fluxcompile.testing.ranks import free_port

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = {}
    for mode in ("whole", "broken"):
        out = subprocess.run(
            [sys.executable, "-c", _COMPILE_AG, mode, str(free_port())],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mode] = out.stdout.strip().splitlines()[-1]
    assert runs["whole"] == "fused 1 registered True"
    assert runs["broken"] == "fused 1 registered False"
