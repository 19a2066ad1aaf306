// The Flux-style GEMM (see flux_gemm.h) as a composition of CUTLASS 3.x Hopper pieces: the collective builders'
// TMA warp-specialized mainloop and epilogue, each wrapped to add the cross-rank part, under CUTLASS's own
// persistent or stream-K tile scheduler.
//   WaitingMainloop:    the producer warp rotates a tile's coordinate and waits for the chunks holding its rows
//                       before the tile's first TMA load.
//   SignallingEpilogue: the consumers rotate the coordinate the same way; once a tile's TMA stores have
//                       completed (checked when the next tile's epilogue starts, or at the kernel's end), the
//                       storing warp adds 1 to the counter of each chunk the tile overlaps.
// The host side caches each problem's kernel parameters (TMA descriptors included): a repeated call only launches.
// Each variant file (flux_gemm_<variant>.cu) instantiates one tile configuration with FLUX_GEMM_VARIANT.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <array>
#include <mutex>
#include <unordered_map>

#include "bounded_wait.cuh"
#include "flux_gemm.h"

namespace fluxcompile::flux {

using namespace cute;

// --- device helpers -------------------------------------------------------------------------------------

CUTLASS_DEVICE unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Tile index `idx` of `tiles` along an axis, rotated to start at the tile of element `elems` (tiles past the
// last, padding of a cluster, stay where they are).
CUTLASS_DEVICE int rotated(int idx, int tiles, int tile, int elems) {
  if (idx >= tiles || tiles <= 0) return idx;
  int shift = (elems / tile) % tiles;
  int r = idx + shift;
  return r >= tiles ? r - tiles : r;
}

// Bounded wait (bounded_wait.cuh) of a whole warp (every lane polls, so every lane's later reads are ordered after
// its acquire) until *flag != 0. False when it timed out or another wait already had; the first timeout fills err
// (from lane 0; err may be null) with value 1 and kind 1 (chunk arrival).
CUTLASS_DEVICE bool wait_flag(const unsigned* flag, FluxGemmSync const& s, int peer, int chunk) {
  unsigned long long t0 = 0;
  for (unsigned iter = 0;; ++iter) {
    if (ld_acquire_sys(flag) != 0) return true;
    if (bounded_wait_gives_up<true>(iter, t0, s, (threadIdx.x & 31) == 0, peer, chunk, 1, 1)) return false;
  }
}

// The chunks of rows [lo, hi) of the gathered operand, awaited in order.
CUTLASS_DEVICE void wait_rows(FluxGemmSync const& s, int lo, int hi) {
  if (s.wait_flags == nullptr || hi <= lo) return;
  int r0 = lo / s.rows_per_rank, r1 = (hi - 1) / s.rows_per_rank;
  for (int r = r0; r <= r1; ++r) {
    if (r == s.skip_rank) continue;
    int base = r * s.rows_per_rank;
    int c0 = r == r0 ? (lo - base) / s.chunk_rows : 0;
    int c1 = r == r1 ? (hi - 1 - base) / s.chunk_rows : s.chunks_per_rank - 1;
    for (int c = c0; c <= c1; ++c) {
      if (!wait_flag(s.wait_flags + r * s.chunks_per_rank + c, s, r, c)) return;
    }
  }
  // The chunk's bytes were written by another agent (copy engine, peer); TMA reads them through the async proxy.
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// --- the mainloop: rotate, wait, then CUTLASS's TMA loads -----------------------------------------------

template <class Base>
struct WaitingMainloop : Base {
  struct Arguments : Base::Arguments {
    FluxGemmSync sync;
  };
  struct Params : Base::Params {
    FluxGemmSync sync;
    int m, n;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.sync = args.sync;
    auto mnkl = append<4>(problem_shape, 1);
    p.m = int(get<0>(mnkl));
    p.n = int(get<1>(mnkl));
    return p;
  }

  template <class Pipeline, class PipelineState, class LoadInputs, class BlockCoord, class... Rest>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipelineState state, LoadInputs const& inputs,
                           BlockCoord const& blk_coord, Rest&&... rest) {
    constexpr int TM = size<0>(typename Base::TileShape{});
    constexpr int TN = size<1>(typename Base::TileShape{});
    FluxGemmSync const& s = params.sync;
    int m = get<0>(blk_coord), n = get<1>(blk_coord);
    if (s.rotate_axis == 0) {
      m = rotated(m, (params.m + TM - 1) / TM, TM, s.rotate_elems);
    } else {
      n = rotated(n, (params.n + TN - 1) / TN, TN, s.rotate_elems);
    }
    wait_rows(s, m * TM, min(params.m, (m + 1) * TM));
    Base::load(params, pipeline, state, inputs, make_coord(m, n, get<2>(blk_coord), get<3>(blk_coord)),
               static_cast<Rest&&>(rest)...);
  }
};

// --- the epilogue: rotate, store with CUTLASS's TMA epilogue, count completed tiles ----------------------

template <class Base>
struct SignallingEpilogue : Base {
  struct Arguments : Base::Arguments {
    FluxGemmSync sync;
  };
  struct Params : Base::Params {
    FluxGemmSync sync;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.sync = args.sync;
    return p;
  }

  CUTLASS_HOST_DEVICE SignallingEpilogue(Params const& params, typename Base::TensorStorage& storage)
      : Base(params, storage), sync_(params.sync) {}

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemMNKL,
            class TileMNK, class TileCoord, class... Rest>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemMNKL problem, TileMNK tile_shape, TileCoord coord,
                            Rest&&... rest) {
    constexpr int TM = size<0>(TileMNK{});
    constexpr int TN = size<1>(TileMNK{});
    int M = int(get<0>(problem)), N = int(get<1>(problem));
    int m = get<0>(coord), n = get<1>(coord);
    if (sync_.rotate_axis == 0) {
      m = rotated(m, (M + TM - 1) / TM, TM, sync_.rotate_elems);
    } else {
      n = rotated(n, (N + TN - 1) / TN, TN, sync_.rotate_elems);
    }
    flush();
    auto result = Base::store(load_pipeline, load_state, store_pipeline, store_state, problem, tile_shape,
                              make_coord(m, n, get<2>(coord), get<3>(coord)), static_cast<Rest&&>(rest)...);
    if (sync_.signal_counters != nullptr && m * TM < M && n * TN < N) {
      // Rows or columns [lo, hi) of this tile along the signal axis, counted once its stores have landed (a
      // cluster's padding tiles past the problem store nothing and count nothing).
      int extent = sync_.signal_axis == 0 ? M : N;
      int lo = sync_.signal_axis == 0 ? m * TM : n * TN;
      int hi = min(extent, lo + (sync_.signal_axis == 0 ? TM : TN));
      pending_lo_ = lo;
      pending_hi_ = hi;
      storer_ = first_warp(rest...);
    }
    return result;
  }

  template <class... Ts>
  CUTLASS_DEVICE auto store_tail(Ts&&... ts) {
    auto result = Base::store_tail(static_cast<Ts&&>(ts)...);
    flush();
    return result;
  }

 private:
  // store()'s trailing arguments are (accumulators, tiled_mma, thread_idx, shared_tensors[, subtile]); CUTLASS's
  // TMA epilogue issues the tile's stores from the warp with thread_idx / 32 == 0.
  template <class Acc, class Mma, class... Tail>
  CUTLASS_DEVICE static bool first_warp(Acc const&, Mma const&, int thread_idx, Tail const&...) {
    return thread_idx / 32 == 0;
  }

  // The previous tile's counters: its storing warp waits for its bulk stores to complete, then one lane fences
  // and adds.
  CUTLASS_DEVICE void flush() {
    if (pending_hi_ <= pending_lo_) return;
    if (storer_) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      __syncwarp();
      if ((threadIdx.x & 31) == 0) {
        // The counters' waiter is this GPU's front end (a stream wait before a copy-engine push): a GPU-scope
        // release orders the tile's bytes before the count.
        asm volatile("fence.proxy.async.global;" ::: "memory");
        int c0 = pending_lo_ / sync_.signal_elems, c1 = (pending_hi_ - 1) / sync_.signal_elems;
        for (int c = c0; c <= c1; ++c) {
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync_.signal_counters + c) : "memory");
        }
      }
    }
    pending_lo_ = pending_hi_ = 0;
  }

  FluxGemmSync sync_;
  int pending_lo_ = 0, pending_hi_ = 0;
  bool storer_ = false;
};

