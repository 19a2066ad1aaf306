"""matmul_reduce_scatter, ``cublas_pipelined:stages<g>``: the peers' row blocks computed in ``g`` groups, one
GEMM per group, each group's blocks pushed by the copy engine beside the next group's GEMM; our own block
last, then the owner's sum (rs_cublas_pipelined.py's protocol and flags).

The per-peer split of ``cublas_pipelined:push`` runs ``world`` GEMMs of m/world rows (eight at TP=8, each
losing up to a wave); ``:unsplit``/``:tail`` run one or two but push only after them. The groups are
ag_stages.stage_plan's (consecutive peers in ring order, as even as possible, the larger ones last).
Experimental until its GPU tests have run: it declines unless ``FLUXCOMPILE_EXPERIMENTAL_RS_STAGES=1``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from ..symm_mem import side_stream
from . import rs_cublas_pipelined as pipelined
from .ag_stages import stage_plan
from .sequencer import graph_limit, sequencer

ENABLED = os.environ.get("FLUXCOMPILE_EXPERIMENTAL_RS_STAGES", "0") == "1"
GROUPS = (2, 3)


def supports(groups: int):
    """``supports`` of ``:stages<groups>``."""

    def supports_stages(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> str | None:
        if not ENABLED:
            return "experimental: FLUXCOMPILE_EXPERIMENTAL_RS_STAGES=1 enables it"
        return pipelined.supports(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name)

    return supports_stages


def matmul_reduce_scatter(
    As: Sequence[Tensor],
    Bs: Sequence[Tensor],
    bias: Tensor | None,
    out_shape: Sequence[int],
    scatter_dim: int,
    reduce_op: str,
    group_size: int,
    group_name: str,
    groups: int = 2,
) -> Tensor:
    plan = pipelined._plan(out_shape, scatter_dim, group_size, group_name, As[0].dtype, False, True)
    js, ranges, flat = stage_plan(plan.rank, plan.world, plan.rows, groups)
    seq = sequencer()
    if seq is not None:
        out = seq.rs_stages(
            list(As), list(Bs), bias, plan.stage_all, plan.peer_slots, plan.own_slot, plan.own_slots,
            *plan.hs.lists, plan.shape, plan.rank, plan.rows, js, flat, side_stream().cuda_stream, graph_limit(),
        )  # fmt: skip
    else:
        out = _python_stages(As, Bs, bias, plan, js, ranges)
    plan.hs.note()
    return out


def _python_stages(As, Bs, bias, plan, js, ranges) -> Tensor:
    """The same stream operations as csrc/pipelined.cpp's rs_stages, from Python (its fallback)."""
    rows, rank, main, side = plan.rows, plan.rank, torch.cuda.current_stream(), side_stream()
    P = plan.stage_all
    for group, group_ranges in zip(js, ranges):
        for lo, hi in group_ranges:
            pipelined._matmul_rows(As, Bs, bias, lo, hi - lo, P[lo:hi])
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for j in group:
                p = plan.hs.order[j]
                plan.hs.send(side, j, plan.peer_slots[j], P[p * rows : (p + 1) * rows])
    mine = P[rank * rows : (rank + 1) * rows] if plan.world == 2 else plan.own_slot
    pipelined._matmul_rows(As, Bs, bias, rank * rows, rows, mine)
    return pipelined._reduce_and_release(plan, mine, As[0], side if plan.hs.order else None)  # see _python_sequence
