"""all_to_all_matmul (MoE dispatch) and matmul_all_to_all (MoE combine) with the Triton grouped GEMM of
kernels/grouped_gemm.py, whose copy tiles pull the dispatched rows from the peers and whose epilogue scatters the
combined rows to them: no NCCL, no host synchronization; the exchanged rows land in the op's output directly, and
the combined rows in the receiver's buffer. (The GEMM reads the exchanged rows from local memory, not from the
peers: every column block re-reads its A rows, and a peer's memory is not cached in this GPU's L2.)

Dispatch, on rank r of w (``A`` its rows in ``[destination][...]`` order, ``input_split_sizes[p]`` of them for p):
  1. (w > 1) ``wait_done``: a one-program kernel waits (bounded) until every peer has finished reading r's send
     buffer in the previous call (``done[p] >= epoch``);
  2. (w > 1) copy ``A``'s rows for the peers into r's symmetric send buffer (copy engine; its own rows stay in
     ``A``);
  3. ``publish``: a one-program kernel advances r's epoch e and writes into every rank p's flag words
     ``info[r] = (where p's rows start in r's send buffer, how many)``, then ``ready[r] = e`` (release);
  4. the grouped GEMM: its copy tiles wait for every source's ``ready``, copy the rows ``[source][...]`` from the
     sources' send buffers (r's own from ``A``) into ``A_exchanged`` (the op's first output: filled in place, no
     further copy) and count them per source; its GEMM tiles wait until the sources their rows come from are all
     in, and multiply the rows picked by ``row_index`` with the expert weights (w1 and w3 share each A tile); the
     last program tells every source ``done[r] = e``. Variant ``-split``: the copy tiles are a launch of their
     own and the GEMM a second one (A through TMA where no row_index gathers it). Variant ``-pull<N>`` (ordered):
     N programs copy (then multiply too) while the others multiply r's own rows (read from ``A``), then each
     peer's as they arrive.
Combine, on rank r (``As[0]`` its product rows in the experts' order, ``Y[row_index[j]] = P[j]``, Y's rows
``[destination][...]``, ``input_split_sizes[d]`` of them for d):
  1. where ``row_index`` is given: zero r's receive buffer (rows nobody writes are zeros; ``accumulate`` adds into
     zeros, in an fp32 buffer);
  2. ``publish``: ``info[r] = (where p's rows start in r's receive buffer, how many)`` into every p, then
     ``ready[r] = e``;
  3. the grouped GEMM whose epilogue waits for every destination's ``ready`` before its first store, then stores
     (or atomically adds) each row at its final position in its destination's receive buffer (peer-to-peer); its
     last program writes ``done[r] = e`` into every destination's flags;
  4. ``wait_done``: waits (bounded) until every source's ``done[s] >= e``, then copies the receive buffer into a
     fresh output (copy engine).

What stays on the GPU: the epoch (a counter in the rank's flag words that ``publish`` advances), every offset and
count a rank needs from its peers (published into its flag words), ``offs`` and ``row_index`` (read by the
kernel: group sizes and the permutation never reach the host), the error words. What comes from the host: the
split sizes, which the op receives as host ints (SymInt lists) and which fix the shapes: they reach the device
as ``publish``'s kernel arguments (by value, so a CUDA graph replays them; a graph is captured for fixed splits,
and ``offs``/``row_index`` may change between its replays). Splits that change between replays: torch.compile's
CUDA graphs record one graph per set of int inputs and keep any graph that reads its splits with ``.tolist()``
out of capture (``aten._local_scalar_dense`` is among Inductor's ops forbidden in CUDA graphs), so a compiled
model never replays stale splits; a capture made by hand replays the splits of its capture, as NCCL's
``all_to_all_single`` (the reference) does. Nothing is synchronized with the host and nothing is
allocated on the hot path but the op's outputs: workspaces, flag views and address tables are made on a rank's
first call (eagerly; a collective where a symmetric workspace is made or grows) and reused.

The send (dispatch) and receive (combine) buffers hold this rank's own rows (``A``, resp. the op's output), so
they are sized by its token copies: equal on every rank when every rank has as many tokens (training). A
workspace grows collectively: where token counts differ between ranks, warm up with the largest batch on every
rank first (or the growing rank waits for its peers in the rendezvous).

Flags are epoch-valued and only grow (no reset race between calls, CUDA graph replays advance them); the only
resets are of the rank's own counters, by the last program of the launch that used them. Every wait is bounded
(``config.wait_timeout_s``, 60 s by default): it records the waiting rank, the peer and the signal in an error
buffer, copied to pinned host memory at the end of the call and checked at the start of the next eager one (no
synchronization on the hot path), or after every call with ``config.check_signals``.

The communication context (``symm_mem.Comm``) carries what the protocol takes from its group (workspaces, error
buffer, address tables, SM count, flag initialization, the waits' bound); :func:`all_to_all_matmul_on` /
:func:`matmul_all_to_all_on` take it explicitly, so the same code runs between GPUs (:func:`group_comm`), between
ranks simulated on one GPU (fluxcompile/testing/one_gpu_ranks.py) and, on CPU tensors, under Triton's interpreter
(tests/test_moe_kernels.py).

Off by default (family ``moe``): its choices run only where ``config.implementations`` has ``moe``
(FLUXCOMPILE_IMPLEMENTATIONS=+moe).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...config import config
from ...symm_mem import Comm, ErrorSpec, ErrorWords, FlagArray, comm_for, group_size

try:
    from ...kernels import grouped_gemm as gg
except ImportError:  # no Triton: the choices are not registered (__init__.py)
    gg = None

NAME = "triton"
MAX_WORLD = 64  # kernels/grouped_gemm.py's flag words per peer
MAX_WEIGHTS = 3
_DTYPES = (torch.bfloat16, torch.float16)
DISPATCH_TAG = "all_to_all_matmul.triton"
COMBINE_TAG = "matmul_all_to_all.triton"
SPLIT = "-split"  # the dispatch's variant with the pull and the GEMM in two launches
ORDERED = "-pull"  # "<tile>-pull<N>": the dispatch's variant where N programs copy while the others multiply
ORDERED_COPIERS = (16, 32)
DEFAULT = "128x128x64-w8s4"

# The choices' variants: the tile configurations of one program per SM (launches that wait run one per SM), for
# the dispatch every configuration split (its GEMM launch waits for nothing) and the one-per-SM ones ordered.
_ONE_PER_SM = [name for name, v in gg.VARIANTS.items() if v.per_sm == 1] if gg is not None else []
DISPATCH_VARIANTS = (
    [
        *_ONE_PER_SM,
        *(f"{name}{SPLIT}" for name in gg.VARIANTS),
        *(f"{name}{ORDERED}{n}" for name in _ONE_PER_SM for n in ORDERED_COPIERS),
    ]
    if gg is not None
    else []
)
COMBINE_VARIANTS = list(_ONE_PER_SM)
# The launches timed per call (one choice per op, its tiles as data): those within reach of the best in the
# recorded runs between GPUs (benchmarks/results/moe-peers-{2,4}xh100-2026-11-27d.json: the dispatch's best were
# the 128x256 tile pulling in 16 or 32 programs of its launch, the combine's the 256x128 and 128x128 tiles).
DISPATCH_TIMED = ("128x256x64-w8s3-pull16", "128x256x64-w8s3-pull32", "128x256x64-w8s3")
COMBINE_TIMED = ("256x128x64-w8s3", "128x128x64-w8s4", "128x128x64-w4s4")


def timeout_s() -> float:
    """The bound on the kernels' waits: ``config.wait_timeout_s``."""
    return float(config.wait_timeout_s)


