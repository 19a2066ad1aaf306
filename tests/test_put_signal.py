"""The put-with-signal exchange (kernels/put_signal.py, kernels/nvshmem_device.py) and the DLRM op's put form
(lowerings/embedding_bag_all_to_all/put.py) on CPU: the protocol between simulated ranks under Triton's
interpreter (kernel_checks/put_interpreted.py), both kernels compiled for sm_90 (the NVSHMEM one against NVSHMEM's
device bitcode, where installed), and where the put form runs and where it declines. Between processes with the
NVSHMEM backend: tests/gpu/test_nvshmem_pes.py."""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

from fluxcompile import config
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import embedding_bag as eb
from fluxcompile.kernels import nvshmem_device as nv
from fluxcompile.kernels import put_signal as ps
from fluxcompile.lowerings import transport as tr
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import put as put_bw
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import triton as lo_bw
from fluxcompile.lowerings.choices import _REGISTRY, Choice
from fluxcompile.lowerings.embedding_bag_all_to_all import put
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo

HERE = os.path.dirname(os.path.abspath(__file__))
OP = "embedding_bag_all_to_all"
BW = "all_to_all_embedding_bag_backward"


def test_put_form_in_interpreter():
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "kernel_checks", "put_interpreted.py"), str(seed)],
        capture_output=True, text=True, env=env, timeout=600, cwd=os.path.join(HERE, "kernel_checks"),
    )  # fmt: skip
    assert out.returncode == 0, f"seed {seed}:\n{out.stderr[-4000:]}"
    results = json.loads(out.stdout.strip().splitlines()[-1])
    timeout = results.pop("timeout")
    bw = results.pop("backward timeout")
    assert len(results) >= 10, sorted(results)
    for name, err in results.items():
        assert err <= 1e-5, f"{name}: relative error {err:.2e} of its dtype's tolerance (seed {seed})"
    assert "rank 0 timed out in call 1 waiting for rank 1's pooled rows" in timeout, timeout
    want = "(put): rank 0 timed out in call 1 waiting for rank 1's put gradient rows (its arrival counter never"
    assert want in bw, bw


# --- compiled for Hopper ----------------------------------------------------------------------------------------

_TYPES = {
    "send": "*bf16", "out": "*bf16", "recv": "*bf16", "counters": "*i64", "peer_data": "*i64",
    "peer_counters": "*i64", "src_start": "*i64", "dst_off": "*i64", "state": "*i64", "D": "i32",
    "parity_elems": "i64", "rank": "i32", "world": "i32",
}  # fmt: skip


