// The Flux-style GEMM (see flux_gemm.h) as a composition of CUTLASS 3.x Hopper pieces: the collective builders'
// TMA warp-specialized mainloop and epilogue, each wrapped to add the cross-rank part, under CUTLASS's own
// persistent or stream-K tile scheduler.
//   WaitingMainloop:    the producer warp rotates a tile's coordinate and waits for the chunks holding its rows
//                       before the tile's first TMA load.
//   SignallingEpilogue: the consumers rotate the coordinate the same way; once a tile's TMA stores have
//                       completed (checked when the next tile's epilogue starts, or at the kernel's end), the
//                       storing warp adds 1 to the counter of each chunk the tile overlaps.
//   RingEpilogue:       the same with a source (the reduce-scatter ring): the epilogue's producer waits for the
//                       sub-chunks of the running sums a tile adds before loading them; the first step's tiles
//                       add zeros, the last step's (our own chunk) store into the output.
//   EpilogueFusion:     the epilogue's arithmetic: alpha and bias (16-bit operands), or fp8's scales as epilogue
//                       visitors (tensor-wise scalars, row-wise row and column vectors) into bf16.
// The host side caches each problem's kernel parameters (TMA descriptors included): a repeated call only launches.
// Each variant file (flux_gemm_<variant>.cu) instantiates one tile configuration with FLUX_GEMM_VARIANT.
#pragma once

#include <cuda.h>
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
#include <cstring>

#include "bounded_wait.cuh"
#include "cutlass_params.cuh"
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

// The tile (m, n) that the scheduler's tile (m, n) stands for, of tiles_m x tiles_n (FluxGemmSync's tile order:
// rotated along one axis, or grouped with an M rotation). The mainloop and the epilogue map alike.
CUTLASS_DEVICE void tile_order(FluxGemmSync const& s, int tiles_m, int tiles_n, int tile_m, int tile_n, int& m,
                               int& n) {
  if (s.group_m <= 0) {
    if (s.rotate_axis == 0) {
      m = rotated(m, tiles_m, tile_m, s.rotate_elems);
    } else {
      n = rotated(n, tiles_n, tile_n, s.rotate_elems);
    }
    return;
  }
  // Clusters of cluster_m x cluster_n tiles; the scheduler (along N, no swizzle) hands out cluster mb * nb_count + nb.
  const int cm = s.cluster_m, cn = s.cluster_n;
  const int mb_count = (tiles_m + cm - 1) / cm, nb_count = (tiles_n + cn - 1) / cn;
  const int mb = m / cm, nb = n / cn;
  if (mb >= mb_count || nb >= nb_count) return;  // a cluster's padding past the grid stays where it is
  const int group = cute::max(1, s.group_m / cm);  // rows of clusters per group
  const int linear = mb * nb_count + nb;
  const int first = (linear / (group * nb_count)) * group;
  const int size = cute::min(group, mb_count - first);
  const int within = linear % (group * nb_count);
  int mb2 = first + within % size;
  const int nb2 = within / size;
  mb2 = (mb2 + (s.rotate_elems / tile_m) / cm) % mb_count;
  m = mb2 * cm + m % cm;
  n = nb2 * cn + n % cn;
}

