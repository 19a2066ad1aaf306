"""A rank's communication context in a group (``Comm``): what every fused op's protocol takes from its group, so
that the protocol itself is plain code over it.

A context holds this rank's symmetric data and flag workspaces (a ``Workspace`` reaches its peers' buffers too and
knows the rank and the group's size), the device's side stream for communication, the error words of its kernels'
bounded waits, the watch that bounds its stream waits from the host (watchdog.py), the peer address tables made
from its workspaces, how its flags are set on every rank before any peer writes into them (``init_flags``), the
SMs its persistent kernels may take and its group's name. A protocol uses the parts it needs; the others are None.

:func:`comm_for` makes the context of a (group, device, tag) on its first call and keeps it: the registered choices
take theirs from there, every call. The same protocol code runs on a context made elsewhere: ranks simulated on one
GPU (fluxcompile/testing/one_gpu_ranks.py) or CPU stand-ins under Triton's interpreter (the tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .errors import Check, ErrorWords
from .local_handle import init_local_flags, local_workspace
from .persistent import capturing, persistent
from .signals import FlagArray
from .signals import init_flags as symm_init_flags
from .watchdog import Watch, watch
from .workspace import Workspace, current_stream, side_stream, workspace


@dataclasses.dataclass(frozen=True)
class ErrorSpec:
    """How a context's error words are made: ``words`` int32 words (the kernel family's layout), ``owner`` names
    the kernels in the errors. One set per (device, tag), which the device's groups share, or with ``per_group``
    one per (group, device, tag)."""

    words: int
    owner: str
    per_group: bool = False


@dataclasses.dataclass(kw_only=True, eq=False)
class Comm:
    """One rank's communication context in a group (see the module). ``data`` and ``flags``: symmetric workspaces
    (this rank's buffer and its peers', through ``view``/``handle.buffer_ptrs``); ``init_flags(flags, value)`` sets
    a flag array on every rank before any peer writes into it (symm_mem.init_flags between processes);
    ``sm_count``: the persistent kernels' SMs (0: all); ``max_spin``: the bound of its kernels' waits where it is
    given (None: the config's). Compared by identity, so a protocol keys state of its own by its context."""

    data: Workspace | None = None
    flags: Workspace | None = None
    side: torch.cuda.Stream | None = None
    errors: ErrorWords | None = None
    group_name: str = ""
    sm_count: int = 0
    init_flags: Callable[[FlagArray, int], None] = symm_init_flags
    watch: Watch | None = None
    max_spin: int | None = None
    tables: dict = dataclasses.field(default_factory=dict)  # device tables made once per buffer (addresses())
    plans: dict = dataclasses.field(default_factory=dict)  # a protocol's per-signature plans (plan())

    @property
    def rank(self) -> int:
        return (self.flags if self.flags is not None else self.data).rank

    @property
    def world(self) -> int:
        return (self.flags if self.flags is not None else self.data).world_size

    def note(self, stream: torch.cuda.Stream) -> None:
        """After an eager call, for the watchdog (its stream waits on peers' flags without a bound; captured calls
        are not watched: replays do not come back)."""
        if self.watch is not None and not torch.cuda.is_current_stream_capturing():
            self.watch.note(stream)

    def plan(self, key: tuple, make: Callable[[], Any]) -> Any:
        """A protocol's plan for a call signature ``key`` (views into the workspaces, flag addresses): ``make()`` on
        the key's first call, kept while this context keeps its workspaces (a grown one is a new workspace, and the
        plan is made again)."""
        held = self.plans.get(key)
        if held is not None and held[0] is self.data and held[1] is self.flags:
            return held[2]
        value = make()
        self.plans[key] = (self.data, self.flags, value)
        return value

    def sequence_reporting(self) -> tuple[Tensor | None, list[int]]:
        """What a C++ sequence takes to report its eager call itself: the error words' pinned host copy, which it
        writes after its kernels, and the events it records at the call's end (not under capture): the error words'
        and the watchdog's. ``(None, [])`` where the words are not on CUDA (the CPU simulations):
        :meth:`after_sequence` then reports in Python."""
        if not self.errors.err.is_cuda:
            return None, []
        events = [self.errors.sequence_event()]
        if self.watch is not None:
            events.append(self.watch.sequence_event())
        return self.errors.host, events

    def after_sequence(self, what: str, check: Check) -> None:
        """After a C++ sequence's call given :meth:`sequence_reporting`: what :meth:`ErrorWords.report` and
        :meth:`note` do after a call, but the copy and the events, which the sequence made itself on CUDA."""
        if not self.errors.err.is_cuda:
            self.errors.report(what, check)
            if self.watch is not None:
                self.note(current_stream())
            return
        self.errors.issued(what, check)
        if self.watch is not None:
            self.watch.noted()

    def addresses(self, ws: Workspace) -> Tensor:
        """Every rank's buffer of ``ws`` as int64 addresses seen from here, on ``ws``'s device (made once per
        buffer, eagerly and outside any CUDA graph pool: a host-to-device copy cannot be captured)."""
        key = (id(ws.handle), ws.buffer.data_ptr())
        table = self.tables.get(key)
        if table is None:
            if capturing(ws.buffer.device):
                raise RuntimeError(
                    f"fluxcompile: a workspace of group {self.group_name!r} changed during CUDA graph capture "
                    "(run the op eagerly with its largest shapes first)"
                )
            table = self.tables[key] = persistent(ws.addresses, "a peer address table")
        return table


_comms: dict[tuple[str, int, str], Comm] = {}  # (group, device, tag)
_errors: dict[tuple[str | None, int, str], ErrorWords] = {}  # (group or None: shared, device, tag)
_watches: dict[tuple[str, int, str], Watch | None] = {}  # (group, device, tag)


def _fits(ws: Workspace | None, nbytes: int) -> bool:
    return nbytes <= 0 or (ws is not None and ws.nbytes >= nbytes)


def comm_for(
    group_name: str,
    tag: str,
    *,
    world: int | None = None,
    data_bytes: int = 0,
    flag_bytes: int = 0,
    flags_tag: str | None = None,
    errors: ErrorSpec | None = None,
    describe: Callable[[Comm], str] | None = None,
    what: str | None = None,
    local_alone: bool = False,
) -> Comm:
    """This rank's context in the group ``group_name`` for the protocol ``tag``, made on the first call of the
    (group, current device, tag) and kept. Each call asks for a data workspace of at least ``data_bytes`` (tag
    ``tag``) and a flag workspace of at least ``flag_bytes`` (tag ``flags_tag``, default ``<tag>.flags``); 0: none.
    Making or growing one is a collective (every rank makes the same call), never during CUDA graph capture; the
    context then holds the grown one. ``world``: the group size the caller was given, checked against the group's
    (None: not checked). ``errors``: the error words to make with the context (:class:`ErrorSpec`). ``describe``:
    the watchdog's report of the context's flags, for a watch made with it (``what`` names the call site in the
    report, default ``<tag> (<group>)``). ``local_alone``: a group of one rank (``world`` 1) takes plain
    allocations (symm_mem.local_handle) instead of symmetric memory."""
    device = torch.cuda.current_device()
    key = (group_name, device, tag)
    comm = _comms.get(key)
    if comm is not None and _fits(comm.data, data_bytes) and _fits(comm.flags, flag_bytes):
        if world is not None and world != comm.world:
            raise ValueError(f"fluxcompile: group_size={world} but group {group_name} has {comm.world} ranks")
        return comm
    local = local_alone and world == 1

    def get(nbytes: int, ws_tag: str) -> Workspace:
        if local:
            return local_workspace(group_name, nbytes, ws_tag)
        return workspace(group_name, nbytes, tag=ws_tag, world=world)

    data = get(data_bytes, tag) if data_bytes > 0 else None
    flags = get(flag_bytes, flags_tag or f"{tag}.flags") if flag_bytes > 0 else None
    if comm is not None:  # a workspace grew: the context holds the grown one (address tables are kept per buffer)
        comm.data = data if data is not None else comm.data
        comm.flags = flags if flags is not None else comm.flags
        return comm
    comm = Comm(
        data=data,
        flags=flags,
        side=side_stream(),
        group_name=group_name,
        init_flags=init_local_flags if local else symm_init_flags,
    )
    if errors is not None:
        ekey = (group_name if errors.per_group else None, device, tag)
        if ekey not in _errors:
            _errors[ekey] = ErrorWords.make(torch.device("cuda", device), errors.words, errors.owner)
        comm.errors = _errors[ekey]
    if describe is not None:
        if key not in _watches:
            _watches[key] = watch(what or f"{tag} ({group_name})", comm.rank, lambda: describe(comm))
        comm.watch = _watches[key]
    _comms[key] = comm
    return comm


def cached_comm(group_name: str, tag: str) -> Comm | None:
    """The context :func:`comm_for` made for (group, current device, tag), if it has (tests read its error
    words)."""
    return _comms.get((group_name, torch.cuda.current_device(), tag))