# --- the communication context -------------------------------------------------------------------------

_ERRORS_OWNER = "the MoE Triton choices"


def make_errors(device: torch.device) -> ErrorWords:
    """A rank's error words of the grouped GEMM's waits (``grouped_gemm.check_error`` reads them)."""
    return ErrorWords.make(device, gg.ERR_WORDS, _ERRORS_OWNER)


@functools.cache
def checker(group_name: str) -> Callable[[Tensor, str], None]:
    """The error words' check: ``grouped_gemm.check_error``, naming the group."""
    return lambda words, what: gg.check_error(words, group_name, what)


def signals(comm: Comm) -> gg.Signals:
    """The kernels' view of ``comm``'s flags (``gg.FLAG_BYTES`` per rank): this rank's flag words, every rank's
    address, the error words and the waits' bound ``comm.max_spin`` (microseconds of the GPU's timer, polls under
    the interpreter; None: the config's). Made once per flag buffer, which it sets to 0 on every rank first."""
    key = ("signals", id(comm.flags.handle), comm.flags.buffer.data_ptr())
    sig = comm.tables.get(key)
    if sig is None:
        comm.init_flags(FlagArray(comm.flags, 0, gg.FLAG_WORDS), 0)
        my_flags = comm.flags.view(comm.rank, (gg.FLAG_WORDS,), torch.int32)
        spin = comm.max_spin if comm.max_spin is not None else int(timeout_s() * 1e6)  # microseconds
        sig = gg.Signals(my_flags, comm.addresses(comm.flags), comm.errors.err, comm.rank, comm.world, spin)
        comm.tables[key] = sig
    return sig


