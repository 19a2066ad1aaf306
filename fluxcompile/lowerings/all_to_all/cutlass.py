"""all_to_all_matmul (MoE dispatch) with the experts' CUTLASS grouped GEMM (kernels/cutlass_grouped.py,
csrc/cutlass_grouped.cuh) fed by Flux's permuting copy (``grouped_gemm.permuted_pull``): a few programs on the side
stream pull the experts' rows from the sources' send buffers straight into their expert order, a block of
``grouped_gemm.COPY_M`` rows at a time, and raise each block's flag; the GEMM on the main stream (on the other SMs)
waits per tile for the blocks its rows overlap, so it starts on the first blocks while later ones are still in
flight. Hopper's TMA cannot gather rows by an index, so the permutation happens in the copy, never in the GEMM.

Per call, on rank r (``A`` its rows in ``[destination][...]`` order):
  main:  [wait_done, copy A's rows for the peers into r's send buffer, publish]   (triton.stage_rows, shared with
         the Triton dispatch: the same send buffer, flags and epochs)
  side:  (after main's publish) permuted_pull: every source's ``ready`` awaited, then ``x[j] =
         A_exchanged[row_index[j]]`` (a padding index a zero row), block flag t := the call's epoch once block t
         has landed; with ``return_A`` the exchanged rows in source order too (``A_exchanged``); the last program
         tells every source ``done``
  main:  per weight: grouped GEMM of ``x`` with the weight, each tile waiting (bounded) for its blocks' flags
         to reach the call's epoch (read on the device) -> join the side stream
Without ``row_index`` the experts' rows are the exchanged rows themselves (``x`` is ``A_exchanged``).

The block flags (int32, one per block of ``x``) are this context's, made on its first call (and grown eagerly) and
epoch-valued like every other flag of the protocol, so nothing is reset between calls and CUDA graphs replay it.
A wait that times out writes the context's error words (``grouped_gemm.WAIT_KINDS`` kind 8 for the GEMM's block
waits), reported as the Triton dispatch's are.

Off by default (family ``moe``): its choices run only where ``config.implementations`` has ``moe``. bf16 with expert
weights grouped by ``offs`` only (the CUTLASS kernel's operands); ``bmm`` (equal groups without ``offs``) and
other dtypes are declined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...kernels import cutlass_grouped
from ...symm_mem import Comm, capturing, persistent
from . import triton

gg = triton.gg  # kernels/grouped_gemm.py (Triton): the permuted pull and the protocol's flags

NAME = "cutlass"
COPIERS = (8, 32)  # the permuted pull's programs (one per SM), per choice
PULL = "-pull"  # "<variant>-pull<N>"
NAMES = [f"{v}{PULL}{n}" for v in cutlass_grouped.GROUPED_VARIANTS for n in COPIERS]
# The launches timed per call (one choice, its variants as data): the best of the recorded one-GPU runs
# (benchmarks/results/moe-peers-1xh200-2026-11-28-cutlass.json).
TIMED = ("128x256x64_c2x1-pull8", "128x128x64_c1x2_pp-pull16")
_BLOCK_FLAGS = "the MoE dispatch's block flags"


def parse(name: str) -> tuple[str, int]:
    """(grouped GEMM variant, pulling programs) of a choice name's part after ``cutlass:``."""
    variant, sep, n = name.rpartition(PULL)
    if not sep or variant not in cutlass_grouped.GROUPED_VARIANTS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"fluxcompile: no CUTLASS MoE dispatch choice {name!r}")
    return variant, int(n)


def supports(
    A, Bs, biases, output_split_sizes, input_split_sizes, group_name,
    A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None, return_A=True,
    choice="",
) -> str | None:  # fmt: skip
    """None when the CUTLASS dispatch handles this all_to_all_matmul call, else why not (never raises)."""
    why = triton.dispatch_supports(
        A, Bs, biases, output_split_sizes, input_split_sizes, group_name, A_scale, B_scales, out_dtype,
        use_fast_accum, offs, row_index,
    )  # fmt: skip
    if why is not None:
        return why
    try:
        if offs is None:
            return "equal expert groups without offs (bmm): the Triton choices take them"
        if A.dtype != torch.bfloat16:
            return f"dtype {A.dtype} (the CUTLASS grouped GEMM is bf16)"
        if A.shape[-1] % 8:
            return "rows that are not 16-byte aligned"  # (A itself is copied where it is not aligned)
        for b in Bs:  # metadata only: the compile-time decision asks with fake tensors
            if cutlass_grouped.weight_layout(b) is None or b.storage_offset() % 8 or b.stride(0) % 8 or b.shape[2] % 8:
                return "a weight that is neither [E, K, N] nor the transpose of [E, N, K] with 16-byte aligned rows"
        return cutlass_grouped.unavailable()
    except Exception as e:  # a broken check declines
        return f"supports() raised {type(e).__name__}: {e}"


