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


def _check_fake(opname: str, args: tuple, real, **kwargs) -> None:
    mode = FakeTensorMode()
    fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
    with mode:
        fake = ops.op(opname)(*fake_args, **kwargs)
    assert torch.utils._pytree.tree_structure(fake) == torch.utils._pytree.tree_structure(real), (
        f"{opname}: fake {torch.utils._pytree.tree_structure(fake)} vs real {torch.utils._pytree.tree_structure(real)}"
    )
    for i, (r, f) in enumerate(zip(torch.utils._pytree.tree_leaves(real), torch.utils._pytree.tree_leaves(fake))):
        if r is None or f is None:  # an optional result left out (all_gather_matmul's with return_A=False)
            assert r is None and f is None, f"{opname} output {i}: real {r!r} vs fake {f!r}"
            continue
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
    # return_A=False: no gathered tensor, the same products (the reference still gathers to compute them).
    no_A, outs_without_A = ops.op("all_gather_matmul")(*args, return_A=False)
    assert no_A is None, "all_gather_matmul with return_A=False returned the gathered tensor"
    assert len(outs_without_A) == len(outs)
    for i, (out, out_without_A) in enumerate(zip(outs, outs_without_A)):
        assert_close(out_without_A, out, 0.0, f"all_gather_matmul out {i}, return_A=False")
    _check_fake("all_gather_matmul", args, (None, outs_without_A), return_A=False)
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

    # embedding_bag_all_to_all: two tables pooled (sum) for 2 samples per rank, sent to the samples' owners.
    weights = [_rand(g, 9, 8, dtype=dtype), _rand(g, 5, 8, dtype=dtype)]
    indices = [torch.randint(0, 5, (3 * ws,), generator=g) for _ in weights]
    offsets = [torch.arange(2 * ws) for _ in weights]  # the last bag holds the rest
    args = (weights, indices, offsets, 0, False, [2 * ws, 16], [2] * ws, [2] * ws, group)
    out, *book = ops.op("embedding_bag_all_to_all")(*args)
    assert book == [[], [], []], book
    pooled = torch.cat([torch.nn.functional.embedding_bag(i, w, o, mode="sum") for w, i, o in zip(weights, indices, offsets)], 1)
    expected = torch.empty(2 * ws, 16, dtype=dtype)
    dist.all_to_all_single(expected, pooled.contiguous(), [2] * ws, [2] * ws)
    assert_close(out, expected, tol, "embedding_bag_all_to_all")
    _check_fake("embedding_bag_all_to_all", args, (out, *book))
    # Equal splits as empty lists (a graph's all_to_all_single without split sizes).
    args = (weights, indices, offsets, 0, False, [2 * ws, 16], [], [], group)
    result = ops.op("embedding_bag_all_to_all")(*args)
    assert_close(result[0], expected, tol, "embedding_bag_all_to_all, equal splits as empty lists")
    _check_fake("embedding_bag_all_to_all", args, result)
    # With the bookkeeping (a training forward): aten's own, table by table.
    for mode in (0, 1):
        args = (weights, indices, offsets, mode, False, [2 * ws, 16], [], [], group)
        out, *book = ops.op("embedding_bag_all_to_all")(*args, bookkeeping=True)
        for t, (w, i, o) in enumerate(zip(weights, indices, offsets)):
            want = torch.ops.aten._embedding_bag(w, i, o, False, mode, False, None, False)
            for k in (1, 2, 3):
                assert torch.equal(book[k - 1][t], want[k]), f"bookkeeping output {k} of table {t}, mode {mode}"
        if dtype == torch.float32:  # aten's CPU meta sizes a bf16 sum's offset2bag unlike its kernel (empty)
            _check_fake("embedding_bag_all_to_all", args, (out, *book), bookkeeping=True)
    checked.append("embedding_bag_all_to_all")

    # all_to_all_embedding_bag_backward: the pooled rows' gradients back to the tables' owners, then each table's
    # embedding-bag gradient (sum and mean, the bookkeeping as aten's forward makes it).
    for mode in (0, 1):
        tables = [torch.nn.Parameter(w.detach().clone()) for w in weights]
        books = [torch.ops.aten._embedding_bag(w, i, o, False, mode, False, None, False, -1)
                 for w, i, o in zip(tables, indices, offsets)]  # fmt: skip
        pooled = torch.cat([b[0] for b in books], 1)
        gout = _rand(g, 2 * ws, 16, dtype=dtype)
        args = (gout, indices, offsets, [b[1] for b in books], [b[2] for b in books], [b[3] for b in books],
                [w.shape[0] for w in weights], False, mode, [2] * ws, [2] * ws, group)  # fmt: skip
        grads = ops.op("all_to_all_embedding_bag_backward")(*args)
        back = torch.empty(2 * ws, 16, dtype=dtype)
        dist.all_to_all_single(back, gout, [2] * ws, [2] * ws)
        pooled.backward(back)
        for t, (got, w) in enumerate(zip(grads, tables)):
            assert_close(got, w.grad.float(), tol, f"all_to_all_embedding_bag_backward mode {mode} table {t}")
        _check_fake("all_to_all_embedding_bag_backward", args, grads)
        # Sparse gradients (the op called directly: the rewrite keeps sparse backwards): aten's, uncoalesced.
        sparse = ops.op("all_to_all_embedding_bag_backward")(*args, sparse=True)
        for t, (got, w) in enumerate(zip(sparse, tables)):
            assert got.is_sparse and got._nnz() == indices[t].numel(), f"sparse gradient of table {t}"
            assert_close(got.to_dense(), w.grad.float(), tol, f"sparse all_to_all_embedding_bag_backward table {t}")
        mode_ = FakeTensorMode()
        with mode_:
            fakes = ops.op("all_to_all_embedding_bag_backward")(
                *torch.utils._pytree.tree_map_only(torch.Tensor, mode_.from_tensor, args), sparse=True
            )
        assert [(f.layout, tuple(f.shape), f._nnz()) for f in fakes] == [
            (s.layout, tuple(s.shape), s._nnz()) for s in sparse
        ], "the sparse gradients' fakes"
    checked.append("all_to_all_embedding_bag_backward")
    return checked


