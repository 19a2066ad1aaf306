"""symm_mem.persistent: the fused ops' persistent buffers are made on a thread of their own, outside the CUDA graph
memory pool the calling thread may be routed to (CUDA graph trees' warm-up). The facility itself on CPU: another
thread, its result, its exception, the refusal during capture; and every state creator of the fused ops makes the
tensors it keeps through it."""

from __future__ import annotations

import collections
import importlib
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fluxcompile.symm_mem import Comm, Workspace, local_handle, persistent
from fluxcompile.symm_mem import comm as comm_module
from fluxcompile.symm_mem import errors as errors_module


def test_runs_on_another_thread_and_returns_its_result():
    caller = threading.get_ident()
    ident, t = persistent(lambda: (threading.get_ident(), torch.arange(4)))
    assert ident != caller
    assert t.tolist() == [0, 1, 2, 3]


def test_one_worker_serves_every_call_and_a_nested_call_runs_in_place():
    """Calls hand off to one worker thread (no thread start per call); a ``make`` that itself makes a persistent
    buffer runs it in place on the worker instead of waiting on itself."""
    first = persistent(threading.get_ident)
    assert persistent(threading.get_ident) == first
    outer, inner = persistent(lambda: (threading.get_ident(), persistent(threading.get_ident)))
    assert outer == inner == first


def test_runs_without_autograd():
    """Tuning runs here: a choice's ``out=`` GEMM on a weight that requires grad must behave as in the compiled graph,
    where autograd is off."""
    w = torch.ones(2, 2, requires_grad=True)
    enabled, out = persistent(lambda: (torch.is_grad_enabled(), torch.mm(w, w, out=torch.empty(2, 2))))
    assert enabled is False and out.tolist() == [[2.0, 2.0], [2.0, 2.0]]


class _Custom(Exception):
    pass


@pytest.mark.parametrize("error", [ValueError("bad size 7"), _Custom("no peer 3"), KeyError("group")])
def test_raises_the_functions_exception(error):
    def make():
        raise error

    with pytest.raises(type(error)) as info:
        persistent(make)
    assert info.value is error  # the same object: type, message and the worker's traceback
    assert str(info.value) == str(error)


def test_refuses_during_cuda_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made = []
    with pytest.raises(RuntimeError, match="the error words cannot be made during CUDA graph capture"):
        persistent(lambda: made.append(1), "the error words")
    assert made == []


def test_host_barrier_runs_on_the_worker(monkeypatch):
    """NCCL keeps a barrier's tensor past the call: the barrier is made where no graph pool routes it."""
    from fluxcompile.symm_mem import host_barrier

    seen = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: seen.append((threading.get_ident(), group)))
    host_barrier("g")
    assert seen == [(persistent(threading.get_ident), "g")]


def test_workspace_rendezvous_runs_on_the_worker(monkeypatch):
    """The rendezvous keeps device tables of peer pointers from the caching allocator: made on the worker."""
    from torch.distributed import _symmetric_memory as symm

    ws_module = importlib.import_module("fluxcompile.symm_mem.workspace")  # the package's name is the function
    calls = []
    handle = SimpleNamespace(buffer_ptrs=[1, 2])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ws_module, "enable_group", lambda name: None)
    monkeypatch.setattr(ws_module, "_workspaces", {})
    monkeypatch.setattr(
        symm,
        "empty",
        lambda n, dtype, device: calls.append(("empty", threading.get_ident())) or torch.zeros(n, dtype=dtype),
    )
    monkeypatch.setattr(
        symm, "rendezvous", lambda buf, name: calls.append(("rendezvous", threading.get_ident())) or handle
    )
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_resolve_process_group", lambda name: _group())
    ws = ws_module.workspace("g", 1024, tag="t")
    worker = persistent(threading.get_ident)
    assert calls == [("empty", worker), ("rendezvous", worker)]
    assert ws.handle is handle and ws.world_size == 2


# --- the state creators --------------------------------------------------------------------------------------------
# Each creator below runs on CPU with its CUDA factory calls made on CPU (_OnCpu) and its collectives and symmetric
# workspaces faked; every tensor its state keeps must have been made inside the facility (here a same-thread stand-in
# that marks what is made inside it). A creator that makes a kept tensor directly fails its case.


