// The steps both sequence families share (sequences.h).
#include "sequences.h"

#include <c10/util/Exception.h>

#include "cublaslt_addmm.h"
#include "memops.h"
#include "streams.h"

namespace fluxcompile::pipelined {

void check_lengths(size_t n, std::initializer_list<size_t> sizes) {
  for (size_t s : sizes) TORCH_CHECK(s == n, "fluxcompile: plan lists of different lengths");
}

Scaling scaling_of(const std::vector<at::Tensor>& a_scales, const std::vector<at::Tensor>& b_scales,
                   std::optional<at::ScalarType> out_dtype, bool fast_accum, size_t matmuls) {
  Scaling s{a_scales, b_scales, out_dtype, fast_accum};
  if (!s.on()) {
    TORCH_CHECK(a_scales.empty() && !out_dtype.has_value(), "fluxcompile: A scales or out_dtype without B scales");
    return s;
  }
  TORCH_CHECK(a_scales.size() == matmuls && b_scales.size() == matmuls,
              "fluxcompile: scaled matmuls need one A and one B scale per matmul");
  for (auto& t : s.a_scales) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "fluxcompile: scales are float32");
    if (t.numel() > 1) t = t.reshape({-1, 1});  // row-wise: [rows, 1], unit strides
  }
  for (auto& t : s.b_scales) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "fluxcompile: scales are float32");
    if (t.numel() > 1) t = t.reshape({1, -1});
  }
  return s;
}

std::vector<at::Tensor> Scaling::tensors() const {
  std::vector<at::Tensor> all = a_scales;
  all.insert(all.end(), b_scales.begin(), b_scales.end());
  return all;
}

int64_t Scaling::word() const {
  const int64_t dtype = out_dtype.has_value() ? static_cast<int64_t>(*out_dtype) : -1;
  return on() ? (dtype + 2) * 2 + (fast_accum ? 1 : 0) : 0;
}

void matmul_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                const Scaling& scaling, size_t i, int64_t lo) {
  if (!scaling.on()) {
    if (bias.has_value()) {
      at::addmm_out(out, *bias, a, b);
    } else {
      at::mm_out(out, a, b);
    }
    return;
  }
  at::Tensor sa = scaling.a_scales[i];
  if (sa.numel() > 1) sa = sa.narrow(0, lo, a.size(0));
  // Tensor-wise scales by our cuBLASLt plan (no heuristic per call); row-wise ones, or a signature cuBLASLt
  // declines, by torch's _scaled_mm.
  const auto stream = c10::cuda::getCurrentCUDAStream(out.device().index());
  if (lt_scaled_mm(out, a, b, sa, scaling.b_scales[i], bias, scaling.fast_accum, stream)) return;
  at::_scaled_mm_out(out, a, b, sa, scaling.b_scales[i], bias, std::nullopt, scaling.out_dtype, scaling.fast_accum);
}

at::TensorOptions product_options(const at::Tensor& a, const Scaling& scaling) {
  if (!scaling.on()) return a.options();
  return a.options().dtype(scaling.out_dtype.value_or(a.scalar_type()));
}

void send_block(const c10::cuda::CUDAStream& side, int64_t done, const at::Tensor& dst, const at::Tensor& src,
                int64_t ready) {
  consume_flag(side, done);
  copy_async(dst, src, side);  // peer-to-peer: the copy engine
  write_flag(side, ready, 1);
}

void check_groups(size_t peers, int64_t m, const std::vector<std::vector<int64_t>>& group_js,
                  const std::vector<std::vector<int64_t>>& group_ranges) {
  TORCH_CHECK(group_js.size() == group_ranges.size(), "fluxcompile: one range list per group");
  std::vector<int> seen(peers, 0);
  for (const auto& js : group_js) {
    for (int64_t j : js) {
      TORCH_CHECK(0 <= j && j < static_cast<int64_t>(peers), "fluxcompile: a group names no peer");
      ++seen[j];
    }
  }
  for (int c : seen) TORCH_CHECK(c == 1, "fluxcompile: the groups must take every peer exactly once");
  for (const auto& rs : group_ranges) {
    TORCH_CHECK(rs.size() % 2 == 0, "fluxcompile: ranges come as lo, hi pairs");
    for (size_t i = 0; i < rs.size(); i += 2) {
      TORCH_CHECK(0 <= rs[i] && rs[i] < rs[i + 1] && rs[i + 1] <= m, "fluxcompile: a row range out of bounds");
    }
  }
}

}  // namespace fluxcompile::pipelined
