"""The MoE dispatch and combine protocols (lowerings/all_to_all/triton.py) between simulated ranks on CPU, their
kernels under Triton's interpreter (run by tests/test_moe_kernels.py in a subprocess with TRITON_INTERPRET=1).

Each rank is a thread making its calls in order, over the symmetric-memory stand-in of the one-GPU harness
(fluxcompile/testing/one_gpu_ranks.py, on CPU tensors); torch ops run as the threads issue them. The interpreter
runs one launch at a time, so launches pass a turnstile: every rank's i-th launch runs after every rank's
(i-1)-th and after the i-th of the ranks before it. The protocol must never need a peer's launch of the same or a
later position; if it did, a wait would time out (``max_spin`` is small) and the call raise. A sequence of calls
with changing routing and shapes (grouped with row_index and padding, three weights, accumulate with a repeated
row, bmm with equal splits, 3-D operands), the dispatch's variants in turn over the same workspaces, is checked on
every rank against the ops references over an exchange computed by hand. Last, a rank whose peer never calls gets
an error naming the rank and the signal.

Prints one JSON line: case -> worst relative error, or a message.
"""

from __future__ import annotations

import json
import sys
import threading

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch

from fluxcompile import ops
from fluxcompile.kernels import grouped_gemm as gg
from fluxcompile.lowerings.all_to_all import triton as moe
from fluxcompile.symm_mem import Comm
from fluxcompile.testing import launches
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks, Turnstile

DT = torch.float16  # bf16 products are wrong in Triton 3.6's interpreter
TILE = "tiny"
gg.VARIANTS[TILE] = gg.Variant((16, 32, 16), num_warps=4, num_stages=2)  # two weights: 16 columns each


