"""Small read-only device tables (pointer tables, split prefixes) that the DLRM protocols hand their kernels,
cached by value: :func:`device_table`."""

from __future__ import annotations

import collections

import torch
from torch import Tensor

from ..symm_mem import capturing, persistent

try:
    from ..kernels import embedding_bag as eb
except ImportError:  # no Triton: tables on the CPU only
    eb = None

_MAX_TABLES = 1024
_tables: collections.OrderedDict[tuple, Tensor] = collections.OrderedDict()
_captured: set[tuple] = set()  # used while capturing a graph: never evicted


def device_table(values: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """A device tensor holding ``values``, cached by value and stream (read-only: callers never write it), written
    by a small kernel whose arguments carry the values: no pinned staging, whose allocation would synchronize the
    device (and so wait for a peer's kernel that waits for this rank's rows), and safe while capturing a graph."""
    # Per stream: a table is written on the stream that first needs it, and only that stream's later work is
    # ordered after the write (ranks simulated on one GPU share a device and their tables' values).
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, dtype, values)
    in_capture = capturing(device)
    t = _tables.get(key)
    if t is None:
        if device.type != "cuda":
            t = torch.tensor(values, dtype=dtype, device=device)
        else:
            # Made during a capture, a table lives in the graph's pool; made eagerly, outside any pool this thread
            # is routed to (the CUDA graph trees' warm-up).
            if in_capture:
                t = torch.empty(len(values), dtype=dtype, device=device)
            else:
                t = persistent(lambda: torch.empty(len(values), dtype=dtype, device=device), "a device table")
            eb.fill(t, values)
        _tables[key] = t
        if len(_tables) > _MAX_TABLES:
            for old in list(_tables):
                if len(_tables) <= _MAX_TABLES:
                    break
                if old not in _captured and old != key:
                    del _tables[old]
    else:
        _tables.move_to_end(key)
    if in_capture:
        _captured.add(key)
    return t
