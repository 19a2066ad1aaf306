// The all-gather -> GEMM sequences of the cuBLAS-pipelined choices (all_gather_matmul/cublas_pipelined.py).
#include "sequences.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "memops.h"
#include "replays.h"
#include "streams.h"

namespace fluxcompile::pipelined {
namespace {

// All-gather, on the side stream once A is ready: our shard into each peer's slot (the copy engine, once
// the peer has freed it), then into our rows of the gathered output.
void push_shard(const c10::cuda::CUDAStream& side, const c10::cuda::CUDAStream& main, const at::Tensor& a_local,
                std::vector<at::Tensor>& peer_slots, const std::vector<int64_t>& done_mine,
                const std::vector<int64_t>& ready_theirs, const std::optional<at::Tensor>& rows_of, int64_t rank) {
  join(side, main);
  // The send lists come in the plan's send order (exchange.gather_send_order).
  for (size_t j = 0; j < peer_slots.size(); ++j) send_block(side, done_mine[j], peer_slots[j], a_local, ready_theirs[j]);
  if (rows_of.has_value()) copy_async(rows_of->select(0, rank), a_local, side);
}

// The gathered output where the caller reads it (return_A), else none.
std::optional<at::Tensor> gathered_output(bool return_A, const std::vector<int64_t>& shape, const at::Tensor& a) {
  if (!return_A) return std::nullopt;
  return at::empty(shape, a.options());
}

// Rows lo .. lo + a.size(0) of every output: a @ B_i (+ bias_i), scaled by `scaling` where it is on (a's rows
// are rows lo .. of the gathered operand).
void mm_at(const at::Tensor& a, const std::vector<at::Tensor>& Bs, const std::vector<std::optional<at::Tensor>>& biases,
           std::vector<at::Tensor>& outs, int64_t lo, const Scaling& scaling = {}) {
  for (size_t i = 0; i < Bs.size(); ++i) matmul_out(outs[i].narrow(0, lo, a.size(0)), a, Bs[i], biases[i], scaling, i, lo);
}

// One [m, N_i] output per weight.
std::vector<at::Tensor> empty_outs(const std::vector<at::Tensor>& Bs, int64_t m, const at::TensorOptions& options) {
  std::vector<at::Tensor> outs;
  outs.reserve(Bs.size());
  for (const auto& b : Bs) outs.push_back(at::empty({m, b.size(-1)}, options));
  return outs;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// all-gather -> GEMM (all_gather_matmul/cublas_pipelined.py). The send lists peer_slots (slot `rank` in a
// peer's buffer: our shard goes there), done_mine and ready_theirs run over the peers in the send order
// (exchange.gather_send_order); order, my_slots (slot order[j] in our buffer: its shard arrives there),
// ready_mine and done_theirs over the peers in ring order. compute_handles: one stream per peer (concurrent),
// or empty (main). return_A: whether the gathered output is assembled (else None, and no copies into it).
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_pipelined(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const std::vector<at::Tensor>& my_slots,
    const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
    const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
    const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world, int64_t side_handle,
    const std::vector<int64_t>& compute_handles, int64_t graphs, bool return_A, const std::vector<at::Tensor>& a_scales,
    const std::vector<at::Tensor>& b_scales, std::optional<at::ScalarType> out_dtype, bool fast_accum) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const Scaling scaling = scaling_of(a_scales, b_scales, out_dtype, fast_accum, Bs.size());
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), my_slots.size(), done_mine.size(), ready_theirs.size(),
                        ready_mine.size(), done_theirs.size()});
  const bool concurrent = !compute_handles.empty();
  if (concurrent) check_lengths(peers, {compute_handles.size()});
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1);
  std::vector<c10::cuda::CUDAStream> gemm_streams;  // concurrent: one per peer
  for (int64_t h : compute_handles) gemm_streams.push_back(external(h, device));

  const std::optional<at::Tensor> gathered = gathered_output(return_A, gathered_shape, a_local);
  std::optional<at::Tensor> rows_of;  // rank i's rows (no leading dims before the gather dim)
  if (gathered.has_value()) rows_of = gathered->view({world, rows, k});
  std::vector<at::Tensor> outs = empty_outs(Bs, world * rows, product_options(a_local, scaling));

  const auto gemms = gemm_stream(device);
  std::vector<c10::cuda::CUDAStream> with_gemms = gemm_streams;  // their cuBLAS workspaces before a capture
  with_gemms.push_back(gemms);
  auto sequence = [&](const c10::cuda::CUDAStream& main) {
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, rows_of, rank);

    std::vector<c10::cuda::CUDAStream> compute;
    compute.reserve(peers);
    for (size_t j = 0; j < peers; ++j) compute.push_back(concurrent ? gemm_streams[j] : main);
    if (concurrent) {
      for (const auto& s : compute) join(s, main);  // A, the outputs and the flag resets are ready
    }
    mm_at(a_local, Bs, biases, outs, rank * rows, scaling);
    for (size_t j = 0; j < peers; ++j) {
      const auto& s = compute[j];
      c10::cuda::CUDAStreamGuard on_s(s);
      consume_flag(s, ready_mine[j]);
      if (rows_of.has_value()) join(side, s);
      mm_at(my_slots[j], Bs, biases, outs, order[j] * rows, scaling);
      // After the GEMM's launch: the copy fills the SMs the GEMM leaves rather than delay its start.
      if (rows_of.has_value()) copy_async(rows_of->select(0, order[j]), my_slots[j], side);
    }
    if (concurrent) {
      for (const auto& s : compute) join(main, s);
    }
    join(main, side);
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);
  };
  auto issue = [&] { on_gemm_stream(gemms, sequence); };
  replays().run(key_of(int64_t{kAgPipelined}, a_local, Bs, biases, peer_slots, my_slots, order, done_mine,
                       ready_theirs, ready_mine, done_theirs, rank, world, side_handle, compute_handles, gathered,
                       outs, scaling.tensors(), scaling.word()),
                graphs, device, issue, with_gemms);
  return {gathered, outs};
}