def simulate(world: int, calls, data_bytes: int, progs: dict[str, int], max_spin: int = 5000):
    """Run ``calls[i](rank, comms)`` on every rank (a thread each); their results per call and rank."""
    gate = Turnstile(world, timeout_s=60.0)
    with gate.patch(launches.MOE):
        comms = []
        for tag in ("dispatch", "combine"):
            ranks = OneGpuRanks(world, data_bytes, gg.FLAG_BYTES, tag=tag, device="cpu")
            comms.append([
                Comm(data=ranks.data.ranks[r], flags=ranks.flags.ranks[r], errors=moe.make_errors(torch.device("cpu")),
                     group_name="test", sm_count=progs[tag], init_flags=ranks.init_flags, max_spin=max_spin)
                for r in range(world)
            ])  # fmt: skip
        for r in range(world):  # every rank's flags before any rank runs (symm_mem.init_flags has a barrier)
            moe.signals(comms[0][r])
            moe.signals(comms[1][r])
        results = [[None] * world for _ in calls]
        failures = []

        def rank_thread(r: int) -> None:
            with gate.rank(r):  # a rank that fails returns: the others no longer wait for its turns
                try:
                    for i, call in enumerate(calls):
                        results[i][r] = call(r, comms[0][r], comms[1][r])
                except BaseException as e:
                    failures.append(f"rank {r}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=rank_thread, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        if any(t.is_alive() for t in threads):
            failures.append("a simulated rank is still running")
        return results, failures


def prefix(xs):
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def exchange(parts: list[torch.Tensor], sends: list[list[int]], r: int) -> torch.Tensor:
    """What rank r receives: rank s's rows for r, in source order (all_to_all_single by hand)."""
    pieces = [parts[s][prefix(sends[s])[r] : prefix(sends[s])[r] + sends[s][r]] for s in range(len(parts))]
    return torch.cat(pieces)


def ragged_offs(g, R: int, E: int) -> torch.Tensor:
    cuts = torch.sort(torch.randint(0, R + 1, (E - 1,), generator=g)).values
    return torch.cat([cuts, torch.tensor([R])]).to(torch.int32)


def scenario(world: int, seed: int, dispatch_variants: tuple[str, ...]) -> tuple[float, list[str]]:
    """Round i's dispatch runs ``dispatch_variants[i % len]`` (the fused one on one program: every program resident
    means one at a time under the interpreter)."""
    g = torch.Generator().manual_seed(seed)
    K, F, E = 32, 48, 3
    plans = []  # per round: routing counts[s][d], weights, inputs per rank

    def routing(lo: int, hi: int) -> list[list[int]]:
        c = torch.randint(lo, hi, (world, world), generator=g)
        if world > 1:
            c[0, 1] = 0  # an empty exchange
        return c.tolist()

    rounds = [
        dict(kind="grouped", counts=routing(0, 7), weights=2, pad=2),
        dict(kind="grouped", counts=routing(3, 12), weights=3, pad=0),
        dict(kind="grouped-acc", counts=routing(0, 9), weights=2, pad=1),
        dict(kind="bmm", counts=[[E * 2] * world for _ in range(world)], weights=2, pad=0),
    ]
    for rd in rounds:
        counts = rd["counts"]
        As = [torch.randn(sum(counts[s]), K, generator=g).to(DT) for s in range(world)]
        w = [torch.randn(E, K, F, generator=g).to(DT) / K**0.5 for _ in range(rd["weights"])]
        if rd["kind"] == "grouped":  # torchtitan's layout: stored [E, F, K], used transposed
            w = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in w]
        w2 = [(torch.randn(E, F, K, generator=g) / F**0.5).to(DT) for _ in range(world)]
        per_rank = []
        for r in range(world):
            recv = [counts[s][r] for s in range(world)]
            n = sum(recv)
            if rd["kind"] == "bmm":
                row_index, offs, R = None, None, n
            else:
                row_index = torch.cat([torch.randperm(n, generator=g), torch.full((rd["pad"],), n)])
                R = n + rd["pad"]
                offs = ragged_offs(g, R, E)
            per_rank.append(dict(recv=recv, row_index=row_index, offs=offs, R=R))
        plans.append(dict(rd, As=As, w=w, w2=w2, ranks=per_rank))

    def call(i: int, phase: str, r: int, dcomm, ccomm):
        p = plans[i]
        counts, pr = p["counts"], p["ranks"][r]
        if phase == "dispatch":
            variant = dispatch_variants[i % len(dispatch_variants)]
            dcomm.sm_count = 1 if variant == TILE else 3  # ordered: one program copies, two multiply
            A = p["As"][r]
            send, recv = counts[r], pr["recv"]
            if p["kind"] == "bmm":  # equal splits given as empty lists, A as [W, rows, K] 3-D
                A = A.view(world, -1, K)
                send, recv = [], []
            return moe.all_to_all_matmul_on(dcomm, A, p["w"], recv, send, pr["offs"], pr["row_index"], variant=variant)
        # combine: the products of what came in go back where they came from
        R = pr["R"]
        h = torch.randn(R, F, generator=torch.Generator().manual_seed(seed * 100 + i * 10 + r)).to(DT)
        if p["kind"] == "bmm":
            h = h.view(E, -1, F)
        y_rows = sum(pr["recv"])
        acc = p["kind"] == "grouped-acc"
        row_index = pr["row_index"]
        if acc and row_index is not None and row_index.numel() > 1:
            row_index = row_index.clone()
            row_index[-1] = row_index[0]  # a row added twice
        out_shape = [y_rows, K]
        return h, row_index, moe.matmul_all_to_all_on(
            ccomm, h, p["w2"][r], out_shape, counts[r], pr["recv"], pr["offs"], row_index, acc, variant=TILE
        )  # fmt: skip

    calls = []
    for i in range(len(plans)):
        calls.append(lambda r, d, c, i=i: call(i, "dispatch", r, d, c))
        calls.append(lambda r, d, c, i=i: call(i, "combine", r, d, c))
    max_rows = max(sum(c) for p in plans for c in p["counts"]) + 8
    results, failures = simulate(world, calls, max_rows * K * 4, {"dispatch": 1, "combine": 3})
    if failures:
        return float("inf"), failures
    worst = 0.0
    for i, p in enumerate(plans):
        counts = p["counts"]
        dispatched, combined = results[2 * i], results[2 * i + 1]
        for r in range(world):
            pr = p["ranks"][r]
            A_ex, outs = dispatched[r]
            want = exchange(p["As"], counts, r)
            worst = max(worst, 0.0 if torch.equal(A_ex.reshape(-1, K), want) else float("inf"))
            x = ops.gather_rows(want, pr["row_index"])
            for out, w in zip(outs, p["w"]):
                ref = ops.expert_matmul(x.float(), w.float(), None, pr["offs"])
                rows = int(pr["offs"][-1]) if pr["offs"] is not None else ref.shape[0]
                worst = max(worst, rel(out.reshape(ref.shape)[:rows], ref[:rows]))
        Ys = []
        for r in range(world):
            h, row_index, _ = combined[r]
            pr = p["ranks"][r]
            P = ops.expert_matmul(h.float(), p["w2"][r].float(), None, pr["offs"]).reshape(-1, K)
            if pr["offs"] is not None:
                P[int(pr["offs"][-1]) :] = 0  # rows past the last group are unspecified; none reach Y here
            Ys.append(ops.scatter_rows(P, row_index, sum(pr["recv"]), p["kind"] == "grouped-acc"))
        back = [[counts[d][s] for d in range(world)] for s in range(world)]  # rank s sends back what it got
        for r in range(world):
            worst = max(worst, rel(combined[r][2], exchange(Ys, back, r)))
    return worst, []


def peer_missing() -> str:
    """World 2, only rank 0 calls: its wait for rank 1's ready flag times out into the error words."""
    ranks = OneGpuRanks(2, 1 << 12, gg.FLAG_BYTES, tag="missing", device="cpu")
    comm = Comm(data=ranks.data.ranks[0], flags=ranks.flags.ranks[0], errors=moe.make_errors(torch.device("cpu")),
                group_name="test", sm_count=1, init_flags=ranks.init_flags, max_spin=50)  # fmt: skip
    A = torch.randn(6, 16).to(DT)
    w = [torch.randn(2, 16, 16).to(DT)]
    try:
        moe.all_to_all_matmul_on(comm, A, w, [3, 3], [2, 4], torch.tensor([2, 6], dtype=torch.int32), variant=TILE)
    except RuntimeError as e:
        return str(e)
    return "no error"


if __name__ == "__main__":
    seed = int(sys.argv[1])
    out = {}
    for name, world, variants in (
        ("world 2, fused", 2, (TILE,)),
        ("world 3, split and fused in turn", 3, (f"{TILE}{moe.SPLIT}", TILE)),
        ("world 2, ordered", 2, (f"{TILE}{moe.ORDERED}1",)),
        ("world 1", 1, (TILE,)),
    ):
        worst, failures = scenario(world, seed, variants)
        out[name] = worst if not failures else "; ".join(failures)
    out["peer missing"] = peer_missing()
    print(json.dumps(out))