@pytest.mark.parametrize(("world", "dtype"), [(2, "float32"), (2, "bfloat16"), (4, "float32"), (8, "bfloat16")])
def test_references_match_decomposition(ranks, world, dtype):
    for checked in ranks(world).run(references, dtype):
        assert checked == list(ops.FUSED_OPS)


def _fp8(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.float8_e4m3fn)


def _scaled(a, b, sa, sb, bias=None) -> torch.Tensor:
    """An independent fp32 product of fp8 operands with tensor-wise or row/column-wise scales."""
    out = (a.float() * sa.float()) @ (b.float() * sb.float())
    return out if bias is None else out + bias.float()


def scaled_and_last_dim() -> list[str]:
    """fp8 scaled matmuls (tensor-wise and row-wise scales) through every op with matmuls, and the
    reduce-scatter along the last (feature) dim."""
    ws, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    g = _seeded(1)
    tol, checked = 2e-2, []
    bf16 = torch.bfloat16

    # all_gather_matmul: a row-wise A scale travels with A's rows (with column-wise B scales), or tensor-wise
    # scales throughout.
    shards = [_fp8(g, 8, 32) for _ in range(ws)]
    row_scales = [torch.rand(8, 1, generator=g) + 0.5 for _ in range(ws)]
    Bs = [_fp8(g, 16, 32).t(), _fp8(g, 24, 32).t()]  # column-major, as _scaled_mm wants its right operand
    by_column = [torch.rand(1, 16, generator=g) + 0.5, torch.rand(1, 24, generator=g) + 0.5]
    for A_scale, full_scale, B_scales in (
        (row_scales[rank], torch.cat(row_scales), by_column),
        (torch.tensor(2.0), torch.tensor(2.0), [torch.tensor(0.5), torch.tensor(1.5)]),
    ):
        args = (shards[rank], Bs, [None, None], 0, ws, group, A_scale, B_scales, bf16)
        A, outs = ops.op("all_gather_matmul")(*args)
        full = torch.cat(shards)
        assert_close(A.float(), full.float(), 0.0, "gathered fp8 A")
        for i, (b, sb) in enumerate(zip(Bs, B_scales)):
            assert outs[i].dtype == bf16
            assert_close(outs[i], _scaled(full, b, full_scale, sb), tol, f"scaled all_gather_matmul out {i}")
        _check_fake("all_gather_matmul", args, (A, outs))
        no_A, outs_without_A = ops.op("all_gather_matmul")(*args, return_A=False)
        assert no_A is None, "scaled all_gather_matmul with return_A=False returned the gathered tensor"
        for i, (out, out_without_A) in enumerate(zip(outs, outs_without_A)):
            assert_close(out_without_A.float(), out.float(), 0.0, f"scaled all_gather_matmul out {i}, return_A=False")
    checked.append("all_gather_matmul")

    # matmul_reduce_scatter: two scaled terms with a bias, scattered along rows and along the last dim.
    As, Bs = [_fp8(g, 4 * ws, 32) for _ in range(2)], [_fp8(g, 16 * ws, 32).t() for _ in range(2)]
    A_scales = [torch.rand(4 * ws, 1, generator=g) + 0.5, torch.tensor(1.5)]
    B_scales = [torch.rand(1, 16 * ws, generator=g) + 0.5, torch.tensor(0.25)]
    bias = torch.randn(16 * ws, generator=g).to(bf16)
    partial = _scaled(As[0], Bs[0], A_scales[0], B_scales[0], bias) + _scaled(As[1], Bs[1], A_scales[1], B_scales[1])
    total = _sum_all(partial)
    for dim in (0, -1):
        args = (As, Bs, bias, [4 * ws, 16 * ws], dim, "sum", ws, group, A_scales, B_scales, bf16)
        out = ops.op("matmul_reduce_scatter")(*args)
        assert_close(out, total.chunk(ws, dim=dim)[rank], tol, f"scaled matmul_reduce_scatter, dim {dim}")
        _check_fake("matmul_reduce_scatter", args, out)
    checked.append("matmul_reduce_scatter")

    # The last-dim reduce-scatter, unscaled and averaged: 3-D output split along its features.
    a, b = torch.randn(6, 24, generator=g), torch.randn(24, 8 * ws, generator=g)
    args = ([a], [b], None, [2, 3, 8 * ws], 2, "avg", ws, group)
    out = ops.op("matmul_reduce_scatter")(*args)
    expected = (_sum_all(a @ b) / ws).reshape(2, 3, 8 * ws).chunk(ws, dim=2)[rank]
    assert_close(out, expected, 1e-5, "last-dim matmul_reduce_scatter (avg)")
    _check_fake("matmul_reduce_scatter", args, out)

    # matmul_all_reduce and matmul_all_to_all, one scaled term each.
    a, b, sa, sb = _fp8(g, 2 * ws, 32), _fp8(g, 16, 32).t(), torch.tensor(0.75), torch.tensor(1.25)
    args = ([a], [b], None, [2 * ws, 16], "sum", group, [sa], [sb], bf16)
    out = ops.op("matmul_all_reduce")(*args)
    assert_close(out, _sum_all(_scaled(a, b, sa, sb)), tol, "scaled matmul_all_reduce")
    _check_fake("matmul_all_reduce", args, out)
    checked.append("matmul_all_reduce")

    splits = [2] * ws
    args = ([a], [b], None, [2 * ws, 16], splits, splits, group, [sa], [sb], bf16)
    out = ops.op("matmul_all_to_all")(*args)
    expected = torch.empty(2 * ws, 16, dtype=bf16)
    dist.all_to_all_single(expected, _scaled(a, b, sa, sb).to(bf16), splits, splits)
    assert_close(out, expected, tol, "scaled matmul_all_to_all")
    checked.append("matmul_all_to_all")

    # all_to_all_matmul: a row-wise A scale is exchanged with A's rows.
    x, sx, sb = _fp8(g, 2 * ws, 32), torch.rand(2 * ws, 1, generator=g) + 0.5, torch.rand(1, 16, generator=g) + 0.5
    args = (x, [b], [None], splits, splits, group, sx, [sb], bf16)
    A, outs = ops.op("all_to_all_matmul")(*args)
    x_ex, sx_ex = torch.empty(2 * ws, 32, dtype=torch.float32), torch.empty(2 * ws, 1)
    dist.all_to_all_single(x_ex, x.float(), splits, splits)
    dist.all_to_all_single(sx_ex, sx, splits, splits)
    assert_close(outs[0], _scaled(x_ex, b, sx_ex, sb), tol, "scaled all_to_all_matmul")
    checked.append("all_to_all_matmul")
    return checked


