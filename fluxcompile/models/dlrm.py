"""A small DLRM: model-parallel embedding tables, data-parallel dense part, the way TorchRec shards it table-wise.

Tables are split over the ranks of ``group``: rank r holds tables ``[r * T_local, (r + 1) * T_local)``. Each rank
gets the sparse features of the GLOBAL batch for its own tables, pools them (``embedding_bag``, sum or mean) to
``[B_global, T_local * dim]``, and ``all_to_all_single_autograd`` with equal splits sends batch chunk r (rows
``r * B_local:(r + 1) * B_local``) to rank r. The receiver rearranges ``[world, B_local, T_local, dim]`` to
``[B_local, num_tables, dim]`` and runs the replicated dense part (bottom MLP on the dense features, dot or
concat interaction, top MLP) on its local batch: logits ``[B_local, 1]``. In the backward the embedding
gradients come back with the mirror all-to-all; the tables get dense gradients (``sparse=False``).

:func:`dlrm_reference` computes the same model over every table and the whole batch in one process.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclasses.dataclass
class DLRMArgs:
    num_tables: int = 8
    rows_per_table: int = 100
    dim: int = 16  # embedding dim, also the bottom MLP's output
    bag_size: int = 4  # indices pooled per sample and table
    dense_in: int = 13
    bottom_mlp: tuple[int, ...] = (64,)  # hidden widths; the last layer outputs ``dim``
    top_mlp: tuple[int, ...] = (64, 32)  # hidden widths; the last layer outputs 1 logit
    mode: str = "sum"  # pooling: "sum" | "mean"
    interaction: str = "dot"  # "dot" (pairwise dot products, DLRM) | "cat" (concatenation)
    padding_idx: int | None = None  # nn.EmbeddingBag's: that row pools nothing and gets no gradient

    def __post_init__(self) -> None:
        if self.mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', not {self.mode!r}")
        if self.interaction not in ("dot", "cat"):
            raise ValueError(f"interaction must be 'dot' or 'cat', not {self.interaction!r}")


def mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    """The data-parallel part: ``forward(dense [B, dense_in], pooled [B, num_tables, dim]) -> logits [B, 1]``."""

    def __init__(self, a: DLRMArgs) -> None:
        super().__init__()
        self.a = a
        self.bottom = mlp([a.dense_in, *a.bottom_mlp, a.dim], last_relu=True)
        n = a.num_tables + 1
        top_in = a.dim + n * (n - 1) // 2 if a.interaction == "dot" else a.dim * n
        self.top = mlp([top_in, *a.top_mlp, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        b = self.bottom(dense)  # [B, dim]
        feats = torch.cat((b.unsqueeze(1), pooled), dim=1)  # [B, T + 1, dim]
        if self.a.interaction == "dot":
            z = torch.bmm(feats, feats.transpose(1, 2))  # [B, T + 1, T + 1]
            i, j = torch.tril_indices(feats.shape[1], feats.shape[1], offset=-1, device=z.device)
            top_in = torch.cat((b, z[:, i, j]), dim=1)
        else:
            top_in = feats.flatten(1)
        return self.top(top_in)


def full_params(a: DLRMArgs, seed: int, dtype: torch.dtype = torch.float32, device=None) -> dict[str, torch.Tensor]:
    """The whole model's weights, the same for a seed on every rank: ``tables [num_tables, rows, dim]`` and the
    dense part's state dict under ``dense.``."""
    g = torch.Generator().manual_seed(seed)
    params = {"tables": torch.randn(a.num_tables, a.rows_per_table, a.dim, generator=g) * a.dim**-0.5}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DenseArch(a).state_dict().items()}
    for name, shape in shapes.items():
        fan_in = shape[-1] if len(shape) > 1 else 1
        scale = fan_in**-0.5 if len(shape) > 1 else 0.1
        params[f"dense.{name}"] = torch.randn(*shape, generator=g) * scale
    return {k: v.to(device=device, dtype=dtype) for k, v in params.items()}


def offsets_of(batch: int, bag_size: int, device) -> torch.Tensor:
    return torch.arange(0, batch * bag_size, bag_size, device=device)


def make_inputs(a: DLRMArgs, batch: int, seed: int, dtype: torch.dtype = torch.float32, device=None):
    """``(dense [batch, dense_in], sparse [num_tables, batch, bag_size] int64)`` of a global batch."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, a.dense_in, generator=g).to(device=device, dtype=dtype)
    sparse = torch.randint(0, a.rows_per_table, (a.num_tables, batch, a.bag_size), generator=g).to(device)
    return dense, sparse


class ModelParallelDLRM(nn.Module):
    """The DLRM on one rank of ``group``: ``forward(dense [B_local, dense_in], sparse [T_local, B_global, bag])``
    -> logits ``[B_local, 1]``, where ``sparse`` holds the global batch's indices of this rank's tables."""

    def __init__(self, a: DLRMArgs, group: dist.ProcessGroup | None = None, params: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.a = a
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if a.num_tables % self.world:
            raise ValueError(f"{a.num_tables} tables do not divide over {self.world} ranks")
        self.local_tables = a.num_tables // self.world
        params = params if params is not None else full_params(a, 0)
        first = self.rank * self.local_tables
        self.tables = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(
                params["tables"][first + t].detach().clone(), freeze=False, mode=a.mode, padding_idx=a.padding_idx
            )
            for t in range(self.local_tables)
        )
        self.dense = DenseArch(a).to(device=params["tables"].device, dtype=params["tables"].dtype)
        self.dense.load_state_dict({k.removeprefix("dense."): v for k, v in params.items() if k.startswith("dense.")})

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        B, W, TL, D = sparse.shape[1], self.world, self.local_tables, self.a.dim
        offsets = offsets_of(B, self.a.bag_size, sparse.device)
        pooled = torch.stack([table(sparse[t].reshape(-1), offsets) for t, table in enumerate(self.tables)], dim=1)
        # Batch chunk r of my tables' pooled features to rank r; from rank s, its tables for my batch chunk.
        received = all_to_all_single_autograd(pooled.reshape(B, TL * D), None, None, self.group)  # [W * B_local, TL * D]
        b_local = B // W
        emb = received.view(W, b_local, TL, D).permute(1, 0, 2, 3).reshape(b_local, W * TL, D)
        return self.dense(dense, emb)


def dlrm_reference(params: dict[str, torch.Tensor], dense: torch.Tensor, sparse: torch.Tensor, a: DLRMArgs) -> torch.Tensor:
    """Every table in one process, no collective: ``dense [B, dense_in]``, ``sparse [num_tables, B, bag]`` ->
    logits ``[B, 1]``."""
    B = sparse.shape[1]
    offsets = offsets_of(B, a.bag_size, sparse.device)
    pooled = torch.stack(
        [
            F.embedding_bag(sparse[t].reshape(-1), params["tables"][t], offsets, mode=a.mode, padding_idx=a.padding_idx)
            for t in range(a.num_tables)
        ],
        dim=1,
    )
    with torch.device("meta"):
        arch = DenseArch(a)
    dense_params = {k.removeprefix("dense."): v for k, v in params.items() if k.startswith("dense.")}
    return torch.func.functional_call(arch, dense_params, (dense, pooled))
