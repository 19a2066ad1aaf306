"""Where the CUDA toolchain's programs are (the compile-only checks of csrc)."""

from __future__ import annotations

import shutil
from pathlib import Path


def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def find_cuobjdump(nvcc: str) -> str | None:
    """cuobjdump beside nvcc, on PATH, or the one Triton ships."""
    cands = [Path(nvcc).resolve().parent / "cuobjdump", shutil.which("cuobjdump")]
    try:
        import triton

        cands.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        pass
    return next((str(c) for c in cands if c and Path(c).exists()), None)