def test_scaled_matmuls_and_last_dim_scatter(ranks):
    for checked in ranks(2).run(scaled_and_last_dim):
        assert checked == ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_to_all",
                           "all_to_all_matmul"]  # fmt: skip


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
        lambda: ops.op("matmul_all_reduce")([x], [w], None, [4, 3], "sum", group, [torch.tensor(1.0)]),  # no B
        lambda: ops.op("matmul_all_reduce")([x], [w], None, [4, 3], "sum", group, None, None, torch.bfloat16),
        lambda: ops.op("all_gather_matmul")(x, [w], [None], 0, 2, group, torch.ones(3, 1), [torch.tensor(1.0)]),
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
    assert "one A scale and one B scale per matmul (1), got 1 and None" in msgs[6]
    assert "out_dtype applies to scaled matmuls only" in msgs[7]
    assert "neither one scale nor one per row of A [4, 8]" in msgs[8]


@pytest.mark.parametrize("torch_takes_rowwise", [True, False])
def test_scaled_reference_with_rowwise_scales(monkeypatch, torch_takes_rowwise):
    """The reference's scaled product with row/column-wise scales, through torch's CPU _scaled_mm where it takes
    them and from the dequantized operands where it does not (torch 2.11): the same product either way."""
    if torch_takes_rowwise and not ops._cpu_scaled_mm_takes_rowwise_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes tensor-wise scales only")
    monkeypatch.setattr(ops, "_cpu_scaled_mm_takes_rowwise_scales", lambda: torch_takes_rowwise)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    a, b = _fp8(g, 8, 32), _fp8(g, 24, 32).t()
    sa, sb = torch.rand(8, 1, generator=g) + 0.5, torch.rand(1, 24, generator=g) + 0.5
    bias = torch.randn(24, generator=g).to(torch.bfloat16)
    out = ops._matmul(a, b, bias, sa, sb, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 24)
    assert_close(out, _scaled(a, b, sa, sb, bias), 2e-2, f"rowwise-scaled reference, torch takes rowwise={torch_takes_rowwise}")
