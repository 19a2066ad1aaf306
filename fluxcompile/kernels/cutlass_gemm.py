"""Launcher of the Flux-style CUTLASS GEMM (csrc/flux_gemm.cuh): one persistent warp-specialized sm_90a GEMM per
call, whose tiles may wait for the chunks holding their rows (all-gather) and whose epilogue may count stored
tiles on per-chunk counters and add the running sums of a reduce-scatter ring (:class:`Ring`).

``VARIANTS`` (cutlass_build.py, the build spec) is the one list of tile configurations, each compiled into the
extension; a call picks one by name. Launch options that cost no compilation (raster order, swizzle, SM
count) are arguments of :func:`gemm`. CUTLASS's headers come from the ``nvidia-cutlass`` package
(``cutlass_library/source/include``); without them, or off Hopper, :func:`unavailable` gives the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import config
from . import extensions
from .cutlass_build import VARIANTS, cutlass_include
from .sequencer import graph_limit, sequencer
from .stream_scratch import StreamScratch

RASTERS = {"auto": 0, "m": 1, "n": 2}
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 2}  # e4m3: the fp8 variants, a bf16 output
ERR_WORDS = 6  # csrc/flux_gemm.h FluxGemmSync::err
MAX_WORLD = 64  # ranks of a group the CUTLASS choices' flag arrays hold (lowerings/*/cutlass.py)


def unavailable(device: torch.device | None = None) -> str | None:
    """Why the kernels cannot run here (None if they may)."""
    if cutlass_include() is None:
        return "CUTLASS headers missing (pip install nvidia-cutlass)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "the CUTLASS kernels are built for Hopper (sm_90a) only"
    return None


def group_declines(group_size: int, A: Tensor) -> str | None:
    """The reasons both ops' CUTLASS choices share: the group's size, no kernel for ``A``'s device."""
    if group_size < 2:
        return "one rank: nothing to overlap"
    if group_size > MAX_WORLD:
        return f"more than {MAX_WORLD} ranks"
    return unavailable(A.device if A.is_cuda else None)


