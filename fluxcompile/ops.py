"""The fused ops: the contract between the rewrite passes, the lowerings and the kernels.

Each op is defined in the ``fluxcompile`` namespace with ``torch.library``: a schema, a fake (meta)
implementation that gives exactly the shapes and strides the original subgraph produced, and a
reference implementation made of c10d functional collectives and ``aten.mm``/``aten.addmm``. The
reference runs anywhere a process group does (gloo on CPU included), so every rewrite is testable
without a GPU; it also is the decomposed NCCL+cuBLAS choice of the GPU autotuner.

The ops appear only in post-grad graphs, so they carry no autograd formula.

Conventions shared by all ops
-----------------------------
* ``group_name`` is a c10d group name (``ProcessGroup.group_name``), as in ``_c10d_functional``.
* A *matmul* is ``aten.mm(a, b)``, or ``aten.addmm(bias, a, b)`` when a bias is given: ``a`` is 2-D
  ``[M, K]``, ``b`` is 2-D ``[K, N]`` with any strides, ``bias`` broadcasts to ``[M, N]`` (usually
  ``[N]``). Using addmm keeps the numerics of the graph that was rewritten.
* *Sum of matmuls* (producer side): ``P = addmm(bias, a_0, b_0) + a_1 @ b_1 + ...`` added left to right;
  the pass puts the term with the bias first (the graph's own add order may differ: same sum up to rounding). That is the backward's ``add(mm, mm)`` form. Note that
  the bias is part of every rank's partial, so a reduction adds it ``world_size`` times — exactly as
  the rewritten graph did (DTensor pre-divides a row-parallel bias by the world size).
* ``out_shape`` is the N-D view of ``P`` (``[M, N]`` → ``out_shape``, last dim ``N``) that the
  collective consumed in the original graph.
* Outputs are new contiguous tensors.

The ops
-------
``all_gather_matmul(A, Bs, biases, gather_dim, group_size, group_name) -> (A_gathered, outs)``
    ``A_gathered = all_gather(A, dim=gather_dim)`` (N-D, contiguous);
    ``outs[i] = addmm(biases[i], A_gathered.reshape(-1, K), Bs[i])`` — several weights share one gather.
``matmul_reduce_scatter(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> out``
    ``out = reduce_scatter(P.reshape(out_shape), dim=scatter_dim)``.
``matmul_all_reduce(As, Bs, bias, out_shape, reduce_op, group_name) -> out``
    ``out = all_reduce(P.reshape(out_shape))``.
``all_to_all_matmul(A, Bs, biases, output_split_sizes, input_split_sizes, group_name) -> (A_exchanged, outs)``
    ``A_exchanged = all_to_all_single(A)`` along dim 0; ``outs[i]`` as for all_gather_matmul.
``matmul_all_to_all(As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name) -> out``
    ``out = all_to_all_single(P.reshape(out_shape))`` along dim 0.
``all_reduce_rmsnorm(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op,
group_name) -> (h, normed)``
    The decoder layer's tail after a row-parallel projection: ``r = all_reduce(x if x is given else
    P.reshape(out_shape))``; ``h = residual + r`` (the new residual stream); ``normed = RMSNorm(h)``, in
    float32 when ``upcast``, with ``weight`` multiplied before the cast back to ``h.dtype``
    (``nn.RMSNorm``) or after it (``weight_after_cast``, as Hugging Face's Llama does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

_c10d = torch.ops._c10d_functional


def _collective(op, *args) -> Tensor:
    """A functional collective and its wait, dispatched below autograd. The functional collectives carry
    Python autograd kernels, which cost host time per collective + wait (BENCHMARKS.md, host time); the
    fused ops have no autograd formula (they appear only in post-grad graphs), so their references skip
    them, as autograd kernels themselves do."""
    with torch._C._AutoDispatchBelowAutograd():
        return _c10d.wait_tensor(op(*args))


_lib = torch.library.Library("fluxcompile", "DEF")
_lib.define(
    "all_gather_matmul(Tensor A, Tensor[] Bs, Tensor?[] biases, int gather_dim, int group_size,"
    " str group_name) -> (Tensor, Tensor[])"
)
_lib.define(
    "matmul_reduce_scatter(Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape, int scatter_dim,"
    " str reduce_op, int group_size, str group_name) -> Tensor"
)
_lib.define(
    "matmul_all_reduce(Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape, str reduce_op,"
    " str group_name) -> Tensor"
)
_lib.define(
    "all_to_all_matmul(Tensor A, Tensor[] Bs, Tensor?[] biases, SymInt[] output_split_sizes,"
    " SymInt[] input_split_sizes, str group_name) -> (Tensor, Tensor[])"
)
_lib.define(
    "matmul_all_to_all(Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape,"
    " SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) -> Tensor"
)

_lib.define(
    "all_reduce_rmsnorm(Tensor? x, Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape, Tensor residual,"
    " Tensor weight, float eps, bool upcast, bool weight_after_cast, str reduce_op, str group_name)"
    " -> (Tensor, Tensor)"
)

FUSED_OPS: tuple[str, ...] = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "all_to_all_matmul",
    "matmul_all_to_all",
    "all_reduce_rmsnorm",
)


def op(name: str) -> torch._ops.OpOverload:
    """The OpOverload of a fused op, e.g. ``op("all_gather_matmul")``."""
    return getattr(torch.ops.fluxcompile, name).default


# ---------------------------------------------------------------------------------------------
# Building blocks of the reference implementations (also used by other choices and by tests).


def _matmul(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def matmul_sum(As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None) -> Tensor:
    """``P = addmm(bias, As[0], Bs[0]) + As[1] @ Bs[1] + ...``, added left to right."""
    _check_pairs(As, Bs)
    out = _matmul(As[0], Bs[0], bias)
    for a, b in zip(As[1:], Bs[1:]):
        out = out + torch.mm(a, b)
    return out


def check_group(group_size: int, group_name: str) -> None:
    """A clear error where the graph's group size disagrees with the process group's (bad input)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        actual = _resolve_process_group(group_name).size()
    except Exception as e:
        raise ValueError(f"fluxcompile: no process group named {group_name!r}: {e}") from e
    if actual != group_size:
        raise ValueError(f"fluxcompile: group_size={group_size} but process group {group_name!r} has {actual} ranks")


