"""Run a compiled ``Plan`` on CUDA tensors of a real process group: one launch of schedules/plan_exec.py per
call and rank.

Per (group, device) a *channel* holds what every plan on that group shares: the group's communication context
(``symm_mem.comm_for``: a symmetric flag array of acks and message flags, a symmetric mailbox grown collectively
when a call needs more, the error words), the epoch ``state`` and the local dependency flags. Per (plan, group, dtype, size) a cached *launch* holds the
uploaded instruction tables, the slice count and the scratch buffer. Input and output are the caller's own
tensors (only mailboxes are written remotely), so a call is one kernel launch and no copies, unless the plan
stores into its input buffer (then the input is first copied to a private buffer).

Everything is created by the first eager call of a (plan, size) on every rank, never during CUDA graph
capture; that call also compiles the kernel and synchronizes the ranks once (host barrier) so no rank's
waits run while a peer is still compiling. Timeouts recorded by the kernel are copied to pinned memory after
each eager call and raised by the next one, or by :func:`check_errors` (which synchronizes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..config import config
from ..symm_mem import Comm, ErrorSpec, ErrorWords, FlagArray, Workspace, comm_for, host_barrier, persistent
from ..symm_mem.groups import process_group
from .encoding import EncodedPlan, encode
from .plan import Plan
from .wait_errors import ERR_WORDS, check_error

ACK_WORDS = 64  # as schedules/plan_exec.py; also the largest group
MSG_FLAGS = 1 << 16  # message flags (message id * slices + slice)
DONE_FLAGS = 1 << 16  # dependency flags (instruction index * slices + slice)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TAG = "schedules.mailbox"  # the context's data workspace, the mailbox; its flag workspace: _FLAGS_TAG
_FLAGS_TAG = "schedules.flags"
_ERRORS = ErrorSpec(ERR_WORDS, "the schedule executor", per_group=True)
# Bytes of a chunk per program: small slices spread a chunk over more SMs (bandwidth), large ones keep
# the number of flags (latency) down. Tunable per call (``slices=``) or here.


@dataclasses.dataclass
class _Channel:
    group_name: str
    rank: int
    world: int
    flags: Workspace
    peer_flags: Tensor  # int64 [world]
    state: Tensor  # int32 [4]: epoch, finished-program count
    done: Tensor  # int32 [DONE_FLAGS]
    errors: ErrorWords  # ERR_WORDS: a peer wait's and a dependency's slot (wait_errors.py)
    max_programs: int  # the group's smallest SM count: every program of a launch is resident
    comm: Comm | None = None  # the group's context: ``flags``, ``errors`` and the mailbox are its
    mbox: Workspace | None = None
    peer_mbox: Tensor | None = None  # int64 [world]


@dataclasses.dataclass
class _Launch:
    enc: EncodedPlan
    code: Tensor
    tbs: Tensor
    deps: Tensor
    n_tb: int
    slices: int
    chunk_elems: int
    slice_elems: int
    vec: int
    out_numel: int
    scratch: Tensor | None
    input_copy: Tensor | None


_channels: dict[tuple[str, int], _Channel] = {}
_encoded: dict[int, tuple[Plan, EncodedPlan]] = {}  # id(plan) -> (plan kept alive, its tables)
_launches: dict[tuple, _Launch] = {}
_ready: set[tuple] = set()
_kept: list[object] = []  # every pointer table a kernel was launched with (CUDA graphs keep using them)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def group_name_of(group: object) -> str:
    """A ProcessGroup, a group name, or None (the default group) -> the group's name."""
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, str):
        return group
    return group.group_name


def _group(group_name: str) -> dist.ProcessGroup:
    return process_group(group_name)


def _comm(group_name: str, mailbox_bytes: int = 0) -> Comm:
    """The group's context: its flag workspace and error words, and a mailbox of at least ``mailbox_bytes`` (a
    collective where a workspace is made or grows)."""
    return comm_for(
        group_name, TAG, data_bytes=mailbox_bytes, flag_bytes=(ACK_WORDS + MSG_FLAGS) * 4, flags_tag=_FLAGS_TAG,
        errors=_ERRORS,
    )  # fmt: skip


