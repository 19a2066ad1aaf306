"""A c10d process group by its name: the fused ops are given ``group_name`` (a string, as the functional collectives
are), and this is where they turn it into the group (torch's resolver is not public)."""

from __future__ import annotations

import torch.distributed as dist


def process_group(group_name: str) -> dist.ProcessGroup:
    """The live c10d process group named ``group_name`` (raises if there is none)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def group_size(group_name: str) -> int:
    """The number of ranks of the group named ``group_name`` (raises if there is none)."""
    return process_group(group_name).size()
