"""Runtime of the fused decode kernels (GEMM -> all-reduce -> optional residual add + RMSNorm): the CUDA GEMV
kernel of csrc/gemv_ar.cu (launched by kernels/gemv_ar.py) for m <= 64 and the Triton kernel of kernels/gemm_ar.py
for any m, each in a one-shot and a two-shot variant. Both follow one protocol (see csrc/gemv_ar.cu's header):

* a symmetric data workspace per kernel family, cut into slots of equal size: partials of each source rank
  for both epoch parities, then the two-shot result slots (``2 * world + 2``); the CUDA family adds two slots
  per partial slot for its LL variant (``6 * world + 2`` in all, zeroed with a barrier when created, since an
  LL word is valid by its content alone); and a symmetric flag workspace of ``(world + 1) * MAX_TILES`` int32
  (zeroed once, with a barrier, when created);
* a per-rank ``state`` that the kernel itself advances, so CUDA graph replays need nothing from the host: its
  calls (the CUDA kernel: a 64-bit counter; the Triton kernels: the epoch and a done count), then a grid
  barrier's count and epoch;
* error words the kernel fills when a bounded wait times out (``symm_mem.ErrorWords``): copied to pinned
  host memory after each eager call and checked at the start of the next one, after every call with
  ``config.check_signals``, or by :func:`check_errors` (which synchronizes; tests call it after graph
  replays).

Workspaces and the state are created by the first eager call of a shape (all ranks make it), never during
graph capture; a shape's first call also synchronizes the ranks once (host barrier) after compiling, so
no rank's kernel waits out another's JIT compilation.

Both kernels are family ``decode`` (their choices decline every call while ``config.implementations`` leaves it
out), and the CUDA kernel runs between GPUs only while ``gemv_peers`` is in it too (the default).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...config import config
from ...kernels import gemv_ar
from ...symm_mem import (
    Comm,
    ErrorSpec,
    ErrorWords,
    FlagArray,
    Workspace,
    comm_for,
    group_size,
    host_barrier,
    persistent,
    process_group,
)

try:
    from ...kernels import gemm_ar
except ImportError:  # no Triton: the Triton choices are not registered (__init__.py)
    gemm_ar = None

MAX_TILES = 8192  # flag words per source rank, as in csrc/gemv_ar.h and kernels/gemm_ar.py
ERR_WORDS = 8
MAX_WORLD = 8
_SLOT_ALIGN = 256

# (residual, weight, eps, weight_after_cast) of all_reduce_rmsnorm, or None for matmul_all_reduce.
Tail = tuple[Tensor, Tensor, float, bool] | None
# The Triton kernel's tile variants, one choice each ("triton:<variant>").
TRITON_VARIANTS = gemm_ar.VARIANTS if gemm_ar is not None else {}


# The data workspaces' tags (the flag workspaces': ``<tag>.flags``) and the error words, per kernel family.
TAGS = {"cuda": "matmul_all_reduce.cuda", "triton": "matmul_all_reduce.triton"}
_ERRORS = {  # ERR_WORDS, kernels/gemm_ar.py's layout (csrc/gemv_ar.cu writes the same), one set per group
    family: ErrorSpec(ERR_WORDS, f"the {family} decode kernel", per_group=True) for family in TAGS
}


@dataclasses.dataclass
class _State:
    """One kernel family's protocol state beside its communication context on one (group, device)."""

    comm: Comm
    state: Tensor  # int32 [4]
    peer_flags: Tensor  # int64 [world]: flag buffers as mapped here (Triton)
    data: Workspace | None = None  # the data workspace the kernels were last given
    peer_data: Tensor | None = None  # int64 [world]: data buffers as mapped here (Triton)

    @property
    def errors(self) -> ErrorWords:
        return self.comm.errors


