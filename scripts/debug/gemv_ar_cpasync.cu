// EXPERIMENT, not used by fluxcompile: csrc/gemv_ar.cu with the weight (and A) streamed through per-warp
// shared-memory rings by cp.async (FLUXCOMPILE_GEMV_STAGES stages of FLUXCOMPILE_GEMV_KU 32-wide k blocks
// per warp). Measured on one H200 (scripts/debug/gemv_lab.py, 2026-11-23) it is SLOWER than csrc's direct
// register loads: 2.9-3.6 TB/s at m = 1 against 3.65 (cuBLAS 4.07, a plain read 4.45), 2.2-2.9 TB/s at m = 16,
// and the stage count changes nothing, so latency hiding is not what limits either kernel. Kept to be
// measured against, e.g. `gemv_lab.py --variants cur,cpa=scripts/debug/gemv_ar_cpasync.cu@-DFLUXCOMPILE_GEMV_KU=2`.
// An earlier try with cp.async.bulk (one 512-byte bulk copy per weight row per chunk, mbarriers) ran at
// 1.0-1.8 TB/s: about 2.3 us per chunk whatever the chunk size or depth, i.e. per-copy issue cost.
// GEMV + all-reduce (+ residual add + RMSNorm) for decode, as one persistent kernel per rank.
//
// out = all_reduce_sum(A @ w.t() + bias) over the ranks of a group, A [m, k] (m <= 64), w [n, k] this rank's
// row shard of the weight. Memory-bound: the weight is streamed through per-warp cp.async rings (WeightStream)
// into tensor-core MMAs (compute_tile), fp32 accumulation.
//
// A tile is kGemvTileN output columns for all m rows. Each CTA owns a fixed list of tiles (positions
// blockIdx.x, +gridDim.x, ...) through three phases, so a tile is reduced by the CTA that computed it here:
//   1. compute each tile's partial (+ bias, rounded to T like addmm's output) and store it straight into
//      the destination ranks' symmetric slots (zero-copy, over NVLink), then release a flag per tile:
//        one-shot: to every rank;   two-shot: only to the tile's owner (tiles are split in contiguous
//        ranges over the ranks). Tiles that other ranks need come first (communication-aware order: on
//        rank r the owners r+1, r+2, ..., r).
//   2. for each tile this rank reduces (one-shot: all of them, two-shot: its own), wait for the peers'
//      flags, sum the partials in rank order (fp32), round to T; two-shot: store the reduced tile into
//      every peer's result slot and release its flag there. Write the output (or h = residual + r).
//   3. two-shot: wait for the tiles other ranks own and copy them out.
//   tail: a grid barrier, then RMSNorm of the CTA's tiles from the per-tile sums of squares of h.
//
// Flags carry epochs: state[0] counts this kernel's calls on this rank (every rank makes the same calls,
// so the counts agree); a call uses e = state[0] + 1 and its last CTA stores e back. A wait succeeds when
// flag - e >= 0 (int32 wrap-around), so a value left by an earlier call never passes and nothing is reset
// between calls or CUDA graph replays. Data slots alternate by the epoch's parity: a rank can start call
// e + 1 while a peer still reads call e's slots, but it cannot start call e + 2 before having received
// something the peer produced in call e + 1 (one-shot: every tile; two-shot: every rank owns >= 1 tile),
// i.e. after the peer finished reading call e.
//
// Every wait is bounded (timeout_ns on %globaltimer): the first timeout records (rank, peer, tile, epoch,
// kind) in err, and every later wait of the call gives up at once, so a missing peer costs one timeout.
// The host checks err afterwards and raises an error naming them.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemv_ar.h"