// --- one tile configuration ---------------------------------------------------------------------------

// Schedules: a tile computed by two consumer warp groups (cooperative) under the persistent data-parallel or the
// stream-K scheduler, or by one while the other runs its epilogue (ping-pong).
enum Schedule { kCoop = 0, kPingpong = 1, kCoopStreamK = 2 };

template <class Element, bool BKMajor, int TM, int TN, int TK, int CM, int CN, int Sched>
struct Gemm {
  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  static constexpr bool Coop = Sched != kPingpong;
  static constexpr bool StreamK = Sched == kCoopStreamK;
  using KernelSchedule = cute::conditional_t<Coop, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                             cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpilogueSchedule = cute::conditional_t<Coop, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                               cutlass::epilogue::TmaWarpSpecialized>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cute::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int Align = 16 / sizeof(Element);

  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, void, float>;
  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, Align, Element, LayoutD, Align,
      EpilogueSchedule, Fusion>::CollectiveOp;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, Align, Element, LayoutB, Align, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename BaseEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Scheduler = cute::conditional_t<StreamK, cutlass::gemm::StreamKScheduler, cutlass::gemm::PersistentScheduler>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, WaitingMainloop<BaseMainloop>,
                                                      SignallingEpilogue<BaseEpilogue>, Scheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Kernel::Arguments arguments(FluxGemmProblem const& p) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    StrideA sa{};
    get<0>(sa) = p.lda;
    get<2>(sa) = int64_t(p.m) * p.lda;
    StrideB sb{};
    if constexpr (BKMajor) {
      get<0>(sb) = p.ldb;  // b[k, j] at j * ldb + k: (N, K) with K contiguous
    } else {
      get<1>(sb) = p.ldb;  // b[k, j] at k * ldb + j: (N, K) with N contiguous
    }
    get<2>(sb) = int64_t(p.k) * p.ldb;
    StrideD sd{};
    get<0>(sd) = p.ldd;
    get<2>(sd) = int64_t(p.m) * p.ldd;

