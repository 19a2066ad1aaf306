"""Host µs of the stream operations in csrc/pipelined.cpp's sequences, one API against another (one GPU).

The all-gather sequence issues three ``cudaMemcpyAsync`` calls and its flag memory operations one by one;
the twelfth session's profile put ~7 µs of host on each copy. This lab times, in a C++ loop with the GPU
queued ahead (so no call waits for it), each way of issuing the same work:

* one copy: ``cudaMemcpyAsync`` (DeviceToDevice / Default), the driver's ``cuMemcpyDtoDAsync`` and
  ``cuMemcpyAsync``, and ``cudaMemcpyBatchAsync`` with one copy;
* two copies: two ``cudaMemcpyAsync`` against one ``cudaMemcpyBatchAsync`` of two;
* flags: ``cuStreamWaitValue32`` + ``cuStreamWriteValue32`` against one ``cuStreamBatchMemOp`` of both;
* an event record + wait between two streams.

Pointers: ordinary allocations, and a fluxcompile workspace (symmetric memory: a VMM mapping, what a peer's
slot is), in both directions. Run: ``python scripts/debug/copy_cost.py [--kib 256] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <chrono>

namespace {
template <class F> F entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  TORCH_CHECK(rc == cudaSuccess && found == cudaDriverEntryPointSuccess && fn, "no driver entry ", name);
  return reinterpret_cast<F>(fn);
}
using DtoD = CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
using MemOp = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
}  // namespace

// Host µs per iteration of `mode` over `calls` iterations (the caller queued the GPU ahead).
double cost(const std::string& mode, int64_t dst, int64_t src, int64_t nbytes, int64_t flag, int64_t other_stream,
            int64_t calls) {
  static const auto dtod = entry<DtoD>("cuMemcpyDtoDAsync");
  static const auto any = entry<DtoD>("cuMemcpyAsync");
  static const auto wait = entry<MemOp>("cuStreamWaitValue32");
  static const auto write = entry<MemOp>("cuStreamWriteValue32");
  static const auto batch_memop = entry<BatchMemOp>("cuStreamBatchMemOp");
  static cudaEvent_t ev = nullptr;
  if (!ev) C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  auto* d = reinterpret_cast<char*>(dst);
  auto* r = reinterpret_cast<const char*>(src);
  const size_t n = static_cast<size_t>(nbytes), half = n / 2;
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = cudaMemLocationTypeDevice;
  attr.dstLocHint.type = cudaMemLocationTypeDevice;
  size_t attr_idx = 0;
  void* dsts[2] = {d, d + half};
  const void* srcs[2] = {r, r + half};
  size_t sizes1[1] = {n}, sizes2[2] = {half, n - half};
  CUstreamBatchMemOpParams ops[2]{};
  ops[0].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  ops[0].waitValue.address = static_cast<CUdeviceptr>(flag);
  ops[0].waitValue.value = 1;
  ops[0].waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
  ops[1].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  ops[1].writeValue.address = static_cast<CUdeviceptr>(flag);
  ops[1].writeValue.value = 1;
  ops[1].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  auto cs = reinterpret_cast<CUstream>(s);
  auto other = reinterpret_cast<cudaStream_t>(other_stream);
  int m = mode == "d2d" ? 0 : mode == "default" ? 1 : mode == "cuDtoD" ? 2 : mode == "cuAsync" ? 3
        : mode == "batch1" ? 4 : mode == "two_d2d" ? 5 : mode == "batch2" ? 6 : mode == "write" ? 7
        : mode == "wait_write" ? 8 : mode == "batch_memop" ? 9 : mode == "event" ? 10 : -1;
  TORCH_CHECK(m >= 0, "unknown mode ", mode);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    switch (m) {
      case 0: C10_CUDA_CHECK(cudaMemcpyAsync(d, r, n, cudaMemcpyDeviceToDevice, s)); break;
      case 1: C10_CUDA_CHECK(cudaMemcpyAsync(d, r, n, cudaMemcpyDefault, s)); break;
      case 2: TORCH_CHECK(dtod((CUdeviceptr)d, (CUdeviceptr)r, n, cs) == CUDA_SUCCESS); break;
      case 3: TORCH_CHECK(any((CUdeviceptr)d, (CUdeviceptr)r, n, cs) == CUDA_SUCCESS); break;
      case 4: C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes1, 1, &attr, &attr_idx, 1, s)); break;
      case 5:
        C10_CUDA_CHECK(cudaMemcpyAsync(d, r, half, cudaMemcpyDeviceToDevice, s));
        C10_CUDA_CHECK(cudaMemcpyAsync(d + half, r + half, n - half, cudaMemcpyDeviceToDevice, s));
        break;
      case 6: C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes2, 2, &attr, &attr_idx, 1, s)); break;
      case 7: TORCH_CHECK(write(cs, (CUdeviceptr)flag, 1, CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS); break;
      case 8:
        TORCH_CHECK(wait(cs, (CUdeviceptr)flag, 1, CU_STREAM_WAIT_VALUE_EQ) == CUDA_SUCCESS);
        TORCH_CHECK(write(cs, (CUdeviceptr)flag, 1, CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS);
        break;
      case 9: TORCH_CHECK(batch_memop(cs, 2, ops, 0) == CUDA_SUCCESS); break;
      case 10:
        C10_CUDA_CHECK(cudaEventRecord(ev, s));
        C10_CUDA_CHECK(cudaStreamWaitEvent(other, ev, 0));
        break;
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / static_cast<double>(calls);
}
"""

