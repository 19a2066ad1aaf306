"""Compile the Triton kernels for Hopper (sm_90) on this machine, no GPU needed: Triton's front end and
ptxas catch what its CPU interpreter cannot (unsupported syntax, shared-memory overflow, TMA lowering),
before any device time is spent. Also checks that the matrix instructions are wgmma and the loads TMA."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")


def compile_sm90(kernel, constexprs: dict, types: dict[str, str], num_warps: int, num_stages: int):
    """``triton.compile`` of ``kernel`` for sm_90: parameters named in ``constexprs`` get those values, the
    others the type in ``types`` (default ``i32``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    try:
        return triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
        )
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


def _ag_cases():
    from fluxcompile.kernels.ag_gemm import VARIANTS

    for name, v in VARIANTS.items():
        for b_t in (False, True) if v.tma else (False,):
            yield pytest.param(v, b_t, id=f"{name}-{'nk' if b_t else 'kn'}")


@pytest.mark.parametrize(("variant", "b_t"), list(_ag_cases()))
def test_ag_gemm_compiles_for_sm90(variant, b_t, tmp_path, monkeypatch):
    from fluxcompile.kernels.ag_gemm import ag_gemm_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bm, bn, bk = variant.block
    const = dict(
        HAS_BIAS0=True, HAS_BIAS1=False, HAS_BIAS2=False, HAS_BIAS3=False, NUM_PROGS=132,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=variant.group_m, STORE_A=True, USE_TMA=variant.tma, B_T=b_t,
    )  # fmt: skip
    ptrs = "a_local a_out a_slots b0 b1 b2 b3 c0 c1 c2 c3 bias0 bias1 bias2 bias3".split()
    types = {**{p: "*bf16" for p in ptrs}, "flags": "*i32", "err": "*i32"}
    k = compile_sm90(ag_gemm_kernel, const, types, variant.num_warps, variant.num_stages)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "the dot is not on Hopper's wgmma path"
    if variant.tma:
        assert "cp.async.bulk.tensor" in ptx, "TMA variant without TMA loads"
    assert k.metadata.shared <= 227 * 1024, f"shared memory {k.metadata.shared} B exceeds sm_90's 227 KiB"
