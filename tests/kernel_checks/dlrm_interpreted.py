"""Checks of kernels/embedding_bag.py and its protocol (lowerings/embedding_bag_all_to_all/triton.py) under Triton's
CPU interpreter (run by tests/test_dlrm_kernel.py in a subprocess with TRITON_INTERPRET=1, which must be set before
Triton compiles anything).

* pooling alone (one rank, the output written directly) against ``ops.pooled_rows``: ragged bags with empty ones,
  tables of different row counts, ``include_last_offset`` both ways, sum and mean, int32/int64 indices and offsets,
  fp32/bf16/fp16, a dim that is not a power of two, column blocks smaller than the dim, the aligned path;
* the whole protocol between ranks simulated in one process: every rank's symmetric workspaces are slices of one
  CPU allocation (testing/one_gpu_ranks.SimulatedWorkspace), its launches run in lockstep with the other ranks'
  (the interpreter runs one kernel at a time; a rank's pooling never waits, so lockstep is an order the GPU may
  take). Equal, uniform and unequal splits (a zero split included), 2-D and 3-D ``out_shape``, a split unit of one
  segment, several calls (both halves of the receive buffers, epochs and counters growing), against the reference
  computed per rank by hand; the counters and epochs after the calls;
* the bounded waits: a peer that never pools (rows) and never publishes (offsets) -> the error words, in words;
* the capturable table fill.

Prints one JSON line: {check name: worst relative error} plus "timeouts": [messages].
"""

from __future__ import annotations

import json
import sys

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch
from lockstep import lockstep

