"""Choices for fluxcompile.all_gather_matmul, and its CUDA implementation: the rank-synchronized
autotuner picks one choice per call signature (identically on every rank) and runs it.

Choices: ``cublas_pipelined`` (ag_cublas_pipelined.py; ``:concurrent``, ``:unsplit`` and ``:lead<d>`` variants;
``:stages<g>``, ag_stages.py, experimental: one GEMM per group of peers), ``torch_symm_mem`` (PyTorch's own
``symm_mem.fused_all_gather_matmul``), ``async_input_mm`` (PyTorch's CUTLASS GEMM that waits on per-chunk
signals, fed by copy-engine pulls: ag_async_input_mm.py) and ``reference`` (NCCL + cuBLAS, registered by
choices.py).
``triton:<tiles>-c<chunks>`` (ag_triton.py, the persistent kernel of kernels/ag_gemm.py) is registered
but declines until it is validated on a GPU (FLUXCOMPILE_EXPERIMENTAL_TRITON_AG=1 enables it).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from . import ag_async_input_mm, ag_cublas_pipelined, ag_stages, ag_triton
from .autotune import pick
from .choices import Choice, register_choice, register_variants
from .direct_calls import cuda_impl

OP = "all_gather_matmul"


def _torch_symm_mem_supports(A, Bs, biases, gather_dim, group_size, group_name) -> str | None:
    if not A.is_cuda:
        return "needs CUDA tensors"
    if any(b is not None for b in biases):
        return "PyTorch's fused_all_gather_matmul takes no bias"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        return "torch.ops.symm_mem.fused_all_gather_matmul is not available"
    return None


def _torch_symm_mem(A, Bs, biases, gather_dim, group_size, group_name) -> tuple[Tensor, list[Tensor]]:
    from torch.distributed import _symmetric_memory as symm

    if not symm.is_symm_mem_enabled_for_group(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm.enable_symm_mem_for_group(group_name)
    A_gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(A, list(Bs), gather_dim, group_name)
    return A_gathered, [o.reshape(-1, o.shape[-1]) for o in outs]


register_choice(
    OP, Choice(ag_cublas_pipelined.NAME, ag_cublas_pipelined.all_gather_matmul, ag_cublas_pipelined.supports)
)
register_choice(
    OP,
    Choice(
        f"{ag_cublas_pipelined.NAME}:concurrent",
        functools.partial(ag_cublas_pipelined.all_gather_matmul, concurrent=True),
        ag_cublas_pipelined.supports,
    ),
)
register_choice(
    OP,
    Choice(
        f"{ag_cublas_pipelined.NAME}:unsplit",
        functools.partial(ag_cublas_pipelined.all_gather_matmul, unsplit=True),
        ag_cublas_pipelined.supports,
    ),
)
_PIPELINED = ag_cublas_pipelined.NAME
register_variants(
    OP, f"{_PIPELINED}:lead", ag_cublas_pipelined.all_gather_matmul, "lead", ag_cublas_pipelined.LEADS,
    ag_cublas_pipelined.lead_supports,
)  # fmt: skip
# experimental: they decline every call unless enabled
register_variants(
    OP, f"{_PIPELINED}:stages", ag_stages.all_gather_matmul, "groups", ag_stages.GROUPS, ag_stages.supports
)
register_choice(OP, Choice("torch_symm_mem", _torch_symm_mem, _torch_symm_mem_supports))
register_choice(OP, Choice(ag_async_input_mm.NAME, ag_async_input_mm.all_gather_matmul, ag_async_input_mm.supports))
for _variant in ag_triton.VARIANTS:  # experimental: they decline every call unless enabled
    register_choice(OP, Choice(f"triton:{_variant}", *ag_triton.make(_variant)))


@cuda_impl(OP, probe=lambda args: args[0])
def _cuda_all_gather_matmul(
    A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], gather_dim: int, group_size: int, group_name: str
) -> tuple[Tensor, list[Tensor]]:
    args = (A, list(Bs), list(biases), gather_dim, group_size, group_name)
    return pick(OP, args, group_name).fn(*args)