def operand_unsupported(a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> str | None:
    """Why ``a @ b`` (a [M, K], b [K, N]) does not fit the kernels' layouts and dtypes (None if it does)."""
    if a.dtype not in DTYPES:
        return f"dtype {a.dtype} (bf16 and fp16 only)"
    if b.dtype != a.dtype or (out_dtype is not None and out_dtype != a.dtype):
        return "mixed dtypes"
    if a.dim() != 2 or b.dim() != 2:
        return "operands that are not matrices"
    align = 16 // a.element_size()
    if a.stride(1) != 1 or a.stride(0) % align or a.shape[1] % align:
        return "A is not row-major with 16-byte aligned rows"
    if weight_layout(b) is None:
        return "a weight that is neither [K, N] row-major nor the transpose of an [N, K] row-major one"
    ld = b.stride(0) if weight_layout(b) == "kn" else b.stride(1)
    if ld % align or b.shape[1] % align or b.shape[0] % align:
        return "weight dims or strides not 16-byte aligned"
    return None


def variants(fp8: bool = False) -> list[str]:
    """The 16-bit variants, or (``fp8``) the e4m3 ones (VARIANTS' ``fp8``)."""
    return [name for name, v in VARIANTS.items() if v.fp8 == fp8]


def scales_unsupported(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> str | None:
    """Why ``scale_a * scale_b * (a @ b)`` (e4m3 ``a`` [M, K] and ``b`` [K, N], float32 scales: one each, or one per
    row of ``a`` and one per column of ``b``) does not fit the fp8 variants (None if it does)."""
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return f"operands {a.dtype} x {b.dtype} (e4m3 x e4m3 only)"
    if out_dtype != torch.bfloat16:
        return f"output {out_dtype} (bf16 only)"
    if a.dim() != 2 or b.dim() != 2 or a.stride(1) != 1 or a.stride(0) % 16 or a.shape[1] % 16:
        return "A is not row-major with 16-byte aligned rows"
    if weight_layout(b) != "nk" or b.stride(1) % 16 or b.shape[1] % 8:
        return "the weight is not K-major with 16-byte aligned columns (fp8 needs the transpose of an [N, K] row-major)"
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return "scales that are not float32"
    m, n = a.shape[0], b.shape[1]
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return None
    if scale_a.numel() == m and scale_b.numel() == n and scale_a.is_contiguous() and scale_b.is_contiguous():
        return None
    return "scales that are neither tensor-wise nor one per row of A and one per column of B, contiguous"


def weight_layout(b: Tensor) -> str | None:
    """``"kn"``: b[k, n] at k * ld + n; ``"nk"`` (K-major, an nn.Linear weight's transpose): at n * ld + k."""
    if b.stride(1) == 1 and b.stride(0) >= b.shape[1]:
        return "kn"
    if b.stride(0) == 1 and b.stride(1) >= b.shape[0]:
        return "nk"
    return None


def load():
    """The built extension (extensions.load raises Unavailable with the reason)."""
    return extensions.load("flux_gemm")


@functools.cache
def _index(name: str) -> int:
    return list(load().names()).index(name)


# Scratch for stream-K's partials, so GEMMs on concurrent streams never share it.
_scratch = StreamScratch("the CUTLASS GEMM's scratch", 1 << 20)


@dataclasses.dataclass(frozen=True)
class Ring:
    """The reduce-scatter ring's part of a GEMM (csrc/flux_gemm.h's ring fields; variants built with ``ring``):
    ``out = alpha * a @ b + c + bias`` per tile, chunk by chunk along ``axis`` (``chunk`` elements each).

    c: [m, n], the running sums added to every tile but those of ``zero_chunk``, which add ``zero`` (zeros,
      [TM, n] for row chunks or [m, TN] for column chunks); flags: int32, one per sub-chunk of ``sub`` elements
      along the axis: a tile's C is loaded once the flag of every sub-chunk it overlaps is non-zero (written by rank
      ``peer``; None: no waits); the tiles of ``own_chunk`` store into ``out`` (that chunk alone) instead of the
      GEMM's output and count nothing. ``chunk`` and ``sub`` are multiples of the tile along ``axis``."""

    c: Tensor
    flags: Tensor | None
    axis: int
    chunk: int
    sub: int
    peer: int
    zero_chunk: int
    own_chunk: int
    zero: Tensor
    out: Tensor
    alpha: float = 1.0


def gemm(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    bias: Tensor | None = None,
    *,
    variant: str,
    raster: str = "auto",
    swizzle: int = 1,
    sm_count: int = 0,
    rotate: tuple[int, int] = (0, 0),
    wait: tuple[Tensor, int, int, int] | None = None,
    signal: tuple[Tensor, int, int] | None = None,
    err: Tensor | None = None,
    rank: int = 0,
    local: tuple[Tensor, int] | None = None,
    group_m: int = 0,
    ring: Ring | None = None,
    scales: tuple[Tensor, Tensor] | None = None,
    fast_accum: bool = False,
) -> Tensor:
    """``out = a @ b (+ bias)`` on the current stream with the variant ``variant`` (a name of VARIANTS).

    scales: (scale_a, scale_b) of e4m3 operands and an fp8 variant (:func:`scales_unsupported` says what fits):
      ``out = scale_a * scale_b * (a @ b) + bias`` into bf16, as ``torch._scaled_mm`` with ``use_fast_accum`` =
      ``fast_accum``.

    rotate: (axis, element): tiles along axis 0 (M) or 1 (N) start at the tile holding that element.
    wait: (flags, rows_per_rank, chunk_rows, skip_rank): flags int32 [ranks * chunks_per_rank]; a tile waits until
      the flag of every chunk holding its rows is non-zero (bounded by ``config.wait_timeout_s``; a timeout
      fills ``err``, int32 [ERR_WORDS]).
    signal: (counters, chunk_elems, axis): once a tile's stores have landed, +1 on counters[c] for each chunk of
      chunk_elems rows (axis 0) or columns (axis 1) it overlaps; see :func:`tiles_per_chunk`.
    local: (shard, row0): rows ``[row0, row0 + rows_per_rank)`` of ``a`` are read from ``shard`` (row-major,
      16-byte aligned) instead, through their own TMA descriptor; ``row0`` and ``rows_per_rank`` (of ``wait``)
      multiples of the tile's M.
    group_m: the grouped tile order (csrc/flux_gemm.h): groups of ``group_m`` rows of tiles, each worked through
      M-first, the groups from the tile of ``rotate``'s element along M on (0: ``rotate`` alone).
    ring: the reduce-scatter ring's source and chunks (:class:`Ring`; the variant's ring build).
    """
    v = VARIANTS[variant]
    m, k = a.shape
    n = b.shape[1]
    layout = weight_layout(b)
    if signal is not None and v.stream_k:
        raise ValueError("fluxcompile: stream-K variants do not signal per tile")
    if (wait is not None or signal is not None or (ring is not None and ring.flags is not None)) and err is None:
        raise ValueError("fluxcompile: waits and signals need an error buffer")
    if v.fp8 != (scales is not None):
        raise ValueError(f"fluxcompile: variant {variant} is for {'scaled e4m3' if v.fp8 else '16-bit'} operands")
    if scales is not None and (why := scales_unsupported(a, b, scales[0], scales[1], out.dtype)) is not None:
        raise ValueError(f"fluxcompile: the fp8 CUTLASS GEMM does not take {why}")
    if scales is not None and not fast_accum and not v.promotes:
        raise ValueError(f"fluxcompile: variant {variant} is built with fast accumulation only (see promotes)")
    ldb = b.stride(0) if layout == "kn" else b.stride(1)
    device = a.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    q = [
        a.data_ptr(), b.data_ptr(), out.data_ptr(), bias.data_ptr() if bias is not None else 0,
        m, n, k, a.stride(0), ldb, out.stride(0), int(layout == "nk"), DTYPES[a.dtype],
        sm_count, RASTERS[raster], swizzle, index, 0,
    ]  # fmt: skip
    flags, rows_per_rank, chunk_rows, skip = wait if wait is not None else (None, 0, 0, -1)
    counters, sig_elems, sig_axis = signal if signal is not None else (None, 0, 0)
    if ring is not None:
        check_ring(ring, v, m, n, a.dtype, signal)
        sig_axis = ring.axis
        q += [ring.c.data_ptr(), ring.c.stride(0), struct.unpack("<i", struct.pack("<f", ring.alpha))[0]]
    if scales is not None:
        row_wise = scales[0].numel() != 1 or scales[1].numel() != 1
        q += [scales[0].data_ptr(), scales[1].data_ptr(), 2 if row_wise else 1, int(fast_accum)]
    s = [
        rotate[0], rotate[1],
        flags.data_ptr() if flags is not None else 0, rows_per_rank, chunk_rows,
        -(-rows_per_rank // chunk_rows) if chunk_rows else 0, skip,
        counters.data_ptr() if counters is not None else 0, sig_axis, sig_elems,
        err.data_ptr() if err is not None else 0, rank, int(config.wait_timeout_s * 1e9),
    ]  # fmt: skip
    if local is not None:
        shard, row0 = local
        tm = v.tile[0]
        if wait is None or rows_per_rank % tm or row0 % tm or shard.shape != (rows_per_rank, k):
            raise ValueError("fluxcompile: a local shard needs wait's rows_per_rank rows at a tile boundary")
        if shard.stride(1) != 1 or shard.data_ptr() % 16 or (shard.stride(0) * shard.element_size()) % 16:
            raise ValueError("fluxcompile: a local shard must be row-major and 16-byte aligned")
        s += [shard.data_ptr(), shard.stride(0), row0]
    else:
        s += [0, 0, 0]
    if group_m and rotate[0] != 0:
        raise ValueError("fluxcompile: the grouped tile order rotates along M only")
    s.append(group_m)
    if ring is not None:
        r = ring
        s += [r.flags.data_ptr() if r.flags is not None else 0, r.sub, r.peer, r.chunk, r.zero_chunk, r.own_chunk,
              r.zero.data_ptr(), r.zero.stride(0), r.out.data_ptr(), r.out.stride(0)]  # fmt: skip
    ext = load()
    which = _index(variant)
    # The raw handle: torch.cuda.current_stream() builds a Stream object per call.
    stream = torch._C._cuda_getCurrentRawStream(index)
    if v.stream_k:
        q[16] = _scratch.address(device, stream, ext.workspace_bytes(which, q, s))
    ext.run(which, q, s, stream)
    return out


@functools.cache
def run_address() -> int:
    """The address of the extension's C entry (csrc/flux_gemm_binding.cpp, ``fluxcompile_flux_gemm_run``) through
    which the pipelined module's sequences launch the GEMM (csrc/flux_problem.h)."""
    return int(load().run_address())


@functools.cache
def _stream_k_bytes(which: int, q: tuple[int, ...], s: tuple[int, ...]) -> int:
    return int(load().workspace_bytes(which, list(q), list(s)))


def ag_sequence(
    a_local: Tensor,
    Bs: list[Tensor],
    biases: list[Tensor | None],
    gathered_shape: list[int],
    peer_slots: list[Tensor],
    buffer: Tensor,
    chunk_bounds: list[int],
    done_mine: list[int],
    arrived_theirs: list[int],
    done_theirs: list[int],
    arrived: Tensor,
    err: Tensor,
    *,
    rank: int,
    world: int,
    chunk_rows: int,
    variant: str,
    sm_count: int,
    side: torch.cuda.Stream,
    raster: str = "auto",
    swizzle: int = 1,
    in_place: bool = False,
    group_m: int = 0,
    return_A: bool = True,
    err_host: Tensor | None = None,
    events: Sequence[int] = (),
) -> tuple[Tensor | None, list[Tensor]]:
    """(gathered A or None, one output per weight): the all-gather's per-call protocol (lowerings/
    all_gather_matmul/cutlass.py) issued by the pipelined module's ``ag_flux`` (csrc/sequences_flux.cpp, where the
    arguments are described) on the current stream and ``side``, one GEMM per weight over ``buffer``
    ``[world * rows, k]`` with ``wait=(arrived, rows, chunk_rows, rank)`` and ``rotate=(0, rank * rows)`` as
    :func:`gemm` takes them (with ``in_place``, also ``local=(a_local, rank * rows)`` where ``a_local`` is
    aligned); a call seen before is replayed as a CUDA graph (``config.sequence_graphs``). ``err_host``: the error
    words' pinned host copy, written in the sequence; ``events``: raw event handles recorded after an eager call
    (``symm_mem.Comm.sequence_reporting``)."""
    workspace = 0
    if VARIANTS[variant].stream_k:
        device = a_local.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch._C._cuda_getCurrentRawStream(index)
        m, k = buffer.shape
        rows = m // world
        s = (0, rank * rows, arrived.data_ptr(), rows, chunk_rows, -(-rows // chunk_rows), rank, 0, 0, 0,
             err.data_ptr(), rank, int(config.wait_timeout_s * 1e9))  # fmt: skip
        nbytes = 0
        for b in Bs:
            layout = weight_layout(b)
            q = (0, 0, 0, 0, m, b.shape[1], k, buffer.stride(0), b.stride(0) if layout == "kn" else b.stride(1), b.shape[1],
                 int(layout == "nk"), DTYPES[buffer.dtype], sm_count, RASTERS[raster], swizzle, index, 0)  # fmt: skip
            nbytes = max(nbytes, _stream_k_bytes(_index(variant), q, s))
        workspace = _scratch.address(device, stream, nbytes)  # one scratch for the call's GEMMs: they run one after another
    launch = [
        run_address(), _index(variant), sm_count, RASTERS[raster], swizzle, int(config.wait_timeout_s * 1e9), workspace,
        group_m,
    ]  # fmt: skip
    return sequencer().ag_flux(
        a_local, Bs, biases, gathered_shape, peer_slots, buffer, chunk_bounds, done_mine, arrived_theirs, done_theirs,
        arrived, err, rank, world, chunk_rows, launch, side.cuda_stream, graph_limit(), in_place, return_A,
        err_host, list(events),
    )  # fmt: skip


def ring_raster(axis: int) -> str:
    """The ring's raster order (unswizzled): along the other axis than the scatter axis ``axis``, so every CTA
    takes its tiles in the ring's step order (its tiles of our own chunk, the rotation's last, after all its
    others: csrc/flux_gemm.cuh's RingEpilogue) and the sub-chunks complete in the order they are pushed."""
    return "n" if axis == 0 else "m"


def ring_variants() -> list[str]:
    """The variants built with the reduce-scatter ring's source and epilogue (VARIANTS' ``ring``)."""
    return [name for name, v in VARIANTS.items() if v.ring]


def check_ring(r: Ring, v, m: int, n: int, dtype: torch.dtype, signal) -> None:
    """Raise ValueError where ``r`` does not fit an ``[m, n]`` GEMM of ``dtype`` with variant ``v`` (and its
    ``signal``, as :func:`gemm` takes it)."""
    tm, tn, _ = v.tile
    tile = tm if r.axis == 0 else tn
    extent = m if r.axis == 0 else n
    if not v.ring:
        raise ValueError(f"fluxcompile: variant {v.name} is not built with the ring's source")
    if r.chunk <= 0 or r.chunk % tile or extent % r.chunk or r.sub <= 0 or r.sub % tile or r.chunk % r.sub:
        raise ValueError("fluxcompile: the ring's chunks and sub-chunks must be multiples of the tile that split the axis")
    if signal is not None and (signal[2] != r.axis or signal[1] != r.sub):
        raise ValueError("fluxcompile: the ring counts its stores per sub-chunk along its own axis")
    if r.c.shape != (m, n) or r.c.stride(1) != 1 or r.c.dtype != dtype:
        raise ValueError("fluxcompile: the ring's running sums must be a row-major [m, n] of the operands' dtype")
    zshape = (tm, n) if r.axis == 0 else (m, tn)
    if tuple(r.zero.shape) != zshape or r.zero.stride(1) != 1 or r.zero.dtype != dtype:
        raise ValueError(f"fluxcompile: the ring's zeros must be a row-major {zshape}")
    oshape = (r.chunk, n) if r.axis == 0 else (m, r.chunk)
    if tuple(r.out.shape) != oshape or r.out.stride(1) != 1 or r.out.dtype != dtype or r.out.data_ptr() % 16:
        raise ValueError(f"fluxcompile: the ring's output must be a row-major, 16-byte aligned {oshape}")
    if r.flags is not None and (r.flags.dtype != torch.int32 or r.flags.numel() < extent // r.sub):
        raise ValueError("fluxcompile: the ring's flags must be int32, one per sub-chunk")


def rs_sequence(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    bias_scratch: Tensor | None,
    partial: Tensor,
    incoming: Tensor,
    peer_incoming: Tensor,
    zero: Tensor,
    counters: Tensor,
    arrived: Tensor,
    tiles: list[int],
    arrived_theirs: int,
    done_mine: int,
    done_theirs: int,
    err: Tensor,
    out_shape: list[int],
    *,
    rank: int,
    world: int,
    axis: int,
    chunk: int,
    sub: int,
    scale: float,
    variant: str,
    sm_count: int,
    side: torch.cuda.Stream,
    err_host: Tensor | None = None,
    events: Sequence[int] = (),
) -> Tensor:
    """The reduce-scatter ring's per-call protocol (lowerings/matmul_reduce_scatter/cutlass.py) issued by the
    pipelined module's ``rs_ring`` (csrc/sequences_flux.cpp, where the arguments are described): one ``gemm``
    with :class:`Ring` over ``incoming`` and ``signal=(counters, sub, axis)``, the chunks from rank + 1's on (ours
    last), and the copy-engine pushes of each stored sub-chunk on ``side``; a call seen before is replayed as a
    CUDA graph (``config.sequence_graphs``)."""
    if not VARIANTS[variant].ring:
        raise ValueError(f"fluxcompile: variant {variant} is not built with the ring's source")
    launch = [run_address(), _index(variant), sm_count, RASTERS[ring_raster(axis)], 1, int(config.wait_timeout_s * 1e9), 0, 0]
    return sequencer().rs_ring(
        a, b, bias, bias_scratch, partial, incoming, peer_incoming, zero, counters, arrived, tiles, arrived_theirs,
        done_mine, done_theirs, err, err_host, list(events), out_shape, rank, world, axis, chunk, sub, scale, launch,
        side.cuda_stream, graph_limit(),
    )  # fmt: skip


def tiles_per_chunk(variant: str, m: int, n: int, chunk_elems: int, axis: int) -> list[int]:
    """The value each counter of a ``signal`` reaches: tiles overlapping chunk c along ``axis``, times the tiles
    along the other axis."""
    tm, tn, _ = VARIANTS[variant].tile
    extent, tile, other = (m, tm, -(-n // tn)) if axis == 0 else (n, tn, -(-m // tm))
    chunks = -(-extent // chunk_elems)
    counts = [0] * chunks
    for t in range(-(-extent // tile)):
        lo, hi = t * tile, min(extent, (t + 1) * tile)
        for c in range(lo // chunk_elems, (hi - 1) // chunk_elems + 1):
            counts[c] += other
    return counts


def check_error(err: Tensor, what: str) -> None:
    """Raise if a wait of the kernel timed out (reads ``err``: a host synchronization)."""
    words = [int(x) for x in err[:ERR_WORDS].tolist()]
    if words[0] and words[5] == 2:
        raise RuntimeError(
            f"fluxcompile: {what}: rank {words[1]} timed out waiting for rank {words[2]}'s running sums of sub-chunk "
            f"{words[3]} (its arrival flag never became non-zero): is every rank running the same op?"
        )
    if words[0]:
        raise RuntimeError(
            f"fluxcompile: {what}: rank {words[1]} timed out waiting for rank {words[2]}'s chunk {words[3]} "
            f"(its arrival flag never became non-zero): is every rank running the same op?"
        )
