"""The Flux-style CUTLASS GEMM (csrc/flux_gemm.cuh) compiled for Hopper on this machine, no GPU needed: one
variant's translation unit (both dtypes, both weight layouts) through nvcc for sm_90a without register spills and
with Hopper's warpgroup MMA fed by TMA, and the generated registry and the binding through the host compiler. The
compilers run in the background from the session's start (tests/prebuild.py); the tests check their results."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import prebuild
import pytest
from toolchain import find_cuobjdump, find_nvcc, torch_cxx_std, torch_syntax_check

from fluxcompile.kernels import cutlass_build, cutlass_gemm, cutlass_grouped_build, extensions

# The variant the check compiles: the first (the persistent cooperative 128x256 tile); the others differ only in
# template arguments. All of them build on a GPU machine (scripts/gpu-check cutlass).
VARIANT = next(iter(cutlass_gemm.VARIANTS))


def _write_sources(tmp_path: Path) -> Path:
    for name, text in {**cutlass_build.generated_sources(), **cutlass_grouped_build.grouped_sources()}.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_variants_and_generated_sources():
    files = cutlass_build.generated_sources()
    fp8 = cutlass_gemm.variants(fp8=True)
    assert fp8 and set(fp8).isdisjoint(cutlass_gemm.variants())
    assert set(files) == (
        {f"flux_gemm_{n}.cu" for n in cutlass_gemm.VARIANTS}
        | {f"flux_gemm_ring_{n}.cu" for n, v in cutlass_gemm.VARIANTS.items() if v.ring}
        | {f"flux_gemm_{n}_s{scale}{fast}.cu" for n in fp8 for scale, fast in cutlass_build.fp8_parts(cutlass_gemm.VARIANTS[n])}
        | {"flux_gemm_registry.cpp"}
    )
    registry = files["flux_gemm_registry.cpp"]
    for name, v in cutlass_gemm.VARIANTS.items():
        assert v.name == name
        assert f'{{"{name}", {v.tile[0]}, {v.tile[1]}, {v.tile[2]}' in registry
        if v.fp8:
            assert name.endswith("_e4m3") and not v.ring
            macro = "FLUX_GEMM_FP8_VARIANT" if v.promotes else "FLUX_GEMM_FP8_FAST_VARIANT"
            assert f"{macro}({name})" in files[f"flux_gemm_{name}.cu"]
            assert len(cutlass_build.fp8_parts(v)) == (4 if v.promotes else 2)
            for scale, fast in cutlass_build.fp8_parts(v):
                assert f"FLUX_GEMM_FP8_PART({name}," in files[f"flux_gemm_{name}_s{scale}{fast}.cu"]
            continue
        assert f"FLUX_GEMM_VARIANT({name}," in files[f"flux_gemm_{name}.cu"]
        ring = f"&flux_gemm_ring_{name}}}" if v.ring else "nullptr}"
        assert f"&flux_gemm_{name}, {ring}" in registry
    # a build of other variants is another build directory
    assert "flux_gemm" in extensions.SOURCES


def _flux_gemm_job(unit: str) -> Callable[[Path], list[str] | str]:
    """nvcc of the generated translation unit ``unit`` (flux_gemm_<variant>.cu or flux_gemm_ring_<variant>.cu)."""

    def make(workdir: Path) -> list[str] | str:
        nvcc = find_nvcc()
        include = cutlass_build.cutlass_include()
        if nvcc is None or include is None:
            return "no nvcc or no CUTLASS headers (nvidia-cutlass, in the test extra)"
        src = _write_sources(workdir) / unit
        return [nvcc, f"-std={torch_cxx_std()}", "-O3", extensions.arch_flag((9, 0)), *extensions.EXTRA_NVCC["flux_gemm"],
                f"-I{extensions.CSRC}", *(f"-I{d}" for d in include), "-Xptxas", "-v", "-c", str(src),
                "-o", str(workdir / "v.o")]  # fmt: skip

    return make


def _host_job(source: str) -> Callable[[Path], list[str] | str]:
    """g++ -fsyntax-only of ``source`` (the generated registry, written into the job's directory, or a file of csrc)
    against this torch's headers."""

    def make(workdir: Path) -> list[str] | str:
        _write_sources(workdir)
        src = workdir / source if (workdir / source).exists() else extensions.CSRC / source
        return torch_syntax_check(workdir, src, "cuda_runtime.h", [extensions.CSRC])

    return make


HOST_SOURCES = ("flux_gemm_registry.cpp", "flux_gemm_binding.cpp", "cutlass_grouped_registry.cpp", "cutlass_grouped_binding.cpp")
# The ring's build of the same variant (a source and the reduce-scatter ring's epilogue).
RING_VARIANT = next(n for n, v in cutlass_gemm.VARIANTS.items() if v.ring)
prebuild.register("flux_gemm_sm90a", _flux_gemm_job(f"flux_gemm_{VARIANT}.cu"))
prebuild.register("flux_gemm_ring_sm90a", _flux_gemm_job(f"flux_gemm_ring_{RING_VARIANT}.cu"))
# The fp8 kernel with the most to hold: row-wise scales (two vector broadcasts) with fp8's fp32 promotion (a
# second accumulator), in the cooperative variant whose warp groups' 64 x 128 accumulators leave room for it.
FP8_VARIANT = next(n for n in cutlass_gemm.variants(fp8=True) if cutlass_gemm.VARIANTS[n].promotes)
prebuild.register("flux_gemm_fp8_sm90a", _flux_gemm_job(f"flux_gemm_{FP8_VARIANT}_s20.cu"))
# The experts' grouped GEMM: one variant (both weight layouts, and the kernel writing the groups' arrays).
GROUPED_VARIANT = next(iter(cutlass_grouped_build.GROUPED_VARIANTS))
prebuild.register("cutlass_grouped_sm90a", _flux_gemm_job(f"cutlass_grouped_{GROUPED_VARIANT}.cu"))
for _source in HOST_SOURCES:
    prebuild.register(f"host:{_source}", _host_job(_source), timeout_s=300)


@pytest.mark.prebuild("flux_gemm_sm90a")
@pytest.mark.prebuild("flux_gemm_ring_sm90a")
@pytest.mark.parametrize("job", ("flux_gemm_sm90a", "flux_gemm_ring_sm90a"))
def test_flux_gemm_compiles_for_sm90a_without_spills(job):
    """One variant's translation unit, plain and with the reduce-scatter ring's source and epilogue."""
    _built_without_spills(job, 4, "HGMMA")  # 2 dtypes x 2 weight layouts


def _built_without_spills(job: str, kernels: int, mma: str) -> None:
    """The prebuilt unit ``job`` compiled, its ``kernels`` or more kernels (ptxas reports) without spills, and its
    SASS with the warpgroup MMA ``mma`` and TMA loads and stores (skipped without cuobjdump)."""
    got = prebuild.finished(job)
    out = got.out
    assert out.returncode == 0, out.stderr[-4000:]
    reports = [line for line in out.stderr.splitlines() if "spill stores" in line]
    assert len(reports) >= kernels, out.stderr[-3000:]
    assert all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in reports), "\n".join(reports)
    cuobjdump = find_cuobjdump(out.args[0])
    if cuobjdump is None:
        pytest.skip("compiled without spills; no cuobjdump to read the SASS with")
    sass = subprocess.run([cuobjdump, "-sass", str(got.workdir / "v.o")], capture_output=True, text=True)
    assert sass.returncode == 0, sass.stderr[-2000:]
    assert mma in sass.stdout and "UTMALDG" in sass.stdout and "UTMASTG" in sass.stdout


