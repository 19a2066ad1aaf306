"""Checks of schedules/plan_exec.py under Triton's CPU interpreter (run by tests/test_schedules_gpu_plan.py in a
subprocess with TRITON_INTERPRET=1, which must be set before Triton compiles anything).

One process plays rank 0 of the 4-rank one-shot all-reduce: every rank's flag array and mailbox are ordinary
tensors (their addresses stand for the peers' mapped buffers). Before the launch, what the peers would have
sent to rank 0 (their inputs, one message each) is put into its mailbox with the call's epoch in the message
flags. A healthy call must give the sum, publish the epoch and send rank 0's input to every peer. Then one peer's
message never comes: the error must name that peer, in the threadblock order of the library (the program waiting
on the peer runs first) and reversed (the programs that depend on it run first, so their dependency waits time
out before the peer wait has started, as on a GPU where those waits expire first).

The interpreter runs the programs one after the other, so a dependency on a later program can never pass: in
the reversed order every call's dependencies time out as they would on a GPU where the program they depend on
is not resident, which the first call (every message there) checks the error of.
"""

from __future__ import annotations

import dataclasses
import json

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch

from fluxcompile.schedules import compile_program, library
from fluxcompile.schedules.encoding import USE_RECV, EncodedPlan, encode
from fluxcompile.schedules.plan import Plan
from fluxcompile.schedules.plan_exec import ACK_WORDS, plan_exec
from fluxcompile.schedules.wait_errors import DEP_SLOT, ERR_WORDS, error_message

WORLD, RANK, ROWS, SLICES, BLOCK = 4, 0, 7, 2, 4  # 7 elements a chunk over 2 slices: a ragged last slice


def reversed_threadblocks(plan: Plan, rank: int) -> Plan:
    """``plan`` with rank ``rank``'s threadblocks in reverse order (dependencies renumbered)."""
    rp = plan.ranks[rank]
    n = len(rp.threadblocks)
    tbs = [
        dataclasses.replace(
            tb, instrs=[dataclasses.replace(i, deps=[(n - 1 - t, k) for t, k in i.deps]) for i in tb.instrs]
        )
        for tb in reversed(rp.threadblocks)
    ]
    ranks = list(plan.ranks)
    ranks[rank] = dataclasses.replace(rp, threadblocks=tbs)
    return dataclasses.replace(plan, ranks=ranks)


class Rank0:
    """Rank 0's view of the group: every rank's flags and mailbox, rank 0's epoch state, dependency flags
    and error words, which successive calls share (as the executor's channel does)."""

    def __init__(self, enc: EncodedPlan):
        self.enc = enc
        self.flags = [torch.zeros(ACK_WORDS + enc.num_messages * SLICES, dtype=torch.int32) for _ in range(WORLD)]
        self.mbox = [torch.full((max(c, 1) * ROWS,), float("nan")) for c in enc.mailbox_chunks]
        self.peer_flags = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)
        self.peer_mbox = torch.tensor([m.data_ptr() for m in self.mbox], dtype=torch.int64)
        self.done = torch.zeros(enc.max_instrs * SLICES, dtype=torch.int32)
        self.state = torch.zeros(4, dtype=torch.int32)
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int32)

    def call(self, xs: list[torch.Tensor], missing: int | None = None) -> torch.Tensor:
        """One call on rank 0; the peers' messages to it delivered first, except ``missing``'s."""
        e = int(self.state[0]) + 1
        rc = self.enc.ranks[RANK]
        for w in rc.code.tolist():
            if w[0] & USE_RECV and w[6] != missing:
                self.mbox[RANK][w[7] * ROWS : (w[7] + w[5]) * ROWS] = xs[w[6]]
                self.flags[RANK][ACK_WORDS + w[8] * SLICES : ACK_WORDS + (w[8] + 1) * SLICES] = e
        self.flags[RANK][1:WORLD] = e - 1  # every peer acked the previous call
        out = torch.full((ROWS,), float("nan"))
        code, tbs, deps = (torch.from_numpy(a.reshape(-1).copy()) for a in (rc.code, rc.tbs, rc.deps))
        plan_exec(
            code, tbs, deps, xs[RANK].clone(), out, out, self.peer_mbox, self.peer_flags, self.done, self.state,
            self.err, n_tb=rc.n_tb, slices=SLICES, chunk_elems=ROWS, slice_elems=-(-ROWS // SLICES), vec=1,
            rank=RANK, world=WORLD, max_spin=20, block=BLOCK,
        )  # fmt: skip
        return out


def healthy() -> str | None:
    """Two calls with every message there: the sum, the epoch published, rank 0's input sent to every peer."""
    enc = encode(compile_program(library.one_shot_all_reduce(WORLD)))
    r0 = Rank0(enc)
    g = torch.Generator().manual_seed(0)
    for call in (1, 2):
        xs = [torch.randint(-50, 50, (ROWS,), generator=g).float() for _ in range(WORLD)]
        out = r0.call(xs)
        msg = error_message(r0.err, "test")
        if msg:
            return f"call {call}: {msg}"
        if not torch.equal(out, sum(xs)):
            return f"call {call}: got {out.tolist()}, want {sum(xs).tolist()}"
        if int(r0.state[0]) != call:
            return f"call {call}: published epoch {int(r0.state[0])}"
        for q in range(1, WORLD):
            if int(r0.flags[q][RANK]) != call:
                return f"call {call}: rank {q} has ack {int(r0.flags[q][RANK])}"
            if not torch.equal(r0.mbox[q][:ROWS], xs[RANK]):  # rank 0's is each peer's only message from it
                return f"call {call}: rank {q}'s mailbox holds {r0.mbox[q][:ROWS].tolist()}"
    return None


def missing_peer(reverse: bool) -> dict:
    """A first call with every message there, then one where rank 1's never comes (the error words cleared in
    between): each call's error message, and the second call's error words."""
    plan = compile_program(library.one_shot_all_reduce(WORLD))
    enc = encode(reversed_threadblocks(plan, RANK) if reverse else plan)
    r0 = Rank0(enc)
    xs = [torch.ones(ROWS) for _ in range(WORLD)]
    r0.call(xs)
    first = error_message(r0.err, "test")
    r0.err.zero_()
    r0.call(xs, missing=1)
    return {
        "first call": first,
        "second call": error_message(r0.err, "test"),
        "peer slot": r0.err[:DEP_SLOT].tolist(),
        "dependency slot": r0.err[DEP_SLOT:].tolist(),
    }


if __name__ == "__main__":
    print(json.dumps({"healthy": healthy(), "in order": missing_peer(False), "reversed": missing_peer(True)}))
