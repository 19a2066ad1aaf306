// The stream steps of the `pipelined` module's sequences other than flags (memops.h): joins between streams,
// copy-engine copies, the all-gather sequences' GEMM stream, streams handed over from Python.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace fluxcompile::pipelined {

// `waiter` waits for everything queued on `producer` so far (torch.cuda.Stream.wait_stream). One event per
// device serves every join: a wait takes the event's state when it is issued, and each record here is
// followed by its wait at once (inside graph capture the pair becomes a graph edge). Creating and
// destroying an event per join would cost host time on every call.
void join(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer);

// The all-gather sequences' GEMM stream: one high-priority stream per device, forked from the caller's. The
// gathered output's rows are SM copies on the side stream that often become ready when a GEMM does; at equal
// priority either may take the SMs first, and a copy that wins holds up the GEMM, which cuBLAS runs on every
// SM. At lower priority the copy takes only what the GEMM leaves (its last wave). Graph replays keep the
// priority (cudaGraphInstantiateFlagUseNodePriority).
c10::cuda::CUDAStream gemm_stream(c10::DeviceIndex device);

// Issues sequence(main) with main = the GEMM stream, current and forked from the caller's stream, which waits
// for it at the end.
template <typename F>
void on_gemm_stream(const c10::cuda::CUDAStream& gemms, F&& sequence) {
  const auto caller = c10::cuda::getCurrentCUDAStream(gemms.device_index());
  join(gemms, caller);
  {
    c10::cuda::CUDAStreamGuard on_gemms(gemms);
    sequence(gemms);
  }
  join(caller, gemms);
}

// dst <- src on stream s: the cudaMemcpyAsync that Tensor::copy_ issues for contiguous same-dtype tensors
// of one device (a peer's mapped buffer counts as this device's: the copy engine moves it over NVLink),
// without the dispatcher's host cost.
void copy_async(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& s);

// dst <- src on stream s by the copy engine (cudaMemcpy2DAsync): both row-major with row strides of their own (a
// column block of a matrix), of one dtype and shape. A strided Tensor::copy_ would be a kernel (an SM).
void copy_2d(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& s);

// A stream of torch's Python side (its handle, torch.cuda.Stream.cuda_stream) on `device`.
c10::cuda::CUDAStream external(int64_t handle, c10::DeviceIndex device);

}  // namespace fluxcompile::pipelined