namespace fluxcompile {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCtasPerSm = 2;
constexpr int kVecPerRow = kGemvTileN / 8;         // 16-byte vectors of T per tile row
// Weight stream: each warp streams its own share of every tile through a private ring of kStages
// shared-memory stages with cp.async (16 bytes per lane, L2 only, no registers held while in flight): of a
// chunk of kChunkK elements of k for the tile's kGemvTileN weight rows, warp w takes kChunkU contiguous
// 32-wide k blocks (64 * kChunkU bytes of each row). No barrier between warps: a warp reads only what it
// copied. Rows are padded by 16 bytes so a quarter-warp's 16-byte reads (two rows) hit distinct banks.
#ifndef FLUXCOMPILE_GEMV_STAGES
#define FLUXCOMPILE_GEMV_STAGES 4
#endif
#ifndef FLUXCOMPILE_GEMV_KU
#define FLUXCOMPILE_GEMV_KU 1
#endif
constexpr int kStages = FLUXCOMPILE_GEMV_STAGES;   // chunks in flight or ready per warp
constexpr int kChunkU = FLUXCOMPILE_GEMV_KU;       // 32-wide k blocks per warp per chunk
constexpr int kChunkK = kWarps * 32 * kChunkU;
constexpr int kPitch = 32 * kChunkU + 8;           // elements per row of a warp's stage
// A warp's stage: the tile's kGemvTileN weight rows, then the 16 * MT rows of A (their k slice too, so no
// load from global memory sits on a warp's path from one chunk to the next).
template <int MT>
__host__ __device__ constexpr int warp_stage() {
  return (kGemvTileN + 16 * MT) * kPitch;
}
// Stages of the ring at this MT: kStages, or fewer where the rings would not fit in ~200 KB (large m).
template <typename T, int MT>
__host__ __device__ constexpr int stages_for() {
  constexpr int fit = (200 * 1024) / (kWarps * warp_stage<MT>() * static_cast<int>(sizeof(T)));
  return fit < kStages ? (fit < 2 ? 2 : fit) : kStages;
}

// Wait kinds reported in err[5].
constexpr int kWaitPartial = 1;
constexpr int kWaitReduced = 2;
constexpr int kWaitBarrier = 3;

template <typename T>
struct Num;
template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Num<__half> {
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
};

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = Num<T>::to_f(e[j]);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) e[j] = Num<T>::from_f(f[j]);
  return v;
}

// Data written by other GPUs or other CTAs: read at L2, never from a possibly stale L1 line.
__device__ __forceinline__ uint4 ld_cg(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ void st_cg(void* p, const uint4& v) { __stcg(reinterpret_cast<uint4*>(p), v); }

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Bounded wait (one thread) until *flag has reached epoch e. False on timeout or when another wait of
// this call already timed out; the first timeout is recorded in err.
template <bool kSys>
__device__ bool wait_epoch(const unsigned* flag, unsigned e, const GemvArParams& p, int peer, int tile, int kind) {
  unsigned long long t0 = 0;
  for (unsigned iter = 0;; ++iter) {
    unsigned v = kSys ? ld_acquire_sys(flag) : ld_acquire_gpu(flag);
    if (static_cast<int>(v - e) >= 0) return true;
    if ((iter & 255u) == 0) {
      unsigned long long now = global_ns();
      if (t0 == 0) t0 = now;
      if (*reinterpret_cast<volatile int*>(p.err) != 0) return false;
      if (static_cast<long long>(now - t0) > p.timeout_ns) {
        if (atomicCAS(p.err, 0, 1) == 0) {
          p.err[1] = p.rank;
          p.err[2] = peer;
          p.err[3] = tile;
          p.err[4] = static_cast<int>(e);
          p.err[5] = kind;
          __threadfence_system();
        }
        return false;
      }
    }
  }
}

__device__ __forceinline__ int first_tile(int owner, int n_tiles, int world) {
  return (owner * n_tiles + world - 1) / world;
}
__device__ __forceinline__ int owner_of(int t, int n_tiles, int world) { return (t * world) / n_tiles; }

// Communication-aware order: position -> tile, the tiles of owners rank+1, rank+2, ... first, own last.
__device__ int tile_at(int pos, const GemvArParams& p) {
  for (int step = 1; step <= p.world; ++step) {
    int o = (p.rank + step) % p.world;
    int lo = first_tile(o, p.n_tiles, p.world);
    int cnt = first_tile(o + 1, p.n_tiles, p.world) - lo;
    if (pos < cnt) return lo + pos;
    pos -= cnt;
  }
  return -1;  // unreachable for pos < n_tiles
}

template <typename T>
__device__ __forceinline__ T* slot(const GemvArParams& p, int dst, int index) {
  return reinterpret_cast<T*>(p.peer_data[dst] + static_cast<long long>(index) * p.slot_bytes);
}

// One m16n8k16 tensor-core MMA, fp32 accumulate: c += a (16x16, row) * b (16x8, col).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                                        unsigned a3, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                 unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- The weight stream (see kStages): cp.async into the warp's ring. ----
// 16 bytes from global memory (L2 only) to shared memory; src_bytes 0 fills zeros (rows past n, k past k).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(src_bytes)
               : "memory");
}