// ---------------------------------------------------------------------------------------------
// The unsplit variants (":unsplit" choices): one GEMM over all rows, then the exchange by the copy engine.
// No overlap, but no GEMM split by rank either (at small m a split costs up to a wave per block) and the
// fewest launches (host time); the copy engine moves a block over NVLink faster than NCCL's kernels at
// these sizes. The autotuner keeps them where they are faster.

// all-gather -> GEMM: the side stream pushes our shard into every peer's slot and assembles the gathered
// A (ours from A, each peer's from its slot once it landed); then one GEMM per weight over all rows.
std::tuple<at::Tensor, std::vector<at::Tensor>> ag_unsplit(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const std::vector<at::Tensor>& my_slots, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    int64_t side_handle, int64_t graphs, const std::vector<at::Tensor>& a_scales,
    const std::vector<at::Tensor>& b_scales, std::optional<at::ScalarType> out_dtype, bool fast_accum) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const Scaling scaling = scaling_of(a_scales, b_scales, out_dtype, fast_accum, Bs.size());
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), my_slots.size(), done_mine.size(), ready_theirs.size(),
                        ready_mine.size(), done_theirs.size()});
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1);

  at::Tensor gathered = at::empty(gathered_shape, a_local.options());
  at::Tensor rows_of = gathered.view({world, rows, k});
  std::vector<at::Tensor> outs = empty_outs(Bs, world * rows, product_options(a_local, scaling));
  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, rows_of, rank);
    for (size_t j = 0; j < peers; ++j) {
      consume_flag(side, ready_mine[j]);
      copy_async(rows_of.select(0, order[j]), my_slots[j], side);
    }
    for (size_t j = 0; j < peers; ++j) write_flag(side, done_theirs[j], 1);  // our slots are free again
    join(main, side);
    mm_at(gathered.view({world * rows, k}), Bs, biases, outs, 0, scaling);
  };
  replays().run(key_of(int64_t{kAgUnsplit}, a_local, Bs, biases, peer_slots, my_slots, order, done_mine,
                       ready_theirs, ready_mine, done_theirs, rank, world, side_handle, gathered, outs,
                       scaling.tensors(), scaling.word()),
                graphs, device, issue);
  return {gathered, outs};
}

