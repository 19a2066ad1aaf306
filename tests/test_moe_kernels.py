"""The MoE dispatch and combine kernels (kernels/grouped_gemm.py) and their choices (lowerings/all_to_all/triton.py)
on CPU: the grouped GEMM, the pull and the scatter under Triton's interpreter against torch._grouped_mm / bmm and
the ops references, waits that time out into the error words, both protocols between ranks simulated as threads
(kernels in the interpreter), the kernel compiled for sm_90 in every mode (wgmma, TMA, shared memory, no spills),
and the choices' registration and declines. Between GPUs and on one GPU's harness: tests/gpu/test_moe_ranks.py."""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from toolchain import triton_ptxas
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

triton = pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

from fluxcompile import config  # noqa: E402
from fluxcompile.kernels import grouped_gemm as gg  # noqa: E402
from fluxcompile.lowerings.all_to_all import OPS  # noqa: E402
from fluxcompile.lowerings.all_to_all import triton as moe  # noqa: E402
from fluxcompile.lowerings.choices import _REGISTRY, choice_named  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BF16, FP16 = torch.bfloat16, torch.float16
_mode = FakeTensorMode()


def _interpreted(script: str) -> tuple[dict, int]:
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "kernel_checks", script), str(seed)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"seed {seed}:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), seed


# --- the kernels under the interpreter ------------------------------------------------------------------------

_TIMEOUTS = {
    "timeout pull": "rank 0 of group test timed out waiting for rank 1's ready flag: its rows in its send buffer",
    "timeout scatter": "rank 0 of group test timed out waiting for rank 1's ready flag: its receive buffer",
    "timeout done": "rank 1 of group test timed out waiting for rank 0's done flag: its rows delivered",
    "splits disagree": "the split sizes the ranks published add up to 6 rows, but this rank expects 8",
}


def test_grouped_gemm_pull_and_scatter_in_interpreter():
    results, seed = _interpreted("moe_interpreted.py")
    for name, want in _TIMEOUTS.items():
        assert want in results.pop(name), f"{name}: {results.get(name)}"
    assert len(results) == 25, sorted(results)
    for name, err in results.items():
        tol = 1e-6 if "fp32" in name or "TMA" in name else 1e-3  # fp16 outputs: one rounding
        assert err <= tol, f"{name}: relative error {err:.2e} (seed {seed})"


def test_protocols_between_simulated_ranks():
    results, seed = _interpreted("moe_protocol_interpreted.py")
    missing = results.pop("peer missing")
    assert "all_to_all_matmul (triton:tiny): rank 0 of group test timed out waiting for rank 1's ready flag" in missing
    assert set(results) == {"world 2, fused", "world 3, split and fused in turn", "world 2, ordered", "world 1"}
    for name, err in results.items():
        assert isinstance(err, float) and err <= 1e-3, f"{name}: {err} (seed {seed})"


# --- compiled for Hopper, no GPU needed ---------------------------------------------------------------------