// The warp's chunks in order: chunk q is chunk q % n_chunks of the CTA's tile q / n_chunks (tile positions
// blockIdx.x, + gridDim.x, ...), in stage q % kStages of the warp's ring.
struct WeightStream {
  char* ring;          // this warp's [kStages][kGemvTileN][kPitch] elements of T
  int n_chunks, total;  // chunks per tile; chunks of this CTA
};

// Copies chunk q's share of this warp (weight rows, then A's rows < m) into its stage and commits one cp.async
// group (an empty one past the end, so group counting stays uniform). Lane L's copy i is 16-byte segment
// i * 32 + L of the share: rows in order, 4 * kChunkU segments (a contiguous 64 * kChunkU bytes) each. Rows
// past n and k past k are zero-filled.
template <typename T, int MT>
__device__ void issue_chunk(const WeightStream& ws, const GemvArParams& p, int q) {
  if (q < ws.total) {
    constexpr int kSegs = (kGemvTileN + 16 * MT) * 4 * kChunkU;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = tile_at(blockIdx.x + (q / ws.n_chunks) * gridDim.x, p);
    const int k0 = (q % ws.n_chunks) * kChunkK + warp * 32 * kChunkU;
    T* stage = reinterpret_cast<T*>(ws.ring) + (q % stages_for<T, MT>()) * warp_stage<MT>();
#pragma unroll
    for (int i = 0; i < (kSegs + 31) / 32; ++i) {
      const int seg = i * 32 + lane, r = seg / (4 * kChunkU), c = (seg % (4 * kChunkU)) * 8;
      const int kc = k0 + c;
      if (r < kGemvTileN) {
        const int row = t * kGemvTileN + r;
        const bool ok = row < p.n && kc < p.k;  // k % 8 == 0: a segment is wholly in range or out
        const T* src = static_cast<const T*>(p.w) + (ok ? static_cast<long long>(row) * p.ldw + kc : 0);
        cp_async16(stage + r * kPitch + c, src, ok ? 16 : 0);
      } else if (r - kGemvTileN < p.m && seg < kSegs) {
        const int row = r - kGemvTileN;
        const bool ok = kc < p.k;
        const T* src = static_cast<const T*>(p.a) + (ok ? row * p.lda + kc : 0);
        cp_async16(stage + r * kPitch + c, src, ok ? 16 : 0);
      }
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Phase-1 work: the fp32 partial tile (without bias) into tile_s[i][c], on tensor cores, from the stream's
// chunks q0 .. q0 + n_chunks - 1.
//
// m up to 64 needs tensor cores (CUDA-core FMAs cap far below the bandwidth at m = 16), without shuffles or
// ldmatrix: a sum over k may visit k in any order as long as A and B agree, so lane (g = lane / 4,
// t = lane % 4) of a warp reads 16 contiguous bytes, k = 8t .. 8t + 7 of its 32-wide k block, of weight row g
// of an n8 group (from the stage) and of A rows g and g + 8 of an m16 tile (from global memory, cached), and
// feeds elements 0-3 to one m16n8k16 MMA and 4-7 to a second, as if they were the fragment's k = 2t, 2t+1,
// 2t+8, 2t+9. A warp covers the tile's 32 columns (4 n8 groups) over its k block of every chunk (split-K);
// the warps' partial sums are added in warp order through shared memory (deterministic).
template <typename T, int MT>
__device__ void compute_tile(const WeightStream& ws, const GemvArParams& p, int q0, float (*tile_s)[kGemvTileN],
                             float (*red)[16][kGemvTileN]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  float c[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) c[mt][j][q] = 0.f;
  bool aok[MT][2];  // A rows past m were not copied: they read as zeros
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) aok[mt][h] = mt * 16 + g + 8 * h < p.m;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int cc = 0; cc < ws.n_chunks; ++cc) {
    const int q = q0 + cc;
    __syncwarp();  // every lane is done reading the stage that chunk q + kStages - 1 overwrites (q - 1's)
    issue_chunk<T, MT>(ws, p, q + stages_for<T, MT>() - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(stages_for<T, MT>() - 1) : "memory");  // chunk q's group landed
    __syncwarp();  // ... for every lane's copies
    const T* stage =
        reinterpret_cast<const T*>(ws.ring) + (q % stages_for<T, MT>()) * warp_stage<MT>() + g * kPitch + 8 * t;
#pragma unroll
    for (int u = 0; u < kChunkU; ++u) {
      uint4 wv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) wv[j] = *reinterpret_cast<const uint4*>(stage + j * 8 * kPitch + u * 32);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const T* ar = stage + (kGemvTileN + mt * 16) * kPitch + u * 32;
        const uint4 lo = aok[mt][0] ? *reinterpret_cast<const uint4*>(ar) : zero;
        const uint4 hi = aok[mt][1] ? *reinterpret_cast<const uint4*>(ar + 8 * kPitch) : zero;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          mma16816<T>(c[mt][j], lo.x, hi.x, lo.y, hi.y, wv[j].x, wv[j].y);
          mma16816<T>(c[mt][j], lo.z, hi.z, lo.w, hi.w, wv[j].z, wv[j].w);
        }
      }
    }
  }
  // Accumulator (mt, j): rows mt*16 + g (+8), columns j*8 + 2t (+1). Sum over warps in warp order.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (mt * 16 >= p.m) break;  // uniform over the CTA
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      red[warp][g][j * 8 + 2 * t] = c[mt][j][0];
      red[warp][g][j * 8 + 2 * t + 1] = c[mt][j][1];
      red[warp][g + 8][j * 8 + 2 * t] = c[mt][j][2];
      red[warp][g + 8][j * 8 + 2 * t + 1] = c[mt][j][3];
    }
    __syncthreads();
    for (int e = tid; e < 16 * kGemvTileN; e += kThreads) {
      const int i = e / kGemvTileN, col = e % kGemvTileN;
      float v = 0.f;
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) v += red[ww][i][col];
      tile_s[mt * 16 + i][col] = v;
    }
    __syncthreads();
  }
}

