// The sequences of the Flux-style CUTLASS GEMM's choices (lowerings/*/cutlass.py): one persistent GEMM per weight
// whose tiles wait for the chunks holding their rows, launched through the flux_gemm module's entry
// (flux_problem.h), with the pushes and flags around it issued here.
#include "sequences.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "flux_problem.h"
#include "slot_reduce.h"
#include "memops.h"
#include "replays.h"
#include "streams.h"

namespace fluxcompile::pipelined {
namespace {

// The error words to their pinned host copy on `s` (checked by the next eager call: symm_mem/errors.py).
void copy_error_words(const at::Tensor& err, const std::optional<at::Tensor>& err_host, const c10::cuda::CUDAStream& s) {
  if (!err_host.has_value()) return;
  C10_CUDA_CHECK(cudaMemcpyAsync(err_host->data_ptr(), err.data_ptr(), err.nbytes(), cudaMemcpyDeviceToHost, s.stream()));
}

// The end of an eager call on the current stream, for the error words' check and the watchdog: `events` recorded
// (not under a caller's capture).
void record_call_end(const std::vector<int64_t>& events, c10::DeviceIndex device) {
  const auto current = c10::cuda::getCurrentCUDAStream(device);
  cudaStreamCaptureStatus status{};
  C10_CUDA_CHECK(cudaStreamIsCapturing(current.stream(), &status));
  if (status != cudaStreamCaptureStatusNone) return;
  for (const int64_t e : events) C10_CUDA_CHECK(cudaEventRecord(reinterpret_cast<cudaEvent_t>(e), current.stream()));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// all-gather -> GEMM (all_gather_matmul/cutlass.py). Our symmetric buffer `buffer` reads as the gathered
// [world * rows, k]: slot s (rows s * rows ..) holds rank s's rows. The send lists peer_slots (slot `rank` in a
// peer's buffer), done_mine, done_theirs and arrived_theirs (peer j's arrival flag of our chunk c at
// j * chunks + c) run over the peers in the send order (exchange.gather_send_order); chunk_bounds holds our
// chunks' rows flattened [lo0, hi0, lo1, hi1, ...]; `arrived`: our arrival flags, int32 [world * chunks] (rank
// s's chunk c at s * chunks + c), which the GEMMs' tiles wait on; err: the GEMMs' error words. gemm: the launch
// words of flux_launch (flux_problem.h).
// in_place: rows is a multiple of the tile's M, so the GEMMs read our rows where a_local is (their own TMA
// descriptor, FluxGemmSync::local_a) and our slot of `buffer` stays unwritten; taken per call where a_local's
// address and rows are 16-byte aligned, else our rows are copied into our slot first. return_A: whether the
// gathered operand is produced (else None). err_host: the error words' pinned host copy, written after the GEMMs;
// events: recorded on the current stream after an eager call (symm_mem's ErrorWords and watchdog read them).
//   side:  join main -> for each peer j: consume done_mine[j] -> per chunk c: our rows [lo_c, hi_c) into
//          peer_slots[j] (peer to peer, copy engine) -> set arrived_theirs[j * chunks + c]
//   main:  [our rows into our slot of `buffer`] -> per weight the GEMM over `buffer` (tiles from our rows on,
//          each other tile waiting, bounded, for its chunks) -> zero `arrived` -> [the gathered output from
//          `buffer`, our rows from a_local] -> join side -> set done_theirs[j] (our slot in peer j's buffer may be
//          written again)
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_flux(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    const std::vector<at::Tensor>& peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& chunk_bounds,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& arrived_theirs,
    const std::vector<int64_t>& done_theirs, const at::Tensor& arrived, const at::Tensor& err, int64_t rank,
    int64_t world, int64_t chunk_rows, const std::vector<int64_t>& gemm, int64_t side_handle, int64_t graphs,
    bool in_place, bool return_A, const std::optional<at::Tensor>& err_host, const std::vector<int64_t>& events) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  TORCH_CHECK(0 <= rank && rank < world, "fluxcompile: rank out of range");
  const size_t peers = peer_slots.size();
  TORCH_CHECK(static_cast<int64_t>(peers) == world - 1, "fluxcompile: one peer slot per peer");
  check_lengths(peers, {done_mine.size(), done_theirs.size()});
  TORCH_CHECK(!chunk_bounds.empty() && chunk_bounds.size() % 2 == 0, "fluxcompile: chunk bounds come as lo, hi pairs");
  const size_t chunks = chunk_bounds.size() / 2;
  check_lengths(peers * chunks, {arrived_theirs.size()});
  TORCH_CHECK(a_local.dim() == 2, "fluxcompile: the shard must be [rows, k]");
  const int64_t rows = a_local.size(0), k = a_local.size(1), m = world * rows;
  TORCH_CHECK(chunk_rows > 0 && static_cast<int64_t>(chunks) == (rows + chunk_rows - 1) / chunk_rows,
              "fluxcompile: the chunks must be the shard's rows in chunk_rows pieces");
  for (size_t c = 0; c < chunks; ++c) {
    const int64_t lo = chunk_bounds[2 * c], hi = chunk_bounds[2 * c + 1];
    TORCH_CHECK(0 <= lo && lo < hi && hi <= rows, "fluxcompile: a chunk out of the shard's rows");
  }
  TORCH_CHECK(buffer.dim() == 2 && buffer.size(0) == m && buffer.size(1) == k,
              "fluxcompile: the buffer must be [world * rows, k]");
  for (const auto& slot : peer_slots) {
    TORCH_CHECK(slot.dim() == 2 && slot.size(0) == rows && slot.size(1) == k, "fluxcompile: a peer slot is not [rows, k]");
  }
  TORCH_CHECK(arrived.scalar_type() == at::kInt && arrived.is_contiguous() &&
                  arrived.numel() == world * static_cast<int64_t>(chunks),
              "fluxcompile: the arrival flags must be int32 [world * chunks]");
  TORCH_CHECK(err.scalar_type() == at::kInt && err.is_contiguous() && err.numel() >= 6,
              "fluxcompile: the error words must be int32 [6]");
  TORCH_CHECK(!err_host.has_value() || (err_host->scalar_type() == at::kInt && err_host->is_contiguous() &&
                                        err_host->numel() == err.numel() && err_host->is_pinned()),
              "fluxcompile: the error words' host copy must be pinned int32 of the words' size");
  const FluxLaunch launch = flux_launch(gemm);
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);

