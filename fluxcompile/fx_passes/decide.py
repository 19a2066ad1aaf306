"""Which implementation a matched site gets, decided while Inductor compiles the graph.

A site the pass matched is either rewritten into its fused op or left as it is: the collective and matmuls of
the original graph, which Inductor then compiles exactly as it compiles them without fluxcompile (the
*decomposition*). The choice is the rank-synchronized autotuner's (lowerings/autotune.py), run here on real
tensors shaped like the site's operands, with the decomposition timed in place of the fused op's reference as
Inductor's generated code issues it (lowerings/decomposition.py: the raw functional collective and its wait, the
cuBLAS matmuls, none of the reference's Python), so the fused choices are held to what the original ops cost,
device and host. Whatever it picks is agreed on every rank of the site's group before any cache
lookup, cached on disk, and kept in the process's memo, so the fused op's first call finds it without tuning.

* The decomposition wins (or no fused choice supports the site, or none is registered for the op on this
  device, or the group's ranks are not all reachable by P2P, which every fused choice's symmetric memory needs:
  symm_mem/topology.py): the original ops stay, and the report says why. Such a site costs what plain Inductor's
  code costs.
* A fused choice wins: the site is rewritten, and the winner's name is written into the fused op's ``choice``
  argument (lowerings/compiled.py), so the compiled code runs it with no lookup, collective or tuning, also when
  Inductor replays the graph from its cache.
* A symbolic row count (one symbol, e.g. vLLM's or ``dynamic=True``'s batch dimension), for the ops whose row
  count is equal on every rank: range-based dispatch. The site is tuned at the row counts of
  ``config.dispatch_rows`` that its symbol's range reaches; a call then runs the choice tuned at the nearest of
  them (on a log scale), a table written into ``choice``. If the decomposition wins at every one, the original
  ops stay.
* Other symbolic sizes (several symbols, symbolic weights, the all-to-all ops' per-rank splits): the site is
  rewritten with an empty ``choice``, and the fused op's runtime autotuner chooses per call signature.

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

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node

from ..config import Config
from ..ops import FP8_DTYPES
from ..symm_mem.groups import process_group
from ..symm_mem.store_gather import gather_strings
from ..symm_mem.topology import no_peer_access
from .graph_utils import val


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the compile-time choice decided for a matched site."""

    keep: str | None = None  # why the original ops stay; None: rewrite the site
    choice: str = ""  # the fused op's ``choice`` argument (lowerings/compiled.py); "": chosen at run time
    note: str = ""  # for the report: how it was chosen

    def kwargs(self) -> dict[str, str]:
        """The fused op's keyword arguments that carry the decision."""
        return {"choice": self.choice} if self.choice else {}


def decide(
    op_name: str,
    args: Sequence[Any],
    group_name: str,
    cfg: Config,
    kwargs: dict[str, Any] | None = None,
    scaling: dict[str, Any] | None = None,
) -> Decision:
    """The decision for a site to be rewritten into ``op_name(*args, **kwargs)`` (Nodes or fake tensors in place of
    tensors; ``kwargs``: the op's flags that its choices take, e.g. all_gather_matmul's ``return_A``). ``scaling``:
    the op's scaling arguments of a site of fp8 matmuls (ops.py, "Scaled matmuls"), by name in the op's order: the
    choices of the op's scaled calls (``lowerings.choices.scaled``) decide it, called with them after ``args``."""
    if scaling:
        from ..lowerings.choices import scaled

        op_name, args = scaled(op_name), (*args, *scaling.values())
    if cfg.choose_at_compile == "never":
        return Decision(note="chosen at run time (choose_at_compile=never)")
    fakes = _tensors(args)
    if not fakes:
        return Decision()
    device = fakes[0].device
    if cfg.choose_at_compile == "cuda" and device.type != "cuda":
        return Decision()
    from ..lowerings import REFERENCE, choices_for, compiled

    if all(c.name == REFERENCE for c in choices_for(op_name)):
        return Decision(f"no fused implementation of {op_name} is allowed here: the collective and matmuls stay as they are")
    if (why := no_peer_access(group_name, cfg.choose_timeout_s)) and all(
        c.peers_decline(why) for c in choices_for(op_name) if c.name != REFERENCE
    ):
        return Decision(f"no symmetric-memory choice of {op_name}: {why}; the collective and matmuls stay as they are")
    symbols = _free_symbols(args)
    if not symbols:
        _meet(group_name, f"{op_name}{[tuple(t.shape) for t in fakes]}", cfg.choose_timeout_s)
        name = _pick(op_name, args, group_name, device, {}, kwargs)
        if name == REFERENCE:
            return Decision(
                f"autotuned at compile time: the unfused collective + matmul beat {op_name}'s supported choices, "
                "if any (FLUXCOMPILE_LOG=info prints the table)"
            )
        return Decision(choice=name, note=f"chose {name} at compile time")
    if len(symbols) > 1 or op_name not in compiled.ROWS:
        why = "several symbolic sizes" if len(symbols) > 1 else "row counts that differ between ranks"
        return Decision(note=f"chosen at run time per call signature ({why})")
    (symbol,) = symbols
    points = _dispatch_points(op_name, args, symbol, cfg.dispatch_rows)
    _meet(group_name, f"{op_name}{[tuple(map(str, t.shape)) for t in fakes]}@{[v for v, _ in points]}", cfg.choose_timeout_s)
    names = [_pick(op_name, args, group_name, device, {symbol: v}, kwargs) for v, _ in points]
    rows = [r for _, r in points]
    tuned = ", ".join(f"{r}: {n}" for r, n in zip(rows, names))
    if all(n == REFERENCE for n in names):
        return Decision(
            f"autotuned at compile time at rows {rows}: the unfused collective + matmul won at every one ({tuned})"
        )
    bounds = [0] + [math.isqrt(a * b) + 1 for a, b in itertools.pairwise(rows)]  # log-scale midpoints
    spec = compiled.encode(list(zip(bounds, names)))
    return Decision(choice=spec, note=f"range-based dispatch on {symbol} (rows {tuned}): {spec}")