// Writes the reduced vector r (8 columns of row i) to the output: r itself, or with the tail
// h = T(residual + r) and the sum of squares of h's 8 values (returned; 0 without the tail).
template <typename T>
__device__ __forceinline__ float write_output(const GemvArParams& p, int i, int col, const uint4& r, bool tail) {
  const long long off = static_cast<long long>(i) * p.n + col;
  T* out = static_cast<T*>(p.out) + off;
  if (!tail) {
    *reinterpret_cast<uint4*>(out) = r;
    return 0.f;
  }
  float rf[8], res[8], h[8];
  unpack8<T>(r, rf);
  unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.residual) + off), res);
#pragma unroll
  for (int q = 0; q < 8; ++q) h[q] = res[q] + rf[q];
  uint4 hv = pack8<T>(h);
  *reinterpret_cast<uint4*>(out) = hv;
  unpack8<T>(hv, h);  // the rounded h, as the reference normalizes it
  float ss = 0.f;
#pragma unroll
  for (int q = 0; q < 8; ++q) ss = fmaf(h[q], h[q], ss);
  return ss;
}

// Sum of the ss values of the kVecPerRow consecutive threads that hold one tile row; row sums land in
// ss_part[i, t]. Called by all threads (inactive ones pass 0).
__device__ __forceinline__ void store_row_ss(const GemvArParams& p, float ss, int v, int t) {
#pragma unroll
  for (int off = 1; off < kVecPerRow; off <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (v < p.m * kVecPerRow && v % kVecPerRow == 0) p.ss_part[(v / kVecPerRow) * p.n_tiles + t] = ss;
}

// Dynamic shared memory of the kernel: the warps' rings.
template <typename T, int MT>
__host__ __device__ constexpr int stream_smem_bytes() {
  return kWarps * stages_for<T, MT>() * warp_stage<MT>() * static_cast<int>(sizeof(T));
}

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) gemv_ar_kernel(const GemvArParams p) {
  constexpr int MM = 16 * MT;
  __shared__ float red[kWarps][16][kGemvTileN];
  __shared__ float tile_s[MM][kGemvTileN];
  __shared__ unsigned s_epoch;
  __shared__ int s_ok;
  __shared__ float s_inv[MM];
  extern __shared__ __align__(128) char dyn_smem[];

  const int tid = threadIdx.x;
  const bool tail = p.normed != nullptr;
  WeightStream ws;
  ws.ring = dyn_smem + (tid >> 5) * stages_for<T, MT>() * warp_stage<MT>() * static_cast<int>(sizeof(T));
  ws.n_chunks = (p.k + kChunkK - 1) / kChunkK;
  ws.total = ((p.n_tiles - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1) * ws.n_chunks;
  for (int q = 0; q < stages_for<T, MT>() - 1; ++q) issue_chunk<T, MT>(ws, p, q);  // the ring's first chunks, in flight now
  if (tid == 0) s_epoch = *reinterpret_cast<volatile unsigned*>(&p.state[0]) + 1u;
  __syncthreads();
  const unsigned e = s_epoch;
  const int parity = static_cast<int>(e & 1u);
  const int result_slot = 2 * p.world + parity;
  unsigned* const my_flags = p.peer_flags[p.rank];
  // The thread's 16-byte vector of a tile: row v / kVecPerRow, columns (v % kVecPerRow) * 8 .. + 8.
  const int v = tid, vi = v / kVecPerRow, vc = (v % kVecPerRow) * 8;
  const bool has_vec = v < p.m * kVecPerRow;

  // Phase 1: partials, pushed to the ranks that reduce them.
  for (int pos = blockIdx.x, i = 0; pos < p.n_tiles; pos += gridDim.x, ++i) {
    const int t = tile_at(pos, p);
    const int col0 = t * kGemvTileN;
    compute_tile<T, MT>(ws, p, i * ws.n_chunks, tile_s, red);
    const int owner = owner_of(t, p.n_tiles, p.world);
    if (has_vec && col0 + vc < p.n) {
      float f[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        f[q] = tile_s[vi][vc + q];
        if (p.bias != nullptr) f[q] += Num<T>::to_f(static_cast<const T*>(p.bias)[col0 + vc + q]);
      }
      const uint4 part = pack8<T>(f);
      const long long off = static_cast<long long>(vi) * p.n + col0 + vc;
      const int src_slot = parity * p.world + p.rank;
      if (p.two_shot) {
        st_cg(slot<T>(p, owner, src_slot) + off, part);
      } else {
        for (int step = 0; step < p.world; ++step) {  // peers first, own slot last
          const int dst = (p.rank + 1 + step) % p.world;
          st_cg(slot<T>(p, dst, src_slot) + off, part);
        }
      }
    }
    __syncthreads();  // every store of the tile is issued before the flag's release (cumulative)
    if (tid == 0) {
      for (int step = 1; step < p.world; ++step) {
        const int dst = (p.rank + step) % p.world;
        if (!p.two_shot || dst == owner)
          st_release_sys(p.peer_flags[dst] + p.rank * kGemvMaxTiles + t, e);
      }
    }
  }

  // Phase 2: reduce the tiles this rank reduces.
  for (int pos = blockIdx.x; pos < p.n_tiles; pos += gridDim.x) {
    const int t = tile_at(pos, p);
    const int col0 = t * kGemvTileN;
    if (p.two_shot && owner_of(t, p.n_tiles, p.world) != p.rank) continue;
    if (tid == 0) {
      bool ok = true;
      for (int step = 1; step < p.world && ok; ++step) {
        const int src = (p.rank + step) % p.world;
        ok = wait_epoch<true>(my_flags + src * kGemvMaxTiles + t, e, p, src, t, kWaitPartial);
      }
      s_ok = ok;
    }
    __syncthreads();
    float ss = 0.f;
    if (s_ok && has_vec && col0 + vc < p.n) {
      const long long off = static_cast<long long>(vi) * p.n + col0 + vc;
      float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int src = 0; src < p.world; ++src) {  // rank order, as every rank sums
        float f[8];
        unpack8<T>(ld_cg(slot<T>(p, p.rank, parity * p.world + src) + off), f);
#pragma unroll
        for (int q = 0; q < 8; ++q) sum[q] += f[q];
      }
      const uint4 r = pack8<T>(sum);
      if (p.two_shot) {
        for (int step = 1; step < p.world; ++step) st_cg(slot<T>(p, (p.rank + step) % p.world, result_slot) + off, r);
      }
      ss = write_output<T>(p, vi, col0 + vc, r, tail);
    }
    if (tail) store_row_ss(p, ss, v, t);
    __syncthreads();
    if (p.two_shot && tid == 0 && s_ok) {
      for (int step = 1; step < p.world; ++step)
        st_release_sys(p.peer_flags[(p.rank + step) % p.world] + p.world * kGemvMaxTiles + t, e);
    }
  }

  // Phase 3 (two-shot): the tiles other ranks reduced.
  if (p.two_shot) {
    for (int pos = blockIdx.x; pos < p.n_tiles; pos += gridDim.x) {
      const int t = tile_at(pos, p);
      const int col0 = t * kGemvTileN;
      const int owner = owner_of(t, p.n_tiles, p.world);
      if (owner == p.rank) continue;
      if (tid == 0) s_ok = wait_epoch<true>(my_flags + p.world * kGemvMaxTiles + t, e, p, owner, t, kWaitReduced);
      __syncthreads();
      float ss = 0.f;
      if (s_ok && has_vec && col0 + vc < p.n) {
        const long long off = static_cast<long long>(vi) * p.n + col0 + vc;
        ss = write_output<T>(p, vi, col0 + vc, ld_cg(slot<T>(p, p.rank, result_slot) + off), tail);
      }
      if (tail) store_row_ss(p, ss, v, t);
      __syncthreads();
    }
  }

  if (tail) {
    // Grid barrier: every tile's h and sum of squares is written. The last CTA to arrive resets the
    // count and releases the others with this call's epoch (no reset needed between calls).
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      unsigned* count = reinterpret_cast<unsigned*>(&p.state[2]);
      unsigned* release = reinterpret_cast<unsigned*>(&p.state[3]);
      if (atomicAdd(count, 1u) == gridDim.x - 1) {
        *count = 0;
        st_release_gpu(release, e);
        s_ok = 1;
      } else {
        s_ok = wait_epoch<false>(release, e, p, -1, -1, kWaitBarrier);
      }
    }
    __syncthreads();
    if (s_ok) {
      // 1 / rms per row from the per-tile sums (the same order on every CTA).
      const int lane = tid & 31, warp = tid >> 5;
      for (int i = warp; i < p.m; i += kWarps) {
        float s = 0.f;
        for (int tt = lane; tt < p.n_tiles; tt += 32) s += __ldcg(p.ss_part + i * p.n_tiles + tt);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) s_inv[i] = rsqrtf(s / static_cast<float>(p.n) + p.eps);
      }
      __syncthreads();
      for (int pos = blockIdx.x; pos < p.n_tiles; pos += gridDim.x) {
        const int col0 = tile_at(pos, p) * kGemvTileN;
        if (has_vec && col0 + vc < p.n) {
          const long long off = static_cast<long long>(vi) * p.n + col0 + vc;
          float h[8], wt[8], o[8];
          unpack8<T>(ld_cg(static_cast<const T*>(p.out) + off), h);
          unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.norm_weight) + col0 + vc), wt);
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            const float x = h[q] * s_inv[vi];
            o[q] = p.weight_after_cast ? Num<T>::to_f(Num<T>::from_f(x)) * wt[q] : x * wt[q];
          }
          *reinterpret_cast<uint4*>(static_cast<T*>(p.normed) + off) = pack8<T>(o);
        }
      }
    }
  }

  // The last CTA to finish publishes this call's epoch for the next call (stream order makes it visible).
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    unsigned* done = reinterpret_cast<unsigned*>(&p.state[1]);
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0;
      p.state[0] = static_cast<int>(e);
    }
  }
}

