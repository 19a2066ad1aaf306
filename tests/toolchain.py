"""Where the CUDA toolchain's programs are (the compile-only checks of csrc)."""

from __future__ import annotations

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


def torch_syntax_check(
    workdir: Path, source: Path, std: str, header: str, includes: Sequence[Path] = ()
) -> list[str] | str:
    """The g++ command checking ``source`` (host code of csrc) against this torch's headers, or why it cannot run
    here (no g++, or no CUDA ``header``). The CPU wheel lacks one generated CUDA header of c10's: a stub in
    ``workdir`` stands in for it."""
    gxx = shutil.which("g++")
    cuda_inc = Path("/usr/local/cuda/include")
    if gxx is None or not (cuda_inc / header).exists():
        return "no g++ or CUDA headers"
    from torch.utils.cpp_extension import include_paths

    stub = workdir / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    return [gxx, f"-std={std}", "-fsyntax-only", "-Wall", "-Werror=return-type", "-DTORCH_EXTENSION_NAME=x",
            f"-I{workdir / 'stub'}", f"-I{cuda_inc}", *(f"-I{d}" for d in includes),
            *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}", str(source)]  # fmt: skip
