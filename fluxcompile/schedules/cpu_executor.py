"""Simulate a ``Plan`` on ordinary CPU tensors: every rank's threadblocks are stepped by one
scheduler; messages travel through unbounded FIFO channels keyed by (src, dst, channel)."""

from __future__ import annotations

from collections import deque

import torch

from .checker import RECEIVES, SENDS, DeadlockError
from .plan import Plan
from .program import Program


def execute(plan: Plan, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Chunks are slices along dim 0. Returns each rank's output, shaped (out_chunks * rows, ...).
    Inputs are cloned: a plan may reduce into its input buffer (GC3 allows it)."""
    if len(inputs) != plan.num_ranks:
        raise ValueError(f"{plan.name}: expected {plan.num_ranks} tensors, got {len(inputs)}")
    x0 = inputs[0]
    if x0.shape[0] % plan.in_chunks:
        raise ValueError(f"{plan.name}: dim 0 ({x0.shape[0]}) is not divisible into {plan.in_chunks} chunks")
    rows = x0.shape[0] // plan.in_chunks
    rest = tuple(x0.shape[1:])
    bufs: list[dict[str, torch.Tensor]] = []
    for r, x in enumerate(inputs):
        if x.shape != x0.shape:
            raise ValueError(f"rank {r}: shape {tuple(x.shape)} differs from rank 0's {tuple(x0.shape)}")
        bufs.append(
            {
                "input": x.detach().clone().reshape(plan.in_chunks, rows, *rest),
                "output": x.new_zeros(plan.out_chunks, rows, *rest),
                "scratch": x.new_zeros(plan.scratch_chunks[r], rows, *rest),
            }
        )
    fifos: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
    pcs = [[0] * len(rp.threadblocks) for rp in plan.ranks]
    remaining = plan.num_instructions()

    def get(r: int, buf: str, idx: int, n: int) -> torch.Tensor:
        return bufs[r][buf][idx : idx + n].clone()

    def put(r: int, buf: str, idx: int, v: torch.Tensor) -> None:
        bufs[r][buf][idx : idx + v.shape[0]] = v

    def ready(r: int, t: int) -> bool:
        rp = plan.ranks[r]
        tb = rp.threadblocks[t]
        if pcs[r][t] >= len(tb.instrs):
            return False
        ins = tb.instrs[pcs[r][t]]
        if any(pcs[r][dt] <= di for dt, di in ins.deps):
            return False
        return ins.op not in RECEIVES or bool(fifos.get((tb.recv_peer, r, tb.channel)))

    def step(r: int, t: int) -> None:
        tb = plan.ranks[r].threadblocks[t]
        ins = tb.instrs[pcs[r][t]]
        msg = None
        if ins.op in RECEIVES:
            msg = fifos[(tb.recv_peer, r, tb.channel)].popleft()
            if msg.shape[0] != ins.count:
                raise RuntimeError(
                    f"rank {r} tb {t} instr {pcs[r][t]}: received {msg.shape[0]} chunks, expects {ins.count}"
                )
        op = ins.op
        if op == "send":
            out = get(r, ins.src_buf, ins.src_index, ins.count)
        elif op == "recv":
            put(r, ins.dst_buf, ins.dst_index, msg)
        elif op == "copy":
            put(r, ins.dst_buf, ins.dst_index, get(r, ins.src_buf, ins.src_index, ins.count))
        elif op == "reduce":
            v = get(r, ins.dst_buf, ins.dst_index, ins.count) + get(r, ins.src_buf, ins.src_index, ins.count)
            put(r, ins.dst_buf, ins.dst_index, v)
        elif op == "rrc":
            put(r, ins.dst_buf, ins.dst_index, get(r, ins.dst_buf, ins.dst_index, ins.count) + msg)
        elif op == "rcs":
            put(r, ins.dst_buf, ins.dst_index, msg)
            out = msg
        elif op in ("rrcs", "rrs"):
            out = get(r, ins.src_buf, ins.src_index, ins.count) + msg
            if op == "rrcs":
                put(r, ins.dst_buf, ins.dst_index, out)
        else:
            raise ValueError(f"rank {r} tb {t}: unknown instruction {op!r}")
        if op in SENDS:
            fifos.setdefault((r, tb.send_peer, tb.channel), deque()).append(out)
        pcs[r][t] += 1

    while remaining:
        progressed = False
        for r, rp in enumerate(plan.ranks):
            for t in range(len(rp.threadblocks)):
                while ready(r, t):
                    step(r, t)
                    remaining -= 1
                    progressed = True
        if not progressed:
            stuck = []
            for r, rp in enumerate(plan.ranks):
                for t, tb in enumerate(rp.threadblocks):
                    if pcs[r][t] < len(tb.instrs):
                        ins = tb.instrs[pcs[r][t]]
                        why = [f"tb {dt} instr {di}" for dt, di in ins.deps if pcs[r][dt] <= di]
                        if ins.op in RECEIVES and not fifos.get((tb.recv_peer, r, tb.channel)):
                            why.append(f"a message from rank {tb.recv_peer} on channel {tb.channel}")
                        stuck.append(f"rank {r} tb {t} instr {pcs[r][t]} ({ins.op}) waits for {', '.join(why)}")
            raise DeadlockError(f"{plan.name}: deadlock, no threadblock can proceed: " + "; ".join(stuck))
    leftover = {k: len(v) for k, v in fifos.items() if v}
    if leftover:
        raise RuntimeError(f"{plan.name}: messages never received on channels {leftover}")
    return [b["output"].reshape(plan.out_chunks * rows, *rest) for b in bufs]


def interpret(prog: Program, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reference semantics: replay the program's ops in program order on tensors, with no
    compilation at all. Tests compare compiled plans against it."""
    rows = inputs[0].shape[0] // prog.in_chunks
    rest = tuple(inputs[0].shape[1:])
    bufs = [
        {
            "input": x.detach().clone().reshape(prog.in_chunks, rows, *rest),
            "output": x.new_zeros(prog.out_chunks, rows, *rest),
            "scratch": x.new_zeros(prog.scratch_chunks[r], rows, *rest),
        }
        for r, x in enumerate(inputs)
    ]
    for op in prog.ops:
        (sb, sr, si), (db, dr, di) = op.src, op.dst
        v = bufs[sr][sb][si : si + op.size].clone()
        if op.kind == "reduce":
            v = v + bufs[dr][db][di : di + op.size]
        bufs[dr][db][di : di + op.size] = v
    return [b["output"].reshape(prog.out_chunks * rows, *rest) for b in bufs]
