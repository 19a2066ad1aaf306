// Host sequencers of the cuBLAS-pipelined choices (fluxcompile/lowerings/all_gather_matmul/cublas_pipelined.py
// and matmul_reduce_scatter/cublas_pipelined.py): the only implementation of their stream sequences.
//
// A call issues ten to thirty stream operations; from Python each costs as much host time as a small GEMM's
// GPU time, so they are issued here. Slot views, flag addresses and the order of the peers are precomputed
// once per call signature by the Python side (its "plan", with the order and flags of
// fluxcompile/symm_mem/exchange.py); this module only issues the GEMMs, copies, events and flag memory operations.
//
// The module's files: the sequences (sequences_ag.cpp, sequences_rs.cpp, sequences_flux.cpp; their shared steps in
// sequences.cpp), built from flag memops (memops.h), stream steps (streams.h), cuBLASLt's addmm (cublaslt_addmm.h),
// the Flux-style CUTLASS GEMM through the flux_gemm module's entry (flux_problem.h) and replayed as CUDA graphs
// (replays.h); pipelined_binding.cpp makes them the Python module.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

namespace fluxcompile::pipelined {

// Which sequence a key belongs to (its first word).
enum SequenceId : int64_t {
  kRsPipelined = 1, kAgPipelined, kRsTail, kAgUnsplit, kAgLead, kAgStages, kRsStages, kRsAddmm, kAgFlux, kRsRing
};

// ---- steps shared by both families (sequences.cpp) ----
void check_lengths(size_t n, std::initializer_list<size_t> sizes);

// The scaling of a call's matmuls (fp8: torch._scaled_mm, ops.py "Scaled matmuls"); none where b_scales is empty.
// a_scales[i] scales the i-th matmul's left operand: one element, or one per row ([rows, 1], taken with the rows);
// b_scales[i] its weight: one element, or [1, n]. The sequences that take one pass it on from Python as four
// arguments after their others (scaling_of).
struct Scaling {
  std::vector<at::Tensor> a_scales, b_scales;
  std::optional<at::ScalarType> out_dtype;
  bool fast_accum = false;
  bool on() const { return !b_scales.empty(); }
  // The key words of a replay: the scales' addresses, the dtype and the flag.
  std::vector<at::Tensor> tensors() const;
  int64_t word() const;
};
Scaling scaling_of(const std::vector<at::Tensor>& a_scales, const std::vector<at::Tensor>& b_scales,
                   std::optional<at::ScalarType> out_dtype, bool fast_accum, size_t matmuls);

// out <- a @ b (+ bias): mm/addmm, or, where `scaling` is on, its i-th scaled matmul, a being rows lo .. of the
// operand its row-wise scale belongs to.
void matmul_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                const Scaling& scaling, size_t i, int64_t lo);
// The options of a call's products: the operand's, with the scaled matmuls' out_dtype.
at::TensorOptions product_options(const at::Tensor& a, const Scaling& scaling);

// On `side`: once the peer has freed its slot (its done flag), the copy engine moves `src` into it (peer to
// peer), then the peer's ready flag.
void send_block(const c10::cuda::CUDAStream& side, int64_t done, const at::Tensor& dst, const at::Tensor& src,
                int64_t ready);

// The groups of the ":stages" choices: every peer's flag is taken exactly once per call (a stale 1 would pass
// the next call's wait), and every range is rows lo < hi within [0, m). Checked before any stream operation.
void check_groups(size_t peers, int64_t m, const std::vector<std::vector<int64_t>>& group_js,
                  const std::vector<std::vector<int64_t>>& group_ranges);

// ---- the sequences, each described at its definition ----
// GEMM -> reduce-scatter (sequences_rs.cpp)
at::Tensor rs_pipelined(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                        const std::optional<at::Tensor>& bias, std::vector<at::Tensor> peer_slots,
                        const std::vector<at::Tensor>& stage_slots, const at::Tensor& own_slot,
                        const at::Tensor& own_slots, const std::vector<int64_t>& order,
                        const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
                        const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                        const std::vector<int64_t>& out_shape, int64_t rank, int64_t rows, bool push,
                        int64_t side_handle, int64_t graphs, const std::vector<at::Tensor>& a_scales,
                        const std::vector<at::Tensor>& b_scales, std::optional<at::ScalarType> out_dtype,
                        bool fast_accum);
