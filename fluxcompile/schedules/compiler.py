"""Compile a traced program to a ``Plan`` (GC3 section 5).

Steps: replicate into instances (5.3.2) -> lower each op to per-rank instructions with same-rank
memory dependencies and send->recv communication edges (5.2) -> peephole fusion into rcs / rrcs /
rrs (5.3.1) -> one global topological order -> threadblock/channel assignment by appending in that
order (deadlock-free by construction: every threadblock's sequence follows one global order, and
one threadblock per rank owns each (peer, channel) direction, so FIFO order equals that order).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .checker import check_program
from .plan import Instr, Plan, RankPlan, Threadblock
from .program import OUTPUT, Program, ProgramError, replicate

Loc = tuple[str, int]  # (buffer, index) on the instruction's own rank


@dataclass
class _Ins:
    id: int
    rank: int
    op: str
    src: Loc | None
    dst: Loc | None
    count: int
    send_peer: int | None = None
    recv_peer: int | None = None
    ch: int = 0
    send_tb: int | None = None  # manual threadblock of the sending part (GC3 5.4)
    recv_tb: int | None = None  # manual threadblock of the receiving / local part
    deps: set[int] = field(default_factory=set)  # same-rank instructions that must finish first
    comm_in: int | None = None  # the send whose message this instruction receives
    comm_out: int | None = None  # the instruction receiving what this one sends
    removed: bool = False


class _Lowering:
    def __init__(self) -> None:
        self.ins: list[_Ins] = []
        self.last_writer: dict[tuple[int, str, int], int] = {}
        self.readers: dict[tuple[int, str, int], list[int]] = defaultdict(list)

    def add(self, ins: _Ins, reads: list[Loc], writes: list[Loc]) -> _Ins:
        ins.id = len(self.ins)
        self.ins.append(ins)
        r, n = ins.rank, ins.count
        rd = [(r, b, i + k) for b, i in reads for k in range(n)]
        wr = [(r, b, i + k) for b, i in writes for k in range(n)]
        for s in rd:  # read after write
            if s in self.last_writer:
                ins.deps.add(self.last_writer[s])
        for s in wr:  # a write waits for the readers of the old value (they waited for its writer)
            rs = [x for x in self.readers.get(s, []) if x != ins.id]
            if rs:
                ins.deps.update(rs)
            elif s in self.last_writer:
                ins.deps.add(self.last_writer[s])
        for s in rd:
            self.readers[s].append(ins.id)
        for s in wr:
            self.last_writer[s] = ins.id
            self.readers[s] = []
        ins.deps.discard(ins.id)
        return ins


def lower(prog: Program) -> list[_Ins]:
    low = _Lowering()
    for op in prog.ops:
        (sb, sr, si), (db, dr, di) = op.src, op.dst
        h = op.hints
        ch = h.get("ch", op.instance)
        if sr == dr:
            tb = h.get("sendtb", h.get("recvtb"))
            if op.kind == "copy":
                low.add(_Ins(0, sr, "copy", (sb, si), (db, di), op.size, recv_tb=tb), [(sb, si)], [(db, di)])
            else:
                low.add(
                    _Ins(0, sr, "reduce", (sb, si), (db, di), op.size, recv_tb=tb), [(sb, si), (db, di)], [(db, di)]
                )
            continue
        snd = low.add(
            _Ins(0, sr, "send", (sb, si), None, op.size, send_peer=dr, ch=ch, send_tb=h.get("sendtb")), [(sb, si)], []
        )
        if op.kind == "copy":
            rcv = low.add(
                _Ins(0, dr, "recv", None, (db, di), op.size, recv_peer=sr, ch=ch, recv_tb=h.get("recvtb")),
                [],
                [(db, di)],
            )
        else:
            rcv = low.add(
                _Ins(0, dr, "rrc", (db, di), (db, di), op.size, recv_peer=sr, ch=ch, recv_tb=h.get("recvtb")),
                [(db, di)],
                [(db, di)],
            )
        snd.comm_out, rcv.comm_in = rcv.id, snd.id
    return low.ins


def fuse(ins: list[_Ins], can_pair: Callable[[int, int, int, int], bool]) -> None:
    """GC3 5.3.1 peephole passes. A recv/rrc whose only dependent is a send of the same chunk becomes
    rcs/rrcs; an rrcs whose stored result nobody reads and that is not output becomes rrs.
    ``can_pair(rank, send_peer, recv_peer, ch)`` reserves one threadblock for both directions, so
    fusion never asks for a threadblock that the connection rules cannot give."""
    dependents: dict[int, set[int]] = defaultdict(set)
    for i in ins:
        for d in i.deps:
            dependents[d].add(i.id)
    for r in ins:
        if r.removed or r.op not in ("recv", "rrc") or len(dependents[r.id]) != 1:
            continue
        s = ins[next(iter(dependents[r.id]))]
        if s.op != "send" or s.src != r.dst or s.count != r.count or s.ch != r.ch or s.send_peer == r.recv_peer:
            continue
        # The fused instruction takes r's place in program order. That keeps program order a valid
        # schedule, with every channel's messages in FIFO order, only if s waits for nothing issued
        # after r and no other send to the same peer/channel is issued between them.
        if any(d != r.id and d > r.id for d in s.deps) or any(
            ins[k].rank == r.rank and ins[k].send_peer == s.send_peer and ins[k].ch == s.ch and not ins[k].removed
            for k in range(r.id + 1, s.id)
        ):
            continue
        if r.recv_tb is not None or s.send_tb is not None:
            if r.recv_tb != s.send_tb:
                continue
        elif not can_pair(r.rank, s.send_peer, r.recv_peer, r.ch):
            continue
        r.op = "rcs" if r.op == "recv" else "rrcs"
        if r.op == "rcs":
            r.src = r.dst
        r.send_peer, r.send_tb, r.comm_out = s.send_peer, s.send_tb, s.comm_out
        ins[s.comm_out].comm_in = r.id
        r.deps |= s.deps - {r.id}
        for d in dependents.pop(s.id, set()):
            ins[d].deps.discard(s.id)
            ins[d].deps.add(r.id)
            dependents[r.id].add(d)
        dependents[r.id].discard(s.id)
        s.removed = True
        if r.op == "rrcs" and not dependents[r.id] and r.dst[0] != OUTPUT:
            r.op, r.dst = "rrs", None  # nobody reads the partial sum here: skip the local store


def topo_order(ins: list[_Ins]) -> list[_Ins]:
    """Global topological order, lower dependency depth first, then longer remaining path (5.2)."""
    live = [i for i in ins if not i.removed]
    preds: dict[int, list[int]] = {i.id: sorted(i.deps) + ([i.comm_in] if i.comm_in is not None else []) for i in live}
    # Messages of one channel (src, dst, ch) are matched in FIFO order, so its sends and its
    # receives are chained in program order (fusion keeps program order a valid schedule).
    last: dict[tuple[str, int, int, int], int] = {}
    for i in live:
        keys = []
        if i.comm_out is not None:
            keys.append(("s", i.rank, i.send_peer, i.ch))
        if i.comm_in is not None:
            keys.append(("r", ins[i.comm_in].rank, i.rank, i.ch))
        for k in keys:
            if k in last:
                preds[i.id].append(last[k])
            last[k] = i.id
    succs: dict[int, list[int]] = defaultdict(list)
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    indeg = {n: len(ps) for n, ps in preds.items()}
    order: list[int] = []
    ready = [n for n, k in indeg.items() if k == 0]
    # Depths need an order first: compute them on a plain Kahn pass.
    depth: dict[int, int] = {}
    queue, deg = list(ready), dict(indeg)
    while queue:
        n = queue.pop()
        depth[n] = max((depth[p] + 1 for p in preds[n]), default=0)
        order.append(n)
        for m in succs[n]:
            deg[m] -= 1
            if deg[m] == 0:
                queue.append(m)
    if len(order) != len(live):
        raise ProgramError("instruction graph has a cycle (internal error)")
    rdepth: dict[int, int] = {}
    for n in reversed(order):
        rdepth[n] = max((rdepth[m] + 1 for m in succs[n]), default=0)

    heap = [(depth[n], -rdepth[n], n) for n in ready]
    heapq.heapify(heap)
    out: list[_Ins] = []
    while heap:
        _, _, n = heapq.heappop(heap)
        out.append(ins[n])
        for m in succs[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                heapq.heappush(heap, (depth[m], -rdepth[m], m))
    return out


class _Tbs:
    """Threadblocks of all ranks and which (peer, channel) direction each owns."""

    def __init__(self, num_ranks: int) -> None:
        self.tbs: list[list[Threadblock]] = [[] for _ in range(num_ranks)]
        self.send_bind: dict[tuple[int, int, int], int] = {}
        self.recv_bind: dict[tuple[int, int, int], int] = {}
        self.last: dict[tuple[int, int], int] = {}

    def new(self, rank: int, ch: int) -> int:
        self.tbs[rank].append(Threadblock(None, None, ch))
        return len(self.tbs[rank]) - 1

    def bind(self, rank: int, t: int, send: int | None, recv: int | None, ch: int) -> None:
        tb = self.tbs[rank][t]
        if tb.send_peer is None and tb.recv_peer is None and (send is not None or recv is not None):
            tb.channel = ch  # a threadblock's channel is that of its first connection
        if send is not None:
            if tb.send_peer not in (None, send) or self.send_bind.setdefault((rank, send, ch), t) != t:
                raise ProgramError(f"rank {rank} tb {t}: cannot also send to {send} on channel {ch}")
            tb.send_peer = send
        if recv is not None:
            if tb.recv_peer not in (None, recv) or self.recv_bind.setdefault((rank, recv, ch), t) != t:
                raise ProgramError(f"rank {rank} tb {t}: cannot also receive from {recv} on channel {ch}")
            tb.recv_peer = recv
        if (send is not None or recv is not None) and tb.channel != ch:
            raise ProgramError(f"rank {rank} tb {t} is on channel {tb.channel}, not {ch}")

    def can_pair(self, rank: int, send: int, recv: int, ch: int) -> bool:
        a, b = self.send_bind.get((rank, send, ch)), self.recv_bind.get((rank, recv, ch))
        if a is None and b is None:
            self.bind(rank, self.new(rank, ch), send, recv, ch)
            return True
        return a == b

    def pick(self, rank: int, send: int | None, recv: int | None, ch: int) -> int:
        """Threadblock for an auto-assigned instruction: the owner of its direction if any, else the
        least recently used compatible one (GC3 5.2 step 5), else a new one."""
        owner = None
        if send is not None:
            owner = self.send_bind.get((rank, send, ch))
        if recv is not None and owner is None:
            owner = self.recv_bind.get((rank, recv, ch))
        if owner is None:
            cands = [
                t
                for t, tb in enumerate(self.tbs[rank])
                if (send is None and recv is None)
                or (
                    tb.channel == ch
                    and (send is None or tb.send_peer is None)
                    and (recv is None or tb.recv_peer is None)
                )
            ]
            owner = min(cands, key=lambda t: self.last.get((rank, t), -1)) if cands else self.new(rank, ch)
        self.bind(rank, owner, send, recv, ch)
        return owner


def compile_program(prog: Program, instances: int = 1, fuse_instructions: bool = True, check: bool = True) -> Plan:
    """Check (optional), replicate, lower, fuse, order and assign; returns the ``Plan``."""
    if check:
        check_program(prog, instances)
    p = replicate(prog, instances)
    ins = lower(p)
    manual = any(i.send_tb is not None or i.recv_tb is not None for i in ins)
    if manual and any(
        (i.send_peer is not None and i.send_tb is None) or (i.recv_tb is None and i.op != "send") for i in ins
    ):
        raise ProgramError("manual threadblocks (sendtb/recvtb) must be given on every operation (GC3 5.4)")
    tbs = _Tbs(p.num_ranks)
    if fuse_instructions:
        fuse(ins, tbs.can_pair)
    order = topo_order(ins)
    pos: dict[int, tuple[int, int]] = {}
    for n, i in enumerate(order):
        if manual:
            t = i.recv_tb if i.op != "send" else i.send_tb
            while len(tbs.tbs[i.rank]) <= t:
                tbs.new(i.rank, i.ch)
            tbs.bind(i.rank, t, i.send_peer, i.recv_peer, i.ch)
        else:
            t = tbs.pick(i.rank, i.send_peer, i.recv_peer, i.ch)
        tb = tbs.tbs[i.rank][t]
        pos[i.id] = (t, len(tb.instrs))
        tbs.last[(i.rank, t)] = n
        tb.instrs.append(
            Instr(
                i.op,
                i.src[0] if i.src else None,
                i.src[1] if i.src else 0,
                i.dst[0] if i.dst else None,
                i.dst[1] if i.dst else 0,
                i.count,
            )
        )
    # Cross-threadblock dependencies: same-threadblock ones hold by program order; per other
    # threadblock only the latest one matters.
    for i in order:
        t, k = pos[i.id]
        latest: dict[int, int] = {}
        for d in i.deps:
            dt, dk = pos[d]
            if dt != t:
                latest[dt] = max(latest.get(dt, -1), dk)
        tbs.tbs[i.rank][t].instrs[k].deps = sorted(latest.items())
    return Plan(
        name=p.name,
        collective=p.collective.name,
        num_ranks=p.num_ranks,
        in_chunks=p.in_chunks,
        out_chunks=p.out_chunks,
        scratch_chunks=list(p.scratch_chunks),
        instances=instances,
        ranks=[RankPlan(r, tbs.tbs[r]) for r in range(p.num_ranks)],
    )
