"""Every kernel of the fused ops with its launcher, whatever its language: one kernel family per file, its tile
variants (``Variant``, ``VARIANTS``) beside it.

* Triton: ag_gemm.py (all-gather -> GEMM), gemm_rs.py (GEMM -> reduce-scatter), gemm_ar.py (decode's GEMM ->
  all-reduce), grouped_gemm.py (MoE dispatch and combine), embedding_bag.py (DLRM); the facilities they share: waits.py (bounded waits and error words) and
  tma_scratch.py (the scratch of device-side TMA descriptors).
* CUTLASS: cutlass_gemm.py launches csrc/flux_gemm.cuh (plain, or with the reduce-scatter ring's source and
  epilogue); cutlass_build.py is its build spec (variants, generated sources, include paths).
* CUDA/C++: gemv_ar.py launches csrc/gemv_ar.cu; sequencer.py loads the cuBLAS-pipelined choices' C++ stream
  sequences; extensions.py builds and loads every csrc module on first use.

Nothing here imports from lowerings/: the choices there hold the protocols and call these launchers.
"""
