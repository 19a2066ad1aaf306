// GEMV + all-reduce for decode (m = 1..64): the shared parameter block of the kernel and its launcher.
// Plain CUDA (no torch headers), so the kernel file compiles with nvcc alone; gemv_ar_binding.cpp wraps it.
#pragma once

#include <cuda_runtime.h>

namespace fluxcompile {

constexpr int kGemvTileN = 32;      // output columns per tile: four n8 MMA groups
constexpr int kGemvMaxM = 64;       // rows handled by one tile (all of m): up to four m16 MMA tiles
constexpr int kGemvMaxTiles = 8192; // flag slots per source rank (n up to 262144)
constexpr int kGemvErrWords = 8;    // err: code, rank, peer, tile, epoch, kind, -, -

// Flag words in the flags workspace (uint32, on every rank):
//   [src * kGemvMaxTiles + t]            partial tile t of rank src has landed here (value: the epoch)
//   [world * kGemvMaxTiles + t]          reduced tile t from its owner has landed here (two-shot)
// Data workspace (element type T), slot_bytes apart:
//   slot (parity, src) = (parity * world + src)      partials written by src
//   slot (parity, result) = (2 * world + parity)     reduced tiles from their owners (two-shot)
//   LL region (parity, src) = slots 2 * world + 2 + 2 * (parity * world + src) and the next one: partials
//     written by src as LL words (one-shot with ll = 1), twice the data's bytes, or as LL128 lines (ll = 2),
//     tile after tile, ceil(4 m / 7) lines of 128 bytes a tile; 6 * world + 2 slots in all
// An opaque CUtensorMap (the kernel's bulk tensor copies read it from the kernel's parameters).
struct alignas(64) GemvTmaMap {
  unsigned long long opaque[16];
};

struct GemvArParams {
  const void* a;            // [m, k], row stride lda (elements), unit column stride
  const void* w;            // weight [n, k] (the op's B = w.t()), row stride ldw, unit column stride
  const void* bias;         // [n] or nullptr
  void* out;                // [m, n] contiguous: all_reduce(A @ B + bias), or h = residual + that (tail)
  void* normed;             // [m, n] contiguous or nullptr: RMSNorm(h) * norm_weight (tail)
  const void* residual;     // [m, n] contiguous (tail)
  const void* norm_weight;  // [n] (tail)
  float eps;
  int weight_after_cast;    // 1: normed = weight * T(x * rsqrt); 0: normed = T(x * rsqrt * weight)
  char* const* peer_data;   // device array [world]: every rank's data workspace, mapped here
  unsigned* const* peer_flags;  // device array [world]: every rank's flag workspace, mapped here
  long long slot_bytes;
  int* state;               // this rank: [0..1] call counter (64-bit), [2] barrier count, [3] barrier epoch
  int* err;                 // [kGemvErrWords]
  int m, n, k, lda, ldw;
  int rank, world, two_shot, n_tiles;
  int ll;                   // one-shot only: partials to peers as LL words (1) or LL128 lines (2), no flags
  long long timeout_ns;
  // Filled by the launcher for m > 16: tensor maps of w ([n, k] in boxes of one unit's rows, 2 * kGemvTileN,
  // x 64 k) and A ([m, k] in boxes of 16 * ceil(m / 16) rows x 64 k), 128-byte swizzled, for the bulk copies
  // into the wgmma loader's shared-memory stages.
  GemvTmaMap tmap_w, tmap_a;
};

// dtype: 0 = bfloat16, 1 = float16. Returns the launch's CUDA error (cudaSuccess when queued).
cudaError_t gemv_ar_launch(const GemvArParams& p, int dtype, int grid, cudaStream_t stream);

}  // namespace fluxcompile
