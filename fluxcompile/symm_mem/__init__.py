"""Symmetric-memory workspaces: buffers every rank of a group can read and write, plus their signals."""

from .signals import FlagArray, init_flags, ready_done_flags, stream_consume, stream_wait, stream_write
from .workspace import Workspace, side_stream, workspace

__all__ = [
    "FlagArray",
    "Workspace",
    "init_flags",
    "ready_done_flags",
    "side_stream",
    "stream_consume",
    "stream_wait",
    "stream_write",
    "workspace",
]
