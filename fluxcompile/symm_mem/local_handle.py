"""A symmetric-memory handle whose ranks' buffers all lie in this process: the stand-in for torch's
``_SymmetricMemory`` handle where no symmetric memory is made.

A protocol reaches its peers only through a handle's ``buffer_ptrs`` (every rank's buffer address, as seen here),
``world_size`` and ``get_buffer(rank, shape, dtype, offset_elems)`` (a view of a rank's buffer); ``Workspace.view``,
``FlagArray`` and the exchange work unchanged over a :class:`LocalHandle`, which gives the three over plain
buffers of this process:

* a group of one rank: its buffer is a plain allocation, with no symmetric memory and no collective
  (:func:`local_workspace`);
* ranks simulated on one GPU: rank r's buffer is the r-th slice of one allocation
  (fluxcompile/testing/one_gpu_ranks.py);
* a loopback: a one-rank group's buffer seen as two ranks, the second rank's pointer a few bytes past ours so that
  its flags alias ours (benchmarks/host_cost.py ``--loopback``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .persistent import persistent
from .signals import FlagArray
from .workspace import Workspace


class LocalHandle:
    """``buffers[r]``: rank r's byte buffer (uint8); ``ptrs[r]``: its address in ``buffer_ptrs`` (default: the
    buffer's own)."""

    def __init__(self, buffers: Sequence[Tensor], ptrs: Sequence[int] | None = None):
        self.buffers = list(buffers)
        self.world_size = len(self.buffers)
        self.buffer_ptrs = [int(p) for p in ptrs] if ptrs is not None else [b.data_ptr() for b in self.buffers]

    def get_buffer(self, rank: int, shape: Sequence[int], dtype: torch.dtype, offset_elems: int = 0) -> Tensor:
        """``rank``'s buffer from ``offset_elems`` elements of ``dtype`` on, as a contiguous ``shape``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        start = offset_elems * itemsize
        end = start + math.prod(shape) * itemsize
        if not 0 <= rank < self.world_size or end > self.buffers[rank].numel():
            have = self.buffers[rank].numel() if 0 <= rank < self.world_size else 0
            raise ValueError(f"fluxcompile: rank {rank}'s local buffer has {have} bytes, a view asks up to {end}")
        return self.buffers[rank][start:end].view(dtype).view(list(shape))


_local: dict[tuple[str, int, str], Workspace] = {}
_retired: list[Tensor] = []  # outgrown local buffers, kept alive for graphs captured over them


def local_workspace(group_name: str, nbytes: int, tag: str) -> Workspace:
    """The workspace of a group of one rank: a plain allocation (zeroed) that grows like ``workspace``'s, keyed
    by (group, current device, tag), made outside any CUDA graph pool and never during capture."""
    key = (group_name, torch.cuda.current_device(), tag)
    ws = _local.get(key)
    if ws is None or ws.nbytes < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fluxcompile: the one-rank workspace '{tag}' cannot grow during CUDA graph capture")
        if ws is not None:
            _retired.append(ws.buffer)
        size = max(nbytes, 2 * ws.nbytes if ws is not None else 0, 1 << 20)
        buf = persistent(lambda: torch.zeros(size, dtype=torch.uint8, device="cuda"), f"the workspace '{tag}'")
        ws = _local[key] = Workspace(group_name, buf, LocalHandle([buf]), 0, 1)
    return ws


def init_local_flags(flags: FlagArray, value: int) -> None:
    """``init_flags`` of a group of one rank: its flags set, no peer to wait for."""
    flags.local().fill_(value)
