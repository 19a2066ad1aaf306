// TMA ring streaming lab (one GPU): how fast can a ring of bulk tensor copies stream a decode weight [n, k]
// (and, per stage, A's rows from L2) into shared memory, with no math? The GEMV's m > 16 loader is capped by
// its ring (BENCHMARKS.md run D: 67.9 us without MMAs against a 53.6 us plain read at down_proj); this
// measures the ring's shape alone: rows per CTA, k per box, boxes per stage, stages, A's rows, a producer
// warp with per-stage empty barriers (WS) or thread 0 refilling behind a CTA barrier (the csrc kernel's),
// L2 evict-first for the weight, and stream-K (contiguous ranges of k steps per CTA, so every SM works).
#include <cuda_runtime.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <torch/extension.h>

namespace {

__device__ __forceinline__ unsigned su32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(unsigned long long* b, unsigned c) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(b)), "r"(c) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(su32(b)) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned long long* b, unsigned parity) {
  unsigned ok = 0;
  while (!ok) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(su32(b)), "r"(parity) : "memory");
  }
}
template <bool kHint>
__device__ __forceinline__ void tma2d(void* dst, const CUtensorMap* m, int c0, int c1, unsigned long long* b,
                                      unsigned long long policy) {
  if (kHint) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(su32(dst)), "l"(m), "r"(c0), "r"(c1), "r"(su32(b)), "l"(policy) : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(su32(dst)), "l"(m), "r"(c0), "r"(c1), "r"(su32(b)) : "memory");
  }
}

// R weight rows per unit; a stage = NB boxes of KB k each (weight R x KB, A AR x KB); S stages; CW consumer
// warps; WS: a producer warp; HINT: weight loads evict-first in L2; SK: stream-K over (unit, k step).
template <int R, int KB, int NB, int S, int AR, int CW, bool WS, bool HINT, bool SK>
__global__ void __launch_bounds__(32 * (CW + (WS ? 1 : 0)))
    tma_stream(const __grid_constant__ CUtensorMap wm, const __grid_constant__ CUtensorMap am, int n, int k,
               float* sink) {
  constexpr int WB = R * KB * 2, AB = AR * KB * 2, SB = NB * (WB + AB);
  extern __shared__ __align__(1024) char smem[];
  __shared__ unsigned long long full[S], empty[S];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int units = (n + R - 1) / R, ksteps = (k + KB * NB - 1) / (KB * NB);
  // This CTA's iterations i = 0 .. n_it - 1 and their global index g (unit * ksteps + k step): stream-K gives
  // it a contiguous range of all units' k steps, otherwise it walks units blockIdx.x, + gridDim.x, ...
  const long long total = static_cast<long long>(units) * ksteps;
  const long long it0 = total * blockIdx.x / gridDim.x;
  const int my_units = blockIdx.x < units ? (units - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int n_it = SK ? static_cast<int>(total * (blockIdx.x + 1) / gridDim.x - it0) : my_units * ksteps;
  auto g_of = [&](int i) -> long long {
    if (SK) return it0 + i;
    const int u = blockIdx.x + (i / ksteps) * gridDim.x;
    return static_cast<long long>(u) * ksteps + i % ksteps;
  };
  unsigned long long policy = 0;
  if (HINT) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  auto issue = [&](int i) {
    const long long g = g_of(i);
    const int s = i % S, unit = static_cast<int>(g / ksteps), ks = static_cast<int>(g % ksteps);
    char* st = smem + s * SB;
    bar_expect(&full[s], SB);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      tma2d<HINT>(st + b * WB, &wm, (ks * NB + b) * KB, unit * R, &full[s], policy);
      if (AR) tma2d<false>(st + NB * WB + b * AB, &am, (ks * NB + b) * KB, 0, &full[s], 0);
    }
  };
  unsigned acc = 0;
  if (WS) {
    if (warp == CW) {
      if (lane == 0) {
        for (int i = 0; i < n_it; ++i) {
          bar_wait(&empty[i % S], ((i / S) & 1) ^ 1);
          issue(i);
        }
      }
    } else {
      for (int i = 0; i < n_it; ++i) {
        bar_wait(&full[i % S], (i / S) & 1);
        acc ^= *reinterpret_cast<const unsigned*>(smem + (i % S) * SB + (tid * 16) % SB);
        __syncwarp();
        if (lane == 0) bar_arrive(&empty[i % S]);
      }
    }
  } else {
    // thread 0 issues the first S, then refills stage s behind a CTA barrier once every warp read it.
    if (tid == 0)
      for (int i = 0; i < S && i < n_it; ++i) issue(i);
    for (int i = 0; i < n_it; ++i) {
      bar_wait(&full[i % S], (i / S) & 1);
      acc ^= *reinterpret_cast<const unsigned*>(smem + (i % S) * SB + (tid * 16) % SB);
      __syncthreads();
      if (tid == 0 && i + S < n_it) issue(i + S);
    }
  }
  if (acc == 0x12345678u) sink[tid] = 1.f;
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    TORCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
                    cudaSuccess && p, "no cuTensorMapEncodeTiled");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

