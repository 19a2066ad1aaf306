// GEMV + all-reduce (+ residual add + RMSNorm) for decode, as one persistent kernel per rank.
//
// out = all_reduce_sum(A @ w.t() + bias) over the ranks of a group, A [m, k] (m <= 64), w [n, k] this rank's
// row shard of the weight. Memory-bound: the weight is streamed once, with fp32 accumulation, by one of
// three loaders (Cfg below):
//   m <= 3 (compute_tile_row): CUDA-core FMAs over whole 512-byte pieces of a weight row per load;
//   3 < m < 9 (compute_tile): 16-byte loads straight into tensor-core MMA fragments, skipping L1,
//     with the L2::256B prefetch size (faster than without it for these 64-byte pieces of 8 rows);
//   m >= 9 (GEMV_WG_MIN_M; compute_tile_wgmma): bulk tensor copies (TMA) of the weight and A into a ring of
//     128-byte-swizzled shared-memory stages, consumed by warpgroup MMAs (wgmma) straight from shared memory,
//     two tiles per CTA (one with GEMV_WG_HALF where two would leave half the SMs idle). Per-lane loads of A
//     from L2 would move twice the weight's bytes at m = 64, and mma.sync fed from the same stages by per-lane
//     shared-memory loads is slower than wgmma reading them itself (BENCHMARKS.md, decode).
//
// A tile is kGemvTileN output columns for all m rows; a CTA computes kTpc adjacent tiles at once (a unit).
// Each CTA owns a fixed list of units (positions blockIdx.x, +gridDim.x, ...) through three phases, so a
// tile is reduced by the CTA that computed it here:
//   1. compute each tile's partial (+ bias, rounded to T like addmm's output) and store it straight into
//      the destination ranks' symmetric slots (zero-copy, over NVLink; the CTA's last unit keeps its own
//      partial in shared memory for phase 2), then release a flag per tile:
//        one-shot: to every rank;   two-shot: only to the tile's owner (tiles are split in contiguous
//        ranges over the ranks). Tiles that other ranks need come first (communication-aware order: on
//        rank r the owners r+1, r+2, ..., r).
//   2. for each tile this rank reduces (one-shot: all of them, two-shot: its own), wait for the peers'
//      flags, sum the partials in rank order (fp32), round to T; two-shot: store the reduced tile into
//      every peer's result slot and release its flag there. Write the output (or h = residual + r).
//   3. two-shot: wait for the tiles other ranks own and copy them out.
//   tail: a grid barrier, then RMSNorm of h row by row, a row a CTA (its sum of squares in one CTA).
//
// LL (p.ll = 1, one-shot only): the partials to peers travel as LL words (data and epoch in every 8 bytes, see
// st_ll) into LL regions after the regular slots, and each reader thread waits for its own words: no
// release fence and no flag per tile on the writer's critical path. LL128 (p.ll = 2) does the same in
// 128-byte lines of seven data vectors and the epoch (see st_line), 8/7 of the data's bytes instead of twice.
//
// Flags carry epochs: e = (this rank's calls of this kernel before this one) + 1 (every rank makes the same
// calls, so the epochs agree), from a 64-bit counter in state[0..1] that each call raises by kCallStep:
// every CTA reads it, then adds its share without awaiting a reply (CTA 0 kCallStep - (gridDim.x - 1), the
// others 1). A CTA that reads it sees whole earlier calls and less than one step of its own call (its own
// share not yet added), so counter / kCallStep is the number of earlier calls in every CTA. A
// wait succeeds when flag - e >= 0 (int32 wrap-around), so a value left by an earlier call never passes
// and nothing is reset between calls or CUDA graph replays. Data slots alternate by the epoch's
// parity: a rank can start call e + 1 while a peer still reads call e's slots, but it cannot start call
// e + 2 before having received something the peer produced in call e + 1 (one-shot: every tile; two-shot:
// every rank owns >= 1 tile), i.e. after the peer finished reading call e.
//
// Every wait is bounded (timeout_ns on %globaltimer, bounded_wait.cuh): the first timeout records (rank, peer,
// tile, epoch, kind) in err, and every later wait of the call gives up at once, so a missing peer costs one
// timeout. The host checks err afterwards and raises an error naming them.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "bounded_wait.cuh"
#include "gemv_ar.h"
#include "gemv_ar_tuning.h"  // the GEMV_* settings (lab builds override them)

namespace fluxcompile {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTmaK = GEMV_WG_STAGE_K;     // k per shared-memory stage of the wgmma loader (4 boxes of 64)
constexpr int kTmaRowBytes = kTmaK * 2;    // a stage row (T is 2 bytes)
constexpr int kBoxK = 64;                  // k per TMA box: 128 bytes, the width of the 128-byte swizzle

// Per m16 count MT (and kRowM: the CUDA-core loader's m; 0 for the MMA loaders, the fragment loader at MT = 1;
// -1 for the wgmma loader at MT = 1; kHalf, the wgmma loader's 32-column units): the loader, tiles per CTA, CTAs
// per SM and the wgmma loader's stage ring (as many stages as fit in 200 KB, at most GEMV_WG_MAX_STAGES).
template <int MT, int kRowM = 0, bool kHalf = false>
struct Cfg {
  static constexpr bool kTma = (kRowM == 0 && MT >= 2) || kRowM < 0;  // (wgmma at m = 3-8: slower)
  // Tiles per CTA: wgmma's M = 64, A's bytes from L2 halve (one with kHalf: twice the CTAs).
  static constexpr int kTpc = kTma && !kHalf ? 2 : 1;
  static constexpr int kCols = kGemvTileN * kTpc;          // a unit's output columns
  static constexpr int kCtas = kTma ? 1 : 2;
  static constexpr int kARows = 16 * MT;                   // wgmma's N: A's rows in a stage (zeros past m)
  static constexpr int kWRows = kTma ? 64 : kCols;         // a stage's weight rows (wgmma's M; zeros past kCols)
  static constexpr int kBoxes = kTmaK / kBoxK;             // TMA boxes of the weight (and of A) per stage
  static constexpr int kBoxW = kWRows * kBoxK * 2;         // one box of the weight in shared memory
  static constexpr int kWBytes = kBoxes * kBoxW;           // = kWRows * kTmaRowBytes
  static constexpr int kABytes = kARows * kTmaRowBytes;
  static constexpr int kStageBytes = kWBytes + kABytes;
  static constexpr int kFit = 200 * 1024 / kStageBytes;
  static constexpr int kStages = !kTma ? 0 : kFit < GEMV_WG_MAX_STAGES ? kFit : GEMV_WG_MAX_STAGES;
  static constexpr int kSmem = kStages * kStageBytes;      // dynamic shared memory (the wgmma loader's)
};

constexpr int kVecPerRow = kGemvTileN / 8;         // 16-byte vectors of T per tile row

// The call counter's step (state[0..1]): more than any grid's CTAs (a grid has at most one CTA per tile).
constexpr unsigned long long kCallStep = 1ull << 16;
static_assert(kGemvMaxTiles < kCallStep, "the call counter's step exceeds any grid's CTAs");

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
// The weight is read once: keep it out of L1. kPrefetch: L2 fetches 256 bytes per miss (faster for the
// fragment loads' 64-byte pieces of 8 rows, slower for whole 512-byte row pieces).
template <bool kPrefetch>
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  if (kPrefetch) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  }
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

