"""A persistent Triton kernel that interprets one rank's compiled schedule ``Plan`` (schedules/encoding.py).

Program ``pid`` runs threadblock ``pid // S`` of the plan on *slice* ``pid % S`` of every chunk: all plan
operations are elementwise from a chunk to a chunk (element k to element k), so slice s of all chunks is an
independent copy of the whole collective, and a large chunk is spread over S programs (and SMs).

Buffers: input, output and scratch are this rank's ordinary tensors; a message travels by remote stores into
its own slot of the receiver's symmetric *mailbox* (every message of the plan has a slot, so a send never
waits for a receive) followed by a release of the receiver's flag ``msg * S + s``. Receives are bounded
acquire spin-waits on that flag. Dependencies between threadblocks of a rank wait on local ``done`` flags.

Epochs (graph-safe, nothing reset between calls): ``state[0]`` counts this group's calls on this rank; a
call uses ``e = state[0] + 1``, and every flag it sets holds ``e``; a wait passes when ``flag - e >= 0``.
The last program to finish (a counter in ``state[1]``) publishes ``e`` to ``state[0]`` and *acks* the call
to every peer (``flags[rank] = e`` in the peer's flag array). Before writing into a peer's mailbox a
program waits for that peer's ack of the previous call (``>= e - 1``), so no mailbox slot is overwritten
while the peer may still read it. All plans of a group share the epoch, flags and mailbox: every rank
runs the group's collectives in the same order, so epochs agree.

Timeouts: a wait on a peer (message, ack) gives up after ``max_spin`` polls, a threadblock dependency after
``dependency_spin(max_spin)``; each kind records into its own slot of ``err`` (schedules/wait_errors.py), and a
peer wait's error, which names the root cause, wins over a dependency's, which is often its consequence;
:func:`wait_errors.check_error` raises naming the rank and the signal. All programs must be resident together
(the launcher keeps the grid at most the SM count).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.waits import bounded_wait, dependency_wait
from .wait_errors import ACK, DEP_SLOT, DEPENDENCY, ERR_WORDS, MESSAGE, dependency_spin

WORDS = 16  # int32 words per instruction (layout in schedules/encoding.py)
ACK_WORDS = 64  # per-source ack flags at the start of the flag array; message flags follow
_DEP_SLOT = tl.constexpr(DEP_SLOT)  # the dependency slot of err, as the kernel sees it
_MESSAGE, _ACK, _DEPENDENCY = tl.constexpr(MESSAGE), tl.constexpr(ACK), tl.constexpr(DEPENDENCY)
# Op bits (schedules/encoding.py): what an instruction reads, stores and sends.
USE_SRC, USE_RECV, ACC_DST, STORE_DST, SEND = 1, 2, 4, 8, 16


@triton.jit
def _local_ptr(buf, inp, out, scr, mbox):
    p = inp
    if buf == 1:
        p = out
    elif buf == 2:
        p = scr
    elif buf == 3:
        p = mbox
    return p


@triton.jit(do_not_specialize=["n_tb", "S", "chunk_vecs", "slice_vecs", "rank", "world", "max_spin", "dep_spin"])
def plan_exec_kernel(
    code, tbs, deps, inp, out, scr, peer_mbox, peer_flags, done, state, err,
    n_tb, S, chunk_vecs, slice_vecs, rank, world, max_spin, dep_spin,
    VEC: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    dtype = out.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tb = pid // S
    s = pid % S
    e = tl.load(state, volatile=True) + 1
    my_flags = tl.load(peer_flags + rank).to(tl.pointer_type(tl.int32))
    mbox = tl.multiple_of(tl.load(peer_mbox + rank).to(tl.pointer_type(dtype)), ALIGN)
    chunk = chunk_vecs * VEC  # a multiple of VEC by construction: the loads below vectorize
    lo = s * slice_vecs * VEC
    hi = tl.minimum(lo + slice_vecs * VEC, chunk)
    start = 0
    n_ins = 0
    if tb < n_tb:
        start = tl.load(tbs + 2 * tb)
        n_ins = tl.load(tbs + 2 * tb + 1)
    for k in range(start, start + n_ins):
        ins = code + k * 16
        bits = tl.load(ins)
        src_buf = tl.load(ins + 1)
        src_chunk = tl.load(ins + 2)
        dst_buf = tl.load(ins + 3)
        dst_chunk = tl.load(ins + 4)
        count = tl.load(ins + 5)
        recv_peer = tl.load(ins + 6)
        recv_chunk = tl.load(ins + 7)
        recv_msg = tl.load(ins + 8)
        send_peer = tl.load(ins + 9)
        send_chunk = tl.load(ins + 10)
        send_msg = tl.load(ins + 11)
        dep_start = tl.load(ins + 12)
        dep_n = tl.load(ins + 13)
        done_idx = tl.load(ins + 14)
        use_src = (bits & 1) != 0
        use_recv = (bits & 2) != 0
        acc_dst = (bits & 4) != 0
        store_dst = (bits & 8) != 0
        do_send = (bits & 16) != 0
        # Waits: same-rank dependencies (their timeouts in the dependency slot), the incoming message, the
        # peer's ack of the previous call.
        for d in range(dep_start, dep_start + dep_n):
            di = tl.load(deps + d)
            dependency_wait(done + di * S + s, e, err, err + _DEP_SLOT, dep_spin, rank, di, _DEPENDENCY)
        if use_recv:
            bounded_wait(my_flags + 64 + recv_msg * S + s, e, err, max_spin, rank, recv_peer, recv_msg, _MESSAGE, True)
        if do_send:
            bounded_wait(my_flags + send_peer, e - 1, err, max_spin, rank, send_peer, -1, _ACK, True)
        tl.debug_barrier()  # every thread reads after the (single-thread) acquires
        sp = _local_ptr(src_buf, inp, out, scr, mbox)
        dp = _local_ptr(dst_buf, inp, out, scr, mbox)
        peer_mb = mbox
        if do_send:
            peer_mb = tl.multiple_of(tl.load(peer_mbox + send_peer).to(tl.pointer_type(dtype)), ALIGN)
        for j in range(count):
            s_off = (src_chunk + j) * chunk
            d_off = (dst_chunk + j) * chunk
            r_off = (recv_chunk + j) * chunk
            t_off = (send_chunk + j) * chunk
            for off in range(lo, hi, BLOCK):
                idx = off + tl.arange(0, BLOCK)
                m = idx < hi
                # `m` where the instruction's flag is set, else all false: tl.where keeps each mask boolean
                # (Triton 3.9's interpreter widens a scalar condition to int32 when it meets a block, and a load's
                # or store's mask must be boolean).
                m_src = tl.where(use_src, m, False)
                m_recv = tl.where(use_recv, m, False)
                m_acc = tl.where(acc_dst, m, False)
                v = tl.load(sp + s_off + idx, mask=m_src, other=0.0, cache_modifier=".cg").to(tl.float32)
                v += tl.load(mbox + r_off + idx, mask=m_recv, other=0.0, cache_modifier=".cg").to(tl.float32)
                v += tl.load(dp + d_off + idx, mask=m_acc, other=0.0, cache_modifier=".cg").to(tl.float32)
                v = v.to(dtype)
                tl.store(dp + d_off + idx, v, mask=tl.where(store_dst, m, False))
                tl.store(peer_mb + t_off + idx, v, mask=tl.where(do_send, m, False))
        tl.debug_barrier()  # all of the instruction's stores and loads before its signals (cumulative release)
        if do_send:
            pf = tl.load(peer_flags + send_peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(pf + 64 + send_msg * S + s, e, sem="release", scope="sys")
        if done_idx >= 0:
            tl.atomic_xchg(done + done_idx * S + s, e, sem="release", scope="gpu")

    # The last program to finish acks the call to every peer (its mailbox may be written again) and
    # publishes the epoch for the next call.
    tl.debug_barrier()
    finished = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        tl.atomic_xchg(state + 1, 0, sem="relaxed", scope="gpu")
        for p in range(world):
            if p != rank:
                pf = tl.load(peer_flags + p).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(pf + rank, e, sem="release", scope="sys")
        tl.atomic_xchg(state, e, sem="release", scope="gpu")


def plan_exec(
    code: torch.Tensor,
    tbs: torch.Tensor,
    deps: torch.Tensor,
    inp: torch.Tensor,
    out: torch.Tensor,
    scr: torch.Tensor,
    peer_mbox: torch.Tensor,
    peer_flags: torch.Tensor,
    done: torch.Tensor,
    state: torch.Tensor,
    err: torch.Tensor,
    *,
    n_tb: int,
    slices: int,
    chunk_elems: int,
    slice_elems: int,
    vec: int,
    rank: int,
    world: int,
    max_spin: int = 1 << 26,
    block: int = 4096,
    num_warps: int = 8,
    compile_only: bool = False,
) -> None:
    """Launch ``max(n_tb, 1) * slices`` programs (see the module docstring). ``chunk_elems`` and
    ``slice_elems`` are multiples of ``vec``; code/tbs/deps come from ``schedules.encoding``; peer_mbox /
    peer_flags: int64 ``[world]`` addresses of every rank's mailbox and flag array as mapped here; done:
    this rank's int32 dependency flags; state: int32 ``[4]``; err: int32 ``[ERR_WORDS]``
    (schedules/wait_errors.py); ``max_spin``: the peer waits' bound in polls."""
    if err.numel() < ERR_WORDS:
        raise ValueError(f"plan_exec: err needs {ERR_WORDS} words, not {err.numel()}")
    if chunk_elems % vec or slice_elems % vec:
        raise ValueError(f"plan_exec: chunk ({chunk_elems}) and slice ({slice_elems}) must be multiples of {vec}")
    grid = (max(n_tb, 1) * slices,)
    align = vec * out.element_size()
    args = (
        code, tbs, deps, inp, out, scr, peer_mbox, peer_flags, done, state, err,
        n_tb, slices, chunk_elems // vec, slice_elems // vec, rank, world, max_spin, dependency_spin(max_spin),
    )  # fmt: skip
    meta = dict(VEC=vec, BLOCK=block, ALIGN=align, num_warps=num_warps)
    if compile_only:
        plan_exec_kernel.warmup(*args, grid=grid, **meta)
    else:
        plan_exec_kernel[grid](*args, **meta)
