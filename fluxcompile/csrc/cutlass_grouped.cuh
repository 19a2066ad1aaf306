// The experts' grouped GEMM (see cutlass_grouped.h): CUTLASS 3.x's Hopper ptr-array grouped kernel, built from the
// collective builders (TMA warp-specialized mainloop and epilogue, cooperative or ping-pong) under CUTLASS's
// group tile scheduler, its mainloop wrapped to wait for the dispatch's blocks of rows (WaitingGroupedMainloop). The groups' shapes, pointers and strides live on the device: a small kernel writes them
// on the stream from `offs` (no host synchronization, graph-capturable), and the kernel reads them (its TMA
// descriptors are re-pointed per group on the device, as CUTLASS's grouped kernels do). The host side caches the
// kernel parameters per workspace and shape: a repeated call launches two kernels and nothing else.
// Each variant file (cutlass_grouped_<variant>.cu) instantiates one tile configuration with GROUPED_VARIANT.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>


#include "bounded_wait.cuh"
#include "cutlass_grouped.h"
#include "cutlass_params.cuh"

namespace fluxcompile::grouped {

using namespace cute;

// --- the mainloop: wait for the tile's blocks of rows, then CUTLASS's TMA loads -------------------------------

CUTLASS_DEVICE int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The tile's rows are [start_g + m * TM, min(end_g, start_g + (m + 1) * TM)) of `a`; each block of
// sync.block_rows rows they overlap is awaited (a whole warp polls: every lane's later reads are ordered after
// its acquire). CUTLASS's grouped kernel tells its mainloop the group through tensors_perform_update (called on
// every change of group, before the group's first load), so the wrapper remembers it there.
template <class Base>
struct WaitingGroupedMainloop : Base {
  struct Arguments : Base::Arguments {
    GroupedSync sync;
  };
  struct Params : Base::Params {
    GroupedSync sync;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.sync = args.sync;
    return p;
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& inputs, Params const& params,
                                                     ProblemShape_MNKL problem, int32_t next_batch) {
    group_ = next_batch;
    return Base::tensors_perform_update(inputs, params, problem, next_batch);
  }

  template <class Pipeline, class PipelineState, class LoadInputs, class TensorMaps, class BlockCoord,
            class... Rest>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipelineState state, LoadInputs const& inputs,
                           TensorMaps const& tensormaps, BlockCoord const& blk_coord, Rest&&... rest) {
    GroupedSync const& s = params.sync;
    if (s.flags != nullptr && s.block_rows > 0) {
      constexpr int TM = size<0>(typename Base::TileShape{});
      const int start = group_ == 0 ? 0 : s.offs[group_ - 1];
      const int end = s.offs[group_];
      const int lo = start + int(get<0>(blk_coord)) * TM;
      const int hi = min(end, lo + TM);
      const int epoch = *s.epoch;
      bool ok = true;
      for (int b = lo / s.block_rows; ok && hi > lo && b <= (hi - 1) / s.block_rows; ++b) {
        unsigned long long t0 = 0;
        for (unsigned iter = 0;; ++iter) {
          if (ld_acquire_gpu(s.flags + b) >= epoch) break;
          if (bounded_wait_gives_up<true>(iter, t0, s, (threadIdx.x & 31) == 0, s.rank, b, epoch, kBlockWaitKind)) {
            ok = false;
            break;
          }
        }
      }
      // The rows were written through the generic proxy; TMA reads them through the async proxy.
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    Base::load(params, pipeline, state, inputs, tensormaps, blk_coord, static_cast<Rest&&>(rest)...);
  }

 private:
  int group_ = 0;
};

// Bytes `n` rounded up to 128 (every array of the workspace starts on a 128-byte boundary).
constexpr size_t round_up(size_t n) { return (n + 127) / 128 * 128; }

// The groups' device arrays in the workspace, in this order, then CUTLASS's own workspace.
template <class Shape3, class Element, class SA_, class SB_, class SD_>
struct Arrays {
  using SA = SA_;
  using SB = SB_;
  using SD = SD_;
  Shape3* shapes;
  Element const** a;
  Element const** b;
  Element** d;
  SA* sa;
  SB* sb;
  SD* sd;
  void* rest;

  static size_t bytes(int groups) {
    const size_t g = static_cast<size_t>(groups);
    return round_up(g * sizeof(Shape3)) + 3 * round_up(g * sizeof(void*)) + round_up(g * sizeof(SA)) +
           round_up(g * sizeof(SB)) + round_up(g * sizeof(SD));
  }

  static Arrays in(void* workspace, int groups) {
    const size_t g = static_cast<size_t>(groups);
    char* p = static_cast<char*>(workspace);
    Arrays w{};
    w.shapes = reinterpret_cast<Shape3*>(p);
    p += round_up(g * sizeof(Shape3));
    w.a = reinterpret_cast<Element const**>(p);
    p += round_up(g * sizeof(void*));
    w.b = reinterpret_cast<Element const**>(p);
    p += round_up(g * sizeof(void*));
    w.d = reinterpret_cast<Element**>(p);
    p += round_up(g * sizeof(void*));
    w.sa = reinterpret_cast<SA*>(p);
    p += round_up(g * sizeof(SA));
    w.sb = reinterpret_cast<SB*>(p);
    p += round_up(g * sizeof(SB));
    w.sd = reinterpret_cast<SD*>(p);
    p += round_up(g * sizeof(SD));
    w.rest = p;
    return w;
  }
};

// One thread per group: its rows [offs[g - 1], offs[g]) of a and d, its weight, their strides.
template <bool BKMajor, class W, class Element>
__global__ void prepare_groups(GroupedProblem p, W w) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.groups) return;
  const int start = g == 0 ? 0 : p.offs[g - 1];
  const int rows = max(p.offs[g] - start, 0);
  w.shapes[g] = make_shape(rows, p.n, p.k);
  w.a[g] = static_cast<Element const*>(p.a) + static_cast<int64_t>(start) * p.lda;
  w.b[g] = static_cast<Element const*>(p.b) + static_cast<int64_t>(g) * p.b_group;
  w.d[g] = static_cast<Element*>(p.d) + static_cast<int64_t>(start) * p.ldd;
  typename W::SA sa{};
  get<0>(sa) = p.lda;
  w.sa[g] = sa;
  typename W::SB sb{};
  if constexpr (BKMajor) {
    get<0>(sb) = p.ldb;  // b[kk, j] at j * ldb + kk: (N, K) with K contiguous
  } else {
    get<1>(sb) = p.ldb;  // b[kk, j] at kk * ldb + j: (N, K) with N contiguous
  }
  w.sb[g] = sb;
  typename W::SD sd{};
  get<0>(sd) = p.ldd;
  w.sd[g] = sd;
}

