"""Symmetric-memory workspaces: buffers every rank of a group can read and write, plus their signals; and the
fused ops' other persistent buffers, made outside any CUDA graph memory pool, and the error words of their kernels'
bounded waits."""

from .errors import ErrorWords
from .persistent import capturing, host_barrier, persistent
from .signals import FlagArray, init_flags, ready_done_flags, stream_consume, stream_wait, stream_write
from .workspace import Workspace, side_stream, workspace

__all__ = [
    "ErrorWords",
    "FlagArray",
    "Workspace",
    "capturing",
    "host_barrier",
    "init_flags",
    "persistent",
    "ready_done_flags",
    "side_stream",
    "stream_consume",
    "stream_wait",
    "stream_write",
    "workspace",
]