def compile_like_launch(kernel, values: dict, constexprs: dict, num_warps: int, num_stages: int):
    """``triton.compile`` for sm_90 with the specialization a launch with these ``values`` gets: pointer
    arguments (``values[name]`` a type such as ``"*bf16"``) 16-byte aligned, an int equal to 1 a constant and one
    divisible by 16 marked so (except where the kernel says ``do_not_specialize``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    nospec = {names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    sig, attrs, consts = {}, {}, dict(constexprs)
    for i, n in enumerate(names):
        if n in consts:
            sig[n] = "constexpr"
            continue
        v = values[n]
        if isinstance(v, str):
            sig[n] = v
            if v.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif n not in nospec and v == 1:
            consts[n], sig[n] = 1, "constexpr"
        else:
            sig[n] = "i64" if abs(v) >= 2**31 else "i32"
            if n not in nospec and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    try:
        return triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
        )
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


def _ptxas(ptx: str, tmp_path) -> tuple[int, int]:
    """(registers per thread, bytes spilled) by ptxas for sm_90a (the ptxas Triton compiles with, -v)."""
    ptxas = triton_ptxas(90)
    if ptxas is None:
        pytest.skip("no ptxas bundled with Triton")
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    regs = max(int(x) for x in re.findall(r"Used (\d+) registers", out.stderr))
    return regs, sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", out.stderr))


def _ptxas_spills(ptx: str, tmp_path) -> int:
    return _ptxas(ptx, tmp_path)[1]


# Mixtral's w1/w3 GEMM as the launcher passes it (K = 4096, N = 14336, 8 experts, 8 ranks).
_K, _N = 4096, 14336
_VALUES = {
    **{p: "*bf16" for p in ("a", "b0", "b1", "c0", "c1", "a_out")},
    "row_index": "*i64", "offs": "*i32", "src_bases": "*i64", "dst_bases": "*i64", "my_flags": "*i32",
    "peer_flags": "*i64", "err": "*i32", "local_addr": 1 << 40, "local_delta": -(1 << 30), "copiers": 16,
    "R": 8192, "n_a": 8192, "K": _K, "n0": _N, "n1": _N, "n_tiles": 224, "E": 8, "group_rows": 0,
    "stride_am": _K, "stride_ak": 1, "sbe0": _K * _N, "sbe1": _K * _N, "sbk0": _N, "sbk1": _N, "sbn0": 1, "sbn1": 1,
    "n_pull": 8192, "y_rows": 8192, "rank": 3, "world": 8, "max_spin": 60_000_000, "num_progs": 132,
}  # fmt: skip
_ORDERED = dict(ORDERED=True, COPY_K=gg.COPIER_K, E_BLOCK=8, W_BLOCK=16)  # as launched for _VALUES' E and world
_MODES = {  # mode -> (constexprs beyond the defaults, B layout [E, N, K]?)
    "w1+w3": (dict(DUAL=True), False),
    "w1+w3, weights [E, N, K]": (dict(DUAL=True, B_T=True), True),
    "one weight, TMA A": (dict(), False),
    "gathered": (dict(GATHER=True, A_TMA=False, DUAL=True, B_T=True), True),
    "fused dispatch": (dict(GATHER=True, A_TMA=False, DUAL=True, PULL=True, B_T=True), True),
    "ordered dispatch": (
        dict(GATHER=True, A_TMA=False, DUAL=True, PULL=True, B_T=True, **_ORDERED), True
    ),
    "pull only": (dict(PULL=True, GEMM=False, A_TMA=False), False),
    "combine scatter": (dict(SCATTER=True, Y_INDEX=True), False),
    "combine accumulate": (dict(SCATTER=True, Y_INDEX=True, ACCUMULATE=True, B_T=True), True),
    "pointer loads": (dict(A_TMA=False, B_TMA=False, DUAL=True), False),
}


def _constexprs(variant: gg.Variant, extra: dict) -> dict:
    bm, bn, bk = gg.launch_block(variant, extra.get("DUAL", False))
    base = dict(
        HAS_OFFS=True, GATHER=False, Y_INDEX=False, A_TMA=True, B_TMA=True, B_T=False,
        DUAL=False, PULL=False, GEMM=True, SCATTER=False, ORDERED=False, ACCUMULATE=False, IEEE=False, ALIGN=16,
        ROW_ALIGN=8, TIMED=True, E_BLOCK=1, W_BLOCK=1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=variant.group_m, COPY_M=gg.COPY_M, COPY_K=gg.COPY_K,
    )  # fmt: skip
    base.update(extra)
    return base


@pytest.mark.parametrize("mode", list(_MODES))
def test_kernel_compiles_for_sm90(mode, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    extra, nk = _MODES[mode]
    v = gg.VARIANTS[gg.DEFAULT]
    const = _constexprs(v, extra)
    values = dict(_VALUES)
    if nk:
        values.update(sbk0=1, sbn0=_K, sbk1=1, sbn1=_K)
    k = compile_like_launch(gg.grouped_gemm_kernel, values, const, v.num_warps, v.num_stages)
    ptx = k.asm["ptx"]
    assert k.metadata.shared <= 227 * 1024, f"shared memory {k.metadata.shared} B exceeds sm_90's 227 KiB"
    if const["GEMM"]:
        assert "wgmma.mma_async" in ptx, "the dot is not on Hopper's wgmma path"
        if const["B_TMA"] or const["A_TMA"]:
            assert "cp.async.bulk.tensor" in ptx, "TMA loads expected"
        if not const["A_TMA"]:
            assert "cp.async.cg.shared.global" in ptx, "A's pointer loads are not pipelined (cp.async)"
    if const["PULL"]:
        assert re.search(r"ld\.global\.cg\.v4", ptx), "the pull's peer loads are not 16-byte vectors"
    if const["PULL"] or const["SCATTER"]:
        assert "%globaltimer" in ptx, "the waits are bounded by the GPU's timer"
    if const["SCATTER"] and not const["ACCUMULATE"]:
        assert "st.global.v4" in ptx, "the scatter's stores are not 16-byte vectors"
    assert _ptxas_spills(ptx, tmp_path) == 0, "registers spill"


@pytest.mark.parametrize("name", list(gg.VARIANTS))
def test_every_variant_fits_sm90(name, tmp_path, monkeypatch):
    """Every tile configuration in the dispatch's heaviest mode (two weights, gathered, fused pull) and the
    combine's: within shared memory, no spills. A variant that runs two programs per SM where nothing waits
    (``per_sm``) must fit twice on an SM in those launches (the GEMM alone: one or two weights, gathered or not)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    v = gg.VARIANTS[name]
    modes = [
        dict(GATHER=True, A_TMA=False, DUAL=True, PULL=True),
        dict(GATHER=True, A_TMA=False, DUAL=True, PULL=True, **_ORDERED),
        dict(SCATTER=True, Y_INDEX=True),
    ]
    plain = [dict(DUAL=True), dict(), dict(GATHER=True, A_TMA=False, DUAL=True)] if v.per_sm > 1 else []
    for extra in modes + plain:
        k = compile_like_launch(gg.grouped_gemm_kernel, _VALUES, _constexprs(v, extra), v.num_warps, v.num_stages)
        assert k.metadata.shared <= 227 * 1024, (extra, k.metadata.shared)
        regs, spills = _ptxas(k.asm["ptx"], tmp_path)
        assert spills == 0, extra
        if extra in plain:
            # sm_90: 228 KiB of shared memory per SM (1 KiB reserved per block), 64 Ki registers
            assert v.per_sm * (k.metadata.shared + 1024) <= 228 * 1024, (extra, k.metadata.shared)
            assert v.per_sm * v.num_warps * 32 * (-(-regs // 8) * 8) <= 65536, (extra, regs)


def test_small_kernels_compile_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    values = {"my_flags": "*i32", "peer_flags": "*i64", "err": "*i32", "rank": 1, "world": 8, "max_spin": 60_000_000}
    values.update({f"u{i:02d}": (1 << 62) | 5 for i in range(gg.MAX_WORLD // 2)})
    compile_like_launch(gg.publish_kernel, values, {}, 1, 1)
    k = compile_like_launch(gg.wait_kernel, values, dict(KIND=3, SKIP_SELF=True, TIMED=True), 1, 1)
    assert "%globaltimer" in k.asm["ptx"], "the waits are bounded by the GPU's timer"
    values.update({"row_index": "*i64", "local_addr": 1 << 40, "src_bases": "*i64", "x_out": "*bf16",
                   "ex_out": "*bf16", "block_flags": "*i32", "n_x": 1000, "n_pull": 998, "K": 4096,
                   "num_progs": 16})  # fmt: skip
    consts = dict(ALIGN=16, TIMED=True, COPY_M=gg.COPY_M, COPY_K=gg.PERMUTED_K, GATHER=True, EXCHANGED=True)
    k = compile_like_launch(gg.permuted_pull_kernel, values, consts, gg.PERMUTED_WARPS, 1)
    assert "%globaltimer" in k.asm["ptx"] and ".release" in k.asm["ptx"], "bounded waits, flags raised with release"
    assert _ptxas_spills(k.asm["ptx"], tmp_path) == 0, "the permuted pull's registers spill"


# --- the launcher's host side -----------------------------------------------------------------------------------


def test_pack_counts():
    packed = gg.pack_counts([5, 2**30 - 1, 0])
    assert len(packed) == gg.MAX_WORLD // 2
    assert all(p >= 2**62 for p in packed), "every argument an int64 (one compiled kernel)"
    assert packed[0] & 0x7FFFFFFF == 5 and (packed[0] >> 32) & 0x3FFFFFFF == 2**30 - 1
    assert packed[1] & 0x7FFFFFFF == 0
    with pytest.raises(ValueError):
        gg.pack_counts([2**30])
    with pytest.raises(ValueError):
        gg.pack_counts([1] * (gg.MAX_WORLD + 1))


def test_weight_layouts():
    block = (128, 128, 64)
    kn = torch.empty(4, 128, 256, dtype=BF16)
    nk = torch.empty(4, 256, 128, dtype=BF16).transpose(1, 2)
    assert gg.weight_layouts([kn, kn], block) is False
    assert gg.weight_layouts([nk], block) is True
    assert gg.weight_layouts([kn, nk], block) is None, "mixed layouts: pointer loads"
    assert gg.weight_layouts([torch.empty(4, 96, 256, dtype=BF16)], block) is None, "K not a multiple of BLOCK_K"
    assert gg.weight_layouts([torch.empty(4, 128, 260, dtype=BF16)], block) is None, "rows not 16-byte aligned"
    assert gg.weight_layouts([torch.empty(4, 96, 256, dtype=BF16).transpose(1, 2).contiguous().transpose(1, 2)],
                             block) is True  # fmt: skip


def test_splits_and_buffers():
    assert moe.split_rows([1, 2], 3, 2, 4, "x") == [4, 8]
    assert moe.split_rows([], 6, 3, 2, "x") == [4, 4, 4]
    with pytest.raises(ValueError):
        moe.split_rows([], 5, 2, 1, "x")
    with pytest.raises(ValueError):
        moe.split_rows([1, 2, 3], 6, 2, 1, "x")
    assert moe.buffer_bytes(1) == 1 << 20 and moe.buffer_bytes((1 << 22) + 1) == 1 << 23
    assert moe.combine_bytes([10, 64], [4, 6], 64, BF16, False) == 10 * 64 * 2
    assert moe.combine_bytes([10, 3, 64], [], 64, BF16, True) == 30 * 64 * 4
    assert moe.DEFAULT == gg.DEFAULT and moe.MAX_WORLD == gg.MAX_WORLD and moe.MAX_WEIGHTS == gg.MAX_WEIGHTS


# --- registration and declines ------------------------------------------------------------------------------


def cuda(*shape, dtype=BF16) -> torch.Tensor:
    """A tensor that says it is on cuda:0, without a GPU (``supports`` reads metadata only)."""
    return FakeTensor(_mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda", 0))


def _triton(op: str) -> dict:
    return {name: c for name, c in _REGISTRY[op].items() if name.startswith("triton:")}


def test_choices_registered_for_both_ops():
    """One Triton choice per op, its tiles as launches: a few timed per call, any variant resolvable by name."""
    assert OPS == ("all_to_all_matmul", "matmul_all_to_all")
    one = [name for name, v in gg.VARIANTS.items() if v.per_sm == 1]
    assert len(one) < len(gg.VARIANTS)
    assert not _triton(OPS[0]) and not _triton(OPS[1])  # no "triton:<variant>" registered
    for op, timed in ((OPS[0], moe.DISPATCH_TIMED), (OPS[1], moe.COMBINE_TIMED)):
        base = _REGISTRY[op]["triton"]
        assert base.family == "moe" and base.launches is not None and 2 <= len(timed) <= 3
    with config.patch(implementations=("+moe",)):
        for v in [*one, *(f"{v}-split" for v in gg.VARIANTS), *(f"{v}-pull{n}" for v in one for n in moe.ORDERED_COPIERS)]:
            assert choice_named(OPS[0], f"triton:{v}").name == f"triton:{v}"
        for v in one:
            assert choice_named(OPS[1], f"triton:{v}").name == f"triton:{v}"
        assert choice_named(OPS[1], "triton:nope") is None


def test_cutlass_dispatch_choices():
    """The CUTLASS dispatch (lowerings/all_to_all/cutlass.py): its names, family and declines (no GPU here: the
    operands' checks pass and the CUTLASS kernels' own reason is last)."""
    from fluxcompile.kernels import cutlass_grouped
    from fluxcompile.lowerings.all_to_all import cutlass as cm

    base = _REGISTRY[OPS[0]]["cutlass"]
    assert base.family == "moe" and base.launches is not None and all(cm.parse(n) for n in cm.TIMED)
    assert [base.variant(n).name for n in cm.NAMES] == [f"cutlass:{n}" for n in cm.NAMES]
    assert len(cm.NAMES) == 2 * len(cutlass_grouped.GROUPED_VARIANTS)
    assert not any(n.startswith("cutlass") for n in _REGISTRY[OPS[1]]), "the combine has no CUTLASS choice yet"
    v = next(iter(cutlass_grouped.GROUPED_VARIANTS))
    assert cm.parse(f"{v}-pull8") == (v, 8)
    for bad in (v, f"{v}-pull0", f"{v}-pullx", "128x128x32-pull8"):
        with pytest.raises(ValueError, match="CUTLASS MoE dispatch"):
            cm.make(bad)
    assert cm.supports(torch.empty(4, 8), [torch.empty(2, 8, 8)], [None], [], [], "g") == "needs CUDA tensors"


def test_cutlass_dispatch_declines(group4):
    from fluxcompile.kernels import cutlass_grouped
    from fluxcompile.lowerings.all_to_all import cutlass as cm

    args, kw = _dispatch()
    assert cm.supports(*args, **kw) == cutlass_grouped.unavailable(), "operands fit: only the kernels' own reason"
    args, kw = _dispatch(offs=None)
    assert "without offs" in cm.supports(*args, **kw)
    args, kw = _dispatch(A=cuda(10, 512, dtype=FP16), Bs=[cuda(2, 512, 768, dtype=FP16)])
    assert "bf16" in cm.supports(*args, **kw)
    args, kw = _dispatch(Bs=[cuda(2, 512, 770)])
    assert "16-byte aligned" in cm.supports(*args, **kw)


def test_variant_names():
    assert moe.tile_variant(f"{gg.DEFAULT}-split") == gg.DEFAULT
    assert moe.tile_variant(f"{gg.DEFAULT}-pull24") == gg.DEFAULT
    assert moe.tile_variant(gg.DEFAULT) == gg.DEFAULT
    moe.make_dispatch(f"{gg.DEFAULT}-pull24")  # any number of copying programs
    for bad in (f"{gg.DEFAULT}-pull0", "64x64x64-w1s1-pull16", f"{gg.DEFAULT}-pullx", "nothing"):
        with pytest.raises(ValueError, match="MoE Triton variant"):
            moe.make_dispatch(bad)
    with pytest.raises(ValueError, match="MoE Triton variant"):
        moe.make_combine(f"{gg.DEFAULT}-pull16")


def _dispatch(A=None, Bs=None, biases=None, out_splits=(3, 5, 0, 2), in_splits=(4, 4, 1, 1), **kw):
    A = cuda(10, 512) if A is None else A
    Bs = [cuda(2, 512, 768), cuda(2, 512, 768)] if Bs is None else Bs
    biases = [None] * len(Bs) if biases is None else biases
    kw.setdefault("offs", cuda(2, dtype=torch.int32))
    kw.setdefault("row_index", cuda(10, dtype=torch.int64))
    return (A, Bs, biases, list(out_splits), list(in_splits), "g"), kw


def _combine(As=None, Bs=None, bias=None, out_shape=(10, 512), **kw):
    As = [cuda(10, 768)] if As is None else As
    Bs = [cuda(2, 768, 512)] if Bs is None else Bs
    kw.setdefault("offs", cuda(2, dtype=torch.int32))
    kw.setdefault("row_index", cuda(10, dtype=torch.int64))
    return (As, Bs, bias, list(out_shape), [3, 5, 0, 2], [4, 4, 1, 1], "g"), kw


@pytest.fixture
def group4(monkeypatch):
    monkeypatch.setattr(moe, "_group_size", lambda name: 4 if name == "g" else f"no process group {name!r}")
    with config.patch(implementations=("+moe",)):
        yield


def test_declined_unless_enabled(monkeypatch):
    monkeypatch.setattr(moe, "_group_size", lambda name: 4)
    assert "moe" not in config.implementations
    off = "off by default: adding 'moe' to config.implementations (FLUXCOMPILE_IMPLEMENTATIONS=+moe) enables it"
    args, kw = _dispatch()  # positional, as the autotuner passes them: the op's arguments in schema order
    for c in _triton(OPS[0]).values():
        why = c.declines(*args, None, None, None, False, kw["offs"], kw["row_index"])
        assert why == off
    args, kw = _combine()
    for c in _triton(OPS[1]).values():
        assert c.declines(*args, None, None, None, False, kw["offs"], kw["row_index"], True) == off


def test_accepts(group4):
    args, kw = _dispatch()
    assert moe.dispatch_supports(*args, **kw) is None
    args, kw = _dispatch(A=cuda(4, 3, 512, dtype=FP16), Bs=[cuda(2, 512, 64, dtype=FP16)] * 3, offs=None,
                         row_index=None, out_splits=(), in_splits=())  # fmt: skip
    assert moe.dispatch_supports(*args, **kw) is None  # fp16, bmm, 3 weights, equal splits, a 3-D A
    args, kw = _combine()
    assert moe.combine_supports(*args, **kw, accumulate=True) is None
    args, kw = _combine(As=[cuda(2, 5, 768)], offs=None, row_index=None)
    assert moe.combine_supports(*args, **kw) is None  # bmm's [E, C, K]


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (dict(A=cuda(10, 512, dtype=torch.float32), Bs=[cuda(2, 512, 64, dtype=torch.float32)]), "dtype torch.float32"),
        (dict(Bs=[cuda(512, 768)]), "dense weights (2-D): another choice handles them"),
        (dict(Bs=[cuda(2, 512, 64, dtype=FP16)]), "mixed dtypes"),
        (dict(Bs=[cuda(2, 512, 64)] * 4), "more than 3 weights"),
        (dict(Bs=[cuda(2, 512, 64)], biases=[cuda(64)]), "a bias with expert weights"),
        (dict(Bs=[cuda(2, 512, 64), cuda(3, 512, 64)]), "weights of different experts or K"),
        (dict(Bs=[cuda(2, 256, 64)]), "A of shape [10, 512] for weights with K = 256"),
        (dict(offs=cuda(3, dtype=torch.int32)), "offs of torch.int32[3] for 2 experts"),
        (dict(row_index=cuda(10, dtype=torch.float32)), "row_index of torch.float32[10]"),
        (dict(out_splits=(5, 5), in_splits=(5, 5)), "2 split sizes for a group of 4 ranks"),
        (dict(out_splits=(), in_splits=(4, 4, 1, 1)), "one split list given, the other empty"),
        (dict(A=torch.empty(10, 512, dtype=BF16)), "needs CUDA tensors"),
        (dict(A_scale=cuda(1, dtype=torch.float32)), "scaled matmuls"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_dispatch_declines(group4, args, reason):
    scaling = {k: args.pop(k) for k in ("A_scale",) if k in args}
    kw = {k: args.pop(k) for k in ("offs", "row_index") if k in args}
    a, k = _dispatch(**args, **kw)
    why = moe.dispatch_supports(*a, **k, **scaling)
    assert why is not None and why.startswith(reason), why


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (dict(As=[cuda(10, 768)] * 2, Bs=[cuda(2, 768, 512)] * 2), "a sum of several matmuls"),
        (dict(bias=cuda(512)), "a bias with expert weights"),
        (dict(Bs=[cuda(768, 512)]), "dense weights (2-D)"),
        (dict(out_shape=(10, 256)), "out_shape [10, 256] for products of 512 columns"),
        (dict(As=[cuda(2, 5, 768)]), "a 3-D A that is not [E, C, K] for bmm"),
        (dict(As=[cuda(10, 768, dtype=FP16)], Bs=[cuda(2, 768, 512, dtype=FP16)]), None),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_combine_declines(group4, args, reason):
    a, k = _combine(**args)
    why = moe.combine_supports(*a, **k)
    assert why == reason if reason is None else (why is not None and why.startswith(reason)), why


def test_group_resolution_declines(monkeypatch):
    with config.patch(implementations=("+moe",)):
        args, kw = _dispatch()
        why = moe.dispatch_supports(*args[:-1], "nope", **kw)
        assert why.startswith("no process group 'nope'"), why
        monkeypatch.setattr(moe, "_group_size", lambda name: 65)
        assert moe.dispatch_supports(*args, **kw) == "more than 64 ranks"


def test_supports_never_raises(group4):
    args, kw = _dispatch()
    assert moe.dispatch_supports(None, *args[1:], **kw).startswith("supports() raised")
    args, kw = _combine()
    assert moe.combine_supports([None], *args[1:], **kw).startswith("supports() raised")