// The bookkeeping of a bounded wait (bounded_wait.cuh) with this call's bound and error words, called every spin
// with its iteration count: true once the wait must give up (the first timeout records rank, peer, tile, epoch and
// kind in err).
__device__ __forceinline__ bool give_up(unsigned iter, unsigned long long& t0, unsigned e, const GemvArParams& p,
                                        int peer, int tile, int kind) {
  return bounded_wait_gives_up(iter, t0, p, true, peer, tile, static_cast<int>(e), kind);
}

// Bounded wait (one thread) until *flag has reached epoch e. False on timeout or when another wait of
// this call already timed out; the first timeout is recorded in err.
template <bool kSys>
__device__ bool wait_epoch(const unsigned* flag, unsigned e, const GemvArParams& p, int peer, int tile, int kind) {
  unsigned long long t0 = 0;
  for (unsigned iter = 0;; ++iter) {
    unsigned v = kSys ? ld_acquire_sys(flag) : ld_acquire_gpu(flag);
    if (static_cast<int>(v - e) >= 0) return true;
    if (give_up(iter, t0, e, p, peer, tile, kind)) return false;
  }
}

// LL ("low latency", NCCL's name) words: 16 bytes of data travel as two 16-byte stores {d0, e, d1, e},
// {d2, e, d3, e}, each 8-byte half a data word and the epoch. A reader that sees the epoch in both halves
// of both stores has the data (8-byte halves land whole, as NCCL's LL protocol relies on), so the
// writer needs no fence and no flag after its data: one NVLink crossing instead of data, fence, flag.
__device__ __forceinline__ void st_ll(char* dst, const uint4& d, unsigned e) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(d.x), "r"(e), "r"(d.y), "r"(e)
               : "memory");
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 16), "r"(d.z), "r"(e), "r"(d.w),
               "r"(e)
               : "memory");
}
// Bounded wait (every thread for its own vector) until the LL words at src carry epoch e; their data in d.
// Not inlined: inlined, it pushes the m <= 16 fragment loader's instantiation past its 128 registers.
__device__ __noinline__ bool wait_ll(const char* src, unsigned e, uint4& d, const GemvArParams& p, int peer, int tile) {
  unsigned long long t0 = 0;
  for (unsigned iter = 0;; ++iter) {
    uint4 lo, hi;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(lo.x), "=r"(lo.y), "=r"(lo.z), "=r"(lo.w)
                 : "l"(src)
                 : "memory");
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(hi.x), "=r"(hi.y), "=r"(hi.z), "=r"(hi.w)
                 : "l"(src + 16)
                 : "memory");
    if (lo.y == e && lo.w == e && hi.y == e && hi.w == e) {
      d = make_uint4(lo.x, lo.z, hi.x, hi.z);
      return true;
    }
    if (give_up(iter, t0, e, p, peer, tile, kWaitPartial)) return false;
  }
}

// LL128 (NCCL's name): a tile's partial travels as 128-byte lines, each written by eight lanes of a warp in one
// store instruction: lanes 0-6 of the line a 16-byte data vector each, lane 7 the epoch. NVLink and the L2
// move such a line whole (NCCL's LL128 protocol relies on the same), so a reader that loads the line with
// eight lanes in one instruction and finds the epoch in lane 7's vector has the data of lanes 0-6.
constexpr int kLineVecs = 7;  // data vectors per line
__host__ __device__ constexpr int ll128_lines(int m) { return (m * kVecPerRow + kLineVecs - 1) / kLineVecs; }
// Line `line` of tile `tile` of partial slot `index` (parity * world + src) in rank dst's LL region.
__device__ __forceinline__ char* ll128_line(const GemvArParams& p, int dst, int index, int tile, int line) {
  return p.peer_data[dst] + static_cast<long long>(2 * p.world + 2 + 2 * index) * p.slot_bytes +
         (static_cast<long long>(tile) * ll128_lines(p.m) + line) * 128;
}
__device__ __forceinline__ void st_line(char* dst, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// Bounded wait of a whole warp (every lane calls it) until each of its lines carries epoch e: the lane's
// positions of `passes` (<= P, equal over the CTA) passes, src[pass] its 16 bytes of a line (valid[pass]: the line
// exists, equal over its eight lanes), loaded together so that their latencies overlap; the data in d.
// Warp-uniform result; `tile` names the unit in a timeout.
template <int P>
__device__ __forceinline__ bool wait_ll128(const char* const (&src)[P], const bool (&valid)[P], int passes, unsigned e,
                                           uint4 (&d)[P], const GemvArParams& p, int peer, int tile) {
  const int lane = threadIdx.x & 31;
  unsigned long long t0 = 0;
  for (unsigned iter = 0;; ++iter) {
    bool ready = true;
#pragma unroll
    for (int pass = 0; pass < P; ++pass) {
      if (pass < passes) {
        uint4 v = make_uint4(e, e, e, e);
        if (valid[pass]) {
          asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "l"(src[pass])
                       : "memory");
        }
        const unsigned flag = __shfl_sync(0xffffffffu, v.w, lane | 7);  // every lane, whatever `ready` holds
        ready = ready & (flag == e);
        d[pass] = v;
      }
    }
    if (__all_sync(0xffffffffu, ready)) return true;
    if (__any_sync(0xffffffffu, give_up(iter, t0, e, p, peer, tile, kWaitPartial))) return false;
  }
}

__device__ __forceinline__ int first_tile(int owner, int n_tiles, int world) {
  return (owner * n_tiles + world - 1) / world;
}
__device__ __forceinline__ int owner_of(int t, int n_tiles, int world) { return (t * world) / n_tiles; }

// Communication-aware order: position -> unit (kTpc tiles). Owners' tile ranges are contiguous and in rank
// order, so "the tiles of owners rank+1, rank+2, ..., rank" is the tile range rotated to start at rank+1's.
template <int kTpc>
__device__ __forceinline__ int unit_at(int pos, const GemvArParams& p) {
  const int units = (p.n_tiles + kTpc - 1) / kTpc;
  return (first_tile((p.rank + 1) % p.world, p.n_tiles, p.world) / kTpc + pos) % units;
}