def _pick(
    op_name: str, args: Sequence[Any], group_name: str, device: torch.device, subs: dict, kwargs: dict[str, Any] | None
) -> str:
    """The autotuner's choice for the site's arguments made real (sizes substituted by ``subs``), called with
    ``kwargs`` as the fused op's implementation will call its choices."""
    from ..lowerings import pick
    from ..lowerings.choices import sample

    return _on_fresh_thread(
        lambda: pick(
            op_name, sample(op_name, tuple(_materialize(args, subs))), group_name, kwargs=kwargs, decomposed=True
        ).name,
        device,
    )


def _dispatch_points(
    op_name: str, args: Sequence[Any], symbol: sympy.Symbol, dispatch_rows: Sequence[int]
) -> list[tuple[int, int]]:
    """``[(symbol value, row count)]`` to tune at: for each of ``dispatch_rows``, the symbol's value in its
    range whose row count is nearest; ascending, without repeats."""
    from ..lowerings import compiled

    rows_of = compiled.ROWS[op_name]

    def rows_at(v: int) -> int:
        return rows_of(tuple(_materialize(args, {symbol: v}, device="meta")))

    lo, hi = _symbol_range(args, symbol)
    r1, r2 = rows_at(lo), rows_at(lo + 1)
    step = max(r2 - r1, 1)  # rows grow linearly with the symbol
    points: list[tuple[int, int]] = []
    for target in dispatch_rows:
        v = min(max(lo + round((target - r1) / step), lo), hi)
        r = rows_at(v)
        if not points or r > points[-1][1]:
            points.append((v, r))
    return points


def _symbol_range(args: Sequence[Any], symbol: sympy.Symbol) -> tuple[int, int]:
    """The symbol's value range as the shape environment knows it (at least 1; capped where unbounded)."""
    for t in _tensors(args):
        for s in t.shape:
            if isinstance(s, torch.SymInt) and symbol in s.node.expr.free_symbols:
                vr = s.node.shape_env.var_to_range.get(symbol)
                if vr is None:
                    break
                lo = max(int(vr.lower), 1) if vr.lower.is_Integer else 1
                hi = int(vr.upper) if vr.upper.is_Integer else 1 << 30
                return lo, max(hi, lo)
    return 1, 1 << 30


def _meet(group_name: str, site: str, timeout_s: float) -> None:
    """Wait until every rank of the group has reached its ``n``-th compile-time choice in this group, and check it
    is the same site everywhere; raise on a timeout or a mismatch (no collective has run yet)."""
    group = process_group(group_name)
    rank = group.rank()
    if group.size() == 1:
        return
    n, sites = gather_strings(
        group,
        "choose",
        site,
        timeout_s,
        lambda n: f"the compile-time choice of site {n} of group {group_name} ({site})",
        "a rank that replays this graph from Inductor's cache skips it. Give the ranks the same Inductor cache "
        "state, or set FLUXCOMPILE_CHOOSE_AT_COMPILE=never",
    )
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


def _free_symbols(args: Any) -> set[sympy.Symbol]:
    """The symbols that the site's sizes, strides and integer arguments depend on."""
    out: set[sympy.Symbol] = set()
    for a in args:
        if isinstance(a, (list, tuple)):
            out |= _free_symbols(a)
            continue
        t = val(a) if isinstance(a, Node) else a
        values = (*t.shape, *t.stride()) if isinstance(t, torch.Tensor) else (t,)
        for v in values:
            if isinstance(v, (torch.SymInt, torch.SymFloat)):
                out |= v.node.expr.free_symbols
    return out


def _concrete(v: Any, subs: dict) -> int:
    return int(v.node.expr.subs(subs)) if isinstance(v, torch.SymInt) else int(v)


def _materialize(a: Any, subs: dict, device: str | None = None) -> Any:
    """``a`` with every Node or fake tensor replaced by a real tensor of its shape, strides, dtype and device
    (or ``device``), filled with random values (floats) or zeros, and every symbolic size replaced by its value
    under ``subs``."""
    if isinstance(a, (list, tuple)):
        return type(a)(_materialize(x, subs, device) for x in a)
    t = val(a) if isinstance(a, Node) else a
    if isinstance(t, (int, torch.SymInt)) and not isinstance(t, bool):
        return _concrete(t, subs)
    if not isinstance(t, torch.Tensor):
        return a
    size = [_concrete(s, subs) for s in t.shape]
    stride = [_concrete(s, subs) for s in t.stride()]
    storage = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if math.prod(size) else 0
    base = torch.empty(storage, dtype=t.dtype, device=device or t.device)
    if base.device.type == "meta":
        return base.as_strided(size, stride)
    if t.dtype in FP8_DTYPES:  # no random fill for fp8: normal values rounded to it
        base.copy_(torch.randn(storage, device=base.device))
    elif t.dtype.is_floating_point:
        base.normal_()
    else:
        base.zero_()
    return base.as_strided(size, stride)
