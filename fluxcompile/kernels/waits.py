"""The bounded acquire-wait on a peer's flag that the Triton kernels share (gemm_ar.py, gemm_rs.py,
schedules/plan_exec.py): a wait that times out records who waited for what in the kernel's error words instead of
hanging, and once one wait of a launch has timed out the others give up at once.

Error words: ``err[0]`` set to 1 by the first timeout; then ``err[1..5]`` = the waiting rank, the peer
(-1: none), the tile or message, the awaited value, and a code for which wait it was (``kind``, per kernel).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
            if tl.atomic_cas(err, 0, 1, sem="acq_rel", scope="gpu") == 0:
                tl.atomic_xchg(err + 1, rank)
                tl.atomic_xchg(err + 2, peer)
                tl.atomic_xchg(err + 3, tile)
                tl.atomic_xchg(err + 4, e)
                tl.atomic_xchg(err + 5, kind)
    return ok
