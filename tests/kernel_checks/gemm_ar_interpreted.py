"""Checks of kernels/gemm_ar.py under Triton's CPU interpreter (run by tests/test_gemm_ar_kernel.py in a
subprocess with TRITON_INTERPRET=1, which must be set before Triton compiles anything).

One process plays rank ``rank`` of ``world``: every rank's symmetric buffers are ordinary tensors, and what
the peers would have pushed (their partial tiles, two-shot: the reduced tiles they own) is put into this
rank's buffers with the call's epoch in the flags before the launch. After it we check this rank's output,
what it pushed into each peer's buffers and flags, and its epoch; a second call with fresh inputs checks the
epoch and parity logic, a third one leaves a peer's flag at the old epoch and must time out naming it.
"""

from __future__ import annotations

import json
import sys

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch

from fluxcompile import ops
from fluxcompile.kernels.gemm_ar import ERR_WORDS, MAX_TILES, check_error, gemm_ar, n_tiles


class Ranks:
    """Every rank's data and flag buffers, as the kernel on ``rank`` sees them."""

    def __init__(self, world: int, slot_elems: int):
        self.world, self.slot = world, slot_elems
        self.data = [torch.full(((2 * world + 2) * slot_elems,), float("nan")) for _ in range(world)]
        self.flags = [torch.zeros((world + 1) * MAX_TILES, dtype=torch.int32) for _ in range(world)]
        self.peer_data = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64)
        self.peer_flags = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)

    def slot_view(self, owner: int, index: int, m: int, n: int) -> torch.Tensor:
        return self.data[owner][index * self.slot : index * self.slot + m * n].view(m, n)


def owner_of(t: int, total: int, world: int) -> int:
    return t * world // total


def tile_box(t: int, tm: int, block) -> tuple[slice, slice]:
    i, j = t % tm, t // tm
    return slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])


def call(
    g, ranks: Ranks, state, rank, m, n, k, bias, two_shot, tail, block, progs, stale=None
) -> tuple[float, str | None]:
    """One call on ``rank``; returns the worst relative error over everything checked (or inf) and the
    timeout message if the kernel reported one."""
    world = ranks.world
    e = int(state[0]) + 1
    parity = e % 2
    As = [torch.randn(m, k, generator=g) for _ in range(world)]
    Ws = [torch.randn(n, k, generator=g) / k**0.5 for _ in range(world)]  # nn.Linear layout: B = W.t()
    b = torch.randn(n, generator=g) if bias else None
    partials = [ops.matmul_sum([As[r]], [Ws[r].t()], b) for r in range(world)]
    reduced = sum(partials[1:], partials[0].clone())
    tm, tn = n_tiles(m, n, block)
    total = tm * tn
    # What the peers pushed into this rank's buffers.
    for src in range(world):
        if src == rank:
            continue
        for t in range(total):
            rs, cs = tile_box(t, tm, block)
            if not two_shot or owner_of(t, total, world) == rank:
                ranks.slot_view(rank, parity * world + src, m, n)[rs, cs] = partials[src][rs, cs]
                ranks.flags[rank][src * MAX_TILES + t] = e
            if two_shot and owner_of(t, total, world) == src:
                ranks.slot_view(rank, 2 * world + parity, m, n)[rs, cs] = reduced[rs, cs]
                ranks.flags[rank][world * MAX_TILES + t] = e
    if stale is not None:  # (flag index) left at the previous epoch
        ranks.flags[rank][stale] = e - 1
    out = torch.full((m, n), float("nan"))
    err = torch.zeros(ERR_WORDS, dtype=torch.int32)
    tail_args, ss_part = None, None
    if tail:
        residual, weight = torch.randn(m, n, generator=g), torch.rand(n, generator=g) + 0.5
        normed = torch.full((m, n), float("nan"))
        tail_args = (normed, residual, weight, 1e-5, tail == "after_cast")
        ss_part = torch.full((m * tn,), float("nan"))
    gemm_ar(
        As[rank], Ws[rank].t(), b, out, ranks.peer_data, ranks.peer_flags, ranks.slot, state, err, rank, world,
        two_shot=two_shot, tail=tail_args, ss_part=ss_part, block=block, num_programs=progs, max_spin=20,
    )  # fmt: skip
    try:
        check_error(err, "test")
    except RuntimeError as ex:
        return float("inf"), str(ex)

    def rel(a, ref):  # NaN (a poisoned value left unwritten) counts as infinitely wrong: max() would drop it
        err = ((a.double() - ref.double()).norm() / ref.double().norm()).item()
        return err if err == err else float("inf")

    worst = 0.0
    if tail:
        h_ref = residual + reduced
        n_ref = ops.rms_norm(h_ref, weight, 1e-5, True, tail == "after_cast")
        worst = max(rel(out, h_ref), rel(normed, n_ref))
    else:
        worst = rel(out, reduced)
    # What this rank pushed: its partial (one-shot: to every peer; two-shot: to the owners) and, two-shot,
    # the reduced tiles it owns.
    for dst in range(world):
        if dst == rank:
            continue
        for t in range(total):
            rs, cs = tile_box(t, tm, block)
            owner = owner_of(t, total, world)
            if not two_shot or owner == dst:
                got = ranks.slot_view(dst, parity * world + rank, m, n)[rs, cs]
                worst = max(worst, rel(got, partials[rank][rs, cs]) if got.numel() else 0.0)
                if int(ranks.flags[dst][rank * MAX_TILES + t]) != e:
                    worst = float("inf")
            if two_shot and owner == rank:
                got = ranks.slot_view(dst, 2 * world + parity, m, n)[rs, cs]
                worst = max(worst, rel(got, reduced[rs, cs]) if got.numel() else 0.0)
                if int(ranks.flags[dst][world * MAX_TILES + t]) != e:
                    worst = float("inf")
    if int(state[0]) != e or int(state[1]) != 0 or int(state[2]) != 0:
        worst = float("inf")
    return worst, None