def data_bases(comm: Comm) -> Tensor:
    """Every rank's data buffer (the dispatch's send, the combine's receive buffer) as addresses; without one (a
    one-rank dispatch), the flag buffers' (never read)."""
    return comm.addresses(comm.data) if comm.data is not None else signals(comm).peer_flags


def buffer_bytes(nbytes: int) -> int:
    """A data workspace's request for ``nbytes``: the next power of two (ranks with slightly different token counts
    then ask for the same size; see the module on growth)."""
    return 1 << max(20, (max(nbytes, 1) - 1).bit_length())


def group_comm(group_name: str, world: int, data_bytes: int, tag: str) -> Comm:
    """This rank's context in a process group for the op ``tag``: its (group, device, tag) workspaces (a
    collective where one must be made or grow: every rank makes the same call; one rank's are plain allocations)
    and its error buffer."""
    return comm_for(
        group_name, tag, world=world, data_bytes=buffer_bytes(data_bytes) if data_bytes else 0,
        flag_bytes=gg.FLAG_BYTES, errors=ErrorSpec(gg.ERR_WORDS, _ERRORS_OWNER), local_alone=True,
    )  # fmt: skip


# --- supports -------------------------------------------------------------------------------------------


def group_world(group_name: str) -> int:
    """The size of the process group ``group_name`` (ValueError naming it where there is none)."""
    world = _group_size(group_name)
    if isinstance(world, str):
        raise ValueError(f"fluxcompile: {world}")
    return world


def _group_size(group_name: str) -> int | str:
    try:
        return group_size(group_name)
    except Exception as e:
        return f"no process group {group_name!r} ({type(e).__name__})"


def _common_declines(
    A: Tensor, Bs: Sequence[Tensor], offs, row_index, output_split_sizes, input_split_sizes, group_name, scaled: bool
) -> str | None:
    """The reasons both ops decline (the same on every rank: shapes, dtypes, group, config; never row counts)."""
    if scaled:
        return "scaled matmuls"
    if not A.is_cuda:
        return "needs CUDA tensors"
    if A.dtype not in _DTYPES:
        return f"dtype {A.dtype} (bf16 and fp16 only)"
    if not Bs or any(b.dim() != 3 for b in Bs):
        return "dense weights (2-D): another choice handles them"
    if len(Bs) > MAX_WEIGHTS:
        return f"more than {MAX_WEIGHTS} weights"
    if any(b.dtype != A.dtype for b in Bs):
        return "mixed dtypes"
    if any(t.device != A.device for t in (*Bs, *(x for x in (offs, row_index) if x is not None))):
        return "operands on several devices"
    E, k = Bs[0].shape[0], Bs[0].shape[1]
    if any(b.shape[:2] != (E, k) for b in Bs):
        return "weights of different experts or K"
    if offs is not None and (offs.dim() != 1 or offs.numel() != E or offs.dtype not in (torch.int32, torch.int64)):
        return f"offs of {offs.dtype}{list(offs.shape)} for {E} experts"
    if row_index is not None and (row_index.dim() != 1 or row_index.dtype not in (torch.int32, torch.int64)):
        return f"row_index of {row_index.dtype}{list(row_index.shape)}"
    world = _group_size(group_name)
    if isinstance(world, str):
        return world
    if world > MAX_WORLD:
        return f"more than {MAX_WORLD} ranks"
    for splits in (output_split_sizes, input_split_sizes):
        if splits and len(splits) != world:
            return f"{len(splits)} split sizes for a group of {world} ranks"
    if bool(output_split_sizes) != bool(input_split_sizes):
        return "one split list given, the other empty"
    return None


