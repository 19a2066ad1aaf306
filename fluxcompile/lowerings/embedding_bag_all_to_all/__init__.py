"""fluxcompile.embedding_bag_all_to_all: its choices and its CUDA implementation, which asks the rank-synchronized
autotuner for one choice per call signature (identically on every rank) and runs it.

Choices, in registration order:
* ``triton:<variant>`` (triton.py; family ``dlrm``): the Triton pooling kernel of
  kernels/embedding_bag.py, which stores every pooled row straight into its owner's output (one launch for all
  tables; with ``bookkeeping`` it also writes the backward's offset2bag and bag sizes), counters per (source,
  destination) pair, a bounded wait and a copy out of the receive buffer;
* ``put:<variant>`` (put.py; family ``dlrm``): the pooling into a symmetric send buffer, then NVSHMEM's
  put-with-signal to every peer: the form for groups across hosts, and on one host where
  ``config.exchange_transport`` is ``"put"``;
* ``reference`` (``embedding_bag`` per table + ``cat`` + NCCL ``all_to_all_single``, registered by
  lowerings/choices.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..autotune import pick
from ..bag_samples import even_bags
from ..choices import Choice, register_choice, register_sample
from ..direct_calls import cuda_impl
from . import put, triton

OP = "embedding_bag_all_to_all"

if triton.eb is not None:
    for _name in triton.eb.VARIANTS:
        register_choice(OP, Choice(f"{triton.NAME}:{_name}", *triton.make(_name), family="dlrm"))
    register_choice(
        OP,
        Choice(
            f"{put.NAME}:{triton.eb.DEFAULT}", *put.make(triton.eb.DEFAULT), family="dlrm", remote_peers=True,
        ),
    )


@cuda_impl(OP, probe=lambda args: args[0][0])
def embedding_bag_all_to_all_cuda(
    weights: Sequence[Tensor], indices: Sequence[Tensor], offsets: Sequence[Tensor], mode: int,
    include_last_offset: bool, out_shape: Sequence[int], output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int], group_name: str, per_sample_weights: Sequence[Tensor] | None = None,
    bookkeeping: bool = False, padding_idx: int = -1, choice: str = "",
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:  # fmt: skip
    """The op's CUDA implementation: the compiled choice, else the autotuner's for this call signature (with the
    bookkeeping and a padding index tuned apart, passed to the choices as keywords)."""
    args = (
        list(weights), list(indices), list(offsets), mode, include_last_offset, list(out_shape),
        list(output_split_sizes), list(input_split_sizes), group_name,
    )  # fmt: skip
    if per_sample_weights is not None:  # positional: the tuning key sees their shapes
        args = (*args, list(per_sample_weights))
    flags = _BOOKKEEPING if bookkeeping else _NONE
    if padding_idx >= 0:
        flags = {**flags, "padding_idx": padding_idx}
    return pick(OP, args, group_name, compiled=choice, kwargs=flags).fn(*args, **flags)


_BOOKKEEPING = {"bookkeeping": True}
_NONE: dict = {}


def _sample(args: tuple) -> tuple:
    """Compile-time tuning operands: every table's bags of equal length over random rows (bag_samples.py)."""
    weights, indices, offsets, _, last = args[:5]
    for w, i, o in zip(weights, indices, offsets):
        even_bags(i, o, w.shape[0], o.numel() - int(last))
    return args


register_sample(OP, _sample)
