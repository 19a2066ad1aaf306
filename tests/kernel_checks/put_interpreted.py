"""Checks of kernels/put_signal.py and the DLRM op's put form (lowerings/embedding_bag_all_to_all/put.py) under
Triton's CPU interpreter (run by tests/test_put_signal.py in a subprocess with TRITON_INTERPRET=1), over the P2P
transport (stores and a release add: NVSHMEM's put needs GPUs; tests/gpu/test_nvshmem_pes.py runs it).

* the put form between 2 and 3 simulated ranks (tests/kernel_checks/dlrm_interpreted.py's ``Ranks``: every rank's
  workspaces slices of one CPU allocation, poisoned), equal and uniform-list splits, 2-D and 3-D ``out_shape``,
  several slices per peer, three calls (both halves of the receive buffers), against the output computed by hand;
  the counters and epochs after the calls;
* the two forms alternating on one workspace (the P2P form, then the put form, then the P2P form): they share
  state, counters and halves;
* the bounded wait: a peer that never puts -> the error words, in words;
* the backward's put form (lowerings/all_to_all_embedding_bag_backward/put.py) between 2 and 3 simulated ranks
  (tests/kernel_checks/dlrm_backward_interpreted.py's ``Ranks`` and ``Tables``): equal and uniform-list splits,
  sum and mean, a padding index, sparse gradients, bf16 through the fp32 accumulator, the P2P and put forms
  alternating, three calls each, against aten's backward of the exchanged rows; its epochs and counters after;
  its bounded wait.

Prints one JSON line: {check name: worst relative error} plus "timeout": the message.
"""

from __future__ import annotations

import functools
import json
import sys

import dlrm_backward_interpreted as bw
import dlrm_interpreted as d
import interpreter_compat  # noqa: F401  (numpy >= 2.4 under Triton 3.6's interpreter)
import torch
from lockstep import lockstep

from fluxcompile.kernels import put_signal as ps
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import put as put_bw
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import triton as lo_bw
from fluxcompile.lowerings.embedding_bag_all_to_all import put
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo


class PutRanks(d.Ranks):
    """``d.Ranks`` whose calls take the put form (``form(call index)``: "put" or "p2p")."""

    def run_forms(self, calls, form, only=None, max_spin=200_000):
        ranks = range(self.world) if only is None else only
        gens = {}
        for r in ranks:
            c = calls[r]
            if form == "put":
                gens[r] = put.protocol(self.comms[r], *c[:8], variant=c[8], max_spin=max_spin, nvshmem=False)
            else:
                gens[r] = lo.protocol(self.comms[r], *c[:8], variant=c[8], max_spin=max_spin)
        return lockstep(gens, self.world)


