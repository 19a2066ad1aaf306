"""all_to_all_matmul (MoE dispatch) and matmul_all_to_all (MoE combine) with torch's NVSHMEM all-to-all
(``torch.ops.symm_mem.all_to_all_vdev``) as the exchange: choice ``vdev`` of both ops.

The exchange runs on symmetric tensors of NVSHMEM's heap: the rows are copied into this group's input buffer,
torch's kernel puts every destination's rows into its output buffer (NVSHMEM's put, over NVLink on one host and
the network across hosts; the split sizes travel with them on the device), and the received rows are copied out
into the op's output. The matmuls are the reference's (``ops.dispatch_matmuls``, ``ops.combine_matmuls``: cuBLAS,
``torch._grouped_mm``), before the exchange in the combine and after it in the dispatch. Nothing is overlapped: the
choice is the exchange that reaches peers on other hosts, a candidate beside NCCL's for the autotuner where the
backend is NVSHMEM.

Buffers, per (group, device, dtype, row width): input and output of ``world x rows`` rows each (``rows``: the
dispatch's input rows or the combine's output rows, the tokens' copies a rank holds: what any rank may send or
receive at most when every rank holds as many), the input split sizes (int64 ``[world]``) and the received splits
and offsets (int64 ``[2, world]``), all symmetric. NVSHMEM's allocation is collective and must be of one size on
every rank: a buffer is made (or grown) on the first call that needs it, where the ranks first agree on the largest
``rows`` among them (an all-gather on the group), so every rank must make that call (the same op in the same order,
as for every collective; warm up with the largest batch before capturing a graph).

Waits: torch's kernel waits for its peers without a bound. Eager calls are watched (symm_mem/watchdog.py): a call
pending past ``config.watchdog_timeout_s`` ends the process with a report naming the rank and the op.

Family ``moe`` (experimental, as the other MoE choices); with ``remote_peers``: it runs on a group that spans hosts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ... import ops
from ...symm_mem import backend, capturing, group_size, process_group
from ...symm_mem.watchdog import Watch, watch
from ..device_tables import device_table

NAME = "vdev"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unavailable() -> str | None:
    """Why torch's NVSHMEM all-to-all cannot run here (None: it can)."""
    if backend.wanted() != "NVSHMEM":
        return "all_to_all_vdev needs symm_mem_backend 'nvshmem'"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return "this torch has no symm_mem.all_to_all_vdev"
    return None


@dataclasses.dataclass
class Buffers:
    """One group's symmetric buffers of the exchange (see the module)."""

    inp: Tensor
    out: Tensor
    in_splits: Tensor
    out_splits_offsets: Tensor
    rows: int  # per rank: the buffers hold world x rows rows
    watch: Watch | None


_buffers: dict[tuple, Buffers] = {}


def buffers(group_name: str, device: torch.device, dtype: torch.dtype, cols: int, rows: int) -> Buffers:
    """The group's buffers for rows of ``cols`` elements of ``dtype``, holding ``world x rows`` rows at least (made
    or grown collectively: every rank of the group calls this at the same point)."""
    key = (group_name, device, dtype, cols)
    b = _buffers.get(key)
    if b is not None and b.rows >= rows:
        return b
    if capturing(device):
        raise RuntimeError(f"fluxcompile: {NAME}: run the op once eagerly (with the largest batch) before capture")
    from torch.distributed import _symmetric_memory as symm

    group = process_group(group_name)
    world = group.size()
    wanted: list[int] = [0] * world
    dist.all_gather_object(wanted, rows, group=group)  # one size on every rank (NVSHMEM allocates collectively)
    rows = max(wanted)
    cap = world * rows
    itemsize = torch.empty((), dtype=dtype).element_size()
    backend.apply(device, 2 * cap * cols * itemsize + 24 * world)
    made = Buffers(
        symm.empty(cap, cols, dtype=dtype, device=device),
        symm.empty(cap, cols, dtype=dtype, device=device),
        symm.empty(world, dtype=torch.int64, device=device),
        symm.empty(2, world, dtype=torch.int64, device=device),
        rows,
        b.watch if b is not None else watch(
            f"{NAME} exchange ({group_name})", dist.get_rank(group),
            lambda: "torch's all_to_all_vdev (NVSHMEM) has not returned: a peer never joined the exchange "
            "(is every rank running the same op in the same order?)",
        ),
    )  # fmt: skip
    for t in (made.inp, made.out, made.in_splits, made.out_splits_offsets):
        symm.rendezvous(t, group_name)
    _buffers[key] = made
    return made