def case(seed, rank, world, m, n, k, bias, two_shot, tail, block, progs) -> float:
    g = torch.Generator().manual_seed(seed)
    ranks = Ranks(world, m * n + 64)
    state = torch.zeros(4, dtype=torch.int32)
    worst = 0.0
    for _ in range(2):  # epochs 1 and 2: both parities, flags never reset
        err, msg = call(g, ranks, state, rank, m, n, k, bias, two_shot, tail, block, progs)
        if msg:
            raise AssertionError(msg)
        worst = max(worst, err)
    return worst


def stale_case(two_shot: bool) -> str:
    """A flag left at the previous call's epoch must not pass: the wait times out and names the signal."""
    g = torch.Generator().manual_seed(0)
    world, rank, m, n, k, block = 2, 0, 8, 48, 16, (16, 16, 16)
    ranks = Ranks(world, m * n)
    state = torch.zeros(4, dtype=torch.int32)
    call(g, ranks, state, rank, m, n, k, False, two_shot, None, block, 2)
    # Tile 0 is owned by rank 0: its partial from rank 1 is awaited in both variants.
    _, msg = call(g, ranks, state, rank, m, n, k, False, two_shot, None, block, 2, stale=1 * MAX_TILES + 0)
    return msg or "no error"


if __name__ == "__main__":
    seed = int(sys.argv[1])
    b16, b32 = (16, 16, 16), (16, 32, 16)
    results = {
        # (rank, world, m, n, k, bias, two_shot, tail, block, programs)
        "one-shot, rank 0 of 2, ragged m and n, bias": case(seed, 0, 2, 21, 40, 24, True, False, None, b16, 3),
        "one-shot, rank 2 of 4": case(seed + 1, 2, 4, 16, 64, 32, False, False, None, b32, 2),
        "two-shot, rank 1 of 2, ragged": case(seed + 2, 1, 2, 5, 72, 16, True, True, None, b16, 3),
        "two-shot, rank 3 of 4, ragged": case(seed + 3, 3, 4, 17, 64, 16, False, True, None, b16, 4),
        "one-shot + RMSNorm tail": case(seed + 4, 1, 2, 19, 48, 16, True, False, "before_cast", b16, 1),
        "two-shot + tail, weight after cast": case(seed + 5, 0, 2, 7, 80, 32, False, True, "after_cast", b16, 1),
        "two-shot + tail, rank 2 of 3": case(seed + 6, 2, 3, 16, 96, 16, True, True, "before_cast", b32, 1),
        "one-shot, rank 5 of 8": case(seed + 7, 5, 8, 9, 48, 16, True, False, None, b16, 2),
        "two-shot, rank 7 of 8": case(seed + 8, 7, 8, 9, 128, 16, False, True, None, b16, 3),
    }
    results["stale one-shot"] = stale_case(False)
    results["stale two-shot"] = stale_case(True)
    print(json.dumps(results))