// Launch with at most as many CTAs as can be resident at once (the RMSNorm tail's grid barrier needs every
// CTA running), and no more than there are tiles.
template <typename T, int MT>
cudaError_t launch_mt(const GemvArParams& p, int grid, cudaStream_t stream) {
  constexpr int smem = stream_smem_bytes<T, MT>();
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc == cudaSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // Above 48 KB of dynamic shared memory must be allowed per kernel (not a stream operation: fine in capture).
  if (rc == cudaSuccess) rc = cudaFuncSetAttribute(gemv_ar_kernel<T, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (rc == cudaSuccess) rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_ar_kernel<T, MT>, kThreads, smem);
  if (rc != cudaSuccess) return rc;
  if (per_sm < 1) return cudaErrorLaunchOutOfResources;
  grid = grid < per_sm * sms ? grid : per_sm * sms;
  gemv_ar_kernel<T, MT><<<dim3(grid), dim3(kThreads), smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const GemvArParams& p, int grid, cudaStream_t stream) {
  switch ((p.m + 15) / 16) {
    case 1: return launch_mt<T, 1>(p, grid, stream);
    case 2: return launch_mt<T, 2>(p, grid, stream);
    case 3: return launch_mt<T, 3>(p, grid, stream);
    default: return launch_mt<T, 4>(p, grid, stream);
  }
}

}  // namespace

cudaError_t gemv_ar_launch(const GemvArParams& p, int dtype, int grid, cudaStream_t stream) {
  const long long w_elems = static_cast<long long>(p.n) * p.ldw, a_elems = static_cast<long long>(p.m) * p.lda;
  if (w_elems >= (1ll << 31) || a_elems >= (1ll << 31)) return cudaErrorInvalidValue;  // 32-bit row offsets
  // Bulk copies need 16-byte aligned rows: the weight's base and row stride.
  if (reinterpret_cast<unsigned long long>(p.w) % 16 || p.ldw % 8) return cudaErrorInvalidValue;
  if (p.m < 1 || p.m > kGemvMaxM || p.n_tiles > kGemvMaxTiles || p.k % 8 || p.n % 8 || grid < 1 ||
      grid > p.n_tiles || p.world < 1 || p.world > 8 || (p.two_shot && p.n_tiles < p.world)) {
    return cudaErrorInvalidValue;
  }
  return dtype == 0 ? launch_typed<__nv_bfloat16>(p, grid, stream) : launch_typed<__half>(p, grid, stream);
}

}  // namespace fluxcompile
