// Python binding of the Flux-style GEMM (flux_gemm.h). Pointers and the stream come from Python as integers;
// kernels/cutlass_gemm.py validates shapes, layouts and dtypes. The variant table is generated at build time
// (flux_gemm_registry.cpp) from kernels/cutlass_gemm.py's VARIANTS.
#include <torch/extension.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "flux_gemm.h"

namespace {

template <typename P>
P ptr(int64_t v) {
  return reinterpret_cast<P>(static_cast<intptr_t>(v));
}

const fluxcompile::FluxGemmVariant& variant(int64_t index) {
  int count = 0;
  const fluxcompile::FluxGemmVariant* table = fluxcompile::flux_gemm_variants(&count);
  if (index < 0 || index >= count) throw std::out_of_range("fluxcompile flux_gemm: no variant " + std::to_string(index));
  return table[index];
}

// problem: a, b, d, bias, m, n, k, lda, ldb, ldd, b_kmajor, dtype, sm_count, raster, swizzle, device, workspace
//          [, c, ldc, alpha (a float's bits)][, scale_a, scale_b, scale_mode, fast_accum (fp8)]
// sync: rotate_axis, rotate_elems, wait_flags, rows_per_rank, chunk_rows, chunks_per_rank, skip_rank,
//       signal_counters, signal_axis, signal_elems, err, rank, timeout_ns[, local_a, local_lda, local_row0, group_m
//       [, c_flags, c_elems, c_peer, chunk_elems, zero_chunk, own_chunk, zero, ldz, out, ldo]]
fluxcompile::FluxGemmProblem problem(const std::vector<int64_t>& q, const std::vector<int64_t>& s) {
  const size_t base = q.size() >= 21 ? q.size() - 4 : q.size();  // without the fp8 suffix
  if ((base != 17 && base != 20) || (s.size() != 13 && s.size() != 17 && s.size() != 27)) {
    throw std::invalid_argument("fluxcompile flux_gemm: bad argument count");
  }
  fluxcompile::FluxGemmProblem p{};
  p.a = ptr<const void*>(q[0]);
  p.b = ptr<const void*>(q[1]);
  p.d = ptr<void*>(q[2]);
  p.bias = ptr<const void*>(q[3]);
  p.m = static_cast<int>(q[4]);
  p.n = static_cast<int>(q[5]);
  p.k = static_cast<int>(q[6]);
  p.lda = q[7];
  p.ldb = q[8];
  p.ldd = q[9];
  p.b_kmajor = q[10] != 0;
  p.dtype = static_cast<int>(q[11]);
  p.sm_count = static_cast<int>(q[12]);
  p.raster = static_cast<int>(q[13]);
  p.swizzle = static_cast<int>(q[14]);
  p.device = static_cast<int>(q[15]);
  p.workspace = ptr<void*>(q[16]);
  if (base == 20) {
    p.c = ptr<const void*>(q[17]);
    p.ldc = q[18];
    const auto bits = static_cast<uint32_t>(q[19]);
    std::memcpy(&p.alpha, &bits, sizeof(bits));
  }
  if (q.size() > base) {
    p.scale_a = ptr<const float*>(q[base]);
    p.scale_b = ptr<const float*>(q[base + 1]);
    p.scale_mode = static_cast<int>(q[base + 2]);
    p.fast_accum = q[base + 3] != 0;
  }
  auto& y = p.sync;
  y.rotate_axis = static_cast<int>(s[0]);
  y.rotate_elems = static_cast<int>(s[1]);
  y.wait_flags = ptr<const unsigned*>(s[2]);
  y.rows_per_rank = static_cast<int>(s[3]);
  y.chunk_rows = static_cast<int>(s[4]);
  y.chunks_per_rank = static_cast<int>(s[5]);
  y.skip_rank = static_cast<int>(s[6]);
  y.signal_counters = ptr<unsigned*>(s[7]);
  y.signal_axis = static_cast<int>(s[8]);
  y.signal_elems = static_cast<int>(s[9]);
  y.err = ptr<int*>(s[10]);
  y.rank = static_cast<int>(s[11]);
  y.timeout_ns = s[12];
  if (s.size() >= 17) {
    y.local_a = ptr<const void*>(s[13]);
    y.local_lda = s[14];
    y.local_row0 = static_cast<int>(s[15]);
    y.group_m = static_cast<int>(s[16]);
  }
  if (s.size() == 27) {
    y.c_flags = ptr<const unsigned*>(s[17]);
    y.c_elems = static_cast<int>(s[18]);
    y.c_peer = static_cast<int>(s[19]);
    y.chunk_elems = static_cast<int>(s[20]);
    y.zero_chunk = static_cast<int>(s[21]);
    y.own_chunk = static_cast<int>(s[22]);
    y.zero = ptr<const void*>(s[23]);
    y.ldz = s[24];
    y.out = ptr<void*>(s[25]);
    y.ldo = s[26];
  }
  return p;
}

// The variant's entry for the problem: the ring's build where the problem has a source (null if not built).
auto entry(const fluxcompile::FluxGemmVariant& v, const fluxcompile::FluxGemmProblem& p) {
  return p.c != nullptr ? v.run_ring : v.run;
}

void run(int64_t index, const std::vector<int64_t>& q, const std::vector<int64_t>& s, int64_t stream) {
  const auto& v = variant(index);
  const auto p = problem(q, s);
  if (entry(v, p) == nullptr) {
    throw std::invalid_argument(std::string("fluxcompile flux_gemm: ") + v.name + " is not built with a source");
  }
  cudaError_t rc = entry(v, p)(p, ptr<cudaStream_t>(stream), nullptr);
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string("fluxcompile flux_gemm ") + v.name + " failed: " + cudaGetErrorString(rc));
  }
}

