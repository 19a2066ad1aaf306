// D = A @ B + C (+ bias) with C and D apart, by cuBLASLt: the sum rides in the GEMM's epilogue, where
// at::addmm_out would first copy C into D. cuBLASLt's functions are looked up in the copy that torch has
// loaded (no link against it, no second copy); where there is none, or its heuristic offers no algorithm
// for the operands, add_mm falls back to at::addmm_out. No workspace: nothing is allocated (a replay's
// capture forbids it) and nothing is shared between streams.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

namespace fluxcompile::pipelined {

// D = A @ B + C (+ bias), C and D apart, one rounding where cuBLASLt does it (else at::addmm_out: C is copied
// into D first).
void add_mm(at::Tensor D, const at::Tensor& C, const at::Tensor& A, const at::Tensor& B,
            const std::optional<at::Tensor>& bias, const c10::cuda::CUDAStream& stream);

// Whether add_mm finds cuBLASLt (else it copies C into D first).
bool lt_available();

// D = (A @ B) * scale_a * scale_b (+ bias), fp8 A [m, k] row-major and B [k, n] column-major (torch._scaled_mm's
// layouts), one-element float32 scales, D bf16/fp16/fp32 (contiguous), by cuBLASLt's fp8 GEMM with one plan per
// call signature (torch._scaled_mm asks cuBLASLt's heuristic on every call: tens of µs of host time a GEMM).
// False where cuBLASLt or an algorithm for these operands is missing (the caller falls back to _scaled_mm).
bool lt_scaled_mm(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale_a,
                  const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, bool fast_accum,
                  const c10::cuda::CUDAStream& stream);

}  // namespace fluxcompile::pipelined
