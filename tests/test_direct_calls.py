"""Inductor's generated code calls the fused ops' entries (lowerings/direct_calls.py), not torch.ops: the
line it writes, the arguments it passes (lists, None, multi-output results) and the results, on CPU where
each entry hands the call back to the dispatcher; and ``config.direct_calls`` off restores torch.ops."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import assert_close, fresh_compiles
from torch._inductor.utils import run_and_get_code

import fluxcompile
from fluxcompile.lowerings import direct_calls


def _block(x, w1, w3, w2, group):
    # all-gather -> two matmuls (one fused op, a list of outputs), matmul -> reduce-scatter.
    h = funcol.all_gather_tensor(x, 0, group)
    y = (torch.relu(h @ w1) * (h @ w3)) @ w2
    return funcol.reduce_scatter_tensor(y, "sum", 0, group)


def _compile_and_code(direct: bool) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    x, w1, w3 = torch.randn(6, 16), torch.randn(16, 32), torch.randn(16, 32)
    w2 = torch.randn(32, 16)
    ref = _block(x, w1, w3, w2, group)
    torch._dynamo.reset()
    with fresh_compiles(), fluxcompile.config.patch(direct_calls=direct):
        out, codes = run_and_get_code(torch.compile(_block, backend="fluxcompile"), x, w1, w3, w2, group)
    return codes, out, ref


def direct_rank() -> dict[str, object]:
    result = {}
    for direct in (True, False):
        codes, out, ref = _compile_and_code(direct)
        assert_close(out, ref, 1e-5, f"direct_calls={direct}")
        code = "\n".join(codes)
        result[direct] = {
            op: (
                f"extern_kernels.{direct_calls.entry_name(op)}(" in code,
                f"torch.ops.fluxcompile.{op}.default(" in code,
            )
            for op in ("all_gather_matmul", "matmul_reduce_scatter")
        }
    return result


def test_generated_code_calls_the_entries(ranks):
    r = ranks(2).run(direct_rank)[0]
    # (entry called, torch.ops called) per op
    assert r[True] == {"all_gather_matmul": (True, False), "matmul_reduce_scatter": (True, False)}, r
    assert r[False] == {"all_gather_matmul": (False, True), "matmul_reduce_scatter": (False, True)}, r


def test_every_op_with_a_cuda_implementation_has_an_entry():
    from torch._inductor.select_algorithm import extern_kernels

    entries = direct_calls.registered()
    assert set(entries) == {
        "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce_rmsnorm",
        "embedding_bag_all_to_all", "all_to_all_embedding_bag_backward", "all_to_all_matmul", "matmul_all_to_all",
    }  # fmt: skip
    for op, entry in entries.items():
        assert getattr(extern_kernels, direct_calls.entry_name(op)) is entry
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fluxcompile::{op}", "CUDA"), op


def test_entry_hands_cpu_operands_to_the_dispatcher():
    # matmul_all_reduce over a 1-rank group: the entry must call the op (the reference runs on CPU), not the
    # CUDA implementation.
    entry = direct_calls.registered()["matmul_all_reduce"]
    calls = []

    class Mode(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with Mode():
        try:
            entry([a], [b], None, [3, 5], "sum", "no-such-group")
        except Exception:
            pass  # the group does not exist; what matters is that the dispatcher saw the op first
    assert calls and calls[0] == "fluxcompile.matmul_all_reduce.default", calls