template <typename T>
__device__ __forceinline__ T* slot(const GemvArParams& p, int dst, int index) {
  return reinterpret_cast<T*>(p.peer_data[dst] + static_cast<long long>(index) * p.slot_bytes);
}
// LL region of partial slot `index` (parity * world + src) on rank dst: two slots after the regular ones;
// element offset off of the partial is at byte 4 * off * sizeof(T) / 2 (twice the data's bytes).
template <typename T>
__device__ __forceinline__ char* ll_slot(const GemvArParams& p, int dst, int index, long long off) {
  return p.peer_data[dst] + static_cast<long long>(2 * p.world + 2 + 2 * index) * p.slot_bytes +
         off * static_cast<long long>(2 * sizeof(T));
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

// The warps' accumulators (mt, group j: A rows mt*16 + g (+8), columns j*8 + 2t (+1)) summed in warp order
// (deterministic) through red into tile_s[row][column of the unit].
template <int MT, int NG>
__device__ __forceinline__ void reduce_warps(const GemvArParams& p, const float (&c)[MT][NG][4],
                                             float (*red)[16][NG * 8], float (*tile_s)[NG * 8]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (mt * 16 >= p.m) break;  // uniform over the CTA
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      red[warp][g][j * 8 + 2 * t] = c[mt][j][0];
      red[warp][g][j * 8 + 2 * t + 1] = c[mt][j][1];
      red[warp][g + 8][j * 8 + 2 * t] = c[mt][j][2];
      red[warp][g + 8][j * 8 + 2 * t + 1] = c[mt][j][3];
    }
    __syncthreads();
    for (int e = tid; e < 16 * NG * 8; e += kThreads) {
      const int i = e / (NG * 8), col = e % (NG * 8);
      float v = 0.f;
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) v += red[ww][i][col];
      tile_s[mt * 16 + i][col] = v;
    }
    __syncthreads();
  }
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
__device__ void compute_tile(const GemvArParams& p, int col0, float (*tile_s)[kGemvTileN]) {
  __shared__ float red[kWarps][16][kGemvTileN];
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
  // The warps' k blocks interleave (warp w: blocks w, w + 8, ...): faster than each warp's abutting.
  for (int k0 = warp * 32; k0 < p.k; k0 += kWarps * 32 * U) {
    uint4 wv[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + u * kWarps * 32;  // k % 8 == 0: a lane's 8 elements are all in range or none
      const bool kok = kk + 8 * t < p.k;
#pragma unroll
      for (int j = 0; j < 4; ++j) wv[u][j] = kok && woff[j] >= 0 ? ld_stream<true>(w + woff[j] + kk) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + u * kWarps * 32;
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
  reduce_warps<MT, 4>(p, c, red, tile_s);
}

// Sums each of a lane's N values over the warp's 32 lanes with N - 1 + 5 - log2(N) shuffles (not 5 N):
// every halving step trades half the values with the partner lane. Returns the sum of value
// index_of(lane) (each index on two or more lanes).
template <int N>
__device__ __forceinline__ float warp_sum_many(float (&v)[N], int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two up to 32");
  constexpr int kSteps = N >= 32 ? 5 : N >= 16 ? 4 : N >= 8 ? 3 : N >= 4 ? 2 : N >= 2 ? 1 : 0;
  // Affine loop bounds, so both loops unroll fully and every index is a constant (v stays in registers).
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    const int half = (N >> st) / 2, o = 16 >> st;
    const bool upper = lane & o;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      if (j < half) {
        const float send = upper ? v[j] : v[j + half];
        const float keep = upper ? v[j + half] : v[j];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
    }
  }
  float s = v[0];
#pragma unroll
  for (int o = 16 >> kSteps; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}
// The value index whose sum warp_sum_many<N> leaves on `lane`: lane bits 4, 3, ... give the index's
// bits log2(N) - 1, log2(N) - 2, ...
template <int N>
__device__ __forceinline__ int index_of(int lane) {
  int idx = 0;
#pragma unroll
  for (int o = 16; o > 16 / N; o >>= 1) idx = idx * 2 + ((lane & o) ? 1 : 0);
  return idx;
}

// m <= 3 on CUDA cores (an MMA would waste most of its 16 rows, and its fragments read 64-byte pieces of 8
// rows per load instruction, slower than whole 512-byte pieces of one row). The pure read's
// fastest shape (the lab's tile3): a load instruction is 512 contiguous bytes of one row (a k block of 256),
// m <= 2: warp w reads 16 rows of the tile (row group w % 2) at the k blocks w / 2, w / 2 + 4, ... (the
// warps of a group interleave), 16 loads in flight; m = 3: 8 rows per warp (4 row groups), 4 loads in
// flight (registers: 3 x 8 accumulators per lane). A's 8 elements per lane are loaded once per k block for
// all the warp's rows. Per warp: fp32 FMAs, then one shuffle reduction of all its rows; the warps of a row
// group are added in warp order through shared memory (deterministic). Faster at m = 1-2 than 4 rows per
// warp over all k.
template <typename T, int M>
__device__ void compute_tile_row(const GemvArParams& p, int col0, float (*tile_s)[kGemvTileN]) {
  static_assert(M >= 1 && M <= 4, "the MMA loaders take m > 4");
  // RW rows per warp (32 spill), CH loads in flight per chunk; m > 2 (more accumulators, A kept unpacked)
  // takes GEMV_ROW_RW / GEMV_ROW_CH.
  constexpr bool kWide = M > 2;
  constexpr int RW = kWide ? GEMV_ROW_RW : 16, G = kGemvTileN / RW, WPG = kWarps / G, KB = 256;
  constexpr int CH = kWide ? GEMV_ROW_CH : 16;
  static_assert(RW % CH == 0 && kGemvTileN % RW == 0, "whole chunks per warp");
  __shared__ float red[kWarps][M][RW];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r0 = (warp % G) * RW;
  const T* a = static_cast<const T*>(p.a) + lane * 8;
  const T* w = static_cast<const T*>(p.w) + static_cast<long long>(col0 + r0) * p.ldw + lane * 8;
  const int nr = p.n - col0 - r0;  // rows of this warp inside the weight
  float acc[M][RW];
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int r = 0; r < RW; ++r) acc[i][r] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int kk = (warp / G) * KB; kk < p.k; kk += WPG * KB) {
    const bool kok = kk + lane * 8 < p.k;  // k % 8 == 0: a lane's 8 elements are all in range or none
    uint4 apk[M];  // m <= 2: A stays packed (half the registers); its elements are converted where used
#pragma unroll
    for (int i = 0; i < M; ++i) apk[i] = kok ? __ldg(reinterpret_cast<const uint4*>(a + i * p.lda + kk)) : zero;
    float afw[kWide ? M : 1][8];  // m > 2: A unpacked once per k block (its conversions would outnumber the FMAs)
    if constexpr (kWide) {
#pragma unroll
      for (int i = 0; i < M; ++i) unpack8<T>(apk[i], afw[i]);
    }
#pragma unroll
    for (int h = 0; h < RW / CH; ++h) {
      uint4 wv[CH];
#pragma unroll
      for (int r = 0; r < CH; ++r)
        wv[r] = kok && h * CH + r < nr ? ld_stream<false>(w + (h * CH + r) * p.ldw + kk) : zero;
#pragma unroll
      for (int r = 0; r < CH; ++r) {
        float wf[8];
        unpack8<T>(wv[r], wf);
#pragma unroll
        for (int i = 0; i < M; ++i) {
          float au[8];  // m <= 2: A converted where used
          if constexpr (!kWide) unpack8<T>(apk[i], au);
          const float* af = kWide ? afw[i] : au;
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[i][h * CH + r] = fmaf(af[q], wf[q], acc[i][h * CH + r]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float s = warp_sum_many<RW>(acc[i], lane);
    if (lane < RW * (32 / RW) && (lane & (32 / RW - 1)) == 0) red[warp][i][index_of<RW>(lane)] = s;
  }
  __syncthreads();
  if (threadIdx.x < M * kGemvTileN) {
    const int i = threadIdx.x / kGemvTileN, col = threadIdx.x % kGemvTileN, grp = col / RW, r = col % RW;
    float s = 0.f;
#pragma unroll
    for (int ww = grp; ww < kWarps; ww += G) s += red[ww][i][r];
    tile_s[i][col] = s;
  }
  __syncthreads();
}

// ---- The bulk-copy helpers of the wgmma loader ----

__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Waits for a local copy (no peer is involved: it completes or the copy faults).
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
__device__ __forceinline__ void tma_load_2d(void* dst, const GemvTmaMap* map, int c0, int c1, unsigned long long* bar,
                                            unsigned long long policy = 0) {
  if (GEMV_WG_HINT && policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
    return;
  }
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

// ---- The wgmma loader (m >= GEMV_WG_MIN_M) ----
// A stage holds kTmaK (256) k of the unit's 64 weight rows and of A's 16 * MT rows (zeros past m), copied by
// the TMA engine in 128-byte-swizzled boxes of 64 k (at 256: 4 of the weight, 4 of A) and completed on an
// mbarrier; its bytes in flight sit in shared memory, not in registers. Warpgroup MMAs read them straight from
// there: the weight is wgmma's A operand (M = 64 rows = the unit's columns), A its B operand (N = 16 * MT).
// Warpgroup 0 takes the first half of the stage's boxes, warpgroup 1 the second; their accumulators are
// summed in that order into tile_s (deterministic). Thread 0 refills a stage once both warpgroups are done
// with it.

// A K-major, 128-byte-swizzled operand of 8-row atoms 1024 bytes apart (the TMA box layout).
__device__ __forceinline__ unsigned long long wg_desc(const void* p) {
  const unsigned long long a = smem_u32(p);
  return ((a & 0x3FFFFull) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

#define GEMV_WG_R8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                      "+f"(d[i + 6]), "+f"(d[i + 7])
// d (64 x N fp32, wgmma's accumulator layout) += A-desc (64 x 16) * B-desc (16 x N).
template <typename T>
struct WgPtx;
template <>
struct WgPtx<__nv_bfloat16> {
  template <int N>
  static __device__ __forceinline__ void mma(float (&d)[N / 2], unsigned long long da, unsigned long long db);
};
template <>
struct WgPtx<__half> {
  template <int N>
  static __device__ __forceinline__ void mma(float (&d)[N / 2], unsigned long long da, unsigned long long db);
};
#define GEMV_WG_DEF(TY, PT, N, REGS, OPS, ...)                                                               \
  template <>                                                                                                \
  __device__ __forceinline__ void WgPtx<TY>::mma<N>(float (&d)[N / 2], unsigned long long da,               \
                                                    unsigned long long db) {                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " {" REGS "}, " OPS            \
                 ", p, 1, 1, 0, 0;\n}"                                                                       \
                 : __VA_ARGS__                                                                               \
                 : "l"(da), "l"(db));                                                                        \
  }
#define GEMV_REGS8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define GEMV_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define GEMV_REGS24 GEMV_REGS16 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define GEMV_REGS32 GEMV_REGS24 ", %24, %25, %26, %27, %28, %29, %30, %31"
GEMV_WG_DEF(__nv_bfloat16, "bf16", 16, GEMV_REGS8, "%8, %9", GEMV_WG_R8(0))
GEMV_WG_DEF(__nv_bfloat16, "bf16", 32, GEMV_REGS16, "%16, %17", GEMV_WG_R8(0), GEMV_WG_R8(8))
GEMV_WG_DEF(__nv_bfloat16, "bf16", 48, GEMV_REGS24, "%24, %25", GEMV_WG_R8(0), GEMV_WG_R8(8), GEMV_WG_R8(16))
GEMV_WG_DEF(__nv_bfloat16, "bf16", 64, GEMV_REGS32, "%32, %33", GEMV_WG_R8(0), GEMV_WG_R8(8), GEMV_WG_R8(16),
            GEMV_WG_R8(24))
GEMV_WG_DEF(__half, "f16", 16, GEMV_REGS8, "%8, %9", GEMV_WG_R8(0))
GEMV_WG_DEF(__half, "f16", 32, GEMV_REGS16, "%16, %17", GEMV_WG_R8(0), GEMV_WG_R8(8))
GEMV_WG_DEF(__half, "f16", 48, GEMV_REGS24, "%24, %25", GEMV_WG_R8(0), GEMV_WG_R8(8), GEMV_WG_R8(16))
GEMV_WG_DEF(__half, "f16", 64, GEMV_REGS32, "%32, %33", GEMV_WG_R8(0), GEMV_WG_R8(8), GEMV_WG_R8(16),
            GEMV_WG_R8(24))

// The unit at col0 (64 columns, or 32 with kHalf) into tile_s. `uses` counts the stages consumed so far by this
// CTA: stage u % kStages, its barrier's phase (u / kStages) & 1.
template <typename T, typename C>
__device__ void compute_tile_wgmma(const GemvArParams& p, int col0, float (*tile_s)[C::kCols], char* smem,
                                   unsigned long long* bars, unsigned& uses) {
  constexpr int N = C::kARows;
  constexpr int kBoxW = C::kBoxW, kBoxA = N * kBoxK * 2;  // one box of the weight / of A
  constexpr int kBoxes = C::kBoxes, kMine = kBoxes / 2;   // boxes per stage, per warpgroup
  static_assert(C::kWRows == 64, "wgmma's M is 64 weight rows");
  constexpr int kTxBytes = C::kCols * kTmaRowBytes + C::kABytes;  // what the bulk copies write into a stage
  static_assert(kBoxes % 2 == 0, "the two warpgroups split a stage's boxes");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, g = lane >> 2, t = lane & 3;
  const int nst = (p.k + kTmaK - 1) / kTmaK;
  const unsigned q0 = uses;
  unsigned long long policy = 0;  // the weight is read once: first out of L2 (GEMV_WG_HINT)
  if (GEMV_WG_HINT) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  auto issue = [&](int it) {
    const unsigned s = (q0 + it) % C::kStages;
    char* st = smem + s * C::kStageBytes;
    mbar_expect_tx(&bars[s], kTxBytes);  // boxes past the operands arrive as zeros and count
#pragma unroll
    for (int b = 0; b < kBoxes; ++b) {
      tma_load_2d(st + b * kBoxW, &p.tmap_w, it * kTmaK + b * kBoxK, col0, &bars[s], policy);
      tma_load_2d(st + C::kWBytes + b * kBoxA, &p.tmap_a, it * kTmaK + b * kBoxK, 0, &bars[s]);
    }
  };
  if (tid == 0) {
    for (int it = 0; it < C::kStages && it < nst; ++it) issue(it);
  }
  float d[N / 2];
#pragma unroll
  for (int q = 0; q < N / 2; ++q) d[q] = 0.f;
  for (int it = 0; it < nst; ++it) {
    const unsigned u = q0 + it, s = u % C::kStages;
    mbar_wait(&bars[s], (u / C::kStages) & 1u);
    const char* st = smem + s * C::kStageBytes;
    wg_fence();
#pragma unroll
    for (int b = kMine * wg; b < kMine * wg + kMine; ++b) {
      const unsigned long long dw = wg_desc(st + b * kBoxW), da = wg_desc(st + C::kWBytes + b * kBoxA);
#pragma unroll
      for (int kk = 0; kk < kBoxK / 16; ++kk) WgPtx<T>::template mma<N>(d, dw + 2 * kk, da + 2 * kk);  // k16: +32 B
    }
    wg_commit();
    wg_wait0();  // (keeping one stage's MMAs in flight is no faster)
    __syncthreads();  // every warpgroup is done with stage s: refill it
    if (tid == 0 && it + C::kStages < nst) issue(it + C::kStages);
  }
  uses = q0 + nst;
  // Accumulator layout: warp w % 4 of the warpgroup holds weight rows (unit columns) 16 (w % 4) + g (+ 8),
  // A rows 8 j + 2 t (+ 1) in d[4 j .. 4 j + 3].
  const int col = (warp & 3) * 16 + g;
  for (int half = 0; half < 2; ++half) {
    if (wg == half && (warp & 3) * 16 < C::kCols) {  // (kHalf: rows past the unit's 32 are zeros)
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
        const int i = 8 * j + 2 * t;
        if (half == 0) {
          tile_s[i][col] = d[4 * j];
          tile_s[i + 1][col] = d[4 * j + 1];
          tile_s[i][col + 8] = d[4 * j + 2];
          tile_s[i + 1][col + 8] = d[4 * j + 3];
        } else {
          tile_s[i][col] += d[4 * j];
          tile_s[i + 1][col] += d[4 * j + 1];
          tile_s[i][col + 8] += d[4 * j + 2];
          tile_s[i + 1][col + 8] += d[4 * j + 3];
        }
      }
    }
    __syncthreads();
  }
}

// The partial's 8 values of row i at column c of the unit (global column col0 + c - its tile's start) as this
// rank's slot holds them: tile_s plus the bias, rounded to T.
template <typename T, int kCols>
__device__ __forceinline__ uint4 partial_at(const GemvArParams& p, const float (*tile_s)[kCols], int i, int c,
                                            int col) {
  float f[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    f[q] = tile_s[i][c + q];
    if (p.bias != nullptr) f[q] += Num<T>::to_f(static_cast<const T*>(p.bias)[col + q]);
  }
  return pack8<T>(f);
}

// This rank's own partial of row i at column c of the unit (global column col): from tile_s where the CTA kept
// it, else from this rank's own slot of the given parity.
template <typename T, int kCols>
__device__ __forceinline__ uint4 own_part(const GemvArParams& p, const float (*tile_s)[kCols], bool kept, int parity,
                                          int i, int c, int col) {
  return kept ? partial_at<T, kCols>(p, tile_s, i, c, col)
              : ld_cg(slot<T>(p, p.rank, parity * p.world + p.rank) + static_cast<long long>(i) * p.n + col);
}

// sum += the 8 values packed in d: one source of a rank-order sum.
template <typename T>
__device__ __forceinline__ void add8(float (&sum)[8], const uint4& d) {
  float f[8];
  unpack8<T>(d, f);
#pragma unroll
  for (int q = 0; q < 8; ++q) sum[q] += f[q];
}

// The residual's 8 values at the output's offset off (tail), loaded before the waits so that their latency
// hides behind them.
template <typename T>
__device__ __forceinline__ uint4 load_residual(const GemvArParams& p, long long off, bool tail) {
  return tail ? *reinterpret_cast<const uint4*>(static_cast<const T*>(p.residual) + off) : uint4{0, 0, 0, 0};
}

// Writes the reduced vector r (8 columns of row i) to the output: r itself, or with the tail
// h = T(residual + r) (res: load_residual's).
template <typename T>
__device__ __forceinline__ void write_output(const GemvArParams& p, int i, int col, const uint4& r, bool tail,
                                             const uint4& res) {
  T* out = static_cast<T*>(p.out) + static_cast<long long>(i) * p.n + col;
  if (!tail) {
    *reinterpret_cast<uint4*>(out) = r;
    return;
  }
  float rf[8], h[8];
  unpack8<T>(r, rf);
  unpack8<T>(res, h);
#pragma unroll
  for (int q = 0; q < 8; ++q) h[q] += rf[q];
  *reinterpret_cast<uint4*>(out) = pack8<T>(h);
}

// The tail's RMSNorm of row i of h (the output, every tile written): a CTA's work. A row of up to kSpan columns
// is read once, each thread's kVecs 16-byte vectors (and their norm weights) in one round of loads; a longer row
// is read twice. The sum of squares runs in a fixed order (thread, warp, CTA), the same on every rank.
// red: kWarps floats of shared memory.
template <typename T>
__device__ __forceinline__ void normalize_row(const GemvArParams& p, int i, float* red) {
  constexpr int kVecs = 4;
  constexpr int kSpan = kThreads * 8 * kVecs;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* h_row = static_cast<const T*>(p.out) + static_cast<long long>(i) * p.n;
  const T* w = static_cast<const T*>(p.norm_weight);
  T* o_row = static_cast<T*>(p.normed) + static_cast<long long>(i) * p.n;
  auto sum_sq = [&](float ss, const uint4& v) {
    float f[8];
    unpack8<T>(v, f);
#pragma unroll
    for (int q = 0; q < 8; ++q) ss = fmaf(f[q], f[q], ss);
    return ss;
  };
  auto inv_rms = [&](float ss) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) total += red[ww];
    __syncthreads();  // red is free for the next row
    return rsqrtf(total / static_cast<float>(p.n) + p.eps);
  };
  auto store = [&](int col, const uint4& hv, const uint4& wv, float inv) {
    float h[8], wt[8], o[8];
    unpack8<T>(hv, h);
    unpack8<T>(wv, wt);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float x = h[q] * inv;
      o[q] = p.weight_after_cast ? Num<T>::to_f(Num<T>::from_f(x)) * wt[q] : x * wt[q];
    }
    *reinterpret_cast<uint4*>(o_row + col) = pack8<T>(o);
  };
  if (p.n <= kSpan) {
    uint4 hv[kVecs], wv[kVecs];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int col = (u * kThreads + tid) * 8;
      hv[u] = col < p.n ? ld_cg(h_row + col) : uint4{0, 0, 0, 0};
      wv[u] = col < p.n ? *reinterpret_cast<const uint4*>(w + col) : uint4{0, 0, 0, 0};
    }
#pragma unroll
    for (int u = 0; u < kVecs; ++u) ss = sum_sq(ss, hv[u]);
    const float inv = inv_rms(ss);
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int col = (u * kThreads + tid) * 8;
      if (col < p.n) store(col, hv[u], wv[u], inv);
    }
  } else {
    float ss = 0.f;
    for (int col = tid * 8; col < p.n; col += kThreads * 8) ss = sum_sq(ss, ld_cg(h_row + col));
    const float inv = inv_rms(ss);
    for (int col = tid * 8; col < p.n; col += kThreads * 8)
      store(col, ld_cg(h_row + col), *reinterpret_cast<const uint4*>(w + col), inv);
  }
}

