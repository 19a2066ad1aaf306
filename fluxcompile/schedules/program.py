"""The chunk-oriented schedule language (GC3, section 3).

A program routes *chunks* between buffer slots ``(buffer, rank, index)``. Running the Python that
builds a program only records operations (``Op``); the checker replays them symbolically and the
compiler lowers them to per-rank instructions. Nothing here touches tensors.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

INPUT, OUTPUT, SCRATCH = "input", "output", "scratch"
BUFFERS = (INPUT, OUTPUT, SCRATCH)
HINT_KEYS = frozenset({"sendtb", "recvtb", "ch"})

# A contribution is an input chunk (src_rank, src_index); a slot's value is a multiset of them.
Contribution = tuple[int, int]
Slot = tuple[str, int, int]


def slot_name(buffer: str, rank: int, index: int) -> str:
    return f"{buffer}[{rank}][{index}]"


class Collective:
    """A collective's interface: chunk counts and post-condition.

    ``chunk_factor`` c lets a program split each logical block into c chunks (and instances
    multiply it), so that the post-condition is stated for any chunk granularity.
    """

    name = "custom"

    def __init__(self, num_ranks: int, chunk_factor: int = 1) -> None:
        self.num_ranks = num_ranks
        self.chunk_factor = chunk_factor

    def in_chunks(self) -> int:
        raise NotImplementedError

    def out_chunks(self) -> int:
        raise NotImplementedError

    def expected(self, rank: int, index: int) -> Counter | None:
        """Multiset of contributions output[rank][index] must hold; None = unconstrained."""
        raise NotImplementedError

    def scaled(self, factor: int) -> Collective:
        return type(self)(self.num_ranks, self.chunk_factor * factor)


class AllGather(Collective):
    name = "all_gather"

    def in_chunks(self) -> int:
        return self.chunk_factor

    def out_chunks(self) -> int:
        return self.chunk_factor * self.num_ranks

    def expected(self, rank: int, index: int) -> Counter:
        return Counter({(index // self.chunk_factor, index % self.chunk_factor): 1})


class ReduceScatter(Collective):
    name = "reduce_scatter"

    def in_chunks(self) -> int:
        return self.chunk_factor * self.num_ranks

    def out_chunks(self) -> int:
        return self.chunk_factor

    def expected(self, rank: int, index: int) -> Counter:
        return Counter({(q, rank * self.chunk_factor + index): 1 for q in range(self.num_ranks)})


class AllReduce(Collective):
    name = "all_reduce"

    def in_chunks(self) -> int:
        return self.chunk_factor

    def out_chunks(self) -> int:
        return self.chunk_factor

    def expected(self, rank: int, index: int) -> Counter:
        return Counter({(q, index): 1 for q in range(self.num_ranks)})


class AllToAll(Collective):
    name = "all_to_all"

    def in_chunks(self) -> int:
        return self.chunk_factor * self.num_ranks

    def out_chunks(self) -> int:
        return self.chunk_factor * self.num_ranks

    def expected(self, rank: int, index: int) -> Counter:
        c = self.chunk_factor
        q, j = divmod(index, c)
        return Counter({(q, rank * c + j): 1})


class AllToNext(Collective):
    """Rank r's output is rank r-1's input; rank 0's output is unconstrained (GC3 section 6.4)."""

    name = "all_to_next"

    def in_chunks(self) -> int:
        return self.chunk_factor

    def out_chunks(self) -> int:
        return self.chunk_factor

    def expected(self, rank: int, index: int) -> Counter | None:
        return None if rank == 0 else Counter({(rank - 1, index): 1})


COLLECTIVES: dict[str, type[Collective]] = {
    c.name: c for c in (AllGather, ReduceScatter, AllReduce, AllToAll, AllToNext)
}


@dataclass(frozen=True)
class Op:
    """One traced chunk operation. ``copy``: dst := src; ``reduce``: dst := dst + src (size chunks)."""

    kind: str
    src: Slot
    dst: Slot
    size: int
    hints: dict[str, int] = field(default_factory=dict, compare=False)
    instance: int = 0  # which replica (GC3 5.3.2); the default channel of its messages


class ProgramError(ValueError):
    """An invalid program: out-of-range slot, reused stale reference, bad hint."""


_current = threading.local()


def current_program() -> Program:
    prog = getattr(_current, "program", None)
    if prog is None:
        raise ProgramError("chunk() used outside a `with Program(...)` block")
    return prog


