"""A Llama-style transformer block, tensor-parallelized as torchtitan does with PyTorch's TP API."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


@dataclasses.dataclass
class BlockArgs:
    dim: int = 256
    n_heads: int = 8
    ffn_dim: int = 688
    bias: bool = False
    norm_eps: float = 1e-5
    n_kv_heads: int | None = None  # grouped-query attention (Llama 3: 8); None: as many as the query heads


class Attention(nn.Module):
    def __init__(self, a: BlockArgs) -> None:
        super().__init__()
        self.n_heads = a.n_heads  # divided by the TP degree when parallelized, as n_kv_heads
        self.n_kv_heads = a.n_kv_heads or a.n_heads
        if a.n_heads % self.n_kv_heads:
            raise ValueError(f"{a.n_heads} query heads do not group over {self.n_kv_heads} key/value heads")
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=a.bias)
        self.wk = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=a.bias)
        self.wv = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=a.bias)
        self.wo = nn.Linear(a.dim, a.dim, bias=a.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.n_kv_heads != self.n_heads:  # each key/value head serves n_heads / n_kv_heads query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, a: BlockArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=a.bias)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=a.bias)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=a.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: BlockArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def tp_plan(sequence_parallel: bool, float8: bool = False) -> dict[str, object]:
    """torchtitan's plan for one block: column-parallel q,k,v,w1,w3; row-parallel wo,w2; SP norms. ``float8``:
    torchao's float8 TP styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``:
    the gathers move fp8 bytes), as torchtitan uses them for the tensor-wise float8 recipe; the block's linears
    must be torchao's ``Float8Linear`` (``convert_to_float8_training``)."""
    col, row, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8 import float8_tensor_parallel as f8tp

        col, row, prepare = f8tp.Float8ColwiseParallel, f8tp.Float8RowwiseParallel, f8tp.PrepareFloat8ModuleInput
    if not sequence_parallel:
        return {
            "attention.wq": col(),
            "attention.wk": col(),
            "attention.wv": col(),
            "attention.wo": row(),
            "feed_forward.w1": col(),
            "feed_forward.w3": col(),
            "feed_forward.w2": row(),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": col(),
        "attention.wk": col(),
        "attention.wv": col(),
        "attention.wo": row(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": col(),
        "feed_forward.w3": col(),
        "feed_forward.w2": row(output_layouts=Shard(1)),
    }


def parallelize_block(block: Block, mesh: DeviceMesh, sequence_parallel: bool = True, float8: bool = False) -> Block:
    """Shard ``block`` over the 1-D ``mesh`` in place. With SP, the block takes and returns tensors
    sharded on the sequence dim (dim 1); without, replicated ones. ``float8``: torchao's float8 TP styles
    (``tp_plan``)."""
    tp = mesh.size()
    attention = block.attention
    if attention.n_heads % tp or attention.n_kv_heads % tp:
        raise ValueError(
            f"{attention.n_heads} query and {attention.n_kv_heads} key/value heads do not divide over {tp} ranks"
        )
    attention.n_heads //= tp
    attention.n_kv_heads //= tp
    return parallelize_module(block, mesh, tp_plan(sequence_parallel, float8))