def dispatch_supports(
    A, Bs, biases, output_split_sizes, input_split_sizes, group_name,
    A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None, return_A=True,
    choice="",
) -> str | None:  # fmt: skip
    """None when the Triton choices handle this all_to_all_matmul call, else why not (never raises)."""
    try:
        scaled = A_scale is not None or B_scales is not None or out_dtype is not None
        why = _common_declines(A, Bs, offs, row_index, output_split_sizes, input_split_sizes, group_name, scaled)
        if why is not None:
            return why
        if A.dim() < 2 or A.shape[-1] != Bs[0].shape[1]:
            return f"A of shape {list(A.shape)} for weights with K = {Bs[0].shape[1]}"
        if len(biases) != len(Bs) or any(x is not None for x in biases):
            return "a bias with expert weights"
        return None
    except Exception as e:  # a broken check declines
        return f"supports() raised {type(e).__name__}: {e}"


def combine_supports(
    As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name,
    A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None,
    accumulate=False, choice="",
) -> str | None:  # fmt: skip
    """None when the Triton choices handle this matmul_all_to_all call, else why not (never raises)."""
    try:
        scaled = A_scales is not None or B_scales is not None or out_dtype is not None
        if not As:
            return "no matmul"
        why = _common_declines(As[0], Bs, offs, row_index, output_split_sizes, input_split_sizes, group_name, scaled)
        if why is not None:
            return why
        if len(As) != 1 or len(Bs) != 1:
            return "a sum of several matmuls"
        if bias is not None:
            return "a bias with expert weights"
        a, b = As[0], Bs[0]
        if a.dtype != b.dtype or a.shape[-1] != b.shape[1] or a.dim() not in (2, 3):
            return f"A of {a.dtype}{list(a.shape)} for weights {b.dtype}{list(b.shape)}"
        if a.dim() == 3 and (offs is not None or a.shape[0] != b.shape[0]):
            return "a 3-D A that is not [E, C, K] for bmm"
        if len(out_shape) < 2 or out_shape[-1] != b.shape[2]:
            return f"out_shape {list(out_shape)} for products of {b.shape[2]} columns"
        return None
    except Exception as e:
        return f"supports() raised {type(e).__name__}: {e}"


def _tma_ok(variant: gg.Variant, device: torch.device) -> bool:
    return variant.tma and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9)


def tile_variant(name: str) -> str:
    """The tile configuration of a dispatch variant (``<tile>``, ``<tile>-split``, ``<tile>-pull<N>``): the
    combine's variant of the same tiles."""
    if name.endswith(SPLIT):
        return name.removesuffix(SPLIT)
    head, sep, n = name.rpartition(ORDERED)
    return head if sep and n.isdigit() else name


def _variant(name: str) -> tuple[gg.Variant, bool, int]:
    """(tile configuration, split, copying programs) of a variant name; ValueError for an unknown one."""
    tile = tile_variant(name)
    if tile not in gg.VARIANTS:
        raise ValueError(f"fluxcompile: no MoE Triton variant {name!r}")
    split = name.endswith(SPLIT)
    ordered = tile != name and not split
    copiers = int(name.rpartition(ORDERED)[2]) if ordered else 0
    if ordered and copiers < 1:
        raise ValueError(f"fluxcompile: MoE Triton variant {name!r} needs at least one copying program")
    return gg.VARIANTS[tile], split, copiers


