"""Checks of kernels/grouped_gemm.py under Triton's CPU interpreter (run by tests/test_moe_kernels.py in a
subprocess with TRITON_INTERPRET=1, which must be set before Triton compiles anything).

The grouped GEMM against ``torch._grouped_mm`` / ``torch.bmm`` (ragged and empty groups, rows past the last group,
gathered rows with padding, up to three weights, both weight layouts, TMA and pointer loads); then one process
plays every rank of a small world: their flag words and symmetric buffers are ordinary tensors in one
allocation each, ``publish`` runs for every rank, and one rank's pull (dispatch) or scatter (combine) launch is
checked against the ``ops`` references: the exchanged rows exactly, the products, what landed in every peer's
receive buffer, the flags it wrote into its peers' words and the counters it reset; the dispatch's permuting copy
(``permuted_pull``: the experts' rows in their order, a flag per block). Last, waits that time out and splits that
disagree, through the error words and ``check_error``.

The interpreter runs a launch's programs one after the other: the fused pull (GEMM tiles waiting for the copy
tiles of other programs) runs with one program. bf16 products are wrong in Triton 3.6's interpreter (``tl.dot``),
so products are checked in fp16 and fp32, bf16 only where rows are moved.

Prints one JSON line: name -> worst relative error (or a message for the error cases).
"""

from __future__ import annotations

import json
import sys

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch

from fluxcompile import ops
from fluxcompile.kernels import grouped_gemm as gg

BLOCK = gg.Variant((16, 16, 16), num_warps=4, num_stages=2)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape:
        return float("inf")
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ragged_offs(g: torch.Generator, R: int, E: int, tail: int = 0) -> torch.Tensor:
    """Group ends over R - tail rows, some groups empty."""
    cuts = torch.sort(torch.randint(0, R - tail + 1, (E - 1,), generator=g)).values
    ends = torch.cat([cuts, torch.tensor([R - tail])])
    if E > 2:
        ends[1] = ends[0]  # an empty group
    return ends.to(torch.int32)