class _OnCpu(TorchFunctionMode):
    """Factory calls on ``cuda`` made on CPU (no GPU here; pinning is skipped); ``made``: every tensor made while
    ``inside`` the facility's stand-in."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.made: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.pin_memory:
            out = args[0]
        else:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.to:
                args = tuple("cpu" if _is_cuda(a) else a for a in args)
            out = func(*args, **kwargs)
        if self.inside and isinstance(out, torch.Tensor):
            self.made.append(out)
        return out

    def persistent(self, make, what: str = ""):
        self.inside += 1
        try:
            return make()
        finally:
            self.inside -= 1

    def not_made_inside(self, kept: list[torch.Tensor]) -> list[int]:
        """Indices of the ``kept`` tensors whose storage was not made inside the facility."""
        inside = {t.untyped_storage().data_ptr() for t in self.made}
        return [i for i, t in enumerate(kept) if t.untyped_storage().data_ptr() not in inside]


def _is_cuda(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


def _workspace(world: int = 2, nbytes: int = 1 << 16) -> Workspace:
    """A stand-in for a symmetric workspace: a CPU buffer and made-up peer addresses."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    return Workspace("g", buf, SimpleNamespace(buffer_ptrs=[buf.data_ptr() + 64 * p for p in range(world)]), 0, world)


def _group(world: int = 2) -> SimpleNamespace:
    return SimpleNamespace(size=lambda: world, rank=lambda: 0)


def _fake_comm_for(mp, mode) -> None:
    """``symm_mem.comm_for`` over stand-in workspaces (no symmetric memory, no collective)."""
    mp.setattr(comm_module, "persistent", mode.persistent)
    mp.setattr(comm_module, "_comms", {})
    mp.setattr(comm_module, "_errors", {})
    mp.setattr(comm_module, "_watches", {})
    mp.setattr(comm_module, "workspace", lambda *a, **k: _workspace())
    mp.setattr(comm_module, "side_stream", lambda: None)
    mp.setattr(comm_module, "symm_init_flags", lambda *a: None)


def _decode_kernels(mp, mode) -> list[torch.Tensor]:
    from fluxcompile.lowerings.matmul_all_reduce import fused_kernels as m

    mp.setattr(m, "persistent", mode.persistent)
    mp.setattr(errors_module, "persistent", mode.persistent)
    _fake_comm_for(mp, mode)
    mp.setattr(m, "_states", {})
    mp.setattr(m, "_kept", [])
    mp.setattr(m, "group_size", lambda name: 2)
    a, b = torch.zeros(4, 8), torch.zeros(8, 16)
    st, _ = m._begin("triton", a, b, "g")
    return [st.state, st.errors.err, st.errors.host, st.peer_flags, st.peer_data]


def _schedules(mp, mode) -> list[torch.Tensor]:
    from fluxcompile.schedules import compile_program, library
    from fluxcompile.schedules import gpu_executor as m

    mp.setattr(m, "persistent", mode.persistent)
    mp.setattr(errors_module, "persistent", mode.persistent)
    _fake_comm_for(mp, mode)
    mp.setattr(m, "_channels", {})
    mp.setattr(m, "_kept", [])
    mp.setattr(m, "_group", lambda name: _group())
    mp.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=132))
    mp.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    ch = m._channel("g")
    launch = m._build(
        compile_program(library.two_shot_all_reduce(2)), ch, torch.zeros(4096, dtype=torch.bfloat16), None
    )
    kept = [ch.peer_flags, ch.state, ch.done, ch.errors.err, ch.errors.host, ch.peer_mbox]
    kept += [launch.code, launch.tbs, launch.deps]
    return kept + [t for t in (launch.scratch, launch.input_copy) if t is not None]


def _rs_triton(mp, mode) -> list[torch.Tensor]:
    from fluxcompile.lowerings.matmul_reduce_scatter import triton as m

    mp.setattr(m, "persistent", mode.persistent)
    mp.setattr(m, "_states", {})
    return [m._state(Comm(data=_workspace(), flags=_workspace()))]


