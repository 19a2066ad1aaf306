"""A collective waited on by several ``wait_tensor`` nodes (torch 2.15's AOTAutograd leaves the backward's wait of a
gather it moved into the forward beside the forward's own) is matched as if it had one wait."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from fluxcompile import config
from fluxcompile.fx_passes.graph_pass import rewrite_graph

c10d = torch.ops._c10d_functional


def gather_waited_twice(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    group_name = dist.group.WORLD.group_name
    gathered = c10d.all_gather_into_tensor(x, dist.get_world_size(), group_name)
    out = c10d.wait_tensor(gathered) @ w
    saved = c10d.wait_tensor(gathered)  # as the forward keeps the gathered input for the weight gradient
    return out, saved


def rank_rewrite() -> tuple[int, list[tuple[str | None, str]], bool]:
    g = torch.Generator().manual_seed(dist.get_rank())
    x, w = torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g)
    gm = make_fx(gather_waited_twice, tracing_mode="fake")(x, w)
    expected = gather_waited_twice(x, w)
    waits = sum(n.target is c10d.wait_tensor.default for n in gm.graph.nodes)
    with config.patch(choose_at_compile="never"):
        report = rewrite_graph(gm.graph)
    gm.recompile()
    got = gm(x, w)
    equal = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, expected))
    return waits, [(e.fused_op, e.detail) for e in report.entries], equal


def test_a_gather_waited_twice_fuses(ranks):
    for waits, entries, equal in ranks(2).run(rank_rewrite):
        assert waits == 2, "the traced graph should wait twice on the gather"
        assert [op for op, _ in entries] == ["all_gather_matmul"], entries
        assert equal
