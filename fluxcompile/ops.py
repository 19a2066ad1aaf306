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

Scaled matmuls (fp8)
--------------------
Every op with matmuls ends with the same optional arguments. Without scales (the default) a matmul is
``mm``/``addmm``. With them it is ``torch._scaled_mm(a, b, scale_a, scale_b, bias=..., out_dtype=out_dtype,
use_fast_accum=use_fast_accum)``, as in the graph that was rewritten:
* consumer ops take ``A_scale``, the scale of the communicated operand as this rank holds it: one element
  (tensor-wise, used for every row) or ``[*A.shape[:-1], 1]`` (row-wise: communicated with A's rows), and
  ``B_scales``, one per weight;
* producer ops take ``A_scales`` and ``B_scales``, one each per term of the sum;
* ``out_dtype`` is every product's dtype (scaled matmuls only).

Expert matmuls (the two all-to-all ops)
---------------------------------------
A weight ``Bs[i]`` may be 3-D, ``[E, K, N]``: one matrix per local expert, no bias. With ``offs`` (int32
``[E]``, cumulative row ends, as ``torch._grouped_mm`` takes them) the matmul is ``torch._grouped_mm(X, Bs[i],
offs=offs)``: rows ``offs[e-1]:offs[e]`` use expert ``e`` (``[R, N]``; rows after ``offs[-1]`` are
unspecified, as grouped_mm leaves them). Without ``offs`` the experts have equal rows: ``torch.bmm(X.reshape(E,
-1, K), Bs[i])`` (``[E, R / E, N]``); a producer's 3-D ``As[i]`` is already ``[E, C, K]``.

``row_index`` (int64 ``[R']``) is the permutation between the exchange's order (by source rank) and the
experts' order, as MoE layers write it (torchtitan's ``_permute``/``_unpermute``): the consumer gathers ``X =
A_exchanged.reshape(-1, K)[row_index]``; the producer scatters ``Y[row_index[j]] = P[j]`` into zeros (adding
where ``accumulate``: the backward of a gather). An index equal to the row count stands for a zero padding row
(torchtitan appends one): it reads zeros and its writes are dropped.

The compiled choice
-------------------
``choice`` (last argument) is what the compile-time choice (``fx_passes/decide.py``) wrote into the graph for
the op's CUDA implementation: ``""`` lets the runtime autotuner choose per call signature; otherwise a table of
choice names by the op's row count (``lowerings/compiled.py``). It never changes the result, so the reference
ignores it.

Adding an op
------------
New ops follow the same shape: the operands before the communication as tensors (weights as ``Tensor[]`` or a
stacked tensor, never Python lists of numbers), the communicated tensor returned beside the products where the
graph may still read it, sizes that may be symbolic as ``SymInt[]`` and sizes known only on the GPU as tensors,
``group_name`` after the operands, then the scaling arguments and ``choice``.

The ops
-------
``all_gather_matmul(A, Bs, biases, gather_dim, group_size, group_name, ..., return_A) -> (A_gathered, outs)``
    ``A_gathered = all_gather(A, dim=gather_dim)`` (N-D, contiguous);
    ``outs[i] = addmm(biases[i], A_gathered.reshape(-1, K), Bs[i])`` — several weights share one gather.
    ``return_A`` (default True; PyTorch's ``symm_mem.fused_all_gather_matmul`` has the same flag) says whether
    the caller reads ``A_gathered``: the rewrite sets it False where only the fused matmuls read the gathered
    tensor, and the op then returns None in its place, so an implementation need not produce it.
``matmul_reduce_scatter(As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name) -> out``
    ``out = reduce_scatter(P.reshape(out_shape), dim=scatter_dim)``; ``scatter_dim`` may be the last (feature) dim.
``matmul_all_reduce(As, Bs, bias, out_shape, reduce_op, group_name) -> out``
    ``out = all_reduce(P.reshape(out_shape))``.
``all_to_all_matmul(A, Bs, biases, output_split_sizes, input_split_sizes, group_name, ..., offs, row_index,
return_A) -> (A_exchanged, outs)``
    ``A_exchanged = all_to_all_single(A)`` along dim 0; ``X = A_exchanged.reshape(-1, K)``, or its rows picked
    by ``row_index`` (see "Expert matmuls"); ``outs[i]`` = the matmul of ``X`` with ``Bs[i]``: dense (with
    ``biases[i]``, as for all_gather_matmul) or per expert. MoE dispatch, Ulysses attention. ``return_A``
    (default True) as all_gather_matmul's: False where only the fused matmuls read the exchanged rows (set by
    the rewrite), and the op returns None in their place.
``matmul_all_to_all(As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name, ..., offs,
row_index, accumulate) -> out``
    ``P`` = the sum of the matmuls (dense or per expert); ``Y = P.reshape(-1, N)``, or its rows put at
    ``row_index``; ``out = all_to_all_single(Y.reshape(out_shape))`` along dim 0. MoE combine.
``embedding_bag_all_to_all(weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes,
input_split_sizes, group_name, bookkeeping) -> (out, offset2bag, bag_size, max_indices)``
    ``P = cat([embedding_bag(indices[t], weights[t], offsets[t], mode)[0] for t], dim=-1)`` (``[B, T * D]``,
    the layout of the pooled rows stacked along dim 1); ``out = all_to_all_single(P.reshape(out_shape))`` along
    dim 0. ``mode`` is aten's: 0 sum, 1 mean, 2 max. The model-parallel embedding tables of DLRM. With
    ``bookkeeping`` (a training forward, set by the rewrite) also every table's ``offset2bag``, ``bag_size`` and
    ``max_indices`` as aten's ``_embedding_bag`` makes them on the tables' device, for the backward; without it
    three empty lists. ``padding_idx`` and ``per_sample_weights`` (one per table, sum pooling) as aten's.
``all_to_all_embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights,
scale_grad_by_freq, mode, output_split_sizes, input_split_sizes, group_name) -> weight_grads``
    Its backward: ``G = all_to_all_single(grad)`` along dim 0 (``grad`` ``[rows, T * D]``, the pooled rows'
    gradients on the samples' owners); ``weight_grads[t] = _embedding_bag_backward(G.view(-1, T, D)[:, t],
    indices[t], offsets[t], offset2bag[t], bag_size[t], max_indices[t], num_weights[t], scale_grad_by_freq, mode)``
    (``per_sample_weights``, ``sparse`` and ``padding_idx`` as aten's): the tables' gradients on their owner,
    sparse COO tensors with ``sparse``; given the tables (``weights``), the per-sample weights' gradients after
    them (``_embedding_bag_per_sample_weights_backward`` per table).
``all_reduce_rmsnorm(x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op,
group_name) -> (h, normed)``
    The decoder layer's tail after a row-parallel projection: ``r = all_reduce(x if x is given else
    P.reshape(out_shape))``; ``h = residual + r`` (the new residual stream); ``normed = RMSNorm(h)``, in
    float32 when ``upcast``, with ``weight`` multiplied before the cast back to ``h.dtype``
    (``nn.RMSNorm``) or after it (``weight_after_cast``, as Hugging Face's Llama does).
"""

from __future__ import annotations

import functools
import math
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
# The trailing arguments, alike for every op with matmuls (see "Scaled matmuls" and "The compiled choice" above).
_SCALING = "Tensor[]? B_scales=None, ScalarType? out_dtype=None, bool use_fast_accum=False"
_CHOICE = 'str choice=""'
_SCALING_TAIL = f"{_SCALING}, {_CHOICE}"
_PRODUCER_TAIL = f"Tensor[]? A_scales=None, {_SCALING_TAIL}"
# The all-to-all ops' expert arguments (see "Expert matmuls"), before ``choice``.
_EXPERTS = "Tensor? offs=None, Tensor? row_index=None"

_lib.define(
    "all_gather_matmul(Tensor A, Tensor[] Bs, Tensor?[] biases, int gather_dim, int group_size, str group_name, "
    f"Tensor? A_scale=None, {_SCALING}, bool return_A=True, {_CHOICE}) -> (Tensor?, Tensor[])"
)
_lib.define(
    "matmul_reduce_scatter(Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape, int scatter_dim,"
    f" str reduce_op, int group_size, str group_name, {_PRODUCER_TAIL}) -> Tensor"
)
_lib.define(
    "matmul_all_reduce(Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape, str reduce_op,"
    f" str group_name, {_PRODUCER_TAIL}) -> Tensor"
)
_lib.define(
    "all_to_all_matmul(Tensor A, Tensor[] Bs, Tensor?[] biases, SymInt[] output_split_sizes,"
    f" SymInt[] input_split_sizes, str group_name, Tensor? A_scale=None, {_SCALING}, {_EXPERTS},"
    f" bool return_A=True, {_CHOICE}) -> (Tensor?, Tensor[])"
)
_lib.define(
    "matmul_all_to_all(Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape,"
    " SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name,"
    f" Tensor[]? A_scales=None, {_SCALING}, {_EXPERTS}, bool accumulate=False, {_CHOICE}) -> Tensor"
)
_lib.define(
    "embedding_bag_all_to_all(Tensor[] weights, Tensor[] indices, Tensor[] offsets, int mode,"
    " bool include_last_offset, SymInt[] out_shape, SymInt[] output_split_sizes, SymInt[] input_split_sizes,"
    " str group_name, Tensor[]? per_sample_weights=None, bool bookkeeping=False, int padding_idx=-1,"
    ' str choice="") -> (Tensor, Tensor[], Tensor[], Tensor[])'
)
_lib.define(
    "all_to_all_embedding_bag_backward(Tensor grad, Tensor[] indices, Tensor[] offsets, Tensor[] offset2bag,"
    " Tensor[] bag_size, Tensor[] max_indices, SymInt[] num_weights, bool scale_grad_by_freq, int mode,"
    " SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name, Tensor[]? per_sample_weights=None,"
    ' Tensor[]? weights=None, bool sparse=False, int padding_idx=-1, str choice="") -> Tensor[]'
)
_lib.define(
    "all_reduce_rmsnorm(Tensor? x, Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape, Tensor residual,"
    " Tensor weight, float eps, bool upcast, bool weight_after_cast, str reduce_op, str group_name,"
    f" {_PRODUCER_TAIL}) -> (Tensor, Tensor)"
)

FUSED_OPS: tuple[str, ...] = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "all_to_all_matmul",
    "matmul_all_to_all",
    "all_reduce_rmsnorm",
    "embedding_bag_all_to_all",
    "all_to_all_embedding_bag_backward",
)


def op(name: str) -> torch._ops.OpOverload:
    """The OpOverload of a fused op, e.g. ``op("all_gather_matmul")``."""
    return getattr(torch.ops.fluxcompile, name).default


# ---------------------------------------------------------------------------------------------
# Building blocks of the reference implementations (also used by other choices and by tests).


def _matmul(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    scale_a: Tensor | None = None,
    scale_b: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> Tensor:
    if scale_a is None:
        return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    # _scaled_mm takes row-wise scales with unit strides ([M, 1] and [1, N]); a graph may hand them over with
    # another stride on their size-1 dim (Inductor fixes the layout for _scaled_mm itself, not for a fused op).
    scale_a, scale_b = canonical_scale(scale_a), canonical_scale(scale_b)
    rowwise = scale_a.numel() > 1 or scale_b.numel() > 1
    if a.device.type == "cpu" and rowwise and not _cpu_scaled_mm_takes_rowwise_scales():
        # The same product from the dequantized operands, in fp32 (torch 2.11's CPU _scaled_mm takes tensor-wise
        # scales only).
        out = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
        return (out if bias is None else out + bias.float()).to(out_dtype or a.dtype)
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def canonical_scale(scale: Tensor) -> Tensor:
    """``scale`` with the row-major strides of its shape (a view where it is contiguous)."""
    return scale.reshape(-1).view(scale.shape)


@functools.cache
def _cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise and column-wise scales (asked once)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def check_scales(
    n: int, A_scales: Sequence[Tensor] | None, B_scales: Sequence[Tensor] | None, out_dtype: torch.dtype | None
) -> bool:
    """Whether the ``n`` matmuls are scaled (both scale lists given, one scale per matmul); a clear error where
    the arguments disagree."""
    if A_scales is None and B_scales is None:
        if out_dtype is not None:
            raise ValueError("fluxcompile: out_dtype applies to scaled matmuls only (no scales given)")
        return False
    if A_scales is None or B_scales is None or len(A_scales) != n or len(B_scales) != n:
        raise ValueError(
            f"fluxcompile: scaled matmuls need one A scale and one B scale per matmul ({n}), got "
            f"{None if A_scales is None else len(A_scales)} and {None if B_scales is None else len(B_scales)}"
        )
    return True


def matmul_sum(
    As: Sequence[Tensor],
    Bs: Sequence[Tensor],
    bias: Tensor | None,
    A_scales: Sequence[Tensor] | None = None,
    B_scales: Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> Tensor:
    """``P = addmm(bias, As[0], Bs[0]) + As[1] @ Bs[1] + ...``, added left to right; with scales, each term is
    ``_scaled_mm(As[i], Bs[i], A_scales[i], B_scales[i], out_dtype=out_dtype)`` (the bias in the first)."""
    _check_pairs(As, Bs)
    scaled = check_scales(len(As), A_scales, B_scales, out_dtype)
    out = None
    for i, (a, b) in enumerate(zip(As, Bs)):
        term_bias = bias if i == 0 else None
        if scaled:
            term = _matmul(a, b, term_bias, A_scales[i], B_scales[i], out_dtype, use_fast_accum)
        else:
            term = _matmul(a, b, term_bias)
        out = term if out is None else out + term
    return out


def group_size_of(group_name: str) -> int:
    """The size of the process group ``group_name`` (a clear error where there is none)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name).size()
    except Exception as e:
        raise ValueError(f"fluxcompile: no process group named {group_name!r}: {e}") from e


def check_group(group_size: int, group_name: str) -> None:
    """A clear error where the graph's group size disagrees with the process group's (bad input)."""
    actual = group_size_of(group_name)
    if actual != group_size:
        raise ValueError(f"fluxcompile: group_size={group_size} but process group {group_name!r} has {actual} ranks")


# Every fp8 dtype this torch has (moved as bytes where a collective has no fp8 type).
FP8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def _moved(A: Tensor, collective: Callable[[Tensor], Tensor]) -> Tensor:
    """``collective(A)`` for a collective that only moves data; fp8 tensors move as bytes (gloo has no fp8)."""
    A = A.contiguous()
    if A.dtype in FP8_DTYPES:
        return collective(A.view(torch.uint8)).view(A.dtype)
    return collective(A)


def gather(A: Tensor, gather_dim: int, group_size: int, group_name: str) -> Tensor:
    """all_gather along ``gather_dim`` (the functional collective gathers along dim 0)."""
    check_group(group_size, group_name)
    gathered = _moved(A, lambda x: _collective(_c10d.all_gather_into_tensor, x, group_size, group_name))
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


def _consumer_matmuls(
    A: Tensor,
    Bs: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    A_scale: Tensor | None = None,
    B_scales: Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> list[Tensor]:
    """``[addmm(biases[i], A.reshape(-1, K), Bs[i])]``, scaled when the scales are given (``A_scale`` already
    communicated like ``A``: one scale, or one per row)."""
    if len(Bs) != len(biases):
        raise ValueError(f"fluxcompile: {len(Bs)} weights but {len(biases)} biases")
    a2 = A.reshape(-1, A.shape[-1])
    if not check_scales(len(Bs), None if A_scale is None else [A_scale] * len(Bs), B_scales, out_dtype):
        return [_matmul(a2, b, bias) for b, bias in zip(Bs, biases)]
    sa = A_scale.reshape(-1, 1) if A_scale.numel() > 1 else A_scale
    return [_matmul(a2, b, bias, sa, sb, out_dtype, use_fast_accum) for b, bias, sb in zip(Bs, biases, B_scales)]


def _row_scale(A: Tensor, A_scale: Tensor | None) -> bool:
    """Whether ``A_scale`` is a row-wise scale of ``A`` (``[*A.shape[:-1], 1]``, communicated with A's rows);
    a one-element scale is tensor-wise. Anything else is an error."""
    if A_scale is None or A_scale.numel() == 1:
        return False
    if list(A_scale.shape) != [*A.shape[:-1], 1]:
        raise ValueError(
            f"fluxcompile: A_scale of shape {list(A_scale.shape)} is neither one scale nor one per row of A "
            f"{list(A.shape)}"
        )
    return True


def _check_pairs(As: Sequence[Tensor], Bs: Sequence[Tensor]) -> None:
    if not As or len(As) != len(Bs):
        raise ValueError(f"fluxcompile: need as many left as right operands (>0), got {len(As)} and {len(Bs)}")


def _check_dim(dim: int, ndim: int, what: str, last: bool = False) -> int:
    """``dim`` normalized; it must be a row dim (any but the last: the last is the matmul's K or N), or any dim
    when ``last`` (the reduce-scatter's output may be split along its features)."""
    if ndim < 2 or not -ndim <= dim < ndim or (dim % ndim == ndim - 1 and not last):
        raise ValueError(f"fluxcompile: {what} {dim} must be a row dim of a {ndim}-D tensor (not the last)")
    return dim % ndim


# ---------------------------------------------------------------------------------------------
# Reference implementations.


@torch.library.impl(_lib, "all_gather_matmul", "CompositeExplicitAutograd")
def _all_gather_matmul_ref(
    A, Bs, biases, gather_dim, group_size, group_name,
    A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, return_A=True, choice="",
):  # fmt: skip
    gather_dim = _check_dim(gather_dim, A.dim(), "gather_dim")
    A_gathered = gather(A, gather_dim, group_size, group_name)
    if _row_scale(A, A_scale):
        A_scale = gather(A_scale, gather_dim, group_size, group_name)
    outs = _consumer_matmuls(A_gathered, Bs, biases, A_scale, B_scales, out_dtype, use_fast_accum)
    return (A_gathered if return_A else None), outs


@torch.library.impl(_lib, "matmul_reduce_scatter", "CompositeExplicitAutograd")
def _matmul_reduce_scatter_ref(
    As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, choice="",
):  # fmt: skip
    scatter_dim = _check_dim(scatter_dim, len(out_shape), "scatter_dim", last=True)
    P = matmul_sum(As, Bs, bias, A_scales, B_scales, out_dtype, use_fast_accum).reshape(out_shape)
    return scatter(P, scatter_dim, reduce_op, group_size, group_name)


@torch.library.impl(_lib, "matmul_all_reduce", "CompositeExplicitAutograd")
def _matmul_all_reduce_ref(
    As, Bs, bias, out_shape, reduce_op, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, choice="",
):  # fmt: skip
    P = matmul_sum(As, Bs, bias, A_scales, B_scales, out_dtype, use_fast_accum).reshape(out_shape).contiguous()
    return _collective(_c10d.all_reduce, P, reduce_op, group_name)


def _exchange(A: Tensor, output_split_sizes, input_split_sizes, group_name: str) -> Tensor:
    if not output_split_sizes or not input_split_sizes:
        # An empty list means equal splits; the raw functional op takes explicit ones (with NCCL, empty lists
        # give an empty output that the exchange then writes past).
        world = group_size_of(group_name)
        equal = [A.shape[0] // world] * world
        output_split_sizes = output_split_sizes or equal
        input_split_sizes = input_split_sizes or equal
    return _moved(
        A, lambda x: _collective(_c10d.all_to_all_single, x, output_split_sizes, input_split_sizes, group_name)
    )


def expert_matmul(
    a: Tensor, b: Tensor, bias: Tensor | None, offs: Tensor | None, *scaling: Any
) -> Tensor:
    """One matmul of the all-to-all ops: dense (``b`` 2-D: ``_matmul``) or per expert (``b`` 3-D ``[E, K, N]``:
    ``torch._grouped_mm`` with ``offs``, ``torch.bmm`` over equal groups without)."""
    if b.dim() == 2:
        return _matmul(a if a.dim() == 2 else a.reshape(-1, a.shape[-1]), b, bias, *scaling)
    if b.dim() != 3 or bias is not None or (scaling and scaling[0] is not None):
        raise ValueError(
            f"fluxcompile: an expert weight is [E, K, N] with no bias or scales, got {list(b.shape)}"
            f"{' with a bias' if bias is not None else ''}"
        )
    if offs is not None:
        return torch._grouped_mm(a.reshape(-1, a.shape[-1]), b, offs=offs)
    return torch.bmm(a.reshape(b.shape[0], -1, a.shape[-1]), b)


def gather_rows(x: Tensor, row_index: Tensor | None) -> Tensor:
    """``x`` (2-D) with its rows picked by ``row_index``; index ``len(x)`` reads a zero row (torchtitan's padding)."""
    if row_index is None:
        return x
    return torch.cat([x, x.new_zeros(1, x.shape[-1])])[row_index]


def scatter_rows(p: Tensor, row_index: Tensor | None, rows: int, accumulate: bool) -> Tensor:
    """``Y`` of ``rows`` rows with ``Y[row_index[j]] = p[j]`` (added where ``accumulate``), zeros elsewhere;
    writes to index ``rows`` (the padding row) are dropped. Without ``row_index``, ``p`` itself."""
    if row_index is None:
        return p
    y = p.new_zeros(rows + 1, p.shape[-1])
    return y.index_put_((row_index,), p, accumulate=accumulate)[:rows]


def _check_experts(Bs: Sequence[Tensor], offs: Tensor | None, row_index: Tensor | None) -> None:
    experts = [b.shape[0] for b in Bs if b.dim() == 3]
    if offs is not None and (len(experts) != len(Bs) or offs.dim() != 1 or offs.numel() != experts[0]):
        raise ValueError(
            f"fluxcompile: offs ({list(offs.shape)}) needs [E, K, N] expert weights with E = offs.numel(), got "
            f"{[list(b.shape) for b in Bs]}"
        )
    if row_index is not None and (row_index.dim() != 1 or row_index.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"fluxcompile: row_index must be a 1-D int32/int64 tensor, got {row_index.dtype}{list(row_index.shape)}")


@torch.library.impl(_lib, "all_to_all_matmul", "CompositeExplicitAutograd")
def _all_to_all_matmul_ref(
    A, Bs, biases, output_split_sizes, input_split_sizes, group_name,
    A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None, return_A=True,
    choice="",
):  # fmt: skip
    _check_experts(Bs, offs, row_index)
    A_exchanged = _exchange(A, output_split_sizes, input_split_sizes, group_name)
    if all(b.dim() == 2 for b in Bs) and row_index is None and _row_scale(A, A_scale):
        A_scale = _exchange(A_scale, output_split_sizes, input_split_sizes, group_name)
    products = dispatch_matmuls(A_exchanged, Bs, biases, A_scale, B_scales, out_dtype, use_fast_accum, offs, row_index)
    return A_exchanged if return_A else None, products


def dispatch_matmuls(
    A_exchanged: Tensor, Bs: Sequence[Tensor], biases: Sequence[Tensor | None], A_scale: Tensor | None = None,
    B_scales: Sequence[Tensor] | None = None, out_dtype: torch.dtype | None = None, use_fast_accum: bool = False,
    offs: Tensor | None = None, row_index: Tensor | None = None,
) -> list[Tensor]:  # fmt: skip
    """all_to_all_matmul's matmuls on the exchanged rows (``A_scale``: already exchanged where per row): what every
    choice that exchanges the rows apart (the reference, ``vdev``) runs after its exchange."""
    if all(b.dim() == 2 for b in Bs) and row_index is None:
        return _consumer_matmuls(A_exchanged, Bs, biases, A_scale, B_scales, out_dtype, use_fast_accum)
    if A_scale is not None or B_scales is not None:
        raise ValueError("fluxcompile: scaled matmuls with expert weights or row_index are not supported")
    if len(Bs) != len(biases):
        raise ValueError(f"fluxcompile: {len(Bs)} weights but {len(biases)} biases")
    x = gather_rows(A_exchanged.reshape(-1, A_exchanged.shape[-1]), row_index)
    return [expert_matmul(x, b, bias, offs) for b, bias in zip(Bs, biases)]


@torch.library.impl(_lib, "matmul_all_to_all", "CompositeExplicitAutograd")
def _matmul_all_to_all_ref(
    As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None,
    accumulate=False, choice="",
):  # fmt: skip
    P = combine_matmuls(As, Bs, bias, out_shape, A_scales, B_scales, out_dtype, use_fast_accum, offs, row_index, accumulate)
    return _exchange(P, output_split_sizes, input_split_sizes, group_name)


def combine_matmuls(
    As: Sequence[Tensor], Bs: Sequence[Tensor], bias: Tensor | None, out_shape: Sequence[int],
    A_scales: Sequence[Tensor] | None = None, B_scales: Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None, use_fast_accum: bool = False, offs: Tensor | None = None,
    row_index: Tensor | None = None, accumulate: bool = False,
) -> Tensor:  # fmt: skip
    """matmul_all_to_all's rows before their exchange (``out_shape``): what every choice that exchanges them apart
    (the reference, ``vdev``) runs first."""
    _check_experts(Bs, offs, row_index)
    if all(b.dim() == 2 for b in Bs) and row_index is None:
        P = matmul_sum(As, Bs, bias, A_scales, B_scales, out_dtype, use_fast_accum)
    else:
        _check_pairs(As, Bs)
        if A_scales is not None or B_scales is not None:
            raise ValueError("fluxcompile: scaled matmuls with expert weights or row_index are not supported")
        P = None
        for i, (a, b) in enumerate(zip(As, Bs)):
            term = expert_matmul(a, b, bias if i == 0 else None, offs)
            P = term if P is None else P + term
        P = scatter_rows(P.reshape(-1, P.shape[-1]), row_index, math.prod(out_shape[:-1]), accumulate)
    return P.reshape(out_shape)


def pooled_rows(
    weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int, include_last_offset: bool
) -> Tensor:
    """``cat([embedding_bag(indices[t], weights[t], offsets[t], mode)[0] for t], dim=-1)``: ``[B, T * D]``."""
    return _bags(weights, indices, offsets, mode, include_last_offset)[0]


def _bags(
    weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int,
    include_last_offset: bool, padding_idx: int = -1, per_sample_weights: Sequence[Tensor] | None = None,
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:  # fmt: skip
    """The pooled rows side by side, and each table's bookkeeping (offset2bag, bag_size, max_indices) as aten's
    ``_embedding_bag`` makes them."""
    if not weights or not len(weights) == len(indices) == len(offsets):
        raise ValueError(
            f"fluxcompile: need as many tables, index and offset tensors (>0), got {len(weights)}, {len(indices)} "
            f"and {len(offsets)}"
        )
    if mode not in (0, 1, 2):
        raise ValueError(f"fluxcompile: embedding_bag mode {mode} is not 0 (sum), 1 (mean) or 2 (max)")
    psw = per_sample_weights if per_sample_weights is not None else [None] * len(weights)
    bags = [
        torch.ops.aten._embedding_bag(w, i, o, False, mode, False, p, include_last_offset, padding_idx)
        for w, i, o, p in zip(weights, indices, offsets, psw)
    ]
    return torch.cat([b[0] for b in bags], dim=-1), *([b[k] for b in bags] for k in (1, 2, 3))


@torch.library.impl(_lib, "embedding_bag_all_to_all", "CompositeExplicitAutograd")
def _embedding_bag_all_to_all_ref(
    weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
    group_name, per_sample_weights=None, bookkeeping=False, padding_idx=-1, choice="",
):  # fmt: skip
    P, offset2bag, bag_size, max_indices = _bags(
        weights, indices, offsets, mode, include_last_offset, padding_idx, per_sample_weights
    )
    out = _exchange(P.reshape(out_shape), output_split_sizes, input_split_sizes, group_name)
    if not bookkeeping:
        return out, [], [], []
    return out, offset2bag, bag_size, max_indices


@torch.library.impl(_lib, "all_to_all_embedding_bag_backward", "CompositeExplicitAutograd")
def _all_to_all_embedding_bag_backward_ref(
    grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
    output_split_sizes, input_split_sizes, group_name, per_sample_weights=None, weights=None, sparse=False,
    padding_idx=-1, choice="",
):  # fmt: skip
    tables = len(indices)
    if grad.dim() != 2 or not tables or grad.shape[1] % tables:
        raise ValueError(f"fluxcompile: pooled gradients {list(grad.shape)} for {tables} tables side by side")
    G = _exchange(grad, output_split_sizes, input_split_sizes, group_name)
    per_table = G.view(G.shape[0], tables, -1)
    psw = per_sample_weights if per_sample_weights is not None else [None] * tables
    backward = torch.ops.aten._embedding_bag_backward
    grads = [
        backward(per_table[:, t], indices[t], offsets[t], offset2bag[t], bag_size[t], max_indices[t], num_weights[t],
                 scale_grad_by_freq, mode, sparse, psw[t], padding_idx)
        for t in range(tables)
    ]  # fmt: skip
    if weights is not None:  # the per-sample weights' gradients too
        grads += [
            torch.ops.aten._embedding_bag_per_sample_weights_backward(
                per_table[:, t], weights[t], indices[t], offsets[t], offset2bag[t], mode, padding_idx
            )
            for t in range(tables)
        ]
    return grads


def rms_norm(h: Tensor, weight: Tensor, eps: float, upcast: bool, weight_after_cast: bool) -> Tensor:
    """RMSNorm in the op order the graphs use (pow, mean, +eps, rsqrt, mul; weight before or after the cast)."""
    x = h.to(torch.float32) if upcast else h
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight_after_cast:
        return weight * n.to(h.dtype)
    return (n * weight).to(h.dtype)


@torch.library.impl(_lib, "all_reduce_rmsnorm", "CompositeExplicitAutograd")
def _all_reduce_rmsnorm_ref(
    x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, choice="",
):  # fmt: skip
    P = x if x is not None else matmul_sum(As, Bs, bias, A_scales, B_scales, out_dtype, use_fast_accum)
    P = P.reshape(out_shape) if x is None else P
    r = _collective(_c10d.all_reduce, P.contiguous(), reduce_op, group_name)
    h = residual + r
    return h, rms_norm(h, weight, eps, upcast, weight_after_cast)


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes and strides of what the original subgraph produced.


def _rows_out(A_out: Tensor, Bs: Sequence[Tensor], out_dtype: torch.dtype | None) -> list[Tensor]:
    m = A_out.numel() // A_out.shape[-1] if A_out.dim() > 1 else 1
    return [A_out.new_empty((m, b.shape[-1]), dtype=out_dtype or A_out.dtype) for b in Bs]


def _product_dtype(
    As: Sequence[Tensor], Bs: Sequence[Tensor], A_scales: Sequence[Tensor] | None, out_dtype: torch.dtype | None
) -> torch.dtype:
    _check_pairs(As, Bs)
    if A_scales is not None:
        return out_dtype or As[0].dtype
    return torch.result_type(As[0], Bs[0])


@torch.library.register_fake("fluxcompile::all_gather_matmul")
def _all_gather_matmul_fake(
    A, Bs, biases, gather_dim, group_size, group_name,
    A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, return_A=True, choice="",
):  # fmt: skip
    gather_dim = _check_dim(gather_dim, A.dim(), "gather_dim")
    shape = list(A.shape)
    shape[gather_dim] = shape[gather_dim] * group_size
    A_out = A.new_empty(shape)
    return (A_out if return_A else None), _rows_out(A_out, Bs, out_dtype)


@torch.library.register_fake("fluxcompile::matmul_reduce_scatter")
def _matmul_reduce_scatter_fake(
    As, Bs, bias, out_shape, scatter_dim, reduce_op, group_size, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, choice="",
):  # fmt: skip
    scatter_dim = _check_dim(scatter_dim, len(out_shape), "scatter_dim", last=True)
    shape = list(out_shape)
    shape[scatter_dim] = shape[scatter_dim] // group_size
    return As[0].new_empty(shape, dtype=_product_dtype(As, Bs, A_scales, out_dtype))


@torch.library.register_fake("fluxcompile::matmul_all_reduce")
def _matmul_all_reduce_fake(
    As, Bs, bias, out_shape, reduce_op, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, choice="",
):  # fmt: skip
    return As[0].new_empty(list(out_shape), dtype=_product_dtype(As, Bs, A_scales, out_dtype))


def _expert_out(x: Tensor, b: Tensor, offs: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    """The fake product of ``x`` (``[R, K]``) and one weight of an all-to-all op (see ``expert_matmul``)."""
    dtype = out_dtype or x.dtype
    if b.dim() == 3 and offs is None:
        return x.new_empty((b.shape[0], x.shape[0] // b.shape[0], b.shape[-1]), dtype=dtype)
    return x.new_empty((x.shape[0], b.shape[-1]), dtype=dtype)


@torch.library.register_fake("fluxcompile::all_to_all_matmul")
def _all_to_all_matmul_fake(
    A, Bs, biases, output_split_sizes, input_split_sizes, group_name,
    A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None, return_A=True,
    choice="",
):  # fmt: skip
    _check_experts(Bs, offs, row_index)
    rows = sum(output_split_sizes) if output_split_sizes else A.shape[0]
    A_out = A.new_empty([rows, *A.shape[1:]])
    returned = A_out if return_A else None
    if all(b.dim() == 2 for b in Bs) and row_index is None:
        return returned, _rows_out(A_out, Bs, out_dtype)
    x = A_out.new_empty((rows * math.prod(A.shape[1:-1]) if row_index is None else row_index.shape[0], A.shape[-1]))
    return returned, [_expert_out(x, b, offs, out_dtype) for b in Bs]


@torch.library.register_fake("fluxcompile::matmul_all_to_all")
def _matmul_all_to_all_fake(
    As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None,
    accumulate=False, choice="",
):  # fmt: skip
    _check_experts(Bs, offs, row_index)
    shape = list(out_shape)
    if output_split_sizes:
        shape[0] = sum(output_split_sizes)
    return As[0].new_empty(shape, dtype=_product_dtype(As, Bs, A_scales, out_dtype))


@torch.library.register_fake("fluxcompile::embedding_bag_all_to_all")
def _embedding_bag_all_to_all_fake(
    weights, indices, offsets, mode, include_last_offset, out_shape, output_split_sizes, input_split_sizes,
    group_name, per_sample_weights=None, bookkeeping=False, padding_idx=-1, choice="",
):  # fmt: skip
    shape = list(out_shape)
    if output_split_sizes:
        shape[0] = sum(output_split_sizes)
    out = weights[0].new_empty(shape)
    if not bookkeeping:
        return out, [], [], []
    # aten's own shapes and dtypes of the bookkeeping (its meta function)
    psw = per_sample_weights if per_sample_weights is not None else [None] * len(weights)
    books = [
        torch.ops.aten._embedding_bag(w, i, o, False, mode, False, p, include_last_offset, padding_idx)
        for w, i, o, p in zip(weights, indices, offsets, psw)
    ]
    return out, *([b[k] for b in books] for k in (1, 2, 3))


@torch.library.register_fake("fluxcompile::all_to_all_embedding_bag_backward")
def _all_to_all_embedding_bag_backward_fake(
    grad, indices, offsets, offset2bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
    output_split_sizes, input_split_sizes, group_name, per_sample_weights=None, weights=None, sparse=False,
    padding_idx=-1, choice="",
):  # fmt: skip
    width = grad.shape[1] // max(len(indices), 1)
    if not sparse:
        grads = [grad.new_empty((n, width)) for n in num_weights]
    else:
        # aten's sparse gradients: every position's row at its index, uncoalesced (its CPU meta path reads an empty
        # offset2bag of the sum fast path as no positions)
        grads = [
            torch.sparse_coo_tensor(
                i.new_empty((1, i.numel()), dtype=torch.int64), grad.new_empty((i.numel(), width)), (n, width),
                check_invariants=False, is_coalesced=False,
            )
            for i, n in zip(indices, num_weights)
        ]  # fmt: skip
    if weights is not None:
        grads += [grad.new_empty((i.numel(),)) for i in indices]
    return grads


@torch.library.register_fake("fluxcompile::all_reduce_rmsnorm")
def _all_reduce_rmsnorm_fake(
    x, As, Bs, bias, out_shape, residual, weight, eps, upcast, weight_after_cast, reduce_op, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, choice="",
):  # fmt: skip
    r = x if x is not None else As[0].new_empty(list(out_shape), dtype=_product_dtype(As, Bs, A_scales, out_dtype))
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
    "embedding_bag_all_to_all": _embedding_bag_all_to_all_ref,
    "all_to_all_embedding_bag_backward": _all_to_all_embedding_bag_backward_ref,
}