    typename Kernel::MainloopArguments mainloop{};
    mainloop.ptr_A = static_cast<Element const*>(p.a);
    mainloop.dA = sa;
    mainloop.ptr_B = static_cast<Element const*>(p.b);
    mainloop.dB = sb;
    mainloop.sync = p.sync;

    typename Kernel::EpilogueArguments epilogue{};
    epilogue.thread.alpha = 1.0f;
    epilogue.thread.beta = 0.0f;
    epilogue.thread.bias_ptr = static_cast<Element const*>(p.bias);
    epilogue.ptr_C = nullptr;
    epilogue.ptr_D = static_cast<Element*>(p.d);
    epilogue.dD = sd;
    epilogue.sync = p.sync;

    cutlass::KernelHardwareInfo hw;
    hw.device_id = p.device;
    hw.sm_count = p.sm_count > 0 ? p.sm_count
                                 : cutlass::KernelHardwareInfo::query_device_multiprocessor_count(p.device);

    typename Kernel::TileSchedulerArguments sched{};
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    sched.raster_order = p.raster == 1 ? Raster::AlongM : p.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    sched.max_swizzle_size = p.swizzle;

    return typename Kernel::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {p.m, p.n, p.k, 1}, mainloop,
                                      epilogue, hw, sched};
  }

  // Kernel parameters per problem (every field of it, pointers included), made once: a repeated call (steady
  // state, CUDA-graph capture) skips the TMA descriptor encoding and the attribute call.
  using Key = std::array<int64_t, 30>;
  static Key key_of(FluxGemmProblem const& p) {
    auto i = [](const void* x) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(x)); };
    auto const& s = p.sync;
    return Key{i(p.a), i(p.b), i(p.d), i(p.bias), p.m, p.n, p.k, p.lda, p.ldb, p.ldd, p.b_kmajor, p.dtype,
               p.sm_count, p.raster, p.swizzle, p.device, i(p.workspace), s.rotate_axis, s.rotate_elems,
               i(s.wait_flags), s.rows_per_rank, s.chunk_rows, s.chunks_per_rank, s.skip_rank,
               i(s.signal_counters), s.signal_axis, s.signal_elems, i(s.err), s.rank, s.timeout_ns};
  }
  struct KeyHash {
    size_t operator()(Key const& k) const {
      size_t h = 1469598103934665603ull;
      for (int64_t v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
      return h;
    }
  };

  static cudaError_t run(FluxGemmProblem const& p, cudaStream_t stream, size_t* workspace_bytes) {
    static std::mutex mutex;
    static std::unordered_map<Key, typename Kernel::Params, KeyHash> cache;
    static bool attribute_set = false;
    if (workspace_bytes != nullptr) {
      *workspace_bytes = Device::get_workspace_size(arguments(p));
      return cudaSuccess;
    }
    Key key = key_of(p);
    typename Kernel::Params params;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = cache.find(key);
      if (it == cache.end()) {
        auto args = arguments(p);
        if (Kernel::can_implement(args) != true) return cudaErrorInvalidValue;
        if (!attribute_set) {
          int smem = Kernel::SharedStorageSize;
          if (smem >= (48 << 10)) {
            cudaError_t rc = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            if (rc != cudaSuccess) return rc;
          }
          attribute_set = true;
        }
        if (cache.size() >= 4096) cache.clear();
        it = cache.emplace(key, Kernel::to_underlying_arguments(args, p.workspace)).first;
      }
      params = it->second;
    }
    if constexpr (StreamK) {
      // Stream-K's tile locks start from zero every call (a memset on the stream, captured with it).
      if (Kernel::initialize_workspace(arguments(p), p.workspace, stream) != cutlass::Status::kSuccess) {
        return cudaErrorInvalidValue;
      }
    }
    if (Device::run(params, stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }
};

template <int TM, int TN, int TK, int CM, int CN, int Sched>
cudaError_t run_variant(FluxGemmProblem const& p, cudaStream_t stream, size_t* workspace_bytes) {
  if (p.dtype == 0) {
    return p.b_kmajor ? Gemm<cutlass::bfloat16_t, true, TM, TN, TK, CM, CN, Sched>::run(p, stream, workspace_bytes)
                      : Gemm<cutlass::bfloat16_t, false, TM, TN, TK, CM, CN, Sched>::run(p, stream, workspace_bytes);
  }
  return p.b_kmajor ? Gemm<cutlass::half_t, true, TM, TN, TK, CM, CN, Sched>::run(p, stream, workspace_bytes)
                    : Gemm<cutlass::half_t, false, TM, TN, TK, CM, CN, Sched>::run(p, stream, workspace_bytes);
}

}  // namespace fluxcompile::flux

// Defines `fluxcompile::flux_gemm_<name>` (declared for the registry in flux_gemm_variants.cpp).
#define FLUX_GEMM_VARIANT(name, TM, TN, TK, CM, CN, SCHED)                                                   \
  namespace fluxcompile {                                                                                  \
  cudaError_t flux_gemm_##name(const FluxGemmProblem& p, cudaStream_t s, size_t* w) {                     \
    return flux::run_variant<TM, TN, TK, CM, CN, SCHED>(p, s, w);                                          \
  }                                                                                                        \
  }
