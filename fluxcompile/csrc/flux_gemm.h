// The Flux-style GEMM of csrc/flux_gemm*.cu: one persistent warp-specialized CUTLASS GEMM (sm_90a) per call,
// whose tiles may wait for the chunks that hold their rows (all-gather) and whose epilogue may count each
// stored tile on the counters of the chunks it overlaps (reduce-scatter). Plain C++: the binding includes it
// without CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fluxcompile {

// The cross-rank part of one call. Every pointer may be null (that part is off).
struct FluxGemmSync {
  // Tile order: tile indices along `rotate_axis` (0: M, 1: N) start at the tile holding element `rotate_elems`
  // of that axis and wrap around, so the tiles whose data is there first (all-gather: this rank's rows) or
  // whose results leave first (reduce-scatter: the next rank's rows) come first.
  int rotate_axis = 0;
  int rotate_elems = 0;
  // Grouped tile order (group_m > 0, M rotation only): the scheduler runs along N with no swizzle, and its k-th
  // cluster of tiles takes, in groups of group_m rows of tiles, the k-th of the group's clusters M-first (each
  // wave works on few rows of tiles and reuses their A and B in L2, as Triton's GROUP_M), the groups starting at
  // the tile of rotate_elems. cluster_m/n: the kernel's cluster shape (set by the kernel's host side).
  int group_m = 0;
  int cluster_m = 1, cluster_n = 1;
  // All-gather: before loading a tile, the producer waits until wait_flags[s * chunks_per_rank + c] != 0 for
  // every chunk c of every rank s whose rows the tile covers (rank s holds rows [s * rows_per_rank, ...),
  // chunk c its rows [c * chunk_rows, ...)); rows of `skip_rank` are in place before the launch.
  const unsigned* wait_flags = nullptr;
  int rows_per_rank = 0;
  int chunk_rows = 0;
  int chunks_per_rank = 0;
  int skip_rank = -1;
  // All-gather, our rows in place: rows [local_row0, local_row0 + rows_per_rank) of A are read from `local_a`
  // (this rank's shard, row-major with leading dimension local_lda, 16-byte aligned) through a TMA descriptor of
  // their own instead of from `a`, whose rows there are never written. Null: every row from `a`. local_row0 and
  // rows_per_rank are multiples of the tile's M (no tile straddles our rows and a peer's; the host checks).
  const void* local_a = nullptr;
  long long local_lda = 0;
  int local_row0 = 0;
  // Reduce-scatter: once a tile's stores have landed, +1 (release, system scope) on signal_counters[c] for every
  // chunk c of `signal_elems` elements along `signal_axis` (0: rows, 1: columns) that the tile overlaps.
  unsigned* signal_counters = nullptr;
  int signal_axis = 0;
  int signal_elems = 0;
  // Reduce-scatter ring (a kernel built with a source, the problem's `c` set): each tile's epilogue adds C, the
  // running sums of this tile's chunk from the ranks before us in the ring, which arrive sub-chunk by sub-chunk
  // (c_elems elements along signal_axis, numbered over the whole axis): before loading a tile's C the epilogue's
  // producer waits until c_flags[j] != 0 for every sub-chunk j the tile overlaps (written by rank c_peer). Chunks are
  // chunk_elems along signal_axis. Tiles of chunk zero_chunk (the ring's first step) load C from `zero` instead
  // (zeros: [TM, n] for row chunks, [m, TN] for column chunks; leading dimension ldz) and wait for nothing. Tiles of
  // chunk own_chunk (the last step) store into `out` (that chunk alone, leading dimension ldo) instead of d and
  // count nothing. Multiples of the tile along signal_axis: chunk_elems and c_elems (the host checks).
  const unsigned* c_flags = nullptr;
  int c_elems = 0;
  int c_peer = -1;
  int chunk_elems = 0;
  int zero_chunk = -1;
  int own_chunk = -1;
  const void* zero = nullptr;
  long long ldz = 0;
  void* out = nullptr;
  long long ldo = 0;
  // Bounded waits: after timeout_ns of %globaltimer a wait gives up and the first one records
  // err[0..5] = 1, rank, the awaited rank, its chunk (or sub-chunk), 1 (the awaited value), the kind: 1 a chunk of
  // the gathered operand, 2 a sub-chunk of the ring's running sums.
  int* err = nullptr;
  int rank = 0;
  long long timeout_ns = 60'000'000'000LL;
};

struct FluxGemmProblem {
  const void* a = nullptr;  // [m, k] row-major (lda)
  const void* b = nullptr;  // [k, n]: b_kmajor ? b[k, j] at j * ldb + k : b[k, j] at k * ldb + j
  void* d = nullptr;        // [m, n] row-major (ldd)
  const void* c = nullptr;  // [m, n] row-major (ldc), added to every tile (the reduce-scatter ring; null: none)
  const void* bias = nullptr;  // [n] or null
  float alpha = 1.0f;          // d = alpha * (a @ b) + c + bias
  int m = 0, n = 0, k = 0;
  long long lda = 0, ldb = 0, ldd = 0, ldc = 0;
  bool b_kmajor = true;
  // 0: bf16, 1: fp16 (a, b, d and bias alike; fp32 accumulation); 2: e4m3 a and b (K-major b), bf16 d and bias,
  // scaled as scale_mode says (the fp8 variants only).
  int dtype = 0;
  // Launch: persistent CTAs on sm_count SMs (0: all); raster 0 heuristic, 1 along M, 2 along N; swizzle 1/2/4/8.
  int sm_count = 0;
  int raster = 0;
  int swizzle = 1;
  int device = 0;
  void* workspace = nullptr;  // workspace_bytes(...) bytes (stream-K variants), else unused
  FluxGemmSync sync;
  // fp8 (dtype 2), as torch._scaled_mm defines it: d = scale_a * scale_b * (a @ b) + bias in fp32, rounded once.
  // scale_mode 1 (tensor-wise): scale_a and scale_b are one float each; 2 (row-wise): scale_a[m] per row of a,
  // scale_b[n] per column of b. fast_accum: the products accumulate in the tensor cores' own precision, without
  // the fp32 promotion every few k-blocks (_scaled_mm's use_fast_accum).
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  int scale_mode = 0;
  bool fast_accum = false;
};

// One tile configuration compiled for both 16-bit dtypes and both weight layouts, or (an fp8 variant) for e4m3
// operands with each scale mode, with and without fast accumulation.
struct FluxGemmVariant {
  const char* name;
  int tile_m, tile_n, tile_k, cluster_m, cluster_n;
  int schedule;  // 0: cooperative, 1: ping-pong, 2: cooperative under stream-K (flux_gemm.cuh's Schedule)
  // run(problem, stream, workspace_bytes_out): with workspace_bytes_out set, only writes the bytes it needs.
  cudaError_t (*run)(const FluxGemmProblem&, cudaStream_t, size_t*);
  // The same tile configuration built with a source (the reduce-scatter ring: problems with `c` set); null where
  // the variant is not built so.
  cudaError_t (*run_ring)(const FluxGemmProblem&, cudaStream_t, size_t*);
};

const FluxGemmVariant* flux_gemm_variants(int* count);

}  // namespace fluxcompile
