// The GEMM -> reduce-scatter sequences of the cuBLAS-pipelined choices (matmul_reduce_scatter/cublas_pipelined.py).
#include "sequences.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cublaslt_addmm.h"
#include "memops.h"
#include "replays.h"
#include "streams.h"

namespace fluxcompile::pipelined {
namespace {

// Reduce-scatter, once the peers' partials of our rows have landed: ours (`mine`; for > 2 ranks already in
// our slot) plus theirs, into `out`; then our slots are free again for the peers (after `side`'s pushes, if any: they
// read our staging).
void reduce_and_release(const c10::cuda::CUDAStream& main, const std::optional<c10::cuda::CUDAStream>& side,
                        const at::Tensor& mine, const at::Tensor& own_slots, const std::vector<int64_t>& order,
                        const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                        const at::Tensor& out, int64_t rows) {
  for (int64_t addr : ready_mine) consume_flag(main, addr);
  at::Tensor out2 = out.view({rows, own_slots.size(2)});
  if (own_slots.size(0) == 1) {
    out2.copy_(mine);  // one rank (tests of the sequences themselves: the choices decline it)
  } else if (own_slots.size(0) == 2) {
    at::add_out(out2, mine, own_slots.select(0, order[0]));  // fp32 math, one rounding
  } else {
    at::sum_out(out2, own_slots, std::vector<int64_t>{0});  // accumulates in fp32, rounds once
  }
  if (side.has_value()) join(main, *side);
  for (int64_t addr : done_theirs) write_flag(main, addr, 1);
}

// dst <- sum_i As[i][lo : lo + count] @ Bs[i] (+ bias): the bias goes into the first product and later
// products accumulate in cuBLAS (fp32) over the sum so far, as in the reference (ops.matmul_sum). Scaled
// products (fp8) are added in the products' dtype, as the reference adds them.
void matmul_rows(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                 const std::optional<at::Tensor>& bias, int64_t lo, int64_t count, at::Tensor dst,
                 const Scaling& scaling = {}) {
  if (scaling.on()) {
    matmul_out(dst, As[0].narrow(0, lo, count), Bs[0], bias, scaling, 0, lo);
    for (size_t i = 1; i < As.size(); ++i) {
      at::Tensor term = at::empty_like(dst);
      matmul_out(term, As[i].narrow(0, lo, count), Bs[i], std::nullopt, scaling, i, lo);
      dst.add_(term);
    }
    return;
  }
  if (bias.has_value()) {
    at::addmm_out(dst, *bias, As[0].narrow(0, lo, count), Bs[0]);
  } else {
    at::mm_out(dst, As[0].narrow(0, lo, count), Bs[0]);
  }
  for (size_t i = 1; i < As.size(); ++i) dst.addmm_(As[i].narrow(0, lo, count), Bs[i]);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// GEMM -> reduce-scatter (matmul_reduce_scatter/cublas_pipelined.py). Lists indexed j run over the peers in ring
// order, which is also the order a reduce-scatter sends in (exchange.py):
//   peer_slots[j]   slot `rank` in peer order[j]'s buffer (zero-copy: cuBLAS writes there)
//   stage_slots[j]  push only: our local staging slot for order[j]'s rows
//   done_mine[j]    done flag of peer order[j] in our flags (may we write into its slot?)
//   ready_theirs[j] ready flag `rank` in order[j]'s flags (our partial has landed there)
//   ready_mine[j]   ready flag order[j] in our flags (its partial of our rows has landed)
//   done_theirs[j]  done flag `rank` in order[j]'s flags (our slot of its partial is free again)
// own_slot: slot `rank` of our buffer; own_slots: [world, rows, n], our slots by source rank.
at::Tensor rs_pipelined(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                        const std::optional<at::Tensor>& bias, std::vector<at::Tensor> peer_slots,
                        const std::vector<at::Tensor>& stage_slots, const at::Tensor& own_slot,
                        const at::Tensor& own_slots, const std::vector<int64_t>& order,
                        const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
                        const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                        const std::vector<int64_t>& out_shape, int64_t rank, int64_t rows, bool push,
                        int64_t side_handle, int64_t graphs, const std::vector<at::Tensor>& a_scales,
                        const std::vector<at::Tensor>& b_scales, std::optional<at::ScalarType> out_dtype,
                        bool fast_accum) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  const Scaling scaling = scaling_of(a_scales, b_scales, out_dtype, fast_accum, As.size());
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  if (push) check_lengths(peers, {stage_slots.size()});
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  at::Tensor out = at::empty(out_shape, product_options(As[0], scaling));
  std::optional<c10::cuda::CUDAStream> side;
  if (push) side = external(side_handle, device);

  // Our partial of `owner`'s rows into dst.
  auto partial = [&](int64_t owner, const at::Tensor& dst) {
    matmul_rows(As, Bs, bias, owner * rows, rows, dst, scaling);
  };
  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    if (push) {
      for (size_t j = 0; j < peers; ++j) {
        partial(order[j], stage_slots[j]);
        join(*side, main);
        send_block(*side, done_mine[j], peer_slots[j], stage_slots[j], ready_theirs[j]);
      }
    } else {
      for (size_t j = 0; j < peers; ++j) {
        consume_flag(main, done_mine[j]);
        partial(order[j], peer_slots[j]);  // zero-copy: cuBLAS stores into the peer's memory
        write_flag(main, ready_theirs[j], 1);
      }
    }
    partial(rank, own_slot);
    // With no peers the side stream did nothing (under a capture it never joined): nothing to wait for.
    reduce_and_release(main, peers ? side : std::nullopt, own_slot, own_slots, order, ready_mine, done_theirs, out,
                       rows);
  };
  replays().run(key_of(int64_t{kRsPipelined}, As, Bs, bias, peer_slots, stage_slots, own_slot, own_slots, order,
                       done_mine, ready_theirs, ready_mine, done_theirs, out, rank, rows, static_cast<int64_t>(push),
                       side_handle, scaling.tensors(), scaling.word()),
                graphs, device, issue);
  return out;
}

// GEMM -> reduce-scatter between two ranks, ":addmm" and ":pushadd": our block's GEMM adds the peer's partial
// of our rows (own_slots[order[0]]) in its epilogue (add_mm: C = that slot, D = the output), where
// rs_pipelined adds the two slots in a pass of its own after the GEMM. Lists as in rs_pipelined, of one peer.
//   :addmm (stage_slots empty):  the peer's block zero-copy; wait for the peer's partial; our block with it.
//   :pushadd:  the peer's block into staging, pushed by the copy engine on `side`; our first `split` rows into
//              our slot while the pushes fly; wait for the peer's partial; the other rows with it; then the
//              first rows' sum in a pass of their own (split of rows instead of all of them).
at::Tensor rs_addmm(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                    const std::optional<at::Tensor>& bias, std::vector<at::Tensor> peer_slots,
                    const std::vector<at::Tensor>& stage_slots, const at::Tensor& own_slot,
                    const at::Tensor& own_slots, const std::vector<int64_t>& order,
                    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
                    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                    const std::vector<int64_t>& out_shape, int64_t rank, int64_t rows, int64_t split,
                    int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  TORCH_CHECK(order.size() == 1, "fluxcompile: rs_addmm is for two ranks");
  check_lengths(1, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(), done_theirs.size()});
  const bool push = !stage_slots.empty();
  if (push) check_lengths(1, {stage_slots.size()});
  TORCH_CHECK(push ? 0 <= split && split < rows : split == 0, "fluxcompile: rs_addmm's split must be in [0, rows)");
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  at::Tensor out = at::empty(out_shape, As[0].options());
  std::optional<c10::cuda::CUDAStream> side;
  if (push) side = external(side_handle, device);
  const at::Tensor theirs = own_slots.select(0, order[0]);

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    if (push) {
      matmul_rows(As, Bs, bias, order[0] * rows, rows, stage_slots[0]);
      join(*side, main);
      send_block(*side, done_mine[0], peer_slots[0], stage_slots[0], ready_theirs[0]);
      if (split > 0) matmul_rows(As, Bs, bias, rank * rows, split, own_slot.narrow(0, 0, split));
    } else {
      consume_flag(main, done_mine[0]);
      matmul_rows(As, Bs, bias, order[0] * rows, rows, peer_slots[0]);  // zero-copy into the peer's slot
      write_flag(main, ready_theirs[0], 1);
    }
    consume_flag(main, ready_mine[0]);
    at::Tensor out2 = out.view({rows, own_slots.size(2)});
    const int64_t lo = rank * rows + split, count = rows - split;
    at::Tensor dst = out2.narrow(0, split, count);
    add_mm(dst, theirs.narrow(0, split, count), As[0].narrow(0, lo, count), Bs[0], bias, main);
    for (size_t i = 1; i < As.size(); ++i) dst.addmm_(As[i].narrow(0, lo, count), Bs[i]);
    if (split > 0) {
      at::Tensor first = out2.narrow(0, 0, split);
      at::add_out(first, own_slot.narrow(0, 0, split), theirs.narrow(0, 0, split));  // fp32 math, one rounding
    }
    if (side.has_value()) join(main, *side);  // the next call's GEMM may overwrite the staging once pushed
    write_flag(main, done_theirs[0], 1);  // our slot is free again once it has been read
  };
  replays().run(key_of(int64_t{kRsAddmm}, As, Bs, bias, peer_slots, stage_slots, own_slot, own_slots, order,
                       done_mine, ready_theirs, ready_mine, done_theirs, out, rank, rows, split, side_handle),
                graphs, device, issue);
  return out;
}

