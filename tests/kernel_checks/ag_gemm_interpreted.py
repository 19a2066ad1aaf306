"""Checks of kernels/ag_gemm.py under Triton's CPU interpreter (run by tests/test_ag_gemm_kernel.py in a
subprocess with TRITON_INTERPRET=1, which must be set before Triton compiles anything)."""

from __future__ import annotations

import json
import sys

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch

from fluxcompile.kernels.ag_gemm import ERR_WORDS, ag_gemm, check_error


def case(
    seed: int, rank: int, world: int, rows: int, k: int, widths, bias: bool, chunk: int, block, tma: str = ""
) -> float:
    """tma: "" (pointer loads), "kn" (TMA, weights [K, N]) or "nk" (TMA, weights stored [N, K])."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(rows, k, generator=g) for _ in range(world)]
    slots = torch.full((world, rows, k), float("nan"))
    for src in range(world):
        if src != rank:
            slots[src] = shards[src]  # what the peers pushed
    Bs = [torch.randn(k, n, generator=g) / k**0.5 for n in widths]
    if tma == "nk":
        Bs = [b.t().contiguous().t() for b in Bs]
    biases = [torch.randn(n, generator=g) if bias else None for n in widths]
    flags = torch.ones(world, -(-rows // chunk), dtype=torch.int32)
    err = torch.zeros(ERR_WORDS, dtype=torch.int32)
    outs = [torch.full((world * rows, n), float("nan")) for n in widths]  # poisoned
    a_out = torch.full((world * rows, k), float("nan"))
    ag_gemm(
        shards[rank], slots, flags, Bs, biases, rank, world, chunk, err,
        num_programs=3, block=block, outs=outs, tma=bool(tma), a_out=a_out,
    )  # fmt: skip
    check_error(err, rank, "test")
    worst = 0.0 if torch.equal(a_out, torch.cat(shards)) else float("inf")  # the gathered rows, exactly
    full = torch.cat(shards).double()
    for out, b, bias_i in zip(outs, Bs, biases):
        ref = full @ b.double() + (0 if bias_i is None else bias_i.double())
        worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
    return worst


def timeout_case() -> str:
    rows, k, world, rank = 8, 16, 2, 0
    a = torch.randn(rows, k)
    slots = torch.randn(world, rows, k)
    flags = torch.ones(world, 2, dtype=torch.int32)
    flags[1, 1] = 0  # rank 1's second chunk never arrives
    err = torch.zeros(ERR_WORDS, dtype=torch.int32)
    ag_gemm(
        a, slots, flags, [torch.randn(k, 8)], [None], rank, world, 4, err, num_programs=2, block=(4, 8, 16), max_spin=50
    )
    try:
        check_error(err, rank, "test")
    except RuntimeError as e:
        return str(e)
    return "no error"


if __name__ == "__main__":
    seed = int(sys.argv[1])
    results = {
        # (rank, world, rows, K, widths, bias, chunk rows, tile)
        "2 ranks, 3 weights, bias": case(seed, 0, 2, 40, 32, (24, 40, 8), True, 16, (16, 16, 16)),
        "rank 1 of 2, ragged rows": case(seed + 1, 1, 2, 37, 24, (33,), False, 10, (16, 16, 8)),
        "rank 2 of 4, chunk > tile": case(seed + 2, 2, 4, 20, 16, (16, 16), True, 20, (8, 16, 16)),
        "rank 3 of 4, 4 weights": case(seed + 3, 3, 4, 9, 16, (8, 24, 16, 8), True, 4, (8, 8, 16)),
        "rank 6 of 8, ragged rows": case(seed + 6, 6, 8, 5, 16, (16,), True, 4, (8, 8, 16)),
        "TMA, rank 1 of 2, ragged rows": case(seed + 4, 1, 2, 37, 24, (32,), True, 10, (16, 16, 8), "kn"),
        "TMA, rank 0 of 2, weights [N, K]": case(seed + 5, 0, 2, 40, 32, (24, 40), False, 16, (16, 8, 16), "nk"),
    }
    results["timeout"] = timeout_case()
    print(json.dumps(results))