enum Schedule { kCoop = 0, kPingpong = 1 };

template <bool BKMajor, int TM, int TN, int TK, int CM, int CN, int Sched>
struct Grouped {
  using Element = cutlass::bfloat16_t;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  static constexpr bool Coop = Sched == kCoop;
  using KernelSchedule = cute::conditional_t<Coop, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>;
  using EpilogueSchedule = cute::conditional_t<Coop, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cute::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int Align = 16 / sizeof(Element);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, Align, Element, LayoutD*, Align,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, Align, Element, LayoutB*, Align, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, WaitingGroupedMainloop<Mainloop>, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using W = Arrays<typename ProblemShape::UnderlyingProblemShape, Element, typename Kernel::InternalStrideA,
                   typename Kernel::InternalStrideB, typename Kernel::InternalStrideD>;

  static typename Kernel::Arguments arguments(GroupedProblem const& p, W const& w) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = p.device;
    hw.sm_count = p.sm_count > 0 ? p.sm_count
                                 : cutlass::KernelHardwareInfo::query_device_multiprocessor_count(p.device);
    typename Kernel::MainloopArguments mainloop{};
    mainloop.ptr_A = w.a;
    mainloop.dA = w.sa;
    mainloop.ptr_B = w.b;
    mainloop.dB = w.sb;
    mainloop.sync = p.sync;
    mainloop.sync.offs = p.offs;
    typename Kernel::EpilogueArguments epilogue{};
    epilogue.thread.alpha = 1.0f;
    epilogue.thread.beta = 0.0f;
    epilogue.ptr_C = nullptr;
    epilogue.dC = nullptr;
    epilogue.ptr_D = w.d;
    epilogue.dD = w.sd;
    return typename Kernel::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                      {p.groups, w.shapes, nullptr},
                                      mainloop,
                                      epilogue,
                                      hw};
  }

  // Kernel parameters per (workspace, groups, device, SM count, the dispatch's waits): everything else reaches the
  // kernel through the groups' arrays.
  using Cache = ParamsCache<Kernel, 11>;

  static cudaError_t run(GroupedProblem const& p, cudaStream_t stream, size_t* workspace_bytes) {
    if (p.groups <= 0) return cudaErrorInvalidValue;
    if (workspace_bytes != nullptr) {
      W w = W::in(nullptr, p.groups);
      *workspace_bytes = W::bytes(p.groups) + Device::get_workspace_size(arguments(p, w));
      return cudaSuccess;
    }
    if (p.workspace == nullptr || p.offs == nullptr) return cudaErrorInvalidValue;
    W w = W::in(p.workspace, p.groups);
    static Cache cache;
    auto i = [](const void* x) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(x)); };
    auto const& y = p.sync;
    typename Cache::Key key{i(p.workspace), p.groups, p.device, p.sm_count, i(p.offs), i(y.flags), y.block_rows,
                            i(y.epoch), i(y.err), y.rank, y.timeout_ns};
    typename Kernel::Params params;
    cudaError_t made = cache.get(key, params, [&](typename Kernel::Params& out) {
      auto args = arguments(p, w);
      if (Kernel::can_implement(args) != true) return cudaErrorInvalidValue;
      if (Kernel::initialize_workspace(args, w.rest, stream) != cutlass::Status::kSuccess) {
        return cudaErrorInvalidValue;
      }
      out = Kernel::to_underlying_arguments(args, w.rest);
      return cudaSuccess;
    });
    if (made != cudaSuccess) return made;
    prepare_groups<BKMajor, W, Element><<<(p.groups + 127) / 128, 128, 0, stream>>>(p, w);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
    if (Device::run(params, stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }
};

template <int TM, int TN, int TK, int CM, int CN, int Sched>
cudaError_t run_variant(GroupedProblem const& p, cudaStream_t stream, size_t* workspace_bytes) {
  return p.b_kmajor ? Grouped<true, TM, TN, TK, CM, CN, Sched>::run(p, stream, workspace_bytes)
                    : Grouped<false, TM, TN, TK, CM, CN, Sched>::run(p, stream, workspace_bytes);
}

}  // namespace fluxcompile::grouped

// Defines `fluxcompile::cutlass_grouped_<name>` (declared for the registry in cutlass_grouped_registry.cpp).
#define GROUPED_VARIANT(name, TM, TN, TK, CM, CN, SCHED)                                                     \
  namespace fluxcompile {                                                                                  \
  cudaError_t cutlass_grouped_##name(const GroupedProblem& p, cudaStream_t s, size_t* w) {                \
    return grouped::run_variant<TM, TN, TK, CM, CN, SCHED>(p, s, w);                                      \
  }                                                                                                        \
  }
