"""Lazy JIT build of the CUDA sources in ``csrc/`` with ``torch.utils.cpp_extension.load``.

A module is built on first use on a GPU machine, for that GPU's architecture (``sm_90a`` on Hopper, so
arch-specific instructions are allowed; else the device's own ``sm_XY``), into
``~/.cache/fluxcompile/csrc/<name>-<hash>`` where the hash covers the sources, the architecture, torch's
version and the flags: a changed source or another machine builds anew, an unchanged one loads in
milliseconds. Ranks building at once are serialized by cpp_extension's lock file in that directory.

Where there is no GPU, no nvcc, or the build fails, :func:`load` raises :class:`Unavailable` with the reason
(remembered, so a failing build is tried once per process): the choices built on it then decline.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
from pathlib import Path
from types import ModuleType

import torch

from ..config import config
from . import cutlass_build, cutlass_grouped_build

CSRC = Path(__file__).resolve().parent.parent / "csrc"  # fluxcompile/csrc, shipped inside the package
SOURCES: dict[str, tuple[str, ...]] = {
    # module name -> its sources (headers are hashed too, so an edited header rebuilds)
    "gemv_ar": ("gemv_ar.cu", "gemv_ar_binding.cpp", "gemv_ar.h", "gemv_ar_tuning.h", "bounded_wait.cuh"),
    # host code only: the cuBLAS-pipelined choices' stream sequences (sequences.h names each file's part)
    "pipelined": (
        "sequences.h", "sequences.cpp", "sequences_ag.cpp", "sequences_rs.cpp", "memops.h", "memops.cpp", "streams.h",
        "streams.cpp", "replays.h", "replays.cpp", "cublaslt_addmm.h", "cublaslt_addmm.cpp", "sequences_flux.cpp", "flux_problem.h", "flux_gemm.h",
        "pipelined_binding.cpp",
    ),
    # the Flux-style CUTLASS GEMM; its per-variant translation units are generated (GENERATED)
    "flux_gemm": ("flux_gemm.h", "flux_gemm.cuh", "flux_gemm_binding.cpp", "bounded_wait.cuh", "cutlass_params.cuh"),
    # the experts' CUTLASS grouped GEMM; its per-variant translation units are generated too
    "cutlass_grouped": (
        "cutlass_grouped.h", "cutlass_grouped.cuh", "cutlass_grouped_binding.cpp", "bounded_wait.cuh", "cutlass_params.cuh",
    ),
}  # fmt: skip
NVCC_FLAGS = ("-O3", "-lineinfo")  # the C++ standard is cpp_extension's choice (it matches torch's headers)
# Per module: extra nvcc flags, and a function returning its generated files ({name: text}, written into the build
# directory and hashed with the sources) or its extra include directories (None: a prerequisite is missing).
_CUTLASS_NVCC = (
    "--expt-relaxed-constexpr", "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
)  # fmt: skip
EXTRA_NVCC: dict[str, tuple[str, ...]] = {
    # CUTLASS needs the half/bfloat16 operators that cpp_extension's default flags switch off.
    "flux_gemm": _CUTLASS_NVCC,
    "cutlass_grouped": _CUTLASS_NVCC,
}


def _generated(name: str) -> dict[str, str]:
    if name == "flux_gemm":
        return cutlass_build.generated_sources()
    if name == "cutlass_grouped":
        return cutlass_grouped_build.grouped_sources()
    return {}


def _includes(name: str) -> list[str] | None:
    if name in ("flux_gemm", "cutlass_grouped"):
        return cutlass_build.cutlass_include()
    return []


@functools.cache
def _host_flags(name: str) -> tuple[str, ...]:
    """Host compiler flags of module ``name`` beyond -O3: for pipelined, the nvidia-cublas wheel's headers
    searched after every other directory (``-idirafter``), so that cublasLt.h is found where the toolkit lacks
    it and the toolkit's own headers still win. Without it, cublaslt_addmm.cpp builds without cuBLASLt. Looked up
    once per process (the build's hash and the build itself use it)."""
    if name != "pipelined":
        return ()
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations or [] if spec is not None else []:
        for sub in (f"cu{str(torch.version.cuda).split('.')[0]}/include", "cublas/include"):
            if (Path(root) / sub / "cublasLt.h").is_file():
                return ("-idirafter", str(Path(root) / sub))
    return ()


class Unavailable(RuntimeError):
    """The extension cannot be built or loaded here (the message says why)."""


_loaded: dict[str, ModuleType] = {}
_failed: dict[str, str] = {}


def arch_flag(capability: tuple[int, int]) -> str:
    """The ``-gencode`` flag for a device of this compute capability (``sm_90a`` for Hopper)."""
    major, minor = capability
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def cache_root() -> Path:
    return Path(config.csrc_cache or "~/.cache/fluxcompile/csrc").expanduser()


def build_dir(name: str, capability: tuple[int, int]) -> Path:
    h = hashlib.sha256()
    for src in SOURCES[name]:
        h.update(src.encode())
        h.update((CSRC / src).read_bytes())
    for gen, text in sorted(_generated(name).items()):
        h.update(gen.encode())
        h.update(text.encode())
    h.update(arch_flag(capability).encode())
    h.update(" ".join(NVCC_FLAGS + EXTRA_NVCC.get(name, ()) + _host_flags(name)).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    return cache_root() / f"{name}-{h.hexdigest()[:16]}"


def unavailable_reason() -> str | None:
    """Why no csrc module can be built on this machine (None if it may be)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return "no nvcc (CUDA_HOME unset)"
    return None


def load(name: str) -> ModuleType:
    """The built module ``name`` (see ``SOURCES``), building it first if needed; raises :class:`Unavailable`."""
    mod = _loaded.get(name)
    if mod is not None:
        return mod
    if name in _failed:
        raise Unavailable(_failed[name])
    why = unavailable_reason()
    if why is not None:
        raise Unavailable(why)
    from torch.utils import cpp_extension

    includes = _includes(name)
    if includes is None:
        _failed[name] = f"csrc/{name}: its headers are missing (the CUTLASS modules: pip install nvidia-cutlass)"
        raise Unavailable(_failed[name])
    capability = torch.cuda.get_device_capability()
    directory = build_dir(name, capability)
    directory.mkdir(parents=True, exist_ok=True)
    sources = [str(CSRC / s) for s in SOURCES[name] if not s.endswith((".h", ".cuh"))]
    for gen, text in _generated(name).items():
        path = directory / gen
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        sources.append(str(path))
    try:
        # An explicit -gencode keeps cpp_extension from adding its default architecture list.
        mod = cpp_extension.load(
            name=f"fluxcompile_{name}_{directory.name.rsplit('-', 1)[1]}",
            sources=sources,
            extra_cflags=["-O3", *_host_flags(name)],
            extra_cuda_cflags=[*NVCC_FLAGS, *EXTRA_NVCC.get(name, ()), arch_flag(capability)],
            extra_include_paths=[str(CSRC), *includes],
            build_directory=str(directory),
            with_cuda=True,  # CUDA headers and cudart also for the host-only modules
            verbose=config.csrc_verbose,
        )
    except Exception as e:
        _failed[name] = f"building csrc/{name} failed: {type(e).__name__}: {str(e)[-2000:]}"
        raise Unavailable(_failed[name]) from e
    _loaded[name] = mod
    return mod
