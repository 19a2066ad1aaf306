// Python binding of the experts' CUTLASS grouped GEMM (cutlass_grouped.h). Pointers and the stream come from
// Python as integers; kernels/cutlass_grouped.py validates shapes, layouts and dtypes. The variant table is
// generated at build time (cutlass_grouped_registry.cpp) from kernels/cutlass_grouped_build.py's GROUPED_VARIANTS.
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "cutlass_grouped.h"

namespace {

template <typename P>
P ptr(int64_t v) {
  return reinterpret_cast<P>(static_cast<intptr_t>(v));
}

const fluxcompile::GroupedVariant& variant(int64_t index) {
  int count = 0;
  const fluxcompile::GroupedVariant* table = fluxcompile::grouped_variants(&count);
  if (index < 0 || index >= count) {
    throw std::out_of_range("fluxcompile cutlass_grouped: no variant " + std::to_string(index));
  }
  return table[index];
}

// q: a, lda, b, ldb, b_group, b_kmajor, d, ldd, offs, groups, n, k, sm_count, device, workspace
//    [, flags, block_rows, epoch, err, rank, timeout_ns (the dispatch's waits)]
fluxcompile::GroupedProblem problem(const std::vector<int64_t>& q) {
  if (q.size() != 15 && q.size() != 21) throw std::invalid_argument("fluxcompile cutlass_grouped: bad argument count");
  fluxcompile::GroupedProblem p{};
  p.a = ptr<const void*>(q[0]);
  p.lda = q[1];
  p.b = ptr<const void*>(q[2]);
  p.ldb = q[3];
  p.b_group = q[4];
  p.b_kmajor = q[5] != 0;
  p.d = ptr<void*>(q[6]);
  p.ldd = q[7];
  p.offs = ptr<const int*>(q[8]);
  p.groups = static_cast<int>(q[9]);
  p.n = static_cast<int>(q[10]);
  p.k = static_cast<int>(q[11]);
  p.sm_count = static_cast<int>(q[12]);
  p.device = static_cast<int>(q[13]);
  p.workspace = ptr<void*>(q[14]);
  if (q.size() == 21) {
    auto& y = p.sync;
    y.flags = ptr<const int*>(q[15]);
    y.block_rows = static_cast<int>(q[16]);
    y.epoch = ptr<const int*>(q[17]);
    y.err = ptr<int*>(q[18]);
    y.rank = static_cast<int>(q[19]);
    y.timeout_ns = q[20];
  }
  return p;
}

void run(int64_t index, const std::vector<int64_t>& q, int64_t stream) {
  const auto& v = variant(index);
  cudaError_t rc = v.run(problem(q), ptr<cudaStream_t>(stream), nullptr);
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string("fluxcompile cutlass_grouped ") + v.name + " failed: " + cudaGetErrorString(rc));
  }
}

int64_t workspace_bytes(int64_t index, const std::vector<int64_t>& q) {
  size_t bytes = 0;
  cudaError_t rc = variant(index).run(problem(q), nullptr, &bytes);
  if (rc != cudaSuccess) throw std::invalid_argument("fluxcompile cutlass_grouped: no workspace size for this problem");
  return static_cast<int64_t>(bytes);
}

std::vector<std::string> names() {
  int count = 0;
  const fluxcompile::GroupedVariant* table = fluxcompile::grouped_variants(&count);
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) out.emplace_back(table[i].name);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "one grouped GEMM (variant index, problem, stream)");
  m.def("workspace_bytes", &workspace_bytes, "bytes of workspace a call needs (the groups' arrays and CUTLASS's)");
  m.def("names", &names, "the compiled variants, in index order");
}