def gather(A: Tensor, gather_dim: int, group_size: int, group_name: str) -> Tensor:
    """all_gather along ``gather_dim`` (the functional collective gathers along dim 0)."""
    check_group(group_size, group_name)
    gathered = _collective(_c10d.all_gather_into_tensor, A.contiguous(), group_size, group_name)
    if gather_dim == 0:
        return gathered
    return torch.cat(gathered.chunk(group_size, dim=0), dim=gather_dim)


def scatter(P: Tensor, scatter_dim: int, reduce_op: str, group_size: int, group_name: str) -> Tensor:
    """reduce_scatter along ``scatter_dim``."""
    check_group(group_size, group_name)
    if P.shape[scatter_dim] % group_size:
        raise ValueError(
            f"fluxcompile: dim {scatter_dim} of size {P.shape[scatter_dim]} does not split over {group_size} ranks"
        )
    if scatter_dim != 0:
        P = torch.cat(P.chunk(group_size, dim=scatter_dim), dim=0)
    return _collective(_c10d.reduce_scatter_tensor, P.contiguous(), reduce_op, group_size, group_name)


def _consumer_matmuls(A: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None]) -> list[Tensor]:
    if len(Bs) != len(biases):
        raise ValueError(f"fluxcompile: {len(Bs)} weights but {len(biases)} biases")
    a2 = A.reshape(-1, A.shape[-1])
    return [_matmul(a2, b, bias) for b, bias in zip(Bs, biases)]


def _check_pairs(As: Sequence[Tensor], Bs: Sequence[Tensor]) -> None:
    if not As or len(As) != len(Bs):
        raise ValueError(f"fluxcompile: need as many left as right operands (>0), got {len(As)} and {len(Bs)}")


def _check_dim(dim: int, ndim: int, what: str) -> int:
    """``dim`` normalized; it must be a row dim (any but the last: the last is the matmul's K or N)."""
    if ndim < 2 or not -ndim <= dim < ndim or dim % ndim == ndim - 1:
        raise ValueError(f"fluxcompile: {what} {dim} must be a row dim of a {ndim}-D tensor (not the last)")
    return dim % ndim


# ---------------------------------------------------------------------------------------------
# Reference implementations.


@torch.library.impl(_lib, "all_gather_matmul", "CompositeExplicitAutograd")
def _all_gather_matmul_ref(A, Bs, biases, gather_dim, group_size, group_name):
    gather_dim = _check_dim(gather_dim, A.dim(), "gather_dim")
    A_gathered = gather(A, gather_dim, group_size, group_name)
    return A_gathered, _consumer_matmuls(A_gathered, Bs, biases)


@torch.library.impl(_lib, "matmul_reduce_scatter", "CompositeExplicitAutograd")
def _matmul_reduce_scatter_ref(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name):
    scatter_dim = _check_dim(scatter_dim, len(out_shape), "scatter_dim")
    P = matmul_sum(As, Bs, bias).reshape(out_shape)
    return scatter(P, scatter_dim, reduce_op, group_size, group_name)


@torch.library.impl(_lib, "matmul_all_reduce", "CompositeExplicitAutograd")
def _matmul_all_reduce_ref(As, Bs, bias, out_shape, reduce_op, group_name):
    P = matmul_sum(As, Bs, bias).reshape(out_shape).contiguous()
    return _collective(_c10d.all_reduce, P, reduce_op, group_name)


def _exchange(A: Tensor, output_split_sizes, input_split_sizes, group_name: str) -> Tensor:
    return _collective(_c10d.all_to_all_single, A.contiguous(), output_split_sizes, input_split_sizes, group_name)


