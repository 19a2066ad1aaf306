// EXPERIMENT, not used by fluxcompile: csrc/gemv_ar.cu with the weight loaded as 2 rows x 256 contiguous bytes
// per warp instruction (the pattern a plain read runs at 4.41 TB/s, against 3.89 TB/s for the MMA fragments'
// 8 rows x 64 B) through a per-warp shared-memory transpose into the fragments, software-pipelined (the next
// block's loads issued before this block's MMAs). Measured on one H200 (scripts/debug/gemv_lab.py,
// 2026-11-23): m = 1 61.9 us vs csrc's 63.4 (down_proj), 22.1 vs 21.9 (o_proj); m = 9..64 slower. ncu on
// o_proj m = 1: 0.23 issued warps per scheduler (a plain read: 0.10), 17 cycles per issued instruction per
// warp of which only 6.8 wait on global loads: the kernel is bound by instruction latency at 16 warps per
// SM (registers: 128 per thread, 2 CTAs of 256), not by the load pattern.
// GEMV + all-reduce (+ residual add + RMSNorm) for decode, as one persistent kernel per rank.
//
// out = all_reduce_sum(A @ w.t() + bias) over the ranks of a group, A [m, k] (m <= 64), w [n, k] this rank's
// row shard of the weight. Memory-bound: the weight is streamed once with 16-byte loads that skip L1, each
// warp instruction covering 512 contiguous bytes (two rows x 256 B), through a small per-warp shared-memory
// transpose into tensor-core MMA fragments (compute_tile), fp32 accumulation.
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
constexpr int kCtasPerSm = 2;                      // 16 warps per SM keep enough weight loads in flight
constexpr int kVecPerRow = kGemvTileN / 8;         // 16-byte vectors of T per tile row
// Per warp and iteration, the tile's 32 weight rows x kBlockK elements of k go through the warp's own
// shared-memory buffer: loaded as 2 rows x 256 contiguous bytes per instruction (a plain read of the same
// bytes ran at 4.41 TB/s on an H200 that way, 3.89 TB/s with the MMA fragments' 8 rows x 64 B), stored,
// and read back in fragment order. The row pitch puts rows g and g + 1 64 bytes apart in the banks, so
// both the stores and the fragment reads are conflict-free.
constexpr int kBlockK = 128;
constexpr int kPitch = kBlockK + 32;               // elements
constexpr int kWarpBuf = kGemvTileN * kPitch;      // elements of one warp's buffer

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
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
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
// m up to 64 needs tensor cores (CUDA-core FMAs cap far below the bandwidth at m = 16). A sum over k may visit
// k in any order as long as A and B agree, so lane (g = lane / 4, t = lane % 4) reads 16 contiguous bytes,
// k = 8t .. 8t + 7 of a 32-wide k block, of weight row g of an n8 group (from the warp's buffer) and of A rows
// g and g + 8 of an m16 tile (from global memory), and feeds elements 0-3 to one m16n8k16 MMA and 4-7 to a
// second, as if they were the fragment's k = 2t, 2t+1, 2t+8, 2t+9. Warp w takes the k blocks w, w + 8, ...
// of kBlockK (split-K); the warps' partial sums are added in warp order through shared memory
// (deterministic).
// HI: A rows 8 .. 15 of an m16 tile exist (m > 8 or MT > 1); without them half of A's loads are skipped.
template <typename T, int MT, bool HI>
__device__ void compute_tile(const GemvArParams& p, int col0, T* wbuf, float (*tile_s)[kGemvTileN],
                             float (*red)[16][kGemvTileN]) {
  constexpr int AB = MT == 1 ? kBlockK / 32 : 1;  // A's k blocks loaded beside the weight (registers allow)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const T* a = static_cast<const T*>(p.a) + 8 * t;
  const T* w = static_cast<const T*>(p.w);
  float c[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) c[mt][j][q] = 0.f;
  int aoff[MT][2];  // 32-bit element offsets of A's rows (the launcher refuses 2^31 elements); -1: none
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mt * 16 + g + 8 * h;
      aoff[mt][h] = row < p.m ? row * p.lda : -1;
    }
  // The lane's weight loads: rows 2q + lr (q = 0..15) of the tile, elements lc .. lc + 7 of the block.
  const int lr = lane >> 4, lc = (lane & 15) * 8;
  const T* wl = w + (col0 + lr) * p.ldw + lc;  // 32-bit offsets: the launcher refuses 2^31 elements
  const int rows_left = p.n - col0 - lr;        // row 2q + lr exists if 2q < rows_left
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // Software-pipelined: a block's weight loads are issued before the previous block's MMAs, so the warp
  // always has 16 loads in flight (a warp that waited for its loads, then computed, kept about 20% fewer).
  uint4 v[16];
  auto load_block = [&](int k0) {
    const bool wk = k0 + lc < p.k;  // k % 8 == 0: a lane's 8 elements are all in range or none
#pragma unroll
    for (int q = 0; q < 16; ++q) v[q] = wk && 2 * q < rows_left ? ld_stream(wl + 2 * q * p.ldw + k0) : zero;
  };
  load_block(warp * kBlockK);
  for (int k0 = warp * kBlockK; k0 < p.k; k0 += kWarps * kBlockK) {
    __syncwarp();  // the previous block's fragment reads are done
#pragma unroll
    for (int q = 0; q < 16; ++q) *reinterpret_cast<uint4*>(wbuf + (2 * q + lr) * kPitch + lc) = v[q];
    __syncwarp();
    if (k0 + kWarps * kBlockK < p.k) load_block(k0 + kWarps * kBlockK);
    uint4 av[AB][2];  // A's k blocks of this block (MT = 1), their latency under the weight loads in flight
#pragma unroll
    for (int b = 0; b < AB; ++b) {
      const int kk = k0 + b * 32;
      const bool kok = kk + 8 * t < p.k;
      av[b][0] = kok && aoff[0][0] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[0][0] + kk) : zero;
      av[b][1] = HI && kok && aoff[0][1] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[0][1] + kk) : zero;
    }