// LL128 positions: position j of a tile (lane j % 8 of line j / 8) carries data vector d = line * 7 + j % 8 (row
// d / kVecPerRow, column (d % kVecPerRow) * 8 of the tile) for j % 8 < 7; thread tid takes positions tid,
// tid + kThreads, ... in passes of the whole CTA, so a line's eight lanes are in one warp.
struct LinePos {
  int line, q, i, c;  // line, lane in it, the data vector's row and column in the tile
  bool data;          // a data vector of the output (q < 7, i < m, column < n)
};
__device__ __forceinline__ LinePos line_pos(const GemvArParams& p, int lines, int j, int col0) {
  LinePos x;
  const int d = (j >> 3) * kLineVecs + (j & 7);
  x.line = j >> 3;
  x.q = j & 7;
  x.i = d / kVecPerRow;
  x.c = (d % kVecPerRow) * 8;
  x.data = x.line < lines && x.q < kLineVecs && x.i < p.m && col0 + x.c < p.n;
  return x;
}

// Phase 1 of LL128 for tile t (tile `sub` of the unit in tile_s): its lines to every peer, and the plain
// partial to this rank's own slot unless the CTA keeps it (keep_own). Every thread of the CTA calls it.
// Inlined, like the reduce below: as calls, the fragment loader (at its 128-register cap) spills around them.
template <typename T, int kCols>
__device__ __forceinline__ void ll128_push(const GemvArParams& p, const float (*tile_s)[kCols], int t, int sub,
                                        unsigned e, bool keep_own) {
  const int col0 = t * kGemvTileN, src_slot = static_cast<int>(e & 1u) * p.world + p.rank;
  const int lines = ll128_lines(p.m), passes = (8 * lines + kThreads - 1) / kThreads;
  for (int pass = 0; pass < passes; ++pass) {
    const LinePos x = line_pos(p, lines, threadIdx.x + pass * kThreads, col0);
    const uint4 v = x.q == kLineVecs ? make_uint4(e, e, e, e)
                    : x.data          ? partial_at<T, kCols>(p, tile_s, x.i, sub * kGemvTileN + x.c, col0 + x.c)
                                      : make_uint4(0, 0, 0, 0);
    if (x.line < lines) {
      for (int step = 1; step < p.world; ++step)
        st_line(ll128_line(p, (p.rank + step) % p.world, src_slot, t, x.line) + x.q * 16, v);
    }
    if (x.data && !keep_own) st_cg(slot<T>(p, p.rank, src_slot) + static_cast<long long>(x.i) * p.n + col0 + x.c, v);
  }
}

