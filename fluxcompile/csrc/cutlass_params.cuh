// The kernel parameters of a CUTLASS kernel per call signature (csrc/flux_gemm.cuh, csrc/cutlass_grouped.cuh),
// made once: a repeated call (steady state, CUDA-graph capture) skips the TMA descriptor encoding and the attribute
// call, and only launches.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/device_kernel.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace fluxcompile {

template <class Kernel, size_t N>
class ParamsCache {
 public:
  using Key = std::array<int64_t, N>;
  using Params = typename Kernel::Params;

  // The parameters of `key` into `out`; at its first sight `make(Params&)` makes them (its error is returned, and
  // nothing is kept), and the kernel's dynamic shared memory is allowed once it has been made. At most 4096 keys
  // are kept (then the cache starts over).
  template <class Make>
  cudaError_t get(Key const& key, Params& out, Make&& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      Params params;
      cudaError_t rc = make(params);
      if (rc != cudaSuccess) return rc;
      if (!attribute_set_) {
        const int smem = Kernel::SharedStorageSize;
        if (smem >= (48 << 10)) {
          rc = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          if (rc != cudaSuccess) return rc;
        }
        attribute_set_ = true;
      }
      if (cache_.size() >= 4096) cache_.clear();
      it = cache_.emplace(key, params).first;
    }
    out = it->second;
    return cudaSuccess;
  }

 private:
  struct Hash {
    size_t operator()(Key const& k) const {
      size_t h = 1469598103934665603ull;
      for (int64_t v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
      return h;
    }
  };
  std::mutex mutex_;
  std::unordered_map<Key, Params, Hash> cache_;
  bool attribute_set_ = false;
};

}  // namespace fluxcompile