MODES = (
    "d2d",
    "default",
    "cuDtoD",
    "cuAsync",
    "batch1",
    "two_d2d",
    "batch2",
    "write",
    "wait_write",
    "batch_memop",
    "event",
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kib", type=int, default=256, help="bytes per copy, KiB")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29513")):
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    from fluxcompile.lowerings.autotune import queue_gpu
    from fluxcompile.symm_mem import workspace

    mod = load_inline("fluxcompile_copy_cost", CPP, functions=["cost"], with_cuda=True, verbose=False)
    nbytes = args.kib << 10
    ws = workspace(dist.group.WORLD.group_name, 4 * nbytes + 4096, tag="copy_cost")
    sym = ws.buffer.view(torch.uint8)
    flag = int(ws.handle.buffer_ptrs[0]) + 4 * nbytes
    sym[4 * nbytes : 4 * nbytes + 4].view(torch.int32).fill_(1)  # the waits below are satisfied
    loc_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    loc_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sym_a = int(ws.handle.buffer_ptrs[0])
    pairs = {
        "local->local": (loc_b.data_ptr(), loc_a.data_ptr()),
        "local->symm": (sym_a, loc_a.data_ptr()),
        "symm->local": (loc_b.data_ptr(), sym_a + nbytes),
    }
    other, work = torch.cuda.Stream(), torch.cuda.Stream()
    errors: dict[tuple[str, str], str] = {}
    queue_us = args.calls * 40.0  # well past what the loop enqueues
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # interleaved: host drift hits every row alike
        for pair, (dst, src) in pairs.items():
            for mode in MODES:
                if pair != "local->local" and mode in ("write", "wait_write", "batch_memop", "event"):
                    continue
                torch.cuda.synchronize()
                with torch.cuda.stream(work):  # the batch APIs refuse the legacy default stream
                    queue_gpu(queue_us)
                    try:
                        us = mod.cost(mode, dst, src, nbytes, flag, other.cuda_stream, args.calls)
                    except Exception as e:  # a row, not a crash (the error is not sticky)
                        errors[(pair, mode)] = str(e).splitlines()[0]
                        us = float("nan")
                results.setdefault((pair, mode), []).append(us)
        for mode in ("d2d", "batch1"):  # the legacy default stream, where torch's current stream starts
            dst, src = pairs["local->symm"]
            torch.cuda.synchronize()
            queue_gpu(queue_us)
            try:
                us = mod.cost(mode, dst, src, nbytes, flag, other.cuda_stream, args.calls)
            except Exception as e:
                errors[("default stream", mode)] = str(e).splitlines()[0]
                us = float("nan")
            results.setdefault(("default stream", mode), []).append(us)
    torch.cuda.synchronize()
    print(f"== copy_cost: host µs per call, median of {args.rounds} rounds of {args.calls} calls, {args.kib} KiB")
    for (pair, mode), xs in results.items():
        print(f"  {pair:14s} {mode:12s} {statistics.median(xs):8.2f}  {errors.get((pair, mode), '')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