// ---------------------------------------------------------------------------------------------
// The unsplit variants (":unsplit" choices): one GEMM over all rows, then the exchange by the copy engine.
// No overlap, but no GEMM split by rank either (at small m a split costs up to a wave per block) and the
// fewest launches (host time); the copy engine moves a block over NVLink faster than NCCL's kernels at
// these sizes. The autotuner keeps them where they are faster.

// GEMM -> reduce-scatter: P (our [m, n] partial, a local region of the symmetric buffer) in one GEMM;
// the side stream pushes each peer's block of P into its slot; we add the peers' partials of our rows.
// With `tail` > 0 (":tail<d>" choices), `tail` of our own rows are left out of that GEMM and computed while
// the copy engine pushes the peers' blocks, which the first GEMM has finished (unsplit leaves the pushes
// bare). The tail rows are the first of ours, or the last for the last rank, so that the first GEMM's rows
// are one or two contiguous ranges.
at::Tensor rs_tail(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                   const std::optional<at::Tensor>& bias, const at::Tensor& stage_all,
                   std::vector<at::Tensor> peer_slots, const at::Tensor& own_slot, const at::Tensor& own_slots,
                   const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
                   const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
                   const std::vector<int64_t>& done_theirs, const std::vector<int64_t>& out_shape, int64_t rank,
                   int64_t rows, int64_t tail, int64_t side_handle, int64_t graphs,
                   const std::vector<at::Tensor>& a_scales, const std::vector<at::Tensor>& b_scales,
                   std::optional<at::ScalarType> out_dtype, bool fast_accum) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  const Scaling scaling = scaling_of(a_scales, b_scales, out_dtype, fast_accum, As.size());
  TORCH_CHECK(0 <= tail && tail < rows, "fluxcompile: tail must be in [0, rows)");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  const auto side = external(side_handle, device);
  const int64_t m = stage_all.size(0), world = static_cast<int64_t>(peers) + 1;
  const int64_t lo = rank * rows + (rank == world - 1 ? rows - tail : 0), hi = lo + tail;
  at::Tensor out = at::empty(out_shape, stage_all.options());

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    if (tail == 0) {
      matmul_rows(As, Bs, bias, 0, m, stage_all, scaling);
    } else {
      if (lo > 0) matmul_rows(As, Bs, bias, 0, lo, stage_all.narrow(0, 0, lo), scaling);
      if (hi < m) matmul_rows(As, Bs, bias, hi, m - hi, stage_all.narrow(0, hi, m - hi), scaling);
    }
    join(side, main);
    for (size_t j = 0; j < peers; ++j) {
      send_block(side, done_mine[j], peer_slots[j], stage_all.narrow(0, order[j] * rows, rows), ready_theirs[j]);
    }
    if (tail > 0) matmul_rows(As, Bs, bias, lo, tail, stage_all.narrow(0, lo, tail), scaling);  // beside the pushes
    const at::Tensor mine = stage_all.narrow(0, rank * rows, rows);
    if (own_slots.size(0) > 2) copy_async(own_slot, mine, main);  // so one sum covers every source
    // Joining `side` also lets the next call's GEMM overwrite P only once our pushes have read it.
    reduce_and_release(main, side, mine, own_slots, order, ready_mine, done_theirs, out, rows);
  };
  replays().run(key_of(int64_t{kRsTail}, As, Bs, bias, stage_all, peer_slots, own_slot, own_slots, order, done_mine,
                       ready_theirs, ready_mine, done_theirs, out, rank, rows, tail, side_handle, scaling.tensors(),
                       scaling.word()),
                graphs, device, issue);
  return out;
}