// Bounded wait (bounded_wait.cuh) of a whole warp (every lane polls, so every lane's later reads are ordered after
// its acquire) until *flag != 0. False when it timed out or another wait already had; the first timeout fills err
// (from lane 0; err may be null) with value 1 and kind 1 (chunk arrival).
CUTLASS_DEVICE bool wait_flag(const unsigned* flag, FluxGemmSync const& s, int peer, int chunk, int kind = 1) {
  unsigned long long t0 = 0;
  for (unsigned iter = 0;; ++iter) {
    if (ld_acquire_sys(flag) != 0) return true;
    if (bounded_wait_gives_up<true>(iter, t0, s, (threadIdx.x & 31) == 0, peer, chunk, 1, kind)) return false;
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

// --- host helpers -----------------------------------------------------------------------------------------

// Points a TMA descriptor at another global address (the driver's cuTensorMapReplaceAddress; `address` is
// 16-byte aligned, the rest of the descriptor unchanged).
inline cudaError_t replace_address(TmaDescriptor const* desc, void const* address) {
  using Fn = CUresult (*)(CUtensorMap*, void*);
  static Fn fn = [] {
    void* pfn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapReplaceAddress", &pfn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      pfn = nullptr;
    }
    return reinterpret_cast<Fn>(pfn);
  }();
  if (fn == nullptr) return cudaErrorNotSupported;
  return fn(const_cast<CUtensorMap*>(reinterpret_cast<CUtensorMap const*>(desc)), const_cast<void*>(address)) ==
                 CUDA_SUCCESS
             ? cudaSuccess
             : cudaErrorInvalidValue;
}

// --- the mainloop: rotate, wait, then CUTLASS's TMA loads -----------------------------------------------

// With sync.local_a set, the m-tiles of our rows load through a second set of CUTLASS's mainloop parameters
// (`local`: the TMA descriptor of our shard, where the caller keeps it), every other tile through the first (the
// gathered operand's buffer). The local descriptor's address is replaced per call (Gemm::run), so the parameter
// cache does not grow with the caller's pointers.
template <class Base>
struct WaitingMainloop : Base {
  struct Arguments : Base::Arguments {
    FluxGemmSync sync;
  };
  struct Params : Base::Params {
    FluxGemmSync sync;
    int m, n;
    typename Base::Params local;
    int local_tile0 = 0, local_tiles = 0;  // m-tiles [local_tile0, local_tile0 + local_tiles) load from `local`
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    constexpr int TM = size<0>(typename Base::TileShape{});
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.sync = args.sync;
    auto mnkl = append<4>(problem_shape, 1);
    p.m = int(get<0>(mnkl));
    p.n = int(get<1>(mnkl));
    p.local = static_cast<typename Base::Params&>(p);
    if (args.sync.local_a != nullptr) {
      typename Base::Arguments local = args;
      local.ptr_A = static_cast<decltype(local.ptr_A)>(args.sync.local_a);
      get<0>(local.dA) = args.sync.local_lda;
      get<2>(local.dA) = int64_t(args.sync.rows_per_rank) * args.sync.local_lda;
      p.local = Base::to_underlying_arguments(
          make_shape(args.sync.rows_per_rank, int(get<1>(mnkl)), int(get<2>(mnkl)), 1), local, workspace);
      p.local_tile0 = args.sync.local_row0 / TM;
      p.local_tiles = args.sync.rows_per_rank / TM;
    }
    return p;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    if (params.local_tiles > 0) Base::prefetch_tma_descriptors(params.local);
  }

  // CUTLASS's (gA, gB) of the whole operand, then gA of our shard.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    constexpr int TM = size<0>(typename Base::TileShape{});
    auto whole = Base::load_init(problem_shape_MNKL, params);
    auto [M, N, K, L] = problem_shape_MNKL;
    auto ours = Base::load_init(make_shape(int(cute::max(params.local_tiles, 1) * TM), N, K, L), params.local);
    return cute::make_tuple(get<0>(whole), get<1>(whole), get<0>(ours));
  }

  template <class Pipeline, class PipelineState, class LoadInputs, class BlockCoord, class... Rest>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipelineState state, LoadInputs const& inputs,
                           BlockCoord const& blk_coord, Rest&&... rest) {
    constexpr int TM = size<0>(typename Base::TileShape{});
    constexpr int TN = size<1>(typename Base::TileShape{});
    FluxGemmSync const& s = params.sync;
    int m = get<0>(blk_coord), n = get<1>(blk_coord);
    tile_order(s, (params.m + TM - 1) / TM, (params.n + TN - 1) / TN, TM, TN, m, n);
    int ours = m - params.local_tile0;
    if (params.local_tiles > 0 && 0 <= ours && ours < params.local_tiles) {
      Base::load(params.local, pipeline, state, cute::make_tuple(get<2>(inputs), get<1>(inputs)),
                 make_coord(ours, n, get<2>(blk_coord), get<3>(blk_coord)), static_cast<Rest&&>(rest)...);
      return;
    }
    wait_rows(s, m * TM, min(params.m, (m + 1) * TM));
    Base::load(params, pipeline, state, cute::make_tuple(get<0>(inputs), get<1>(inputs)),
               make_coord(m, n, get<2>(blk_coord), get<3>(blk_coord)), static_cast<Rest&&>(rest)...);
  }
};

// --- the epilogue: rotate, store with CUTLASS's TMA epilogue, count completed tiles ----------------------

