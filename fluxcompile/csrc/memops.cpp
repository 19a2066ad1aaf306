// The flag memory operations (memops.h), through the runtime's driver entry point.
#include "memops.h"

#include <c10/util/Exception.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

namespace fluxcompile::pipelined {
namespace {

using MemOpFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct MemOps {
  MemOpFn wait = nullptr;
  MemOpFn write = nullptr;
};

MemOpFn entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  // Through the runtime, so the module needs no link against libcuda; 12000: the CUDA 12 signatures.
  cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  TORCH_CHECK(rc == cudaSuccess && found == cudaDriverEntryPointSuccess && fn != nullptr,
              "fluxcompile: the CUDA driver has no ", name);
  return reinterpret_cast<MemOpFn>(fn);
}

const MemOps& memops() {
  static const MemOps ops{entry_point("cuStreamWaitValue32"), entry_point("cuStreamWriteValue32")};
  return ops;
}

}  // namespace

void wait_flag(const c10::cuda::CUDAStream& s, int64_t addr, uint32_t value) {
  CUresult rc = memops().wait(reinterpret_cast<CUstream>(s.stream()), static_cast<CUdeviceptr>(addr), value,
                              CU_STREAM_WAIT_VALUE_EQ);
  TORCH_CHECK(rc == CUDA_SUCCESS, "fluxcompile: cuStreamWaitValue32 failed (", static_cast<int>(rc), ")");
}

void write_flag(const c10::cuda::CUDAStream& s, int64_t addr, uint32_t value) {
  CUresult rc = memops().write(reinterpret_cast<CUstream>(s.stream()), static_cast<CUdeviceptr>(addr), value,
                               CU_STREAM_WRITE_VALUE_DEFAULT);
  TORCH_CHECK(rc == CUDA_SUCCESS, "fluxcompile: cuStreamWriteValue32 failed (", static_cast<int>(rc), ")");
}

void consume_flag(const c10::cuda::CUDAStream& s, int64_t addr) {
  wait_flag(s, addr, 1);
  write_flag(s, addr, 0);
}

}  // namespace fluxcompile::pipelined
