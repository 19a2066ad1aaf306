// GEMV + all-reduce (+ residual add + RMSNorm) for decode, as one persistent kernel per rank.
//
// out = all_reduce_sum(A @ w.t() + bias) over the ranks of a group, A [m, k] (m <= 64), w [n, k] this rank's
// row shard of the weight. Memory-bound: the weight is streamed once with 16-byte loads that skip L1, into
// tensor-core MMAs (compute_tile), fp32 accumulation.
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

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "gemv_ar.h"

namespace fluxcompile {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCtasPerSm = 2;                      // 16 warps per SM keep enough weight loads in flight
#ifndef FLUXCOMPILE_GEMV_L2_HINT
#define FLUXCOMPILE_GEMV_L2_HINT 0  // lab: L2 prefetch size of the weight loads (0, 128, 256)
#endif
#ifndef FLUXCOMPILE_GEMV_KCONTIG
#define FLUXCOMPILE_GEMV_KCONTIG 0  // lab: a warp's k blocks abut (1) or interleave with the other warps' (0)
#endif
#ifndef FLUXCOMPILE_GEMV_WIDE
#define FLUXCOMPILE_GEMV_WIDE 0  // lab: 4 rows x 128 B per weight load instruction (compute_tile_wide)
#endif
#ifndef FLUXCOMPILE_GEMV_TMA
#define FLUXCOMPILE_GEMV_TMA 0  // lab: weight and A staged by bulk tensor copies (compute_tile_tma)
#endif
#ifndef FLUXCOMPILE_GEMV_TMA_S1
#define FLUXCOMPILE_GEMV_TMA_S1 4
#endif
#ifndef FLUXCOMPILE_GEMV_LAB_NOEPI
#define FLUXCOMPILE_GEMV_LAB_NOEPI 0  // lab: the partial tile straight to out (no slots, flags or reduction)
#endif
#ifndef FLUXCOMPILE_GEMV_FMA
#define FLUXCOMPILE_GEMV_FMA 0  // lab: m == 1 on CUDA cores, one row x 512 B per load instruction
#endif
constexpr int kVecPerRow = kGemvTileN / 8;         // 16-byte vectors of T per tile row

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

// The weight is read once: keep it out of L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
#if FLUXCOMPILE_GEMV_L2_HINT == 256
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
#elif FLUXCOMPILE_GEMV_L2_HINT == 128
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
#else
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
#endif
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
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

// Phase-1 work: the fp32 partial tile (without bias) into tile_s[i][c], on tensor cores.
//
// The weight is streamed at memory speed only if many 16-byte loads are in flight, and m up to 64 needs
// tensor cores (CUDA-core FMAs cap far below the bandwidth at m = 16). Both come from one layout trick: a
// sum over k may visit k in any order as long as A and B agree, so lane (g = lane / 4, t = lane % 4) of a
// warp loads 16 contiguous bytes, k = 8t .. 8t + 7 of a 32-wide k block, of weight row g of an n8 group and
// of A rows g and g + 8 of an m16 tile, and feeds elements 0-3 to one m16n8k16 MMA and 4-7 to a second,
// as if they were the fragment's k = 2t, 2t+1, 2t+8, 2t+9. No shared-memory staging, no shuffles.
// A warp covers the tile's 32 columns (4 n8 groups) over every kGemvWarps-th k block (split-K), so a
// tile is 8 warps' worth of loads; the warps' partial sums are added in warp order through shared memory
// (deterministic).
template <typename T, int MT>
__device__ void compute_tile(const GemvArParams& p, int col0, float (*tile_s)[kGemvTileN],
                             float (*red)[16][kGemvTileN]) {
  // k blocks per iteration: loads in flight against registers (the accumulators grow with MT).
  constexpr int U = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const T* a = static_cast<const T*>(p.a) + 8 * t;
  const T* w = static_cast<const T*>(p.w) + 8 * t;
  float c[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) c[mt][j][q] = 0.f;
  // 32-bit element offsets of the rows (the launcher refuses operands of 2^31 elements or more); -1: none.
  int woff[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = col0 + j * 8 + g;
    woff[j] = col < p.n ? col * p.ldw : -1;
  }
  int aoff[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mt * 16 + g + 8 * h;
      aoff[mt][h] = row < p.m ? row * p.lda : -1;
    }
  const uint4 zero = make_uint4(0, 0, 0, 0);
#if FLUXCOMPILE_GEMV_KCONTIG
  constexpr int kStepU = 32;  // a warp's U k blocks abut: whole 128-byte lines of each row per warp
  for (int k0 = warp * 32 * U; k0 < p.k; k0 += kWarps * 32 * U) {
#else
  constexpr int kStepU = kWarps * 32;
  for (int k0 = warp * 32; k0 < p.k; k0 += kWarps * 32 * U) {
#endif
    uint4 wv[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + u * kStepU;  // k % 8 == 0: a lane's 8 elements are all in range or none
      const bool kok = kk + 8 * t < p.k;
#pragma unroll
      for (int j = 0; j < 4; ++j) wv[u][j] = kok && woff[j] >= 0 ? ld_stream(w + woff[j] + kk) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + u * kStepU;
      const bool kok = kk + 8 * t < p.k;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 lo = kok && aoff[mt][0] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[mt][0] + kk) : zero;
        const uint4 hi = kok && aoff[mt][1] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[mt][1] + kk) : zero;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          mma16816<T>(c[mt][j], lo.x, hi.x, lo.y, hi.y, wv[u][j].x, wv[u][j].y);
          mma16816<T>(c[mt][j], lo.z, hi.z, lo.w, hi.w, wv[u][j].z, wv[u][j].w);
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

// Lab: the weight read as 4 rows x 128 contiguous bytes per load instruction (the fragments' 8 rows x 64 B
// read measurably slower). A warp's k block is 64 wide. Of an n8 group (rows 0-7 of it), instruction 0 gives
// lane (g, t) row g/2 at 16-byte chunk 4(g%2)+t, instruction 1 row 4+g/2 at chunk 4(1-g%2)+t. MMA pair "a"
// multiplies A's chunk t with each lane's (g odd ? v1 : v0), pair "b" A's chunk 4+t with the other: every
// lane of one t then holds one k chunk, as the k-permutation trick needs. Pair a's column c is row
// (c even ? c/2 : 4+c/2) of the group and pair b's column c is pair a's column c^1, so pair b accumulates
// into the same registers with each column pair swapped: accumulator (c0, c1) = rows (t, 4+t) of lane t.
template <typename T>
__device__ __forceinline__ void mma_swapped(float (&c)[4], const uint4& lo, const uint4& hi, unsigned b0,
                                            unsigned b1, bool second) {
  float s[4] = {c[1], c[0], c[3], c[2]};
  if (second) mma16816<T>(s, lo.z, hi.z, lo.w, hi.w, b0, b1);
  else mma16816<T>(s, lo.x, hi.x, lo.y, hi.y, b0, b1);
  c[0] = s[1]; c[1] = s[0]; c[2] = s[3]; c[3] = s[2];
}

template <typename T, int MT>
__device__ void compute_tile_wide(const GemvArParams& p, int col0, float (*tile_s)[kGemvTileN],
                                  float (*red)[16][kGemvTileN]) {
  constexpr int U = MT == 1 ? 2 : 1;  // 64-wide k blocks per iteration: 8 * U weight loads in flight
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const bool odd = g & 1;
  const T* a = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w);
  float c[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) c[mt][j][q] = 0.f;
  // Element offsets of the lane's two weight rows per n8 group, with their k chunk's offset; -1: none.
  const int ch0 = 8 * (4 * (g & 1) + t), ch1 = 8 * (4 * (1 - (g & 1)) + t);
  int woff[4][2];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r0 = col0 + j * 8 + g / 2, r1 = r0 + 4;
    woff[j][0] = r0 < p.n ? r0 * p.ldw + ch0 : -1;
    woff[j][1] = r1 < p.n ? r1 * p.ldw + ch1 : -1;
  }
  int aoff[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mt * 16 + g + 8 * h;
      aoff[mt][h] = row < p.m ? row * p.lda + 8 * t : -1;
    }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int k0 = warp * 64; k0 < p.k; k0 += kWarps * 64 * U) {
    uint4 wv[U][4][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + u * kWarps * 64;
      const bool ok0 = kk + ch0 < p.k, ok1 = kk + ch1 < p.k;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        wv[u][j][0] = ok0 && woff[j][0] >= 0 ? ld_stream(w + woff[j][0] + kk) : zero;
        wv[u][j][1] = ok1 && woff[j][1] >= 0 ? ld_stream(w + woff[j][1] + kk) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + u * kWarps * 64;
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {  // pair a: A chunk t; pair b: A chunk 4 + t
        const bool kok = kk + 8 * t + 32 * pr < p.k;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint4 lo = kok && aoff[mt][0] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[mt][0] + kk + 32 * pr) : zero;
          const uint4 hi = kok && aoff[mt][1] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[mt][1] + kk + 32 * pr) : zero;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint4 b = (odd != (pr == 1)) ? wv[u][j][1] : wv[u][j][0];
            if (pr == 0) {
              mma16816<T>(c[mt][j], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
              mma16816<T>(c[mt][j], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
            } else {
              mma_swapped<T>(c[mt][j], lo, hi, b.x, b.y, false);
              mma_swapped<T>(c[mt][j], lo, hi, b.z, b.w, true);
            }
          }
        }
      }
    }
  }
  // Accumulator (mt, j): A rows mt*16 + g (+8), tile columns j*8 + t and j*8 + 4 + t. Warp order sum.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (mt * 16 >= p.m) break;  // uniform over the CTA
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      red[warp][g][j * 8 + t] = c[mt][j][0];
      red[warp][g][j * 8 + 4 + t] = c[mt][j][1];
      red[warp][g + 8][j * 8 + t] = c[mt][j][2];
      red[warp][g + 8][j * 8 + 4 + t] = c[mt][j][3];
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