// Phase 2 of the LL words for a unit (tiles t0 .. t0 + nt - 1): the unit's vectors in one sweep of the CTA (a
// tile at a time, the second tile's waits would follow the first's), each thread waiting for its own words;
// the partials summed in rank order, the output written.
template <typename T, int kCols>
__device__ __forceinline__ void ll_reduce(const GemvArParams& p, const float (*tile_s)[kCols], int t0, int nt,
                                          unsigned e, bool kept) {
  const int parity = static_cast<int>(e & 1u);
  const bool tail = p.normed != nullptr;
  const int per_tile = p.m * kVecPerRow;
  for (int j = threadIdx.x; j < nt * per_tile; j += kThreads) {
    const int sub = j / per_tile, i = (j - sub * per_tile) / kVecPerRow, c = (j % kVecPerRow) * 8;
    const int col0 = (t0 + sub) * kGemvTileN;
    if (col0 + c >= p.n) continue;
    const long long off = static_cast<long long>(i) * p.n + col0 + c;
    const uint4 res = load_residual<T>(p, off, tail);
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    bool ok = true;
    for (int src = 0; src < p.world && ok; ++src) {  // rank order, as every rank sums
      uint4 d;
      if (src != p.rank) {
        ok = wait_ll(ll_slot<T>(p, p.rank, parity * p.world + src, off), e, d, p, src, t0 + sub);
      } else {
        d = own_part<T, kCols>(p, tile_s, kept, parity, i, sub * kGemvTileN + c, col0 + c);
      }
      add8<T>(sum, d);
    }
    if (ok) write_output<T>(p, i, col0 + c, pack8<T>(sum), tail, res);  // else err names the peer
  }
}