def _channel(group_name: str) -> _Channel:
    key = (group_name, torch.cuda.current_device())
    ch = _channels.get(key)
    if ch is not None:
        return ch
    if _capturing():
        raise RuntimeError(
            f"fluxcompile.schedules: run the collective once eagerly on group {group_name} before CUDA graph capture"
        )
    group = _group(group_name)
    rank, world = group.rank(), group.size()
    if world > ACK_WORDS:
        raise ValueError(f"fluxcompile.schedules: at most {ACK_WORDS} ranks, not {world}")
    comm = _comm(group_name)
    fws = comm.flags
    comm.init_flags(FlagArray(fws, 0, ACK_WORDS + MSG_FLAGS), 0)  # host barrier: zeroed on every rank first
    peer_flags = comm.addresses(fws)

    def make() -> _Channel:  # the SM-count all-reduce too: NCCL keeps its tensor past the call
        sms = torch.tensor([torch.cuda.get_device_properties().multi_processor_count], device="cuda")
        dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=group)
        return _Channel(
            group_name=group_name,
            rank=rank,
            world=world,
            flags=fws,
            peer_flags=peer_flags,
            state=torch.zeros(4, dtype=torch.int32, device="cuda"),
            done=torch.zeros(DONE_FLAGS, dtype=torch.int32, device="cuda"),
            errors=comm.errors,
            max_programs=int(sms.item()),
            comm=comm,
        )

    ch = _channels[key] = persistent(make, f"fluxcompile.schedules' channel of group {group_name}")
    return ch


def _mailbox(ch: _Channel, nbytes: int) -> None:
    """Make the group's mailbox hold ``nbytes`` (a collective when it grows: same sizes on every rank)."""
    ws = _comm(ch.group_name, max(nbytes, 16)).data
    if ws is not ch.mbox:
        ch.mbox = ws
        ch.peer_mbox = ch.comm.addresses(ws)
        _kept.extend((ws, ch.peer_mbox))


def encoded(plan: Plan) -> EncodedPlan:
    hit = _encoded.get(id(plan))
    if hit is None or hit[0] is not plan:
        hit = _encoded[id(plan)] = (plan, encode(plan))
    return hit[1]