_states: dict[Comm, _State] = {}
# Every workspace and pointer table a kernel was ever launched with: a CUDA graph captured over one keeps
# using it after a larger workspace replaced it, so none may be freed.
_kept: list[object] = []
_ready: set[tuple] = set()  # (family, variant, signature) whose first call synchronized the ranks


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _state(family: str, comm: Comm) -> _State:
    """The family's state on ``comm`` (made on its first call, eagerly: its flags zeroed on every rank first)."""
    st = _states.get(comm)
    if st is None:
        if _capturing():
            raise RuntimeError(f"fluxcompile: run the {family} decode kernel once eagerly before graph capture")
        comm.init_flags(FlagArray(comm.flags, 0, (comm.world + 1) * MAX_TILES), 0)  # host barrier
        peer_flags = comm.addresses(comm.flags)
        st = _states[comm] = persistent(
            lambda: _State(comm=comm, state=torch.zeros(4, dtype=torch.int32, device="cuda"), peer_flags=peer_flags),
            f"the {family} decode kernel's state",
        )
    return st


def _slots(family: str, world: int) -> int:
    return 6 * world + 2 if family == "cuda" else 2 * world + 2  # csrc/gemv_ar.h; kernels/gemm_ar.py


def _slot_bytes(st: _State, family: str, group_name: str, slots: int) -> int:
    """The slot size of the context's data workspace: it follows from the buffer's capacity (equal on all ranks),
    so calls of any shape agree on where a slot starts. A workspace the kernels have not been given yet is
    zeroed first where the family needs it, and its address table made."""
    ws = st.comm.data
    if st.data is not ws:
        if family == "cuda":
            # LL words are read by their content: no stale bytes of an earlier owner of this memory may pass
            # for one. Zeroed on every rank before any rank's kernel writes into it.
            ws.buffer.zero_()
            torch.cuda.synchronize()
            host_barrier(process_group(group_name))
        st.data = ws
        st.peer_data = st.comm.addresses(ws)
        _kept.extend((ws, st.peer_data))
    return (ws.nbytes // slots) // _SLOT_ALIGN * _SLOT_ALIGN


@functools.cache
def _checker(group_name: str) -> Callable[[Tensor, str], None]:
    """The error words' check: kernels/gemm_ar.py's ``check_error``, naming the group (the same words for both
    kernel families)."""
    return lambda words, what: gemm_ar.check_error(words, group_name)


def check_errors() -> None:
    """Synchronize and raise if any decode kernel's wait timed out on this rank (tests, after graph replays)."""
    torch.cuda.synchronize()
    for comm, st in _states.items():
        _checker(comm.group_name)(st.errors.err.cpu(), "a decode kernel")


def _sync_ranks_once(key: tuple, group_name: str) -> None:
    """The first call of a signature: wait until every rank has compiled before any launches."""
    if key in _ready:
        return
    if _capturing():
        raise RuntimeError("fluxcompile: the decode kernel's first call for a shape must be eager (warm up first)")
    torch.cuda.synchronize()
    host_barrier(process_group(group_name))
    _ready.add(key)


# ---------------------------------------------------------------------------------------------
# Support checks (only what is equal on every rank: shapes, dtypes, strides, group size, config).


def _common_supports(As, Bs, bias, out_shape, reduce_op, group_name, x=None, tail: Tail = None) -> str | None:
    if x is not None:
        return "a bare all-reduce (no matmul to fuse with)"
    if len(As) != 1 or len(Bs) != 1:
        return "a sum of several matmuls"
    a, b = As[0], Bs[0]
    if not a.is_cuda:
        return "needs CUDA tensors"
    if reduce_op != "sum":
        return f"reduce_op {reduce_op!r} (only sum)"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        return "operands are not [m, k] @ [k, n] of one dtype"
    m, n = a.shape[0], b.shape[1]
    if m == 0 or n == 0 or a.shape[1] == 0:
        return "an empty matmul"
    if list(out_shape)[-1] != n or math.prod(out_shape) != m * n:
        return "out_shape is not a view of [m, n]"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype != a.dtype):
        return "a bias that is not [n] of the operands' dtype"
    if group_size(group_name) > MAX_WORLD:
        return f"more than {MAX_WORLD} ranks"
    if tail is not None:
        residual, weight, _, _ = tail
        if list(residual.shape) != list(out_shape) or residual.dtype != a.dtype:
            return "a residual that is not the output's shape and dtype"
        if weight.dim() != 1 or weight.shape[0] != n or weight.dtype != a.dtype:
            return "an RMSNorm weight that is not [n] of the output's dtype"
    return None


