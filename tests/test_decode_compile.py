"""The decode kernels compiled for Hopper on this machine, no GPU needed: every Triton variant of
kernels/gemm_ar.py through Triton's front end and ptxas (what its interpreter cannot catch), and
csrc/gemv_ar.cu through nvcc when nvcc is installed. Plus the csrc builder's pure parts."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

import prebuild  # noqa: E402
from test_kernels_compile import compile_sm90  # noqa: E402
from toolchain import find_cuobjdump, find_nvcc, torch_cxx_std, torch_syntax_check  # noqa: E402

from fluxcompile.kernels import extensions  # noqa: E402
from fluxcompile.kernels.gemm_ar import VARIANTS  # noqa: E402


def _cases():
    for name, v in VARIANTS.items():
        for tail in (False, True):
            yield pytest.param(v, tail, id=f"{name}-{'tail' if tail else 'plain'}")


@pytest.mark.parametrize(("variant", "tail"), list(_cases()))
def test_gemm_ar_compiles_for_sm90(variant, tail, tmp_path, monkeypatch):
    from fluxcompile.kernels.gemm_ar import gemm_ar_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bm, bn, bk = variant.block
    const = dict(
        HAS_BIAS=True, TWO_SHOT=variant.two_shot, TAIL=tail, WEIGHT_AFTER_CAST=tail, IEEE=False, NUM_PROGS=132,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    ptrs = "a b bias out normed residual norm_w".split()
    types = {
        **{p: "*bf16" for p in ptrs},
        "peer_data": "*i64", "peer_flags": "*i64", "state": "*i32", "ss_part": "*fp32", "err": "*i32", "eps": "fp32",
    }  # fmt: skip
    k = compile_sm90(gemm_ar_kernel, const, types, variant.num_warps, variant.num_stages)
    ptx = k.asm["ptx"]
    assert "mma" in ptx, "the dot did not become a tensor-core instruction"
    assert "ld.global.cg" in ptx or "ld.cg" in ptx.replace("ld.global.cg", "ld.cg"), "peer data not read at L2"
    assert ".sys" in ptx, "no system-scope flag operations"
    assert k.metadata.shared <= 227 * 1024


def test_arch_flag_and_build_dir():
    assert extensions.arch_flag((9, 0)) == "-gencode=arch=compute_90a,code=sm_90a"
    assert extensions.arch_flag((8, 0)) == "-gencode=arch=compute_80,code=sm_80"
    assert extensions.build_dir("gemv_ar", (9, 0)) != extensions.build_dir("gemv_ar", (8, 0))
    assert extensions.build_dir("gemv_ar", (9, 0)) == extensions.build_dir("gemv_ar", (9, 0))


def test_sources_name_every_csrc_file_their_module_includes():
    """Each module's SOURCES name every csrc file that its sources include (so that the build key hashes it: an
    edited header rebuilds), and every file of csrc belongs to a module (but its documents, *.md)."""
    import re

    for name, sources in extensions.SOURCES.items():
        for source in sources:
            for inc in re.findall(r'^#include "([^"]+)"', (extensions.CSRC / source).read_text(), re.M):
                if (extensions.CSRC / inc).is_file():
                    assert inc in sources, f"{name}: {source} includes {inc}, which SOURCES[{name!r}] does not name"
    named = {s for sources in extensions.SOURCES.values() for s in sources}
    assert {p.name for p in extensions.CSRC.iterdir() if p.suffix != ".md"} <= named


def test_pipelined_finds_the_cublas_wheels_headers(tmp_path, monkeypatch):
    """cublaslt_addmm.cpp's cuBLASLt header comes from the nvidia-cublas wheel, searched after every other directory;
    without it the module builds without cuBLASLt (no flag)."""
    import importlib.machinery
    import importlib.util

    import torch

    root = tmp_path / "nvidia"
    spec = importlib.machinery.ModuleSpec("nvidia", None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "nvidia" else None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    flags = extensions._host_flags
    try:
        flags.cache_clear()  # looked up once per process: forget the real lookup and each one here
        assert flags("pipelined") == ()
        (root / "cu13" / "include").mkdir(parents=True)
        (root / "cu13" / "include" / "cublasLt.h").write_text("")
        flags.cache_clear()
        assert flags("pipelined") == ("-idirafter", str(root / "cu13" / "include"))
        assert flags("gemv_ar") == ()
    finally:
        flags.cache_clear()


def test_load_declines_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine builds for real (tests/gpu)")
    with pytest.raises(extensions.Unavailable, match="no CUDA device"):
        extensions.load("gemv_ar")


def _gemv_ar_job(workdir: Path) -> list[str] | str:
    nvcc = find_nvcc()
    if nvcc is None:
        return "no nvcc"
    return [nvcc, f"-std={torch_cxx_std()}", "-O3", extensions.arch_flag((9, 0)), "-Xptxas", "-v", "-c",
            str(extensions.CSRC / "gemv_ar.cu"), "-o", str(workdir / "gemv_ar.o")]  # fmt: skip


# The translation units of the pipelined module (host code: the cuBLAS-pipelined choices' stream sequences).
PIPELINED_SOURCES = tuple(s for s in extensions.SOURCES["pipelined"] if s.endswith(".cpp"))


def _pipelined_job(source: str) -> Callable[[Path], list[str] | str]:
    """csrc/``source`` against this torch's headers, with the cuBLASLt part where the nvidia-cublas wheel's headers
    are installed (the module's own flags)."""

    def make(workdir: Path) -> list[str] | str:
        cmd = torch_syntax_check(workdir, extensions.CSRC / source, "cuda.h")
        return cmd if isinstance(cmd, str) else [*cmd[:-1], *extensions._host_flags("pipelined"), cmd[-1]]

    return make


prebuild.register("gemv_ar_sm90a", _gemv_ar_job, timeout_s=300)
for _source in PIPELINED_SOURCES:
    prebuild.register(f"pipelined:{_source}", _pipelined_job(_source), timeout_s=300)


@pytest.mark.prebuild("gemv_ar_sm90a")
def test_gemv_ar_cu_compiles_for_sm90a():
    got = prebuild.finished("gemv_ar_sm90a")
    out = got.out
    assert out.returncode == 0, out.stderr[-4000:]
    assert "spill stores" in out.stderr
    assert " 0 bytes spill stores" in out.stderr and "bytes spill stores" not in out.stderr.replace(
        " 0 bytes spill stores", ""
    ), f"register spills:\n{out.stderr[-3000:]}"
    # The wgmma loader's math must be Hopper's warpgroup MMA fed by bulk tensor copies (mma.sync fed from
    # shared memory ran 18% slower at m = 64).
    cuobjdump = find_cuobjdump(out.args[0])
    if cuobjdump is None:
        pytest.skip("compiled without spills; no cuobjdump to read the SASS with")
    sass = subprocess.run([cuobjdump, "-sass", str(got.workdir / "gemv_ar.o")], capture_output=True, text=True)
    assert sass.returncode == 0, sass.stderr[-2000:]
    assert "HGMMA" in sass.stdout and "UTMALDG" in sass.stdout


@pytest.mark.parametrize(
    "source", [pytest.param(s, marks=pytest.mark.prebuild(f"pipelined:{s}")) for s in PIPELINED_SOURCES]
)
def test_pipelined_sources_compile(source):
    out = prebuild.finished(f"pipelined:{source}").out
    assert out.returncode == 0, f"{source}:\n{out.stderr[-4000:]}"
