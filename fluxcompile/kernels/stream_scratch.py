"""Device scratch of a kernel family per (device, stream): launches on one stream run one after another and share
it, launches on concurrent streams never do. Grown eagerly and then reused; an outgrown buffer is kept, since a
CUDA graph captured over it still reads it. A first use under CUDA graph capture (a capture stream no eager call
ran on, as ``torch.cuda.graph``'s own side stream) takes its buffer from the graph's memory pool, held here so
the pool never hands it out again; the launcher's first call on it (which initializes it) is then in the capture."""

from __future__ import annotations

import torch
from torch import Tensor

from ..symm_mem import persistent


class StreamScratch:
    """``address(device, stream, nbytes)``: at least ``nbytes`` (and ``min_bytes``) of scratch for launches on the
    raw ``stream`` of ``device`` (0 if none is needed). ``label`` names the buffer (``symm_mem.persistent``)."""

    def __init__(self, label: str, min_bytes: int) -> None:
        self.label, self.min_bytes = label, min_bytes
        self._buffers: dict[tuple[int, int], Tensor] = {}
        self._retired: list[Tensor] = []  # outgrown buffers, kept for CUDA graphs captured over them

    def address(self, device: torch.device, stream: int, nbytes: int) -> int:
        if nbytes == 0:
            return 0
        key = (device.index if device.index is not None else torch.cuda.current_device(), stream)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._retired.append(buf)
            size = max(nbytes, self.min_bytes)
            if torch.cuda.is_current_stream_capturing():
                buf = torch.empty(size, dtype=torch.uint8, device=device)  # from the graph's pool, kept alive here
            else:
                buf = persistent(lambda: torch.empty(size, dtype=torch.uint8, device=device), self.label)
            self._buffers[key] = buf
        return buf.data_ptr()
