"""An expert-parallel MoE layer written the way users write it (torchtitan's dropless form, GShard's capacity form).

Experts are sharded over the ranks of ``group`` (the EP group): rank r holds experts
``[r * E_local, (r + 1) * E_local)`` with their SwiGLU weights stacked, ``w1``/``w3`` ``[E_local, dim, ffn]`` and
``w2`` ``[E_local, ffn, dim]``; the router is replicated. Tokens go to their experts' ranks with
``all_to_all_single_autograd`` and come back the same way, so AOTAutograd's post-grad graphs hold
``_c10d_functional.all_to_all_single`` + ``wait_tensor`` next to the experts' matmuls (forward: dispatch, experts,
combine; backward: the mirror image).

Dropless (``capacity_factor=None``, torchtitan): token copies sorted by expert, counts exchanged with a first
all-to-all, the split sizes read on the host (``.tolist()``: compile with
``torch._dynamo.config.capture_scalar_outputs = True``), rows permuted from [source rank][local expert] to
[local expert][source rank], experts as ``torch._grouped_mm`` (``expert_form="grouped"``) or one ``mm`` per
expert (``"loop"``).

Capacity (``capacity_factor`` set, GShard): each expert takes at most ``C = ceil(cf * tokens * top_k / E)`` copies
of this rank's tokens (the first ones in token order; the others are dropped: they contribute exactly zero),
a dispatch tensor ``[E, C, dim]`` exchanged with equal splits, experts as ``torch.bmm`` (``"bmm"``),
``torch._grouped_mm`` with equal groups (``"grouped"``) or one ``mm`` per expert (``"loop"``).

:func:`moe_reference` computes the same layer in one process without any collective (every expert local), for
checking the expert-parallel layer against.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

EXPERT_FORMS = ("grouped", "bmm", "loop")


@dataclasses.dataclass
class MoEArgs:
    dim: int = 64
    ffn_dim: int = 96
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    expert_form: str = "grouped"  # "grouped" | "bmm" (capacity only) | "loop"
    pad_row: bool = False  # dropless: torchtitan's zero row appended before the permutation

    def __post_init__(self) -> None:
        if self.expert_form not in EXPERT_FORMS:
            raise ValueError(f"expert_form must be one of {EXPERT_FORMS}, not {self.expert_form!r}")
        if self.expert_form == "bmm" and self.capacity_factor is None:
            raise ValueError("expert_form='bmm' needs a capacity_factor (dropless groups are uneven)")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, {self.num_experts}]")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, not {self.capacity_factor}")


def capacity(a: MoEArgs, tokens: int) -> int:
    """Slots per expert for ``tokens`` tokens of one rank (capacity form)."""
    return max(1, math.ceil(a.capacity_factor * tokens * a.top_k / a.num_experts))


def full_params(a: MoEArgs, seed: int, dtype: torch.dtype = torch.float32, device=None) -> dict[str, torch.Tensor]:
    """The whole layer's weights, the same for a seed on every rank: ``router [dim, E]``, ``w1``/``w3``
    ``[E, dim, ffn]``, ``w2 [E, ffn, dim]``."""
    g = torch.Generator().manual_seed(seed)
    E, D, H = a.num_experts, a.dim, a.ffn_dim

    def init(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * fan_in**-0.5).to(device=device, dtype=dtype)

    return {
        "router": init(D, E, fan_in=D),
        "w1": init(E, D, H, fan_in=D),
        "w3": init(E, D, H, fan_in=D),
        "w2": init(E, H, D, fan_in=H),
    }


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in fp32, expert ids [T, k])``: the top-k of the softmax of the router's scores in fp32."""
    scores = torch.softmax(x.float() @ router.float(), dim=-1)
    return scores.topk(top_k, dim=-1)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1) * (x @ w3)) @ w2


