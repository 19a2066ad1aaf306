"""fp8 over gloo, for the CPU tests: gloo has no fp8 type, so the functional collectives that only move data
(all_gather_into_tensor, all_to_all_single) move fp8 tensors as bytes, as the fused ops' references do.

``install()`` registers CPU kernels for those ops that view an fp8 input as uint8, call the ops' own kernels and
view the result back; other dtypes go straight to the ops' own kernels. Once per process (a test hook: the
package never calls it).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..ops import FP8_DTYPES

_libs: list[torch.library.Library] = []


def _as_bytes(name: str):
    op = getattr(torch.ops._c10d_functional, name).default
    key = torch._C.DispatchKey.CompositeExplicitAutograd

    def kernel(x: Tensor, *args):
        if x.dtype in FP8_DTYPES:
            return op._op_dk(key, x.contiguous().view(torch.uint8), *args).view(x.dtype)
        return op._op_dk(key, x, *args)

    return kernel


@functools.cache
def install() -> None:
    """Let the data-moving functional collectives take fp8 tensors on CPU (gloo) process groups."""
    lib = torch.library.Library("_c10d_functional", "IMPL")
    for name in ("all_gather_into_tensor", "all_to_all_single"):
        lib.impl(name, _as_bytes(name), "CPU")
    _libs.append(lib)
