"""Two ranks on one GPU: fluxcompile/csrc/gemv_ar.cu's exchange (partials into the peers' slots, flags, epochs,
parity slots, two-shot's reduced tiles) run between two launches of the kernel that share the GPU, each on its
own stream with half the resident CTAs, their workspaces mapped into each other as a group's would be.

It checks the protocol's logic without a second GPU: every output against the fp32 sum of both ranks'
products, over many eager calls and CUDA-graph replays with inputs changed between them (a stale flag or a
slot read early shows as a wrong sum). It does not check NVLink's ordering (both "peers" share one L2), and
its times are not the exchange's cost between GPUs (each rank has half the GPU):

    python lab/gemv_sim2.py [--variants cur,NAME=FILE@-DFLAG] [--shapes 8192x14336] [--ms 1,16,64]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch

from fluxcompile.kernels.gemv_ar import MODES, slot_need
from fluxcompile.testing.numerics import rel_err

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_lab import CSRC, build_variants, graph_time

TILE, MAX_TILES, WORLD = 32, 8192, 2
TIMEOUT_NS = int(2e8)  # 0.2 s: a launch that never meets its peer ends in an error, not a hang


def _wg_min_m(item: str) -> int:
    """The smallest m on the wgmma loader (GEMV_WG_MIN_M) of a ``--variants`` item: its -D flag, else the
    #define of its source (a whole past gemv_ar.cu may hold it), else the product's tuning header's."""
    v, *flags = item.split("@")
    for f in flags:
        if f.startswith("-DGEMV_WG_MIN_M="):
            return int(f.split("=", 1)[1])
    path = v.partition("=")[2]
    whole = path and path != "cur" and not path.endswith((".patch", ".diff"))
    for src in [*([Path(path)] if whole else []), CSRC / "gemv_ar_tuning.h"]:
        found = re.search(r"^#define GEMV_WG_MIN_M (\d+)$", src.read_text(), re.M)
        if found:
            return int(found.group(1))
    return 17


class Rank:
    """One simulated rank's workspaces and tensors."""

    def __init__(self, m: int, n: int, k: int, world: int, tail: bool):
        self.slot_bytes = (slot_need(m, n, 2) + 255) // 256 * 256
        # Regular slots and LL regions (fluxcompile/csrc/gemv_ar.h), poisoned: NaN data, flags no epoch matches.
        self.data = torch.full(((6 * world + 2) * self.slot_bytes,), 0xFF, dtype=torch.uint8, device="cuda")
        self.flags = torch.zeros((world + 1) * MAX_TILES, dtype=torch.int32, device="cuda")
        self.state = torch.zeros(4, dtype=torch.int32, device="cuda")
        self.err = torch.zeros(8, dtype=torch.int32, device="cuda")
        self.a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        self.out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        self.tail = tail
        self.residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if tail else None
        self.norm_w = torch.randn(n, device="cuda", dtype=torch.bfloat16) if tail else None
        self.normed = torch.empty(m, n, device="cuda", dtype=torch.bfloat16) if tail else None
        self.stream = torch.cuda.Stream()