// ---- Bulk tensor copies (TMA) into a ring of shared-memory stages ----
// A stage holds 256 k of the tile's 32 weight rows (16 KB) and of A's rows. The bytes in flight sit in
// shared memory, not in registers, so a CTA keeps 2-4 stages (48-96 KB) of the weight streaming while its
// warps multiply the stage that landed. Warp w takes k = 32w .. 32w + 31 of a stage, with the register
// layout of compute_tile (lane (g, t): 16 bytes at chunk t of row g).
constexpr int kTmaK = 256;
constexpr int kTmaRowBytes = kTmaK * 2;

template <int MT>
struct TmaCfg {
  static constexpr int kStages = MT == 1 ? FLUXCOMPILE_GEMV_TMA_S1 : MT == 2 ? 3 : 2;
  static constexpr int kWBytes = kGemvTileN * kTmaRowBytes;
  static constexpr int kABytes = 16 * MT * kTmaRowBytes;
  static constexpr int kStageBytes = kWBytes + kABytes;
  static constexpr int kSmem = kStages * kStageBytes;
  static_assert(kSmem >= kWarps * 16 * kGemvTileN * 4, "the warps' partial sums reuse the stages");
};

__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned ok = 0;
  while (!ok) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void tma_load_2d(void* dst, const GemvTmaMap* map, int c0, int c1, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
// Generic-proxy accesses of shared memory before this are ordered before later bulk copies into it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

template <typename T, int MT>
__device__ void compute_tile_tma(const GemvArParams& p, int col0, float (*tile_s)[kGemvTileN], char* smem,
                                 unsigned long long* bars, unsigned& uses) {
  using C = TmaCfg<MT>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int nst = (p.k + kTmaK - 1) / kTmaK;
  const unsigned q0 = uses;
  auto issue = [&](int it) {
    const unsigned s = (q0 + it) % C::kStages;
    char* st = smem + s * C::kStageBytes;
    mbar_expect_tx(&bars[s], C::kWBytes + p.a_box_rows * kTmaRowBytes);
    tma_load_2d(st, &p.tmap_w, it * kTmaK, col0, &bars[s]);
    tma_load_2d(st + C::kWBytes, &p.tmap_a, it * kTmaK, 0, &bars[s]);
  };
  if (tid == 0) {
    for (int it = 0; it < C::kStages && it < nst; ++it) issue(it);
  }
  float c[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) c[mt][j][q] = 0.f;
  const int lane_off = warp * 64 + t * 16;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int it = 0; it < nst; ++it) {
    const unsigned u = q0 + it, s = u % C::kStages;
    mbar_wait(&bars[s], (u / C::kStages) & 1u);
    const char* ws = smem + s * C::kStageBytes + lane_off;
    const char* as = ws + C::kWBytes;
    uint4 wv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wv[j] = *reinterpret_cast<const uint4*>(ws + (j * 8 + g) * kTmaRowBytes);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r = mt * 16 + g;
      const uint4 lo = r < p.m ? *reinterpret_cast<const uint4*>(as + r * kTmaRowBytes) : zero;
      const uint4 hi = r + 8 < p.m ? *reinterpret_cast<const uint4*>(as + (r + 8) * kTmaRowBytes) : zero;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mma16816<T>(c[mt][j], lo.x, hi.x, lo.y, hi.y, wv[j].x, wv[j].y);
        mma16816<T>(c[mt][j], lo.z, hi.z, lo.w, hi.w, wv[j].z, wv[j].w);
      }
    }
    __syncthreads();  // every warp is done with stage s: refill it
    if (tid == 0 && it + C::kStages < nst) issue(it + C::kStages);
  }
  uses = q0 + nst;
  // The warps' partial sums reuse the stages (every copy has landed and been read).
  float (*red)[16][kGemvTileN] = reinterpret_cast<float (*)[16][kGemvTileN]>(smem);
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
  fence_proxy_async();  // the next tile's copies overwrite what red wrote
  __syncthreads();
}

