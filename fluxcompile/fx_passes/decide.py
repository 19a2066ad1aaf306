"""Which implementation a matched site gets, decided while Inductor compiles the graph.

A site the pass matched is either rewritten into its fused op or left as it is: the collective and matmuls of
the original graph, which Inductor then compiles exactly as it compiles them without fluxcompile (the
*decomposition*). The choice is the rank-synchronized autotuner's (lowerings/autotune.py), run here on real
tensors shaped like the site's operands, with the decomposition timed as the fused op's reference (the same
collective and cuBLAS matmuls). Whatever it picks is agreed on every rank of the site's group before any cache
lookup, cached on disk, and kept in the process's memo, so the fused op's first call finds it without tuning.

* The decomposition wins (or no fused choice supports the site, or none is registered for the op on this
  device): the original ops stay, and the report says why. Such a site costs what plain Inductor's code costs.
* A fused choice wins: the site is rewritten and the fused op runs that choice.
* Symbolic sizes: the site is rewritten and the fused op's runtime autotuner chooses per call signature (the
  compiled code serves many sizes, which cannot be benchmarked here).

``config.choose_at_compile`` says where this runs: ``"cuda"`` (default) for sites on CUDA tensors, ``"always"``,
or ``"never"`` (every matched site is rewritten and chosen at run time). On CPU the fused ops run their
reference, so rewriting them keeps every rewrite testable there.

Every rank of a group compiles the same graphs in the same order, as for any collective, so every rank reaches
each site's agreement; sites of other groups (pipeline stages, expert groups) agree within their own group.
Before any collective, the ranks of the group meet on the process group's store (bounded by
``config.choose_timeout_s``): a rank that never arrives, because Inductor replayed this graph from its cache
there, or that arrives at another site, ends this rank's compile with an error that says so, instead of a
collective that would hang or mix with the other rank's own.
"""

from __future__ import annotations

import datetime
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node

from ..config import Config
from .graph_utils import static_int, val


def keep_reason(op_name: str, args: Sequence[Any], group_name: str, cfg: Config) -> str | None:
    """None when the site is to be rewritten into ``op_name``; else why its original ops stay.

    ``args`` are the fused op's arguments with Nodes (or fake tensors) in place of tensors."""
    if cfg.choose_at_compile == "never":
        return None
    fakes = _tensors(args)
    if not fakes:
        return None
    device = fakes[0].device
    if cfg.choose_at_compile == "cuda" and device.type != "cuda":
        return None
    if not all(_static(t) for t in fakes) or not all(_static_value(a) for a in args):
        return None  # symbolic sizes: the runtime autotuner decides per call signature
    from ..lowerings import REFERENCE, choices_for, pick

    if all(c.name == REFERENCE for c in choices_for(op_name)):
        return f"no fused implementation of {op_name} is allowed here: the collective and matmuls stay as they are"
    _meet(group_name, f"{op_name}{[tuple(t.shape) for t in fakes]}", cfg.choose_timeout_s)
    choice = _on_fresh_thread(lambda: pick(op_name, tuple(_materialize(args)), group_name), device)
    if choice.name == REFERENCE:
        return (
            f"autotuned at compile time: the unfused collective + matmul beat {op_name}'s supported choices, if "
            "any (FLUXCOMPILE_LOG=info prints the table)"
        )
    return None


_meetings: dict[str, int] = {}  # group name -> sites this process has met on


def _meet(group_name: str, site: str, timeout_s: float) -> None:
    """Wait until every rank of the group has reached its ``n``-th compile-time choice in this group, and check it
    is the same site everywhere; raise on a timeout or a mismatch (no collective has run yet)."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    rank, world = group.rank(), group.size()
    if world == 1:
        return
    n = _meetings[group_name] = _meetings.get(group_name, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    keys = [f"fluxcompile/choose/{group_name}/{n}/{r}" for r in range(world)]
    store.set(keys[rank], site)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise RuntimeError(
            f"fluxcompile: rank {rank}: the compile-time choice of site {n} of group {group_name} ({site}) waited "
            f"{timeout_s:g} s for the group's other ranks ({type(e).__name__}): a rank that replays this graph "
            "from Inductor's cache skips it. Give the ranks the same Inductor cache state, or set "
            "FLUXCOMPILE_CHOOSE_AT_COMPILE=never"
        ) from None
    sites = [store.get(k).decode() for k in keys]
    if any(other != site for other in sites):
        raise RuntimeError(
            f"fluxcompile: rank {rank}: the ranks of group {group_name} compile different sites at their "
            f"compile-time choice {n}: {sites}"
        )


def _on_fresh_thread(fn: Callable[[], Any], device: torch.device) -> Any:
    """``fn()`` on a thread of its own, outside the compiling thread's dispatch state: a functional collective
    awaited on the compiling thread never completes. The thread starts on ``device`` with no fake mode."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            with unset_fake_temporarily(), torch.no_grad():
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                result["value"] = fn()
        except BaseException as e:  # re-raised on the compiling thread
            result["error"] = e

    thread = threading.Thread(target=run, name="fluxcompile-choose")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _tensors(args: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_tensors(a))
        else:
            t = val(a) if isinstance(a, Node) else a
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _static(t: torch.Tensor) -> bool:
    return all(static_int(s) is not None for s in (*t.shape, *t.stride()))


def _static_value(a: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return all(_static_value(x) for x in a)
    return not isinstance(a, (torch.SymInt, torch.SymFloat))


def _materialize(a: Any) -> Any:
    """``a`` with every Node or fake tensor replaced by a real tensor of its shape, strides, dtype and device,
    filled with random values (floats) or zeros."""
    if isinstance(a, (list, tuple)):
        return type(a)(_materialize(x) for x in a)
    t = val(a) if isinstance(a, Node) else a
    if not isinstance(t, torch.Tensor):
        return a
    size = [static_int(s) for s in t.shape]
    stride = [static_int(s) for s in t.stride()]
    storage = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if math.prod(size) else 0
    base = torch.empty(storage, dtype=t.dtype, device=t.device)
    if t.dtype.is_floating_point:
        base.normal_()
    else:
        base.zero_()
    return base.as_strided(size, stride)