@pytest.mark.prebuild("flux_gemm_fp8_sm90a")
def test_flux_gemm_fp8_compiles_for_sm90a_without_spills():
    """One kernel of an fp8 variant (e4m3 x e4m3, row-wise scales in the epilogue, no fast accumulation)."""
    got = prebuild.finished("flux_gemm_fp8_sm90a")
    assert got.out.returncode == 0, got.out.stderr[-4000:]
    assert "E4M3E4M3" in got.out.stderr  # the kernel's name: Hopper's fp8 warpgroup MMA
    _built_without_spills("flux_gemm_fp8_sm90a", 1, "QGMMA")


@pytest.mark.prebuild("host:flux_gemm_registry.cpp")
@pytest.mark.prebuild("host:flux_gemm_binding.cpp")
@pytest.mark.parametrize("source", HOST_SOURCES)
def test_registry_and_binding_compile(source):
    out = prebuild.finished(f"host:{source}").out
    assert out.returncode == 0, f"{source}:\n{out.stderr[-4000:]}"


def test_grouped_variants_and_generated_sources():
    files = cutlass_grouped_build.grouped_sources()
    assert set(files) == {f"cutlass_grouped_{n}.cu" for n in cutlass_grouped_build.GROUPED_VARIANTS} | {
        "cutlass_grouped_registry.cpp"
    }
    registry = files["cutlass_grouped_registry.cpp"]
    for name, v in cutlass_grouped_build.GROUPED_VARIANTS.items():
        assert v.name == name
        assert f"GROUPED_VARIANT({name}, {v.tile[0]}, {v.tile[1]}, {v.tile[2]}" in files[f"cutlass_grouped_{name}.cu"]
        assert f'{{"{name}", {v.tile[0]}, {v.tile[1]}, {v.tile[2]}' in registry and f"&cutlass_grouped_{name}}}" in registry
    assert "cutlass_grouped" in extensions.SOURCES


@pytest.mark.prebuild("cutlass_grouped_sm90a")
def test_cutlass_grouped_compiles_for_sm90a_without_spills():
    """One variant of the experts' grouped GEMM: CUTLASS's ptr-array kernel in both weight layouts."""
    _built_without_spills("cutlass_grouped_sm90a", 2, "HGMMA")
