"""Checks of kernels/gemm_rs.py under Triton's CPU interpreter (run by tests/test_gemm_rs_kernel.py in a
subprocess with TRITON_INTERPRET=1, which must be set before Triton compiles anything).

One process plays rank ``rank`` of ``world``: every rank's symmetric data and flag buffers are ordinary
tensors (their addresses stand for the peers' mapped buffers). Before the launch, what the peers would have
stored into this rank's buffers (their partials of its rows) is put there, with the call's epoch in their
flags. After it we check this rank's output (the reduce-scattered block), what it stored into each peer's
slot and flags, the epoch it published, and the tile order (peers from rank + 1 on, own rows last). Two calls
per case (both parities, flags never reset); then a flag left at the previous epoch must time out.
"""

from __future__ import annotations

import json
import sys

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch

from fluxcompile import ops
from fluxcompile.kernels.gemm_rs import ERR_WORDS, MAX_TILES, check_error, gemm_rs, n_tiles


class Ranks:
    """Every rank's data and flag buffers, as the kernel on ``rank`` sees them."""

    def __init__(self, world: int, rows: int, n: int):
        self.world = world
        self.slot = rows * n + 24  # padded, as the lowering's slots are
        self.parity = world * self.slot + 8
        self.data = [torch.full((2 * self.parity,), float("nan")) for _ in range(world)]
        self.flags = [torch.zeros(world * MAX_TILES, dtype=torch.int32) for _ in range(world)]
        self.peer_data = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64)
        self.peer_flags = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)

    def slot_view(self, owner: int, parity: int, src: int, rows: int, n: int) -> torch.Tensor:
        lo = parity * self.parity + src * self.slot
        return self.data[owner][lo : lo + rows * n].view(rows, n)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error; NaN (a poisoned value left unwritten) counts as infinitely wrong."""
    err = ((a.double() - ref.double()).norm() / ref.double().norm()).item()
    return err if err == err else float("inf")


def call(g, ranks: Ranks, state, rank, rows, n, ks, bias, block, progs, layout="", stale=None):
    """One call on ``rank``: (worst relative error over everything checked, timeout message or None)."""
    world = ranks.world
    m = world * rows
    e = int(state[0]) + 1
    parity = e % 2
    As, Bs, biases = [], [], []
    for _ in range(world):  # every rank has its own operands (and bias: the contract adds each rank's)
        a_r = [torch.randn(m, k, generator=g) for k in ks]
        b_r = [torch.randn(k, n, generator=g) / k**0.5 for k in ks]
        if layout == "strided":  # A column-major, B an nn.Linear weight transposed
            a_r = [a.t().contiguous().t() for a in a_r]
            b_r = [b.t().contiguous().t() for b in b_r]
        As.append(a_r)
        Bs.append(b_r)
        biases.append(torch.randn(n, generator=g) if bias else None)
    partials = [ops.matmul_sum(As[r], Bs[r], biases[r]) for r in range(world)]
    ref = sum(p[rank * rows : (rank + 1) * rows] for p in partials)
    tm, tn = n_tiles(rows, n, block)
    for src in range(world):
        if src != rank:
            ranks.slot_view(rank, parity, src, rows, n).copy_(partials[src][rank * rows : (rank + 1) * rows])
            ranks.flags[rank][src * MAX_TILES : src * MAX_TILES + tm * tn] = e
    if stale is not None:  # (source rank, tile) whose flag is left at the previous epoch
        ranks.flags[rank][stale[0] * MAX_TILES + stale[1]] = e - 1
    out = torch.full((rows, n), float("nan"))
    err = torch.zeros(ERR_WORDS, dtype=torch.int32)
    trace = torch.full((world * tm * tn,), -1, dtype=torch.int32)
    gemm_rs(
        As[rank], Bs[rank], biases[rank], out, ranks.peer_data, ranks.peer_flags, ranks.slot, ranks.parity,
        state, err, rank, world, block=block, num_programs=progs, reduce_programs=progs, max_spin=20, trace=trace,
    )  # fmt: skip
    try:
        check_error(err, "test")
    except RuntimeError as ex:
        return float("inf"), str(ex)
    worst = rel(out, ref)
    for owner in range(world):  # what this rank stored into each owner's slot, and the owner's flags
        got = ranks.slot_view(owner, parity, rank, rows, n)
        worst = max(worst, rel(got, partials[rank][owner * rows : (owner + 1) * rows]))
        if not bool((ranks.flags[owner][rank * MAX_TILES : rank * MAX_TILES + tm * tn] == e).all()):
            worst = float("inf")
    if int(state[0]) != e or int(state[1]) != 0:
        worst = float("inf")
    # Tile order: owner rank+1's tiles at positions [0, T), rank+2's at [T, 2T), ..., this rank's last.
    per = tm * tn
    for owner in range(world):
        step = (owner - rank - 1) % world
        pos = trace[owner * per : (owner + 1) * per]
        if sorted(pos.tolist()) != list(range(step * per, (step + 1) * per)):
            worst = float("inf")
    return worst, None


def case(seed, rank, world, rows, n, ks, bias, block, progs, layout="") -> float:
    g = torch.Generator().manual_seed(seed)
    ranks = Ranks(world, rows, n)
    state = torch.zeros(2, dtype=torch.int32)
    worst = 0.0
    for _ in range(2):  # epochs 1 and 2: both parities, flags never reset
        err, msg = call(g, ranks, state, rank, rows, n, ks, bias, block, progs, layout)
        if msg:
            raise AssertionError(msg)
        worst = max(worst, err)
    return worst


def stale_case() -> str:
    """A flag left at the previous call's epoch must not pass: the wait times out and names the signal."""
    g = torch.Generator().manual_seed(0)
    world, rank, rows, n, block = 2, 0, 8, 40, (8, 16, 16)
    ranks = Ranks(world, rows, n)
    state = torch.zeros(2, dtype=torch.int32)
    call(g, ranks, state, rank, rows, n, (16,), False, block, 2)
    _, msg = call(g, ranks, state, rank, rows, n, (16,), False, block, 2, stale=(1, 2))
    return msg or "no error"


if __name__ == "__main__":
    seed = int(sys.argv[1])
    results = {
        # (rank, world, rows per rank, N, K of each product, bias, tile, programs)
        "rank 0 of 2, ragged rows and N, bias": case(seed, 0, 2, 21, 40, (24,), True, (16, 16, 16), 3),
        "rank 1 of 2, two products (K 16, 40)": case(seed + 1, 1, 2, 16, 33, (16, 40), False, (16, 16, 16), 2),
        "rank 2 of 4, three products, bias": case(seed + 2, 2, 4, 9, 24, (16, 8, 24), True, (8, 16, 16), 3),
        "rank 0 of 3, four products, strided": case(
            seed + 3, 0, 3, 12, 20, (8, 16, 8, 24), True, (8, 8, 8), 5, "strided"
        ),
        "rank 1 of 3, one program": case(seed + 4, 1, 3, 5, 16, (16,), False, (8, 8, 16), 1),
        "rank 5 of 8, bias": case(seed + 5, 5, 8, 4, 24, (16,), True, (8, 8, 16), 2),
    }
    results["stale"] = stale_case()
    print(json.dumps(results))