def make_dispatch(name: str) -> tuple[Callable[..., tuple[Tensor, list[Tensor]]], Callable[..., str | None]]:
    """(fn, supports) of all_to_all_matmul's choice ``triton:<name>``."""
    _variant(name)  # raises for an unknown name; any number of copying programs is accepted

    def run(
        A, Bs, biases, output_split_sizes, input_split_sizes, group_name,
        A_scale=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None,
        return_A=True, choice="",
    ):  # fmt: skip
        A_exchanged, outs = all_to_all_matmul(
            A, Bs, output_split_sizes, input_split_sizes, group_name, offs=offs, row_index=row_index, variant=name
        )  # the pull's target either way: the exchanged rows are written whether read or not
        return (A_exchanged if return_A else None), outs

    return run, dispatch_supports


def make_combine(name: str) -> tuple[Callable[..., Tensor], Callable[..., str | None]]:
    """(fn, supports) of matmul_all_to_all's choice ``triton:<name>``."""
    if name not in COMBINE_VARIANTS:
        raise ValueError(f"fluxcompile: no MoE Triton variant {name!r}")

    def run(
        As, Bs, bias, out_shape, output_split_sizes, input_split_sizes, group_name,
        A_scales=None, B_scales=None, out_dtype=None, use_fast_accum=False, offs=None, row_index=None,
        accumulate=False, choice="",
    ):  # fmt: skip
        return matmul_all_to_all(
            As[0], Bs[0], out_shape, output_split_sizes, input_split_sizes, group_name,
            offs=offs, row_index=row_index, accumulate=accumulate, variant=name,
        )  # fmt: skip

    return run, combine_supports


# --- the protocols --------------------------------------------------------------------------------------


