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
loaded already: its callers load them first (:func:`load_cutlass_all_gather`, :func:`load_cutlass_reduce_scatter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

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


def load_cutlass_all_gather(variant: str, weights: Sequence[Tensor]) -> None:
    """Load the GEMM's kernel for each weight's layout and dtype before the simulated ranks run. The all-gather's
    C++ sequence is one launch of the turnstile that holds both of a call's GEMMs; a first launch of a kernel loads
    its module, which waits for the device to drain, while the first GEMM of the same sequence already waits for
    the pushes of the peers' sequences, which come later: so no kernel may load inside it."""
    for b in weights:
        a = torch.zeros(128, b.shape[0], dtype=b.dtype, device=b.device)
        cutlass_gemm.gemm(a, b, torch.empty(128, b.shape[1], dtype=b.dtype, device=b.device), variant=variant)
    torch.zeros(4, dtype=torch.int32, device="cuda").zero_()  # the sequence's reset of its arrival flags
    # The sequence's other operations (its copies, the error words' copy to pinned memory, the event records) made
    # once at one rank: the first in a process may wait for the device (a first all-gather case failed so).
    a = torch.randn(128, weights[0].shape[0], dtype=weights[0].dtype, device="cuda")
    event = torch.cuda.Event()
    event.record()
    err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
    cutlass_gemm.ag_sequence(
        a, list(weights), [None] * len(weights), [128, a.shape[1]], [], torch.empty_like(a), [0, 128], [], [], [],
        torch.ones(1, dtype=torch.int32, device="cuda"), err, rank=0, world=1, chunk_rows=128, variant=variant,
        sm_count=0, side=torch.cuda.Stream(), err_host=torch.zeros_like(err, device="cpu").pin_memory(),
        events=[event.cuda_event],
    )  # fmt: skip
    torch.cuda.synchronize()


def load_cutlass_reduce_scatter(variant: str, weights: Sequence[Tensor]) -> None:
    """The reduce-scatter's sequence at one rank (its GEMM per weight layout, the flags, the copies and the error
    words' copy) before the simulated ranks run: a first launch of a kernel loads its module, which waits for the
    device, where the peers' streams wait for this rank's pushes. Rank 0 of two whose peer
    is a local stand-in: its running sums preset as arrived, its flags local words."""
    tm = cutlass_gemm.VARIANTS[variant].tile[0]
    for b in weights:
        m, n = 2 * tm, b.shape[1]
        a = torch.randn(m, b.shape[0], dtype=b.dtype, device="cuda")
        like = dict(dtype=b.dtype, device="cuda")
        flags = torch.zeros(8, dtype=torch.int32, device="cuda")  # [0:2] counters, [2:4] arrived, [4] done, ...
        flags[2:5] = 1
        err = torch.zeros(cutlass_gemm.ERR_WORDS, dtype=torch.int32, device="cuda")
        event = torch.cuda.Event()
        event.record()
        addr = flags.data_ptr()
        cutlass_gemm.rs_sequence(
            a, b, None, None, torch.empty(m, n, **like), torch.zeros(m, n, **like), torch.empty(m, n, **like),
            torch.zeros(tm, n, **like), flags[0:2], flags[2:4], cutlass_gemm.tiles_per_chunk(variant, m, n, tm, 0),
            addr + 20, addr + 16, addr + 28, err, [tm, n], rank=0, world=2, axis=0, chunk=tm, sub=tm, scale=1.0,
            variant=variant, sm_count=0, side=torch.cuda.Stream(),
            err_host=torch.zeros_like(err, device="cpu").pin_memory(), events=[event.cuda_event],
        )  # fmt: skip
    torch.cuda.synchronize()
