// The steps both sequence families share (sequences.h).
#include "sequences.h"

#include <c10/util/Exception.h>

#include "memops.h"
#include "streams.h"

namespace fluxcompile::pipelined {

void check_lengths(size_t n, std::initializer_list<size_t> sizes) {
  for (size_t s : sizes) TORCH_CHECK(s == n, "fluxcompile: plan lists of different lengths");
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
