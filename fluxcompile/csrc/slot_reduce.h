// The reduction of a reduce-scatter's received slots (slot_reduce.cu), for the CUTLASS reduce-scatter's sequence
// (sequences_flux.cpp): out = scale * (own + the w-1 peers' slots in ring order), summed in fp32 and rounded once.
// Plain C++: the pipelined module includes it without CUDA's device headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fluxcompile {

struct SlotReduce {
  const void* slots = nullptr;  // [world, rows, cols] contiguous: slot s holds rank s's partial of our chunk
  const void* own = nullptr;    // [rows, cols], row stride ld_own (our own partial of our chunk, in place)
  void* out = nullptr;          // [rows, cols] contiguous
  int64_t rows = 0, cols = 0, ld_own = 0;
  int rank = 0, world = 1;
  float scale = 1.0f;
  int dtype = 0;  // 0: bf16, 1: fp16
};

// fluxcompile_slot_reduce (slot_reduce.cu): launches the reduction on `stream`.
using SlotReduceRun = cudaError_t (*)(const SlotReduce* args, cudaStream_t stream);

}  // namespace fluxcompile
