"""NVSHMEM's device functions for the Triton kernels (kernels/put_signal.py), and how a kernel that calls them is
compiled and launched.

The externs name NVSHMEM's own device API (``nvshmemx_putmem_signal_block``, ``nvshmemx_signal_op``), linked from
NVSHMEM's device bitcode. They are declared here rather than taken from
``torch.distributed._symmetric_memory._nvshmem_triton``, whose functions exist only where torch sees a GPU: the
kernels also compile for sm_90 on a machine without one (tests/test_put_signal.py). At launch, torch's
``requires_nvshmem`` supplies what NVSHMEM needs: the bitcode as the kernel's extern library, and the
initialization of every CUDA module the kernel compiles into (``nvshmemx_cumodule_init``).

Addresses are symmetric: a buffer of the NVSHMEM heap has the same offset in every PE's heap, so the local address
of this rank's copy names the peer's copy in ``pe``'s heap (torch's NVSHMEM backend allocates every symmetric
tensor there).
"""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
from collections.abc import Callable

import triton
import triton.language as tl
from triton.language import core

SIGNAL_SET = tl.constexpr(0)  # NVSHMEM_SIGNAL_SET
SIGNAL_ADD = tl.constexpr(5)  # NVSHMEM_SIGNAL_ADD


@core.extern
def putmem_signal_block(dst, src, nbytes, sig, value, op, pe, _semantic=None):
    """``nvshmemx_putmem_signal_block``: every thread of the program copies ``nbytes`` from local ``src`` to the
    symmetric ``dst`` on ``pe``, then NVSHMEM updates the symmetric uint64 ``sig`` on ``pe`` (``op``: set or add
    ``value``) once the data is delivered; returns when ``src`` may be reused. Addresses as int64."""
    return core.extern_elementwise(
        "", "",
        [dst, src, nbytes, sig, value, op, pe],
        {
            (core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int64"),
             core.dtype("uint64"), core.dtype("int32"), core.dtype("int32")): ("nvshmemx_putmem_signal_block",
                                                                               core.dtype("int32")),
        },
        is_pure=False, _semantic=_semantic,
    )  # fmt: skip


@core.extern
def signal_op(sig, value, op, pe, _semantic=None):
    """``nvshmemx_signal_op``: update the symmetric uint64 ``sig`` on ``pe`` (set or add ``value``), no data."""
    return core.extern_elementwise(
        "", "",
        [sig, value, op, pe],
        {
            (core.dtype("int64"), core.dtype("uint64"), core.dtype("int32"), core.dtype("int32")): (
                "nvshmemx_signal_op", core.dtype("int32"),
            ),
        },
        is_pure=False, _semantic=_semantic,
    )  # fmt: skip


@triton.jit
def put_with_signal(dst, src, nbytes, sig, value, pe):
    """Put ``nbytes`` (may be 0: then the signal alone, where ``value`` is not 0) and add ``value`` to ``sig`` on
    ``pe`` after them."""
    v = value.to(tl.uint64)
    if nbytes > 0:
        putmem_signal_block(dst.to(tl.int64), src.to(tl.int64), nbytes.to(tl.int64), sig.to(tl.int64), v,
                            SIGNAL_ADD, pe.to(tl.int32))  # fmt: skip
    elif value != 0:
        signal_op(sig.to(tl.int64), v, SIGNAL_ADD, pe.to(tl.int32))


def bitcode(capability: int = 90) -> str | None:
    """The path of NVSHMEM's device bitcode for compute ``capability`` (torch's finder first, then the wheel's
    ``nvidia/nvshmem/lib``: one ``libnvshmem_device.bc``, or one per architecture in NVSHMEM 3.5 and later), None
    where NVSHMEM's device library is not installed."""
    try:
        from torch.distributed._symmetric_memory._nvshmem_triton import NvshmemLibFinder

        return NvshmemLibFinder.find_device_library()
    except Exception:  # an older torch, or its finder found nothing
        pass
    lib = os.path.join(sysconfig.get_path("purelib"), "nvidia", "nvshmem", "lib")
    for name in ("libnvshmem_device.bc", f"libnvshmem_device_sm_{capability}.bc"):
        if os.path.exists(os.path.join(lib, name)):
            return os.path.join(lib, name)
    found = sorted(glob.glob(os.path.join(lib, "libnvshmem_device_sm_*.bc")))
    return found[-1] if found else None


@functools.cache
def launcher(kernel: triton.runtime.JITFunction) -> Callable:
    """``kernel`` ready to launch with NVSHMEM (``launcher(kernel)[grid](...)``): torch's ``requires_nvshmem``,
    which links the device bitcode and initializes each compiled module for NVSHMEM."""
    from torch.distributed._symmetric_memory._nvshmem_triton import requires_nvshmem

    return requires_nvshmem(kernel)
