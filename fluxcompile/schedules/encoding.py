"""A ``Plan`` as the GPU interpreter's tables (plan_exec.py): per rank a small int32 instruction
array, a threadblock table and a dependency list. Pure NumPy, independent of sizes and dtypes: chunk
indices are scaled by the chunk size in the kernel.

Messages: the k-th send of rank r to peer p on channel c matches the k-th receive of p from r on c (the
compiler gives each (peer, channel) direction one threadblock, so this is the plan's FIFO order). Each
message gets a global id (its flag) and its own slot in the receiver's mailbox, so sends never wait.

Instruction words (``WORDS`` = 16):
  0 op bits (USE_SRC, USE_RECV, ACC_DST, STORE_DST, SEND)
  1 src buffer, 2 src chunk, 3 dst buffer, 4 dst chunk, 5 count (chunks)
  6 recv peer, 7 recv mailbox chunk (own mailbox), 8 recv message id
  9 send peer, 10 send mailbox chunk (in the peer's mailbox), 11 send message id
  12 first dependency (index into ``deps``), 13 dependency count, 14 done-flag index (-1: none)
  15 the op's index in ``OPS`` (for decoding)
Buffers: 0 input, 1 output, 2 scratch, -1 none (the mailbox is implicit in receives and sends).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .plan import Instr, Plan, RankPlan, Threadblock
from .program import INPUT, OUTPUT, SCRATCH

WORDS = 16
USE_SRC, USE_RECV, ACC_DST, STORE_DST, SEND = 1, 2, 4, 8, 16
OPS = ("copy", "reduce", "send", "recv", "rrc", "rcs", "rrcs", "rrs")
# value = src? + received? + old dst?; then stored and/or sent
OP_BITS = {
    "copy": USE_SRC | STORE_DST,
    "reduce": USE_SRC | ACC_DST | STORE_DST,
    "send": USE_SRC | SEND,
    "recv": USE_RECV | STORE_DST,
    "rrc": USE_SRC | USE_RECV | STORE_DST,  # the compiler sets src = dst: dst := dst + received
    "rcs": USE_RECV | STORE_DST | SEND,
    "rrcs": USE_SRC | USE_RECV | STORE_DST | SEND,
    "rrs": USE_SRC | USE_RECV | SEND,
}
BUFS = (INPUT, OUTPUT, SCRATCH)


@dataclasses.dataclass
class RankCode:
    rank: int
    code: np.ndarray  # int32 [n_instr, WORDS]
    tbs: np.ndarray  # int32 [n_tb, 2]: (first instruction, count)
    deps: np.ndarray  # int32 [n_deps]: done-flag indices (= instruction indices on this rank)
    tb_meta: list[tuple[int | None, int | None, int]]  # (send_peer, recv_peer, channel), for decoding

    @property
    def n_tb(self) -> int:
        return len(self.tbs)

    @property
    def n_instr(self) -> int:
        return len(self.code)


@dataclasses.dataclass
class EncodedPlan:
    name: str
    collective: str
    num_ranks: int
    in_chunks: int
    out_chunks: int
    scratch_chunks: list[int]
    mailbox_chunks: list[int]  # chunks of mailbox each rank receives into
    num_messages: int
    writes_input: bool  # some instruction stores into the input buffer (then the executor copies it)
    ranks: list[RankCode]
    instances: int = 1

    @property
    def max_tbs(self) -> int:
        return max((rc.n_tb for rc in self.ranks), default=0)

    @property
    def max_instrs(self) -> int:
        return max((rc.n_instr for rc in self.ranks), default=0)


def encode(plan: Plan) -> EncodedPlan:
    R = plan.num_ranks
    # Match sends and receives per (src, dst, channel) in threadblock program order.
    sends: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    recvs: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    for rp in plan.ranks:
        for t, tb in enumerate(rp.threadblocks):
            for k, ins in enumerate(tb.instrs):
                if ins.op not in OP_BITS:
                    raise ValueError(f"{plan.name}: rank {rp.rank} tb {t}: unknown instruction {ins.op!r}")
                bits = OP_BITS[ins.op]
                if bits & SEND:
                    sends.setdefault((rp.rank, tb.send_peer, tb.channel), []).append((rp.rank, t, k))
                if bits & USE_RECV:
                    recvs.setdefault((tb.recv_peer, rp.rank, tb.channel), []).append((rp.rank, t, k))
    if set(sends) != set(recvs) or any(len(sends[key]) != len(recvs[key]) for key in sends):
        raise ValueError(f"{plan.name}: sends and receives do not pair up per (src, dst, channel)")
    send_of: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # (rank, tb, k) -> (peer, mailbox chunk, msg)
    recv_of: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    mailbox = [0] * R
    msg = 0
    for key in sorted(sends):
        src, dst, _ = key
        for s_loc, r_loc in zip(sends[key], recvs[key]):
            r_ins = plan.ranks[dst].threadblocks[r_loc[1]].instrs[r_loc[2]]
            s_ins = plan.ranks[src].threadblocks[s_loc[1]].instrs[s_loc[2]]
            if s_ins.count != r_ins.count:
                raise ValueError(f"{plan.name}: message {msg} from rank {src} to {dst}: sizes differ")
            send_of[s_loc] = (dst, mailbox[dst], msg)
            recv_of[r_loc] = (src, mailbox[dst], msg)
            mailbox[dst] += s_ins.count
            msg += 1

    ranks = []
    writes_input = False
    for rp in plan.ranks:
        starts, n = [], 0
        for tb in rp.threadblocks:
            starts.append(n)
            n += len(tb.instrs)
        targets = {starts[dt] + dk for tb in rp.threadblocks for ins in tb.instrs for dt, dk in ins.deps}
        code = np.zeros((n, WORDS), dtype=np.int32)
        deps: list[int] = []
        for t, tb in enumerate(rp.threadblocks):
            for k, ins in enumerate(tb.instrs):
                g = starts[t] + k
                bits = OP_BITS[ins.op]
                w = code[g]
                w[0] = bits
                w[1] = BUFS.index(ins.src_buf) if ins.src_buf else -1
                w[2] = ins.src_index
                w[3] = BUFS.index(ins.dst_buf) if ins.dst_buf else -1
                w[4] = ins.dst_index
                w[5] = ins.count
                w[6:9] = recv_of.get((rp.rank, t, k), (-1, 0, -1))
                w[9:12] = send_of.get((rp.rank, t, k), (-1, 0, -1))
                w[12] = len(deps)
                w[13] = len(ins.deps)
                deps.extend(starts[dt] + dk for dt, dk in ins.deps)
                w[14] = g if g in targets else -1
                w[15] = OPS.index(ins.op)
                if bits & STORE_DST and ins.dst_buf == INPUT:
                    writes_input = True
        tbs = np.array([[s, len(tb.instrs)] for s, tb in zip(starts, rp.threadblocks)], dtype=np.int32).reshape(-1, 2)
        meta = [(tb.send_peer, tb.recv_peer, tb.channel) for tb in rp.threadblocks]
        ranks.append(RankCode(rp.rank, code, tbs, np.array(deps, dtype=np.int32), meta))
    return EncodedPlan(
        plan.name,
        plan.collective,
        R,
        plan.in_chunks,
        plan.out_chunks,
        list(plan.scratch_chunks),
        mailbox,
        msg,
        writes_input,
        ranks,
        plan.instances,
    )


def decode(enc: EncodedPlan) -> Plan:
    """The ``Plan`` the tables encode (tests: ``decode(encode(plan)) == plan``)."""
    ranks = []
    for rc in enc.ranks:
        tbs = []
        for t, (start, n) in enumerate(rc.tbs.tolist()):
            send_peer, recv_peer, ch = rc.tb_meta[t]
            instrs = []
            for g in range(start, start + n):
                w = rc.code[g].tolist()
                deps = []
                for d in rc.deps[w[12] : w[12] + w[13]].tolist():
                    dt = next(i for i, (s, c) in enumerate(rc.tbs.tolist()) if s <= d < s + c)
                    deps.append((dt, d - int(rc.tbs[dt][0])))
                op = OPS[w[15]]
                instrs.append(
                    Instr(
                        op,
                        BUFS[w[1]] if w[1] >= 0 else None,
                        w[2],
                        BUFS[w[3]] if w[3] >= 0 else None,
                        w[4],
                        w[5],
                        deps,
                    )
                )
            tbs.append(Threadblock(send_peer, recv_peer, ch, instrs))
        ranks.append(RankPlan(rc.rank, tbs))
    return Plan(
        enc.name, enc.collective, enc.num_ranks, enc.in_chunks, enc.out_chunks, list(enc.scratch_chunks),
        enc.instances, ranks,
    )  # fmt: skip
