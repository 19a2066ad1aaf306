"""The bounded acquire-wait on a peer's flag that the Triton kernels share (gemm_ar.py, gemm_rs.py, grouped_gemm.py,
embedding_bag.py, schedules/plan_exec.py): a wait that times out records who waited for what in the kernel's error
words instead of hanging, and once one wait of a launch has timed out the others give up at once.

Error words: ``err[0]`` set to 1 by the first timeout (or another error a kernel records with
:func:`record_error`); then ``err[1..5]`` = the waiting rank, the peer (-1: none), the tile or message, the
awaited value, and a code for which wait it was (``kind``, per kernel).
:func:`dependency_wait` records into a second set of words of the same layout (schedules/wait_errors.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def record_error(err, rank, peer, tile, e, kind):
    """The first error of a launch (a timeout, or another a kernel detects) fills the error words; later ones
    leave them."""
    if tl.atomic_cas(err, 0, 1, sem="acq_rel", scope="gpu") == 0:
        tl.atomic_xchg(err + 1, rank)
        tl.atomic_xchg(err + 2, peer)
        tl.atomic_xchg(err + 3, tile)
        tl.atomic_xchg(err + 4, e)
        tl.atomic_xchg(err + 5, kind)


@triton.jit
def bounded_wait(flag, e, err, max_spin, rank, peer, tile, kind, SYS: tl.constexpr):
    """Bounded acquire-wait until ``*flag - e >= 0``; 1 when it passed, 0 on timeout (recorded once)."""
    if SYS:
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    else:
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
    bail = tl.load(err, volatile=True)
    spins = 0
    while ((seen - e) < 0) & (spins < max_spin) & (bail == 0):
        if SYS:
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        else:
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        bail = tl.load(err, volatile=True)
        spins += 1
    ok = (seen - e) >= 0
    if (seen - e) < 0:
        if bail == 0:
            record_error(err, rank, peer, tile, e, kind)
    return ok


@triton.jit
def dependency_wait(flag, e, err, dep_err, max_spin, rank, tile, kind):
    """Bounded acquire-wait (GPU scope) until ``*flag - e >= 0`` on a flag of this rank's own programs, which
    may themselves be waiting on a peer. It gives up at once when ``err`` or ``dep_err`` holds an error, and
    its timeout goes to ``dep_err`` (the same layout), not ``err``: the peer waits, which give up on ``err``
    only, keep waiting and can record the root cause there. 1 when it passed, 0 otherwise."""
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
    bail = tl.load(err, volatile=True) | tl.load(dep_err, volatile=True)
    spins = 0
    while ((seen - e) < 0) & (spins < max_spin) & (bail == 0):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        bail = tl.load(err, volatile=True) | tl.load(dep_err, volatile=True)
        spins += 1
    ok = (seen - e) >= 0
    if (seen - e) < 0:
        if bail == 0:
            record_error(dep_err, rank, -1, tile, e, kind)
    return ok


@triton.jit
def uniform_now_ns():
    """The global timer, one value for every thread of the program (the earliest of their readings, reduced across
    warps): a loop that ends on it ends in every thread at the same iteration. Threads leaving a loop at different
    iterations would meet the loop's broadcasts and barriers, or a later warpgroup MMA, apart (a hang or an illegal
    instruction)."""
    t = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([1024], dtype=tl.int32)], dtype=tl.int64, is_pure=False, pack=1
    )
    return tl.min(t, axis=0)


@triton.jit
def timed_wait(flag, e, err, budget_us, rank, peer, tile, kind, SYS: tl.constexpr, TIMED: tl.constexpr):
    """:func:`bounded_wait` bounded by time: ``budget_us`` microseconds of the global timer (``TIMED``, compiled
    kernels), or that many polls (Triton's interpreter, which has no timer): a poll's duration depends on what
    the memory system is doing, so a bound in polls is no bound in time."""
    if TIMED:
        start = uniform_now_ns()
        budget_ns = budget_us.to(tl.int64) * 1000
        if SYS:
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        else:
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        bail = tl.load(err, volatile=True)
        late = False
        while ((seen - e) < 0) & (bail == 0) & (not late):
            if SYS:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            else:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
            bail = tl.load(err, volatile=True)
            late = (uniform_now_ns() - start) > budget_ns
        ok = (seen - e) >= 0
        if (seen - e) < 0:
            if bail == 0:
                record_error(err, rank, peer, tile, e, kind)
    else:
        ok = bounded_wait(flag, e, err, budget_us, rank, peer, tile, kind, SYS)
    return ok
