// The bounded spin-wait of csrc's CUDA kernels (gemv_ar.cu, flux_gemm.cuh) on a flag that another rank sets.
// A wait gives up after timeout_ns of %globaltimer, or at once where another wait of the same call already has, so
// a missing peer costs one timeout. The first wait to time out records who waited for what in the call's error
// words, which the host reads after the call to raise an error naming them:
//   err[0] = 1, err[1] = this rank, err[2] = the awaited peer, err[3] = its tile or chunk, err[4] = the awaited
//   value (an epoch), err[5] = the wait's kind.
// Each kernel keeps its own polling (what it loads and compares); the bookkeeping between polls is this header's.
#pragma once

namespace fluxcompile {

// %globaltimer: nanoseconds.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The bookkeeping of a bounded wait, called after every unsuccessful poll with the poll's iteration count and the
// wait's start t0 (0 until the first look at the clock, taken every 256 polls): true once the wait must give up,
// because another wait of this call already timed out (err[0] != 0) or because this one has now. `call` holds the
// call's bound and error words: call.timeout_ns, call.err (int*) and call.rank (the kernels' parameter blocks,
// GemvArParams and FluxGemmSync, name them alike). The first timeout (its atomicCAS sets err[0]) records rank,
// peer, unit, value and kind in err[1..5]; where `record` is false this thread leaves that to another of the same
// wait (a warp's waits record from one lane).
// kErrOptional: call.err may be null, and then nothing is read or recorded there (a wait ends on its own timeout).
template <bool kErrOptional = false, class Call>
__device__ __forceinline__ bool bounded_wait_gives_up(unsigned iter, unsigned long long& t0, const Call& call,
                                                      bool record, int peer, int unit, int value, int kind) {
  if (iter & 255u) return false;
  const unsigned long long now = global_ns();
  if (t0 == 0) t0 = now;
  const bool have_err = !kErrOptional || call.err != nullptr;
  if (have_err && *reinterpret_cast<volatile int*>(call.err) != 0) return true;
  if (static_cast<long long>(now - t0) <= call.timeout_ns) return false;
  if (have_err && record && atomicCAS(call.err, 0, 1) == 0) {
    call.err[1] = call.rank;
    call.err[2] = peer;
    call.err[3] = unit;
    call.err[4] = value;
    call.err[5] = kind;
    __threadfence_system();
  }
  return true;
}

}  // namespace fluxcompile