// store()'s trailing arguments are (accumulators, tiled_mma, thread_idx, shared_tensors[, subtile]); CUTLASS's TMA
// epilogue issues the tile's stores from the warp with thread_idx / 32 == 0.
template <class Acc, class Mma, class... Tail>
CUTLASS_DEVICE bool storing_warp(Acc const&, Mma const&, int thread_idx, Tail const&...) {
  return thread_idx / 32 == 0;
}

// The counts of the last stored tile, added once its stores have landed: note() records the tile's elements
// [lo, hi) along the signal axis, flush() (at the next tile's epilogue, or the kernel's end) makes its storing warp
// wait for its bulk stores to complete, then one lane fences and adds 1 on each counter the tile overlaps.
struct TileCounts {
  int lo = 0, hi = 0;
  bool storer = false;

  CUTLASS_DEVICE void note(int lo_, int hi_, bool storer_) {
    lo = lo_;
    hi = hi_;
    storer = storer_;
  }

  CUTLASS_DEVICE void flush(FluxGemmSync const& s) {
    if (hi <= lo) return;
    if (storer) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      __syncwarp();
      if ((threadIdx.x & 31) == 0) {
        // The counters' waiter is this GPU's front end (a stream wait before a copy-engine push): a GPU-scope
        // release orders the tile's bytes before the count.
        asm volatile("fence.proxy.async.global;" ::: "memory");
        int c0 = lo / s.signal_elems, c1 = (hi - 1) / s.signal_elems;
        for (int c = c0; c <= c1; ++c) {
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(s.signal_counters + c) : "memory");
        }
      }
    }
    lo = hi = 0;
  }
};

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
    tile_order(sync_, (M + TM - 1) / TM, (N + TN - 1) / TN, TM, TN, m, n);
    counts_.flush(sync_);
    auto result = Base::store(load_pipeline, load_state, store_pipeline, store_state, problem, tile_shape,
                              make_coord(m, n, get<2>(coord), get<3>(coord)), static_cast<Rest&&>(rest)...);
    if (sync_.signal_counters != nullptr && m * TM < M && n * TN < N) {
      // Rows or columns [lo, hi) of this tile along the signal axis, counted once its stores have landed (a
      // cluster's padding tiles past the problem store nothing and count nothing).
      int extent = sync_.signal_axis == 0 ? M : N;
      int lo = sync_.signal_axis == 0 ? m * TM : n * TN;
      counts_.note(lo, min(extent, lo + (sync_.signal_axis == 0 ? TM : TN)), storing_warp(rest...));
    }
    return result;
  }

  template <class... Ts>
  CUTLASS_DEVICE auto store_tail(Ts&&... ts) {
    auto result = Base::store_tail(static_cast<Ts&&>(ts)...);
    counts_.flush(sync_);
    return result;
  }

 private:
  FluxGemmSync sync_;
  TileCounts counts_;
};

// The reduce-scatter ring's epilogue (FluxGemmSync's ring fields): a source C of the whole problem's shape (the
// running sums that arrived from the next rank), plus two more sets of CUTLASS's epilogue parameters: `zero` (C
// from the zero rows or columns, for the first step's tiles) and `local` (D into the output, for our own chunk's
// tiles), each used through an epilogue object of its own over the same shared memory and pipelines.
// d = alpha * acc + c + bias, in fp32, rounded once into the element type: each step of the ring rounds once.
template <class Base, int TM, int TN>
struct RingEpilogue : Base {
  struct Arguments : Base::Arguments {
    FluxGemmSync sync;
  };
  struct Params : Base::Params {
    FluxGemmSync sync;
    typename Base::Params zero;
    typename Base::Params local;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    FluxGemmSync const& s = args.sync;
    p.sync = s;
    auto mnkl = append<4>(problem_shape, 1);
    const int M = int(get<0>(mnkl)), N = int(get<1>(mnkl)), K = int(get<2>(mnkl));
    const bool rows = s.signal_axis == 0;
    typename Base::Arguments z = args;  // C: the zeros, as [TM, N] or [M, TN]
    z.ptr_C = static_cast<decltype(z.ptr_C)>(s.zero);
    get<0>(z.dC) = s.ldz;
    p.zero = Base::to_underlying_arguments(rows ? make_shape(TM, N, K, 1) : make_shape(M, TN, K, 1), z, workspace);
    typename Base::Arguments o = args;  // D: our own chunk, into `out`
    o.ptr_D = static_cast<decltype(o.ptr_D)>(s.out);
    get<0>(o.dD) = s.ldo;
    if (!rows && o.thread.bias_ptr != nullptr) o.thread.bias_ptr += int64_t(s.own_chunk) * s.chunk_elems;
    p.local = Base::to_underlying_arguments(
        rows ? make_shape(s.chunk_elems, N, K, 1) : make_shape(M, s.chunk_elems, K, 1), o, workspace);
    return p;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    Base::prefetch_tma_descriptors(params.zero);
    Base::prefetch_tma_descriptors(params.local);
  }

