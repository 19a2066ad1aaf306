"""Does a same-device copy run beside a cuBLAS GEMM that holds every SM? On one GPU.

The all-gather choices copy the shards into the gathered output (and our rows into our symmetric slot) on a side
stream while a GEMM runs. ``cudaMemcpyAsync`` within one device may run as a kernel, which then waits for SMs
(cuBLAS's Hopper GEMMs hold all of them); ``cudaMemcpyBatchAsync`` with ``cudaMemcpyFlagPreferOverlapWithCompute``
(CUDA >= 12.8) asks the driver for the copy engine instead. This lab times, interleaved:
  gemm          the GEMM alone
  copy:<how>    the copy alone
  both:<how>    the GEMM on one stream, the copy on another, issued right after it (span and the copy's end)
for <how> = plain (cudaMemcpyAsync), batch (cudaMemcpyBatchAsync, prefer overlap), and checks each copy's bytes
and whether the batch copy can be captured in a CUDA graph.

Usage: python lab/ce_copy_lab.py [--mb 8,16,64] [--gemm 2048x14336x4096]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

import torch


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


def cudart() -> ctypes.CDLL:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    if not paths:
        raise SystemExit("libcudart is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", default="8,16,64")
    p.add_argument("--gemm", default="2048x14336x4096")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    rt = cudart()
    batch = rt.cudaMemcpyBatchAsync
    batch.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
        ctypes.c_void_p,
    ]  # fmt: skip
    attr = MemcpyAttributes(1, MemLocation(0, 0), MemLocation(0, 0), 1)  # stream order, prefer overlap
    idx = (ctypes.c_size_t * 1)(0)

    def copy(dst: torch.Tensor, src: torch.Tensor, how: str, stream: torch.cuda.Stream) -> None:
        if how == "plain":
            with torch.cuda.stream(stream):
                dst.copy_(src)
            return
        d = (ctypes.c_void_p * 1)(dst.data_ptr())
        s = (ctypes.c_void_p * 1)(src.data_ptr())
        n = (ctypes.c_size_t * 1)(src.nbytes)
        rc = batch(d, s, n, 1, ctypes.byref(attr), idx, 1, ctypes.c_void_p(stream.cuda_stream))
        if rc != 0:
            raise SystemExit(f"cudaMemcpyBatchAsync returned {rc}")

    m, n, k = (int(x) for x in args.gemm.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    s_main, s_side = torch.cuda.Stream(), torch.cuda.Stream()
    print(torch.cuda.get_device_name(), torch.__version__, "gemm", args.gemm)
    for mb in (int(x) for x in args.mb.split(",")):
        src = torch.randn(mb << 19, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        for how in ("plain", "batch"):  # bytes first
            dst.fill_(float("nan"))
            copy(dst, src, how, s_side)
            s_side.synchronize()
            assert torch.equal(dst, src), how
        times: dict[str, list[float]] = {}

        def ev() -> torch.cuda.Event:
            return torch.cuda.Event(enable_timing=True)

        for _ in range(args.rounds):
            for how in ("plain", "batch"):
                torch.cuda.synchronize()
                e0, e1 = ev(), ev()
                e0.record(s_side)
                copy(dst, src, how, s_side)
                e1.record(s_side)
                torch.cuda.synchronize()
                times.setdefault(f"copy:{how}", []).append(e0.elapsed_time(e1) * 1e3)
            for how in ("none", "plain", "batch"):
                torch.cuda.synchronize()
                e0, eg, ec = ev(), ev(), ev()
                with torch.cuda.stream(s_main):
                    e0.record()
                    torch.mm(a, b, out=c)
                    eg.record()
                s_side.wait_event(e0)
                if how != "none":
                    copy(dst, src, how, s_side)
                ec.record(s_side)
                torch.cuda.synchronize()
                key = "gemm" if how == "none" else f"both:{how}"
                times.setdefault(key, []).append(e0.elapsed_time(eg) * 1e3)
                if how != "none":
                    times.setdefault(f"{key} copy end", []).append(e0.elapsed_time(ec) * 1e3)
        med = {x: statistics.median(v) for x, v in times.items()}
        print(f"{mb} MB: " + ", ".join(f"{x} {v:.1f}" for x, v in med.items()), flush=True)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=s_side):
                copy(dst, src, "batch", s_side)
            dst.fill_(0)
            g.replay()
            torch.cuda.synchronize()
            print(f"{mb} MB: batch copy captured and replayed, bytes equal: {torch.equal(dst, src)}")
        except Exception as e:
            print(f"{mb} MB: batch copy capture failed: {str(e).splitlines()[0]}")
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