// ---------------------------------------------------------------------------------------------
// all-gather -> GEMM, "lead" (":lead<d>" choices): a first GEMM over `lead` of our own rows hides the
// shards' flight; then one GEMM (two for a rank in the middle of the order) over every other row, read
// from our symmetric buffer, where the slots by source rank form the gathered [world * rows, k] (our other
// rows are copied into our slot on `aux` beside the lead GEMM). Two or three GEMMs instead of one per rank:
// a split costs up to a wave per GEMM, and `lead` can be picked (by the autotuner) so that the two add no
// wave.
// The lead rows are the first of ours, or the last for the last rank, so that the rest is contiguous.
//   buffer: our whole symmetric buffer as [world * rows, k] (slot s = rows s * rows ..)
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_lead(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    int64_t lead, int64_t side_handle, int64_t aux_handle, int64_t graphs, bool return_A) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const auto aux = external(aux_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1), m = world * rows;
  TORCH_CHECK(0 < lead && lead < rows, "fluxcompile: lead must be in (0, rows)");
  TORCH_CHECK(buffer.size(0) == m && buffer.size(1) == k, "fluxcompile: the buffer must be [world * rows, k]");

  const std::optional<at::Tensor> gathered = gathered_output(return_A, gathered_shape, a_local);
  std::optional<at::Tensor> rows_of;
  if (gathered.has_value()) rows_of = gathered->view({world, rows, k});
  std::vector<at::Tensor> outs = empty_outs(Bs, m, a_local.options());
  auto gemm = [&](const at::Tensor& a, int64_t lo) { mm_at(a, Bs, biases, outs, lo); };

  const auto gemms = gemm_stream(device);
  auto sequence = [&](const c10::cuda::CUDAStream& main) {
    // Side: the pushes (the peers wait for them). Main: the lead GEMM, which reads A itself. Aux: our other
    // rows into our own slot, issued after the lead GEMM so that the copy (an SM copy) takes the SMs the
    // lead GEMM leaves free rather than delaying its start; not queued behind the pushes on the side
    // stream, or the rest GEMM would wait for those too.
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, rows_of, rank);
    join(aux, main);

    const bool last = rank == world - 1;
    const int64_t lead_lo = last ? rows - lead : 0;  // within our rows
    const int64_t other_lo = last ? 0 : lead;  // our rows the lead leaves out
    gemm(a_local.narrow(0, lead_lo, lead), rank * rows + lead_lo);
    copy_async(buffer.narrow(0, rank * rows + other_lo, rows - lead), a_local.narrow(0, other_lo, rows - lead), aux);
    for (size_t j = 0; j < peers; ++j) consume_flag(main, ready_mine[j]);
    join(main, aux);
    // The rest: [0, lo) and [hi, m) of the gathered rows. The gathered output's peer rows: SM copies on the
    // side stream after the ready waits, beside the rest GEMM (which need not wait for them, nor for our
    // pushes), issued after it so that they fill the SMs its last wave leaves rather than delay its start.
    join(side, main);
    const int64_t lo = rank * rows + lead_lo, hi = lo + lead;
    if (lo > 0) gemm(buffer.narrow(0, 0, lo), 0);
    if (hi < m) gemm(buffer.narrow(0, hi, m - hi), hi);
    for (size_t j = 0; j < peers && rows_of.has_value(); ++j) {
      copy_async(rows_of->select(0, order[j]), buffer.narrow(0, order[j] * rows, rows), side);
    }
    join(main, side);  // then our slots are free again
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);
  };
  auto issue = [&] { on_gemm_stream(gemms, sequence); };
  replays().run(key_of(int64_t{kAgLead}, a_local, Bs, biases, peer_slots, buffer, order, done_mine, ready_theirs,
                       ready_mine, done_theirs, rank, world, lead, side_handle, aux_handle, gathered, outs),
                graphs, device, issue, {gemms});
  return {gathered, outs};
}

// all-gather -> GEMM, ":stages<g>" (all_gather_matmul/cublas_pipelined.py): the peers' shards in groups, one
// GEMM per group's row range(s) of our symmetric buffer (its slots abut into the gathered [world * rows, k]),
// after a GEMM over our own rows from A. group_js[g]: indices j of the group's peers (their ready flags);
// group_ranges[g]: its row ranges, flattened [lo0, hi0, lo1, hi1, ...].
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_stages(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    const std::vector<std::vector<int64_t>>& group_js, const std::vector<std::vector<int64_t>>& group_ranges,
    int64_t side_handle, int64_t graphs, bool return_A) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  check_groups(peers, world * a_local.size(0), group_js, group_ranges);
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1), m = world * rows;
  TORCH_CHECK(buffer.size(0) == m && buffer.size(1) == k, "fluxcompile: the buffer must be [world * rows, k]");

  const std::optional<at::Tensor> gathered = gathered_output(return_A, gathered_shape, a_local);
  std::optional<at::Tensor> rows_of;
  if (gathered.has_value()) rows_of = gathered->view({world, rows, k});
  std::vector<at::Tensor> outs = empty_outs(Bs, m, a_local.options());
  auto gemm = [&](const at::Tensor& a, int64_t lo) { mm_at(a, Bs, biases, outs, lo); };

  const auto gemms = gemm_stream(device);
  auto sequence = [&](const c10::cuda::CUDAStream& main) {
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, rows_of, rank);
    gemm(a_local, rank * rows);
    for (size_t g = 0; g < group_js.size(); ++g) {
      const auto& rs = group_ranges[g];
      for (int64_t j : group_js[g]) consume_flag(main, ready_mine[j]);
      join(side, main);  // the group's rows have landed: the gathered output's copies, beside its GEMMs
      for (size_t i = 0; i < rs.size() && gathered.has_value(); i += 2) {
        copy_async(gathered->view({m, k}).narrow(0, rs[i], rs[i + 1] - rs[i]),
                   buffer.narrow(0, rs[i], rs[i + 1] - rs[i]), side);
      }
      for (size_t i = 0; i < rs.size(); i += 2) gemm(buffer.narrow(0, rs[i], rs[i + 1] - rs[i]), rs[i]);
    }
    join(main, side);  // then our slots are free again
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);
  };
  auto issue = [&] { on_gemm_stream(gemms, sequence); };
  replays().run(key_of(int64_t{kAgStages}, a_local, Bs, biases, peer_slots, buffer, order, done_mine, ready_theirs,
                       ready_mine, done_theirs, rank, world, group_js, group_ranges, side_handle, gathered, outs),
                graphs, device, issue, {gemms});
  return {gathered, outs};
}

}  // namespace fluxcompile::pipelined