#pragma unroll
    for (int b = 0; b < kBlockK / 32; ++b) {
      const int kk = k0 + b * 32;
      const bool kok = kk + 8 * t < p.k;
      uint4 wv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) wv[j] = *reinterpret_cast<const uint4*>(wbuf + (j * 8 + g) * kPitch + b * 32 + 8 * t);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint4 lo, hi;
        if (MT == 1) {
          lo = av[AB == 1 ? 0 : b][0];
          hi = av[AB == 1 ? 0 : b][1];
        } else {
          lo = kok && aoff[mt][0] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[mt][0] + kk) : zero;
          hi = kok && aoff[mt][1] >= 0 ? *reinterpret_cast<const uint4*>(a + aoff[mt][1] + kk) : zero;
        }
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

template <typename T, int MT, bool HI>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) gemv_ar_kernel(const GemvArParams p) {
  constexpr int MM = 16 * MT;
  __shared__ float red[kWarps][16][kGemvTileN];
  __shared__ float tile_s[MM][kGemvTileN];
  __shared__ unsigned s_epoch;
  __shared__ int s_ok;
  __shared__ float s_inv[MM];
  extern __shared__ __align__(16) char dyn_smem[];  // the warps' weight buffers

  const int tid = threadIdx.x;
  T* const wbuf = reinterpret_cast<T*>(dyn_smem) + (tid >> 5) * kWarpBuf;
  const bool tail = p.normed != nullptr;
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
  for (int pos = blockIdx.x; pos < p.n_tiles; pos += gridDim.x) {
    const int t = tile_at(pos, p);
    const int col0 = t * kGemvTileN;
    compute_tile<T, MT, HI>(p, col0, wbuf, tile_s, red);
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
template <typename T, int MT, bool HI = true>
cudaError_t launch_mt(const GemvArParams& p, int grid, cudaStream_t stream) {
  constexpr int smem = kWarps * kWarpBuf * static_cast<int>(sizeof(T));
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc == cudaSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // Over 48 KB of dynamic shared memory must be allowed per kernel (not a stream operation: fine in capture).
  if (rc == cudaSuccess) rc = cudaFuncSetAttribute(gemv_ar_kernel<T, MT, HI>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (rc == cudaSuccess) rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_ar_kernel<T, MT, HI>, kThreads, smem);
  if (rc != cudaSuccess) return rc;
  if (per_sm < 1) return cudaErrorLaunchOutOfResources;
  grid = grid < per_sm * sms ? grid : per_sm * sms;
  gemv_ar_kernel<T, MT, HI><<<dim3(grid), dim3(kThreads), smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const GemvArParams& p, int grid, cudaStream_t stream) {
  switch ((p.m + 15) / 16) {
    case 1: return p.m <= 8 ? launch_mt<T, 1, false>(p, grid, stream) : launch_mt<T, 1>(p, grid, stream);
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