def choose_slices(enc: EncodedPlan, chunk_bytes: int, max_programs: int, slice_bytes: int = 0) -> int:
    """Programs per threadblock: about ``slice_bytes`` of a chunk each, all resident, flags within bounds."""
    want = -(-chunk_bytes // (slice_bytes or config.sched_slice_bytes))
    cap = min(
        max_programs // max(enc.max_tbs, 1),
        MSG_FLAGS // max(enc.num_messages, 1),
        DONE_FLAGS // max(enc.max_instrs, 1),
    )
    if cap < 1:
        raise ValueError(
            f"fluxcompile.schedules: {enc.name} needs {enc.max_tbs} threadblocks resident at once, "
            f"more than the {max_programs} SMs"
        )
    return max(1, min(want, cap))


def _build(plan: Plan, ch: _Channel, x: Tensor, slices: int | None) -> _Launch:
    enc = encoded(plan)
    numel, esize = x.numel(), x.element_size()
    chunk = numel // enc.in_chunks
    vec = 16 // esize if chunk % (16 // esize) == 0 else 1
    S = slices or choose_slices(enc, chunk * esize, ch.max_programs)
    S = max(1, min(S, choose_slices(enc, 1 << 62, ch.max_programs)))
    per_slice = -(-chunk // S)
    slice_elems = -(-per_slice // vec) * vec  # a multiple of vec: the slices' loads stay vectorized
    rc = enc.ranks[ch.rank]

    def dev(a: np.ndarray) -> Tensor:  # uploaded once; an empty table still needs a valid pointer
        flat = np.ascontiguousarray(a, dtype=np.int32).reshape(-1)
        return torch.from_numpy(flat if flat.size else np.zeros(1, np.int32)).to(x.device)

    biggest = max(enc.in_chunks, enc.out_chunks, *enc.scratch_chunks, *enc.mailbox_chunks) * chunk
    if biggest >= 1 << 31:
        raise ValueError(f"fluxcompile.schedules: {enc.name}: a buffer of {biggest} elements exceeds 32-bit offsets")
    scratch = enc.scratch_chunks[ch.rank] * chunk
    _mailbox(ch, max(enc.mailbox_chunks, default=0) * chunk * esize)  # it only grows: later calls fit too
    return persistent(
        lambda: _Launch(
            enc=enc,
            code=dev(rc.code),
            tbs=dev(rc.tbs),
            deps=dev(rc.deps),
            n_tb=rc.n_tb,
            slices=S,
            chunk_elems=chunk,
            slice_elems=slice_elems,
            vec=vec,
            out_numel=enc.out_chunks * chunk,
            scratch=torch.empty(scratch, dtype=x.dtype, device=x.device) if scratch else None,
            input_copy=torch.empty_like(x) if enc.writes_input else None,
        ),
        f"the launch tables of {enc.name}",
    )


@functools.cache
def _checker(group_name: str) -> Callable[[Tensor, str], None]:
    """The error words' check: wait_errors.py's ``check_error``, naming the group."""
    return lambda words, what: check_error(words, group_name)


def check_errors() -> None:
    """Synchronize and raise if a wait of the schedule kernel timed out on this rank (tests, after replays)."""
    torch.cuda.synchronize()
    for ch in _channels.values():
        check_error(ch.errors.err.cpu(), ch.group_name)


def output_shape(x: Tensor, out_numel: int) -> tuple[int, ...]:
    """The input's shape when the sizes agree, else along dim 0 (all-gather grows it, reduce-scatter
    shrinks it) when the trailing dims divide, else flat."""
    if out_numel == x.numel():
        return tuple(x.shape)
    inner = math.prod(x.shape[1:]) if x.dim() > 1 else 1
    if x.dim() >= 1 and inner and out_numel % inner == 0:
        return (out_numel // inner, *x.shape[1:])
    return (out_numel,)


def validate(plan: Plan, x: Tensor, group_name: str) -> None:
    if not isinstance(x, Tensor) or not x.is_cuda:
        raise ValueError("fluxcompile.schedules: the GPU executor takes one CUDA tensor per rank")
    if x.dtype not in DTYPES:
        raise ValueError(f"fluxcompile.schedules: dtype {x.dtype} (supported: {', '.join(map(str, DTYPES))})")
    if not x.is_contiguous():
        raise ValueError("fluxcompile.schedules: the input must be contiguous")
    if x.numel() == 0 or x.numel() % plan.in_chunks:
        raise ValueError(
            f"fluxcompile.schedules: {plan.name} cuts its input into {plan.in_chunks} chunks; "
            f"{x.numel()} elements do not divide"
        )
    size = _group(group_name).size()
    if size != plan.num_ranks:
        raise ValueError(f"fluxcompile.schedules: {plan.name} is for {plan.num_ranks} ranks, the group has {size}")


def run_plan(
    plan: Plan,
    x: Tensor,
    group: object = None,
    out: Tensor | None = None,
    *,
    slices: int | None = None,
    max_spin: int | None = None,
) -> Tensor:
    """Run ``plan`` on this rank's ``x`` (every rank of ``group`` calls it alike); returns this rank's output
    (``out`` if given: contiguous, of the output's size and x's dtype)."""
    from .plan_exec import plan_exec

    group_name = group_name_of(group)
    key = (id(plan), group_name, x.device.index, x.dtype, x.numel(), slices)
    launch = _launches.get(key)
    if launch is None:
        validate(plan, x, group_name)
        if _capturing():
            raise RuntimeError(
                f"fluxcompile.schedules: the first call of {plan.name} for {x.numel()} {x.dtype} elements must be "
                "eager (warm up before CUDA graph capture)"
            )
        ch = _channel(group_name)
        launch = _launches[key] = _build(plan, ch, x, slices)
    elif not x.is_contiguous():
        raise ValueError("fluxcompile.schedules: the input must be contiguous")
    ch = _channels[(group_name, torch.cuda.current_device())]
    if out is None:
        out = torch.empty(output_shape(x, launch.out_numel), dtype=x.dtype, device=x.device)
    elif out.numel() != launch.out_numel or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"fluxcompile.schedules: out must be contiguous {x.dtype} with {launch.out_numel} elements")
    elif out.data_ptr() == x.data_ptr():
        raise ValueError("fluxcompile.schedules: out must not be the input (plans may read it after writing out)")
    inp = x
    if launch.input_copy is not None:
        launch.input_copy.copy_(x)
        inp = launch.input_copy
    capturing = _capturing()
    what = f"the schedule executor ({plan.name})"
    ch.errors.check_previous(what, _checker(group_name))
    spin = max_spin if max_spin is not None else int(config.wait_timeout_s * 1e6)
    args = (
        launch.code, launch.tbs, launch.deps, inp, out,
        launch.scratch if launch.scratch is not None else out, ch.peer_mbox, ch.peer_flags, ch.done, ch.state,
        ch.errors.err,
    )  # fmt: skip
    kw = dict(
        n_tb=launch.n_tb, slices=launch.slices, chunk_elems=launch.chunk_elems, slice_elems=launch.slice_elems,
        vec=launch.vec, rank=ch.rank, world=ch.world, max_spin=spin,
    )  # fmt: skip
    # Once per launch (not per alignment variant: that may differ between ranks, the barrier must not).
    ready_key = key
    if ready_key not in _ready:
        if capturing:
            raise RuntimeError(f"fluxcompile.schedules: warm up {plan.name} eagerly before CUDA graph capture")
        plan_exec(*args, compile_only=True, **kw)  # compile first, then start together
        torch.cuda.synchronize()
        host_barrier(_group(group_name))
        _ready.add(ready_key)
    plan_exec(*args, **kw)
    ch.errors.report(what, _checker(group_name))
    return out
