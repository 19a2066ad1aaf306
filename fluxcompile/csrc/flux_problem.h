// The Flux-style CUTLASS GEMM (flux_gemm.h) as the pipelined module's sequences launch it. The flux_gemm module
// exports one C entry, fluxcompile_flux_gemm_run (flux_gemm_binding.cpp; Python passes its address,
// kernels/cutlass_gemm.py's run_address), so the CUTLASS module builds apart from the sequences and the sequences'
// one replay cache (replays.h) holds the GEMM's calls too. A sequence takes the launch options as words
// (flux_launch), fills one FluxGemmProblem per GEMM from its tensors and its cross-rank part (flux_problem), and
// launches it on a stream (flux_gemm). Both the all-gather (sequences_flux.cpp) and the reduce-scatter build on
// these.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flux_gemm.h"

namespace fluxcompile::pipelined {

// fluxcompile_flux_gemm_run: the variant at index `variant` of flux_gemm_variants(), called as its
// FluxGemmVariant::run (with workspace_bytes set, it only writes the bytes the call needs).
using FluxGemmRun = cudaError_t (*)(int variant, const FluxGemmProblem* p, cudaStream_t s, size_t* workspace_bytes);

// The launch options a call's GEMMs share.
struct FluxLaunch {
  FluxGemmRun run = nullptr;
  int variant = 0;
  int sm_count = 0, raster = 0, swizzle = 1;  // FluxGemmProblem's
  long long timeout_ns = 0;                   // FluxGemmSync's
  void* workspace = nullptr;                  // stream-K's scratch (null: none)
  int group_m = 0;                            // FluxGemmSync's grouped tile order (0: off)
};

// The launch options from Python's 8 words: the run entry's address, the variant's index, sm_count, raster,
// swizzle, the waits' timeout (ns), the workspace's address (0: none), group_m.
inline FluxLaunch flux_launch(const std::vector<int64_t>& w) {
  TORCH_CHECK(w.size() == 8, "fluxcompile: the Flux GEMM's launch takes 8 words");
  TORCH_CHECK(w[0] != 0, "fluxcompile: no address of the Flux GEMM's entry");
  FluxLaunch l;
  l.run = reinterpret_cast<FluxGemmRun>(static_cast<intptr_t>(w[0]));
  l.variant = static_cast<int>(w[1]);
  l.sm_count = static_cast<int>(w[2]);
  l.raster = static_cast<int>(w[3]);
  l.swizzle = static_cast<int>(w[4]);
  l.timeout_ns = w[5];
  l.workspace = reinterpret_cast<void*>(static_cast<intptr_t>(w[6]));
  l.group_m = static_cast<int>(w[7]);
  return l;
}

// The weight's layout as kernels/cutlass_gemm.py's weight_layout reads it: false for "kn" (b[k, n] at
// k * ld + n), true for "nk" (K-major: at n * ld + k).
inline bool weight_kmajor(const at::Tensor& b) {
  TORCH_CHECK(b.dim() == 2, "fluxcompile: a weight that is not a matrix");
  if (b.stride(1) == 1 && b.stride(0) >= b.size(1)) return false;
  if (b.stride(0) == 1 && b.stride(1) >= b.size(0)) return true;
  TORCH_CHECK(false, "fluxcompile: a weight that is neither [K, N] row-major nor the transpose of an [N, K] one");
  return false;
}

// The kernel's dtype code (kernels/cutlass_gemm.py's DTYPES).
inline int flux_dtype(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return 0;
  if (t.scalar_type() == at::kHalf) return 1;
  TORCH_CHECK(false, "fluxcompile: the Flux GEMM takes bf16 and fp16 only");
  return -1;
}

// d = a @ b (+ bias) with the cross-rank part `sync` (its timeout from `launch`), filled as kernels/cutlass_gemm.py's
// gemm fills its words: a [m, k] row-major, b [k, n] in either layout, d [m, n] row-major, bias [n] contiguous.
inline FluxGemmProblem flux_problem(const at::Tensor& a, const at::Tensor& b, const at::Tensor& d,
                                    const std::optional<at::Tensor>& bias, const FluxLaunch& launch,
                                    const FluxGemmSync& sync) {
  TORCH_CHECK(a.dim() == 2 && d.dim() == 2 && a.stride(1) == 1 && d.stride(1) == 1,
              "fluxcompile: the Flux GEMM's A and D are row-major matrices");
  TORCH_CHECK(b.size(0) == a.size(1) && d.size(0) == a.size(0) && d.size(1) == b.size(1),
              "fluxcompile: the Flux GEMM's operands do not match");
  TORCH_CHECK(b.scalar_type() == a.scalar_type() && d.scalar_type() == a.scalar_type(),
              "fluxcompile: the Flux GEMM's operands have several dtypes");
  FluxGemmProblem p{};
  const bool kmajor = weight_kmajor(b);
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.d = d.data_ptr();
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == b.size(1) && bias->is_contiguous() &&
                    bias->scalar_type() == a.scalar_type(),
                "fluxcompile: the Flux GEMM's bias is a contiguous [N] of the operands' dtype");
    p.bias = bias->data_ptr();
  }
  p.m = static_cast<int>(a.size(0));
  p.n = static_cast<int>(b.size(1));
  p.k = static_cast<int>(a.size(1));
  p.lda = a.stride(0);
  p.ldb = kmajor ? b.stride(1) : b.stride(0);
  p.ldd = d.stride(0);
  p.b_kmajor = kmajor;
  p.dtype = flux_dtype(a);
  p.sm_count = launch.sm_count;
  p.raster = launch.raster;
  p.swizzle = launch.swizzle;
  p.device = a.device().index();
  p.workspace = launch.workspace;
  p.sync = sync;
  p.sync.timeout_ns = launch.timeout_ns;
  p.sync.group_m = launch.group_m;
  return p;
}

// Launches one GEMM on `s`; throws if the kernel could not be launched.
inline void flux_gemm(const FluxLaunch& launch, const FluxGemmProblem& p, cudaStream_t s) {
  const cudaError_t rc = launch.run(launch.variant, &p, s, nullptr);
  TORCH_CHECK(rc == cudaSuccess, "fluxcompile: the Flux GEMM (variant ", launch.variant, ") failed: ",
              cudaGetErrorString(rc));
}

}  // namespace fluxcompile::pipelined