  std::vector<std::optional<at::Tensor>> bias_c;  // the kernel reads a contiguous [N]
  bias_c.reserve(biases.size());
  for (const auto& b : biases) bias_c.push_back(b.has_value() ? std::optional<at::Tensor>(b->contiguous()) : std::nullopt);
  TORCH_CHECK(a_local.is_contiguous(), "fluxcompile: the shard must be contiguous");
  const auto row_bytes = static_cast<uint64_t>(k * a_local.element_size());
  in_place = in_place && reinterpret_cast<uintptr_t>(a_local.data_ptr()) % 16 == 0 && row_bytes % 16 == 0;
  std::optional<at::Tensor> gathered;
  if (return_A) {
    gathered = at::empty(gathered_shape, a_local.options());
    TORCH_CHECK(gathered->numel() == m * k, "fluxcompile: the gathered shape does not hold world * rows rows");
  }
  std::vector<at::Tensor> outs;
  outs.reserve(Bs.size());
  for (const auto& b : Bs) outs.push_back(at::empty({m, b.size(-1)}, a_local.options()));

  // Our rows' tiles first (nothing to wait for); every other tile waits for the chunks holding its rows.
  FluxGemmSync sync;
  sync.rotate_axis = 0;
  sync.rotate_elems = static_cast<int>(rank * rows);
  sync.wait_flags = static_cast<const unsigned*>(arrived.data_ptr());
  sync.rows_per_rank = static_cast<int>(rows);
  sync.chunk_rows = static_cast<int>(chunk_rows);
  sync.chunks_per_rank = static_cast<int>(chunks);
  sync.skip_rank = static_cast<int>(rank);
  sync.err = static_cast<int*>(err.data_ptr());
  sync.rank = static_cast<int>(rank);
  if (in_place) {
    sync.local_a = a_local.data_ptr();
    sync.local_lda = a_local.stride(0);
    sync.local_row0 = static_cast<int>(rank * rows);
  }
  std::vector<FluxGemmProblem> problems;
  problems.reserve(Bs.size());
  for (size_t i = 0; i < Bs.size(); ++i) problems.push_back(flux_problem(buffer, Bs[i], outs[i], bias_c[i], launch, sync));

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    join(side, main);
    for (size_t j = 0; j < peers; ++j) {
      consume_flag(side, done_mine[j]);  // the peer has freed our slot
      for (size_t c = 0; c < chunks; ++c) {
        const int64_t lo = chunk_bounds[2 * c], hi = chunk_bounds[2 * c + 1];
        copy_async(peer_slots[j].narrow(0, lo, hi - lo), a_local.narrow(0, lo, hi - lo), side);
        write_flag(side, arrived_theirs[j * chunks + c], 1);
      }
    }
    if (!in_place) copy_async(buffer.narrow(0, rank * rows, rows), a_local, main);  // before the launch
    for (const auto& p : problems) flux_gemm(launch, p, main.stream());
    copy_error_words(err, err_host, main);
    // Every wait of this call is over: the next call starts from 0 (ATen's fill on `main`, the current stream).
    arrived.zero_();
    if (gathered.has_value()) {
      const at::Tensor g = gathered->view({m, k});
      if (in_place) {  // the peers' rows from the buffer, ours from where they are
        if (rank > 0) copy_async(g.narrow(0, 0, rank * rows), buffer.narrow(0, 0, rank * rows), main);
        copy_async(g.narrow(0, rank * rows, rows), a_local, main);
        const int64_t after = m - (rank + 1) * rows;
        if (after > 0) copy_async(g.narrow(0, (rank + 1) * rows, after), buffer.narrow(0, (rank + 1) * rows, after), main);
      } else {
        copy_async(g, buffer, main);
      }
    }
    join(main, side);
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);
  };
  replays().run(key_of(int64_t{kAgFlux}, a_local, Bs, bias_c, peer_slots, buffer, chunk_bounds, done_mine,
                       arrived_theirs, done_theirs, arrived, err, rank, world, chunk_rows, gemm, side_handle, gathered,
                       outs, static_cast<int64_t>(in_place), err_host),
                graphs, device, issue, {}, /*blas=*/false);  // the CUTLASS GEMMs need no cuBLAS handle
  record_call_end(events, device);
  return {gathered, outs};
}

