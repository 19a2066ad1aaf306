"""The launch functions of the protocols that the one-GPU harness orders (one_gpu_ranks.py, ``launches``): per
protocol, ``(module, name)`` pairs of the launchers it calls through their module, in the order every rank makes
them; the harness patches each on its module while the simulated ranks' calls run.

Every simulated rank shares one CUDA context, where loading a kernel's module waits for the device to drain: the
launches listed are those that may load one (a Triton kernel's first launch of a specialization, a CUTLASS kernel
of another layout or dtype). Ordered by the harness's turnstile, no rank loads a module while a peer's queued
kernel waits for this rank. No launch of these protocols needs a peer's launch of the same or a later position
(tests/kernel_checks/moe_protocol_interpreted.py checks the MoE protocols so), but for the CUTLASS all-gather's C++
sequence: one launch that pushes this rank's rows and runs the GEMMs that wait for the peers' pushes, which their
sequences of the same position make. It returns without waiting for the device only where its kernels are
loaded already: its callers load them first (tests/gpu/test_cutlass_ranks.py).
"""

from __future__ import annotations

from typing import Any

from ..kernels import cutlass_gemm, cutlass_grouped

try:
    from ..kernels import embedding_bag, embedding_bag_backward, grouped_gemm
except ImportError:  # no Triton: none of these protocols runs
    embedding_bag = embedding_bag_backward = grouped_gemm = None

Launches = tuple[tuple[Any, str], ...]

# all_gather_matmul's ``cutlass`` choices (lowerings/all_gather_matmul/cutlass.py): one C++ sequence per call
# (its pushes, then one GEMM per weight).
CUTLASS_ALL_GATHER: Launches = ((cutlass_gemm, "ag_sequence"),)
# matmul_reduce_scatter's ``cutlass`` choices: one C++ sequence per call (the ring's GEMM and its pushes).
CUTLASS_REDUCE_SCATTER: Launches = ((cutlass_gemm, "rs_sequence"),)
# The MoE dispatch and combine (lowerings/all_to_all/triton.py): publish, the wait for the peers' reads, the
# grouped GEMM's launch; the CUTLASS dispatch's (lowerings/all_to_all/cutlass.py) permuted pull and its CUTLASS
# grouped GEMM.
MOE: Launches = (
    (
        *((grouped_gemm, name) for name in ("publish", "wait_done", "launch_grouped", "permuted_pull")),
        (cutlass_grouped, "grouped_mm"),
    )
    if grouped_gemm is not None
    else ()
)
# The DLRM embedding-bag all-to-all (lowerings/embedding_bag_all_to_all/triton.py).
DLRM: Launches = (
    tuple((embedding_bag, name) for name in ("publish", "fetch_offsets", "pool", "wait", "copy_out"))
    if embedding_bag is not None
    else ()
)
# The DLRM backward (lowerings/all_to_all_embedding_bag_backward/triton.py).
DLRM_BACKWARD: Launches = (
    tuple((embedding_bag_backward, name) for name in ("publish", "fetch", "rows", "stage", "signal", "wait", "scatter"))
    if embedding_bag_backward is not None
    else ()
)