def check_put(g, results: dict) -> None:
    T, D, bags_per_rank = 2, 16, 3
    scenarios = [
        # name, world, dtype, splits listed, out_shape kind, forms of the three calls, bytes per slice
        ("w2-equal", 2, torch.float32, False, "2d", ("put", "put", "put"), None),
        ("w3-lists-3d-slices", 3, torch.bfloat16, True, "3d", ("put", "put", "put"), 64),
        ("w2-alternating", 2, torch.float16, True, "2d", ("p2p", "put", "p2p"), 128),
        ("w3-put-then-p2p", 3, torch.float32, False, "2d", ("put", "p2p", "put"), None),
        ("w3-unequal", 3, torch.float32, "unequal", "2d", ("put", "put", "put"), 64),
        ("w2-unequal-alternating", 2, torch.bfloat16, "unequal", "3d", ("put", "p2p", "put"), None),
    ]
    for name, world, dtype, listed, shape_kind, forms, slice_bytes in scenarios:
        saved = ps.SLICE_BYTES
        if slice_bytes:
            ps.SLICE_BYTES = slice_bytes  # several programs per peer on these small chunks
        try:
            bags = bags_per_rank * world
            out_shape = [bags, T * D] if shape_kind == "2d" else [world, bags_per_rank, T * D]
            units = out_shape[0]
            if listed == "unequal":  # rank s sends rank r rows[s][r] (a zero among them); every rank sends ``units``
                rows = [[units - 2, 2], [1, units - 1]] if world == 2 else [
                    [units - 3, 0, 3], [1, units - 2, 1], [2, 2, units - 4]]  # fmt: skip
            else:
                rows = [[units // world] * world for _ in range(world)]

            ranks = None
            for call, form in enumerate(forms):
                last, mode = bool(call % 2), call % 2
                cases = [
                    d.Case(g, bags, [7 + 3 * r + t for t in range(T)], D, dtype, last, torch.int64, torch.int64, 4)
                    for r in range(world)
                ]
                calls = []
                for r in range(world):
                    c = cases[r]
                    ins, outs = (rows[r], [row[r] for row in rows]) if listed else ([], [])
                    calls.append((c.weights, c.indices, c.offsets, mode, last, out_shape, outs, ins, "b8u4w4"))
                if ranks is None:
                    nbytes = max(
                        put.data_bytes(lo.layout_of(c[0], c[2], last, out_shape, c[6], c[7], r, world),
                                       c[0][0].element_size())
                        for r, c in enumerate(calls)
                    )  # fmt: skip
                    ranks = PutRanks(world, nbytes)
                got = ranks.run_forms(calls, form)
                want = d.expected(world, cases, mode, last, out_shape, None, lambda s, rows=rows: rows[s])
                key = f"put {name}"
                for r in range(world):
                    results[key] = max(results.get(key, 0.0), d.rel(got[r], want[r]) / d.TOL[dtype] * 1e-5)
                if any(c.errors.err.tolist()[0] for c in ranks.comms):
                    results[f"{key} errors"] = float("inf")
            # The epoch is 3 everywhere, and every counter equals the state's target for it.
            for r in range(world):
                state, _ = lo.protocol_state(ranks.comms[r])
                ok = int(state[0]) == 3 and ranks.counters(r) == state[1 : 1 + world].tolist()
                ok = ok and all(ranks.counters(r)[s] > 0 for s in range(world) if s != r)
                if not ok:
                    results[f"counters {name} rank {r}"] = float("inf")
        finally:
            ps.SLICE_BYTES = saved


def check_timeout(g) -> str:
    """Rank 0 of 2 alone: its wait for rank 1's put."""
    T, D, bags = 2, 16, 4
    c = d.Case(g, bags, [5, 6], D, torch.float32, True, torch.int64, torch.int64)
    call = (c.weights, c.indices, c.offsets, 0, True, [bags, T * D], [], [], "b8u4w4")
    lay = lo.layout_of(c.weights, c.offsets, True, [bags, T * D], [], [], 0, 2)
    ranks = PutRanks(2, put.data_bytes(lay, 4))
    try:  # on CPU the call's report raises at once
        ranks.run_forms([call, call], "put", only=[0], max_spin=50)
        return f"no timeout: {ranks.comms[0].errors.err.tolist()}"
    except RuntimeError as e:
        return str(e)


class BackwardRanks(bw.Ranks):
    """``bw.Ranks`` whose calls take the put form where ``form`` says so."""

    def run_forms(self, calls, form, only=None, max_spin=200_000):
        ranks = range(self.world) if only is None else only
        exchange = functools.partial(put_bw.exchange, nvshmem=False) if form == "put" else None
        gens = {
            r: lo_bw.protocol(
                self.comms[r], *calls[r][:8], max_spin=max_spin, padding_idx=calls[r][8], sparse=calls[r][9],
                exchange=exchange, form=put_bw.NAME if form == "put" else lo_bw.NAME,
            )
            for r in ranks
        }  # fmt: skip
        return lockstep(gens, self.world)


def check_backward(g, results: dict) -> None:
    T, D, bags_per_rank = 2, 16, 3
    scenarios = [
        # name, world, dtype, splits listed, padding index ("sparse": sparse gradients), forms, bytes per slice
        ("w2-equal", 2, torch.float32, False, -1, ("put", "put", "put"), None),
        ("w3-lists-bf16-padding-slices", 3, torch.bfloat16, True, 2, ("put", "put", "put"), 64),
        ("w2-alternating-fp16", 2, torch.float16, True, -1, ("p2p", "put", "p2p"), None),
        ("w3-sparse", 3, torch.float32, False, "sparse", ("put", "put", "put"), None),
        ("w3-unequal-slices", 3, torch.float32, "unequal", 2, ("put", "put", "put"), 64),
        ("w2-unequal-alternating-bf16", 2, torch.bfloat16, "unequal", -1, ("put", "p2p", "put"), None),
    ]
    for name, world, dtype, listed, pad, forms, slice_bytes in scenarios:
        sparse, pad = pad == "sparse", -1 if pad == "sparse" else pad
        saved = ps.SLICE_BYTES
        if slice_bytes:
            ps.SLICE_BYTES = slice_bytes
        try:
            bags = bags_per_rank * world
            chunk = bags // world
            if listed == "unequal":  # every rank holds ``bags`` rows and every owner receives ``bags`` (a zero split)
                sizes = [[bags - 2, 2], [2, bags - 2]] if world == 2 else [
                    [bags - 2, 0, 2], [2, bags - 2, 0], [0, 2, bags - 2]]  # fmt: skip
            else:
                sizes = [[chunk] * world for _ in range(world)]
            ranks = None
            for call, form in enumerate(forms):
                last, mode = bool(call % 2), call % 2
                owners = [
                    bw.Tables(g, bags, [7 + 3 * r + t for t in range(T)], D, mode, last, *(torch.int64,) * 2, 4, pad)
                    for r in range(world)
                ]
                grads = [torch.randn(bags, T * D, generator=g).to(dtype) for _ in range(world)]
                calls = []
                for r in range(world):
                    ins, outs = (sizes[r], [row[r] for row in sizes]) if listed else ([], [])
                    calls.append((grads[r], *owners[r].args(), mode, outs, ins, pad, sparse))
                if ranks is None:
                    nbytes = max(
                        put_bw.data_bytes(lo_bw.layout_of(grads[r], T, c[-4], c[-3], r, world), grads[r].element_size())
                        for r, c in enumerate(calls)
                    )  # fmt: skip
                    ranks = BackwardRanks(world, nbytes)
                got = ranks.run_forms(calls, form)
                key = f"backward put {name}"
                for r in range(world):
                    pieces = [torch.split(grads[s], sizes[s], dim=0)[r] for s in range(world)]
                    want = owners[r].reference(torch.cat(pieces, dim=0), sparse)
                    for a, b in zip(got[r], want):
                        if sparse:
                            a, b = a.to_dense(), b.to_dense()
                        results[key] = max(results.get(key, 0.0), d.rel(a, b) / d.TOL[dtype] * 1e-5)
                if any(c.errors.err[0] for c in ranks.comms):
                    results[f"{key} errors"] = float("inf")
            puts = sum(f == "put" for f in forms)
            for r in range(world):
                state = put_bw.protocol_state(ranks.comms[r])
                counters = ranks.comms[r].flags.view(r, (world,), torch.int64, lo_bw.COUNTERS).tolist()
                ok = int(state[0]) == puts and counters == state[1 : 1 + world].tolist()
                ok = ok and all(counters[s] > 0 for s in range(world) if s != r)
                if not ok:
                    results[f"backward counters {name} rank {r}"] = float("inf")
        finally:
            ps.SLICE_BYTES = saved


def check_backward_timeout(g) -> str:
    T, D, bags = 2, 16, 4
    tb = bw.Tables(g, bags, [5, 6], D, 0, False, torch.int64, torch.int64)
    grad = torch.randn(bags, T * D, generator=g)
    call = (grad, *tb.args(), 0, [], [], -1, False)
    ranks = BackwardRanks(2, put_bw.data_bytes(lo_bw.layout_of(grad, T, [], [], 0, 2), 4))
    try:
        ranks.run_forms([call, call], "put", only=[0], max_spin=50)
        return f"no timeout: {ranks.comms[0].errors.err.tolist()}"
    except RuntimeError as e:
        return str(e)


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    g = torch.Generator().manual_seed(seed)
    results: dict = {}
    check_put(g, results)
    check_backward(g, results)
    results["timeout"] = check_timeout(g)
    results["backward timeout"] = check_backward_timeout(g)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
