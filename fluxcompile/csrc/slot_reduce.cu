// The reduction of slot_reduce.h: one thread per 8 elements of a row where the rows allow 16-byte accesses,
// else one per element; every slot read once, fp32 sums in ring order from our own partial.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "slot_reduce.h"

namespace fluxcompile {
namespace {

template <class T>
__device__ float to_float(T x);
template <>
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ float to_float(__half x) { return __half2float(x); }
template <class T>
__device__ T from_float(float x);
template <>
__device__ __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }
template <>
__device__ __half from_float(float x) { return __float2half(x); }

// Elements [i * V, i * V + V) of row r: V = 8 (16-byte vectors) or 1.
template <class T, int V>
using Chunk = typename std::conditional<V == 8, uint4, T>::type;  // one access: 16 bytes or one element

template <class T, int V>
__global__ void reduce_slots(SlotReduce a) {
  using W = Chunk<T, V>;
  const int64_t per_row = a.cols / V;
  const int64_t total = a.rows * per_row;
  const T* slots = static_cast<const T*>(a.slots);
  const T* own = static_cast<const T*>(a.own);
  T* out = static_cast<T*>(a.out);
  const int64_t slot_elems = a.rows * a.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * V;
    float acc[V];
    alignas(16) T v[V];
    *reinterpret_cast<W*>(v) =
        *reinterpret_cast<const W*>(own + r * a.ld_own + c);
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = to_float(v[e]);
    for (int j = 1; j < a.world; ++j) {
      const int s = (a.rank + j) % a.world;
      *reinterpret_cast<W*>(v) =
          *reinterpret_cast<const W*>(slots + s * slot_elems +
                                                                                      r * a.cols + c);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += to_float(v[e]);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = from_float<T>(acc[e] * a.scale);
    *reinterpret_cast<W*>(out + r * a.cols + c) =
        *reinterpret_cast<const W*>(v);
  }
}

template <class T>
cudaError_t launch(const SlotReduce& a, cudaStream_t stream) {
  const bool vec = a.cols % 8 == 0 && a.ld_own % 8 == 0 && reinterpret_cast<uintptr_t>(a.slots) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.own) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  const int64_t work = a.rows * (vec ? a.cols / 8 : a.cols);
  if (work == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (work + threads - 1) / threads;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
  if (vec) {
    reduce_slots<T, 8><<<grid, threads, 0, stream>>>(a);
  } else {
    reduce_slots<T, 1><<<grid, threads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace fluxcompile

// The C entry the pipelined module's reduce-scatter sequence launches the reduction through (its address:
// flux_gemm_binding.cpp's reduce_address), as it launches the GEMM through fluxcompile_flux_gemm_run.
extern "C" cudaError_t fluxcompile_slot_reduce(const fluxcompile::SlotReduce* a, cudaStream_t stream) {
  if (a == nullptr || a->world < 1 || a->rank < 0 || a->rank >= a->world) return cudaErrorInvalidValue;
  return a->dtype == 0 ? fluxcompile::launch<__nv_bfloat16>(*a, stream) : fluxcompile::launch<__half>(*a, stream);
}