// Phase 2 of LL128 for a unit (tiles t0 .. t0 + nt - 1, tile_s holding their partials where the CTA kept
// them): the unit's lines in one sweep, a thread's positions of every pass waited for together (tile by tile
// or pass by pass, the waits' latencies would add up); the partials summed in rank order, the output written.
// Every thread of the CTA calls it.
template <typename T, int kCols, int kTpc>
__device__ __forceinline__ void ll128_reduce(const GemvArParams& p, const float (*tile_s)[kCols], int t0, int nt,
                                          unsigned e, bool kept) {
  constexpr int kPasses = (kTpc * 8 * ll128_lines(kGemvMaxM) + kThreads - 1) / kThreads;
  const int parity = static_cast<int>(e & 1u);
  const bool tail = p.normed != nullptr;
  const int lines = ll128_lines(p.m), passes = (nt * 8 * lines + kThreads - 1) / kThreads;
  LinePos x[kPasses];
  int sub[kPasses];
  bool valid[kPasses];
  uint4 res[kPasses];
  float sum[kPasses][8];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int j = threadIdx.x + pass * kThreads;
    sub[pass] = j / (8 * lines);
    valid[pass] = pass < passes && sub[pass] < nt;
    x[pass] = line_pos(p, lines, j - sub[pass] * 8 * lines, (t0 + sub[pass]) * kGemvTileN);
    x[pass].data = x[pass].data && valid[pass];
    const long long off = static_cast<long long>(x[pass].i) * p.n + (t0 + sub[pass]) * kGemvTileN + x[pass].c;
    res[pass] = load_residual<T>(p, off, tail && x[pass].data);
#pragma unroll
    for (int q = 0; q < 8; ++q) sum[pass][q] = 0.f;
  }
  bool ok = true;
  for (int src = 0; src < p.world && ok; ++src) {  // rank order, as every rank sums
    uint4 d[kPasses];
    if (src != p.rank) {
      const char* from[kPasses];
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass)
        from[pass] = ll128_line(p, p.rank, parity * p.world + src, t0 + sub[pass], x[pass].line) + x[pass].q * 16;
      ok = wait_ll128<kPasses>(from, valid, passes, e, d, p, src, t0);
    } else {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int col0 = (t0 + sub[pass]) * kGemvTileN;
        d[pass] = x[pass].data ? own_part<T, kCols>(p, tile_s, kept, parity, x[pass].i,
                                                    sub[pass] * kGemvTileN + x[pass].c, col0 + x[pass].c)
                               : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) add8<T>(sum[pass], d[pass]);
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    if (ok && x[pass].data)  // else err names the peer
      write_output<T>(p, x[pass].i, (t0 + sub[pass]) * kGemvTileN + x[pass].c, pack8<T>(sum[pass]), tail, res[pass]);
  }
}