def split_rows(sizes: Sequence[int], rows: int, world: int, unit: int, what: str) -> list[int]:
    """Matrix rows per rank of an exchange along dim 0 (``unit`` matrix rows per dim-0 index): the given split
    sizes, or equal splits of ``rows`` dim-0 indices where the list is empty (all_to_all_single's convention)."""
    if sizes:
        if len(sizes) != world:
            raise ValueError(f"fluxcompile: {len(sizes)} {what} for {world} ranks")
        return [int(s) * unit for s in sizes]
    if rows % world:
        raise ValueError(f"fluxcompile: {rows} rows do not split equally over {world} ranks")
    return [rows // world * unit] * world


def _num_programs(comm: Comm, device: torch.device) -> int | None:
    return comm.sm_count or None


def dispatch_bytes(A: Tensor, world: int) -> int:
    """The dispatch's send buffer: this rank's rows (none for one rank, which reads ``A`` itself)."""
    return A.numel() * A.element_size() if world > 1 else 0


def all_to_all_matmul(
    A: Tensor, Bs: Sequence[Tensor], output_split_sizes, input_split_sizes, group_name: str, *,
    offs: Tensor | None = None, row_index: Tensor | None = None, variant: str = DEFAULT,
) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
    """The registered choice: this rank's ``Comm`` in the group, then the protocol."""
    world = group_world(group_name)
    comm = group_comm(group_name, world, dispatch_bytes(A, world), DISPATCH_TAG)
    return all_to_all_matmul_on(comm, A, Bs, output_split_sizes, input_split_sizes, offs, row_index, variant=variant)


def all_to_all_matmul_on(
    comm: Comm, A: Tensor, Bs: Sequence[Tensor], output_split_sizes, input_split_sizes,
    offs: Tensor | None = None, row_index: Tensor | None = None, *, variant: str = DEFAULT,
) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
    """The dispatch's results on the rank of ``comm`` (every rank of its group makes the same call): the protocol
    of the module's docstring, on the current stream."""
    v, split, copiers = _variant(variant)
    what = f"all_to_all_matmul ({NAME}:{variant})"
    k = A.shape[-1]
    a_local, send, recv, unit = dispatch_rows(A, output_split_sizes, input_split_sizes, comm.world, what)
    received = sum(recv)
    exchanged_shape = [received // unit, *A.shape[1:]] if unit else [0, *A.shape[1:]]
    sig = signals(comm)
    comm.errors.check_previous(what, checker(comm.group_name))

    stage_rows(comm, sig, a_local, send, what)

    A_exchanged = torch.empty(exchanged_shape, dtype=A.dtype, device=A.device)
    a_ex = A_exchanged.view(received, k)
    pull = gg.Pull(a_local, data_bases(comm), a_ex, received)
    offs_ = offs.contiguous() if offs is not None else None
    rows_ = row_index.contiguous() if row_index is not None else None
    kw = dict(variant=v, num_programs=_num_programs(comm, A.device), tma=_tma_ok(v, A.device))
    if split:
        gg.grouped_gemm(a_ex, Bs, pull=pull, gemm=False, sig=sig, **kw)
        outs = gg.grouped_gemm(a_ex, Bs, offs=offs_, row_index=rows_, **kw)
    else:
        outs = gg.grouped_gemm(a_ex, Bs, offs=offs_, row_index=rows_, pull=pull, sig=sig, copiers=copiers, **kw)
    if offs is None:  # bmm: [E, rows / E, N]
        outs = [o.view(b.shape[0], -1, b.shape[2]) for o, b in zip(outs, Bs)]
    comm.errors.report(what, checker(comm.group_name))
    return A_exchanged, outs


def dispatch_rows(
    A: Tensor, output_split_sizes, input_split_sizes, world: int, what: str
) -> tuple[Tensor, list[int], list[int], int]:
    """The dispatch's rows of ``A`` (exchanged along dim 0): ``(a_local, send, recv, unit)``, ``a_local`` its rows as
    a contiguous, 16-byte aligned ``[rows, K]``, ``send``/``recv`` the matrix rows per rank (:func:`split_rows`),
    ``unit`` the matrix rows per dim-0 index; ValueError where the input splits do not add up to ``A``'s rows."""
    unit = math.prod(A.shape[1:-1])
    a_local = A.reshape(-1, A.shape[-1])
    if not a_local.is_contiguous() or a_local.data_ptr() % 16:
        a_local = a_local.contiguous()
    send = split_rows(input_split_sizes, A.shape[0], world, unit, "input split sizes")
    recv = split_rows(output_split_sizes, A.shape[0], world, unit, "output split sizes")
    if sum(send) != a_local.shape[0]:
        raise ValueError(f"fluxcompile: {what}: input split sizes add up to {sum(send)} rows, A has {a_local.shape[0]}")
    return a_local, send, recv, unit


def stage_rows(comm: Comm, sig: gg.Signals, a_local: Tensor, send: Sequence[int], what: str) -> None:
    """The dispatch's steps 1-3 on this rank: once every peer has read its previous rows, the rows of ``a_local``
    (contiguous, ``[destination][...]``, ``send[p]`` for p) that the peers read into its send buffer (its own stay
    in ``a_local``, read from there), then where each destination's rows start (``publish``)."""
    rank = comm.rank
    if comm.world > 1:
        nbytes = a_local.numel() * a_local.element_size()
        if comm.data is None or comm.data.nbytes < nbytes:
            raise ValueError(f"fluxcompile: {what}: the send buffer has too few bytes for {nbytes}")
        gg.wait_done(sig, 3, skip_self=True)  # every peer has read our previous rows
        staged = comm.data.view(rank, tuple(a_local.shape), a_local.dtype)
        lo = sum(send[:rank])
        hi = lo + send[rank]
        for first, end in ((0, lo), (hi, a_local.shape[0])):
            if end > first:
                staged[first:end].copy_(a_local[first:end])
    gg.publish(sig, send)


def combine_bytes(out_shape: Sequence[int], output_split_sizes, N: int, dtype: torch.dtype, accumulate: bool) -> int:
    """The combine's receive buffer: this rank's output rows (fp32 where rows are accumulated)."""
    rows = (sum(output_split_sizes) if output_split_sizes else out_shape[0]) * math.prod(out_shape[1:-1])
    return rows * N * (4 if accumulate else dtype.itemsize)


def matmul_all_to_all(
    a: Tensor, b: Tensor, out_shape: Sequence[int], output_split_sizes, input_split_sizes, group_name: str, *,
    offs: Tensor | None = None, row_index: Tensor | None = None, accumulate: bool = False, variant: str = DEFAULT,
) -> Tensor:  # fmt: skip
    """The registered choice: this rank's ``Comm`` in the group, then the protocol."""
    world = group_world(group_name)
    acc32 = accumulate and row_index is not None
    nbytes = combine_bytes(out_shape, output_split_sizes, b.shape[2], a.dtype, acc32)
    comm = group_comm(group_name, world, nbytes, COMBINE_TAG)
    return matmul_all_to_all_on(
        comm, a, b, out_shape, output_split_sizes, input_split_sizes, offs, row_index, accumulate, variant=variant
    )


def matmul_all_to_all_on(
    comm: Comm, a: Tensor, b: Tensor, out_shape: Sequence[int], output_split_sizes, input_split_sizes,
    offs: Tensor | None = None, row_index: Tensor | None = None, accumulate: bool = False, *,
    variant: str = DEFAULT,
) -> Tensor:  # fmt: skip
    """The combine's result on the rank of ``comm`` (every rank of its group makes the same call): the protocol of
    the module's docstring, on the current stream."""
    rank, world = comm.rank, comm.world
    v, _, _ = _variant(variant)
    what = f"matmul_all_to_all ({NAME}:{variant})"
    n = b.shape[2]
    h = a.reshape(-1, a.shape[-1])
    if not h.is_contiguous() or h.data_ptr() % 16:
        h = h.contiguous()
    unit = math.prod(out_shape[1:-1])
    y_rows = out_shape[0] * unit
    send = split_rows(input_split_sizes, out_shape[0], world, unit, "input split sizes")
    recv = split_rows(output_split_sizes, out_shape[0], world, unit, "output split sizes")
    if sum(send) != y_rows:
        raise ValueError(f"fluxcompile: {what}: input split sizes add up to {sum(send)} rows, out_shape has {y_rows}")
    if row_index is None and h.shape[0] != y_rows:
        raise ValueError(f"fluxcompile: {what}: {h.shape[0]} product rows for an output of {y_rows}")
    if row_index is not None and row_index.numel() != h.shape[0]:
        raise ValueError(f"fluxcompile: {what}: row_index has {row_index.numel()} entries for {h.shape[0]} rows")
    if offs is None and h.shape[0] % b.shape[0]:
        raise ValueError(f"fluxcompile: {what}: {h.shape[0]} rows do not split into {b.shape[0]} equal groups")
    mine = sum(recv)
    acc32 = accumulate and row_index is not None  # without row_index no row is written twice
    buf_dtype = torch.float32 if acc32 else a.dtype
    nbytes = mine * n * buf_dtype.itemsize
    if comm.data is None or comm.data.nbytes < nbytes:
        raise ValueError(f"fluxcompile: {what}: the receive buffer has too few bytes for {nbytes}")
    sig = signals(comm)
    comm.errors.check_previous(what, checker(comm.group_name))

    received = comm.data.view(rank, (mine, n), buf_dtype)
    if row_index is not None:
        received.zero_()  # rows no product lands on are zeros; accumulated rows start from zero
    gg.publish(sig, recv)  # where each source's rows go in our buffer
    gg.grouped_gemm(
        h, [b], offs=offs.contiguous() if offs is not None else None,
        row_index=row_index.contiguous() if row_index is not None else None,
        scatter=gg.Scatter(data_bases(comm), y_rows, acc32), sig=sig,
        variant=v, num_programs=_num_programs(comm, a.device), tma=_tma_ok(v, a.device),
    )  # fmt: skip
    gg.wait_done(sig, 5, skip_self=False)  # every source's rows have landed
    out = torch.empty([mine // unit if unit else 0, *out_shape[1:]], dtype=a.dtype, device=a.device)
    out.view(mine, n).copy_(received)
    comm.errors.report(what, checker(comm.group_name))
    return out
