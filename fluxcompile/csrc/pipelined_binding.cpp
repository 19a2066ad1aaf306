// The `pipelined` Python module (pybind11): the sequences of sequences.h and their replays' counters.
#include <torch/extension.h>

#include "cublaslt_addmm.h"
#include "replays.h"
#include "sequences.h"

using namespace fluxcompile::pipelined;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rs_pipelined", &rs_pipelined, "GEMM -> reduce-scatter, cuBLAS-pipelined");
  m.def("rs_addmm", &rs_addmm, "GEMM -> reduce-scatter at two ranks: the peer's partial added in our GEMM's epilogue");
  m.def("lt_available", &lt_available, "whether add_mm finds cuBLASLt (else it copies C into D first)");
  m.def("ag_pipelined", &ag_pipelined, "all-gather -> GEMM, cuBLAS-pipelined");
  m.def("rs_stages", &rs_stages, "GEMM -> reduce-scatter: one GEMM per group of peers, then our own block");
  m.def("rs_tail", &rs_tail,
        "GEMM -> reduce-scatter: all rows but a tail of ours (none: unsplit), then the tail beside the pushes");
  m.def("ag_unsplit", &ag_unsplit, "all-gather by the copy engine, then one GEMM per weight");
  m.def("ag_stages", &ag_stages, "all-gather -> GEMM: our rows, then one GEMM per group of peers");
  m.def("ag_lead", &ag_lead, "all-gather -> GEMM: a lead GEMM over some of our rows, then the rest in one");
  m.def("ag_flux", &ag_flux, "all-gather -> GEMM: one Flux-style CUTLASS GEMM per weight whose tiles wait for their chunks");
  m.def("rs_ring", &rs_ring, "GEMM -> reduce-scatter as a ring in one Flux-style CUTLASS GEMM: each tile adds the "
        "running sum of its chunk from the next rank, sub-chunks pushed on as they are stored");
  m.def("replay_stats", [] { return replays().stats(); },
        "[replays, captures, direct calls, failed captures, graphs held] since the last clear");
  m.def("clear_replays", [] { replays().clear(); }, "drop every captured sequence (tests; stale workspaces)");
  m.def("capture_failure", [] { return replays().last_failure(); },
        "why the last failed capture since the last clear failed (empty: none failed)");
}
