"""Which backend torch's symmetric memory allocates from (``config.symm_mem_backend``): torch's CUDA backend (CUDA
IPC between the GPUs of one host, the default) or its NVSHMEM backend (one symmetric heap per process; peers on
other hosts reachable by NVSHMEM's put/get over the network).

torch takes the backend once per process (``torch.distributed._symmetric_memory.set_backend``), before its first
symmetric allocation; afterwards it cannot change. :func:`apply` runs before every symmetric allocation of this
package (workspace.py) and when the backend compiles its first graph (backend.py), so fluxcompile's choice is in
place before PyTorch's own ``torch_symm_mem`` choices allocate; where something else allocated first with another
backend, torch refuses the change and :func:`apply` says so in one line. (torch reports its default backend before
any allocation too, so only its refusal tells that it is too late.) With NVSHMEM it also sizes the heap (``NVSHMEM_SYMMETRIC_SIZE``, read
when NVSHMEM starts, at the first allocation) from ``config.nvshmem_heap_mb`` where the environment does not set it:
every workspace of the process lives in that heap (the all-gather's at 8192 x 12288 bf16, TP=2, is 192 MiB alone).
"""

from __future__ import annotations

import torch

from ..config import config

HEAP_VARIABLE = "NVSHMEM_SYMMETRIC_SIZE"
_applied: dict[int, str] = {}  # device index -> the backend set for it


def wanted() -> str:
    """torch's name of the configured backend: ``"CUDA"`` or ``"NVSHMEM"``."""
    return config.symm_mem_backend.upper()


def apply(device: torch.device | int | None = None, need_bytes: int = 0) -> str:
    """Set torch's symmetric-memory backend to the configured one before allocations that bring this process's
    symmetric memory to ``need_bytes`` on ``device`` (default: the current CUDA device), once per device; returns
    its name. Raises where torch already uses another backend there, where NVSHMEM is asked for and unavailable,
    or where NVSHMEM's heap is smaller than ``need_bytes``."""
    from torch.distributed import _symmetric_memory as symm

    if device is None:
        index = torch.cuda.current_device()
    else:
        index = device if isinstance(device, int) else device.index
    want = wanted()
    if want == "CUDA":  # torch's default: nothing to set (torch may run on another backend a user chose)
        return want
    _check_heap(need_bytes)
    if _applied.get(index) == want:
        return want
    if not symm.is_nvshmem_available():
        raise RuntimeError("fluxcompile: symm_mem_backend is 'nvshmem', but this torch has no NVSHMEM backend")
    have = _current(symm, index)
    if have is None or have.upper() != want:
        # torch reports its default (CUDA) before any allocation too: set it, and let torch say if it is too late
        try:
            symm.set_backend(want)
        except RuntimeError as e:
            raise RuntimeError(
                f"fluxcompile: symm_mem_backend is {config.symm_mem_backend!r}, but torch's symmetric memory on "
                f"cuda:{index} runs {have} and cannot change ({str(e).splitlines()[0] if str(e) else 'refused'}): "
                "set FLUXCOMPILE_SYMM_MEM_BACKEND before anything allocates symmetric memory"
            ) from None
    if not config.nvshmem_heap_env():  # NVSHMEM reads it when it starts, at the first allocation
        config.export_nvshmem_heap()
    _applied[index] = want
    return want


def torch_fused_ops_problem() -> str | None:
    """Why PyTorch's own fused symm_mem ops (``fused_all_gather_matmul``, ``fused_matmul_reduce_scatter`` and their
    scaled forms) cannot run with the configured backend (None: they can): they allocate their buffers by group
    name, which torch's NVSHMEM allocator refuses (seen on torch 2.11: "NVSHMEMSymmetricMemoryAllocator::alloc must
    not be called with a group_name")."""
    if wanted() == "NVSHMEM":
        return "PyTorch's fused symm_mem ops allocate by group name, which its NVSHMEM backend refuses"
    return None


def _current(symm, index: int) -> str | None:
    """The backend torch uses on cuda:``index``, None where it has not chosen one yet."""
    try:
        return symm.get_backend(torch.device("cuda", index))
    except (AttributeError, RuntimeError):  # a torch without get_backend, or no backend chosen
        return None


def _check_heap(need_bytes: int) -> None:
    """The NVSHMEM heap (the environment's, else ``config.nvshmem_heap_mb``) holds ``need_bytes``."""
    have = config.nvshmem_heap_env()
    heap = heap_bytes(have) if have else config.nvshmem_heap_mb << 20
    if need_bytes > heap:
        where = f"{HEAP_VARIABLE}={have}" if have else f"nvshmem_heap_mb={config.nvshmem_heap_mb}"
        raise RuntimeError(
            f"fluxcompile: a symmetric workspace needs {need_bytes >> 20} MiB, more than NVSHMEM's heap ({where}): "
            f"raise FLUXCOMPILE_NVSHMEM_HEAP_MB (or {HEAP_VARIABLE}) before the first allocation"
        )


def heap_bytes(value: str) -> int:
    """NVSHMEM's size syntax (a number with an optional K, M, G or T suffix, powers of 1024) in bytes."""
    text = value.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMGT" else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"fluxcompile: {HEAP_VARIABLE}={value!r} is not a size (e.g. 2G, 512M)") from None


def reset() -> None:
    """Forget what was applied (tests)."""
    _applied.clear()