  CUTLASS_HOST_DEVICE RingEpilogue(Params const& params, typename Base::TensorStorage& storage)
      : Base(params, storage), sync_(params.sync), zero_(params.zero, storage), local_(params.local, storage) {}

  // The epilogue's producer warp: C of the tile (rotated as the mainloop's), once its sub-chunks have arrived.
  template <class LoadPipeline, class LoadState, class ProblemMNKL, class TileMNK, class TileCoord, class... Rest>
  CUTLASS_DEVICE auto load(LoadPipeline load_pipeline, LoadState load_state, ProblemMNKL problem, TileMNK tile_shape,
                           TileCoord coord, Rest&&... rest) {
    const int M = int(get<0>(problem)), N = int(get<1>(problem));
    int m = get<0>(coord), n = get<1>(coord);
    tile_order(sync_, (M + TM - 1) / TM, (N + TN - 1) / TN, TM, TN, m, n);
    const bool rows = sync_.signal_axis == 0;
    const int extent = rows ? M : N;
    const int lo = rows ? m * TM : n * TN;
    if (lo < extent && lo / sync_.chunk_elems == sync_.zero_chunk) {
      return zero_.load(load_pipeline, load_state,
                        rows ? make_shape(TM, N, get<2>(problem), get<3>(problem))
                             : make_shape(M, TN, get<2>(problem), get<3>(problem)),
                        tile_shape, make_coord(rows ? 0 : m, rows ? n : 0, get<2>(coord), get<3>(coord)),
                        static_cast<Rest&&>(rest)...);
    }
    if (lo < extent && sync_.c_flags != nullptr) {
      const int hi = min(extent, lo + (rows ? TM : TN));
      for (int j = lo / sync_.c_elems; j <= (hi - 1) / sync_.c_elems; ++j) {
        if (!wait_flag(sync_.c_flags + j, sync_, sync_.c_peer, j, 2)) break;
      }
      // The sub-chunk's bytes were written by another agent (copy engine, peer); TMA reads them (async proxy).
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    return Base::load(load_pipeline, load_state, problem, tile_shape, make_coord(m, n, get<2>(coord), get<3>(coord)),
                      static_cast<Rest&&>(rest)...);
  }

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemMNKL,
            class TileMNK, class TileCoord, class... Rest>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemMNKL problem, TileMNK tile_shape, TileCoord coord,
                            Rest&&... rest) {
    const int M = int(get<0>(problem)), N = int(get<1>(problem));
    int m = get<0>(coord), n = get<1>(coord);
    tile_order(sync_, (M + TM - 1) / TM, (N + TN - 1) / TN, TM, TN, m, n);
    counts_.flush(sync_);
    const bool rows = sync_.signal_axis == 0;
    const int extent = rows ? M : N;
    const int lo = rows ? m * TM : n * TN;
    const bool inside = lo < extent && (rows ? n * TN < N : m * TM < M);
    const bool own = inside && lo / sync_.chunk_elems == sync_.own_chunk;
    if (own != local_stores_) {
      // CUTLASS's epilogue counts the stores it issued (when to release the source's shared-memory stages) in
      // the object that issued them: before storing through the other object, the stores so far, if any, are
      // drained (store_tail: waits for them, releases the stages they hold). Our own chunk's tiles come last in
      // every CTA (the scheduler's raster runs along the other axis), so this happens at most once per CTA.
      if (stored_) {
        auto states = local_stores_ ? local_.store_tail(load_pipeline, load_state, store_pipeline, store_state)
                                    : Base::store_tail(load_pipeline, load_state, store_pipeline, store_state);
        load_state = get<0>(states);
        store_state = get<1>(states);
      }
      local_stores_ = own;
    }
    stored_ = true;
    if (own) {  // our own chunk: into the output, not counted
      const int tiles0 = sync_.own_chunk * sync_.chunk_elems / (rows ? TM : TN);
      return local_.store(load_pipeline, load_state, store_pipeline, store_state,
                          rows ? make_shape(sync_.chunk_elems, N, get<2>(problem), get<3>(problem))
                               : make_shape(M, sync_.chunk_elems, get<2>(problem), get<3>(problem)),
                          tile_shape,
                          make_coord(rows ? m - tiles0 : m, rows ? n : n - tiles0, get<2>(coord), get<3>(coord)),
                          static_cast<Rest&&>(rest)...);
    }
    auto result = Base::store(load_pipeline, load_state, store_pipeline, store_state, problem, tile_shape,
                              make_coord(m, n, get<2>(coord), get<3>(coord)), static_cast<Rest&&>(rest)...);
    if (sync_.signal_counters != nullptr && inside) {
      counts_.note(lo, min(extent, lo + (rows ? TM : TN)), storing_warp(rest...));
    }
    return result;
  }

