// Flag memory operations of the `pipelined` module's sequences. Flags are 32-bit words in symmetric memory, set
// and awaited by the GPU front end (cuStreamWriteValue32 / cuStreamWaitValue32, no SM), with the protocol of
// fluxcompile/symm_mem/signals.py.
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace fluxcompile::pipelined {

void wait_flag(const c10::cuda::CUDAStream& s, int64_t addr, uint32_t value);
void write_flag(const c10::cuda::CUDAStream& s, int64_t addr, uint32_t value);
// The waiter's half of the protocol (signals.stream_consume): wait until the flag is 1, then reset it to 0.
void consume_flag(const c10::cuda::CUDAStream& s, int64_t addr);

}  // namespace fluxcompile::pipelined
