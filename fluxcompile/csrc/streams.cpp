// The stream steps of streams.h.
#include "streams.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <vector>

namespace fluxcompile::pipelined {

void join(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  static std::vector<cudaEvent_t> events;  // by device index
  const auto device = static_cast<size_t>(producer.device_index());
  if (events.size() <= device) events.resize(device + 1, nullptr);
  if (events[device] == nullptr) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&events[device], cudaEventDisableTiming));
  }
  C10_CUDA_CHECK(cudaEventRecord(events[device], producer.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter.stream(), events[device], 0));
}

c10::cuda::CUDAStream gemm_stream(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(true, device)).first;
  return it->second;
}

void copy_async(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& s) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.dtype() == src.dtype() &&
                  dst.numel() == src.numel(),
              "fluxcompile: copy_async needs contiguous tensors of one dtype and size");
  C10_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDeviceToDevice, s.stream()));
}

void copy_2d(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& s) {
  TORCH_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.sizes() == src.sizes() && dst.dtype() == src.dtype() &&
                  dst.stride(1) == 1 && src.stride(1) == 1,
              "fluxcompile: copy_2d needs row-major tensors of one shape and dtype");
  if (src.is_contiguous() && dst.is_contiguous()) return copy_async(dst, src, s);
  const size_t es = src.element_size();
  C10_CUDA_CHECK(cudaMemcpy2DAsync(dst.data_ptr(), dst.stride(0) * es, src.data_ptr(), src.stride(0) * es,
                                   src.size(1) * es, src.size(0), cudaMemcpyDefault, s.stream()));
}

c10::cuda::CUDAStream external(int64_t handle, c10::DeviceIndex device) {
  return c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(handle), device);
}

}  // namespace fluxcompile::pipelined
