// The sequences of the Flux-style CUTLASS GEMM's choices (lowerings/*/cutlass.py): one persistent GEMM per weight
// whose tiles wait for the chunks holding their rows, launched through the flux_gemm module's entry
// (flux_problem.h), with the pushes and flags around it issued here.
#include "sequences.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "flux_problem.h"
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
// GEMM -> reduce-scatter as a ring in one GEMM (matmul_reduce_scatter/cutlass.py). Chunk q (rows q * chunk ..,
// or columns) is summed along the ring q-1, q-2, ..., q: each rank's GEMM adds its product to the running sum of
// chunk q that rank + 1 pushed into our `incoming` and passes it on to rank - 1; the owner's GEMM adds the last
// product and writes the output. So this rank's GEMM takes the chunks in the order rank+1, ..., rank (tile
// rotation; the first adds zeros, the last stores into `out`), each step of the ring rounding once. Every rank's
// tiles count on `counters` per sub-chunk (`sub` elements along `axis`, numbered over the whole axis), and the
// side stream pushes each sub-chunk of P as soon as it is stored; the receiving epilogue waits on `arrived`, our
// flag per sub-chunk, before loading that sub-chunk's running sum.
// partial: our P [m, n] (symmetric buffer); incoming: our [m, n] of running sums (symmetric buffer, written by
// rank + 1); peer_incoming: rank - 1's `incoming`; zero: zeros of [TM, n] (rows) or [m, TN] (columns); tiles: per
// sub-chunk, the count of its stored tiles; arrived_theirs: the address of rank - 1's `arrived`; done_mine: our
// flag that rank - 1 has read its `incoming` (we may push into it); done_theirs: that flag at rank + 1.
//   side:  join main -> for each chunk q = rank+1, ..., rank-1 and each of its sub-chunks j: wait counters[j] ==
//          tiles[j], reset it -> [the first: consume done_mine] -> sub-chunk j of P into peer_incoming (copy
//          engine; columns as a 2-D copy) -> set arrived_theirs[j]
//   main:  the GEMM (d = scale * a @ b + running sum + scale * bias) -> zero `arrived` -> join side -> set
//          done_theirs
at::Tensor rs_ring(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& bias_scratch, const at::Tensor& partial,
                   const at::Tensor& incoming, const at::Tensor& peer_incoming, const at::Tensor& zero,
                   const at::Tensor& counters, const at::Tensor& arrived,
                   const std::vector<int64_t>& tiles, int64_t arrived_theirs, int64_t done_mine, int64_t done_theirs,
                   const at::Tensor& err, const std::optional<at::Tensor>& err_host, const std::vector<int64_t>& events,
                   const std::vector<int64_t>& out_shape, int64_t rank, int64_t world, int64_t axis, int64_t chunk,
                   int64_t sub, double scale, const std::vector<int64_t>& gemm, int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(world >= 2 && 0 <= rank && rank < world && (axis == 0 || axis == 1),
              "fluxcompile: rank, world or axis out of range");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && partial.dim() == 2 && partial.size(0) == a.size(0) &&
                  partial.size(1) == b.size(1) && partial.is_contiguous(),
              "fluxcompile: the partial must be a contiguous [m, n]");
  const int64_t m = partial.size(0), n = partial.size(1);
  for (const auto* t : {&incoming, &peer_incoming}) {
    TORCH_CHECK(t->sizes() == partial.sizes() && t->is_contiguous() && t->scalar_type() == partial.scalar_type(),
                "fluxcompile: the running sums must be a contiguous [m, n] of the partial's dtype");
  }
  TORCH_CHECK(chunk > 0 && chunk * world == (axis == 0 ? m : n), "fluxcompile: the chunks must split the axis");
  TORCH_CHECK(sub > 0 && chunk % sub == 0, "fluxcompile: the sub-chunks must split a chunk");
  const int64_t subs = chunk / sub;  // per chunk
  TORCH_CHECK(static_cast<int64_t>(tiles.size()) == world * subs, "fluxcompile: one tile count per sub-chunk");
  TORCH_CHECK(counters.scalar_type() == at::kInt && counters.is_contiguous() && counters.numel() >= world * subs &&
                  arrived.scalar_type() == at::kInt && arrived.is_contiguous() && arrived.numel() == world * subs,
              "fluxcompile: the tile counters and arrival flags must be int32 [sub-chunks]");
  TORCH_CHECK(zero.dim() == 2 && zero.stride(1) == 1 && zero.scalar_type() == partial.scalar_type() &&
                  zero.size(axis == 0 ? 1 : 0) == (axis == 0 ? n : m),
              "fluxcompile: the zeros must be a row-major [TM, n] or [m, TN]");
  TORCH_CHECK(err.scalar_type() == at::kInt && err.is_contiguous() && err.numel() >= 6,
              "fluxcompile: the error words must be int32 [6]");
  TORCH_CHECK(!err_host.has_value() || (err_host->scalar_type() == at::kInt && err_host->is_pinned() &&
                                        err_host->numel() == err.numel()),
              "fluxcompile: the error words' host copy must be pinned int32 of the words' size");
  const FluxLaunch launch = flux_launch(gemm);
  const auto device = a.device().index();
  c10::cuda::CUDAGuard guard(a.device());
  const auto side = external(side_handle, device);

  // Each step adds its rank's bias, scaled as its product is: with a scale (avg), scale * bias is written into
  // bias_scratch ([n], kept by the caller across calls) at the start of the call.
  std::optional<at::Tensor> bias_c;
  const bool scaled_bias = bias.has_value() && scale != 1.0;
  if (bias.has_value()) bias_c = bias->contiguous();
  if (scaled_bias) {
    TORCH_CHECK(bias_scratch.has_value() && bias_scratch->is_contiguous() && bias_scratch->sizes() == bias->sizes() &&
                    bias_scratch->scalar_type() == bias->scalar_type(),
                "fluxcompile: a scaled bias needs a scratch of the bias's shape");
  }
  at::Tensor out = at::empty(out_shape, partial.options());
  TORCH_CHECK(out.numel() == (axis == 0 ? chunk * n : m * chunk), "fluxcompile: the output shape does not hold our chunk");
  const int64_t ldo = axis == 0 ? n : chunk;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && (ldo * out.element_size()) % 16 == 0,
              "fluxcompile: the output must be 16-byte aligned");
  const auto counter = [&](int64_t j) { return reinterpret_cast<int64_t>(counters.data_ptr<int32_t>() + j); };

  const int64_t next = (rank + 1) % world;
  FluxGemmSync sync;
  sync.rotate_axis = static_cast<int>(axis);
  sync.rotate_elems = static_cast<int>(next * chunk);
  sync.signal_counters = static_cast<unsigned*>(counters.data_ptr());
  sync.signal_axis = static_cast<int>(axis);
  sync.signal_elems = static_cast<int>(sub);
  sync.c_flags = static_cast<const unsigned*>(arrived.data_ptr());
  sync.c_elems = static_cast<int>(sub);
  sync.c_peer = static_cast<int>(next);
  sync.chunk_elems = static_cast<int>(chunk);
  sync.zero_chunk = static_cast<int>(next);
  sync.own_chunk = static_cast<int>(rank);
  sync.zero = zero.data_ptr();
  sync.ldz = zero.stride(0);
  sync.out = out.data_ptr();
  sync.ldo = ldo;
  sync.err = static_cast<int*>(err.data_ptr());
  sync.rank = static_cast<int>(rank);
  FluxGemmProblem problem =
      flux_problem(a, b, partial, scaled_bias ? std::optional<at::Tensor>(*bias_scratch) : bias_c, launch, sync);
  problem.c = incoming.data_ptr();
  problem.ldc = incoming.stride(0);
  problem.alpha = static_cast<float>(scale);

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    join(side, main);  // the side stream runs beside the GEMM
    if (scaled_bias) {  // ATen, on `main`
      at::Tensor scratch = *bias_scratch;
      at::mul_out(scratch, *bias_c, at::Scalar(scale));
    }
    flux_gemm(launch, problem, main.stream());
    bool first = true;
    for (int64_t step = 0; step + 1 < world; ++step) {
      const int64_t q = (rank + 1 + step) % world;
      for (int64_t j = q * subs; j < (q + 1) * subs; ++j) {
        wait_flag(side, counter(j), static_cast<uint32_t>(tiles[j]));  // sub-chunk j of P is stored
        write_flag(side, counter(j), 0);
        if (first) consume_flag(side, done_mine);  // rank - 1 has read its running sums of the last call
        first = false;
        copy_2d(peer_incoming.narrow(axis, j * sub, sub), partial.narrow(axis, j * sub, sub), side);
        write_flag(side, arrived_theirs + 4 * j, 1);
      }
    }
    // Every wait of this call is over: the next call starts from 0 (ATen's fill on `main`, the current stream).
    arrived.zero_();
    join(main, side);
    write_flag(main, done_theirs, 1);  // rank + 1 may push into our running sums again
    copy_error_words(err, err_host, main);
  };
  replays().run(key_of(int64_t{kRsRing}, a, b, bias_c, bias_scratch, partial, incoming, peer_incoming, zero, counters, arrived,
                       tiles, arrived_theirs, done_mine, done_theirs, err, err_host, rank, world, axis, chunk, sub,
                       static_cast<int64_t>(scale * (1 << 20)), gemm, side_handle, out),
                graphs, device, issue, {}, /*blas=*/false);
  record_call_end(events, device);
  return out;
}

}  // namespace fluxcompile::pipelined