  template <class... Ts>
  CUTLASS_DEVICE auto store_tail(Ts&&... ts) {
    auto result = local_stores_ ? local_.store_tail(static_cast<Ts&&>(ts)...) : Base::store_tail(static_cast<Ts&&>(ts)...);
    counts_.flush(sync_);
    return result;
  }

 private:
  FluxGemmSync sync_;
  Base zero_, local_;
  TileCounts counts_;
  bool local_stores_ = false;  // the stores since the last drain go through `local_`
  bool stored_ = false;        // a tile was stored since the kernel's start (store_tail releases its stages)
};

// --- one tile configuration ---------------------------------------------------------------------------

// Schedules: a tile computed by two consumer warp groups (cooperative) under the persistent data-parallel or the
// stream-K scheduler, or by one while the other runs its epilogue (ping-pong).
enum Schedule { kCoop = 0, kPingpong = 1, kCoopStreamK = 2 };

// Scalings (FluxGemmProblem::scale_mode): 16-bit operands unscaled, or e4m3 operands with tensor-wise or row-wise
// scales.
enum Scaling { kUnscaled = 0, kTensorwise = 1, kRowwise = 2 };

namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// The epilogue's arithmetic, in fp32, rounded once into ElementD:
//   unscaled:    alpha * acc (+ c) + bias[n]
//   tensor-wise: (scale_a * scale_b) * acc + bias[n]       (the two scalars multiplied, as _scaled_mm's alpha)
//   row-wise:    scale_a[m] * (scale_b[n] * acc) + bias[n]
// A null bias adds zeros (the broadcasts' null default).
template <int Scale, class ElementD, class ElementC, class TileShape>
struct EpilogueFusion {
  using Op = fusion::LinCombPerColBias<ElementD, float, ElementD, ElementC, float>;
};
template <class ElementD, class ElementC, class TileShape>
struct EpilogueFusion<kTensorwise, ElementD, ElementC, TileShape> {
  using Scales = fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, _0>, 2>;
  using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementD, float>;
  using Op = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>, Scales,
                             fusion::Sm90AccFetch, Bias>;
};
template <class ElementD, class ElementC, class TileShape>
struct EpilogueFusion<kRowwise, ElementD, ElementC, TileShape> {
  using RowScales = fusion::Sm90ColBroadcast<0, TileShape, float, float>;  // one per row of the tile
  using ColScales = fusion::Sm90RowBroadcast<0, TileShape, float, float>;  // one per column
  using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementD, float>;
  using Op = fusion::Sm90EVT<
      fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>, RowScales,
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, ColScales, fusion::Sm90AccFetch>,
      Bias>;
};

// The mainloop's schedule: fp8 with fast accumulation takes CUTLASS's FP8FastAccum schedules; fp8 without it the
// plain ones, for which the builder picks CUTLASS's fp8 mainloop (fp32 promotion every mma_promotion_interval).
template <bool Coop, bool FastAccum>
using MainloopSchedule = cute::conditional_t<
    Coop,
    cute::conditional_t<FastAccum, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                        cutlass::gemm::KernelTmaWarpSpecializedCooperative>,
    cute::conditional_t<FastAccum, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                        cutlass::gemm::KernelTmaWarpSpecializedPingpong>>;

