"""The all-gather's shard produced straight into symmetric memory (lowerings/comm_buffers.py), on CPU.

No GPU here, so no buffer is realized in symmetric memory: what is checked is that the lowering is registered
the way Inductor's implicit fallback would register the op, that a compiled sequence-parallel all-gather + matmul
on 2 gloo ranks still matches eager and its generated code still calls the fused op's direct entry with no
``empty_strided_p2p``, and the decision for each kind of shard, taken on the real IR of those compiles (the
report names symbolic sizes too). The decision checks the device last, so a CPU shard that passes every other
check says "not on CUDA".

And all_gather_matmul/async_input_mm.py's two protocols, as the stream operations one rank queues (recorded by
GPU-free fakes): a symmetric shard is read by its peers straight from A and the op waits for their ``done`` at
its end; any other shard is published into the workspace after their ``done``, at its start.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import assert_close, fresh_compiles
from torch._inductor.utils import run_and_get_code

import fluxcompile
from fluxcompile.lowerings import comm_buffers, direct_calls

ENTRY = f"extern_kernels.{direct_calls.entry_name('all_gather_matmul')}("
NOT_CUDA = "not on CUDA"
SYMBOLIC = "symbolic sizes"
NOT_ALLOCATED = "Inductor does not allocate"
ESCAPES = "also an output of the graph"


# ---------------------------------------------------------------------------------------------
# Registration and the decision's pieces.


def test_lowering_is_registered_as_the_implicit_fallback_would_be():
    from torch._inductor.lowering import (
        _maybe_layout_constraints,
        fallbacks,
        lowerings,
        needs_realized_inputs,
        tag_to_layout_constraint,
    )
    from torch._library.utils import get_layout_constraint_tag

    op = comm_buffers.op()
    assert comm_buffers.registered()
    assert op in lowerings and op in fallbacks and op in needs_realized_inputs
    implicit = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
    assert _maybe_layout_constraints.get(op) is implicit


def test_group_name_found_by_the_schema():
    op = comm_buffers.op()
    args = ("A", ["B"], [None], 0, 2, "group-7")
    assert comm_buffers.group_name_of(op, args, {}) == "group-7"
    assert comm_buffers.group_name_of(op, args[:5], {"group_name": "g"}) == "g"
    assert comm_buffers.group_name_of(op, args, {"choice": "reference"}) == "group-7"


def test_is_static():
    import sympy

    assert comm_buffers.is_static(12)
    assert comm_buffers.is_static(sympy.Integer(12))
    assert not comm_buffers.is_static(sympy.Symbol("s0") * 16)


class _Views(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        v = y.view(-1)
        return torch.mm(y, y.t()), v.view(4, 4)


class _NoEscape(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        return torch.mm(y.view(4, 4), y.t())


def _aten_graph(module: torch.nn.Module) -> torch.fx.Graph:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(module)(torch.randn(4, 4)).graph


def _node(graph: torch.fx.Graph, target: object) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.target is target)


def test_escapes_follows_views_to_the_outputs():
    aten = torch.ops.aten
    g = _aten_graph(_Views())
    relu = _node(g, aten.relu.default)
    assert comm_buffers.escapes(relu)  # a view of a view of it is returned
    assert comm_buffers.escapes(_node(g, aten.t.default))  # a view: its base escapes
    g = _aten_graph(_NoEscape())
    assert not comm_buffers.escapes(_node(g, aten.relu.default))
    assert not comm_buffers.escapes(_node(g, aten.t.default))


# ---------------------------------------------------------------------------------------------
# Compiled on 2 gloo ranks.


def _relu_gather(x, w, group):
    # The shard is produced by a kernel Inductor generates.
    return funcol.all_gather_tensor(torch.relu(x), 0, group) @ w


def _input_gather(x, w, group):
    # The shard is the graph's input.
    return funcol.all_gather_tensor(x, 0, group) @ w


def _escaping_gather(x, w, group):
    # The shard is produced by Inductor and also returned.
    h = torch.relu(x)
    return funcol.all_gather_tensor(h, 0, group) @ w, h


CASES = {
    "relu": (_relu_gather, False, NOT_CUDA),
    "input": (_input_gather, False, NOT_ALLOCATED),
    "escapes": (_escaping_gather, False, ESCAPES),
    "dynamic": (_relu_gather, True, SYMBOLIC),
}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def compile_case(case: str) -> dict[str, object]:
    fn, dynamic, _ = CASES[case]
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    x, w = torch.randn(8, 16), torch.randn(16, 24)
    ref = fn(x, w, group)
    torch._dynamo.reset()
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    logger = logging.getLogger("fluxcompile.comm_buffers")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        with fresh_compiles(), fluxcompile.collect_reports() as rep:
            out, codes = run_and_get_code(torch.compile(fn, backend="fluxcompile", dynamic=dynamic), x, w, group)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert_close(o, r, 1e-5, f"{case}: output {i}")
    code = "\n".join(codes)
    return {
        "fused": rep.count("all_gather_matmul"),
        "entry": code.count(ENTRY),
        "p2p": "empty_strided_p2p(" in code,
        "decisions": records.messages,
        "report": [e.detail for e in rep.entries()],
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_gather_keeps_its_direct_call(ranks, case):
    want = CASES[case][2]
    for r in ranks(2).run(compile_case, case):
        assert r["fused"] == 1, r
        assert r["entry"] == 1, r  # the fused op's line is still the direct call
        assert not r["p2p"], r  # nothing is allocated in symmetric memory on CPU
        assert len(r["decisions"]) == 1 and want in r["decisions"][0], r
        # The report says where the shard is copied because of its sizes.
        assert any(SYMBOLIC in d for d in r["report"]) == (want == SYMBOLIC), r


# ---------------------------------------------------------------------------------------------
# async_input_mm's two protocols, as the stream operations one rank queues (GPU-free fakes record them).


class _Stream:
    def __init__(self, name: str, trace: list[tuple]) -> None:
        self.name, self.trace = name, trace

    def wait_event(self, event: object) -> None:
        self.trace.append((self.name, "wait event"))

    def wait_stream(self, other: _Stream) -> None:
        self.trace.append((self.name, f"wait {other.name}"))


class _Flags:
    def __init__(self, name: str) -> None:
        self.name = name

    def addr(self, rank: int, index: int) -> tuple:
        return (self.name, rank, index)


class _Shards:
    """Each rank's shard (or workspace), [rows, k] on CPU; ``get_buffer``/``view`` record which rank was read."""

    def __init__(self, world: int, rows: int, k: int, trace: list[tuple], current: list[_Stream]) -> None:
        self.rank, self.world_size = 0, world
        self.data = [torch.full((rows, k), float(r + 1), dtype=torch.bfloat16) for r in range(world)]
        self.trace, self.current = trace, current

    def get_buffer(self, rank: int, shape, dtype, offset: int = 0) -> torch.Tensor:
        self.trace.append((self.current[-1].name, "read", rank))
        return self.data[rank]

    def view(self, rank: int, shape, dtype, offset: int = 0) -> torch.Tensor:
        return self.get_buffer(rank, shape, dtype, offset)


