"""Static checks: a program's post-condition (symbolic execution) and a plan's deadlock freedom."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from .program import INPUT, OUTPUT, Program, Slot, replicate, slot_name

if TYPE_CHECKING:
    from .plan import Plan


class CheckError(AssertionError):
    """The program does not implement its collective; the message names the chunks."""


class DeadlockError(RuntimeError):
    """The plan can deadlock; the message names the cycle or the stuck instructions."""


def _contrib(c: tuple[int, int]) -> str:
    return slot_name(INPUT, *c)


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def symbolic_state(prog: Program) -> dict[Slot, Counter]:
    """Replay the ops over multisets of input contributions (values are sums, so a multiset is exact)."""
    state: dict[Slot, Counter] = {}
    for r in range(prog.num_ranks):
        for i in range(prog.in_chunks):
            state[(INPUT, r, i)] = Counter({(r, i): 1})
    for n, op in enumerate(prog.ops):
        (sb, sr, si), (db, dr, di) = op.src, op.dst
        vals = []
        for k in range(op.size):
            src = (sb, sr, si + k)
            if src not in state:
                raise CheckError(f"op {n} ({op.kind}) reads uninitialized {slot_name(*src)}")
            vals.append(state[src])
        for k in range(op.size):
            dst = (db, dr, di + k)
            if op.kind == "copy":
                state[dst] = Counter(vals[k])
            else:
                if dst not in state:
                    raise CheckError(f"op {n} (reduce) reduces into uninitialized {slot_name(*dst)}")
                state[dst] = state[dst] + vals[k]
    return state


def check_program(prog: Program, instances: int = 1) -> None:
    """Prove every output chunk holds exactly its expected multiset of input contributions."""
    prog = replicate(prog, instances)
    state = symbolic_state(prog)
    errors: list[str] = []
    for r in range(prog.num_ranks):
        for i in range(prog.out_chunks):
            want = prog.collective.expected(r, i)
            if want is None:
                continue
            name = slot_name(OUTPUT, r, i)
            have = state.get((OUTPUT, r, i))
            if have is None:
                errors.append(f"{name} is never written")
                continue
            for c in sorted(set(want) | set(have)):
                h, w = have.get(c, 0), want.get(c, 0)
                if h == w:
                    continue
                if h == 0:
                    errors.append(f"{name} is missing {_contrib(c)}")
                elif w == 0:
                    errors.append(f"{name} has unexpected {_contrib(c)}")
                else:
                    errors.append(f"{name} has {_contrib(c)} {_times(h)} (expected {_times(w)})")
    if errors:
        more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
        raise CheckError(f"{prog.name}: " + "; ".join(errors[:8]) + more)


# ------------------------------------------------------------------------------------------
# Deadlock freedom of a plan
# ------------------------------------------------------------------------------------------

Node = tuple[int, int, int]  # (rank, tb, instruction index)


def _describe(plan: Plan, n: Node) -> str:
    r, t, i = n
    tb = plan.ranks[r].threadblocks[t]
    ins = tb.instrs[i]
    peers = []
    if ins.op in RECEIVES:
        peers.append(f"from {tb.recv_peer}")
    if ins.op in SENDS:
        peers.append(f"to {tb.send_peer}")
    return f"rank {r} tb {t} instr {i} ({ins.op}{' ' + ' '.join(peers) if peers else ''})"


SENDS = frozenset({"send", "rcs", "rrcs", "rrs"})
RECEIVES = frozenset({"recv", "rrc", "rcs", "rrcs", "rrs"})


def match_messages(plan: Plan) -> dict[Node, Node]:
    """Pair the k-th send with the k-th receive of each channel (src, dst, ch); recv -> send.

    Matching by order is only sound when one threadblock per rank sends (and one receives) on a
    channel, so that the FIFO order is the program order; anything else is rejected."""
    senders: dict[tuple[int, int, int], list[Node]] = defaultdict(list)
    receivers: dict[tuple[int, int, int], list[Node]] = defaultdict(list)
    owners: dict[tuple[str, int, int, int], int] = {}
    for rp in plan.ranks:
        for t, tb in enumerate(rp.threadblocks):
            for i, ins in enumerate(tb.instrs):
                if ins.op in SENDS:
                    key = (rp.rank, tb.send_peer, tb.channel)
                    if owners.setdefault(("s", *key), t) != t:
                        raise DeadlockError(
                            f"rank {rp.rank}: threadblocks {owners[('s', *key)]} and {t} both send to "
                            f"{tb.send_peer} on channel {tb.channel}"
                        )
                    senders[key].append((rp.rank, t, i))
                if ins.op in RECEIVES:
                    key = (tb.recv_peer, rp.rank, tb.channel)
                    if owners.setdefault(("r", *key), t) != t:
                        raise DeadlockError(
                            f"rank {rp.rank}: threadblocks {owners[('r', *key)]} and {t} both receive "
                            f"from {tb.recv_peer} on channel {tb.channel}"
                        )
                    receivers[key].append((rp.rank, t, i))
    matches: dict[Node, Node] = {}
    for key in set(senders) | set(receivers):
        s, r = senders.get(key, []), receivers.get(key, [])
        if len(s) != len(r):
            src, dst, ch = key
            raise DeadlockError(
                f"channel {src}->{dst} ch {ch}: {len(s)} send(s) but {len(r)} receive(s); "
                f"the extra {'receives wait' if len(r) > len(s) else 'sends are never received'} forever"
            )
        for a, b in zip(s, r):
            matches[b] = a
    return matches


def check_deadlock(plan: Plan) -> None:
    """Wait-for graph: program order in each threadblock, explicit cross-threadblock deps, and
    recv -> matching send. A cycle is a deadlock (sends are treated as non-blocking)."""
    waits: dict[Node, list[Node]] = defaultdict(list)
    for rp in plan.ranks:
        for t, tb in enumerate(rp.threadblocks):
            for i, ins in enumerate(tb.instrs):
                node = (rp.rank, t, i)
                if i:
                    waits[node].append((rp.rank, t, i - 1))
                for dt, di in ins.deps:
                    waits[node].append((rp.rank, dt, di))
    for recv, send in match_messages(plan).items():
        waits[recv].append(send)
    # Iterative DFS with colours; on a back edge, report the cycle.
    colour: dict[Node, int] = {}
    for start in sorted(waits):
        if colour.get(start):
            continue
        stack: list[tuple[Node, int]] = [(start, 0)]
        path: list[Node] = [start]
        colour[start] = 1
        while stack:
            node, k = stack[-1]
            nxt = waits.get(node, [])
            if k < len(nxt):
                stack[-1] = (node, k + 1)
                m = nxt[k]
                if colour.get(m) == 1:
                    cyc = [*path[path.index(m) :], m]
                    raise DeadlockError(
                        f"{plan.name}: deadlock cycle: " + " waits for ".join(_describe(plan, n) for n in cyc)
                    )
                if not colour.get(m):
                    colour[m] = 1
                    stack.append((m, 0))
                    path.append(m)
            else:
                colour[node] = 2
                stack.pop()
                path.pop()