CUtensorMap make_map(const torch::Tensor& t, int box_rows, int box_cols) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {(cuuint64_t)t.size(1), (cuuint64_t)t.size(0)};
  const cuuint64_t strides[1] = {(cuuint64_t)t.stride(0) * 2};
  const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)(box_rows > 0 ? box_rows : 8)};
  const cuuint32_t unit[2] = {1, 1};
  auto swz = box_cols * 2 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE;
  CUresult r = encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), dims, strides, box, unit,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, swz, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed: ", (int)r);
  return m;
}

template <int R, int KB, int NB, int S, int AR, int CW, bool WS, bool HINT, bool SK>
void run_cfg(torch::Tensor w, torch::Tensor a, torch::Tensor sink, int64_t stream, int ctas_per_sm) {
  auto kern = tma_stream<R, KB, NB, S, AR, CW, WS, HINT, SK>;
  constexpr int SB = NB * (R * KB * 2 + AR * KB * 2);
  constexpr int smem = S * SB;
  static bool raised = false;
  if (!raised) {
    TORCH_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess,
                "smem ", smem);
    raised = true;
  }
  const CUtensorMap wm = make_map(w, R, KB), am = make_map(a, AR, KB);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, w.get_device());
  const int units = (w.size(0) + R - 1) / R;
  int grid = sms * ctas_per_sm;
  if (!SK && grid > units) grid = units;
  kern<<<grid, 32 * (CW + (WS ? 1 : 0)), smem, reinterpret_cast<cudaStream_t>(stream)>>>(
      wm, am, (int)w.size(0), (int)w.size(1), sink.data_ptr<float>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "launch failed");
}

}  // namespace

// The configurations, by name: R_KB_NB_S_AR_CW_WS_HINT_SK (and CTAs per SM).
#define CFGS(X)                                          \
  X(cur, 64, 256, 1, 3, 64, 8, false, false, false, 1)   \
  X(cur_a0, 64, 256, 1, 3, 0, 8, false, false, false, 1) \
  X(cur_a16, 64, 256, 1, 3, 16, 8, false, false, false, 1) \
  X(ws3, 64, 256, 1, 3, 64, 8, true, false, false, 1)    \
  X(ws3h, 64, 256, 1, 3, 64, 8, true, true, false, 1)    \
  X(ws3sk, 64, 256, 1, 3, 64, 8, true, false, true, 1)   \
  X(sw6, 64, 64, 2, 6, 64, 8, true, false, false, 1)     \
  X(sw6sk, 64, 64, 2, 6, 64, 8, true, false, true, 1)    \
  X(sw10a16, 64, 64, 2, 10, 16, 8, true, false, false, 1) \
  X(sw8a0, 64, 64, 4, 6, 0, 8, true, false, false, 1)    \
  X(r32w4, 32, 256, 1, 4, 16, 4, true, false, false, 2)  \
  X(r32w4sk, 32, 256, 1, 4, 16, 4, true, false, true, 2) \
  X(r128, 128, 64, 2, 4, 64, 8, true, false, true, 1)    \
  X(r64s4, 64, 256, 1, 4, 32, 8, true, false, true, 1)

#define DEF(name, R, KB, NB, S, AR, CW, WS, HINT, SK, CPS) \
  void name(torch::Tensor w, torch::Tensor a, torch::Tensor sink, int64_t stream) { run_cfg<R, KB, NB, S, AR, CW, WS, HINT, SK>(w, a, sink, stream, CPS); }
CFGS(DEF)

std::vector<std::string> names() {
  std::vector<std::string> v;
#define NAME(name, ...) v.push_back(#name);
  CFGS(NAME)
  return v;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("names", &names);
#define BIND(name, ...) m.def(#name, &name);
  CFGS(BIND)
}