@torch.library.impl(_lib, "all_to_all_matmul", "CompositeExplicitAutograd")
def _all_to_all_matmul_ref(A, Bs, biases, output_split_sizes, input_split_sizes, group_name):
    A_exchanged = _exchange(A, output_split_sizes, input_split_sizes, group_name)
    return A_exchanged, _consumer_matmuls(A_exchanged, Bs, biases)


@torch.library.impl(_lib, "matmul_all_to_all", "CompositeExplicitAutograd")
def _matmul_all_to_all_ref(As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name):
    P = matmul_sum(As, Bs, bias).reshape(out_shape)
    return _exchange(P, output_split_sizes, input_split_sizes, group_name)


def rms_norm(h: Tensor, weight: Tensor, eps: float, upcast: bool, weight_after_cast: bool) -> Tensor:
    """RMSNorm in the op order the graphs use (pow, mean, +eps, rsqrt, mul; weight before or after the cast)."""
    x = h.to(torch.float32) if upcast else h
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight_after_cast:
        return weight * n.to(h.dtype)
    return (n * weight).to(h.dtype)


@torch.library.impl(_lib, "all_reduce_rmsnorm", "CompositeExplicitAutograd")
def _all_reduce_rmsnorm_ref(
    x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name
):
    P = x if x is not None else matmul_sum(As, Bs, bias).reshape(out_shape)
    r = _collective(_c10d.all_reduce, P.contiguous(), reduce_op, group_name)
    h = residual + r
    return h, rms_norm(h, weight, eps, upcast, weight_after_cast)


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes and strides of what the original subgraph produced.


def _rows_out(A_out: Tensor, Bs: Sequence[Tensor]) -> list[Tensor]:
    m = A_out.numel() // A_out.shape[-1] if A_out.dim() > 1 else 1
    return [A_out.new_empty((m, b.shape[-1])) for b in Bs]


def _product_dtype(As: Sequence[Tensor], Bs: Sequence[Tensor]) -> torch.dtype:
    _check_pairs(As, Bs)
    return torch.result_type(As[0], Bs[0])


@torch.library.register_fake("fluxcompile::all_gather_matmul")
def _all_gather_matmul_fake(A, Bs, biases, gather_dim, group_size, group_name):
    gather_dim = _check_dim(gather_dim, A.dim(), "gather_dim")
    shape = list(A.shape)
    shape[gather_dim] = shape[gather_dim] * group_size
    A_out = A.new_empty(shape)
    return A_out, _rows_out(A_out, Bs)


@torch.library.register_fake("fluxcompile::matmul_reduce_scatter")
def _matmul_reduce_scatter_fake(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name):
    scatter_dim = _check_dim(scatter_dim, len(out_shape), "scatter_dim")
    shape = list(out_shape)
    shape[scatter_dim] = shape[scatter_dim] // group_size
    return As[0].new_empty(shape, dtype=_product_dtype(As, Bs))


@torch.library.register_fake("fluxcompile::matmul_all_reduce")
def _matmul_all_reduce_fake(As, Bs, bias, out_shape, reduce_op, group_name):
    return As[0].new_empty(list(out_shape), dtype=_product_dtype(As, Bs))


@torch.library.register_fake("fluxcompile::all_to_all_matmul")
def _all_to_all_matmul_fake(A, Bs, biases, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else A.shape[0]
    A_out = A.new_empty([rows, *A.shape[1:]])
    return A_out, _rows_out(A_out, Bs)


@torch.library.register_fake("fluxcompile::matmul_all_to_all")
def _matmul_all_to_all_fake(As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name):
    shape = list(out_shape)
    if output_split_sizes:
        shape[0] = sum(output_split_sizes)
    return As[0].new_empty(shape, dtype=_product_dtype(As, Bs))


@torch.library.register_fake("fluxcompile::all_reduce_rmsnorm")
def _all_reduce_rmsnorm_fake(
    x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name
):
    r = x if x is not None else As[0].new_empty(list(out_shape), dtype=_product_dtype(As, Bs))
    h = torch.empty_like(residual + r, memory_format=torch.contiguous_format)
    normed_dtype = torch.result_type(weight, h) if weight_after_cast else h.dtype
    return h, torch.empty_like(h, dtype=normed_dtype)


# The reference implementations by op name. The "reference" choice of every op calls these functions directly:
# called through the dispatcher, a CUDA implementation registered for the op would call itself.
REFERENCES: dict[str, Callable[..., Any]] = {
    "all_gather_matmul": _all_gather_matmul_ref,
    "matmul_reduce_scatter": _matmul_reduce_scatter_ref,
    "matmul_all_reduce": _matmul_all_reduce_ref,
    "all_to_all_matmul": _all_to_all_matmul_ref,
    "matmul_all_to_all": _matmul_all_to_all_ref,
    "all_reduce_rmsnorm": _all_reduce_rmsnorm_ref,
}
