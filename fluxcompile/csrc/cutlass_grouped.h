// The experts' grouped GEMM as CUTLASS's own Hopper grouped kernel (the one torch._grouped_mm runs on sm90): rows
// of A grouped by the device-side ends `offs`, one weight per group. Plain C++: the binding includes it without
// CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fluxcompile {

// The dispatch's part of a call (every pointer may be null: that part is off). Before loading a tile, the producer
// waits until flags[b] >= *epoch for every block b of block_rows rows of `a` (the experts' rows, in their order)
// that the tile's rows overlap: whoever writes a block of rows raises its flag to the call's epoch once they have
// landed, so the GEMM starts on the first blocks while later ones are still arriving.
// The kind a timed-out block wait records (kernels/grouped_gemm.py's WAIT_KINDS names it).
constexpr int kBlockWaitKind = 8;

struct GroupedSync {
  const int* flags = nullptr;
  int block_rows = 0;
  const int* epoch = nullptr;  // a device word: the epoch this call awaits (read by the kernel, so graphs replay)
  // Bounded waits (bounded_wait.cuh): after timeout_ns of %globaltimer a wait gives up and the first one records
  // err[0..5] = 1, rank, rank (the block's writer is this rank's own copy), the block, the epoch, kind
  // kBlockWaitKind (the MoE dispatch shares these words with kernels/grouped_gemm.py's waits: its WAIT_KINDS).
  int* err = nullptr;
  int rank = 0;
  long long timeout_ns = 60'000'000'000LL;
  const int* offs = nullptr;  // the problem's group ends (set by the host side)
};

struct GroupedProblem {
  // out[start_g:end_g] = a[start_g:end_g] @ b[g] for g < groups, start_g = offs[g - 1] (0 for g = 0), end_g = offs[g]
  // (int32 on the device, non-decreasing; rows past offs[groups - 1] are not written). bf16 operands and output,
  // fp32 accumulation.
  const void* a = nullptr;  // [R, k] row-major (lda)
  long long lda = 0;
  // b[g][kk, j]: b_kmajor ? at g * b_group + j * ldb + kk ([E, n, k] row-major, transposed) : at g * b_group +
  // kk * ldb + j ([E, k, n] row-major).
  const void* b = nullptr;
  long long ldb = 0;
  long long b_group = 0;
  bool b_kmajor = true;
  void* d = nullptr;  // [R, n] row-major (ldd)
  long long ldd = 0;
  const int* offs = nullptr;
  int groups = 0;
  int n = 0, k = 0;
  int sm_count = 0;  // persistent CTAs on sm_count SMs (0: all)
  int device = 0;
  // grouped_workspace_bytes(groups, variant) bytes of device memory: the groups' shapes, pointers and strides
  // (written on the stream by a small kernel from `offs`) and CUTLASS's own workspace.
  void* workspace = nullptr;
  GroupedSync sync;
};

struct GroupedVariant {
  const char* name;
  int tile_m, tile_n, tile_k, cluster_m, cluster_n;
  int schedule;  // 0: cooperative, 1: ping-pong
  // run(problem, stream, workspace_bytes_out): with workspace_bytes_out set, only writes the bytes it needs.
  cudaError_t (*run)(const GroupedProblem&, cudaStream_t, size_t*);
};

const GroupedVariant* grouped_variants(int* count);

}  // namespace fluxcompile
