"""Symmetric-memory workspaces: buffers every rank of a group can read and write, plus their signals; a rank's
communication context in a group (comm.py), which every fused op's protocol takes its workspaces, side stream,
error words and watch from; and the fused ops' other persistent buffers, made outside any CUDA graph memory pool,
and the error words of their kernels' bounded waits."""

from .comm import Comm, ErrorSpec, comm_for
from .errors import ErrorWords
from .groups import group_size, process_group
from .local_handle import LocalHandle
from .persistent import capturing, host_barrier, persistent
from .signals import FlagArray, init_flags, ready_done_flags, stream_consume, stream_wait, stream_write
from .workspace import Workspace, side_stream, workspace

__all__ = [
    "Comm",
    "ErrorSpec",
    "ErrorWords",
    "FlagArray",
    "LocalHandle",
    "Workspace",
    "capturing",
    "comm_for",
    "group_size",
    "host_barrier",
    "init_flags",
    "persistent",
    "process_group",
    "ready_done_flags",
    "side_stream",
    "stream_consume",
    "stream_wait",
    "stream_write",
    "workspace",
]