// Ring: built with a source C and the ring's epilogue (RingEpilogue), for the reduce-scatter ring. Scale (Scaling):
// Element is e4m3 and the output bf16 where it is not kUnscaled; FastAccum: fp8's fast accumulation.
template <class Element, bool BKMajor, int TM, int TN, int TK, int CM, int CN, int Sched, bool Ring = false,
          int Scale = kUnscaled, bool FastAccum = false>
struct Gemm {
  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  static constexpr bool Coop = Sched != kPingpong;
  static constexpr bool StreamK = Sched == kCoopStreamK;
  static_assert(!Ring || Sched == kCoop, "the ring's epilogue drains mid-kernel: the cooperative data-parallel schedule only");
  static_assert(!Ring || Scale == kUnscaled, "the ring is built for 16-bit operands");
  static_assert(Scale == kUnscaled || BKMajor, "fp8 operands are K-major (Hopper's fp8 warpgroup MMA)");
  using KernelSchedule = MainloopSchedule<Coop, FastAccum>;
  using EpilogueSchedule = cute::conditional_t<Coop, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                               cutlass::epilogue::TmaWarpSpecialized>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cute::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  using ElementD = cute::conditional_t<Scale == kUnscaled, Element, cutlass::bfloat16_t>;
  static constexpr int Align = 16 / sizeof(Element);
  static constexpr int AlignD = 16 / sizeof(ElementD);

  using ElementC = cute::conditional_t<Ring, Element, void>;
  using Fusion = typename EpilogueFusion<Scale, ElementD, ElementC, TileShape>::Op;
  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD, AlignD, ElementD, LayoutD,
      AlignD, EpilogueSchedule, Fusion>::CollectiveOp;
  using Epilogue = cute::conditional_t<Ring, RingEpilogue<BaseEpilogue, TM, TN>, SignallingEpilogue<BaseEpilogue>>;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, Align, Element, LayoutB, Align, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename BaseEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Scheduler = cute::conditional_t<StreamK, cutlass::gemm::StreamKScheduler, cutlass::gemm::PersistentScheduler>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, WaitingMainloop<BaseMainloop>,
                                                      Epilogue, Scheduler>;
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
    FluxGemmSync sync = p.sync;  // with the cluster shape the grouped tile order maps by
    sync.cluster_m = CM;
    sync.cluster_n = CN;
    mainloop.sync = sync;

    typename Kernel::EpilogueArguments epilogue{};
    auto const* bias = static_cast<ElementD const*>(p.bias);
    if constexpr (Scale == kUnscaled) {
      epilogue.thread.alpha = p.alpha;
      epilogue.thread.beta = Ring ? 1.0f : 0.0f;
      epilogue.thread.bias_ptr = bias;
    } else if constexpr (Scale == kTensorwise) {
      typename EpilogueFusion<Scale, ElementD, ElementC, TileShape>::Scales::Arguments scales{};
      scales.scalar_ptrs[0] = p.scale_a;
      scales.scalar_ptrs[1] = p.scale_b;
      epilogue.thread = {scales, {}, {bias}, {}};
    } else {
      epilogue.thread = {{p.scale_a}, {{p.scale_b}, {}, {}}, {bias}, {}};
    }
    epilogue.ptr_C = nullptr;
    if constexpr (Ring) {
      epilogue.ptr_C = static_cast<Element const*>(p.c);
      typename Kernel::StrideC sc{};
      get<0>(sc) = p.ldc;
      get<2>(sc) = int64_t(p.m) * p.ldc;
      epilogue.dC = sc;
    }
    epilogue.ptr_D = static_cast<ElementD*>(p.d);
    epilogue.dD = sd;
    epilogue.sync = sync;

    cutlass::KernelHardwareInfo hw;
    hw.device_id = p.device;
    hw.sm_count = p.sm_count > 0 ? p.sm_count
                                 : cutlass::KernelHardwareInfo::query_device_multiprocessor_count(p.device);

    typename Kernel::TileSchedulerArguments sched{};
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    sched.raster_order = p.raster == 1 ? Raster::AlongM : p.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    sched.max_swizzle_size = p.swizzle;
    if (p.sync.group_m > 0) {  // the grouped tile order maps the scheduler's order along N, unswizzled
      sched.raster_order = Raster::AlongN;
      sched.max_swizzle_size = 1;
    }