at::Tensor rs_addmm(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                    const std::optional<at::Tensor>& bias, std::vector<at::Tensor> peer_slots,
                    const std::vector<at::Tensor>& stage_slots, const at::Tensor& own_slot,
                    const at::Tensor& own_slots, const std::vector<int64_t>& order,
                    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
                    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                    const std::vector<int64_t>& out_shape, int64_t rank, int64_t rows, int64_t split,
                    int64_t side_handle, int64_t graphs);
at::Tensor rs_tail(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                   const std::optional<at::Tensor>& bias, const at::Tensor& stage_all,
                   std::vector<at::Tensor> peer_slots, const at::Tensor& own_slot, const at::Tensor& own_slots,
                   const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
                   const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
                   const std::vector<int64_t>& done_theirs, const std::vector<int64_t>& out_shape, int64_t rank,
                   int64_t rows, int64_t tail, int64_t side_handle, int64_t graphs,
                   const std::vector<at::Tensor>& a_scales, const std::vector<at::Tensor>& b_scales,
                   std::optional<at::ScalarType> out_dtype, bool fast_accum);
at::Tensor rs_stages(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                     const std::optional<at::Tensor>& bias, const at::Tensor& stage_all,
                     std::vector<at::Tensor> peer_slots, const at::Tensor& own_slot, const at::Tensor& own_slots,
                     const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
                     const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
                     const std::vector<int64_t>& done_theirs, const std::vector<int64_t>& out_shape, int64_t rank,
                     int64_t rows, const std::vector<std::vector<int64_t>>& group_js,
                     const std::vector<std::vector<int64_t>>& group_ranges, int64_t side_handle, int64_t graphs);

// all-gather -> GEMM (sequences_ag.cpp)
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_pipelined(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const std::vector<at::Tensor>& my_slots,
    const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
    const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
    const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world, int64_t side_handle,
    const std::vector<int64_t>& compute_handles, int64_t graphs, bool return_A, const std::vector<at::Tensor>& a_scales,
    const std::vector<at::Tensor>& b_scales, std::optional<at::ScalarType> out_dtype, bool fast_accum);
std::tuple<at::Tensor, std::vector<at::Tensor>> ag_unsplit(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const std::vector<at::Tensor>& my_slots, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    int64_t side_handle, int64_t graphs, const std::vector<at::Tensor>& a_scales,
    const std::vector<at::Tensor>& b_scales, std::optional<at::ScalarType> out_dtype, bool fast_accum);
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_lead(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    int64_t lead, int64_t side_handle, int64_t aux_handle, int64_t graphs, bool return_A);
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_stages(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    const std::vector<std::vector<int64_t>>& group_js, const std::vector<std::vector<int64_t>>& group_ranges,
    int64_t side_handle, int64_t graphs, bool return_A);

// all-gather -> the Flux-style CUTLASS GEMM (sequences_flux.cpp; the GEMM through flux_problem.h)
std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> ag_flux(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    const std::vector<at::Tensor>& peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& chunk_bounds,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& arrived_theirs,
    const std::vector<int64_t>& done_theirs, const at::Tensor& arrived, const at::Tensor& err, int64_t rank,
    int64_t world, int64_t chunk_rows, const std::vector<int64_t>& gemm, int64_t side_handle, int64_t graphs,
    bool in_place, bool return_A, const std::optional<at::Tensor>& err_host, const std::vector<int64_t>& events);

// the Flux-style CUTLASS GEMM -> reduce-scatter, a ring in one GEMM (sequences_flux.cpp)
at::Tensor rs_ring(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& bias_scratch, const at::Tensor& partial,
                   const at::Tensor& incoming, const at::Tensor& peer_incoming, const at::Tensor& zero,
                   const at::Tensor& counters, const at::Tensor& arrived,
                   const std::vector<int64_t>& tiles, int64_t arrived_theirs, int64_t done_mine, int64_t done_theirs,
                   const at::Tensor& err, const std::optional<at::Tensor>& err_host, const std::vector<int64_t>& events,
                   const std::vector<int64_t>& out_shape, int64_t rank, int64_t world, int64_t axis, int64_t chunk,
                   int64_t sub, double scale, const std::vector<int64_t>& gemm, int64_t side_handle, int64_t graphs);

}  // namespace fluxcompile::pipelined