def ref_grouped(x: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    if offs is None:
        return torch.bmm(x.double().view(b.shape[0], -1, x.shape[1]), b.double()).view(x.shape[0], -1)
    out = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        out[lo:hi] = x[lo:hi].double() @ b[e].double()
        lo = hi
    return out


def weights(g, E, K, widths, dtype, layout="kn"):
    Bs = [torch.randn(E, K, n, generator=g) / K**0.5 for n in widths]
    if layout == "nk":  # stored [E, N, K], used transposed (torchtitan's expert weights)
        Bs = [b.transpose(1, 2).contiguous().transpose(1, 2) for b in Bs]
    return [b.to(dtype) for b in Bs]


def gemm_case(
    seed, R, K, E, widths, dtype, *, grouped=True, tail=0, gather=False, layout="kn", tma=False, progs=3, variant=BLOCK
) -> float:
    g = torch.Generator().manual_seed(seed)
    n_a = R + 5 if gather else R
    a = torch.randn(n_a, K, generator=g).to(dtype)
    Bs = weights(g, E, K, widths, dtype, layout)
    offs = ragged_offs(g, R, E, tail) if grouped else None
    row_index = None
    x = a
    if gather:
        row_index = torch.randint(0, n_a, (R,), generator=g)
        row_index[:: max(1, R // 4)] = n_a  # padding rows read zeros
        row_index[1] = -1  # torch's negative indices: -1 is the padding row, -2 the last row
        row_index[2] = -2
        x = ops.gather_rows(a, row_index)
    outs = [torch.full((R, n), float("nan"), dtype=dtype) for n in widths]
    gg.grouped_gemm(a, Bs, outs, offs=offs, row_index=row_index, variant=variant, num_programs=progs, tma=tma)
    rows = int(offs[-1]) if offs is not None else R
    worst = 0.0
    for out, b in zip(outs, Bs):
        ref = ref_grouped(x, b, offs)
        worst = max(worst, rel(out[:rows], ref[:rows]))
        if grouped and offs is not None and not tma:  # torch's own grouped_mm agrees
            tg = torch._grouped_mm(x.float(), b.float(), offs=offs)
            worst = max(worst, rel(out[:rows], tg[:rows]))
    return worst


# --- a small world in one process ----------------------------------------------------------------------------


class World:
    """Every rank's flag words and data buffers as slices of one allocation each (addresses as the peers see
    them), and the routing: ``counts[s][d]`` rows rank s sends to rank d."""

    def __init__(self, counts: list[list[int]], data_elems: int, dtype: torch.dtype, max_spin: int = 2000):
        self.world = len(counts)
        self.counts = counts
        self.flags = torch.zeros(self.world, gg.FLAG_WORDS, dtype=torch.int32)
        self.data = torch.full((self.world, max(data_elems, 1)), float("nan"), dtype=dtype)
        self.peer_flags = torch.tensor([self.flags[r].data_ptr() for r in range(self.world)], dtype=torch.int64)
        self.bases = torch.tensor([self.data[r].data_ptr() for r in range(self.world)], dtype=torch.int64)
        self.errs = [torch.zeros(gg.ERR_WORDS, dtype=torch.int32) for _ in range(self.world)]
        self.max_spin = max_spin

    def sig(self, r: int) -> gg.Signals:
        return gg.Signals(self.flags[r], self.peer_flags, self.errs[r], r, self.world, self.max_spin)

    def sent(self, s: int) -> list[int]:
        return list(self.counts[s])

    def received(self, r: int) -> list[int]:
        return [self.counts[s][r] for s in range(self.world)]


def prefix(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out


def staged(w, g, counts, rank, K, dtype):
    """A call's rows on every rank of ``w``: (every rank's rows, what ``rank`` receives from each, those rows in
    source order); the peers' rows in their send buffers, every rank's splits published."""
    world = len(counts)
    As = [torch.randn(sum(counts[s]), K, generator=g).to(dtype) for s in range(world)]
    for s in range(world):
        if s != rank:
            w.data[s][: As[s].numel()] = As[s].reshape(-1)  # its send buffer
        gg.publish(w.sig(s), w.sent(s))
    recv = w.received(rank)
    exchanged = torch.cat([As[s][prefix(counts[s])[rank] : prefix(counts[s])[rank] + recv[s]] for s in range(world)])
    return As, recv, exchanged


def permuted_case(seed, counts, rank, K, dtype, *, progs, calls=2, gather=True, exchanged_too=False) -> float:
    """The dispatch's permuting copy at ``rank`` (``gg.permuted_pull``): the experts' rows in a random order with
    padding rows (``gather``; else the exchanged rows as they are), with ``exchanged_too`` the exchanged rows in
    source order too, every value exact, every block flag at the call's epoch, the peers told ``done``, the finish
    counter reset; two calls in a row (the epochs advance)."""
    g = torch.Generator().manual_seed(seed)
    world = len(counts)
    worst = 0.0
    w = World(counts, max(sum(c) for c in counts) * K, dtype)
    for call in range(calls):
        As, _, exchanged = staged(w, g, counts, rank, K, dtype)
        n = exchanged.shape[0]
        row_index, x = None, exchanged
        if gather:
            row_index = torch.cat([torch.randperm(n, generator=g), torch.tensor([n, -1, n])])
            row_index = row_index[torch.randperm(row_index.numel(), generator=g)]
            x = torch.cat([exchanged, exchanged.new_zeros(1, K)])[row_index.clamp(max=n).where(row_index >= 0, n)]
        x_out = torch.full((x.shape[0], K), float("nan"), dtype=dtype)
        ex_out = torch.full((n, K), float("nan"), dtype=dtype) if exchanged_too else None
        blocks = -(-x.shape[0] // gg.COPY_M)
        flags = torch.zeros(blocks + 1, dtype=torch.int32)
        gg.permuted_pull(gg.Pull(As[rank], w.bases, x_out, n), row_index, flags, w.sig(rank), progs, ex_out)
        gg.check_error(w.errs[rank], "test")
        e = call + 1
        if not torch.equal(x_out, x) or flags[:blocks].tolist() != [e] * blocks or int(flags[blocks]) != 0:
            worst = float("inf")
        if ex_out is not None and not torch.equal(ex_out, exchanged):
            worst = float("inf")
        for p in range(world):
            if p != rank and int(w.flags[p][gg.DONE + rank]) != e:
                worst = float("inf")  # the peer was not told its send buffer is free
        mine = w.flags[rank]
        if int(mine[gg.STATE]) != e or int(mine[gg.STATE + 2]) != 0:
            worst = float("inf")
    return worst


def pull_case(
    seed, counts, rank, K, E, widths, dtype, *, fused, gather, progs, calls=2, products=True, copiers=0,
    by_source=False,
) -> float:
    """The dispatch at ``rank``: every rank publishes its input splits, the rank pulls and multiplies (fused on
    one program, or ordered: ``copiers`` of ``progs`` programs copy). Two calls in a row (epochs advance,
    counters reset). ``by_source``: each group's gathered rows in source order (as an [expert][source]
    permutation leaves them), and the ordered dispatch's segment table is checked against them."""
    g = torch.Generator().manual_seed(seed)
    world = len(counts)
    worst = 0.0
    w = World(counts, max(sum(c) for c in counts) * K, dtype)
    for call in range(calls):
        As, recv, exchanged = staged(w, g, counts, rank, K, dtype)
        n = exchanged.shape[0]
        a_out = torch.full((n, K), float("nan"), dtype=dtype)
        pull = gg.Pull(As[rank], w.bases, a_out, n)
        Bs = weights(g, E, K, widths, dtype)
        row_index = None
        x = exchanged
        R = n
        if gather:  # [source][expert] -> any order, plus padding rows
            perm = torch.randperm(n, generator=g)
            row_index = torch.cat([perm, torch.tensor([n, n])])
            x = torch.cat([exchanged, exchanged.new_zeros(1, K)])[row_index]
            R = n + 2
        offs = ragged_offs(g, R, E)
        # The source of each exchanged row (the padding row n: after every source).
        src = torch.cat([torch.repeat_interleave(torch.arange(world), torch.tensor(recv)), torch.tensor([world])])
        if by_source:  # each group's rows sorted by source (padding last)
            lo = 0
            for end in offs.tolist():
                part = row_index[lo:end]
                row_index[lo:end] = part[torch.sort(src[part.clamp(max=n)], stable=True).indices]
                lo = end
            x = torch.cat([exchanged, exchanged.new_zeros(1, K)])[row_index]
        if fused:
            outs = gg.grouped_gemm(
                a_out, Bs, offs=offs, row_index=row_index, pull=pull, sig=w.sig(rank), variant=BLOCK,
                num_programs=progs if copiers else 1, copiers=copiers,
            )  # fmt: skip
        else:
            gg.grouped_gemm(a_out, Bs, pull=pull, gemm=False, sig=w.sig(rank), variant=BLOCK, num_programs=progs)
            outs = []
            if products:
                outs = gg.grouped_gemm(a_out, Bs, offs=offs, row_index=row_index, variant=BLOCK, num_programs=progs)
        gg.check_error(w.errs[rank], "test")
        worst = max(worst, 0.0 if torch.equal(a_out, exchanged) else float("inf"))
        for out, b in zip(outs, Bs):
            worst = max(worst, rel(out, ref_grouped(x, b, offs)))
        e = call + 1
        for p in range(world):
            done = int(w.flags[p][gg.DONE + rank])
            if p != rank and done != e:
                worst = float("inf")  # the peer was not told its send buffer is free
        if by_source:  # segment g, s starts at the group's first row from source s or later
            lo = 0
            for grp, end in enumerate(offs.tolist()):
                keys = src[row_index[lo:end].clamp(max=n)]
                want = [lo + int((keys < s).sum()) for s in range(world)] + [end]
                got = w.flags[rank][gg.TABLE + grp * (world + 1) : gg.TABLE + (grp + 1) * (world + 1)].tolist()
                if got != want:
                    worst = float("inf")
                lo = end
        mine = w.flags[rank]
        if int(mine[gg.STATE]) != e or int(mine[gg.STATE + 2]) != 0 or mine[gg.ARRIVED : gg.ARRIVED + world].any():
            worst = float("inf")  # epoch, finish counter, arrival counters
    return worst


def scatter_case(seed, counts, rank, K, E, N, dtype, *, gather, accumulate, progs, calls=2) -> float:
    """The combine at ``rank``: every rank publishes its output splits (where its senders' rows go), the rank
    multiplies and scatters into every rank's receive buffer; checked against ops.scatter_rows + the exchange."""
    g = torch.Generator().manual_seed(seed)
    world = len(counts)
    worst = 0.0
    # Rank r receives from s what it sent to s in the dispatch: counts[r][s]; out splits of d: counts[d][:].
    rows_out = [sum(counts[d]) for d in range(world)]
    w = World(counts, max(rows_out) * N, torch.float32 if accumulate else dtype)
    for call in range(calls):
        w.data.fill_(0.0 if (gather or accumulate) else float("nan"))  # each rank zeroes its own before publishing
        for d in range(world):
            gg.publish(w.sig(d), [counts[d][s] for s in range(world)])
        y_rows = sum(counts[s][rank] for s in range(world))  # Y: what this rank got in the dispatch, by source
        in_split = [counts[d][rank] for d in range(world)]
        R = y_rows + (3 if gather else 0)
        h = torch.randn(R, K, generator=g).to(dtype)
        b = weights(g, E, K, [N], dtype)[0]
        offs = ragged_offs(g, R, E)
        row_index = None
        if gather:
            perm = torch.randperm(y_rows, generator=g)
            row_index = torch.cat([perm, torch.tensor([y_rows, y_rows, y_rows])])
            if accumulate:
                row_index[-2] = int(perm[0])  # a repeated row: added twice
        gg.grouped_gemm(
            h, [b], offs=offs, row_index=row_index,
            scatter=gg.Scatter(w.bases, y_rows, accumulate), sig=w.sig(rank), variant=BLOCK, num_programs=progs,
        )  # fmt: skip
        gg.check_error(w.errs[rank], "test")
        P = ref_grouped(h, b, offs)
        Y = ops.scatter_rows(P, row_index, y_rows, accumulate) if gather else P[:y_rows]
        starts = prefix(in_split)
        for d in range(world):
            at = prefix([counts[d][s] for s in range(world)])[rank]
            got = w.data[d][: rows_out[d] * N].view(rows_out[d], N)[at : at + in_split[d]]
            want = Y[starts[d] : starts[d] + in_split[d]]
            if want.numel():
                worst = max(worst, rel(got, want))
            if int(w.flags[d][gg.DONE + rank]) != call + 1:
                worst = float("inf")  # the destination was not told
        if int(w.flags[rank][gg.STATE + 2]) != 0:
            worst = float("inf")
    return worst


def publish_case() -> float:
    counts = [[3, 0, 5], [1, 2, 0], [0, 0, 7]]
    w = World(counts, 8, torch.float16)
    for call in (1, 2):
        for s in range(3):
            gg.publish(w.sig(s), counts[s])
        for p in range(3):
            for s in range(3):
                want = (prefix(counts[s])[p], counts[s][p])
                got = (int(w.flags[p][gg.INFO + 2 * s]), int(w.flags[p][gg.INFO + 2 * s + 1]))
                if got != want or int(w.flags[p][gg.READY + s]) != call or int(w.flags[s][gg.STATE]) != call:
                    return float("inf")
    big = [2**30 - 1, 0, 12345, 1]  # the packing of large counts
    w = World([big, big, big, big], 8, torch.float16)
    gg.publish(w.sig(1), big)
    return 0.0 if int(w.flags[3][gg.INFO + 2]) == prefix(big)[3] and int(w.flags[0][gg.INFO + 3]) == big[0] else 1.0


def error_of(w: World, rank: int) -> str:
    try:
        gg.check_error(w.errs[rank], "test")
    except RuntimeError as e:
        return str(e)
    return "no error"


def timeout_pull() -> str:
    counts = [[2, 3], [4, 1]]
    w = World(counts, 16 * 8, torch.float16, max_spin=50)
    gg.publish(w.sig(0), counts[0])  # rank 1 never publishes
    a_out = torch.empty(6, 8, dtype=torch.float16)
    pull = gg.Pull(torch.randn(5, 8).half(), w.bases, a_out, 6)
    Bs = weights(torch.Generator().manual_seed(0), 2, 8, [16], torch.float16)
    gg.grouped_gemm(a_out, Bs, pull=pull, sig=w.sig(0), variant=BLOCK, num_programs=1)
    return error_of(w, 0)


def timeout_scatter() -> str:
    counts = [[2, 3], [4, 1]]
    w = World(counts, 16 * 8, torch.float16, max_spin=50)
    gg.publish(w.sig(0), [2, 4])  # rank 1 never publishes
    h = torch.randn(6, 8).half()
    b = weights(torch.Generator().manual_seed(0), 2, 8, [8], torch.float16)[0]
    offs = torch.tensor([3, 6], dtype=torch.int32)
    gg.grouped_gemm(h, [b], offs=offs, scatter=gg.Scatter(w.bases, 6), sig=w.sig(0), variant=BLOCK, num_programs=2)
    return error_of(w, 0)


def timeout_done() -> str:
    w = World([[1, 1], [1, 1]], 8, torch.float16, max_spin=50)
    gg.publish(w.sig(1), [1, 1])
    gg.wait_done(w.sig(1), 5, False)  # nobody delivered
    return error_of(w, 1)


def splits_disagree() -> str:
    counts = [[2, 3], [4, 1]]
    w = World(counts, 16 * 8, torch.float16, max_spin=50)
    for s in range(2):
        gg.publish(w.sig(s), counts[s])
    a_out = torch.empty(8, 8, dtype=torch.float16)  # rank 0 receives 2 + 4 = 6 rows, but expects 8
    pull = gg.Pull(torch.randn(5, 8).half(), w.bases, a_out, 8)
    gg.grouped_gemm(a_out, [torch.randn(2, 8, 8).half()], pull=pull, gemm=False, sig=w.sig(0), variant=BLOCK)
    return error_of(w, 0)


if __name__ == "__main__":
    seed = int(sys.argv[1])
    f16, f32, bf16 = torch.float16, torch.float32, torch.bfloat16
    results = {
        "grouped, ragged + empty groups, 2 weights, fp16": gemm_case(seed, 70, 32, 4, (24, 40), f16),
        "grouped, rows past the last group, fp32": gemm_case(seed + 1, 45, 16, 3, (16,), f32, tail=7),
        "grouped, 3 weights, one program": gemm_case(seed + 2, 40, 32, 3, (16, 8, 24), f16, progs=1),
        "bmm (equal groups)": gemm_case(seed + 3, 48, 16, 4, (24,), f16, grouped=False),
        "gather with padding": gemm_case(seed + 4, 37, 32, 3, (16, 16), f16, gather=True),
        "TMA, weights [E, K, N]": gemm_case(seed + 5, 50, 32, 3, (32,), f32, tma=True),
        "TMA, weights [E, N, K], ragged K": gemm_case(seed + 6, 50, 24, 3, (24, 16), f32, tma=True, layout="nk"),
        "TMA weights, gathered A": gemm_case(seed + 7, 33, 32, 2, (16,), f32, tma=True, gather=True),
        "weights [E, N, K], pointer loads": gemm_case(seed + 8, 30, 16, 2, (8,), f16, layout="nk"),
        "publish": publish_case(),
        "pull fused, gather, world 2": pull_case(
            seed + 9, [[3, 5], [4, 0]], 0, 32, 2, (16, 24), f16, fused=True, gather=True, progs=1
        ),
        "pull fused, world 3, rank 2": pull_case(
            seed + 10, [[3, 0, 6], [1, 2, 9], [0, 4, 5]], 2, 16, 3, (16,), f16, fused=True, gather=False, progs=1
        ),
        "pull split, gather, world 3, rank 1": pull_case(
            seed + 11, [[3, 0, 6], [1, 2, 9], [40, 4, 5]], 1, 16, 2, (16,), f16, fused=False, gather=True, progs=3
        ),
        "pull moves bf16 rows exactly": pull_case(
            seed + 12, [[2, 33], [35, 1]], 1, 16, 1, (16,), bf16, fused=False, gather=False, progs=2, products=False
        ),
        "pull ordered, gather, world 3, rank 1": pull_case(
            seed + 17, [[3, 0, 6], [1, 20, 9], [40, 4, 5]], 1, 16, 3, (16, 24), f16, fused=True, gather=True, progs=3,
            copiers=1,
        ),
        "pull ordered, [expert][source] rows, world 3, rank 2": pull_case(
            seed + 19, [[3, 0, 26], [1, 20, 9], [40, 4, 25]], 2, 16, 3, (16,), f16, fused=True, gather=True, progs=3,
            copiers=1, by_source=True,
        ),
        "pull ordered, world 2, rank 0, own rows only in some tiles": pull_case(
            seed + 18, [[30, 5], [4, 0]], 0, 32, 2, (16,), f16, fused=True, gather=False, progs=2, copiers=1
        ),
        "world 1": pull_case(seed + 13, [[9]], 0, 16, 2, (16,), f16, fused=True, gather=True, progs=1),
        "scatter, world 2": scatter_case(
            seed + 14, [[3, 5], [4, 6]], 0, 16, 2, 24, f16, gather=False, accumulate=False, progs=3
        ),
        "scatter, gather, world 3": scatter_case(
            seed + 15, [[3, 0, 6], [1, 2, 9], [7, 4, 5]], 1, 16, 3, 16, f16, gather=True, accumulate=False, progs=2
        ),
        "scatter, accumulate, world 3": scatter_case(
            seed + 16, [[3, 0, 6], [1, 2, 9], [7, 4, 5]], 2, 16, 2, 16, f16, gather=True, accumulate=True, progs=2
        ),
    }
    f16 = torch.float16
    results["permuted pull, world 2"] = permuted_case(seed + 19, [[30, 25], [17, 40]], 0, 16, f16, progs=2)
    results["permuted pull, world 3, bf16"] = permuted_case(
        seed + 20, [[3, 20, 6], [11, 2, 9], [7, 14, 5]], 1, 24, torch.bfloat16, progs=3
    )
    results["permuted pull, exchanged rows too, world 3"] = permuted_case(
        seed + 21, [[3, 20, 6], [11, 2, 9], [7, 14, 5]], 2, 16, f16, progs=2, exchanged_too=True
    )
    results["permuted pull, no row index, world 2"] = permuted_case(
        seed + 22, [[30, 25], [17, 40]], 1, 16, f16, progs=3, gather=False
    )
    results["timeout pull"] = timeout_pull()
    results["timeout scatter"] = timeout_scatter()
    results["timeout done"] = timeout_done()
    results["splits disagree"] = splits_disagree()
    print(json.dumps(results))
