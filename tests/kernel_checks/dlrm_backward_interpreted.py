"""Checks of kernels/embedding_bag_backward.py and its protocol (lowerings/all_to_all_embedding_bag_backward/triton.py)
under Triton's CPU interpreter (run by tests/test_dlrm_backward_kernel.py in a subprocess with TRITON_INTERPRET=1).

* one rank (the scatter reads ``grad`` itself) against aten's ``_embedding_bag_backward`` on the bookkeeping of
  aten's own forward: ragged bags with empty ones, repeated indices within and across bags, tables of different
  row counts, ``include_last_offset`` both ways, sum and mean, int32/int64 indices and offsets, fp32/bf16/fp16, a
  dim that is not a power of two and one wider than a column block;
* the whole protocol between 2 and 3 ranks simulated in one process (testing/one_gpu_ranks.OneGpuRanks on the
  CPU, data poisoned), every rank's launches in lockstep (no launch waits for a peer's launch of the same or a
  later position, so lockstep is an order the GPU may take): empty, uniform and unequal split lists (a zero split
  included), several calls (both halves of the send buffers, the epoch growing), against the reference computed
  per rank by hand (the sources' chunks in rank order, then aten's backward); the epoch and ready flags after;
* the bounded waits: a peer that never stages (ready) or never publishes (offsets) -> the error words, in words.

Prints one JSON line: {check name: worst relative error} plus "timeouts": [messages].
"""

from __future__ import annotations

import json
import sys

import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch
from dlrm_interpreted import TOL, rel  # the forward's checks: the same tolerances and relative error
from lockstep import lockstep

from fluxcompile.kernels import embedding_bag_backward as ebb
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import triton as lo
from fluxcompile.symm_mem import Comm, ErrorWords
from fluxcompile.testing.one_gpu_ranks import OneGpuRanks


