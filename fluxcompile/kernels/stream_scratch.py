"""Device scratch of a kernel family per (device, stream): launches on one stream run one after another and share
it, launches on concurrent streams never do. Grown eagerly and then reused; an outgrown buffer is kept, since a
CUDA graph captured over it still reads it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..symm_mem import persistent


class StreamScratch:
    """``address(device, stream, nbytes)``: at least ``nbytes`` (and ``min_bytes``) of scratch for launches on the
    raw ``stream`` of ``device`` (0 if none is needed). ``owner`` names the kernel in the error of a first use
    under CUDA graph capture, ``label`` the buffer (``symm_mem.persistent``)."""

    def __init__(self, owner: str, label: str, min_bytes: int) -> None:
        self.owner, self.label, self.min_bytes = owner, label, min_bytes
        self._buffers: dict[tuple[int, int], Tensor] = {}
        self._retired: list[Tensor] = []  # outgrown buffers, kept for CUDA graphs captured over them

    def address(self, device: torch.device, stream: int, nbytes: int) -> int:
        if nbytes == 0:
            return 0
        key = (device.index if device.index is not None else torch.cuda.current_device(), stream)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"fluxcompile: run {self.owner} once eagerly before CUDA graph capture")
            if buf is not None:
                self._retired.append(buf)
            size = max(nbytes, self.min_bytes)
            buf = self._buffers[key] = persistent(
                lambda: torch.empty(size, dtype=torch.uint8, device=device), self.label
            )
        return buf.data_ptr()