class ExpertParallelMoE(nn.Module):
    """The MoE layer on one rank of ``group``: ``forward(x [tokens, dim]) -> [tokens, dim]`` for this rank's tokens."""

    def __init__(self, a: MoEArgs, group: dist.ProcessGroup | None = None, params: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.a = a
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if a.num_experts % self.world:
            raise ValueError(f"{a.num_experts} experts do not divide over {self.world} ranks")
        self.local_experts = a.num_experts // self.world
        params = params if params is not None else full_params(a, 0)
        mine = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        self.router = nn.Parameter(params["router"].detach().clone())
        self.w1 = nn.Parameter(params["w1"][mine].detach().clone())
        self.w3 = nn.Parameter(params["w3"][mine].detach().clone())
        self.w2 = nn.Parameter(params["w2"][mine].detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.a.top_k)
        if self.a.capacity_factor is None:
            out = self._dropless(x, ids)
        else:
            out = self._with_capacity(x, ids)
        # out: [T, k, dim], the experts' outputs of every token copy (zero where dropped)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    # -- experts on rows grouped by local expert

    def _experts(self, x: torch.Tensor, offs: torch.Tensor | None, sizes: list[int] | None) -> torch.Tensor:
        """SwiGLU of the rows of ``x`` ([N, dim], grouped by local expert: ends ``offs``, sizes ``sizes``)."""
        if self.a.expert_form == "grouped":
            h = F.silu(torch._grouped_mm(x, self.w1, offs=offs)) * torch._grouped_mm(x, self.w3, offs=offs)
            return torch._grouped_mm(h, self.w2, offs=offs)
        outs = [swiglu(xe, self.w1[e], self.w3[e], self.w2[e]) for e, xe in enumerate(torch.split(x, sizes))]
        return torch.cat(outs)

    # -- dropless (torchtitan)

    def _dropless(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, D = x.shape
        k, E, W, EL = self.a.top_k, self.a.num_experts, self.world, self.local_experts
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # copies by expert: [destination rank][its local expert]
        sorted_x = x[order // k]
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        # What each source rank sends to each of my experts: [source rank][local expert].
        recv_counts = all_to_all_single(counts, None, None, self.group).view(W, EL)
        input_splits = counts.view(W, EL).sum(dim=1).tolist()
        output_splits = recv_counts.sum(dim=1).tolist()
        for s in (*input_splits, *output_splits):
            torch._check(s >= 0)
        torch._check(sum(input_splits) == T * k)
        received = sum(output_splits)
        routed = all_to_all_single_autograd(sorted_x, output_splits, input_splits, self.group)  # [received, D]

        # Rows arrive as [source rank][local expert]; the experts want [local expert][source rank].
        per_expert = recv_counts.sum(dim=0)  # [EL]
        perm = permute_indices(recv_counts, received)
        if self.a.pad_row:  # torchtitan appends a zero row, which padding indices would point at
            routed = torch.vstack((routed, routed.new_zeros(routed.shape[-1])))
        x_perm = routed[perm]
        offs = sizes = None
        if self.a.expert_form == "grouped":
            offs = torch.cumsum(per_expert, dim=0).to(torch.int32)
        else:
            sizes = per_expert.tolist()
            for s in sizes:
                torch._check(s >= 0)
            torch._check(sum(sizes) == received)
        y = self._experts(x_perm, offs, sizes)
        back = y.new_empty((received + (1 if self.a.pad_row else 0), D))
        back[perm] = y  # un-permute (torchtitan's _unpermute)
        if self.a.pad_row:
            back = back[:-1]
        combined = all_to_all_single_autograd(back, input_splits, output_splits, self.group)  # [T * k, D] sorted
        out = combined.new_empty(combined.shape)
        out[order] = combined  # un-sort
        return out.view(T, k, D)

    # -- capacity (GShard)

    def _with_capacity(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, D = x.shape
        k, E, W, EL = self.a.top_k, self.a.num_experts, self.world, self.local_experts
        C = capacity(self.a, T)
        slot = capacity_slots(ids, E, C)  # [T * k], E * C where dropped
        copies = x.repeat_interleave(k, dim=0)  # [T * k, D], row t * k + j is token t
        dispatch = x.new_zeros(E * C + 1, D).index_add(0, slot, copies)[: E * C]  # [E * C, D] = [W][EL][C]
        received = all_to_all_single_autograd(dispatch, None, None, self.group)  # [W * EL * C, D]: [source][EL][C]
        xe = received.view(W, EL, C, D).transpose(0, 1).reshape(EL, W * C, D)
        if self.a.expert_form == "bmm":
            y = torch.bmm(F.silu(torch.bmm(xe, self.w1)) * torch.bmm(xe, self.w3), self.w2)
        else:
            flat = xe.reshape(EL * W * C, D)
            offs = torch.arange(1, EL + 1, device=x.device, dtype=torch.int32) * (W * C)
            y = self._experts(flat, offs, [W * C] * EL)
        back = y.view(EL, W, C, D).transpose(0, 1).reshape(W * EL * C, D)
        combined = all_to_all_single_autograd(back, None, None, self.group)  # [E * C, D]: my copies' outputs
        combined = torch.cat((combined, combined.new_zeros(1, D)))  # the dropped copies read the zero row
        return combined[slot].view(T, k, D)


def permute_indices(counts: torch.Tensor, total) -> torch.Tensor:
    """Index of each row in [local expert][source rank] order within rows received in [source rank][local expert]
    order, ``counts [W, EL]`` rows from each source for each local expert (torchtitan's
    ``generate_permute_indices`` without alignment padding, in plain torch ops)."""
    W, EL = counts.shape
    src_start = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)  # start of (s, e) in received order
    by_expert = counts.t().reshape(-1)  # (e, s) in destination order
    dst_start = torch.cumsum(by_expert, 0) - by_expert
    group = torch.repeat_interleave(torch.arange(W * EL, device=counts.device), by_expert, output_size=total)
    src_start_by_expert = src_start.view(W, EL).t().reshape(-1)
    pos = torch.arange(total, device=counts.device)
    return pos - dst_start[group] + src_start_by_expert[group]


def capacity_slots(ids: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Slot ``expert * cap + position`` of each token copy (``ids [T, k]`` flattened), ``num_experts * cap`` for
    a copy beyond its expert's capacity. Positions follow token order, then k."""
    flat = ids.reshape(-1)
    one_hot = F.one_hot(flat, num_experts)  # [T * k, E]
    position = ((torch.cumsum(one_hot, dim=0) - 1) * one_hot).sum(dim=1)
    return torch.where(position < cap, flat * cap + position, num_experts * cap)


def moe_reference(params: dict[str, torch.Tensor], xs: torch.Tensor, a: MoEArgs) -> torch.Tensor:
    """The layer of every rank in one process: ``xs [world, T, dim]`` (rank r's tokens ``xs[r]``) ->
    ``[world, T, dim]``, every expert local, no collective. Drops (capacity form) are per source rank, as in
    the expert-parallel layer."""
    outs = []
    for x in xs.unbind(0):
        T = x.shape[0]
        weights, ids = route(x, params["router"], a.top_k)
        keep = torch.ones(T * a.top_k, dtype=torch.bool, device=x.device)
        if a.capacity_factor is not None:
            keep = capacity_slots(ids, a.num_experts, capacity(a, T)) < a.num_experts * capacity(a, T)
        keep = keep.view(T, a.top_k)
        out = torch.zeros_like(x)
        for e in range(a.num_experts):
            y = swiglu(x, params["w1"][e], params["w3"][e], params["w2"][e])  # every token, then masked
            w = (weights * ((ids == e) & keep)).sum(dim=1)  # [T]
            out = out + y * w.unsqueeze(-1).to(y.dtype)
        outs.append(out)
    return torch.stack(outs)


def dropped_copies(ids: torch.Tensor, a: MoEArgs) -> int:
    """Token copies (of ``ids [T, k]``) beyond their expert's capacity; 0 for the dropless form."""
    if a.capacity_factor is None:
        return 0
    C = capacity(a, ids.shape[0])
    return int((capacity_slots(ids, a.num_experts, C) == a.num_experts * C).sum())