// Lab: m == 1 on CUDA cores. Warp w owns the tile's rows 4w .. 4w + 3; its lanes read 512 contiguous bytes
// of a row per instruction (16 loads in flight: 4 rows x 4 chunks), fp32 FMAs, a shuffle sum per row.
template <typename T>
__device__ void compute_tile_fma(const GemvArParams& p, int col0, float (*tile_s)[kGemvTileN]) {
  constexpr int R = kGemvTileN / kWarps, KU = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* a = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w);
  float acc[R];
  int woff[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = 0.f;
    const int col = col0 + warp * R + r;
    woff[r] = col < p.n ? col * p.ldw : -1;
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int k0 = lane * 8; k0 < p.k; k0 += 256 * KU) {
    uint4 wv[KU][R];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int kk = k0 + u * 256;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = kk < p.k && woff[r] >= 0 ? ld_stream(w + woff[r] + kk) : zero;
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int kk = k0 + u * 256;
      float af[8], wf[8];
      unpack8<T>(kk < p.k ? *reinterpret_cast<const uint4*>(a + kk) : zero, af);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        unpack8<T>(wv[u][r], wf);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[r] = fmaf(af[q], wf[q], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    if (lane == 0) tile_s[0][warp * R + r] = acc[r];
  }
  __syncthreads();
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

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) gemv_ar_kernel(const __grid_constant__ GemvArParams p) {
  constexpr int MM = 16 * MT;
#if FLUXCOMPILE_GEMV_TMA
  extern __shared__ __align__(1024) char stages[];
  __shared__ unsigned long long bars[TmaCfg<MT>::kStages];
  unsigned uses = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < TmaCfg<MT>::kStages; ++s) mbar_init(&bars[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#else
  __shared__ float red[kWarps][16][kGemvTileN];
#endif
  __shared__ float tile_s[MM][kGemvTileN];
  __shared__ unsigned s_epoch;
  __shared__ int s_ok;
  __shared__ float s_inv[MM];

  const int tid = threadIdx.x;
  const bool tail = p.normed != nullptr;
  // The epoch is first needed after the first tile's math: its load's latency hides behind the weight stream.
  unsigned prev_epoch = 0;
  if (tid == 0) prev_epoch = *reinterpret_cast<volatile unsigned*>(&p.state[0]);
  __syncthreads();  // (and the copies' barriers are initialized)
  unsigned e = 0;
  int parity = 0, result_slot = 0;
  bool have_epoch = false;  // uniform over the CTA
  auto take_epoch = [&]() {
    if (have_epoch) return;
    if (tid == 0) s_epoch = prev_epoch + 1u;
    __syncthreads();
    e = s_epoch;
    parity = static_cast<int>(e & 1u);
    result_slot = 2 * p.world + parity;
    have_epoch = true;
  };
  unsigned* const my_flags = p.peer_flags[p.rank];
  // The thread's 16-byte vector of a tile: row v / kVecPerRow, columns (v % kVecPerRow) * 8 .. + 8.
  const int v = tid, vi = v / kVecPerRow, vc = (v % kVecPerRow) * 8;
  const bool has_vec = v < p.m * kVecPerRow;

  // Phase 1: partials, pushed to the ranks that reduce them.
  for (int pos = blockIdx.x; pos < p.n_tiles; pos += gridDim.x) {
    const int t = tile_at(pos, p);
    const int col0 = t * kGemvTileN;
#if FLUXCOMPILE_GEMV_FMA
    if (MT == 1 && p.m == 1) compute_tile_fma<T>(p, col0, tile_s); else
#endif
#if FLUXCOMPILE_GEMV_TMA
    compute_tile_tma<T, MT>(p, col0, tile_s, stages, bars, uses);
#elif FLUXCOMPILE_GEMV_WIDE
    compute_tile_wide<T, MT>(p, col0, tile_s, red);
#else
    compute_tile<T, MT>(p, col0, tile_s, red);
#endif
    take_epoch();
#if FLUXCOMPILE_GEMV_LAB_NOEPI
    if (has_vec && col0 + vc < p.n) {
      float f[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) f[q] = tile_s[vi][vc + q];
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + static_cast<long long>(vi) * p.n + col0 + vc) = pack8<T>(f);
    }
    __syncthreads();
    continue;
#endif
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

  take_epoch();  // (a CTA without tiles)
#if FLUXCOMPILE_GEMV_LAB_NOEPI
  return;
#endif

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
template <typename T>
constexpr CUtensorMapDataType tma_dtype() {
  return sizeof(T) == 2 && std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// A 2-D tensor map of a row-major [rows, cols] matrix (row stride ld elements of T) in boxes of
// box_rows x box_cols; reads past the matrix land as zeros.
template <typename T>
cudaError_t encode_tma(GemvTmaMap* map, const void* base, int rows, int cols, int ld, int box_rows, int box_cols) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    cudaError_t rc = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (rc != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) return cudaErrorNotSupported;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * sizeof(T)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  CUresult r = encode(reinterpret_cast<CUtensorMap*>(map), tma_dtype<T>(), 2, const_cast<void*>(base), dims, strides,
                      box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T, int MT>
cudaError_t launch_mt(const GemvArParams& p_in, int grid, cudaStream_t stream) {
  GemvArParams p = p_in;
  int device = 0, sms = 0, per_sm = 0, smem = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc == cudaSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
#if FLUXCOMPILE_GEMV_TMA
  smem = TmaCfg<MT>::kSmem;
  p.a_box_rows = (p.m + 7) / 8 * 8;
  if (rc == cudaSuccess) rc = encode_tma<T>(&p.tmap_w, p.w, p.n, p.k, p.ldw, kGemvTileN, kTmaK);
  if (rc == cudaSuccess) rc = encode_tma<T>(&p.tmap_a, p.a, p.m, p.k, p.lda, p.a_box_rows, kTmaK);
  if (rc == cudaSuccess)
    rc = cudaFuncSetAttribute(gemv_ar_kernel<T, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
#endif
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
  if (p.m < 1 || p.m > kGemvMaxM || p.n_tiles > kGemvMaxTiles || p.k % 8 || p.n % 8 || grid < 1 ||
      grid > p.n_tiles || p.world < 1 || p.world > 8 || (p.two_shot && p.n_tiles < p.world)) {
    return cudaErrorInvalidValue;
  }
  return dtype == 0 ? launch_typed<__nv_bfloat16>(p, grid, stream) : launch_typed<__half>(p, grid, stream);
}

}  // namespace fluxcompile
