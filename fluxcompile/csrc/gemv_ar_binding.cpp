// Python binding of the GEMV + all-reduce launcher. Pointers and the stream come from Python as integers
// (data_ptr(), buffer_ptrs_dev, cuda_stream): the Python side validates shapes, so this file needs no
// ATen tensor or CUDA header of torch's, only pybind11.
#include <torch/extension.h>

#include <stdexcept>
#include <string>

#include "gemv_ar.h"

namespace {

template <typename P>
P ptr(int64_t v) {
  return reinterpret_cast<P>(static_cast<intptr_t>(v));
}

void launch(int64_t a, int64_t w, int64_t bias, int64_t out, int64_t normed, int64_t residual, int64_t norm_weight,
            double eps, bool weight_after_cast, int64_t peer_data, int64_t peer_flags, int64_t slot_bytes,
            int64_t state, int64_t err, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldw,
            int64_t rank, int64_t world, bool two_shot, int64_t ll, int64_t n_tiles, int64_t timeout_ns, int64_t dtype,
            int64_t grid, int64_t stream) {
  fluxcompile::GemvArParams p{};
  p.a = ptr<const void*>(a);
  p.w = ptr<const void*>(w);
  p.bias = ptr<const void*>(bias);
  p.out = ptr<void*>(out);
  p.normed = ptr<void*>(normed);
  p.residual = ptr<const void*>(residual);
  p.norm_weight = ptr<const void*>(norm_weight);
  p.eps = static_cast<float>(eps);
  p.weight_after_cast = weight_after_cast ? 1 : 0;
  p.peer_data = ptr<char* const*>(peer_data);
  p.peer_flags = ptr<unsigned* const*>(peer_flags);
  p.slot_bytes = slot_bytes;
  p.state = ptr<int*>(state);
  p.err = ptr<int*>(err);
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.lda = static_cast<int>(lda);
  p.ldw = static_cast<int>(ldw);
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(world);
  p.two_shot = two_shot ? 1 : 0;
  p.ll = static_cast<int>(ll);
  p.n_tiles = static_cast<int>(n_tiles);
  p.timeout_ns = timeout_ns;
  cudaError_t rc = fluxcompile::gemv_ar_launch(p, static_cast<int>(dtype), static_cast<int>(grid),
                                               ptr<cudaStream_t>(stream));
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string("fluxcompile gemv_ar launch failed: ") + cudaGetErrorString(rc));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "GEMV + all-reduce (+ residual + RMSNorm) over symmetric memory");
  m.attr("TILE_N") = fluxcompile::kGemvTileN;
  m.attr("MAX_M") = fluxcompile::kGemvMaxM;
  m.attr("MAX_TILES") = fluxcompile::kGemvMaxTiles;
  m.attr("ERR_WORDS") = fluxcompile::kGemvErrWords;
}