    return typename Kernel::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {p.m, p.n, p.k, 1}, mainloop,
                                      epilogue, hw, sched};
  }

  // Kernel parameters per problem (every field of it, pointers included but our shard's and the ring's output),
  // made once (ParamsCache); our shard's and the output's descriptors only get their addresses replaced.
  using Key = std::array<int64_t, 50>;
  static Key key_of(FluxGemmProblem const& p) {
    auto i = [](const void* x) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(x)); };
    auto const& s = p.sync;
    int32_t alpha_bits = 0;
    std::memcpy(&alpha_bits, &p.alpha, sizeof(alpha_bits));
    return Key{i(p.a), i(p.b), i(p.d), i(p.bias), p.m, p.n, p.k, p.lda, p.ldb, p.ldd, p.b_kmajor, p.dtype,
               p.sm_count, p.raster, p.swizzle, p.device, i(p.workspace), s.rotate_axis, s.rotate_elems,
               i(s.wait_flags), s.rows_per_rank, s.chunk_rows, s.chunks_per_rank, s.skip_rank,
               i(s.signal_counters), s.signal_axis, s.signal_elems, i(s.err), s.rank, s.timeout_ns,
               s.local_a != nullptr ? s.local_lda : -1, s.local_row0, s.group_m, i(p.c), p.ldc, alpha_bits,
               i(s.c_flags), s.c_elems, s.c_peer, s.chunk_elems, s.zero_chunk, s.own_chunk, i(s.zero), s.ldz,
               s.out != nullptr ? s.ldo : -1, i(p.scale_a), i(p.scale_b), p.scale_mode, p.fast_accum};
  }
  static cudaError_t run(FluxGemmProblem const& p, cudaStream_t stream, size_t* workspace_bytes) {
    static ParamsCache<Kernel, std::tuple_size<Key>::value> cache;
    if (workspace_bytes != nullptr) {
      *workspace_bytes = Device::get_workspace_size(arguments(p));
      return cudaSuccess;
    }
    typename Kernel::Params params;
    cudaError_t made = cache.get(key_of(p), params, [&](typename Kernel::Params& out) {
      auto args = arguments(p);
      if (Kernel::can_implement(args) != true) return cudaErrorInvalidValue;
      out = Kernel::to_underlying_arguments(args, p.workspace);
      return cudaSuccess;
    });
    if (made != cudaSuccess) return made;
    if (p.sync.local_a != nullptr) {
      cudaError_t rc = replace_address(params.mainloop.local.tma_load_a.get_tma_descriptor(), p.sync.local_a);
      if (rc != cudaSuccess) return rc;
    }
    if constexpr (Ring) {
      cudaError_t rc = replace_address(params.epilogue.local.tma_store_d.get_tma_descriptor(), p.sync.out);
      if (rc != cudaSuccess) return rc;
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

template <int TM, int TN, int TK, int CM, int CN, int Sched, bool Ring = false>
cudaError_t run_variant(FluxGemmProblem const& p, cudaStream_t stream, size_t* workspace_bytes) {
  if (Ring != (p.c != nullptr)) return cudaErrorInvalidValue;  // a source needs the ring's build, and only it
  if (p.dtype != 0 && p.dtype != 1) return cudaErrorInvalidValue;  // fp8: the fp8 variants
  if (p.dtype == 0) {
    return p.b_kmajor
               ? Gemm<cutlass::bfloat16_t, true, TM, TN, TK, CM, CN, Sched, Ring>::run(p, stream, workspace_bytes)
               : Gemm<cutlass::bfloat16_t, false, TM, TN, TK, CM, CN, Sched, Ring>::run(p, stream, workspace_bytes);
  }
  return p.b_kmajor ? Gemm<cutlass::half_t, true, TM, TN, TK, CM, CN, Sched, Ring>::run(p, stream, workspace_bytes)
                    : Gemm<cutlass::half_t, false, TM, TN, TK, CM, CN, Sched, Ring>::run(p, stream, workspace_bytes);
}

// One scale mode of an fp8 variant, with or without fast accumulation (a translation unit of its own each, so the
// variant's four kernels build in parallel).
template <int TM, int TN, int TK, int CM, int CN, int Sched, int Scale, bool FastAccum>
cudaError_t run_fp8_part(FluxGemmProblem const& p, cudaStream_t stream, size_t* workspace_bytes) {
  return Gemm<cutlass::float_e4m3_t, true, TM, TN, TK, CM, CN, Sched, false, Scale, FastAccum>::run(p, stream,
                                                                                                     workspace_bytes);
}

}  // namespace fluxcompile::flux

// Defines `fluxcompile::flux_gemm_<name>_s<scale><fast>`: one kernel of the fp8 variant `name`.
#define FLUX_GEMM_FP8_PART(name, TM, TN, TK, CM, CN, SCHED, SCALE, FAST)                                      \
  namespace fluxcompile {                                                                                  \
  cudaError_t flux_gemm_##name##_s##SCALE##FAST(const FluxGemmProblem& p, cudaStream_t s, size_t* w) {      \
    return flux::run_fp8_part<TM, TN, TK, CM, CN, SCHED, SCALE, FAST>(p, s, w);                             \
  }                                                                                                        \
  }

