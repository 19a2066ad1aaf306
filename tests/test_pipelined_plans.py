"""The plans of the cuBLAS-pipelined choices (slot views and flag addresses, what csrc/sequences.h's sequences are
given), built on CPU over fake symmetric workspaces for 2, 4 and 8 ranks: each peer's slot is where the protocol
says, and the flag lists pair up across ranks (what rank r sets in p is what p waits for from r)."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from fluxcompile.lowerings.all_gather_matmul import cublas_pipelined as ag
from fluxcompile.lowerings.matmul_reduce_scatter import cublas_pipelined as rs
from fluxcompile.symm_mem import comm as comm_module
from fluxcompile.symm_mem import exchange
from fluxcompile.symm_mem.signals import FlagArray

BASE = 1 << 40  # fake address of rank 0's buffers; rank p's are at BASE + p * STRIDE
STRIDE = 1 << 32


class FakeWorkspace:
    """World-many CPU byte buffers standing for one symmetric buffer; view(p, ...) views rank p's."""

    def __init__(self, rank: int, world: int, nbytes: int, tag: str) -> None:
        self.rank, self.world_size, self.tag = rank, world, tag
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world)]
        self.buffer = self.buffers[rank]
        base = BASE + (hash(tag) % 1024) * (1 << 24)
        self.handle = types.SimpleNamespace(buffer_ptrs=[base + p * STRIDE for p in range(world)])

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def view(self, rank, shape, dtype, offset_bytes=0):
        n = 1
        for s in shape:
            n *= s
        raw = self.buffers[rank][offset_bytes : offset_bytes + n * dtype.itemsize]
        return raw.view(dtype).view(shape)


workspace_module = importlib.import_module("fluxcompile.symm_mem.workspace")  # the package's name is the function


