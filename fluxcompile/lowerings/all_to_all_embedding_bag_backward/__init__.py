"""fluxcompile.all_to_all_embedding_bag_backward: its choices and its CUDA implementation, which asks the
rank-synchronized autotuner for one choice per call signature (identically on every rank) and runs it.

Choices, in registration order:
* ``triton`` (triton.py; family ``dlrm``): the tables' owner reads every bag's gradient row from the rank that
  holds it (symmetric memory, one ready flag per rank and call) and adds it at the bag's indices
  (kernels/embedding_bag_backward.py): no exchanged tensor, no separate all-to-all;
* ``put`` (put.py; family ``dlrm``): every rank puts each owner's chunk of the gradients into the owner's receive
  buffer with NVSHMEM's put-with-signal, then the same scatter reads them locally: the form for groups across
  hosts, and on one host where ``config.exchange_transport`` is ``"put"``;
* ``reference`` (NCCL ``all_to_all_single`` + ``_embedding_bag_backward`` per table, registered by
  lowerings/choices.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..autotune import pick
from ..bag_samples import bag_of_positions, bag_sizes, even_bags
from ..choices import Choice, register_choice, register_sample
from ..direct_calls import cuda_impl
from . import put, triton

OP = "all_to_all_embedding_bag_backward"

if triton.ebb is not None:
    register_choice(OP, Choice(triton.NAME, *triton.make(), family="dlrm"))
    register_choice(OP, Choice(put.NAME, *put.make(), family="dlrm", remote_peers=True))


@cuda_impl(OP, probe=lambda args: args[0])
def all_to_all_embedding_bag_backward_cuda(
    grad: Tensor, indices: Sequence[Tensor], offsets: Sequence[Tensor], offset2bag: Sequence[Tensor],
    bag_size: Sequence[Tensor], max_indices: Sequence[Tensor], num_weights: Sequence[int], scale_grad_by_freq: bool,
    mode: int, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], group_name: str,
    per_sample_weights: Sequence[Tensor] | None = None, weights: Sequence[Tensor] | None = None, sparse: bool = False,
    padding_idx: int = -1, choice: str = "",
) -> list[Tensor]:  # fmt: skip
    """The op's CUDA implementation: the compiled choice, else the autotuner's for this call signature (sparse
    gradients and a padding index tuned apart, passed to the choices as keywords)."""
    args = (
        grad, list(indices), list(offsets), list(offset2bag), list(bag_size), list(max_indices), list(num_weights),
        scale_grad_by_freq, mode, list(output_split_sizes), list(input_split_sizes), group_name,
    )  # fmt: skip
    if per_sample_weights is not None:  # positional: the tuning key sees their shapes
        args = (*args, list(per_sample_weights), None if weights is None else list(weights))
    flags = {"padding_idx": padding_idx} if padding_idx >= 0 else {}
    if sparse:
        flags["sparse"] = True
    return pick(OP, args, group_name, compiled=choice, kwargs=flags).fn(*args, **flags)


def _sample(args: tuple) -> tuple:
    """Compile-time tuning operands: every table's bags of equal length over random rows (bag_samples.py), with
    the bookkeeping that matches them (each position's bag, each bag's size)."""
    grad, indices, offsets, offset2bag, bag_size, _, num_weights = args[:7]
    output_split_sizes = args[9]
    bags = sum(output_split_sizes) if output_split_sizes else grad.shape[0]
    for t, (i, o) in enumerate(zip(indices, offsets)):
        even_bags(i, o, int(num_weights[t]), bags)
        if offset2bag[t].numel() == i.numel():
            offset2bag[t].copy_(bag_of_positions(i.numel(), bags, i.device))
        if bag_size[t].numel() >= bags:
            bag_size[t][:bags].copy_(bag_sizes(i.numel(), bags, i.device))
    return args


register_sample(OP, _sample)