def _compile(kernel, const: dict, types: dict[str, str], extern_libs=None, num_warps: int = 4):
    """``triton.compile`` of ``kernel`` for sm_90 (``const``: its constexprs; ``extern_libs``: NVSHMEM's bitcode)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in const else types[n] for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    options = {"num_warps": num_warps, "num_stages": 1}
    if extern_libs:
        options["extern_libs"] = tuple(extern_libs.items())
    try:
        return __import__("triton").compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


def _put(own_in_recv: bool = False) -> dict:
    return {"OWN_IN_RECV": own_in_recv, "SLICES": 4, "BLOCK": ps.COPY_BLOCK}


def test_p2p_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptx = _compile(ps.put_chunks_p2p_kernel, _put(True), _TYPES).asm["ptx"]
    assert re.search(r"\b(atom|red)\.global\.sys\.release\.add\.u64", ptx), "the arrival counters' release adds"
    assert "nvshmem" not in ptx


def test_nvshmem_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    """Linked against NVSHMEM's device bitcode: the put-with-signal and signal-only calls resolve (the wheel
    nvidia-nvshmem-cu13 comes with a CUDA torch; without it, skipped)."""
    path = nv.bitcode(90)
    if path is None:
        pytest.skip("NVSHMEM's device bitcode is not installed (nvidia-nvshmem-cu13)")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    k = _compile(ps.put_chunks_nvshmem_kernel, _put(), _TYPES, {"libnvshmem_device": path})
    ptx = k.asm["ptx"]
    assert "nvshmem" in ptx, "no NVSHMEM call in the kernel"
    assert "ld.global" in ptx and "st.global" in ptx  # our own chunk's copy


_OFFSET_TYPES = {
    "values": "*i64", "outbox": "*i64", "inbox": "*i64", "counters": "*i64", "peer_inbox": "*i64",
    "peer_counters": "*i64", "ostate": "*i64", "dst_off": "*i64", "err": "*i32", "max_spin": "i64", "rank": "i32",
    "world": "i32",
}  # fmt: skip


def test_offsets_kernels_compile_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptx = _compile(ps.publish_offsets_p2p_kernel, {"BLOCK_W": 64}, _OFFSET_TYPES, num_warps=1).asm["ptx"]
    assert re.search(r"\b(atom|red)\.global\.sys\.release\.add\.u64", ptx)
    _compile(ps.fetch_offsets_kernel, {"BLOCK_W": 64, "TIMED": True}, _OFFSET_TYPES, num_warps=1)
    path = nv.bitcode(90)
    if path is not None:
        kernel = ps.publish_offsets_nvshmem_kernel
        ptx = _compile(kernel, {"BLOCK_W": 64}, _OFFSET_TYPES, {"libnvshmem_device": path}, num_warps=1).asm["ptx"]
        assert "nvshmem" in ptx


def test_slices_are_powers_of_two():
    assert ps.slices(0) == 1 and ps.slices(1) == 1
    assert ps.slices(ps.SLICE_BYTES + 1) == 2
    assert ps.slices(3 * ps.SLICE_BYTES) == 4
    assert ps.slices(1 << 40) == ps.MAX_SLICES
    with pytest.raises(ValueError, match="slices"):
        ps.put_chunks(*[torch.empty(1)] * 4, src_start=torch.empty(1), dst_off=torch.empty(1), state=torch.empty(1),
                      dim=1, parity_elems=1, rank=0, world=2, n_slices=3, nvshmem=True)  # fmt: skip


# --- where the put form runs ----------------------------------------------------------------------------------


def test_registered():
    choice = _REGISTRY[OP][f"put:{eb.DEFAULT}"]
    assert choice.family == "dlrm" and choice.remote_peers and choice.symmetric_memory
    assert not _REGISTRY[OP][f"triton:{eb.DEFAULT}"].remote_peers
    bw = _REGISTRY[BW]["put"]
    assert bw.family == "dlrm" and bw.remote_peers and not _REGISTRY[BW]["triton"].remote_peers


@pytest.mark.parametrize(
    ("transport", "backend", "world", "remote", "why"),
    [
        ("p2p", "cuda", 2, False, "exchange_transport is 'p2p' and every peer is on this host"),
        ("p2p", "nvshmem", 4, False, "exchange_transport is 'p2p' and every peer is on this host"),
        ("put", "cuda", 2, False, "put-with-signal needs symm_mem_backend 'nvshmem'"),
        ("p2p", "cuda", 2, True, "put-with-signal needs symm_mem_backend 'nvshmem'"),
        ("put", "nvshmem", 1, False, "one rank"),
        ("put", "nvshmem", 2, False, None),
        ("p2p", "nvshmem", 8, True, None),
    ],
)
def test_transport(transport, backend, world, remote, why):
    with config.patch(exchange_transport=transport, symm_mem_backend=backend):
        got = tr.transport_problem(world, remote)
    assert (got is None) if why is None else (why in (got or "")), got


def _args(splits=()):
    weights = [torch.randn(10, 16) for _ in range(2)]
    indices = [torch.randint(0, 10, (8,)) for _ in weights]
    offsets = [torch.arange(0, 8, 2) for _ in weights]
    return (weights, indices, offsets, 0, False, [4, 32], list(splits), list(splits), "g2")


def test_declines(monkeypatch):
    monkeypatch.setitem(lo._group_sizes, "g2", 2)
    _, supports = put.make(eb.DEFAULT, lambda g: False)
    with config.patch(implementations=IMPLEMENTATIONS, exchange_transport="put", symm_mem_backend="nvshmem"):
        # the operands here are on the CPU (on CUDA these calls are taken, unequal splits too)
        assert supports(*_args((1, 3))) == "not on a CUDA device"
        assert supports(*_args((2, 2))) == "not on a CUDA device"
        # forced, the P2P form steps aside
        why = _REGISTRY[OP][f"triton:{eb.DEFAULT}"].declines(*_args())
        assert why == "exchange_transport is 'put' (the put-with-signal form runs instead of the stores into peers)"


def _bw_args(splits=()):
    grad = torch.randn(4, 32)
    indices = [torch.randint(0, 10, (8,)) for _ in range(2)]
    offsets = [torch.arange(0, 8, 2) for _ in range(2)]
    o2b = [torch.zeros(8, dtype=torch.long) for _ in range(2)]
    sizes = [torch.full((4,), 2) for _ in range(2)]
    empty = [torch.empty(0, dtype=torch.long) for _ in range(2)]
    return (grad, indices, offsets, o2b, sizes, empty, [10, 10], False, 0, list(splits), list(splits), "g2")


def test_backward_declines(monkeypatch):
    monkeypatch.setitem(lo_bw._group_sizes, "g2", 2)
    _, supports = put_bw.make(lambda g: False)
    with config.patch(implementations=IMPLEMENTATIONS, exchange_transport="put", symm_mem_backend="nvshmem"):
        # the operands here are on the CPU (on CUDA these calls are taken, unequal splits too)
        assert supports(*_bw_args((1, 3))) == "not on a CUDA device"
        assert supports(*_bw_args((2, 2))) == "not on a CUDA device"
        why = _REGISTRY[BW]["triton"].declines(*_bw_args())
        assert why == "exchange_transport is 'put' (the put-with-signal form runs instead of the reads from peers)"


def test_peers_decline_lets_nvshmem_choices_span_hosts():
    spans = "the group spans 2 hosts (a: ranks [0]; b: ranks [1]), and symmetric memory reaches only ..."
    p2p_choice = Choice("a:x", lambda: None)
    put_choice = Choice("b:x", lambda: None, remote_peers=True)
    ref = Choice("reference", lambda: None, symmetric_memory=False)
    for backend in ("cuda", "nvshmem"):
        with config.patch(symm_mem_backend=backend):
            assert p2p_choice.peers_decline(spans) == spans
            assert ref.peers_decline(spans) is None
            assert put_choice.peers_decline(spans) == (spans if backend == "cuda" else None)
            assert put_choice.peers_decline(None) is None


def test_backward_workspace_holds_both_forms():
    lay = lo_bw.layout(12, 3, 16, (), (), 1, 4)
    for itemsize in (2, 4):
        recv, send, end = put_bw.regions(lay, itemsize)
        assert recv >= lay.data_bytes(itemsize) and recv % 256 == 0
        assert send >= recv + 2 * lay.parity_elems * itemsize and send % 256 == 0
        assert end == send + 12 * 48 * itemsize == put_bw.data_bytes(lay, itemsize)
    assert lo_bw.OFFSET_COUNTERS + 8 * lo_bw.MAX_WORLD == lo_bw.FLAG_BYTES
    # unequal splits: a receive half holds world x our rows (a bound alike on every rank holding as many)
    uneven = lo_bw.layout(12, 3, 16, (2, 1, 4, 5), (3, 3, 3, 3), 1, 4)
    assert put_bw.recv_parity(uneven) == 4 * 12 * 48 and put_bw.recv_parity(lay) == lay.parity_elems


def test_data_workspace_holds_both_forms():
    lay = lo.layout(12, 3, 16, (12, 48), (), (), 1, 4)
    for itemsize in (2, 4):
        assert put.send_offset(lay, itemsize) >= lay.data_bytes(itemsize)
        assert put.send_offset(lay, itemsize) % 256 == 0
        assert put.data_bytes(lay, itemsize) == put.send_offset(lay, itemsize) + 12 * 3 * 16 * itemsize