@pytest.fixture
def fake(monkeypatch):
    state = {"rank": 0, "world": 2, "ws": {}}

    def workspace(group_name, nbytes, tag="default", world=None):
        key = (state["rank"], tag)
        ws = state["ws"].get(key)
        if ws is None or ws.nbytes < nbytes:
            ws = FakeWorkspace(state["rank"], state["world"], max(nbytes, 1 << 16), tag)
            state["ws"][key] = ws
            workspace_module._generation += 1  # as the real one does: plans built before are stale
        return ws

    def ready_done_flags(group_name, tag, world):
        ws = workspace(group_name, 512, tag)
        return FlagArray(ws, 0, world), FlagArray(ws, 256, world)

    for mod in (rs, ag):
        monkeypatch.setattr(mod, "_plans", {})
    monkeypatch.setattr(comm_module, "workspace", workspace)
    monkeypatch.setattr(comm_module, "side_stream", lambda: None)
    monkeypatch.setattr(comm_module, "_comms", {})
    monkeypatch.setattr(exchange, "ready_done_flags", ready_done_flags)
    monkeypatch.setattr(exchange, "watch", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return state


def _become(state: dict, rank: int, world: int) -> None:
    """Play another rank: as a new process, with no plans yet (the plans' cache is per process, not per rank)."""
    state["rank"], state["world"] = rank, world
    rs._plans.clear()
    ag._plans.clear()
    comm_module._comms.clear()  # the contexts too: they hold the rank's workspaces


def _flag(tag: str, owner: int, which: str, index: int) -> int:
    base = BASE + (hash(tag) % 1024) * (1 << 24) + owner * STRIDE
    return base + (0 if which == "ready" else 256) + 4 * index


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("variant", ["zero_copy", "push", "unsplit"])
def test_rs_plan_slots_and_flags(fake, world, variant):
    rows, n = 24, 40
    tag = "matmul_reduce_scatter.flags"
    for rank in range(world):
        _become(fake, rank, world)
        plan = rs.plan([world * rows, n], 0, world, "g", torch.bfloat16, variant == "push", variant == "unsplit")
        hs = plan.hs
        assert sorted(hs.recv_from) == [p for p in range(world) if p != rank] and hs.recv_from[0] == (rank + 1) % world
        assert hs.send_to == hs.recv_from  # a reduce-scatter sends in ring order: csrc/sequences_rs.cpp pairs them
        for j, p in enumerate(hs.recv_from):
            # Our partial of p's rows goes to slot `rank` of p's buffer, and p's of ours arrives in slot p here.
            assert plan.peer_slots[j].data_ptr() == plan.ws.view(p, (rows, n), torch.bfloat16, 0).data_ptr() + (
                rank * plan.own_slots.stride(0) * 2
            )
            assert hs.ready_theirs[j] == _flag(tag, p, "ready", rank)
            assert hs.ready_mine[j] == _flag(tag, rank, "ready", p)
            assert hs.done_mine[j] == _flag(tag, rank, "done", p)
            assert hs.done_theirs[j] == _flag(tag, p, "done", rank)
        assert plan.own_slots.shape == (world, rows, n)
        assert plan.own_slot.data_ptr() == plan.own_slots[rank].data_ptr()
        if variant == "unsplit":
            assert plan.stage_all.shape == (world * rows, n)
            # after the receive slots, inside the buffer
            assert plan.stage_all.data_ptr() >= plan.own_slots[world - 1].data_ptr() + rows * n * 2
            end = plan.stage_all.data_ptr() + plan.stage_all.numel() * 2
            assert end <= plan.ws.buffer.data_ptr() + plan.ws.nbytes
        if variant == "push":
            assert len(plan.stage_slots) == world - 1
            assert all(s.data_ptr() >= plan.own_slots[world - 1].data_ptr() for s in plan.stage_slots)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ag_plan_slots_and_flags(fake, world):
    rows, k = 16, 48
    tag = "all_gather_matmul.flags"
    for rank in range(world):
        _become(fake, rank, world)
        plan = ag.plan(rows, k, torch.bfloat16, world, "g")
        hs = plan.hs
        assert hs.recv_from[0] == (rank + 1) % world and len(hs.recv_from) == world - 1
        assert hs.send_to == tuple(reversed(hs.recv_from))  # rank - 1 first
        slot_bytes = -(-rows * k * 2 // 256) * 256  # slots are 256-byte aligned
        for j, p in enumerate(hs.send_to):  # the send lists, in send order
            assert plan.peer_slots[j].data_ptr() == plan.ws.buffers[p].data_ptr() + rank * slot_bytes
            assert hs.ready_theirs[j] == _flag(tag, p, "ready", rank)
            assert hs.done_mine[j] == _flag(tag, rank, "done", p)
        for j, p in enumerate(hs.recv_from):  # the receive lists, in ring order
            assert plan.my_slots[j].data_ptr() == plan.ws.buffer.data_ptr() + p * slot_bytes
            assert hs.ready_mine[j] == _flag(tag, rank, "ready", p)
            assert hs.done_theirs[j] == _flag(tag, p, "done", rank)
        assert hs.lists == (list(hs.recv_from), hs.done_mine, hs.ready_theirs, hs.ready_mine, hs.done_theirs)
        # rows * k * 2 = 1536 bytes: the slots abut, so the lead choices read the buffer as the gathered A,
        # each peer's rows where its slot is
        assert plan.buffer is not None and tuple(plan.buffer.shape) == (world * rows, k)
        for j, p in enumerate(hs.recv_from):
            assert plan.buffer[p * rows].data_ptr() == plan.my_slots[j].data_ptr()
    _become(fake, 0, world)
    assert ag.plan(10, 24, torch.bfloat16, world, "g").buffer is None  # 480 bytes: padded slots


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ag_shards_land_in_the_order_they_are_consumed(world):
    """Rank r takes its peers' shards in ring order (r+1 first); with every rank sending in the gather send
    order, one shard per step, ring_order[j]'s shard lands at r at step j + 1, and at each step the ranks send to
    distinct peers (no two into one peer's NVLink at once)."""
    step_of: dict[tuple[int, int], int] = {}  # (src, dst) -> step of the push
    for src in range(world):
        for step, dst in enumerate(exchange.gather_send_order(src, world), start=1):
            step_of[(src, dst)] = step
    for r in range(world):
        assert [step_of[(p, r)] for p in exchange.ring_order(r, world)] == list(range(1, world))
    for step in range(1, world):
        targets = [dst for (src, dst), s in step_of.items() if s == step]
        assert sorted(targets) == list(range(world))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("groups", [2, 3])
def test_ag_stage_groups_cover_every_peer_once_in_arrival_order(world, groups):
    rows = 5
    for rank in range(world):
        js = exchange.stage_groups(world, groups)
        assert [j for g in js for j in g] == list(range(world - 1))  # every peer once, in arrival order
        assert len(js) == min(groups, world - 1) and all(js)
        sizes = [len(g) for g in js]
        assert sizes == sorted(sizes) and sizes[-1] - sizes[0] <= 1  # even, the larger ones last
        covered = [False] * (world * rows)
        for r in range(rank * rows, (rank + 1) * rows):
            covered[r] = True  # our own rows: the first GEMM, from A
        for g in js:
            ranges = exchange.row_ranges(rank, world, rows, g)
            assert 1 <= len(ranges) <= 2
            want = sorted(
                r for j in g for r in range(((rank + 1 + j) % world) * rows, ((rank + 1 + j) % world + 1) * rows)
            )
            assert sorted(r for lo, hi in ranges for r in range(lo, hi)) == want
            for lo, hi in ranges:
                assert lo < hi
                for r in range(lo, hi):
                    assert not covered[r]
                    covered[r] = True
        assert all(covered)


def test_rs_stages_declines_unless_enabled():
    from fluxcompile import config
    from fluxcompile.lowerings.choices import _REGISTRY

    A, B = torch.empty(128, 32, dtype=torch.bfloat16), torch.empty(32, 16, dtype=torch.bfloat16)
    args = ([A], [B], None, [128, 16], 0, "sum", 2, "g")
    choice = _REGISTRY["matmul_reduce_scatter"]["cublas_pipelined:stages2"]
    assert choice.family == "rs_stages"
    assert choice.declines(*args).startswith("off by default: adding 'rs_stages' to config.implementations")
    with config.patch(implementations=("+rs_stages",)):
        assert "CUDA" in choice.declines(*args)
    assert "CUDA" in rs.stages_supports(2)(*args)  # the choice's own rules


def test_ag_stages_declines_unless_enabled():
    from fluxcompile import config
    from fluxcompile.lowerings.choices import _REGISTRY

    A = torch.empty(64, 32, dtype=torch.bfloat16)
    args = (A, [torch.empty(32, 8, dtype=torch.bfloat16)], [None], 0, 2, "g")
    choice = _REGISTRY["all_gather_matmul"]["cublas_pipelined:stages2"]
    assert choice.family == "ag_stages"
    assert choice.declines(*args).startswith("off by default: adding 'ag_stages' to config.implementations")
    with config.patch(implementations=("+ag_stages",)):
        assert "CUDA" in choice.declines(*args)  # CPU tensors: declined by the pipelined rules
    assert "CUDA" in ag.stages_supports(2)(*args)


def test_lead_rows_and_declines():
    assert [exchange.slice_rows(1024, d) for d in ag.LEADS] == [128, 256, 512]
    assert exchange.slice_rows(330, 2) == 128 and exchange.slice_rows(330, 4) == 64
    assert exchange.slice_rows(330, 8) == 0
    A = torch.empty(330, 100, dtype=torch.bfloat16)  # CPU: declined before any size rule
    assert ag.lead_supports(4)(A, [torch.empty(100, 8, dtype=torch.bfloat16)], [None], 0, 2, "g")


def test_tail_rows_and_declines():
    assert [exchange.slice_rows(1024, d) for d in rs.TAILS] == [128, 256, 512]
    assert exchange.slice_rows(77, 2) == 0
    A, B = torch.empty(154, 32, dtype=torch.bfloat16), torch.empty(32, 16, dtype=torch.bfloat16)
    assert rs.tail_supports(2)([A], [B], None, [154, 16], 0, "sum", 2, "g")  # CPU: declined


def test_plan_is_reused_until_the_workspace_grows(fake):
    _become(fake, 0, 2)
    p1 = rs.plan([64, 32], 0, 2, "g", torch.bfloat16, False, False)
    assert rs.plan([64, 32], 0, 2, "g", torch.bfloat16, False, False) is p1
    rs.plan([4096, 512], 0, 2, "g", torch.bfloat16, False, False)  # grows the workspace
    p2 = rs.plan([64, 32], 0, 2, "g", torch.bfloat16, False, False)
    assert p2 is not p1 and p2.ws is not p1.ws


def test_handshake_refuses_more_ranks_than_it_holds():
    from fluxcompile.symm_mem import signals

    with pytest.raises(ValueError, match="65 ranks"):
        signals.ready_done_flags("g", "x.flags", signals.MAX_HANDSHAKE_RANKS + 1)