def _comm_for(mp, mode) -> list[torch.Tensor]:
    """The communication context of the CUTLASS all-gather: its error words and an address table."""
    from fluxcompile.lowerings.all_gather_matmul import cutlass as ag

    mp.setattr(errors_module, "persistent", mode.persistent)
    _fake_comm_for(mp, mode)
    comm = comm_module.comm_for("g", ag.TAG, data_bytes=1024, flag_bytes=ag.FLAG_BYTES, errors=ag.ERRORS)
    return [comm.errors.err, comm.errors.host, comm.addresses(comm.data)]


def _moe(mp, mode) -> list[torch.Tensor]:
    from fluxcompile.lowerings.all_to_all import triton as m

    mp.setattr(local_handle, "persistent", mode.persistent)
    mp.setattr(comm_module, "persistent", mode.persistent)
    mp.setattr(errors_module, "persistent", mode.persistent)
    mp.setattr(local_handle, "_local", {})
    mp.setattr(local_handle, "_retired", [])
    errors = m.make_errors(torch.device("cuda", 0))
    ws = local_handle.local_workspace("g", 4096, "t")
    table = Comm(data=ws, flags=ws, errors=errors).addresses(_workspace())
    return [errors.err, errors.host, ws.buffer, table]


def _dlrm(mp, mode) -> list[torch.Tensor]:
    from fluxcompile.lowerings import device_tables as tables
    from fluxcompile.lowerings import protocol_steps
    from fluxcompile.lowerings.embedding_bag_all_to_all import triton as m

    mp.setattr(protocol_steps, "persistent", mode.persistent)
    mp.setattr(m, "_states", {})
    mp.setattr(tables, "persistent", mode.persistent)
    mp.setattr(tables, "_tables", collections.OrderedDict())
    mp.setattr(tables, "_captured", set())
    mp.setattr(tables, "eb", SimpleNamespace(fill=lambda t, values: None))  # a Triton kernel on the GPU
    mp.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=7))
    state, scratch = m.protocol_state(SimpleNamespace(flags=_workspace()))
    return [state, scratch, tables.device_table((3, 1, 4), torch.device("cuda", 0))]


def _cutlass_scratch(mp, mode) -> list[torch.Tensor]:
    from fluxcompile.kernels import cutlass_gemm as m
    from fluxcompile.kernels import stream_scratch

    mp.setattr(stream_scratch, "persistent", mode.persistent)
    scratch = stream_scratch.StreamScratch("the CUTLASS GEMM's scratch", 1 << 20)
    mp.setattr(m, "_scratch", scratch)
    m._scratch.address(torch.device("cuda", 0), 0, 4096)
    return list(scratch._buffers.values())


CREATORS = [
    _decode_kernels, _schedules, _rs_triton, _comm_for, _moe, _dlrm, _cutlass_scratch,
]  # fmt: skip


@pytest.mark.parametrize("creator", CREATORS, ids=lambda f: f.__name__.strip("_"))
def test_state_creators_make_their_kept_buffers_through_persistent(creator, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with _OnCpu() as mode:
        kept = creator(monkeypatch, mode)
    assert kept and mode.made
    direct = mode.not_made_inside(kept)
    assert not direct, f"{creator.__name__}: kept tensors {direct} were made outside symm_mem.persistent"


def test_a_contexts_plans_last_while_its_workspaces_do():
    """``Comm.plan``: made once per key; made again when the context's data or flag workspace is another (grown)."""
    made = []
    comm = Comm(data=object(), flags=object())

    def make(tag):
        return lambda: made.append(tag) or f"plan {tag}"

    assert comm.plan(("a", 1), make("a1")) == "plan a1"
    assert comm.plan(("a", 1), make("again")) == "plan a1"
    assert comm.plan(("a", 2), make("a2")) == "plan a2"
    comm.data = object()  # a grown workspace
    assert comm.plan(("a", 1), make("a1 grown")) == "plan a1 grown"
    assert made == ["a1", "a2", "a1 grown"]
