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


class Attention(nn.Module):
    def __init__(self, a: BlockArgs) -> None:
        super().__init__()
        self.n_heads = a.n_heads  # divided by the TP degree when parallelized
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=a.bias)
        self.wk = nn.Linear(a.dim, a.dim, bias=a.bias)
        self.wv = nn.Linear(a.dim, a.dim, bias=a.bias)
        self.wo = nn.Linear(a.dim, a.dim, bias=a.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
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


def tp_plan(sequence_parallel: bool) -> dict[str, object]:
    """torchtitan's plan for one block: column-parallel q,k,v,w1,w3; row-parallel wo,w2; SP norms."""
    if not sequence_parallel:
        return {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
    gather_input = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attention_norm": SequenceParallel(),
        "attention": gather_input,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize_block(block: Block, mesh: DeviceMesh, sequence_parallel: bool = True) -> Block:
    """Shard ``block`` over the 1-D ``mesh`` in place. With SP, the block takes and returns tensors
    sharded on the sequence dim (dim 1); without, replicated ones."""
    tp = mesh.size()
    if block.attention.n_heads % tp:
        raise ValueError(f"{block.attention.n_heads} heads do not divide over {tp} ranks")
    block.attention.n_heads //= tp
    return parallelize_module(block, mesh, tp_plan(sequence_parallel))