int64_t workspace_bytes(int64_t index, const std::vector<int64_t>& q, const std::vector<int64_t>& s) {
  size_t bytes = 0;
  const auto p = problem(q, s);
  const auto fn = entry(variant(index), p);
  if (fn != nullptr) fn(p, nullptr, &bytes);
  return static_cast<int64_t>(bytes);
}

std::vector<std::string> names() {
  int count = 0;
  const fluxcompile::FluxGemmVariant* table = fluxcompile::flux_gemm_variants(&count);
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) out.emplace_back(table[i].name);
  return out;
}

std::vector<std::string> ring_names() {
  int count = 0;
  const fluxcompile::FluxGemmVariant* table = fluxcompile::flux_gemm_variants(&count);
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    if (table[i].run_ring != nullptr) out.emplace_back(table[i].name);
  }
  return out;
}

}  // namespace

// The C entry that the pipelined module's sequences launch the GEMM through (csrc/flux_problem.h's FluxGemmRun;
// Python hands them its address, run_address): the variant at `index`, called as its FluxGemmVariant::run. A
// plain function pointer, so the sequences build without CUTLASS and this module without the sequences.
extern "C" cudaError_t fluxcompile_flux_gemm_run(int index, const fluxcompile::FluxGemmProblem* p, cudaStream_t stream,
                                                 size_t* workspace_bytes) {
  int count = 0;
  const fluxcompile::FluxGemmVariant* table = fluxcompile::flux_gemm_variants(&count);
  if (p == nullptr || index < 0 || index >= count) return cudaErrorInvalidValue;
  const auto fn = entry(table[index], *p);
  if (fn == nullptr) return cudaErrorInvalidValue;
  try {
    return fn(*p, stream, workspace_bytes);
  } catch (...) {  // no exception crosses the C entry
    return cudaErrorUnknown;
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "one Flux-style GEMM (variant index, problem, sync, stream)");
  m.def("workspace_bytes", &workspace_bytes, "bytes of workspace a call needs (stream-K variants)");
  m.def("names", &names, "the compiled variants, in index order");
  m.def("ring_names", &ring_names, "the variants also built with the reduce-scatter ring's source and epilogue");
  m.def("run_address", [] { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&fluxcompile_flux_gemm_run)); },
        "the address of fluxcompile_flux_gemm_run, the C entry the pipelined module's sequences call");
}