from fluxcompile import ops
from fluxcompile.kernels import embedding_bag as eb
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo
from fluxcompile.symm_mem import Comm, ErrorWords
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error; NaN (a poisoned value left unwritten) counts as infinitely wrong."""
    if a.shape != ref.shape:
        return float("inf")
    den = ref.double().norm().item() or 1.0
    err = (a.double() - ref.double()).norm().item() / den
    return err if err == err else float("inf")


def bags_of(g, bags: int, max_len: int, rows: int, last: bool, idx_dtype, off_dtype, empty: bool = True):
    lens = torch.randint(0, max_len + 1, (bags,), generator=g)
    if empty and bags > 2:
        lens[1] = 0
        lens[-1] = 0  # the last bag empty: its end is the index count (include_last_offset=False)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    idx = torch.randint(0, rows, (int(offs[-1]),), generator=g)
    return idx.to(idx_dtype), (offs if last else offs[:-1]).to(off_dtype)


def reference(weights, indices, offsets, mode, last) -> torch.Tensor:
    """``pooled_rows`` in fp32 (aten's CPU embedding_bag takes int64 indices and offsets alike)."""
    return ops.pooled_rows(
        [w.float() for w in weights], [i.long() for i in indices], [o.long() for o in offsets], mode, last
    )


def bookkeeping_of(indices: torch.Tensor, offsets: torch.Tensor, bags: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's bag and each bag's size, by hand."""
    starts = offsets[:bags].long()
    ends = torch.cat([offsets[1:bags].long(), torch.tensor([indices.numel()])]) if offsets.numel() == bags else (
        offsets[1 : bags + 1].long()
    )  # fmt: skip
    sizes = (ends - starts).clamp_min(0)
    return torch.repeat_interleave(torch.arange(bags), sizes), sizes


class Case:
    """One rank's operands."""

    def __init__(self, g, bags, rows, dim, dtype, last, idx_dtype, off_dtype, max_len=5):
        self.weights = [torch.randn(n, dim, generator=g).to(dtype) for n in rows]
        pairs = [bags_of(g, bags, max_len, n, last, idx_dtype, off_dtype) for n in rows]
        self.indices = [p[0] for p in pairs]
        self.offsets = [p[1] for p in pairs]


def check_pool(g, results: dict) -> None:
    cases = [
        # name, bags, table rows, dim, dtype, index dtype, offset dtype, variant
        ("fp32-i64", 9, [13, 40, 7], 20, torch.float32, torch.int64, torch.int64, eb.Variant(4, 2, 4)),
        ("fp32-i32", 6, [5, 9], 24, torch.float32, torch.int32, torch.int32, eb.Variant(8, 4, 4)),
        ("bf16-mixed", 7, [11, 3, 30], 16, torch.bfloat16, torch.int32, torch.int64, eb.VARIANTS["b8u4w4"]),
        ("fp16-dblocks", 5, [8, 21], 40, torch.float16, torch.int64, torch.int32, eb.Variant(2, 2, 4, block_d=16)),
    ]
    for name, bags, rows, dim, dtype, it, ot, v in cases:
        for last in (True, False):
            for mode in (0, 1):
                c = Case(g, bags, rows, dim, dtype, last, it, ot)
                out = torch.full((bags, len(rows) * dim), float("nan"), dtype=dtype)
                tables = lo.pointer_table(c.weights, c.indices, c.offsets)
                aligned = dim % 16 == 0 and all(w.data_ptr() % 16 == 0 for w in c.weights)
                eb.pool(
                    tables, out, bags, len(rows), dim, mode=mode, include_last_offset=last, index_dtype=it,
                    offset_dtype=ot, variant=v, dst_off=torch.zeros(1, dtype=torch.int64),
                    src_start=torch.tensor([0, bags * len(rows)]), aligned=aligned,
                )  # fmt: skip
                ref = reference(c.weights, c.indices, c.offsets, mode, last)
                key = f"pool {name}"
                results[key] = max(results.get(key, 0.0), rel(out, ref) / TOL[dtype] * 1e-5)
                # The protocol's one-rank path (no comm) takes the same kernel through the layout.
                full = lo.embedding_bag_all_to_all_on(
                    None, c.weights, c.indices, c.offsets, mode, last, [bags, len(rows) * dim], [], [], variant="b4u8w4"
                )  # fmt: skip
                key = f"one rank {name}"
                results[key] = max(results.get(key, 0.0), rel(full, ref) / TOL[dtype] * 1e-5)
                if it == ot:  # the bookkeeping (indices and offsets of one dtype): each position's bag, bag sizes
                    book = lo.bookkeeping_tensors(c.indices, c.offsets)
                    for t in book[1]:
                        t.fill_(-7)  # the last offset's bag size stays unwritten, as aten leaves it
                    lo.embedding_bag_all_to_all_on(
                        None, c.weights, c.indices, c.offsets, mode, last, [bags, len(rows) * dim], [], [], book=book
                    )  # fmt: skip
                    ok = all(
                        torch.equal(o2b.long(), want_o2b) and torch.equal(size[:bags].long(), want_size)
                        and (not last or int(size[-1]) == -7) and m.numel() == 0 and o2b.dtype == it
                        for o2b, size, m, (want_o2b, want_size) in zip(*book, (
                            bookkeeping_of(i, o, bags) for i, o in zip(c.indices, c.offsets)))
                    )  # fmt: skip
                    results[f"bookkeeping {name}"] = 0.0 if ok else float("inf")
                # A padding index (a row the bags meet often): it pools nothing, counts in no bag's size.
                pad = int(c.indices[0][0]) if c.indices[0].numel() else 0
                book = lo.bookkeeping_tensors(c.indices, c.offsets) if it == ot else None
                got = lo.embedding_bag_all_to_all_on(
                    None, c.weights, c.indices, c.offsets, mode, last, [bags, len(rows) * dim], [], [], book=book,
                    padding_idx=pad,
                )  # fmt: skip
                want = ops._bags([w.float() for w in c.weights], [i.long() for i in c.indices],
                                 [o.long() for o in c.offsets], mode, last, pad)  # fmt: skip
                key = f"padding {name}"
                err = rel(got, want[0]) / TOL[dtype] * 1e-5
                # (aten's CPU kernel counts bag sizes in mean pooling only; its CUDA kernel, which ours follows, always)
                if book is not None and mode == 1 and not all(
                    torch.equal(size[:bags].long(), want_size[:bags]) for size, want_size in zip(book[1], want[2])
                ):
                    err = float("inf")
                results[key] = max(results.get(key, 0.0), err)
                if mode == 0:  # per-sample weights (sum pooling only, as aten)
                    psw = [torch.rand(i.numel(), generator=g).to(dtype) for i in c.indices]
                    got = lo.embedding_bag_all_to_all_on(
                        None, c.weights, c.indices, c.offsets, mode, last, [bags, len(rows) * dim], [], [],
                        padding_idx=pad, per_sample_weights=psw,
                    )  # fmt: skip
                    want = ops._bags([w.float() for w in c.weights], [i.long() for i in c.indices],
                                     [o.long() for o in c.offsets], mode, last, pad, [p.float() for p in psw])  # fmt: skip
                    key = f"per-sample weights {name}"
                    results[key] = max(results.get(key, 0.0), rel(got, want[0]) / TOL[dtype] * 1e-5)


class Ranks:
    """``world`` ranks' Comms over CPU workspaces (slices of one allocation each, data poisoned with 0xFF)."""

    def __init__(self, world: int, data_bytes: int):
        self.world = world
        self.sim = OneGpuRanks(world, data_bytes, lo.FLAG_BYTES, tag=f"dlrm{world}", device="cpu")
        self.comms = [
            Comm(
                data=self.sim.data.ranks[r], flags=self.sim.flags.ranks[r], side=None,
                errors=ErrorWords(*(torch.zeros(eb.ERR_WORDS, dtype=torch.int32) for _ in range(2))),
                init_flags=self.sim.init_flags,
            )
            for r in range(world)
        ]

    def run(self, calls, only=None, max_spin=200_000):
        """Every rank's protocol in lockstep: ``calls[r]`` = (weights, indices, offsets, mode, last, out_shape, out
        splits, in splits, variant); ``only``: the ranks that take part (the others never start)."""
        ranks = range(self.world) if only is None else only
        gens = {
            r: lo.protocol(self.comms[r], *calls[r][:8], variant=calls[r][8], max_spin=max_spin) for r in ranks
        }
        return lockstep(gens, self.world)

    def counters(self, r: int) -> list[int]:
        return self.comms[r].flags.view(r, (self.world,), torch.int64, lo.COUNTERS).tolist()


def expected(world, cases, mode, last, out_shape, outs_of, ins_of):
    """Every rank's output by hand: rank s's pooled rows as ``out_shape``, chunk r (its input splits) to rank r,
    the receiver's chunks in source order."""
    P = [reference(c.weights, c.indices, c.offsets, mode, last).reshape(out_shape) for c in cases]
    chunks = [list(torch.split(P[s], ins_of(s), dim=0)) for s in range(world)]
    return [torch.cat([chunks[s][r] for s in range(world)], dim=0) for r in range(world)]


def check_protocol(g, results: dict) -> None:
    T, D, bags_per_rank = 2, 16, 3
    scenarios = [
        # name, world, dtype, splits mode, out_shape kind, variant
        ("w2-equal-empty", 2, torch.float32, "empty", "2d", "b8u4w4"),
        ("w3-uniform-lists-3d", 3, torch.bfloat16, "uniform", "3d", "b4u8w4"),
        ("w3-unequal", 3, torch.float32, "unequal", "2d", "b16u4w8"),
        ("w2-segment-units", 2, torch.float16, "segments", "segments", "b8u4w4"),
    ]
    for name, world, dtype, splits, shape_kind, variant in scenarios:
        bags = bags_per_rank * world
        if shape_kind == "2d":
            out_shape = [bags, T * D]
        elif shape_kind == "3d":
            out_shape = [world, bags_per_rank, T * D]
        else:  # one dim-0 entry per segment (a table's D columns of one bag)
            out_shape = [bags * T, D]
        units = out_shape[0]
        if splits == "unequal":
            # rank s sends rank r sizes[s][r] rows (a zero among them); every rank's row count is ``units``
            sizes = [[units - 2 * (units // 4) - 1, units // 4 + 1, units // 4] for _ in range(world)]
            sizes[1] = [0, units - 2, 2]
            sizes[2] = [units // 2, 0, units - units // 2]
        else:
            sizes = [[units // world] * world for _ in range(world)]

        def ins_of(s, sizes=sizes):
            return sizes[s]

        def outs_of(r, sizes=sizes):
            return [row[r] for row in sizes]

        ranks = None
        for call in range(3):
            last, mode = bool(call % 2), call % 2
            cases = [
                Case(g, bags, [7 + 3 * r + t for t in range(T)], D, dtype, last, torch.int64, torch.int64, 4)
                for r in range(world)
            ]
            calls = []
            for r in range(world):
                c = cases[r]
                o, i = (outs_of(r), ins_of(r)) if splits != "empty" else ([], [])
                calls.append((c.weights, c.indices, c.offsets, mode, last, out_shape, o, i, variant))
            if ranks is None:
                nbytes = max(lo.data_bytes(c[0], c[2], last, out_shape, c[6], c[7], world) for c in calls)
                ranks = Ranks(world, nbytes)
            got = ranks.run(calls)
            want = expected(world, cases, mode, last, out_shape, outs_of, ins_of)
            key = f"protocol {name}"
            for r in range(world):
                results[key] = max(results.get(key, 0.0), rel(got[r], want[r]) / TOL[dtype] * 1e-5)
            errs = [c.errors.err.tolist() for c in ranks.comms]
            if any(e[0] for e in errs):
                results[f"{key} errors"] = float("inf")
        # After 3 calls: counter[s] on r = 3 x (segments from s + 1); the epoch is 3 everywhere.
        for r in range(world):
            lay = [lo.layout(bags, T, D, tuple(out_shape), tuple(outs_of(r)), tuple(ins_of(r)), r, world)][0]
            want_counts = [3 * lay.expect[s] for s in range(world)]
            state, _ = lo.protocol_state(ranks.comms[r])
            ok = ranks.counters(r) == want_counts and int(state[0]) == 3 and state[1 : 1 + world].tolist() == want_counts
            if not ok:
                results[f"counters {name} rank {r}"] = float("inf")


def check_timeouts(g) -> list[str]:
    """Rank 0 of 2 alone: its wait for rank 1's rows (equal splits), its wait for rank 1's offsets (unequal)."""
    msgs = []
    T, D, bags = 2, 16, 4
    for splits in ([], [1, 3]):
        c = Case(g, bags, [5, 6], D, torch.float32, True, torch.int64, torch.int64)
        call = (c.weights, c.indices, c.offsets, 0, True, [bags, T * D], splits, splits, "b8u4w4")
        ranks = Ranks(2, lo.data_bytes(c.weights, c.offsets, True, [bags, T * D], splits, splits, 2))
        try:  # on CPU the call's report raises at once
            ranks.run([call, call], only=[0], max_spin=50)
            msgs.append(f"no timeout: {ranks.comms[0].errors.err.tolist()}")
        except RuntimeError as e:
            msgs.append(str(e))
    return msgs


def check_fill(results: dict) -> None:
    for dtype in (torch.int64, torch.int32):
        values = tuple(range(-3, 34))
        t = torch.full((40,), 99, dtype=dtype)
        eb.fill(t, values)
        ok = t[: len(values)].tolist() == list(values) and t[len(values) :].tolist() == [99] * 3
        results[f"fill {dtype}"] = 0.0 if ok else float("inf")
    big = (1 << 40) + 7
    t = torch.zeros(1, dtype=torch.int64)
    eb.fill(t, (big,))
    results["fill int64 address"] = 0.0 if int(t[0]) == big else float("inf")


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    g = torch.Generator().manual_seed(seed)
    results: dict = {}
    check_pool(g, results)
    check_protocol(g, results)
    check_fill(results)
    results["timeouts"] = check_timeouts(g)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