class Tables:
    """One owner's tables: indices and offsets of ``bags`` ragged bags each (empty ones, repeats) and aten's
    forward bookkeeping (offset2bag, bag_size) for them."""

    def __init__(self, g, bags, rows, dim, mode, last, idx_dtype, off_dtype, max_len=5, pad=-1):
        self.rows, self.dim, self.mode, self.last, self.pad = rows, dim, mode, last, pad
        self.indices, self.offsets, self.bag_size, self.offset2bag, self.max_indices = [], [], [], [], []
        for n in rows:
            lens = torch.randint(0, max_len + 1, (bags,), generator=g)
            if bags > 2:
                lens[1] = 0
                lens[-1] = 0
            offs = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
            idx = torch.randint(0, max(1, n // 2), (int(offs[-1]),), generator=g)  # repeats within and across bags
            offs = offs if last else offs[:-1]
            _, o2b, size, maxi = torch.ops.aten._embedding_bag(
                torch.zeros(n, dim), idx, offs, False, mode, False, None, last, pad
            )
            self.indices.append(idx.to(idx_dtype))
            self.offsets.append(offs.to(off_dtype))
            self.offset2bag.append(o2b)
            self.bag_size.append(size.to(idx_dtype))  # as aten's CUDA forward: the indices' dtype
            self.max_indices.append(maxi)

    def reference(self, G: torch.Tensor, sparse: bool = False, freq: bool = False) -> list[torch.Tensor]:
        """aten's backward of each table on the exchanged gradients ``G`` ([bags, T * D]), in fp32 (``sparse``: its
        sparse COO gradients)."""
        per = G.float().view(G.shape[0], len(self.rows), -1)
        return [
            torch.ops.aten._embedding_bag_backward(
                per[:, t], self.indices[t].long(), self.offsets[t].long(), self.offset2bag[t], self.bag_size[t].long(),
                self.max_indices[t], n, freq, self.mode, sparse, None, self.pad,
            )
            for t, n in enumerate(self.rows)
        ]  # fmt: skip

    def args(self):
        return self.indices, self.offsets, self.bag_size, self.rows


def check_one_rank(g, results: dict) -> None:
    cases = [
        # name, bags, table rows, dim, dtype, index dtype, offset dtype
        ("fp32-i64", 9, [13, 40, 7], 20, torch.float32, torch.int64, torch.int64),
        ("fp32-i32-wide", 6, [5, 9], 300, torch.float32, torch.int32, torch.int32),
        ("bf16-mixed", 7, [11, 3, 30], 16, torch.bfloat16, torch.int32, torch.int64),
        ("fp16", 5, [8, 21], 40, torch.float16, torch.int64, torch.int32),
    ]
    for name, bags, rows, dim, dtype, it, ot in cases:
        for last, mode, pad in ((True, 0, -1), (False, 1, -1), (True, 1, 2), (False, 0, 1)):
            if True:
                tb = Tables(g, bags, rows, dim, mode, last, it, ot, pad=pad)
                grad = torch.randn(bags, len(rows) * dim, generator=g).to(dtype)
                got = lo.all_to_all_embedding_bag_backward_on(None, grad, *tb.args(), mode, [], [], padding_idx=pad)
                want = tb.reference(grad)
                key = f"one rank {name}"
                for a, b in zip(got, want):
                    ok = a.dtype == dtype
                    results[key] = max(results.get(key, 0.0), rel(a, b) / TOL[dtype] * 1e-5 if ok else float("inf"))
                # scale_grad_by_freq: each add divided by how often its index occurs in the table's indices, by
                # hand (aten's CPU backward divides by the count of another index's run; its CUDA one as here)
                got = lo.all_to_all_embedding_bag_backward_on(
                    None, grad, *tb.args(), mode, [], [], padding_idx=pad, scale_grad_by_freq=True
                )
                key = f"freq one rank {name}"
                per = grad.float().view(bags, len(rows), dim)
                for t, (a, n) in enumerate(zip(got, rows)):
                    idx = tb.indices[t].long()
                    b = positions_bags(tb.offsets[t], idx.numel(), bags)
                    count = torch.zeros(n).index_add_(0, idx, torch.ones(idx.numel()))
                    scale = (idx != pad).float() / count[idx]
                    if mode == 1:
                        scale = scale / tb.bag_size[t].long()[b].clamp_min(1).float()
                    want = torch.zeros(n, dim).index_add_(0, idx, per[b, t] * scale[:, None])
                    results[key] = max(results.get(key, 0.0), rel(a, want) / TOL[dtype] * 1e-5)
                if pad < 0:  # sparse gradients: aten's values at aten's indices, uncoalesced
                    got = lo.all_to_all_embedding_bag_backward_on(None, grad, *tb.args(), mode, [], [], sparse=True)
                    key = f"sparse one rank {name}"
                    for a, b in zip(got, tb.reference(grad, sparse=True)):
                        ok = a.is_sparse and a._nnz() == b._nnz() and torch.equal(a._indices(), b._indices())
                        err = rel(a._values(), b._values()) / TOL[dtype] * 1e-5 if ok else float("inf")
                        results[key] = max(results.get(key, 0.0), err)


class Ranks:
    """``world`` ranks' Comms over CPU workspaces (slices of one allocation each, data poisoned with 0xFF)."""

    def __init__(self, world: int, data_bytes: int):
        self.world = world
        self.sim = OneGpuRanks(world, data_bytes, lo.FLAG_BYTES, tag=f"dlrm-bw{world}", device="cpu")
        self.comms = [
            Comm(
                data=self.sim.data.ranks[r],
                flags=self.sim.flags.ranks[r],
                side=None,
                errors=ErrorWords(*(torch.zeros(ebb.ERR_WORDS, dtype=torch.int32) for _ in range(2))),
                init_flags=self.sim.init_flags,
            )
            for r in range(world)
        ]

    def run(self, calls, only=None, max_spin=200_000):
        """Every rank's protocol in lockstep: ``calls[r]`` = the arguments after the Comm; ``only``: the ranks that
        take part (the others never start)."""
        ranks = range(self.world) if only is None else only
        gens = {
            r: lo.protocol(self.comms[r], *calls[r][:8], max_spin=max_spin, padding_idx=calls[r][8], sparse=calls[r][9])
            for r in ranks
        }
        return lockstep(gens, self.world)


def positions_bags(offsets: torch.Tensor, n: int, bags: int) -> torch.Tensor:
    """Each position's bag (every position lies in one: offsets start at 0)."""
    ends = torch.cat([offsets.long()[1 : bags + 1], torch.tensor([n])])[:bags] if offsets.numel() > bags else (
        torch.cat([offsets.long()[1:], torch.tensor([n])])
    )  # fmt: skip
    starts = offsets.long()[:bags]
    return torch.repeat_interleave(torch.arange(bags), (ends - starts).clamp_min(0))


def check_per_sample_weights(g, results: dict) -> None:
    """Sum pooling with per-sample weights: the tables' gradients (each position's bag row times its weight) and
    the weights' gradients (the bag row dotted with the table row), one rank and a 2-rank protocol, by hand."""
    for name, dtype, world, pad in (("fp32", torch.float32, 1, -1), ("bf16-padding", torch.bfloat16, 1, 3),
                                    ("fp32-w2", torch.float32, 2, -1)):  # fmt: skip
        bags, dim, rows = 4 * world, 16, [9, 14]
        owners = [Tables(g, bags, rows, dim, 0, False, torch.int64, torch.int64, pad=pad) for _ in range(world)]
        tabs = [[torch.randn(n, dim, generator=g).to(dtype) for n in rows] for _ in range(world)]
        psws = [[torch.rand(i.numel(), generator=g).to(dtype) for i in o.indices] for o in owners]
        grads = [torch.randn(bags, len(rows) * dim, generator=g).to(dtype) for _ in range(world)]
        if world == 1:
            outs = [lo.all_to_all_embedding_bag_backward_on(
                None, grads[0], *owners[0].args(), 0, [], [], padding_idx=pad, per_sample_weights=psws[0],
                weights=tabs[0])]  # fmt: skip
            Gs = [grads[0]]
        else:
            ranks = Ranks(world, lo.data_bytes(grads[0], len(rows), [], [], world))
            gens = {
                r: lo.protocol(
                    ranks.comms[r],
                    grads[r],
                    *owners[r].args(),
                    0,
                    [],
                    [],
                    max_spin=200_000,
                    padding_idx=pad,
                    per_sample_weights=psws[r],
                    weights=tabs[r],
                )
                for r in range(world)
            }
            done: dict = {}
            while len(done) < world:
                for r, gen in gens.items():
                    if r not in done:
                        try:
                            next(gen)
                        except StopIteration as stop:
                            done[r] = stop.value
            outs = [done[r] for r in range(world)]
            chunk = bags // world
            Gs = [torch.cat([grads[s][r * chunk : (r + 1) * chunk] for s in range(world)]) for r in range(world)]
        err = 0.0
        for r in range(world):
            per = Gs[r].float().view(bags, len(rows), dim)
            for t, n in enumerate(rows):
                idx, w, p = owners[r].indices[t], tabs[r][t].float(), psws[r][t].float()
                b = positions_bags(owners[r].offsets[t], idx.numel(), bags)
                live = (idx != pad).float()
                want_w = torch.zeros(n, dim).index_add_(0, idx, per[b, t] * (p * live)[:, None])
                want_p = (per[b, t] * w[idx]).sum(1) * live
                err = max(err, rel(outs[r][t], want_w), rel(outs[r][len(rows) + t], want_p))
        results[f"per-sample weights {name}"] = err / TOL[dtype] * 1e-5


def check_protocol(g, results: dict) -> None:
    T, D, bags_per_rank = 2, 16, 3
    scenarios = [
        # name, world, dtype, splits, padding index
        ("w2-equal-empty", 2, torch.float32, "empty", -1),
        ("w3-uniform-lists", 3, torch.bfloat16, "uniform", -1),
        ("w3-unequal-padding", 3, torch.float32, "unequal", 2),
        ("w2-unequal-fp16", 2, torch.float16, "unequal", -1),
        ("w2-equal-sparse", 2, torch.bfloat16, "empty", "sparse"),
    ]
    for name, world, dtype, splits, pad in scenarios:
        sparse, pad = pad == "sparse", -1 if pad == "sparse" else pad
        bags = bags_per_rank * world  # every owner pools the global batch (of about ``bags``)
        if splits == "unequal":
            # rank s sends rank r sizes[s][r] rows; rank r receives column r, which must add up to its bags
            if world == 2:
                sizes = [[bags - 2, 2], [2, bags - 2]]
            else:
                # ranks holding and owners receiving different row counts (bags + 1 on rank 2 and owner 0)
                sizes = [[bags - 2, 0, 2], [1, bags - 1, 0], [2, 1, bags - 2]]
        else:
            sizes = [[bags // world] * world for _ in range(world)]
        recv = [[sizes[s][r] for s in range(world)] for r in range(world)]
        ranks = None
        for call in range(3):
            last, mode = bool(call % 2), call % 2
            owners = [
                Tables(g, sum(recv[r]), [7 + 3 * r + t for t in range(T)], D, mode, last, *(torch.int64,) * 2, 4, pad)
                for r in range(world)
            ]
            grads = [torch.randn(sum(sizes[s]), T * D, generator=g).to(dtype) for s in range(world)]
            calls = []
            for r in range(world):
                o, i = (recv[r], sizes[r]) if splits != "empty" else ([], [])
                calls.append((grads[r], *owners[r].args(), mode, o, i, pad, sparse))
            if ranks is None:
                nbytes = max(lo.data_bytes(grads[r], T, calls[r][-4], calls[r][-3], world)
                             for r in range(world))  # fmt: skip
                ranks = Ranks(world, nbytes)
            got = ranks.run(calls)
            key = f"protocol {name}"
            for r in range(world):
                chunks = [torch.split(grads[s], sizes[s], dim=0)[r] for s in range(world)]
                want = owners[r].reference(torch.cat(chunks, dim=0), sparse)
                for a, b in zip(got[r], want):
                    if sparse:
                        a, b = a.to_dense(), b.to_dense()
                    results[key] = max(results.get(key, 0.0), rel(a, b) / TOL[dtype] * 1e-5)
            if any(c.errors.err[0] for c in ranks.comms):
                results[f"{key} errors"] = float("inf")
        for r in range(world):
            state, _ = lo._state(ranks.comms[r])
            ready = ranks.comms[r].flags.view(r, (1,), torch.int64, lo._READY)
            if int(state[0]) != 3 or int(ready[0]) != 3:
                results[f"epoch {name} rank {r}"] = float("inf")


def check_timeouts(g) -> list[str]:
    """Rank 0 of 2 alone: its wait for rank 1's staged gradients (equal splits), for its offsets (unequal)."""
    msgs = []
    T, D, bags = 2, 16, 4
    for splits in ([], [1, 3]):
        tb = Tables(g, bags, [5, 6], D, 0, False, torch.int64, torch.int64)
        grad = torch.randn(bags, T * D, generator=g)
        call = (grad, *tb.args(), 0, splits, splits[::-1], -1, False)
        ranks = Ranks(2, lo.data_bytes(grad, T, splits, splits[::-1], 2))
        try:  # on CPU the call's report raises at once
            ranks.run([call, call], only=[0], max_spin=50)
            msgs.append(f"no timeout: {ranks.comms[0].errors.err.tolist()}")
        except RuntimeError as e:
            msgs.append(str(e))
    return msgs


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    g = torch.Generator().manual_seed(seed)
    results: dict = {}
    check_one_rank(g, results)
    check_per_sample_weights(g, results)
    check_protocol(g, results)
    results["timeouts"] = check_timeouts(g)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
