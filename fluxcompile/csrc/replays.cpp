// The parts of replays.h that are no templates, and the process's replays.
#include "replays.h"

#include <c10/cuda/CUDACachingAllocator.h>

namespace fluxcompile::pipelined {

// The cuBLAS settings a capture bakes in that a user may change between calls (reduced-precision
// reductions of fp16/bf16 GEMMs). TF32 is left out: reading it throws where the old and new precision
// APIs were mixed, and these sequences run fp16/bf16 in practice.
int64_t Replays::blas_settings() {
  const auto& ctx = at::globalContext();
  return static_cast<int64_t>(ctx.allowFP16ReductionCuBLAS()) |
         static_cast<int64_t>(ctx.allowBF16ReductionCuBLAS()) << 4;
}

bool Replays::handed_out(c10::DeviceIndex device, Handed& h) {
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    h = {stats.allocation[0].allocated, stats.allocated_bytes[0].allocated};  // [0]: all pools
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

std::string Replays::error_text(cudaError_t rc) {
  return std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")";
}

bool Replays::capturing(const c10::cuda::CUDAStream& s) {
  cudaStreamCaptureStatus status{};
  C10_CUDA_CHECK(cudaStreamIsCapturing(s.stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

bool Replays::first_sight(const std::vector<int64_t>& key) {
  if (seen_.size() > 4096) seen_.clear();  // keys that never came back
  return seen_.emplace(key, true).second;
}

// A stream of our own per device (never the legacy default stream, which cannot capture). One from
// torch's pool may be the side or a compute stream of these very sequences (torch.cuda.Stream() draws
// from that pool), which would fold their branches into one.
c10::cuda::CUDAStream Replays::capture_stream(c10::DeviceIndex device) {
  static std::unordered_map<c10::DeviceIndex, cudaStream_t> streams;
  auto it = streams.find(device);
  if (it == streams.end()) {
    cudaStream_t raw = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));  // the current device's (guarded)
    it = streams.emplace(device, raw).first;
  }
  return c10::cuda::getStreamFromExternal(it->second, device);
}

// Makes the cuBLAS and cuBLASLt workspaces of this thread's GEMMs on `s`, where they are missing: made
// during a capture they would count as an allocation. torch keeps one per (cuBLAS handle, stream), with a
// handle per thread, and drops them all at torch._C._cuda_clearCublasWorkspaces(), which Inductor's CUDA
// graph trees call around each recording; so this runs before every capture (once per captured key), on the
// capturing thread. Real GEMMs, plain and with a bias, rather than torch's workspace functions: they make
// whatever workspaces this torch version's GEMM paths use.
// No synchronization: the workspaces are made on the host, and the scratch GEMMs may run whenever.
void Replays::warm_blas(const c10::cuda::CUDAStream& s) {
  c10::cuda::CUDAStreamGuard on_s(s);
  for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    at::Tensor a = at::ones({16, 16}, at::TensorOptions().dtype(dtype).device(s.device()));
    at::Tensor bias = at::ones({16}, a.options());
    at::mm(a, a);
    at::addmm(bias, a, a);  // the cuBLASLt path (bias epilogue)
  }
}

Replays& replays() {
  static Replays* r = new Replays();  // never destroyed: graphs must not be freed after the CUDA context
  return *r;
}

}  // namespace fluxcompile::pipelined