def launch(ext, r: Rank, rank: int, peer_data, peer_flags, mode: str, grid: int) -> None:
    m, k = r.a.shape
    n = r.w.shape[0]
    tiles = -(-n // TILE)
    p = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    ext.launch(
        r.a.data_ptr(), r.w.data_ptr(), 0, r.out.data_ptr(), p(r.normed), p(r.residual), p(r.norm_w), 1e-5, False,
        int(peer_data.data_ptr()), int(peer_flags.data_ptr()), r.slot_bytes, r.state.data_ptr(),
        r.err.data_ptr(), m, n, k, r.a.stride(0), r.w.stride(0), rank, WORLD, mode == "twoshot", MODES[mode],
        tiles, TIMEOUT_NS, 0,
        min(grid, tiles), r.stream.cuda_stream,
    )  # fmt: skip


def call(ext, ranks, peer_data, peer_flags, mode, grid) -> None:
    """Both ranks' launches, concurrent on their streams, joined back into the current stream."""
    cur = torch.cuda.current_stream()
    for i, r in enumerate(ranks):
        r.stream.wait_stream(cur)
        with torch.cuda.stream(r.stream):
            launch(ext, r, i, peer_data, peer_flags, mode, grid)
    for r in ranks:
        cur.wait_stream(r.stream)


def check(ranks, tag: str) -> str | None:
    """None when every rank's output is the fp32 sum of the ranks' products (and its tail), else why not."""
    ref = sum(r.a.float() @ r.w.float().t() for r in ranks)
    for i, r in enumerate(ranks):
        bad = r.err.tolist()
        if bad[0]:
            return f"{tag}: rank {i} err words {bad}"
        want = ref
        if r.tail:
            h = r.residual.float() + ref.to(torch.bfloat16).float()
            want = h
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * r.norm_w.float()
            e = rel_err(r.normed, normed)
            if not e < 1e-2:
                return f"{tag}: rank {i} normed rel err {e:.2e}"
        e = rel_err(r.out, want)
        if not e < 1e-2:
            return f"{tag}: rank {i} rel err {e:.2e}"
    return None


def fresh(ranks) -> None:
    for r in ranks:
        r.a.copy_(torch.randn_like(r.a))
        r.out.fill_(float("nan"))
        if r.tail:
            r.normed.fill_(float("nan"))


def run_case(ext, m, n, k, mode, tail, grid, eager_calls, replays) -> tuple[str | None, float]:
    ranks = [Rank(m, n, k, WORLD, tail) for _ in range(WORLD)]
    peer_data = torch.tensor([r.data.data_ptr() for r in ranks], dtype=torch.int64, device="cuda")
    peer_flags = torch.tensor([r.flags.data_ptr() for r in ranks], dtype=torch.int64, device="cuda")
    for it in range(eager_calls):
        fresh(ranks)
        call(ext, ranks, peer_data, peer_flags, mode, grid)
        torch.cuda.synchronize()
        why = check(ranks, f"eager call {it}")
        if why:
            return why, float("nan")
    # A graph of one call, replayed with new inputs each time, then the lab's timed graph of 20 calls.
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(ext, ranks, peer_data, peer_flags, mode, grid)
    for it in range(replays):
        fresh(ranks)
        g.replay()
        if it % 50 == 0 or it == replays - 1:
            torch.cuda.synchronize()
            why = check(ranks, f"replay {it}")
            if why:
                return why, float("nan")
    t = graph_time(lambda: call(ext, ranks, peer_data, peer_flags, mode, grid), reps=20)
    return check(ranks, "after the timed replays"), t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="cur")
    p.add_argument("--shapes", default="8192x14336,8200x4104,200x1032")
    p.add_argument("--ms", default="1,2,3,16,24,64")
    p.add_argument("--modes", default="oneshot,twoshot,oneshot-ll,oneshot-ll128")
    p.add_argument("--eager", type=int, default=20)
    p.add_argument("--replays", type=int, default=300)
    args = p.parse_args()
    exts = build_variants(args.variants, prefix="sim_")
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, failures = [], 0
    wg_min = {"sim_" + item.split("@")[0].partition("=")[0]: _wg_min_m(item) for item in args.variants.split(",")}
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for m in map(int, args.ms.split(",")):
            for name, ext in exts.items():
                per_sm = 1 if m >= wg_min[name] else 2  # the kernel's CTAs per SM (Cfg::kCtas: 1 with wgmma)
                grid = per_sm * sms // WORLD
                for mode in args.modes.split(","):
                    for tail in (False, True):
                        why, t = run_case(ext, m, n, k, mode, tail, grid, args.eager, args.replays)
                        tag = f"{name} n={n} k={k} m={m} {mode}{' +tail' if tail else ''}"
                        line = f"{tag}: {'FAIL ' + why if why else 'ok'} {t:.1f}us"
                        failures += why is not None
                        print(line, flush=True)
                        rows.append(line)
    print("== sim table")
    print("\n".join(rows))
    print(f"== {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