// GEMM -> reduce-scatter, ":stages<g>" (matmul_reduce_scatter/cublas_pipelined.py): the peers' row blocks in
// groups, one GEMM per group's row range(s) into our local partial P (stage_all), each group's blocks pushed
// by the copy engine as soon as its GEMM is done, beside the next group's GEMM; our own block last, then the
// owner's sum.
at::Tensor rs_stages(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                     const std::optional<at::Tensor>& bias, const at::Tensor& stage_all,
                     std::vector<at::Tensor> peer_slots, const at::Tensor& own_slot, const at::Tensor& own_slots,
                     const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
                     const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
                     const std::vector<int64_t>& done_theirs, const std::vector<int64_t>& out_shape, int64_t rank,
                     int64_t rows, const std::vector<std::vector<int64_t>>& group_js,
                     const std::vector<std::vector<int64_t>>& group_ranges, int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  check_groups(peers, stage_all.size(0), group_js, group_ranges);
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  const auto side = external(side_handle, device);
  at::Tensor out = at::empty(out_shape, stage_all.options());

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    for (size_t g = 0; g < group_js.size(); ++g) {
      const auto& rs = group_ranges[g];
      for (size_t i = 0; i < rs.size(); i += 2) {
        matmul_rows(As, Bs, bias, rs[i], rs[i + 1] - rs[i], stage_all.narrow(0, rs[i], rs[i + 1] - rs[i]));
      }
      join(side, main);
      for (int64_t j : group_js[g]) {
        send_block(side, done_mine[j], peer_slots[j], stage_all.narrow(0, order[j] * rows, rows), ready_theirs[j]);
      }
    }
    // Our own block: straight into our slot where the sum reads every slot (> 2 ranks), else into P.
    const bool two = own_slots.size(0) == 2;
    const at::Tensor mine = two ? stage_all.narrow(0, rank * rows, rows) : own_slot;
    matmul_rows(As, Bs, bias, rank * rows, rows, mine);
    const auto pushed = peers ? std::optional<c10::cuda::CUDAStream>(side) : std::nullopt;  // see rs_pipelined
    reduce_and_release(main, pushed, mine, own_slots, order, ready_mine, done_theirs, out, rows);
  };
  replays().run(key_of(int64_t{kRsStages}, As, Bs, bias, stage_all, peer_slots, own_slot, own_slots, order,
                       done_mine, ready_theirs, ready_mine, done_theirs, out, rank, rows, group_js, group_ranges,
                       side_handle),
                graphs, device, issue);
  return out;
}

}  // namespace fluxcompile::pipelined
