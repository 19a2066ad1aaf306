"""A NumPy model of plan_exec.py for CPU tests: the same tables, slices, mailboxes, flags, epochs
and acks, with every program of every rank a generator that yields wherever the kernel would wait or
between blocks of its data loop. A seeded random scheduler interleaves them, and ranks run successive
calls without waiting for each other, so a missing wait (say, the ack that keeps a sender from
overwriting a mailbox slot its peer still reads) shows up as a wrong result or a stuck program."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np

from .encoding import ACC_DST, SEND, STORE_DST, USE_RECV, USE_SRC, EncodedPlan

ACK = 64  # ack flags first, then message flags (as in the kernel)


class Stuck(RuntimeError):
    """No program can make progress (the kernel would time out)."""


class Emulator:
    """All ranks of one process group; successive :meth:`run` calls share epochs, flags and mailboxes."""

    def __init__(self, world: int, mailbox_elems: int, flag_words: int = 1 << 14, done_words: int = 1 << 14):
        self.world = world
        self.epoch = [0] * world
        self.flags = [np.zeros(flag_words, dtype=np.int64) for _ in range(world)]
        self.done = [np.zeros(done_words, dtype=np.int64) for _ in range(world)]
        self.mbox = [np.full(mailbox_elems, np.nan) for _ in range(world)]

    def run(
        self,
        enc: EncodedPlan,
        calls: Sequence[Sequence[np.ndarray]],
        slices: int = 1,
        block: int = 3,
        seed: int = 0,
        wait_ack: bool = True,
    ) -> list[list[np.ndarray]]:
        """``calls[c][r]``: rank r's flat input of call c. Returns each call's outputs per rank.
        ``wait_ack=False`` drops the ack wait (tests show that it is needed)."""
        R = self.world
        assert enc.num_ranks == R
        n = calls[0][0].size
        chunk = n // enc.in_chunks
        slice_elems = -(-chunk // slices)
        outs = [[np.full(enc.out_chunks * chunk, np.nan) for _ in range(R)] for _ in calls]
        rng = random.Random(seed)

        def program(r: int, c: int, tb: int, s: int, bufs: dict) -> Iterator[None]:
            e = self.epoch[r] + 1
            rc = enc.ranks[r]
            lo, hi = s * slice_elems, min((s + 1) * slice_elems, chunk)
            start, cnt = (int(x) for x in rc.tbs[tb]) if tb < rc.n_tb else (0, 0)
            for g in range(start, start + cnt):
                w = [int(x) for x in rc.code[g]]
                bits = w[0]
                for d in rc.deps[w[12] : w[12] + w[13]]:
                    while self.done[r][int(d) * slices + s] < e:
                        yield
                if bits & USE_RECV:
                    while self.flags[r][ACK + w[8] * slices + s] < e:
                        yield
                if bits & SEND and wait_ack:
                    while self.flags[r][w[9]] < e - 1:
                        yield
                src = bufs[w[1]] if w[1] >= 0 else None
                dst = bufs[w[3]] if w[3] >= 0 else None
                peer_mb = self.mbox[w[9]] if bits & SEND else None
                for j in range(w[5]):
                    for off in range(lo, hi, block):
                        sl = slice(off, min(off + block, hi))
                        idx = np.arange(sl.start, sl.stop)
                        v = np.zeros(len(idx))
                        if bits & USE_SRC:
                            v = v + src[(w[2] + j) * chunk + idx]
                        if bits & USE_RECV:
                            v = v + self.mbox[r][(w[7] + j) * chunk + idx]
                        if bits & ACC_DST:
                            v = v + dst[(w[4] + j) * chunk + idx]
                        if bits & STORE_DST:
                            dst[(w[4] + j) * chunk + idx] = v
                        if bits & SEND:
                            peer_mb[(w[10] + j) * chunk + idx] = v
                        yield
                if bits & SEND:
                    self.flags[w[9]][ACK + w[11] * slices + s] = e
                if w[14] >= 0:
                    self.done[r][w[14] * slices + s] = e

        def rank_calls(r: int) -> Iterator[None]:
            for c, inputs in enumerate(calls):
                x = inputs[r]
                bufs = {
                    0: x.astype(np.float64).copy(),
                    1: outs[c][r],
                    2: np.full(enc.scratch_chunks[r] * chunk, np.nan),
                }
                progs = [program(r, c, tb, s, bufs) for tb in range(max(enc.ranks[r].n_tb, 1)) for s in range(slices)]
                while progs:  # the programs of one launch, interleaved
                    p = rng.choice(progs)
                    try:
                        next(p)
                    except StopIteration:
                        progs.remove(p)
                    yield
                e = self.epoch[r] + 1
                for p in range(R):
                    if p != r:
                        self.flags[p][r] = e
                self.epoch[r] = e

        ranks = [rank_calls(r) for r in range(R)]
        live = list(range(R))
        idle = 0
        snapshot = None
        while live:
            r = rng.choice(live)
            try:
                next(ranks[r])
            except StopIteration:
                live.remove(r)
            idle += 1
            if idle > 200_000:  # a cheap livelock guard: state unchanged over many steps means stuck
                now = (tuple(self.epoch), tuple(int(f.sum()) for f in self.flags))
                if now == snapshot:
                    raise Stuck(f"{enc.name}: no progress (epochs {self.epoch})")
                snapshot, idle = now, 0
        return outs