def cuda_supports(mode: str, As, Bs, bias, out_shape, reduce_op, group_name, x=None, tail: Tail = None):
    why = _common_supports(As, Bs, bias, out_shape, reduce_op, group_name, x, tail)
    if why:
        return why
    if mode not in gemv_ar.MODES:
        return f"unknown mode {mode!r}"
    two_shot = mode == "twoshot"
    a, b = As[0], Bs[0]
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if a.dtype not in (torch.bfloat16, torch.float16):
        return "the CUDA kernel takes bfloat16 or float16"
    if m > gemv_ar.MAX_M:
        return f"m = {m} > {gemv_ar.MAX_M} (the GEMV kernel's rows)"
    if b.stride(0) != 1:
        return "the weight is not in nn.Linear layout (B = W.t(), W [n, k] with unit stride along k)"
    if k % 8 or n % 8 or b.stride(1) % 8 or a.stride(1) != 1 or a.stride(0) % 8:
        return "k, n and row strides must be multiples of 8 elements (16-byte vectors)"
    if n * b.stride(1) >= 2**31 or m * a.stride(0) >= 2**31:
        return "an operand of 2^31 elements or more (the kernel's row offsets are 32-bit)"
    world = group_size(group_name)
    if gemv_ar.MODES[mode] and world < 2:
        return "LL words travel between ranks: with one rank this is the one-shot choice"
    if world > 1 and (why := config.family_declines("gemv_peers")):
        return f"csrc/gemv_ar.cu between GPUs: {why}"
    tiles = -(-n // gemv_ar.TILE_N)
    if tiles > MAX_TILES or (two_shot and tiles < world):
        return f"{tiles} tiles of {gemv_ar.TILE_N} columns do not fit the flags (or are fewer than the ranks)"
    return gemv_ar.unavailable()


def triton_supports(variant: str, As, Bs, bias, out_shape, reduce_op, group_name, x=None, tail: Tail = None):
    why = _common_supports(As, Bs, bias, out_shape, reduce_op, group_name, x, tail)
    if why:
        return why
    v = TRITON_VARIANTS[variant]
    a, b = As[0], Bs[0]
    m, n = a.shape[0], b.shape[1]
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {a.dtype}"
    if not v.min_m <= m <= v.max_m:
        return f"m = {m} outside this tile's range [{v.min_m}, {v.max_m}]"
    tiles = -(-m // v.block[0]) * -(-n // v.block[1])
    if tiles > MAX_TILES or (v.two_shot and tiles < group_size(group_name)):
        return f"{tiles} tiles do not fit the flags (or are fewer than the ranks)"
    return None


# ---------------------------------------------------------------------------------------------
# The calls.


def _begin(family: str, a: Tensor, b: Tensor, group_name: str, slot_need: int = 0) -> tuple[_State, int]:
    """The start of a launch: (the family's state on its context, the slot size, at least the partial's bytes and
    ``slot_need``); raises if an earlier call's kernel reported a timeout. The context's data workspace has a slot
    per source rank and parity and the two-shot results; its flag workspace ``(world + 1) * MAX_TILES`` int32."""
    world = group_size(group_name)
    slots = _slots(family, world)
    need = max(a.shape[0] * b.shape[1] * a.element_size(), slot_need)
    comm = comm_for(
        group_name, TAGS[family], data_bytes=slots * (-(-need // _SLOT_ALIGN) * _SLOT_ALIGN),
        flag_bytes=(world + 1) * MAX_TILES * 4, errors=_ERRORS[family],
    )  # fmt: skip
    st = _state(family, comm)
    st.errors.check_previous(f"the {family} decode kernel", _checker(group_name))
    return st, _slot_bytes(st, family, group_name, slots)


def _outputs(a: Tensor, out_shape: Sequence[int], tail: Tail) -> tuple[Tensor, Tensor | None]:
    out = torch.empty(list(out_shape), dtype=a.dtype, device=a.device)
    normed = torch.empty_like(out) if tail is not None else None
    return out, normed


def run_cuda(mode: str, As, Bs, bias, out_shape, group_name: str, tail: Tail = None) -> Tensor | tuple[Tensor, Tensor]:
    gemv_ar.load()  # raises Unavailable before any communication
    a, b = As[0], Bs[0]
    if a.data_ptr() % 16:
        a = a.clone()  # a fresh allocation is aligned for 16-byte loads
    if b.data_ptr() % 16:
        # Before any communication, so every rank fails alike (weights are whole allocations in practice).
        raise ValueError("fluxcompile: the CUDA GEMV kernel needs a 16-byte aligned weight")
    m, k = a.shape
    n = b.shape[1]
    st, slot_bytes = _begin("cuda", a, b, group_name, gemv_ar.slot_need(m, n, a.element_size()))
    comm = st.comm
    out, normed = _outputs(a, out_shape, tail)
    _sync_ranks_once(("cuda", mode, a.dtype, m, n, k, tail is not None, group_name), group_name)
    gemv_ar.gemv_ar(
        a, b, bias, out, int(comm.data.handle.buffer_ptrs_dev), int(comm.flags.handle.buffer_ptrs_dev), slot_bytes,
        st.state, st.errors.err, comm.rank, comm.world,
        mode=mode, timeout_ns=int(config.wait_timeout_s * 1e9), tail=(normed, *tail) if tail is not None else None,
    )  # fmt: skip
    st.errors.report(f"the cuda decode kernel ({mode})", _checker(group_name))
    return out if tail is None else (out, normed)


def run_triton(
    variant: str, As, Bs, bias, out_shape, group_name: str, tail: Tail = None
) -> Tensor | tuple[Tensor, Tensor]:
    v = TRITON_VARIANTS[variant]
    a, b = As[0], Bs[0]
    m, k = a.shape
    n = b.shape[1]
    st, slot_bytes = _begin("triton", a, b, group_name)
    rank, world = st.comm.rank, st.comm.world
    out, normed = _outputs(a, out_shape, tail)
    tail_args, ss_part = None, None
    if tail is not None:
        residual, weight, eps, weight_after_cast = tail
        tail_args = (normed.view(m, n), residual.contiguous().view(m, n), weight.contiguous(), eps, weight_after_cast)
        ss_part = torch.empty(m * gemm_ar.n_tiles(m, n, v.block)[1], dtype=torch.float32, device=a.device)
    progs = torch.cuda.get_device_properties(a.device).multi_processor_count
    kwargs = dict(
        two_shot=v.two_shot, tail=tail_args, ss_part=ss_part, block=v.block, num_programs=progs,
        max_spin=int(config.wait_timeout_s * 1e6), num_warps=v.num_warps, num_stages=v.num_stages,
    )  # fmt: skip
    call = (a, b, bias, out.view(m, n), st.peer_data, st.peer_flags, slot_bytes // a.element_size(), st.state)
    key = ("triton", variant, a.dtype, m, n, k, tuple(b.stride()), bias is not None, tail is not None, group_name)
    if key not in _ready:
        gemm_ar.gemm_ar(*call, st.errors.err, rank, world, compile_only=True, **kwargs)
        _sync_ranks_once(key, group_name)
    gemm_ar.gemm_ar(*call, st.errors.err, rank, world, **kwargs)
    st.errors.report(f"the triton decode kernel ({variant})", _checker(group_name))
    return out if tail is None else (out, normed)
