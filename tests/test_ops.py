"""The fused ops called directly: reference impls against an independent decomposition made of
``torch.distributed`` collectives, fake impls against real outputs, and bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fluxcompile import ops
from fluxcompile.testing.numerics import assert_close


def _seeded(salt: int) -> torch.Generator:
    """Equal on all ranks, different every run."""
    seed = torch.randint(0, 2**31 - 1, (1,))
    dist.broadcast(seed, 0)
    return torch.Generator().manual_seed(int(seed) + salt)


def _rand(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _sum_all(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def _same_layout(real, fake, what: str) -> None:
    assert real.shape == fake.shape and real.stride() == fake.stride() and real.dtype == fake.dtype, (
        f"{what}: real {tuple(real.shape)}/{real.stride()}/{real.dtype} vs fake {tuple(fake.shape)}/{fake.stride()}/{fake.dtype}"
    )


def _check_fake(opname: str, args: tuple, real) -> None:
    mode = FakeTensorMode()
    fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
    with mode:
        fake = ops.op(opname)(*fake_args)
    for i, (r, f) in enumerate(zip(torch.utils._pytree.tree_leaves(real), torch.utils._pytree.tree_leaves(fake))):
        _same_layout(r, f, f"{opname} output {i}")


def references(dtype_name: str) -> list[str]:
    dtype = getattr(torch, dtype_name)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ws, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    g = _seeded(0)
    checked = []

    # all_gather_matmul: ND shard [2, 7, 24] gathered on dim 1, three weights, one with a bias.
    shards = [_rand(g, 2, 7, 24, dtype=dtype) for _ in range(ws)]
    Bs = [_rand(g, 24, n, dtype=dtype) for n in (40, 8, 16)]
    biases = [_rand(g, 40, dtype=dtype), None, None]
    args = (shards[rank], Bs, biases, 1, ws, group)
    A, outs = ops.op("all_gather_matmul")(*args)
    full = torch.cat(shards, dim=1)
    assert_close(A, full, 0.0, "gathered A")
    for i, (b, bias) in enumerate(zip(Bs, biases)):
        ref = full.reshape(-1, 24).float() @ b.float() + (0 if bias is None else bias.float())
        assert_close(outs[i], ref, tol, f"all_gather_matmul out {i}")
    _check_fake("all_gather_matmul", args, (A, outs))
    checked.append("all_gather_matmul")

    # matmul_reduce_scatter: sum of two matmuls with a bias, viewed [2, 6*ws, 40], scattered on dim 1.
    m = 2 * 6 * ws
    As, Bs = [_rand(g, m, 24, dtype=dtype) for _ in range(2)], [_rand(g, 24, 40, dtype=dtype) for _ in range(2)]
    bias = _rand(g, 40, dtype=dtype)
    args = (As, Bs, bias, [2, 6 * ws, 40], 1, "sum", ws, group)
    out = ops.op("matmul_reduce_scatter")(*args)
    partial = (As[0].float() @ Bs[0].float() + bias.float() + As[1].float() @ Bs[1].float()).reshape(2, 6 * ws, 40)
    ref = _sum_all(partial).chunk(ws, dim=1)[rank]
    assert_close(out, ref, tol, "matmul_reduce_scatter")
    _check_fake("matmul_reduce_scatter", args, out)
    checked.append("matmul_reduce_scatter")

    # matmul_all_reduce: one matmul with bias, viewed [3, 5, 40].
    a, b, bias = _rand(g, 15, 24, dtype=dtype), _rand(g, 24, 40, dtype=dtype), _rand(g, 40, dtype=dtype)
    args = ([a], [b], bias, [3, 5, 40], "sum", group)
    out = ops.op("matmul_all_reduce")(*args)
    assert_close(out, _sum_all((a.float() @ b.float() + bias.float()).reshape(3, 5, 40)), tol, "matmul_all_reduce")
    _check_fake("matmul_all_reduce", args, out)
    checked.append("matmul_all_reduce")

    # all_to_all_matmul / matmul_all_to_all with unequal splits: rank r sends 1 + r + j rows to rank j.
    send = [1 + rank + j for j in range(ws)]
    recv = [1 + j + rank for j in range(ws)]
    x, w = _rand(g, sum(send), 24, dtype=dtype), _rand(g, 24, 40, dtype=dtype)
    x = x + rank  # different data per rank
    expected = torch.empty(sum(recv), 24, dtype=dtype)
    dist.all_to_all_single(expected, x, recv, send)
    args = (x, [w], [None], recv, send, group)
    A, outs = ops.op("all_to_all_matmul")(*args)
    assert_close(A, expected, 0.0, "exchanged A")
    assert_close(outs[0], expected.float() @ w.float(), tol, "all_to_all_matmul")
    _check_fake("all_to_all_matmul", args, (A, outs))
    checked.append("all_to_all_matmul")

    a = _rand(g, sum(send), 24, dtype=dtype) + rank
    args = ([a], [w], None, [sum(send), 40], recv, send, group)
    out = ops.op("matmul_all_to_all")(*args)
    expected = torch.empty(sum(recv), 40, dtype=dtype)
    dist.all_to_all_single(expected, (a @ w).contiguous(), recv, send)
    assert_close(out, expected, tol, "matmul_all_to_all")
    _check_fake("matmul_all_to_all", args, out)
    checked.append("matmul_all_to_all")

    # all_reduce_rmsnorm, from a sum of matmuls and from a bare tensor, both weight orders.
    a, b = _rand(g, 10, 24, dtype=dtype), _rand(g, 24, 32, dtype=dtype)
    res, weight = _rand(g, 2, 5, 32, dtype=dtype), _rand(g, 32, dtype=dtype)
    for x, after in ((None, False), ((a @ b).reshape(2, 5, 32), True)):
        args = (x, [] if x is not None else [a], [] if x is not None else [b], None, [2, 5, 32], res, weight, 1e-5,
                dtype != torch.float32, after, "sum", group)  # fmt: skip
        h, normed = ops.op("all_reduce_rmsnorm")(*args)
        h_ref = res.float() + _sum_all((a.float() @ b.float()).reshape(2, 5, 32))
        n = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
        assert_close(h, h_ref, tol, "all_reduce_rmsnorm residual")
        assert_close(normed, n, 2 * tol, "all_reduce_rmsnorm normed")
        _check_fake("all_reduce_rmsnorm", args, (h, normed))
    checked.append("all_reduce_rmsnorm")
    return checked


@pytest.mark.parametrize(("world", "dtype"), [(2, "float32"), (2, "bfloat16"), (4, "float32"), (8, "bfloat16")])
def test_references_match_decomposition(ranks, world, dtype):
    for checked in ranks(world).run(references, dtype):
        assert checked == list(ops.FUSED_OPS)


def bad_arguments() -> list[str]:
    group = dist.group.WORLD.group_name
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    messages = []
    for call in (
        lambda: ops.op("all_gather_matmul")(x, [w, w], [None], 0, 2, group),  # 2 weights, 1 bias
        lambda: ops.op("all_gather_matmul")(x, [w], [None], 1, 2, group),  # gather on the K dim
        lambda: ops.op("all_gather_matmul")(x, [w], [None], 0, 4, group),  # world size mismatch
        lambda: ops.op("matmul_reduce_scatter")([x[:3]], [w], None, [3, 3], 0, "sum", 2, group),  # 3 rows over 2
        lambda: ops.op("matmul_all_reduce")([x, x], [w], None, [4, 3], "sum", group),  # 2 lefts, 1 right
        lambda: ops.op("all_gather_matmul")(x, [w], [None], 0, 2, "no-such-group"),
    ):
        try:
            call()
        except (ValueError, RuntimeError) as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def test_bad_arguments_get_clear_errors(ranks):
    msgs = ranks(2).run(bad_arguments)[0]
    assert "2 weights but 1 biases" in msgs[0]
    assert "must be a row dim" in msgs[1]
    assert "group_size=4 but process group" in msgs[2] and "has 2 ranks" in msgs[2]
    assert "does not split over 2 ranks" in msgs[3]
    assert "as many left as right operands" in msgs[4]
    assert "no process group named 'no-such-group'" in msgs[5]