def exchange(
    x: Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], group_name: str, rows: int
) -> Tensor:  # fmt: skip
    """``all_to_all_single(x, output_split_sizes, input_split_sizes)`` along dim 0 by torch's NVSHMEM kernel, into
    a fresh tensor; ``rows``: this rank's buffer size basis (see the module)."""
    world = group_size(group_name)
    n0 = x.shape[0]
    if not output_split_sizes or not input_split_sizes:  # equal splits, as the reference
        output_split_sizes = output_split_sizes or [n0 // world] * world
        input_split_sizes = input_split_sizes or [n0 // world] * world
    received = sum(output_split_sizes)
    per_entry = math.prod(x.shape[1:])
    b = buffers(group_name, x.device, x.dtype, per_entry, rows)
    if n0 > b.inp.shape[0] or received > b.out.shape[0]:
        raise ValueError(
            f"fluxcompile: {NAME}: {n0} rows to send and {received} to receive, more than the {b.inp.shape[0]} of "
            f"the group's buffers (world x the largest batch at their making): warm up with the largest batch"
        )
    b.inp[:n0].copy_(x.reshape(n0, per_entry))
    b.in_splits.copy_(device_table(tuple(int(s) for s in input_split_sizes), x.device))
    torch.ops.symm_mem.all_to_all_vdev(b.inp, b.out, b.in_splits, b.out_splits_offsets, group_name)
    out = b.out[:received].reshape(received, *x.shape[1:]).clone()
    if b.watch is not None and not capturing(x.device):
        b.watch.note()
    return out


def _supports_rows(x: Tensor, group_name: str) -> str | None:
    why = unavailable()
    if why is not None:
        return why
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}"
    if x.device.type != "cuda":
        return "not on a CUDA device"
    try:
        world = group_size(group_name)
    except Exception as e:
        return f"no process group {group_name!r} ({type(e).__name__})"
    return "one rank (nothing to exchange)" if world == 1 else None


def make_dispatch() -> tuple[Callable[..., tuple], Callable[..., str | None]]:
    """(fn, supports) of all_to_all_matmul's choice ``vdev``."""

    def supports(A, Bs, biases, output_split_sizes, input_split_sizes, group_name, A_scale=None, B_scales=None,
                 out_dtype=None, use_fast_accum=False, offs=None, row_index=None) -> str | None:  # fmt: skip
        if A_scale is not None or B_scales is not None:
            return "scaled matmuls (the vdev exchange moves the rows, not their scales)"
        return _supports_rows(A, group_name)

    def run(A, Bs, biases, output_split_sizes, input_split_sizes, group_name, A_scale=None, B_scales=None,
            out_dtype=None, use_fast_accum=False, offs=None, row_index=None, return_A=True):  # fmt: skip
        A_exchanged = exchange(A, output_split_sizes, input_split_sizes, group_name, A.shape[0])
        products = ops.dispatch_matmuls(A_exchanged, Bs, biases, None, None, out_dtype, use_fast_accum, offs, row_index)
        return A_exchanged if return_A else None, products

    return run, supports


def make_combine() -> tuple[Callable[..., Tensor], Callable[..., str | None]]:
    """(fn, supports) of matmul_all_to_all's choice ``vdev``."""

    def supports(As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name, A_scales=None,
                 B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None,
                 accumulate=False) -> str | None:  # fmt: skip
        if A_scales is not None or B_scales is not None:
            return "scaled matmuls (the vdev exchange moves the rows, not their scales)"
        return _supports_rows(As[0], group_name)

    def run(As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name, A_scales=None, B_scales=None,
            out_dtype=None, use_fast_accum=False, offs=None, row_index=None, accumulate=False):  # fmt: skip
        P = ops.combine_matmuls(As, Bs, bias, out_shape, None, None, out_dtype, use_fast_accum, offs, row_index,
                                accumulate)  # fmt: skip
        # the rows this rank ends with (its tokens): what its buffers are sized by, alike on every rank
        return exchange(P, output_split_sizes, input_split_sizes, group_name, sum(output_split_sizes) or P.shape[0])

    return run, supports