// Defines `fluxcompile::flux_gemm_<name>` of an fp8 variant: its parts (FLUX_GEMM_FP8_PART) by the problem's scale
// mode and accumulation; e4m3 operands, K-major weights, no source. The _FAST_ form is built with fast
// accumulation only (cutlass_build.py's `promotes`): a call without it is refused.
#define FLUX_GEMM_FP8_DISPATCH(name, SLOW1, SLOW2)                                                           \
  namespace fluxcompile {                                                                                  \
  cudaError_t flux_gemm_##name##_s11(const FluxGemmProblem&, cudaStream_t, size_t*);                       \
  cudaError_t flux_gemm_##name##_s21(const FluxGemmProblem&, cudaStream_t, size_t*);                       \
  cudaError_t flux_gemm_##name(const FluxGemmProblem& p, cudaStream_t s, size_t* w) {                     \
    if (p.dtype != 2 || !p.b_kmajor || p.c != nullptr || p.scale_a == nullptr || p.scale_b == nullptr) {   \
      return cudaErrorInvalidValue;                                                                        \
    }                                                                                                      \
    if (p.scale_mode == 1) return p.fast_accum ? flux_gemm_##name##_s11(p, s, w) : SLOW1;                  \
    if (p.scale_mode == 2) return p.fast_accum ? flux_gemm_##name##_s21(p, s, w) : SLOW2;                  \
    return cudaErrorInvalidValue;                                                                          \
  }                                                                                                        \
  }
#define FLUX_GEMM_FP8_VARIANT(name)                                                                          \
  namespace fluxcompile {                                                                                  \
  cudaError_t flux_gemm_##name##_s10(const FluxGemmProblem&, cudaStream_t, size_t*);                       \
  cudaError_t flux_gemm_##name##_s20(const FluxGemmProblem&, cudaStream_t, size_t*);                       \
  }                                                                                                        \
  FLUX_GEMM_FP8_DISPATCH(name, flux_gemm_##name##_s10(p, s, w), flux_gemm_##name##_s20(p, s, w))
#define FLUX_GEMM_FP8_FAST_VARIANT(name) FLUX_GEMM_FP8_DISPATCH(name, cudaErrorInvalidValue, cudaErrorInvalidValue)

// Defines `fluxcompile::flux_gemm_<name>` (declared for the registry in flux_gemm_registry.cpp).
#define FLUX_GEMM_VARIANT(name, TM, TN, TK, CM, CN, SCHED)                                                   \
  namespace fluxcompile {                                                                                  \
  cudaError_t flux_gemm_##name(const FluxGemmProblem& p, cudaStream_t s, size_t* w) {                     \
    return flux::run_variant<TM, TN, TK, CM, CN, SCHED>(p, s, w);                                          \
  }                                                                                                        \
  }

// Defines `fluxcompile::flux_gemm_ring_<name>`: the same tile configuration with the ring's source and epilogue.
#define FLUX_GEMM_RING_VARIANT(name, TM, TN, TK, CM, CN, SCHED)                                              \
  namespace fluxcompile {                                                                                  \
  cudaError_t flux_gemm_ring_##name(const FluxGemmProblem& p, cudaStream_t s, size_t* w) {                \
    return flux::run_variant<TM, TN, TK, CM, CN, SCHED, true>(p, s, w);                                    \
  }                                                                                                        \
  }
