"""TMA ring lab (one GPU): ring shapes of scripts/debug/tma_stream.cu streaming a decode weight into shared
memory with no math, against a plain read and cuBLAS at m = 64, all timed as CUDA graph replays:

    python scripts/debug/tma_lab.py [--shapes 8192x14336,8192x4096] [--cfgs cur,ws3,...]

Prints time and weight GB/s per configuration (see CFGS in the .cu file for what each name sets).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemv_lab


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x14336,8192x4096")
    p.add_argument("--cfgs", default="")
    args = p.parse_args()
    from torch.utils import cpp_extension

    here = Path(__file__).resolve().parent
    ext = cpp_extension.load(
        name="tma_stream_lab", sources=[str(here / "tma_stream.cu")],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], with_cuda=True,
    )  # fmt: skip
    read_ext = gemv_lab.read_yardstick()
    sink = torch.zeros(1 << 16, dtype=torch.float32, device="cuda")
    names = args.cfgs.split(",") if args.cfgs else list(ext.names())
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        res = {
            "read": gemv_lab.graph_time(lambda w=w: read_ext.read_all(w, sink)),
            "cublas64": gemv_lab.graph_time(lambda a=a, w=w: a @ w.t()),
            "cublas16": gemv_lab.graph_time(lambda a=a, w=w: a[:16] @ w.t()),
        }
        for name in names:
            fn = getattr(ext, name)
            try:
                # the stream is looked up per call: graph capture runs on a side stream
                res[name] = gemv_lab.graph_time(
                    lambda fn=fn, a=a, w=w: fn(w, a, sink, torch.cuda.current_stream().cuda_stream)
                )
            except RuntimeError as e:
                print(f"!! {name} {shape}: {e}", flush=True)
        gb = w.numel() * 2
        for name, t in res.items():
            line = f"n={n:6d} k={k:6d} {name:10s} {t:7.1f}us {gb / t / 1e3:6.0f}GB/s"
            print(line, flush=True)
            rows.append(line)
    print("== lab table")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