// ---------------------------------------------------------------------------------------------
// GEMM -> reduce-scatter (matmul_reduce_scatter/cutlass.py). P = a @ b (+ bias) is `partial` [m, n] in our
// symmetric buffer; owner p's chunk is chunk p along `axis` (rows p * chunk .., or columns); `slots` [world, rows,
// cols] in our buffer receive the peers' partials of our chunk (slot s: rank s's). The lists run over the owners
// in ring order (`owners`, rank + 1 first, our own last is left out): peer_slots[j] (slot `rank` in owner j's
// buffer), tiles[j] (the count of owner j's chunk once every tile of it is stored), done_mine[j] (owner j has freed
// our slot), ready_theirs[j] (our partial has landed at owner j), ready_mine[j] (owner j's partial has landed here),
// done_theirs[j] (owner j's slot here is free again). counters: our tile counters, int32 [world] (owner p's at p),
// which the GEMM's epilogue counts on; reduce: the address of fluxcompile_slot_reduce (slot_reduce.h).
//   side:  join main -> for each owner j: wait counters[owners[j]] == tiles[j], reset it -> consume done_mine[j]
//          -> owner j's chunk of P into peer_slots[j] (copy engine; columns as a 2-D copy) -> set ready_theirs[j]
//   main:  the GEMM into P, counting stored tiles per owner chunk, owners' chunks in ring order (ours last)
//          -> reset our own chunk's counter -> consume every ready_mine[j] -> out = scale * (our chunk of P +
//          the slots), fp32, rounded once -> set every done_theirs[j] -> join side
at::Tensor rs_flux(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                   const at::Tensor& partial, const at::Tensor& slots, const std::vector<at::Tensor>& peer_slots,
                   const std::vector<int64_t>& owners, const std::vector<int64_t>& tiles,
                   const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
                   const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                   const at::Tensor& counters, const at::Tensor& err, const std::optional<at::Tensor>& err_host,
                   const std::vector<int64_t>& events, const std::vector<int64_t>& out_shape, int64_t rank,
                   int64_t world, int64_t axis, int64_t chunk, double scale, const std::vector<int64_t>& gemm,
                   int64_t reduce, int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(0 <= rank && rank < world && (axis == 0 || axis == 1), "fluxcompile: rank or axis out of range");
  const size_t peers = owners.size();
  TORCH_CHECK(static_cast<int64_t>(peers) == world - 1, "fluxcompile: one owner per peer");
  check_lengths(peers, {peer_slots.size(), tiles.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  TORCH_CHECK(a.dim() == 2 && partial.dim() == 2 && partial.size(0) == a.size(0) && partial.size(1) == b.size(1) &&
                  partial.is_contiguous(),
              "fluxcompile: the partial must be a contiguous [m, n]");
  const int64_t m = partial.size(0), n = partial.size(1);
  const int64_t rows = axis == 0 ? chunk : m, cols = axis == 0 ? n : chunk;
  TORCH_CHECK(chunk > 0 && chunk * world == (axis == 0 ? m : n), "fluxcompile: the chunks must split the axis");
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == world && slots.size(1) == rows && slots.size(2) == cols &&
                  slots.is_contiguous() && slots.scalar_type() == partial.scalar_type(),
              "fluxcompile: the slots must be a contiguous [world, rows, cols] of the partial's dtype");
  for (const auto& t : peer_slots) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.is_contiguous(),
                "fluxcompile: a peer slot is not a contiguous [rows, cols]");
  }
  for (const int64_t p : owners) TORCH_CHECK(0 <= p && p < world && p != rank, "fluxcompile: an owner out of range");
  TORCH_CHECK(counters.scalar_type() == at::kInt && counters.is_contiguous() && counters.numel() >= world,
              "fluxcompile: the tile counters must be int32 [world]");
  TORCH_CHECK(err.scalar_type() == at::kInt && err.is_contiguous() && err.numel() >= 6,
              "fluxcompile: the error words must be int32 [6]");
  TORCH_CHECK(!err_host.has_value() || (err_host->scalar_type() == at::kInt && err_host->is_pinned() &&
                                        err_host->numel() == err.numel()),
              "fluxcompile: the error words' host copy must be pinned int32 of the words' size");
  TORCH_CHECK(reduce != 0, "fluxcompile: no address of the slot reduction");
  const FluxLaunch launch = flux_launch(gemm);
  const auto device = a.device().index();
  c10::cuda::CUDAGuard guard(a.device());
  const auto side = external(side_handle, device);

  std::optional<at::Tensor> bias_c;
  if (bias.has_value()) bias_c = bias->contiguous();
  at::Tensor out = at::empty(out_shape, partial.options());
  TORCH_CHECK(out.numel() == rows * cols, "fluxcompile: the output shape does not hold our chunk");
  auto part = [&](int64_t p) { return partial.narrow(axis, p * chunk, chunk); };
  const auto counter = [&](int64_t p) { return reinterpret_cast<int64_t>(counters.data_ptr<int32_t>() + p); };

  // Owners' chunks in ring order, ours last; each stored tile counted on its owner's counter.
  FluxGemmSync sync;
  sync.rotate_axis = static_cast<int>(axis);
  sync.rotate_elems = static_cast<int>((peers > 0 ? owners[0] : rank) * chunk);
  sync.signal_counters = static_cast<unsigned*>(counters.data_ptr());
  sync.signal_axis = static_cast<int>(axis);
  sync.signal_elems = static_cast<int>(chunk);
  sync.err = static_cast<int*>(err.data_ptr());
  sync.rank = static_cast<int>(rank);
  const FluxGemmProblem problem = flux_problem(a, b, partial, bias_c, launch, sync);

  SlotReduce reduction;
  reduction.slots = slots.data_ptr();
  const at::Tensor own = part(rank);
  reduction.own = own.data_ptr();
  reduction.out = out.data_ptr();
  reduction.rows = rows;
  reduction.cols = cols;
  reduction.ld_own = own.stride(0);
  reduction.rank = static_cast<int>(rank);
  reduction.world = static_cast<int>(world);
  reduction.scale = static_cast<float>(scale);
  reduction.dtype = flux_dtype(partial);
  const auto reduce_run = reinterpret_cast<SlotReduceRun>(static_cast<intptr_t>(reduce));

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    join(side, main);  // the side stream runs beside the GEMM
    flux_gemm(launch, problem, main.stream());
    write_flag(main, counter(rank), 0);  // our own chunk's count (nobody waits for it)
    for (size_t j = 0; j < peers; ++j) {
      wait_flag(side, counter(owners[j]), static_cast<uint32_t>(tiles[j]));  // owner j's chunk is stored
      write_flag(side, counter(owners[j]), 0);
      consume_flag(side, done_mine[j]);  // our slot in owner j's buffer is free
      copy_2d(peer_slots[j], part(owners[j]), side);
      write_flag(side, ready_theirs[j], 1);
    }
    for (size_t j = 0; j < peers; ++j) consume_flag(main, ready_mine[j]);
    const cudaError_t rc = reduce_run(&reduction, main.stream());
    TORCH_CHECK(rc == cudaSuccess, "fluxcompile: the slot reduction failed: ", cudaGetErrorString(rc));
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);  // owner j's slot here is free
    join(main, side);
    copy_error_words(err, err_host, main);
  };
  replays().run(key_of(int64_t{kRsFlux}, a, b, bias_c, partial, slots, peer_slots, owners, tiles, done_mine,
                       ready_theirs, ready_mine, done_theirs, counters, err, err_host, rank, world, axis, chunk,
                       static_cast<int64_t>(scale * (1 << 20)), gemm, reduce, side_handle, out),
                graphs, device, issue, {}, /*blas=*/false);
  record_call_end(events, device);
  return out;
}

}  // namespace fluxcompile::pipelined
