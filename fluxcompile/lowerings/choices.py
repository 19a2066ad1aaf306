"""The choice registry: every implementation a fused op may run, and which of them the config allows.

A choice's name is ``"<kind>"`` or ``"<kind>:<variant>"`` (``"triton:128x256x64-pull"``); autotuning caches,
reports and compiled choices use it. Its family (``config.IMPLEMENTATIONS``) is what ``config.implementations``
lists and what is switched on or off: the kind unless given (the Triton all-gather's ``"triton:*"`` choices are
family ``"triton_ag"``). ``choices_for(op)`` returns the allowed choices in the order of
``config.implementations`` (registration order within a family), which is both the autotuner's candidate
order (it breaks timing ties) and the preference order when autotuning is off. ``"reference"`` is always
returned, last unless listed earlier, because it runs everywhere and is the fallback when nothing else does.
A choice whose family the config does not enable (left out of ``implementations``, or off by default and not
switched on) declines every call with the reason, which names what enables it (``Config.family_declines``).

A choice may carry its launch variants as data (``Launches``: a kernel family's shipped tuning table): it is
registered once, under its family's name, and a call's candidates are the variants its table gives that call,
each a choice of its own named ``"<name>:<variant>"`` (one where the table has the call's entry, two or three
timed at compile time where it has none). ``choice_named`` finds such a name as it finds a registered one.

A choice must behave alike on every rank: ``supports`` may look only at what is equal on all ranks
(shapes, dtypes, group, config), and ``fn`` must either fail before its first collective or not at all,
since a rank that leaves a collective early makes the others wait in it (see ``autotune.pick``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from .. import ops
from ..config import config, register_family
from ..symm_mem import backend

REFERENCE = "reference"


def _supports_all(*args: Any) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Launches:
    """A choice's launch variants as data. ``for_call(*args)``: the variants to run the call with, the same on every
    rank (a tuning table's entry for its arch, world size, shape bucket and dtype; where the table has none, the
    few candidates the autotuner times); ``make(variant)``: that variant's ``(fn, supports)``, ``ValueError``
    for a name it does not know; ``digest``: the table's content hash (the rewrite pass's uuid covers it)."""

    for_call: Callable[..., Sequence[str]]
    make: Callable[[str], tuple[Callable[..., Any], Callable[..., str | None]]]
    digest: str = ""

    @classmethod
    def timed(
        cls,
        names: Sequence[str],
        make: Callable[[str], tuple[Callable[..., Any], Callable[..., str | None]]],
        salt: str = "",
    ) -> Launches:
        """Launches without a table: every call times those of ``names`` that take it (the first where none
        does, declined by its reason). The digest covers the names and ``salt`` (what else decides which take a
        call, e.g. the tiles' row ranges)."""
        names = list(names)
        for name in names:
            make(name)  # an unknown launch fails at registration, not at a call

        def for_call(*args: Any) -> list[str]:
            return [n for n in names if make(n)[1](*args) is None] or names[:1]

        return cls(for_call, make, hashlib.sha256(f"{','.join(names)}|{salt}".encode()).hexdigest()[:16])


@dataclasses.dataclass(frozen=True)
class Choice:
    """One implementation of a fused op.

    ``fn`` has the fused op's signature and outputs (``ops.py``); ``supports(*args)`` returns None when
    ``fn`` handles these arguments, else the reason it does not. ``symmetric_memory``: ``fn`` reaches the
    peers' memory (every fused choice), so it declines on a group whose ranks are not all reachable by P2P
    (symm_mem/topology.py); the reference (the collective, then the matmuls) does not. ``family``: its
    implementation family ("" = the name's kind, the part before ":"). ``remote_peers``: ``fn`` reaches its peers
    only through NVSHMEM (put-with-signal), never by their P2P addresses, so with the NVSHMEM backend it runs on a
    group that spans hosts too (its ``supports`` says where it does not). ``launches``: its launch variants as
    data (``Launches``); ``fn`` and ``supports`` are then the family's default launch and its check.
    """

    name: str
    fn: Callable[..., Any]
    supports: Callable[..., str | None] = _supports_all
    symmetric_memory: bool = True
    family: str = ""
    remote_peers: bool = False
    launches: Launches | None = None

    def __post_init__(self) -> None:
        kind, _, variant = self.name.partition(":")
        if not kind or self.name != self.name.strip() or (":" in self.name and not variant):
            raise ValueError(f"fluxcompile: bad choice name {self.name!r} (want '<kind>' or '<kind>:<variant>')")
        if not self.family:
            object.__setattr__(self, "family", kind)

    def peers_decline(self, no_peers: str | None) -> str | None:
        """``no_peers`` (why the group's ranks cannot all reach each other by P2P, symm_mem/topology.py) where it
        keeps this choice from running: for every choice that reaches symmetric memory, but one that reaches its
        peers through NVSHMEM alone while the backend is NVSHMEM."""
        if not no_peers or not self.symmetric_memory:
            return None
        if self.remote_peers and backend.wanted() == "NVSHMEM":
            return None
        return no_peers

    def variant(self, name: str) -> Choice:
        """The choice ``<name>:<variant>`` of this choice's launch variant ``name`` (``ValueError``: not one)."""
        if self.launches is None:
            raise ValueError(f"fluxcompile: {self.name} has no launch variants ({name!r} asked for)")
        fn, supports = self.launches.make(name)
        return dataclasses.replace(self, name=f"{self.name}:{name}", fn=fn, supports=supports, launches=None)

    def candidates(self, *args: Any) -> list[Choice]:
        """What the autotuner times for this call in this choice's place: the launch variants its table gives
        the call, or the choice itself (no table, or it declines the call: it is then declined as itself)."""
        if self.launches is None or self.declines(*args) is not None:
            return [self]
        return [self.variant(v) for v in self.launches.for_call(*args)]

    def declines(self, *args: Any) -> str | None:
        """Why this choice does not run these arguments: its family is not enabled (the config's reason), else
        ``supports(*args)``, with an exception turned into a reason (a broken check must not crash)."""
        why = config.family_declines(self.family)
        if why is not None:
            return why
        try:
            return self.supports(*args)
        except Exception as e:
            return f"supports() raised {type(e).__name__}: {e}"


# op name -> choice name -> Choice; dicts keep registration order.
_REGISTRY: dict[str, dict[str, Choice]] = {}


def register_choice(op_name: str, choice: Choice) -> None:
    """Register ``choice`` for ``op_name``; a choice of the same name is replaced in place (reloads)."""
    register_family(choice.family)
    _REGISTRY.setdefault(op_name, {})[choice.name] = choice


def choices_for(op_name: str) -> list[Choice]:
    """The registered choices of ``op_name`` that ``config.implementations`` allows, in its order."""
    order = {family: i for i, family in enumerate(config.implementations)}
    registered = list(_REGISTRY.get(op_name, {}).values())
    allowed = [c for c in registered if c.family in order or c.family == REFERENCE]
    # sorted() is stable, so registration order holds within a family; an unlisted reference goes last.
    return sorted(allowed, key=lambda c: order.get(c.family, len(order)))


def choice_named(op_name: str, name: str, offered: list[Choice] | None = None) -> Choice | None:
    """The choice called ``name`` among ``offered`` (default: ``choices_for(op_name)``): a registered one, or a
    launch variant of one (``"<name>:<variant>"``); None where there is none."""
    by_name = {c.name: c for c in (choices_for(op_name) if offered is None else offered)}
    if name in by_name:
        return by_name[name]
    for base in by_name.values():
        if base.launches is not None and name.startswith(f"{base.name}:"):
            try:
                return base.variant(name[len(base.name) + 1 :])
            except ValueError:
                return None
    return None


def registered_names() -> str:
    """Every registered choice of every op, by name, with the content hash of its launch table (the rewrite pass's
    uuid covers it: a graph compiled against a choice or a launch variant that is gone or renamed is never
    replayed from Inductor's cache)."""
    def named(c: Choice) -> str:
        return f"{c.name}@{c.launches.digest}" if c.launches is not None else c.name

    return ";".join(f"{op}:{','.join(map(named, choices.values()))}" for op, choices in sorted(_REGISTRY.items()))


# op name -> a function that makes a site's materialized operands look like a real call's where zeros would not
# (fx_passes/decide.py tunes on them): the DLRM ops' indices and offsets.
_SAMPLES: dict[str, Callable[[tuple], tuple]] = {}


def register_sample(op_name: str, fn: Callable[[tuple], tuple]) -> None:
    """``fn(args) -> args``: the op's compile-time tuning operands made realistic (in place or new)."""
    _SAMPLES[op_name] = fn


def sample(op_name: str, args: tuple) -> tuple:
    """``args`` through the op's registered sample function (unchanged where it has none)."""
    fn = _SAMPLES.get(op_name)
    return fn(args) if fn is not None else args


# The ops whose matmuls may be scaled (fp8, ops.py "Scaled matmuls").
SCALABLE_OPS: tuple[str, ...] = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce_rmsnorm")


def scaled(op_name: str) -> str:
    """The registry key of ``op_name``'s scaled calls: their choices (and the autotuner's tables for them) are
    apart from the op's plain ones, and take the op's scaling arguments positionally after the others, in the op's
    schema order (``all_gather_matmul``: ``A_scale, B_scales, out_dtype, use_fast_accum``; the producer ops:
    ``A_scales, B_scales, out_dtype, use_fast_accum``), its flags (``return_A``) by keyword."""
    if op_name not in SCALABLE_OPS:
        raise ValueError(f"fluxcompile: {op_name} has no scaled matmuls")
    return f"{op_name}.scaled"


# The reference implementation of every fused op (ops.py) is its "reference" choice, for plain and scaled calls.
for _op in ops.FUSED_OPS:
    register_choice(_op, Choice(REFERENCE, ops.REFERENCES[_op], symmetric_memory=False))
for _op in SCALABLE_OPS:
    register_choice(scaled(_op), Choice(REFERENCE, ops.REFERENCES[_op], symmetric_memory=False))
