"""The fused ops called from Inductor's generated code through their direct entries (lowerings/direct_calls.py)
on CUDA operands: the generated line, the results against the references and against the same op called
through the dispatcher, the profiler range, and a CUDA-graph replay. Any world size (one GPU: every choice
but the reference declines, which still takes the direct path)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpu_helpers import shared_seed
from torch._inductor.utils import run_and_get_code

from fluxcompile import ops
from fluxcompile.lowerings import direct_calls
from fluxcompile.testing.numerics import assert_close


def test_compiled_calls_go_through_the_entries():
    group = dist.group.WORLD
    world, name = group.size(), group.group_name
    g = torch.Generator(device="cuda").manual_seed(shared_seed() + dist.get_rank())

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale

    x, a = rnd(72, 256), rnd(24, 512)  # 72 * world rows gathered: not a multiple of a tile
    b1, b2, w_rs, w = (rnd(*s, scale=1 / 16) for s in ((256, 384), (256, 384), (384, 256), (512, 256)))
    res, nw = rnd(24, 256), rnd(256)

    def fused(x, a, res):
        # Explicit calls of the ops (no rewrite needed), so the test runs at any world size.
        xg, (h1, h2) = torch.ops.fluxcompile.all_gather_matmul(x, [b1, b2], [None, None], 0, world, name)
        rs = torch.ops.fluxcompile.matmul_reduce_scatter(
            [torch.relu(h1) * h2], [w_rs], None, [xg.shape[0], 256], 0, "sum", world, name
        )
        ar = torch.ops.fluxcompile.matmul_all_reduce([a], [w], None, [a.shape[0], 256], "sum", name)
        h, normed = torch.ops.fluxcompile.all_reduce_rmsnorm(
            None, [a], [w], None, [a.shape[0], 256], res, nw, 1e-6, True, False, "sum", name
        )
        return xg, rs, ar, h, normed

    eager = fused(x, a, res)  # through the dispatcher (tunes and memoizes every choice)
    compiled = torch.compile(fused, backend="inductor")
    got, codes = run_and_get_code(compiled, x, a, res)
    code = "\n".join(codes)
    for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce_rmsnorm"):
        assert f"extern_kernels.{direct_calls.entry_name(op)}(" in code, f"{op} is not called directly:\n{code}"
        assert f"torch.ops.fluxcompile.{op}.default(" not in code, op

    # References from the ops' reference implementations (NCCL + cuBLAS).
    xg_ref, (h1_ref, h2_ref) = ops.REFERENCES["all_gather_matmul"](x, [b1, b2], [None, None], 0, world, name)
    rs_ref = ops.REFERENCES["matmul_reduce_scatter"](
        [torch.relu(h1_ref) * h2_ref], [w_rs], None, [xg_ref.shape[0], 256], 0, "sum", world, name
    )
    ar_ref = ops.REFERENCES["matmul_all_reduce"]([a], [w], None, [a.shape[0], 256], "sum", name)
    h_ref, n_ref = ops.REFERENCES["all_reduce_rmsnorm"](
        None, [a], [w], None, [a.shape[0], 256], res, nw, 1e-6, True, False, "sum", name
    )
    refs = (xg_ref, rs_ref, ar_ref, h_ref, n_ref)
    labels = ("gathered", "reduce-scattered", "all-reduced", "residual", "normed")
    for label, o, e, r in zip(labels, got, eager, refs):
        assert_close(o, r, 0.0 if label == "gathered" else 2e-2, f"compiled {label}")
        assert_close(o, e, 2e-2, f"compiled vs dispatcher {label}")

    # The profiler names the op's range, as the dispatcher would.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x, a, res)
    keys = {e.key for e in prof.key_averages()}
    assert "fluxcompile::matmul_reduce_scatter" in keys, sorted(keys)[:40]

    # Captured in a CUDA graph (the choices are memoized): replays on fresh inputs stay correct.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap = compiled(x, a, res)
    for _ in range(3):
        x.copy_(rnd(72, 256))
        a.copy_(rnd(24, 512))
        graph.replay()
        ref = fused(x, a, res)
        for label, o, r in zip(labels, cap, ref):
            assert_close(o, r, 2e-2, f"graph replay {label}")
