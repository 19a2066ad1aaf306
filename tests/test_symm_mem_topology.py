"""A group whose ranks are not all reachable by P2P (several nodes) declines every symmetric-memory choice.

Two gloo ranks on this machine stand for two hosts (``fluxcompile.testing.hosts.simulated_hosts``). Each op of the
tensor-parallel block gains a fake fused choice ``peer:<op>`` (a symmetric-memory choice, as every fused choice
is) that supports CPU tensors and computes with the op's reference; with autotuning off it is the first allowed
choice, so it wins wherever it is not declined. On one host the sites fuse into it; on two hosts every site
keeps its collective and matmuls at compile time with the reason in the rewrite report, and the fused ops
compiled with the choice left to run time run the reference. Outputs equal eager in every case.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import assert_close, fresh_compiles

import fluxcompile
from fluxcompile import config, ops
from fluxcompile.lowerings import Choice, clear_memo, register_choice
from fluxcompile.symm_mem import topology
from fluxcompile.testing.hosts import simulated_hosts

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
SPANS = "the group spans 2 hosts"
CALLS: collections.Counter[str] = collections.Counter()  # per-process calls of the fake choices, by op


def two_hosts(rank: int) -> str:
    return f"node{rank}/boot{rank}"


def tp_block(x, w1, w2, w3, group):
    """all_gather + mm, mm + reduce_scatter, mm + all_reduce."""
    h = funcol.all_gather_tensor(x, 0, group) @ w1
    y = funcol.reduce_scatter_tensor(torch.relu(h) @ w2, "sum", 0, group)
    return funcol.all_reduce(y @ w3, "sum", group)


def inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    return tuple(torch.randn(*s, generator=g) for s in ((4, 16), (16, 32), (32, 16), (16, 8)))


def peer_choice(op: str) -> Choice:
    reference = ops.REFERENCES[op]

    def fn(*args, **kwargs):  # kwargs: all_gather_matmul's return_A
        CALLS[op] += 1
        return reference(*args, **kwargs)

    return Choice(f"peer:{op}", fn)


@contextlib.contextmanager
def peer_choices(choose: str) -> Iterator[None]:
    """``peer:<op>`` first in ``implementations``, autotuning off; the fused ops' CPU kernels run the autotuner's
    choice as their CUDA implementations do. The choices stay registered, inert while ``peer`` is not allowed."""
    from fluxcompile.lowerings.all_gather_matmul import all_gather_matmul_cuda
    from fluxcompile.lowerings.matmul_all_reduce import matmul_all_reduce_cuda
    from fluxcompile.lowerings.matmul_reduce_scatter import matmul_reduce_scatter_cuda

    for op in OPS:
        register_choice(op, peer_choice(op))
    CALLS.clear()
    clear_memo()
    try:
        with (
            config.patch(implementations=("peer", "reference"), choose_at_compile=choose, autotune=False),
            torch.library._scoped_library("fluxcompile", "IMPL") as lib,
        ):
            lib.impl("all_gather_matmul", all_gather_matmul_cuda, "CPU")
            lib.impl("matmul_reduce_scatter", matmul_reduce_scatter_cuda, "CPU")
            lib.impl("matmul_all_reduce", matmul_all_reduce_cuda, "CPU")
            yield
    finally:
        clear_memo()


def compile_and_run(choose: str, hosts: bool) -> dict[str, object]:
    """The block compiled with the sites chosen ``choose`` ("always": at compile time, "never": at run time), on
    one host or two; the report's (fused op, detail) per site and the fake choices' calls."""
    group = dist.group.WORLD
    host = simulated_hosts(two_hosts) if hosts else contextlib.nullcontext()
    with host, peer_choices(choose):
        torch._dynamo.reset()
        compiled = torch.compile(tp_block, backend="fluxcompile")
        with fresh_compiles(), fluxcompile.collect_reports() as rep:
            for seed in (0, 1):  # fresh random inputs after the first call
                args = (*inputs(seed), group)
                assert_close(compiled(*args), tp_block(*args), 1e-5, f"{choose}, two hosts={hosts}, seed {seed}")
        return {"report": [(e.fused_op, e.detail) for e in rep.entries()], "calls": dict(CALLS)}


def layouts() -> dict[str, object]:
    group = dist.group.WORLD
    topology.clear()
    one = topology.layout(group)
    with simulated_hosts(two_hosts):
        two = topology.layout(group.group_name)
        cached = topology.layout(group) is two
    return {"one": one, "two": two, "cached": cached}


def test_layout_is_read_once_per_group_and_alike_on_every_rank(ranks):
    results = ranks(2).run(layouts)
    assert all(r == results[0] for r in results), results
    one, two = results[0]["one"], results[0]["two"]
    # Each rank's CUDA device (gloo ranks on a GPU machine share the first), -1 without CUDA.
    device = 0 if torch.cuda.is_available() else -1
    assert one.no_peer_access is None and len(set(one.hosts)) == 1 and one.devices == (device, device), one
    assert two.hosts == ("node0/boot0", "node1/boot1"), two
    assert two.no_peer_access.startswith(SPANS) and "node0: ranks [0]; node1: ranks [1]" in two.no_peer_access
    assert two.remote_peers(0) == (1,) and one.remote_peers(0) == () and one.local_peers(1) == (0,)
    assert results[0]["cached"]


def test_two_hosts_keep_every_site_with_the_reason(ranks):
    one, two = (ranks(2).run(compile_and_run, "always", hosts) for hosts in (False, True))
    # One host: every site fuses into the peer choice, chosen at compile time (so the test can fail).
    for r in one:
        assert [op for op, _ in r["report"]] == list(OPS), r["report"]
        assert all(r["calls"].get(op) == 2 for op in OPS), r["calls"]
    # Two hosts: every site keeps its collective and matmuls, with the reason; the fake choices never run.
    for r in two:
        assert len(r["report"]) == 3 and all(op is None for op, _ in r["report"]), r["report"]
        for op, (_, detail) in zip(OPS, r["report"]):
            assert detail.startswith(f"no symmetric-memory choice of {op}: {SPANS}"), detail
        assert not r["calls"], r["calls"]


def test_two_hosts_decline_symmetric_memory_at_run_time(ranks):
    # Sites rewritten with the choice left to run time: the autotuner declines the peer choices on two hosts.
    one, two = (ranks(2).run(compile_and_run, "never", hosts) for hosts in (False, True))
    for r in one:
        assert [op for op, _ in r["report"]] == list(OPS), r["report"]
        assert all(r["calls"].get(op) == 2 for op in OPS), r["calls"]
    for r in two:
        assert [op for op, _ in r["report"]] == list(OPS), r["report"]
        assert not r["calls"], r["calls"]


def test_nodes_and_peers_per_pair():
    """Which peers a rank reaches by P2P and which over the network (issue 58's per-peer forms), from the hosts of a
    layout: 2 nodes of 4 ranks, ranks interleaved as a launcher may place them."""
    hosts = ("a/1", "b/2", "a/1", "b/2", "a/1", "b/2", "a/1", "b/2")
    lay = topology.Layout(hosts, (0, 0, 1, 1, 2, 2, 3, 3), None)
    assert lay.nodes == (0, 1, 0, 1, 0, 1, 0, 1) and lay.node_count == 2
    assert lay.local_peers(0) == (2, 4, 6) and lay.remote_peers(0) == (1, 3, 5, 7)
    assert lay.remote(3, 4) and not lay.remote(3, 5)
    assert topology.node_indices(["x", "x", "y"]) == (0, 0, 1)
    one = topology.Layout(("a/1",) * 4, (0, 1, 2, 3), None)
    assert one.node_count == 1 and one.remote_peers(2) == () and one.local_peers(2) == (0, 1, 3)