def make(name: str) -> tuple[Callable[..., tuple[Tensor | None, list[Tensor]]], Callable[..., str | None]]:
    """(fn, supports) of all_to_all_matmul's choice ``cutlass:<variant>-pull<N>``."""
    variant, copiers = parse(name)

    def run(
        A, Bs, biases, output_split_sizes, input_split_sizes, group_name,
        A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None,
        return_A=True, choice="",
    ):  # fmt: skip
        world = triton.group_world(group_name)
        comm = triton.group_comm(group_name, world, triton.dispatch_bytes(A, world), triton.DISPATCH_TAG)
        return all_to_all_matmul_on(
            comm, A, Bs, output_split_sizes, input_split_sizes, offs, row_index,
            variant=variant, copiers=copiers, return_A=return_A,
        )  # fmt: skip

    return run, supports


def block_flags(comm: Comm, device: torch.device, blocks: int) -> Tensor:
    """This context's block flags (int32, at least ``blocks``), made on first use and grown eagerly: under CUDA
    graph capture a call needs them made already (an eager call with as many rows first)."""
    key = ("cutlass block flags", device)
    have = comm.tables.get(key)
    if have is None or have.numel() < blocks:
        if capturing(device):
            raise RuntimeError(
                f"fluxcompile: {_BLOCK_FLAGS} cannot grow during CUDA graph capture; run the dispatch eagerly with "
                "as many rows first"
            )
        if have is not None:
            comm.tables.setdefault(("cutlass retired block flags", device), []).append(have)  # a graph may read it
        size = 1 << max(10, (blocks - 1).bit_length())
        have = persistent(lambda: torch.zeros(size, dtype=torch.int32, device=device), _BLOCK_FLAGS)
        comm.tables[key] = have
    return have


def gemm_sms(comm: Comm, device: torch.device, copiers: int) -> int:
    """The GEMM's SMs: the context's share (the one-GPU harness), else the device's but the pull's, even (2-SM
    clusters)."""
    if comm.sm_count:
        return comm.sm_count
    if device.type != "cuda":
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(2, (sms - copiers) // 2 * 2)


def all_to_all_matmul_on(
    comm: Comm, A: Tensor, Bs: Sequence[Tensor], output_split_sizes, input_split_sizes,
    offs: Tensor, row_index: Tensor | None = None, *, variant: str, copiers: int = COPIERS[-1], return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:  # fmt: skip
    """The dispatch's results on the rank of ``comm`` (every rank of its group makes the same call; ``comm.side``
    the side stream): the protocol of the module's docstring. ``(None, outs)`` where ``return_A`` is False."""
    what = f"all_to_all_matmul ({NAME}:{variant}{PULL}{copiers})"
    if comm.side is None:
        raise ValueError(f"fluxcompile: {what} needs a side stream in its communication context")
    k = A.shape[-1]
    a_local, send, recv, unit = triton.dispatch_rows(A, output_split_sizes, input_split_sizes, comm.world, what)
    received = sum(recv)
    device = A.device
    sig = triton.signals(comm)
    comm.errors.check_previous(what, triton.checker(comm.group_name))
    offs32 = offs if offs.dtype == torch.int32 else offs.to(torch.int32)

    triton.stage_rows(comm, sig, a_local, send, what)

    A_exchanged = None
    if return_A or row_index is None:
        A_exchanged = torch.empty([received // unit if unit else 0, *A.shape[1:]], dtype=A.dtype, device=device)
    if row_index is None:
        x, exchanged = A_exchanged.view(received, k), None
    else:
        x = torch.empty(row_index.numel(), k, dtype=A.dtype, device=device)
        exchanged = A_exchanged.view(received, k) if A_exchanged is not None else None
    flags = block_flags(comm, device, -(-max(x.shape[0], 1) // gg.COPY_M))
    epoch = sig.my_flags[gg.STATE : gg.STATE + 1]  # the call's epoch, which publish advanced (read on the device)
    rows = row_index.contiguous() if row_index is not None else None

    main = torch.cuda.current_stream(device)
    comm.side.wait_stream(main)
    with torch.cuda.stream(comm.side):
        gg.permuted_pull(gg.Pull(a_local, triton.data_bases(comm), x, received), rows, flags, sig, copiers, exchanged)
    sms = gemm_sms(comm, device, copiers)
    outs = []
    for b in Bs:
        out = torch.empty(x.shape[0], b.shape[2], dtype=A.dtype, device=device)
        outs.append(out)
        if not x.shape[0]:
            continue
        cutlass_grouped.grouped_mm(
            x, b, offs32, out, variant=variant, sm_count=sms, wait=(flags, gg.COPY_M, epoch), err=comm.errors.err,
            rank=comm.rank,
        )  # fmt: skip
    main.wait_stream(comm.side)
    comm.errors.report(what, triton.checker(comm.group_name))
    return (A_exchanged if return_A else None), outs