def _trace_call(
    monkeypatch: pytest.MonkeyPatch, symmetric: bool, world: int = 3, return_A: bool = True
) -> list[tuple]:
    from fluxcompile.lowerings.all_gather_matmul import async_input_mm as aim

    trace: list[tuple] = []
    main, side = _Stream("main", trace), _Stream("side", trace)
    current = [main]
    rows, k = 128, 16
    shards = _Shards(world, rows, k, trace, current)
    flags = (_Flags("ready"), _Flags("done"))

    class _Event:
        def record(self, stream: _Stream) -> None:
            trace.append((stream.name, "record"))

    class _Using:
        def __init__(self, stream: _Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            current.pop()

    def consume(stream: _Stream, addr: tuple) -> None:
        trace.append((stream.name, "consume", *addr))

    def write(stream: _Stream, addr: object, value: int) -> None:
        if isinstance(addr, tuple):  # a flag; the GEMM's signals are addresses of a local tensor
            trace.append((stream.name, "set", *addr))

    def gemm(a: torch.Tensor, b: torch.Tensor, signals: torch.Tensor, rank: int) -> torch.Tensor:
        trace.append((current[-1].name, "gemm"))
        return a.float() @ b.float()

    monkeypatch.setattr(aim, "stream_consume", consume)
    monkeypatch.setattr(aim, "stream_write", write)
    comm = SimpleNamespace(data=shards, side=side, rank=0, world=world, note=lambda stream: None)
    monkeypatch.setattr(aim, "comm_for", lambda *args, **kwargs: comm)
    monkeypatch.setattr(aim, "symmetric_source", lambda a, g: (shards, 0) if symmetric else None)
    monkeypatch.setattr(aim, "pull_flags", lambda g, w: flags)
    monkeypatch.setattr(aim, "ready_done_flags", lambda g, tag, w: flags)
    monkeypatch.setattr(aim, "_signal_buffer", lambda g, w: torch.zeros(w, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", _Using)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.ops.symm_mem, "_async_input_mm", gemm, raising=False)

    A = shards.data[0].clone()
    b = torch.randn(k, 8, dtype=torch.bfloat16)
    A_gathered, outs = aim.all_gather_matmul(A, [b], [None], 0, world, "g", return_A=return_A)
    if return_A:
        assert torch.equal(A_gathered, torch.cat(shards.data)), "gathered rows"
    else:  # the gathered rows are the GEMM's input buffer all the same; the caller does not get them
        assert A_gathered is None
    assert outs[0].shape == (world * rows, 8)  # (the simulated GEMM runs at its launch, before the pulls land)
    return trace


@pytest.mark.parametrize("return_A", [True, False], ids=["return_A", "no_A"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "copied"])
def test_async_input_mm_protocol(monkeypatch, symmetric, return_A):
    world, rank = 3, 0
    peers = [1, 2]  # ring order from rank 0
    trace = _trace_call(monkeypatch, symmetric, world, return_A)
    main = [t[1:] for t in trace if t[0] == "main"]
    side = [t[1:] for t in trace if t[0] == "side"]
    gemm = main.index(("gemm",))
    done_waits = [main.index(("consume", "done", rank, p)) for p in peers]
    # Every peer: its ready awaited, then its shard read (its A, or its workspace), then its done raised.
    for p in peers:
        i = side.index(("consume", "ready", rank, p))
        assert side.index(("read", p)) > i and side.index(("set", "done", p, rank)) > side.index(("read", p)), side
    # Our ready raised on every peer before the GEMM.
    assert all(main.index(("set", "ready", p, rank)) < gemm for p in peers), main
    if symmetric:
        # Nothing published; the peers' done awaited at the end, after the pulls have joined the main stream.
        assert ("read", rank) not in main, main
        assert min(done_waits) > main.index(("wait side",)), main
        assert main[-len(peers) :] == [("consume", "done", rank, p) for p in peers], main
    else:
        # The workspace is free (every peer's done) before our shard is published into it, before the GEMM.
        publish = main.index(("read", rank))
        assert max(done_waits) < publish < gemm, main
        assert main[-1] == ("wait side",), main


def test_shard_offset_is_where_get_buffer_finds_the_shard():
    from fluxcompile.lowerings.all_gather_matmul import async_input_mm as aim

    base = torch.zeros(4 * 64, dtype=torch.bfloat16)

    class _Handle:
        rank = 0

        def __init__(self, start: int) -> None:  # the handle's buffer starts ``start`` elements into ``base``
            self.buffer_ptrs = [base[start:].data_ptr()]
            self.start = start

        def get_buffer(self, rank, shape, dtype, offset=0):
            n = shape[0] * shape[1]
            if self.start + offset + n > base.numel():
                raise RuntimeError("past the end")
            return base[self.start + offset :][:n].view(*shape)

    shard = base[128:].view(2, 64)
    assert aim.shard_offset(_Handle(0), shard) == 128  # the handle starts at the allocation
    assert aim.shard_offset(_Handle(128), shard) == 0  # the handle starts at the shard
    assert aim.shard_offset(_Handle(0), base[1:129].view(2, 64)) == 1
