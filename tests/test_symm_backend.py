"""The symmetric-memory backend setting (symm_mem/backend.py, ``config.symm_mem_backend``) on CPU, against a stand-in
for torch's ``_symmetric_memory`` backend API: applied once before the first allocation, NVSHMEM's heap sized,
and a clear line where it is too late, unavailable or too small. The NVSHMEM backend's runs on GPUs:
tests/gpu (issue 58)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fluxcompile import config
from fluxcompile.config import ConfigError
from fluxcompile.symm_mem import backend


class FakeSymm:
    """torch.distributed._symmetric_memory's backend calls, recorded."""

    def __init__(self, current="CUDA", available=True):
        self.current, self.available, self.calls, self.allocated = current, available, [], False

    def get_backend(self, device):
        return self.current  # torch 2.11 names its default before any allocation

    def set_backend(self, name):
        if self.allocated and name != self.current:
            raise RuntimeError("Cannot set backend after symmetric memory has been allocated")
        self.calls.append(name)
        self.current = name

    def is_nvshmem_available(self):
        return self.available


@pytest.fixture
def fake(monkeypatch):
    import torch.distributed._symmetric_memory as symm

    stand_in = FakeSymm()
    for name in ("get_backend", "set_backend", "is_nvshmem_available"):
        monkeypatch.setattr(symm, name, getattr(stand_in, name))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(backend.HEAP_VARIABLE, raising=False)
    backend.reset()
    yield stand_in
    backend.reset()


def test_cuda_is_left_alone(fake):
    assert backend.apply(None, 1 << 40) == "CUDA"
    assert fake.calls == []


def test_nvshmem_is_set_once_with_its_heap(fake, monkeypatch):
    with config.patch(symm_mem_backend="nvshmem", nvshmem_heap_mb=1024):
        assert backend.apply(0, 300 << 20) == "NVSHMEM"
        assert backend.apply(0, 600 << 20) == "NVSHMEM"
    assert fake.calls == ["NVSHMEM"]
    import os

    assert os.environ[backend.HEAP_VARIABLE] == "1024M"


def test_too_late_names_both_backends(fake):
    fake.allocated = True  # something allocated with torch's default first
    with config.patch(symm_mem_backend="nvshmem"), pytest.raises(RuntimeError) as e:
        backend.apply(0)
    assert "runs CUDA and cannot change (Cannot set backend after" in str(e.value), e.value
    assert "FLUXCOMPILE_SYMM_MEM_BACKEND" in str(e.value)


def test_nvshmem_unavailable(fake):
    fake.available = False
    with config.patch(symm_mem_backend="nvshmem"), pytest.raises(RuntimeError, match="no NVSHMEM backend"):
        backend.apply(0)


def test_heap_too_small(fake, monkeypatch):
    monkeypatch.setenv(backend.HEAP_VARIABLE, "64M")
    with config.patch(symm_mem_backend="nvshmem"), pytest.raises(RuntimeError) as e:
        backend.apply(0, 192 << 20)  # the all-gather's workspace at 8192 x 12288 bf16, TP=2
    assert "needs 192 MiB" in str(e.value) and "NVSHMEM_SYMMETRIC_SIZE=64M" in str(e.value)
    with config.patch(symm_mem_backend="nvshmem", nvshmem_heap_mb=128), pytest.raises(RuntimeError, match="64M"):
        backend.apply(0, 100 << 20)


def test_heap_sizes():
    assert backend.heap_bytes("2G") == 2 << 30 and backend.heap_bytes("512M") == 512 << 20
    assert backend.heap_bytes("1024") == 1024 and backend.heap_bytes("1.5g") == 3 << 29
    with pytest.raises(ValueError, match="not a size"):
        backend.heap_bytes("lots")


def test_setting_is_checked():
    with pytest.raises((ValueError, ConfigError)):
        config.symm_mem_backend = "nccl"
    assert config.symm_mem_backend == "cuda"


def test_workspace_allocation_applies_the_backend(fake, monkeypatch):
    """workspace() asks for the backend before its first symmetric allocation, with the bytes the process will then
    hold on the device."""
    import importlib

    ws = importlib.import_module("fluxcompile.symm_mem.workspace")  # the package exports its function by that name

    asked = []
    monkeypatch.setattr(backend, "apply", lambda device, need: asked.append((device, need)) or "NVSHMEM")
    monkeypatch.setattr(ws, "enable_group", lambda name: None)
    monkeypatch.setattr(ws, "process_group", lambda name: SimpleNamespace(rank=lambda: 0, size=lambda: 1))
    monkeypatch.setattr(ws, "persistent", lambda make, what: (torch.zeros(8, dtype=torch.uint8), object()))
    monkeypatch.setattr(ws, "_workspaces", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ws.workspace("g", 4096, "t")
    assert asked and asked[0][0] == 0 and asked[0][1] >= 4096


def test_torch_fused_ops_decline_on_nvshmem():
    """PyTorch's fused all-gather/reduce-scatter ops allocate by group name, which its NVSHMEM allocator refuses
    (torch 2.11, tests/gpu/test_nvshmem_pes.py): their choices decline there with the reason, before any call."""
    from fluxcompile.lowerings.all_gather_matmul import torch_symm_mem as ag
    from fluxcompile.lowerings.matmul_reduce_scatter import torch_symm_mem as rs

    with config.patch(symm_mem_backend="nvshmem"):
        why = backend.torch_fused_ops_problem()
        assert why == "PyTorch's fused symm_mem ops allocate by group name, which its NVSHMEM backend refuses"
        if hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
            assert ag._unavailable("fused_all_gather_matmul") == why
            assert rs._on_cuda_with(_Cuda(), _Cuda(), "fused_matmul_reduce_scatter") == why
    with config.patch(symm_mem_backend="cuda"):
        assert backend.torch_fused_ops_problem() is None


class _Cuda:
    """An operand as the reduce-scatter's check sees it on a GPU."""

    is_cuda = True
