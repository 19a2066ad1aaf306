"""Each rewrite pattern on hand-written graphs of c10d functional collectives and matmuls, on 2 gloo ranks.

A case is a small function ``f`` (collectives from ``torch.distributed._functional_collectives`` or raw
``_c10d_functional`` ops, plus ``mm``/``addmm``/reshapes/adds) with per-rank inputs. On every rank, ``f`` is traced
with ``make_fx(tracing_mode="fake")`` (nodes get FakeTensor ``meta["val"]`` as in a post-grad graph, and
``.to(dtype)`` becomes ``prims.convert_element_type`` as there), rewritten in place by ``rewrite_graph``, and
checked: the graph lints; the fused ops and the collectives left are the expected ones; the report has one entry
per collective with the expected fused op (or none) and reason; the graph's outputs have the same fake shapes,
strides and dtypes as before; and running it on real inputs gives what ``f`` gives eagerly (values, shapes,
strides). Inputs are fresh random tensors of a per-test seed (set ``FLUXCOMPILE_TEST_SEED`` to replay one).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from helpers import assert_close
from torch import Tensor
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from fluxcompile import config, ops
from fluxcompile.fx_passes import rewrite_graph

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_all_gather = getattr(fc, "all_gather_single", fc.all_gather_tensor)
_reduce_scatter = getattr(fc, "reduce_scatter_single", fc.reduce_scatter_tensor)
# What AOTAutograd/Inductor decompose before the post-grad passes and that the matchers rely on.
_DECOMPS = get_decompositions([aten._to_copy])
AG, RS, AR, A2A = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"
AGMM, MMRS, MMAR, A2AMM, MMA2A, ARNORM, EBA2A, A2AEBB = ops.FUSED_OPS


@dataclasses.dataclass
class Ctx:
    """What a case builder needs on its rank: the group and a source of fresh random inputs."""

    seed: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.group = dist.group.WORLD
        self.group_name = self.group.group_name
        self._shared = torch.Generator().manual_seed(self.seed)  # equal on all ranks
        self._local = torch.Generator().manual_seed(self.seed + 7919 * (self.rank + 1))  # differs per rank

    def randn(self, *shape: int, shared: bool = False, dtype: torch.dtype | None = None) -> Tensor:
        gen = self._shared if shared else self._local
        return torch.randn(*shape, generator=gen).to(dtype or self.dtype)


@dataclasses.dataclass
class Case:
    f: Callable[..., Any]
    inputs: list[Tensor]
    # One per collective of the traced graph, in graph order: (collective, fused op or None, detail substrings).
    entries: list[tuple[str, str | None, tuple[str, ...]]]
    # Op-name substrings that the traced graph must contain (the split/cat forms of dim > 0).
    traced: tuple[str, ...] = ()
    # For each all_gather_matmul/all_to_all_matmul node, in graph order: how many matmul outputs it has.
    mm_outputs: tuple[int, ...] = ()
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def fused(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, op, _ in self.entries:
            if op is not None:
                counts[op] = counts.get(op, 0) + 1
        return counts

    @property
    def kept(self) -> int:
        return sum(op is None for _, op, _ in self.entries)


# ------------------------------------------------------------------------------------------------
# all_gather -> mm


def case_ag_dim0(c: Ctx) -> Case:
    def f(x, w):
        return torch.mm(_all_gather(x, 0, c.group), w)

    return Case(
        f,
        [c.randn(8, 16), c.randn(16, 12)],
        [(AG, AGMM, ("gather dim 0", "1 matmul(s) [mm]", "M=16"))],
        mm_outputs=(1,),
    )


def case_ag_dim1_nd(c: Ctx) -> Case:
    def f(x, w):  # x: [B, S/ws, K], w: a linear weight [N, K]
        y = _all_gather(x, 1, c.group)
        return torch.mm(y.reshape(-1, 16), w.t()).reshape(2, 8, 12)

    return Case(
        f,
        [c.randn(2, 4, 16), c.randn(12, 16)],
        [(AG, AGMM, ("gather dim 1", "1 matmul(s)", "M=16"))],
        traced=("aten.split", "aten.cat"),
        mm_outputs=(1,),
    )


def case_ag_dim1_batch1(c: Ctx) -> Case:
    # With B = 1, all_gather_single gathers dim 1 as a view of the dim-0 result (no split/cat): a dim-0 gather.
    def f(x, w):
        y = _all_gather(x, 1, c.group)
        return torch.mm(y.reshape(-1, 16), w).reshape(1, 8, 12)

    return Case(f, [c.randn(1, 4, 16), c.randn(16, 12)], [(AG, AGMM, ("gather dim 0", "M=8"))], mm_outputs=(1,))


def case_ag_qkv(c: Ctx) -> Case:
    def f(x, wq, wk, wv):
        h = _all_gather(x, 1, c.group).reshape(-1, 16)
        q, k, v = torch.mm(h, wq.t()), torch.mm(h, wk.t()), torch.mm(h, wv.t())
        return q.reshape(2, 8, 12), k.reshape(2, 8, 8), v.reshape(2, 8, 8)

    return Case(
        f,
        [c.randn(2, 4, 16), c.randn(12, 16), c.randn(8, 16), c.randn(8, 16)],
        [(AG, AGMM, ("gather dim 1", "3 matmul(s) [mm, mm_1, mm_2]"))],
        traced=("aten.split", "aten.cat"),
        mm_outputs=(3,),
    )


def case_ag_addmm(c: Ctx) -> Case:
    def f(x, w, b):
        return torch.addmm(b, _all_gather(x, 0, c.group), w.t())

    inputs = [c.randn(8, 16), c.randn(12, 16), c.randn(12, shared=True)]
    return Case(f, inputs, [(AG, AGMM, ("gather dim 0", "1 matmul(s) [addmm]"))], mm_outputs=(1,))


def case_ag_ragged(c: Ctx) -> Case:
    def f(x, w):
        return torch.mm(_all_gather(x, 0, c.group), w)

    return Case(f, [c.randn(7, 24), c.randn(24, 40)], [(AG, AGMM, ("gather dim 0", "M=14"))], mm_outputs=(1,))


def case_ag_ragged_dim1(c: Ctx) -> Case:
    def f(x, w1, w2):
        h = _all_gather(x, 1, c.group).reshape(-1, 24)
        return torch.mm(h, w1).reshape(3, 14, 40), torch.mm(h, w2)

    return Case(
        f,
        [c.randn(3, 7, 24), c.randn(24, 40), c.randn(24, 5)],
        [(AG, AGMM, ("gather dim 1", "2 matmul(s)", "M=42"))],
        traced=("aten.split", "aten.cat"),
        mm_outputs=(2,),
    )


def case_ag_other_users(c: Ctx) -> Case:
    # The gathered tensor also feeds a relu and, transposed, a weight-gradient-like mm: both keep reading it.
    def f(x, w, g):
        y = _all_gather(x, 1, c.group)
        h = y.reshape(-1, 16)
        return torch.mm(h, w.t()), torch.relu(y), torch.mm(h.t(), g)

    return Case(
        f,
        [c.randn(2, 4, 16), c.randn(12, 16), c.randn(16, 12)],
        [(AG, AGMM, ("1 matmul(s)", "gathered tensor also kept for 2 other user(s)"))],
        traced=("aten.split", "aten.cat"),
        mm_outputs=(1,),
    )


def case_ag_permute(c: Ctx) -> Case:
    # Megatron's [S, B, K] layout gathered on the sequence dim, then permuted to [B, S, K] before the mm:
    # the permute moves onto the shard.
    def f(x, w1, w2):
        h = _all_gather(x, 0, c.group).permute(1, 0, 2).reshape(-1, 16)
        return torch.mm(h, w1), torch.mm(h, w2)

    return Case(
        f,
        [c.randn(3, 2, 16), c.randn(16, 12), c.randn(16, 8)],
        [(AG, AGMM, ("gather dim 1 (of the shard permuted by [1, 0, 2])", "2 matmul(s)"))],
        mm_outputs=(2,),
    )


def case_no_ag_permute_moves_k(c: Ctx) -> Case:
    # A permute that moves the last dim changes what the matmul contracts over: not followed.
    def f(x, w):
        return torch.mm(_all_gather(x, 0, c.group).permute(0, 2, 1).reshape(-1, 3), w)

    return Case(f, [c.randn(2, 3, 4), c.randn(3, 5)], [(AG, None, ("aten.permute",))])


def case_ag_returned(c: Ctx) -> Case:
    def f(x, w):
        y = _all_gather(x, 0, c.group)
        return y, torch.mm(y, w)

    return Case(f, [c.randn(8, 16), c.randn(16, 12)], [(AG, AGMM, ("also kept for 1 other user(s)",))], mm_outputs=(1,))


def case_ag_mlp(c: Ctx) -> Case:
    # Sequence-parallel MLP: gather -> column-parallel mm -> relu -> row-parallel mm -> reduce_scatter.
    def f(x, w1, w2):
        h = torch.relu(torch.mm(_all_gather(x, 0, c.group), w1))
        return _reduce_scatter(torch.mm(h, w2), "sum", 0, c.group)

    return Case(
        f,
        [c.randn(8, 16), c.randn(16, 24), c.randn(24, 16)],
        [(AG, AGMM, ("1 matmul(s)",)), (RS, MMRS, ("scatter dim 0", "sum of 1 matmul(s)"))],
        mm_outputs=(1,),
    )


# ------------------------------------------------------------------------------------------------
# mm -> reduce_scatter


def case_rs_dim0(c: Ctx) -> Case:
    def f(a, w):
        return _reduce_scatter(torch.mm(a, w), "sum", 0, c.group)

    return Case(f, [c.randn(16, 12), c.randn(12, 10)], [(RS, MMRS, ("scatter dim 0", "sum of 1 matmul(s) [mm]"))])


def case_rs_dim1_nd(c: Ctx) -> Case:
    def f(a, w):  # a: [B*S, K/ws], w: a linear weight shard [N, K/ws]
        p = torch.mm(a, w.t()).reshape(2, 8, 10)
        return _reduce_scatter(p, "sum", 1, c.group)

    return Case(
        f,
        [c.randn(16, 12), c.randn(10, 12)],
        [(RS, MMRS, ("scatter dim 1", "sum of 1 matmul(s)"))],
        traced=("aten.split", "aten.cat"),
    )


def case_rs_permuted_dim1(c: Ctx) -> Case:
    # torchtitan's spmd_types backend scatters the tokens (dim 1) as permute -> contiguous -> reduce_scatter on
    # dim 0 -> permute back; its activation checkpointing also saves the un-waited result.
    def f(a, w):
        p = torch.mm(a, w).reshape(2, 8, 10).permute(1, 0, 2).contiguous()
        rs = c10d.reduce_scatter_tensor(p, "sum", c.ws, c.group_name)
        return c10d.wait_tensor(rs).permute(1, 0, 2), rs

    return Case(
        f,
        [c.randn(16, 12), c.randn(12, 10)],
        [(RS, MMRS, ("scatter dim 1 (of the input permuted by [1, 0, 2])", "sum of 1 matmul(s)"))],
    )


def case_ag_sliced_dim1(c: Ctx) -> Case:
    # torchtitan's spmd_types backend gathers the tokens (dim 1) as all_gather on dim 0 -> one slice per rank -> cat.
    def f(x, w):
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, c.ws, c.group_name))
        rows = x.shape[0]
        h = torch.cat([g[r * rows : (r + 1) * rows] for r in range(c.ws)], dim=1)
        return torch.mm(h.reshape(-1, 16), w)

    return Case(
        f,
        [c.randn(2, 4, 16), c.randn(16, 12)],
        [(AG, AGMM, ("gather dim 1", "1 matmul(s)"))],
        traced=("aten.slice", "aten.cat"),
        mm_outputs=(1,),
    )


def case_no_ag_slices_reordered(c: Ctx) -> Case:
    def f(x, w):
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, c.ws, c.group_name))
        rows = x.shape[0]
        h = torch.cat([g[r * rows : (r + 1) * rows] for r in reversed(range(c.ws))], dim=1)
        return torch.mm(h.reshape(-1, 16), w)

    return Case(
        f,
        [c.randn(2, 4, 16), c.randn(16, 12)],
        [(AG, None, ("the slices of the gathered tensor are not its rank chunks in order",))],
    )


def case_rs_addmm(c: Ctx) -> Case:
    def f(a, w, b):
        return _reduce_scatter(torch.addmm(b, a, w.t()), "sum", 0, c.group)

    inputs = [c.randn(16, 12), c.randn(10, 12), c.randn(10, shared=True)]
    return Case(f, inputs, [(RS, MMRS, ("scatter dim 0", "[addmm], with bias"))])


def case_rs_sum2(c: Ctx) -> Case:
    # The backward's form: an input gradient that is a sum of two matmuls (K differs between the terms).
    def f(a1, b1, a2, b2):
        return _reduce_scatter(torch.mm(a1, b1) + torch.mm(a2, b2), "sum", 0, c.group)

    inputs = [c.randn(16, 12), c.randn(12, 10), c.randn(16, 6), c.randn(6, 10)]
    return Case(f, inputs, [(RS, MMRS, ("sum of 2 matmul(s) [mm, mm_1]",))])


def case_rs_sum3_dim1(c: Ctx) -> Case:
    def f(a1, b1, a2, b2, a3, b3):
        p = torch.mm(a1, b1) + torch.mm(a2, b2) + torch.mm(a3, b3)
        return _reduce_scatter(p.reshape(2, 8, 10), "sum", 1, c.group)

    inputs = [c.randn(16, 12), c.randn(12, 10), c.randn(16, 6), c.randn(6, 10), c.randn(16, 4), c.randn(4, 10)]
    return Case(
        f,
        inputs,
        [(RS, MMRS, ("scatter dim 1", "sum of 3 matmul(s) [mm, mm_1, mm_2]"))],
        traced=("aten.split", "aten.cat"),
    )


def case_rs_sum_bias_second(c: Ctx) -> Case:
    # The biased term comes second in the graph; the fused op puts it first (addition commutes).
    def f(a1, b1, a2, b2, bias):
        return _reduce_scatter(torch.mm(a1, b1) + torch.addmm(bias, a2, b2), "sum", 0, c.group)

    inputs = [c.randn(16, 12), c.randn(12, 10), c.randn(16, 6), c.randn(6, 10), c.randn(10, shared=True)]
    return Case(f, inputs, [(RS, MMRS, ("sum of 2 matmul(s) [addmm, mm]", "with bias"))])


def case_rs_ragged(c: Ctx) -> Case:
    def f(a, w):
        return _reduce_scatter(torch.mm(a, w), "sum", 0, c.group)

    return Case(f, [c.randn(14, 24), c.randn(24, 40)], [(RS, MMRS, ("scatter dim 0",))])


# ------------------------------------------------------------------------------------------------
# mm -> all_reduce


def case_ar_plain(c: Ctx) -> Case:
    def f(a, w):
        return fc.all_reduce(torch.mm(a, w), "sum", c.group)

    return Case(f, [c.randn(8, 12), c.randn(12, 10)], [(AR, MMAR, ("sum of 1 matmul(s) [mm]",))])


def _rms_norm(h: Tensor, weight: Tensor, weight_after_cast: bool) -> Tensor:
    # As nn.RMSNorm (weight, then cast) or Hugging Face's Llama (cast, then weight) spell it.
    x = h.float() if h.dtype != torch.float32 else h
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * n.to(h.dtype) if weight_after_cast else (n * weight).to(h.dtype)


def case_ar_rmsnorm_matmul(c: Ctx) -> Case:
    # Decode's tail: row-parallel mm -> all_reduce -> residual add -> RMSNorm, one fused op.
    def f(a, w, res, g):
        h = res + fc.all_reduce(torch.mm(a, w), "sum", c.group)
        return h, _rms_norm(h, g, False)

    inputs = [c.randn(8, 12), c.randn(12, 16), c.randn(8, 16, shared=True), c.randn(16, shared=True)]
    expect = ("sum of 1 matmul(s) [mm]", "+ residual add + RMSNorm", "weight before the cast")
    return Case(f, inputs, [(AR, ARNORM, expect)])


def case_ar_rmsnorm_bare_nd(c: Ctx) -> Case:
    # A bare all_reduce (its producer is no mm), 3-D, the residual on the right, Hugging Face's order.
    def f(x, res, g):
        h = fc.all_reduce(torch.relu(x), "sum", c.group) + res
        return _rms_norm(h, g, True), h

    inputs = [c.randn(2, 5, 16), c.randn(2, 5, 16, shared=True), c.randn(16, shared=True)]
    return Case(f, inputs, [(AR, ARNORM, ("bare all_reduce", "+ residual add + RMSNorm"))])


def case_no_rmsnorm_rsqrt_saved(c: Ctx) -> Case:
    # Training keeps rsqrt for the backward: the tail stays, the matmul+all_reduce still fuses.
    def f(a, w, res, g):
        h = res + fc.all_reduce(torch.mm(a, w), "sum", c.group)
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h * r * g, r

    inputs = [c.randn(8, 12), c.randn(12, 16), c.randn(8, 16, shared=True), c.randn(16, shared=True)]
    return Case(f, inputs, [(AR, MMAR, ("sum of 1 matmul(s) [mm]",))])


def case_ar_bias(c: Ctx) -> Case:
    def f(a, w, b):
        return fc.all_reduce(torch.addmm(b, a, w.t()), "sum", c.group)

    inputs = [c.randn(8, 12), c.randn(10, 12), c.randn(10, shared=True)]
    return Case(f, inputs, [(AR, MMAR, ("[addmm], with bias",))])


def case_ar_nd(c: Ctx) -> Case:
    def f(a, w):
        return fc.all_reduce(torch.mm(a.reshape(-1, 12), w).reshape(2, 4, 10), "sum", c.group)

    return Case(f, [c.randn(2, 4, 12), c.randn(12, 10)], [(AR, MMAR, ("sum of 1 matmul(s)",))])


def case_ar_sum2(c: Ctx) -> Case:
    def f(a1, b1, a2, b2):
        return fc.all_reduce(torch.mm(a1, b1) + torch.mm(a2, b2), "sum", c.group)

    inputs = [c.randn(8, 12), c.randn(12, 10), c.randn(8, 5), c.randn(5, 10)]
    return Case(f, inputs, [(AR, MMAR, ("sum of 2 matmul(s) [mm, mm_1]",))])


# ------------------------------------------------------------------------------------------------
# all_to_all_single <-> mm


def _uneven_splits(c: Ctx) -> tuple[list[int], list[int]]:
    """Rank r sends [1 + r, 3 - r] rows (4 in all) to ranks 0 and 1; (output splits, input splits)."""
    sends = [[1 + r, 3 - r] for r in range(c.ws)]
    return [sends[src][c.rank] for src in range(c.ws)], sends[c.rank]


def case_a2a_mm(c: Ctx) -> Case:
    def f(x, w):
        return torch.mm(fc.all_to_all_single(x, None, None, c.group), w)

    return Case(f, [c.randn(8, 16), c.randn(16, 12)], [(A2A, A2AMM, ("1 matmul(s) [mm]",))], mm_outputs=(1,))


def case_a2a_mm_uneven(c: Ctx) -> Case:
    out_splits, in_splits = _uneven_splits(c)

    def f(x, w, b, w2):
        y = fc.all_to_all_single(x, out_splits, in_splits, c.group)
        return torch.addmm(b, y, w), torch.mm(y, w2)

    inputs = [c.randn(4, 16), c.randn(16, 12), c.randn(12, shared=True), c.randn(16, 3)]
    return Case(f, inputs, [(A2A, A2AMM, ("2 matmul(s) [addmm, mm]",))], mm_outputs=(2,))


def case_a2a_mm_nd(c: Ctx) -> Case:
    def f(x, w):  # tokens [T, H, K] exchanged along T, then flattened into the mm
        y = fc.all_to_all_single(x, None, None, c.group)
        return torch.mm(y.reshape(-1, 16), w).reshape(4, 2, 12)

    return Case(f, [c.randn(4, 2, 16), c.randn(16, 12)], [(A2A, A2AMM, ("1 matmul(s)",))], mm_outputs=(1,))


def case_mm_a2a(c: Ctx) -> Case:
    def f(a, w):
        return fc.all_to_all_single(torch.mm(a, w), None, None, c.group)

    return Case(f, [c.randn(8, 16), c.randn(16, 12)], [(A2A, MMA2A, ("sum of 1 matmul(s) [mm]",))])


def case_mm_a2a_uneven(c: Ctx) -> Case:
    out_splits, in_splits = _uneven_splits(c)

    def f(a, w, b):
        return fc.all_to_all_single(torch.addmm(b, a, w), out_splits, in_splits, c.group)

    inputs = [c.randn(4, 16), c.randn(16, 12), c.randn(12, shared=True)]
    return Case(f, inputs, [(A2A, MMA2A, ("sum of 1 matmul(s) [addmm]",))])


# ------------------------------------------------------------------------------------------------
# Negative cases: the collective stays, with the reason in the report.


def case_no_relu_before_rs(c: Ctx) -> Case:
    def f(a, w):
        return _reduce_scatter(torch.relu(torch.mm(a, w)), "sum", 0, c.group)

    return Case(
        f, [c.randn(16, 12), c.randn(12, 10)], [(RS, None, ("aten.relu (relu) between mm and reduce_scatter",))]
    )


def case_no_mm_two_users(c: Ctx) -> Case:
    def f(a, w):
        p = torch.mm(a, w)
        return _reduce_scatter(p, "sum", 0, c.group), p

    return Case(f, [c.randn(16, 12), c.randn(12, 10)], [(RS, None, ("mm result (mm) has 2 users",))])


def case_no_view_two_users(c: Ctx) -> Case:
    def f(a, w):
        p = torch.mm(a, w).reshape(2, 4, 10)
        return fc.all_reduce(p, "sum", c.group), p

    return Case(f, [c.randn(8, 12), c.randn(12, 10)], [(AR, None, ("(view) has 2 users",))])


def case_no_shared_sum_with_non_matmul_term(c: Ctx) -> Case:
    # DTensor's backward form (torchtitan without SP): the all-reduced gradient, read by another matmul too, is
    # a matmul's output plus the incoming gradient halved. The term that is not a matmul is the reason.
    def f(a, w, g):
        p = (torch.mm(a, w) + g / 2).reshape(2, 4, 10)
        return fc.all_reduce(p, "sum", c.group), p

    inputs = [c.randn(8, 12), c.randn(12, 10), c.randn(8, 10)]
    return Case(f, inputs, [(AR, None, ("(div) feeds the all_reduce, not a matmul",))])


def case_no_dtype_change_ag(c: Ctx) -> Case:
    def f(x, w):
        return torch.mm(_all_gather(x, 0, c.group).to(torch.bfloat16), w)

    return Case(
        f,
        [c.randn(8, 16, dtype=torch.float32), c.randn(16, 12, dtype=torch.bfloat16)],
        [(AG, None, ("no mm consumes", "dtype change torch.float32 -> torch.bfloat16"))],
    )


def case_no_dtype_change_rs(c: Ctx) -> Case:
    def f(a, w):
        return _reduce_scatter(torch.mm(a, w).float(), "sum", 0, c.group)

    inputs = [c.randn(16, 12, dtype=torch.bfloat16), c.randn(12, 10, dtype=torch.bfloat16)]
    return Case(f, inputs, [(RS, None, ("prims.convert_element_type", "between mm and reduce_scatter"))])


def case_no_ag_chunk_count(c: Ctx) -> Case:
    # The gathered rows are cut into 4 chunks, not one per rank: not an all_gather along dim 1.
    def f(x, w):
        y = c10d.wait_tensor(c10d.all_gather_into_tensor(x, c.ws, c.group_name))
        return torch.mm(torch.cat(torch.split(y, 4), dim=1), w)

    return Case(
        f,
        [c.randn(8, 6), c.randn(24, 12)],
        [(AG, None, ("gathered tensor split into 4 chunks but the group has 2 ranks",))],
    )


def case_no_ag_reorder(c: Ctx) -> Case:
    def f(x, w):
        y = c10d.wait_tensor(c10d.all_gather_into_tensor(x, c.ws, c.group_name))
        chunks = torch.split(y, 4)
        return torch.mm(torch.cat(chunks[::-1], dim=1).reshape(-1, 8), w)

    return Case(f, [c.randn(4, 2, 8), c.randn(8, 12)], [(AG, None, ("cat reorders the gathered chunks",))])


def case_no_rs_reorder(c: Ctx) -> Case:
    def f(a, w):
        chunks = torch.split(torch.mm(a, w).reshape(2, 8, 10), 4, dim=1)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.cat(chunks[::-1]), "sum", c.ws, c.group_name))

    return Case(
        f, [c.randn(16, 12), c.randn(12, 10)], [(RS, None, ("cat reorders the chunks before the reduce_scatter",))]
    )


def case_no_rs_disabled(c: Ctx) -> Case:
    case = case_rs_dim1_nd(c)
    case.entries = [(RS, None, ("matmul_reduce_scatter disabled by config", "FLUXCOMPILE_MATMUL_REDUCE_SCATTER=0"))]
    case.config = {"matmul_reduce_scatter": False}
    return case


def case_no_mlp_ag_disabled(c: Ctx) -> Case:
    case = case_ag_mlp(c)
    case.entries[0] = (AG, None, ("all_gather_matmul disabled by config",))
    case.mm_outputs = ()
    case.config = {"all_gather_matmul": False}
    return case


def case_no_min_k_ag(c: Ctx) -> Case:
    case = case_ag_dim1_nd(c)
    case.entries = [(AG, None, ("K = 16 < min_k = 1024", "FLUXCOMPILE_MIN_K"))]
    case.mm_outputs = ()
    case.config = {"min_k": 1024}
    return case


def case_no_min_k_rs(c: Ctx) -> Case:
    case = case_rs_sum2(c)
    case.entries = [(RS, None, ("K = 12 < min_k = 1024",))]
    case.config = {"min_k": 1024}
    return case


def case_no_gather_last_dim(c: Ctx) -> Case:
    def f(x, w):
        return torch.mm(_all_gather(x, 1, c.group), w)

    return Case(
        f,
        [c.randn(8, 8), c.randn(16, 12)],
        [(AG, None, ("gather dim is the matmul's contraction (last) dim",))],
        traced=("aten.split", "aten.cat"),
    )


def case_no_gather_mm_output_last_dim(c: Ctx) -> Case:
    # Megatron's ColumnParallelLinear(gather_output=True): the output (+ bias) gathered on its features.
    def f(a, w, b):
        return _all_gather(torch.mm(a, w).reshape(2, 4, 12) + b, 2, c.group)

    return Case(
        f,
        [c.randn(8, 16), c.randn(16, 12), c.randn(12)],
        [(AG, None, ("gathers on its last dim a tensor computed by mm: no fused op for matmul -> all_gather",))],
        traced=("aten.split", "aten.cat"),
    )


def case_rs_last_dim(c: Ctx) -> Case:
    # PyTorch's async-TP form: the output split along its features (column tiles to their owners).
    def f(a, w):
        return _reduce_scatter(torch.mm(a, w), "sum", 1, c.group)

    return Case(f, [c.randn(8, 12), c.randn(12, 16)], [(RS, MMRS, ("scatter dim 1", "sum of 1 matmul(s) [mm]"))])


def case_rs_last_dim_avg_nd(c: Ctx) -> Case:
    def f(a, w, b):
        p = torch.addmm(b, a, w.t()).reshape(2, 4, 16)
        return _reduce_scatter(p, "avg", 2, c.group)

    inputs = [c.randn(8, 12), c.randn(16, 12), c.randn(16, shared=True)]
    return Case(f, inputs, [(RS, MMRS, ("scatter dim 2", "[addmm], with bias"))], traced=("aten.split", "aten.cat"))


def case_no_broadcast(c: Ctx) -> Case:
    def f(x, w):
        return torch.mm(fc.broadcast(x, 0, c.group), w)

    return Case(
        f, [c.randn(8, 16), c.randn(16, 12)], [("broadcast", None, ("no fused op for _c10d_functional.broadcast",))]
    )


def case_no_ag_without_mm(c: Ctx) -> Case:
    def f(x):
        return torch.relu(_all_gather(x, 0, c.group))

    return Case(f, [c.randn(8, 16)], [(AG, None, ("no mm consumes the gathered tensor", "aten.relu (relu) uses it"))])


def case_no_ag_right_operand(c: Ctx) -> Case:
    def f(x, a):
        return torch.mm(a, _all_gather(x, 0, c.group))

    return Case(f, [c.randn(8, 12), c.randn(10, 16)], [(AG, None, ("mm takes it as the right operand",))])


def case_no_ag_weight_from_result(c: Ctx) -> Case:
    # mm(y, y.t()): the right operand is computed from the gathered tensor, so no fused op can take it.
    def f(x):
        y = _all_gather(x, 0, c.group)
        return torch.mm(y, y.t())

    return Case(f, [c.randn(8, 16)], [(AG, None, ("right operand or bias is computed from the collective's result",))])


def case_no_rs_after_fused_mm(c: Ctx) -> Case:
    # gather -> mm -> reduce_scatter: the mm goes into the all_gather_matmul, so the reduce_scatter stays.
    def f(x, w):
        return _reduce_scatter(torch.mm(_all_gather(x, 0, c.group), w), "sum", 0, c.group)

    return Case(
        f,
        [c.randn(8, 16), c.randn(16, 12)],
        [(AG, AGMM, ("1 matmul(s)",)), (RS, None, ("already fused into fluxcompile.all_gather_matmul",))],
        mm_outputs=(1,),
    )


def case_no_addmm_alpha(c: Ctx) -> Case:
    def f(x, w, b, a2, w2):
        y = torch.addmm(b, _all_gather(x, 0, c.group), w, alpha=2.0)
        return y, _reduce_scatter(torch.addmm(b, a2, w2, beta=0.5), "sum", 0, c.group)

    inputs = [c.randn(8, 16), c.randn(16, 12), c.randn(12, shared=True), c.randn(16, 6), c.randn(6, 12)]
    return Case(
        f,
        inputs,
        [
            (AG, None, ("addmm with beta/alpha != 1",)),
            (RS, None, ("addmm with beta/alpha != 1 (addmm_1)",)),
        ],
    )


def case_no_broadcast_add_bias(c: Ctx) -> Case:
    def f(a, w, b):
        return fc.all_reduce(torch.mm(a, w) + b, "sum", c.group)

    inputs = [c.randn(8, 12), c.randn(12, 10), c.randn(10, shared=True)]
    return Case(f, inputs, [(AR, None, ("add with broadcasting or a scalar (add) between mm and all_reduce",))])


def case_no_a2a_without_mm(c: Ctx) -> Case:
    def f(x):
        return torch.relu(fc.all_to_all_single(x, None, None, c.group))

    return Case(
        f,
        [c.randn(8, 16)],
        [
            (
                A2A,
                None,
                (
                    "consumer side: no mm consumes the exchanged tensor",
                    "producer side: placeholder (x_1) feeds the all_to_all, not a matmul",
                ),
            )
        ],
    )


# ------------------------------------------------------------------------------------------------
# The rank side: trace, rewrite, check.


def _collectives(gm: torch.fx.GraphModule, waits: bool = False) -> list[str]:
    return [
        n.target.name()
        for n in gm.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "namespace", None) == "_c10d_functional"
        and (waits or n.target is not c10d.wait_tensor.default)
    ]


def _fused_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    targets = {ops.op(name): name for name in ops.FUSED_OPS}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _output_layouts(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    vals = [a.meta["val"] for a in torch.utils._pytree.tree_leaves(out.args)]
    return [(tuple(v.shape), tuple(v.stride()), v.dtype) for v in vals]


def _real(t: Tensor) -> Tensor:
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def run_case(name: str, dtype_name: str, seed: int) -> list[tuple[str, str | None, str]]:
    """Build, trace, rewrite and check one case on this rank; return its report entries."""
    dtype = getattr(torch, dtype_name)
    case: Case = globals()["case_" + name](Ctx(seed, dtype))
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    gm = make_fx(case.f, tracing_mode="fake", decomposition_table=_DECOMPS)(*case.inputs)
    traced = [n.target.name() for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "name")]
    for want in case.traced:
        assert any(want.replace(".", "::") in t for t in traced), f"traced graph has no {want}:\n{gm.graph}"
    before = _collectives(gm)
    assert len(before) == len(case.entries), f"traced graph has collectives {before}:\n{gm.graph}"
    layouts = _output_layouts(gm)

    with config.patch(**case.config):
        report = rewrite_graph(gm.graph)
    gm.graph.lint()
    gm.recompile()
    graph = f"\n{report.format()}\n{gm.graph}"

    # The report: one entry per collective, in graph order.
    got = [(e.collective, e.fused_op) for e in report.entries]
    assert got == [(col, op) for col, op, _ in case.entries], f"report {got}{graph}"
    for e, (_, _, subs) in zip(report.entries, case.entries):
        for s in subs:
            assert s in e.detail, f"{s!r} not in the report's detail {e.detail!r}{graph}"
        assert e.group_name == dist.group.WORLD.group_name, e
    # The graph: the fused ops, and only the collectives that were not fused.
    fused = _fused_nodes(gm)
    counts = {name: sum(n.target is ops.op(name) for n in fused) for name in ops.FUSED_OPS}
    assert {k: v for k, v in counts.items() if v} == case.fused, f"fused ops {counts}{graph}"
    left = _collectives(gm, waits=not case.kept)
    assert len(left) == case.kept, f"collectives left: {left}{graph}"
    outs = [len(n.meta["val"][1]) for n in fused if n.target in (ops.op(AGMM), ops.op(A2AMM))]
    assert tuple(outs) == case.mm_outputs, f"matmul outputs per consumer-side fused op: {outs}{graph}"
    # all_gather_matmul returns the gathered tensor (return_A, default True) exactly where something besides its
    # matmuls reads it, which the report says ("also kept for N other user(s)"); its first result is read only then.
    kept = [any("also kept for" in s for s in subs) for _, op, subs in case.entries if op == AGMM]
    gathers = [n for n in fused if n.target is ops.op(AGMM)]
    flags = [n.kwargs.get("return_A", True) for n in gathers]
    assert flags == kept, f"return_A {flags}, expected {kept}{graph}"
    reads = [any(u.args[1] == 0 for u in n.users) for n in gathers]
    assert reads == kept, f"result 0 read {reads}, expected {kept}{graph}"
    assert all(n.meta["val"][0] is None for n in gathers if not n.kwargs.get("return_A", True)), graph
    assert _output_layouts(gm) == layouts, f"output layouts {_output_layouts(gm)} != {layouts}{graph}"

    # Real values, shapes and strides against f run eagerly.
    got_t = torch.utils._pytree.tree_leaves(gm(*case.inputs))
    ref_t = [_real(t) for t in torch.utils._pytree.tree_leaves(case.f(*case.inputs))]
    assert len(got_t) == len(ref_t)
    for i, (a, b) in enumerate(zip(got_t, ref_t)):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), (
            f"output {i}: {(a.shape, a.stride(), a.dtype)} vs eager {(b.shape, b.stride(), b.dtype)}{graph}"
        )
        assert (tuple(a.shape), tuple(a.stride()), a.dtype) == layouts[i]
        assert_close(a, b, tol, f"{name} ({dtype_name}) output {i}")
    if dtype != torch.float32:  # and near the exact result, not only near eager's rounding
        exact = torch.utils._pytree.tree_leaves(case.f(*[t.double() for t in case.inputs]))
        for i, (a, b) in enumerate(zip(got_t, exact)):
            assert_close(a, _real(b), tol, f"{name} ({dtype_name}) output {i} vs float64")
    return [(e.collective, e.fused_op, e.detail) for e in report.entries]


# ------------------------------------------------------------------------------------------------
# The test side.

CASES = [name.removeprefix("case_") for name in list(globals()) if name.startswith("case_")]
BF16 = [
    "ar_rmsnorm_matmul",
    "ar_rmsnorm_bare_nd",
    "ag_dim0",
    "ag_dim1_nd",
    "ag_qkv",
    "rs_dim0",
    "rs_dim1_nd",
    "rs_permuted_dim1",
    "rs_sum2",
    "ar_bias",
    "a2a_mm_uneven",
    "mm_a2a_uneven",
]
PARAMS = [pytest.param(n, "float32", id=n) for n in CASES] + [pytest.param(n, "bfloat16", id=n + "-bf16") for n in BF16]


def _seed() -> int:
    return int(os.environ.get("FLUXCOMPILE_TEST_SEED") or random.SystemRandom().randrange(2**31))


@pytest.mark.parametrize(("name", "dtype_name"), PARAMS)
def test_pattern(ranks, name, dtype_name):
    seed = _seed()
    try:
        entries = ranks(2).run(run_case, name, dtype_name, seed)
    except AssertionError as e:
        raise AssertionError(f"[FLUXCOMPILE_TEST_SEED={seed}] {e}") from None
    assert entries[0] == entries[1], f"ranks rewrote differently: {entries}"
