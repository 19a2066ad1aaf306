"""The compiled, executable form (GC3-EF, section 4.1): plain dataclasses, JSON round-trippable."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Instr:
    """One instruction of a threadblock.

    ops: send, recv, copy (dst := src), reduce (dst := dst + src), rrc (dst := dst + received),
    rcs (dst := received; send it), rrcs (dst := src + received; send it), rrs (send src + received,
    store nothing). Peers and channel are the threadblock's. ``deps`` are (threadblock, instr index)
    pairs on the same rank that must have finished first (cross-threadblock memory dependencies).
    """

    op: str
    src_buf: str | None = None
    src_index: int = 0
    dst_buf: str | None = None
    dst_index: int = 0
    count: int = 1
    deps: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Threadblock:
    send_peer: int | None
    recv_peer: int | None
    channel: int
    instrs: list[Instr] = field(default_factory=list)


@dataclass
class RankPlan:
    rank: int
    threadblocks: list[Threadblock] = field(default_factory=list)


@dataclass
class Plan:
    name: str
    collective: str
    num_ranks: int
    in_chunks: int
    out_chunks: int
    scratch_chunks: list[int]
    instances: int
    ranks: list[RankPlan]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        ranks = [
            RankPlan(
                rp["rank"],
                [
                    Threadblock(
                        tb["send_peer"],
                        tb["recv_peer"],
                        tb["channel"],
                        [Instr(**{**i, "deps": [tuple(x) for x in i["deps"]]}) for i in tb["instrs"]],
                    )
                    for tb in rp["threadblocks"]
                ],
            )
            for rp in d.pop("ranks")
        ]
        return cls(**d, ranks=ranks)

    def num_instructions(self) -> int:
        return sum(len(tb.instrs) for rp in self.ranks for tb in rp.threadblocks)

    def op_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rp in self.ranks:
            for tb in rp.threadblocks:
                for i in tb.instrs:
                    out[i.op] = out.get(i.op, 0) + 1
        return out
