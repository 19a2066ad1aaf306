"""Where the CUDA toolchain's programs are (the compile-only checks of csrc)."""

from __future__ import annotations

import re
import shutil
import sysconfig
from collections.abc import Sequence
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


def triton_ptxas(arch: int = 90) -> str | None:
    """The ptxas Triton itself runs for ``arch`` (Triton 3.9 ships two and takes the newer one for sm_90, whose PTX
    the other rejects), or None where Triton has none."""
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    try:
        return get_ptxas(arch).path
    except (AttributeError, RuntimeError):  # a Triton without get_ptxas, or no ptxas to be found
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        return str(bundled) if bundled.exists() else None


def torch_cxx_std() -> str:
    """The C++ standard torch's extension builds pass (``-std=`` in ``torch.utils.cpp_extension``'s flags, for the
    host compiler and nvcc alike): c++20 on the supported torch releases, whose headers need it from 2.14 on."""
    import torch.utils.cpp_extension as cpp_extension

    found = re.findall(r"-std=c\+\+(\d+)", Path(cpp_extension.__file__).read_text())
    return f"c++{max(int(v) for v in found)}" if found else "c++17"


def torch_syntax_check(workdir: Path, source: Path, header: str, includes: Sequence[Path] = ()) -> list[str] | str:
    """The g++ command checking ``source`` (host code of csrc) against this torch's headers with torch's C++
    standard, or why it cannot run here (no g++, or no CUDA ``header``). The CPU wheel lacks one generated CUDA
    header of c10's: a stub in ``workdir`` stands in for it."""
    gxx = shutil.which("g++")
    cuda_inc = Path("/usr/local/cuda/include")
    if gxx is None or not (cuda_inc / header).exists():
        return "no g++ or CUDA headers"
    from torch.utils.cpp_extension import include_paths

    stub = workdir / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    return [gxx, f"-std={torch_cxx_std()}", "-fsyntax-only", "-Wall", "-Werror=return-type", "-DTORCH_EXTENSION_NAME=x",
            f"-I{workdir / 'stub'}", f"-I{cuda_inc}", *(f"-I{d}" for d in includes),
            *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}", str(source)]  # fmt: skip