// kRowM (MT == 1 only): m == kRowM on CUDA cores (1 to GEMV_ROW_MAX_M; 0: the MMA loaders; -1: wgmma), an
// instantiation of its own so each loader gets its registers.
template <typename T, int MT, int kRowM, bool kHalf = false>
__global__ void __launch_bounds__(kThreads, Cfg<MT, kRowM, kHalf>::kCtas)
    gemv_ar_kernel(const __grid_constant__ GemvArParams p) {
  using C = Cfg<MT, kRowM, kHalf>;
  constexpr int MM = 16 * MT;
  constexpr int kTpc = C::kTpc;
  extern __shared__ __align__(1024) char stages[];  // the TMA loader's ring (empty for the direct loader)
  __shared__ unsigned long long bars[C::kTma ? C::kStages : 1];
  __shared__ float tile_s[MM][C::kCols];
  __shared__ unsigned s_epoch;
  __shared__ int s_ok;

  const int tid = threadIdx.x;
  const bool tail = p.normed != nullptr;
  unsigned uses = 0;
  if (C::kTma && tid == 0) {
    for (int s = 0; s < C::kStages; ++s) mbar_init(&bars[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (C::kTma && C::kCols < C::kWRows) {
    // The weight rows past the unit's columns in every box of every stage: zeros, written once here (the bulk
    // copies fill only the first kCols rows) and made visible to the warpgroup MMAs' reads.
    constexpr int kFilled = C::kCols * kBoxK * 2, kFill = C::kBoxW - kFilled;  // bytes of a box
    constexpr int kChunks = C::kStages * C::kBoxes * kFill / 16;
    for (int c = tid; c < kChunks; c += kThreads) {
      const int box = c / (kFill / 16), at = c % (kFill / 16);
      char* st = stages + (box / C::kBoxes) * C::kStageBytes + (box % C::kBoxes) * C::kBoxW;
      *reinterpret_cast<uint4*>(st + kFilled + at * 16) = uint4{0, 0, 0, 0};
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  // The epoch is first needed after the first unit's math: its load's latency hides behind the weight stream.
  unsigned long long* const calls = reinterpret_cast<unsigned long long*>(p.state);
  unsigned prev_epoch = 0;
  if (tid == 0) prev_epoch = static_cast<unsigned>(*reinterpret_cast<volatile unsigned long long*>(calls) / kCallStep);
  __syncthreads();
  unsigned e = 0;
  int parity = 0, result_slot = 0;
  bool have_epoch = false;  // uniform over the CTA
  // The first call of a CTA sets e, then adds the CTA's share to the counter (after its read: the value is
  // consumed first); nothing waits for the addition.
  auto take_epoch = [&]() {
    if (have_epoch) return;
    if (tid == 0) s_epoch = prev_epoch + 1u;
    __syncthreads();
    e = s_epoch;
    parity = static_cast<int>(e & 1u);
    result_slot = 2 * p.world + parity;
    have_epoch = true;
    if (tid == 0) atomicAdd(calls, blockIdx.x == 0 ? kCallStep - (gridDim.x - 1) : 1ull);
  };
  unsigned* const my_flags = p.peer_flags[p.rank];
  // The thread's 16-byte vector of a tile: row v / kVecPerRow, columns (v % kVecPerRow) * 8 .. + 8.
  const int v = tid, vi = v / kVecPerRow, vc = (v % kVecPerRow) * 8;
  const bool has_vec = v < p.m * kVecPerRow;
  const int n_units = (p.n_tiles + kTpc - 1) / kTpc;
  // Every phase visits the CTA's tiles: unit positions blockIdx.x, + gridDim.x, ..., kTpc tiles each (the
  // last unit may hold fewer). `for_tiles(f)` calls f(tile, index of the tile in its unit, whether that unit
  // is the CTA's last).
  auto for_tiles = [&](auto&& f) {
    for (int pos = blockIdx.x; pos < n_units; pos += gridDim.x) {
      const int t0 = unit_at<kTpc>(pos, p) * kTpc;
      for (int sub = 0; sub < kTpc && t0 + sub < p.n_tiles; ++sub) f(t0 + sub, sub, pos + gridDim.x >= n_units);
    }
  };
  // The partial of tile `sub` of the unit in tile_s as this rank's slot holds it (bias added, rounded to T).
  auto own_partial = [&](int col0, int sub) {
    return partial_at<T, C::kCols>(p, tile_s, vi, sub * kGemvTileN + vc, col0 + vc);
  };

  // Phase 1: partials, pushed to the ranks that reduce them.
  for (int pos = blockIdx.x; pos < n_units; pos += gridDim.x) {
    const int t0 = unit_at<kTpc>(pos, p) * kTpc;
    if constexpr (C::kTma) {
      compute_tile_wgmma<T, C>(p, t0 * kGemvTileN, tile_s, stages, bars, uses);
    } else if constexpr (kRowM > 0) {
      compute_tile_row<T, kRowM>(p, t0 * kGemvTileN, tile_s);
    } else {
      compute_tile<T, MT>(p, t0 * kGemvTileN, tile_s);
    }
    take_epoch();
    // The CTA's last unit keeps its own partial in tile_s for phase 2: no store to its own slot and load back
    // on the way to the output.
    const bool keep_own = pos + gridDim.x >= n_units;
    for (int sub = 0; sub < kTpc && t0 + sub < p.n_tiles; ++sub) {
      const int t = t0 + sub, col0 = t * kGemvTileN;
      const int owner = owner_of(t, p.n_tiles, p.world);
      if (p.ll == 2) {
        ll128_push<T, C::kCols>(p, tile_s, t, sub, e, keep_own);
      } else if (has_vec && col0 + vc < p.n) {
        const uint4 part = own_partial(col0, sub);
        const long long off = static_cast<long long>(vi) * p.n + col0 + vc;
        const int src_slot = parity * p.world + p.rank;
        if (p.two_shot) {
          if (!(keep_own && owner == p.rank)) st_cg(slot<T>(p, owner, src_slot) + off, part);
        } else {
          for (int step = 0; step < p.world - (keep_own ? 1 : 0); ++step) {  // peers first, own slot last
            const int dst = (p.rank + 1 + step) % p.world;
            if (p.ll && dst != p.rank) {
              st_ll(ll_slot<T>(p, dst, src_slot, off), part, e);
            } else {
              st_cg(slot<T>(p, dst, src_slot) + off, part);
            }
          }
        }
      }
      __syncthreads();  // every store of the tile is issued before the flag's release (cumulative)
      if (tid == 0 && !p.ll) {  // LL words carry their own epoch
        for (int step = 1; step < p.world; ++step) {
          const int dst = (p.rank + step) % p.world;
          if (!p.two_shot || dst == owner)
            st_release_sys(p.peer_flags[dst] + p.rank * kGemvMaxTiles + t, e);
        }
      }
    }
  }
  if (blockIdx.x >= n_units) take_epoch();  // a CTA without units counts in too

  // Phase 2: reduce the tiles this rank reduces.
  if (p.ll) {  // one-shot, LL words or LL128 lines: a unit's tiles in one sweep, no flags
    for (int pos = blockIdx.x; pos < n_units; pos += gridDim.x) {
      const int t0 = unit_at<kTpc>(pos, p) * kTpc, nt = p.n_tiles - t0 < kTpc ? p.n_tiles - t0 : kTpc;
      const bool last_unit = pos + gridDim.x >= n_units;
      if (p.ll == 2) {
        ll128_reduce<T, C::kCols, kTpc>(p, tile_s, t0, nt, e, last_unit);
      } else {
        ll_reduce<T, C::kCols>(p, tile_s, t0, nt, e, last_unit);
      }
    }
  } else {
    for_tiles([&](int t, int sub, bool last_unit) {
      const int col0 = t * kGemvTileN;
      if (p.two_shot && owner_of(t, p.n_tiles, p.world) != p.rank) return;
      const long long off = static_cast<long long>(vi) * p.n + col0 + vc;
      const bool mine = has_vec && col0 + vc < p.n;
      const uint4 res = load_residual<T>(p, off, tail && mine);
      if (tid == 0) {
        bool ok = true;
        for (int step = 1; step < p.world && ok; ++step) {
          const int src = (p.rank + step) % p.world;
          ok = wait_epoch<true>(my_flags + src * kGemvMaxTiles + t, e, p, src, t, kWaitPartial);
        }
        s_ok = ok;
      }
      __syncthreads();
      if (s_ok && mine) {
        float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int src = 0; src < p.world; ++src) {  // rank order, as every rank sums
          add8<T>(sum, last_unit && src == p.rank ? own_partial(col0, sub)
                                                  : ld_cg(slot<T>(p, p.rank, parity * p.world + src) + off));
        }
        const uint4 r = pack8<T>(sum);
        if (p.two_shot) {
          for (int step = 1; step < p.world; ++step)
            st_cg(slot<T>(p, (p.rank + step) % p.world, result_slot) + off, r);
        }
        write_output<T>(p, vi, col0 + vc, r, tail, res);
      }
      __syncthreads();
      if (p.two_shot && tid == 0 && s_ok) {
        for (int step = 1; step < p.world; ++step)
          st_release_sys(p.peer_flags[(p.rank + step) % p.world] + p.world * kGemvMaxTiles + t, e);
      }
    });
  }

  // Phase 3 (two-shot): the tiles other ranks reduced.
  if (p.two_shot) {
    for_tiles([&](int t, int, bool) {
      const int col0 = t * kGemvTileN;
      const int owner = owner_of(t, p.n_tiles, p.world);
      if (owner == p.rank) return;
      const long long off = static_cast<long long>(vi) * p.n + col0 + vc;
      const bool mine = has_vec && col0 + vc < p.n;
      const uint4 res = load_residual<T>(p, off, tail && mine);
      if (tid == 0) s_ok = wait_epoch<true>(my_flags + p.world * kGemvMaxTiles + t, e, p, owner, t, kWaitReduced);
      __syncthreads();
      if (s_ok && mine) write_output<T>(p, vi, col0 + vc, ld_cg(slot<T>(p, p.rank, result_slot) + off), tail, res);
      __syncthreads();
    });
  }

  if (tail) {
    // Grid barrier: every tile's h is written. The last CTA to arrive resets the count and releases the others
    // with this call's epoch (no reset needed between calls). Then RMSNorm row by row, a row a CTA.
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
      for (int i = blockIdx.x; i < p.m; i += gridDim.x) normalize_row<T>(p, i, &tile_s[0][0]);  // tile_s is free
    }
  }
}

template <typename T>
constexpr CUtensorMapDataType tma_dtype() {
  return std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// A 2-D tensor map of a row-major [rows, cols] matrix (row stride ld elements of T) in boxes of box_rows x
// kBoxK columns, 128-byte swizzled (the wgmma loader's stages); reads past the matrix land as zeros. Host-only
// work (no GPU call).
template <typename T>
cudaError_t encode_tma(GemvTmaMap* map, const void* base, int rows, int cols, int ld, int box_rows) {
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
  const cuuint32_t box[2] = {kBoxK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  CUresult r = encode(reinterpret_cast<CUtensorMap*>(map), tma_dtype<T>(), 2, const_cast<void*>(base), dims, strides,
                      box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

constexpr int kMaxDevices = 64;  // the launchers' per-device caches (a bit mask and arrays)

// Launch with at most as many CTAs as can be resident at once (the RMSNorm tail's grid barrier needs every
// CTA running), and no more than there are units.
template <typename T, int MT, int kRowM = 0, bool kHalf = false>
cudaError_t launch_mt(const GemvArParams& p_in, int grid, int device, int sms, cudaStream_t stream) {
  using C = Cfg<MT, kRowM, kHalf>;
  GemvArParams p = p_in;
  int per_sm = 0;
  cudaError_t rc = cudaSuccess;
  if (C::kTma) {
    rc = encode_tma<T>(&p.tmap_w, p.w, p.n, p.k, p.ldw, C::kCols);
    if (rc == cudaSuccess) rc = encode_tma<T>(&p.tmap_a, p.a, p.m, p.k, p.lda, C::kARows);
    static unsigned long long raised = 0;  // devices whose shared-memory limit this kernel has raised
    if (rc == cudaSuccess && !(raised >> device & 1ull)) {
      rc = cudaFuncSetAttribute(gemv_ar_kernel<T, MT, kRowM, kHalf>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                C::kSmem);
      if (rc == cudaSuccess) raised |= 1ull << device;
    }
  }
  static int resident[kMaxDevices] = {};  // per device: CTAs of this kernel an SM holds at once (0: not asked yet)
  if (rc == cudaSuccess && resident[device] == 0) {
    rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_ar_kernel<T, MT, kRowM, kHalf>, kThreads,
                                                       C::kSmem);
    if (rc == cudaSuccess) resident[device] = per_sm;
  }
  if (rc != cudaSuccess) return rc;
  per_sm = resident[device];
  if (per_sm < 1) return cudaErrorLaunchOutOfResources;
  const int units = (p.n_tiles + C::kTpc - 1) / C::kTpc;
  grid = grid < units ? grid : units;
  grid = grid < per_sm * sms ? grid : per_sm * sms;
  gemv_ar_kernel<T, MT, kRowM, kHalf><<<dim3(grid), dim3(kThreads), C::kSmem, stream>>>(p);
  return cudaGetLastError();
}

// The wgmma loader (m >= GEMV_WG_MIN_M): 32-column units where 64-column ones would fill at most half the SMs
// (GEMV_WG_HALF).
template <typename T, int MT, int kRowM = 0>
cudaError_t launch_wg(const GemvArParams& p, int grid, int device, int sms, cudaStream_t stream) {
  if constexpr (GEMV_WG_HALF) {
    if (2 * ((p.n_tiles + 1) / 2) <= sms) return launch_mt<T, MT, kRowM, true>(p, grid, device, sms, stream);
  }
  return launch_mt<T, MT, kRowM>(p, grid, device, sms, stream);
}

template <typename T>
cudaError_t launch_typed(const GemvArParams& p, int grid, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc == cudaSuccess && (device < 0 || device >= kMaxDevices)) rc = cudaErrorInvalidDevice;
  if (rc == cudaSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (rc != cudaSuccess) return rc;
  switch ((p.m + 15) / 16) {
    case 1:
      if (p.m == 1) return launch_mt<T, 1, 1>(p, grid, device, sms, stream);
      if (p.m == 2) return launch_mt<T, 1, 2>(p, grid, device, sms, stream);
      if constexpr (GEMV_ROW_MAX_M >= 3) {
        if (p.m == 3) return launch_mt<T, 1, 3>(p, grid, device, sms, stream);
      }
      if constexpr (GEMV_ROW_MAX_M >= 4) {
        if (p.m == 4) return launch_mt<T, 1, 4>(p, grid, device, sms, stream);
      }
      if constexpr (GEMV_WG_MIN_M <= 16) {
        if (p.m >= GEMV_WG_MIN_M) return launch_wg<T, 1, -1>(p, grid, device, sms, stream);
      }
      return launch_mt<T, 1>(p, grid, device, sms, stream);
    case 2: return launch_wg<T, 2>(p, grid, device, sms, stream);
    case 3: return launch_wg<T, 3>(p, grid, device, sms, stream);
    default: return launch_wg<T, 4>(p, grid, device, sms, stream);
  }
}

}  // namespace

cudaError_t gemv_ar_launch(const GemvArParams& p, int dtype, int grid, cudaStream_t stream) {
  const long long w_elems = static_cast<long long>(p.n) * p.ldw, a_elems = static_cast<long long>(p.m) * p.lda;
  if (w_elems >= (1ll << 31) || a_elems >= (1ll << 31)) return cudaErrorInvalidValue;  // 32-bit row offsets
  if (p.m < 1 || p.m > kGemvMaxM || p.n_tiles > kGemvMaxTiles || p.k % 8 || p.n % 8 || grid < 1 ||
      grid > p.n_tiles || p.world < 1 || p.world > 8 || (p.two_shot && p.n_tiles < p.world) ||
      (p.ll && p.two_shot) || p.ll < 0 || p.ll > 2) {
    return cudaErrorInvalidValue;
  }
  // LL128's lines of every tile fit its LL region (two slots).
  if (p.ll == 2 && static_cast<long long>(p.n_tiles) * ll128_lines(p.m) * 128 > 2 * p.slot_bytes) {
    return cudaErrorInvalidValue;
  }
  return dtype == 0 ? launch_typed<__nv_bfloat16>(p, grid, stream) : launch_typed<__half>(p, grid, stream);
}

}  // namespace fluxcompile
