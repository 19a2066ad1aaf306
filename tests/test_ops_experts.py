"""The all-to-all ops with expert weights and row permutations, and embedding_bag_all_to_all: the reference
implementations against loops of plain matmuls and ``torch.distributed.all_to_all_single``, fakes against reals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_ops import _check_fake, _seeded

from fluxcompile import ops
from fluxcompile.testing.numerics import assert_close


def _a2a(x: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send)
    return out


def _routing(g: torch.Generator, world: int, experts: int) -> torch.Tensor:
    """``counts[src, dst * experts + e]``: rows rank ``src`` sends to expert ``e`` of rank ``dst`` (some zero)."""
    counts = torch.randint(0, 4, (world, world * experts), generator=g)
    counts[0, 0] = 0
    return counts


def experts_case() -> list[str]:
    ws, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    g = _seeded(1)
    E, K, N = 3, 16, 24
    counts = _routing(g, ws, E)
    send = counts[rank].view(ws, E).sum(1).tolist()
    recv = [int(counts[src, rank * E : (rank + 1) * E].sum()) for src in range(ws)]
    x = torch.randn(sum(send), K, generator=g) + rank
    w1, w3 = torch.randn(E, K, N, generator=g), torch.randn(E, K, N, generator=g)
    checked = []

    # Dispatch: received rows are [source][expert]; the permutation puts them [expert][source], plus one padding row.
    recv_counts = counts[:, rank * E : (rank + 1) * E]  # [src, e]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), recv_counts.flatten().cumsum(0)[:-1]]).view(ws, E)
    perm = [int(starts[s, e]) + j for e in range(E) for s in range(ws) for j in range(int(recv_counts[s, e]))]
    R = sum(recv)
    row_index = torch.tensor([*perm, R])  # the last row reads the padding row
    sizes = recv_counts.sum(0).tolist()
    sizes[-1] += 1
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    args = (x, [w1, w3], [None, None], recv, send, group)
    kw = {"offs": offs, "row_index": row_index}
    A, outs = ops.op("all_to_all_matmul")(*args, **kw)
    exchanged = _a2a(x, recv, send)
    assert_close(A, exchanged, 0.0, "exchanged A")
    xp = torch.cat([exchanged, exchanged.new_zeros(1, K)])[row_index]
    bounds = [0, *offs.tolist()]
    for w, out in zip((w1, w3), outs):
        ref = torch.cat([xp[bounds[e] : bounds[e + 1]] @ w[e] for e in range(E)])
        assert_close(out, ref, 1e-5, "grouped all_to_all_matmul")
    _check_fake("all_to_all_matmul", (*args, *[None] * 4, offs, row_index), (A, outs))
    checked.append("dispatch grouped")

    # Combine: the grouped products go back to their [source][expert] rows, then home.
    h = torch.randn(len(perm) + 1, N, generator=g)
    w2 = torch.randn(E, N, K, generator=g)
    for accumulate in (False, True):
        args = ([h], [w2], None, [R, K], send, recv, group)
        out = ops.op("matmul_all_to_all")(*args, offs=offs, row_index=row_index, accumulate=accumulate)
        p = torch.cat([h[bounds[e] : bounds[e + 1]] @ w2[e] for e in range(E)])
        y = torch.zeros(R, K)
        y[row_index[:-1]] = p[:-1]  # the padding row's write is dropped
        assert_close(out, _a2a(y, send, recv), 1e-5, f"grouped matmul_all_to_all accumulate={accumulate}")
        _check_fake("matmul_all_to_all", (*args, *[None] * 4, offs, row_index, accumulate), out)
    checked.append("combine grouped")

    # Capacity form: equal splits, [world, E, C] blocks transposed to [E, world * C], bmm per expert.
    C = 2
    xc = torch.randn(ws * E * C, K, generator=g)
    split = [E * C] * ws
    index = torch.arange(ws * E * C).view(ws, E, C).transpose(0, 1).reshape(-1)
    A, outs = ops.op("all_to_all_matmul")(xc, [w1], [None], split, split, group, row_index=index)
    xe = _a2a(xc, split, split).view(ws, E, C, K).transpose(0, 1).reshape(E, ws * C, K)
    assert_close(outs[0], torch.bmm(xe, w1), 1e-5, "bmm all_to_all_matmul")
    assert outs[0].shape == (E, ws * C, N)
    hc = torch.randn(E, ws * C, N, generator=g)
    out = ops.op("matmul_all_to_all")([hc], [w2], None, [ws * E * C, K], split, split, group, row_index=index)
    yc = torch.bmm(hc, w2).view(E, ws, C, K).transpose(0, 1).reshape(-1, K)
    assert_close(out, _a2a(yc, split, split), 1e-5, "bmm matmul_all_to_all")
    checked.append("capacity bmm")

    # A gather's backward: duplicate indices add up.
    index = torch.tensor([0, 0, 1, 1] * ws) % (2 * ws)
    hd = torch.randn(4 * ws, N, generator=g)
    out = ops.op("matmul_all_to_all")(
        [hd], [torch.eye(N)], None, [2 * ws, N], [2] * ws, [2] * ws, group, row_index=index, accumulate=True
    )
    y = torch.zeros(2 * ws, N).index_put_((index,), hd, accumulate=True)
    assert_close(out, _a2a(y, [2] * ws, [2] * ws), 1e-5, "accumulating scatter")
    return checked


def embedding_bag_case(mode: int) -> None:
    ws, group = dist.get_world_size(), dist.group.WORLD.group_name
    g = _seeded(2 + mode)
    T, D, B_local = 2, 8, 3
    B = B_local * ws
    weights = [torch.randn(10 + t, D, generator=g) for t in range(T)]
    lengths = [torch.randint(0, 4, (B,), generator=g) for _ in range(T)]
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)[:-1]]) for n in lengths]
    indices = [torch.randint(0, 10 + t, (int(n.sum()),), generator=g) for t, n in enumerate(lengths)]
    split = [B_local] * ws
    args = (weights, indices, offsets, mode, False, [B, T * D], split, split, group)
    result = ops.op("embedding_bag_all_to_all")(*args)
    out = result[0]
    names = {0: "sum", 1: "mean", 2: "max"}
    pooled = torch.stack(
        [torch.nn.functional.embedding_bag(i, w, o, mode=names[mode]) for w, i, o in zip(weights, indices, offsets)],
        dim=1,
    )
    assert_close(out, _a2a(pooled.reshape(B, T * D), split, split), 1e-6, f"embedding_bag_all_to_all mode {mode}")
    _check_fake("embedding_bag_all_to_all", args, result)


def bad_arguments() -> None:
    group = dist.group.WORLD.group_name
    ws = dist.get_world_size()
    x, w = torch.randn(2 * ws, 8), torch.randn(3, 8, 4)
    with pytest.raises(ValueError, match="offs"):
        ops.op("all_to_all_matmul")(x, [torch.randn(8, 4)], [None], [2] * ws, [2] * ws, group, offs=torch.ones(3))
    with pytest.raises(ValueError, match="no bias"):
        ops.op("all_to_all_matmul")(x, [w], [torch.randn(4)], [2] * ws, [2] * ws, group)
    with pytest.raises(ValueError, match="row_index"):
        ops.op("all_to_all_matmul")(x, [w], [None], [2] * ws, [2] * ws, group, row_index=torch.ones(2, 2).long())
    with pytest.raises(ValueError, match="mode 5"):
        ops.op("embedding_bag_all_to_all")(
            [torch.randn(4, 8)], [torch.zeros(2).long()], [torch.zeros(1).long()], 5, False, [1, 8], [], [], group
        )


@pytest.mark.parametrize("world", [2, 3])
def test_expert_references(ranks, world):
    for checked in ranks(world).run(experts_case):
        assert checked == ["dispatch grouped", "combine grouped", "capacity bmm"]


def test_embedding_bag_reference(ranks):
    for mode in (0, 1, 2):
        ranks(2).run(embedding_bag_case, mode)


def test_bad_expert_arguments(ranks):
    ranks(2).run(bad_arguments)