class Program:
    """Context in which ``chunk(...)`` references are made and operations are recorded."""

    def __init__(
        self,
        name: str,
        collective: str | Collective,
        num_ranks: int,
        chunk_factor: int = 1,
        *,
        in_chunks: int | None = None,
        out_chunks: int | None = None,
    ) -> None:
        """``collective`` is a name in ``COLLECTIVES`` or a ``Collective``. The buffers are cut into
        the collective's chunks times ``chunk_factor``; alternatively give ``in_chunks`` (and/or
        ``out_chunks``), which must be a multiple of the collective's own count."""
        if isinstance(collective, str):
            if collective not in COLLECTIVES:
                raise ProgramError(f"unknown collective {collective!r}; known: {sorted(COLLECTIVES)}")
            base = COLLECTIVES[collective](num_ranks)
            for want, have in ((in_chunks, base.in_chunks()), (out_chunks, base.out_chunks())):
                if want is not None:
                    if want % have:
                        raise ProgramError(
                            f"{collective} on {num_ranks} ranks needs a multiple of {have} chunks, not {want}"
                        )
                    chunk_factor = want // have
            collective = COLLECTIVES[collective](num_ranks, chunk_factor)
        for want, have, what in (
            (in_chunks, collective.in_chunks(), "in"),
            (out_chunks, collective.out_chunks(), "out"),
        ):
            if want is not None and want != have:
                raise ProgramError(f"{collective.name}: {what}_chunks={want} disagrees with {have}")
        self.name = name
        self.collective = collective
        self.num_ranks = num_ranks
        self.in_chunks = collective.in_chunks()
        self.out_chunks = collective.out_chunks()
        self.ops: list[Op] = []
        # Scratch is unbounded (GC3 3.1): its size per rank is whatever the program touches.
        self.scratch_chunks = [0] * num_ranks
        # Version per slot so a reference to an overwritten chunk is caught (GC3 "Validity").
        self._version: dict[Slot, int] = {}
        self._prev: Program | None = None

    def __enter__(self) -> Program:
        self._prev = getattr(_current, "program", None)
        _current.program = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.program = self._prev

    # -- internals used by ChunkRef -------------------------------------------------------
    def _check_slot(self, buffer: str, rank: int, index: int, size: int) -> None:
        if buffer not in BUFFERS:
            raise ProgramError(f"unknown buffer {buffer!r} (expected one of {BUFFERS})")
        if not 0 <= rank < self.num_ranks:
            raise ProgramError(f"rank {rank} out of range for {self.num_ranks} ranks")
        limit = {INPUT: self.in_chunks, OUTPUT: self.out_chunks, SCRATCH: None}[buffer]
        if index < 0 or size < 1 or (limit is not None and index + size > limit):
            raise ProgramError(f"{slot_name(buffer, rank, index)} size {size} out of range ({buffer} has {limit})")
        if buffer == SCRATCH:
            self.scratch_chunks[rank] = max(self.scratch_chunks[rank], index + size)

    def _versions(self, buffer: str, rank: int, index: int, size: int) -> tuple[int, ...]:
        return tuple(self._version.get((buffer, rank, index + k), 0) for k in range(size))

    def _record(self, op: Op) -> None:
        self.ops.append(op)
        b, r, i = op.dst
        for k in range(op.size):
            self._version[(b, r, i + k)] = self._version.get((b, r, i + k), 0) + 1


def _check_hints(hints: dict[str, int]) -> dict[str, int]:
    bad = set(hints) - HINT_KEYS
    if bad:
        raise ProgramError(f"unknown hint(s) {sorted(bad)}; allowed: {sorted(HINT_KEYS)}")
    return dict(hints)


class ChunkRef:
    """A reference to ``size`` contiguous chunks at (buffer, rank, index)."""

    def __init__(self, prog: Program, buffer: str, rank: int, index: int, size: int) -> None:
        prog._check_slot(buffer, rank, index, size)
        self.prog, self.buffer, self.rank, self.index, self.size = prog, buffer, rank, index, size
        self._versions = prog._versions(buffer, rank, index, size)

    def __repr__(self) -> str:
        return f"chunk({self.buffer!r}, rank={self.rank}, index={self.index}, size={self.size})"

    @property
    def slot(self) -> Slot:
        return (self.buffer, self.rank, self.index)

    def _check_fresh(self) -> None:
        if self.prog._versions(self.buffer, self.rank, self.index, self.size) != self._versions:
            raise ProgramError(f"{self!r} was overwritten after this reference was made")

    def copy(self, dst_rank: int, buffer: str, index: int, **hints: int) -> ChunkRef:
        """Copy these chunks to (buffer, dst_rank, index); returns a reference to the copy."""
        self._check_fresh()
        dst = ChunkRef(self.prog, buffer, dst_rank, index, self.size)
        if dst.slot == self.slot:
            raise ProgramError(f"{self!r} copied onto itself")
        self.prog._record(Op("copy", self.slot, dst.slot, self.size, _check_hints(hints)))
        return ChunkRef(self.prog, buffer, dst_rank, index, self.size)

    def reduce(self, other: ChunkRef, **hints: int) -> ChunkRef:
        """Reduce ``other`` into this chunk's slot (this := this + other); returns the new ref."""
        self._check_fresh()
        other._check_fresh()
        if other.size != self.size:
            raise ProgramError(f"reduce of {other!r} into {self!r}: sizes differ")
        if other.slot == self.slot:
            raise ProgramError(f"{self!r} reduced with itself")
        self.prog._record(Op("reduce", other.slot, self.slot, self.size, _check_hints(hints)))
        return ChunkRef(self.prog, self.buffer, self.rank, self.index, self.size)


def chunk(buffer: str, rank: int, index: int, size: int = 1) -> ChunkRef:
    """Reference to chunk(s) of the current program (GC3 Table 1)."""
    return ChunkRef(current_program(), buffer, rank, index, size)


def replicate(prog: Program, instances: int) -> Program:
    """GC3 5.3.2: every chunk i becomes chunks i*r..i*r+r-1; an op over [i, i+s) becomes r ops over
    the r contiguous pieces of [i*r, (i+s)*r), instance j on piece j. Hints are spread so that each
    instance gets its own channel/threadblocks (tb*r + j, ch*r + j). Dependencies are recomputed
    later from the new ops, as the paper requires."""
    if instances == 1:
        return prog
    r = instances
    new = Program(prog.name, prog.collective.scaled(r), prog.num_ranks)
    new.scratch_chunks = [s * r for s in prog.scratch_chunks]
    for op in prog.ops:
        for j in range(r):
            hints = {k: v * r + j for k, v in op.hints.items()}
            (sb, sr, si), (db, dr, di) = op.src, op.dst
            new.ops.append(
                Op(op.kind, (sb, sr, si * r + j * op.size), (db, dr, di * r + j * op.size), op.size, hints, j)
            )
    return new
