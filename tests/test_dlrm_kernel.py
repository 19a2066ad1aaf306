"""The DLRM kernel (kernels/embedding_bag.py) and its choices (lowerings/embedding_bag_all_to_all) on CPU: the pooling
kernel, the whole protocol between 2-3 simulated ranks and its bounded waits under Triton's interpreter
(kernel_checks/dlrm_interpreted.py), the kernels compiled for sm_90, the layout of a call's rows, registration and
the choices' reasons to decline. The protocol on GPUs: tests/gpu/test_dlrm_ranks.py."""

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

pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

from fluxcompile import config
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import embedding_bag as eb
from fluxcompile.lowerings import embedding_bag_all_to_all as lowering
from fluxcompile.lowerings.choices import _REGISTRY
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo

HERE = os.path.dirname(os.path.abspath(__file__))
OP = "embedding_bag_all_to_all"


def test_kernels_in_interpreter():
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "kernel_checks", "dlrm_interpreted.py"), str(seed)],
        capture_output=True, text=True, env=env, timeout=600, cwd=os.path.join(HERE, "kernel_checks"),
    )  # fmt: skip
    assert out.returncode == 0, f"seed {seed}:\n{out.stderr[-4000:]}"
    results = json.loads(out.stdout.strip().splitlines()[-1])
    timeouts = results.pop("timeouts")
    assert len(results) >= 15, sorted(results)
    for name, err in results.items():
        assert err <= 1e-5, f"{name}: relative error {err:.2e} of its dtype's tolerance (seed {seed})"
    rows, offs = timeouts
    assert "rank 0 timed out in call 1 waiting for rank 1's pooled rows (its counter never reached" in rows, rows
    assert "rank 0 timed out in call 1 waiting for rank 1's published split offsets" in offs, offs


# --- compiled for Hopper (no GPU needed: Triton's front end and ptxas) -----------------------------------------


def _compile_sm90(kernel, constexprs: dict, types: dict[str, str], num_warps: int, div16=()):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(
        fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    try:
        return __import__("triton").compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1}
        )
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


_POOL_TYPES = {
    "tables": "*i64", "peer_data": "*i64", "peer_counters": "*i64", "dst_off": "*i64", "src_start": "*i64",
    "state": "*i64", "book": "*i64", "psw": "*i64",
}  # fmt: skip


@pytest.mark.parametrize(
    ("variant", "dtype", "signal"),
    [(name, "fp32" if i % 2 == 0 else "bf16", i % 2 == 0) for i, name in enumerate(eb.VARIANTS)]
    + [(eb.DEFAULT, "bf16", True), (eb.DEFAULT, "fp16", False)],
)
def test_pool_kernel_compiles_for_sm90(variant, dtype, signal, tmp_path, monkeypatch):
    """Every offered variant compiles; with 16-aligned tables and dim the row loads and stores are 16-byte vectors."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    v = eb.VARIANTS[variant]
    const = dict(
        MODE=1, LAST=False, IDX64=True, OFF64=False, SIGNAL=signal, ALIGNED=True, BOOK=signal, PAD=signal,
        PSW=not signal,
        BLOCK_B=v.block_b, BLOCK_D=v.column_block(128), UNROLL=v.unroll,
    )  # fmt: skip
    k = _compile_sm90(
        eb.pool_kernel, const, {**_POOL_TYPES, "out": f"*{dtype}"}, v.num_warps,
        div16=("D", "tables", "out", "dst_off", "src_start", "parity_elems"),
    )  # fmt: skip
    ptx = k.asm["ptx"]
    assert "ld.global.v4" in ptx, "the table rows are not loaded as 16-byte vectors"
    assert "st.global.v4" in ptx or "st.global.v2" in ptx, "the pooled rows are not stored as vectors"
    # atom. or red. (Triton 3.9 emits the reduction where the old value is unused): the same release add
    release_add = re.search(r"\b(atom|red)\.global\.sys\.release\.add\.u64", ptx) is not None
    assert release_add == signal, "the counters' release adds at system scope (64-bit)"


def test_protocol_kernels_compile_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    _compile_sm90(eb.wait_kernel, {}, {"counters": "*i64", "expect": "*i64", "state": "*i64", "err": "*i32"}, 1)
    _compile_sm90(
        eb.publish_kernel, {"BLOCK_W": 64}, {"my_pub": "*i64", "my_flag": "*i64", "my_prefix": "*i64", "state": "*i64"}, 1
    )
    _compile_sm90(
        eb.fetch_offsets_kernel, {"BLOCK_W": 64},
        {"my_prefix": "*i64", "peer_pub": "*i64", "peer_flags": "*i64", "dst_off": "*i64", "state": "*i64", "err": "*i32"},
        1,
    )  # fmt: skip
    _compile_sm90(
        eb.copy_kernel, {"BLOCK": eb.COPY_BLOCK},
        {"out": "*bf16", "recv": "*bf16", "state": "*i64", "total": "i64", "hole_lo": "i64", "hole_hi": "i64",
         "parity_elems": "i64"}, 4,
    )  # fmt: skip
    _compile_sm90(eb.fill_kernel, {}, {"dst": "*i64", **{f"v{i}": "i64" for i in range(16)}}, 1)


# --- layout -------------------------------------------------------------------------------------------------


def test_layout_equal_and_unequal_splits():
    # DLRM: 4 ranks, 8 bags each (32 pooled per rank), 2 tables of 16: rank 1's rows 8..16 go to rank 1, etc.
    lay = lo.layout(32, 2, 16, (32, 32), (), (), 1, 4)
    assert lay.uniform and lay.in_splits == lay.out_splits == (8,) * 4
    assert lay.src_start == (0, 16, 32, 48, 64)  # segments: 8 bags x 2 tables per chunk
    assert lay.recv_prefix == (0, 256, 512, 768) and lay.hole == (256, 512)
    assert lay.equal_dst_off() == (256,) * 4  # our chunk comes second in every receiver's output
    assert lay.expect == (17, 0, 17, 17)  # 16 segments + the token; none from ourselves
    assert lay.out_shape == (32, 32) and lay.parity_elems == 1024
    # unequal: rank 0 of 2 sends [3, 5] rows and receives [3, 1]
    lay = lo.layout(8, 1, 16, (8, 16), (3, 1), (3, 5), 0, 2)
    assert not lay.uniform and lay.src_start == (0, 3, 8) and lay.recv_prefix == (0, 48)
    assert lay.out_shape == (4, 16) and lay.expect == (0, 2) and lay.parity_elems == 2 * 128
    # a 3-D out_shape and one segment per entry
    assert lo.layout(6, 2, 16, (2, 3, 32), (), (), 0, 2).src_start == (0, 6, 12)
    assert lo.layout(4, 2, 16, (8, 16), (), (), 1, 2).src_start == (0, 4, 8)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((4, 2, 16, [4, 33], [], [], 2), "does not hold"),
        ((4, 2, 16, [16, 8], [], [], 2), "cuts a table's 16 columns"),
        ((4, 2, 16, [4, 32], [1, 1, 2], [], 2), "split list of 3 entries for a group of 2 ranks"),
        ((4, 2, 16, [4, 32], [], [1, 2], 2), "input splits add up to 3"),
        ((3, 2, 16, [3, 32], [], [], 2), "equal splits of 3 rows over 2 ranks"),
        ((4, 2, 16, [4, 32], [-1, 5], [2, 2], 2), "negative output split"),
    ],
)
def test_split_problems(args, why):
    assert why in (lo.split_problem(*args) or ""), lo.split_problem(*args)


# --- registration and declines --------------------------------------------------------------------------------


def test_registered_choices():
    names = list(_REGISTRY[OP])
    assert [n for n in names if n.startswith("triton:")] == [f"triton:{v}" for v in eb.VARIANTS]
    assert "reference" in names
    assert lowering.OP == OP
    assert "CUDA" in str(torch._C._dispatch_dump(f"fluxcompile::{OP}"))


def _args(dtype=torch.float32, dims=(16, 16), mode=0, last=False, splits=(), world_splits=None, t_count=None):
    t_count = t_count or len(dims)
    weights = [torch.randn(10, d, dtype=dtype) for d in dims[:t_count]]
    indices = [torch.randint(0, 10, (8,)) for _ in weights]
    offsets = [torch.arange(0, 8, 2) if not last else torch.arange(0, 9, 2) for _ in weights]
    cols = sum(w.shape[1] for w in weights)
    return (weights, indices, offsets, mode, last, [4, cols], list(splits), list(world_splits or splits), "g2")


@pytest.fixture
def group_of_two(monkeypatch):
    monkeypatch.setitem(lo._group_sizes, "g2", 2)
    with config.patch(implementations=IMPLEMENTATIONS):
        yield


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        (dict(mode=2), "max pooling (mode 2)"),
        (dict(dims=(16, 32)), "tables of different dims (per-table D)"),
        (dict(dtype=torch.float64), "dtype torch.float64"),
        (dict(splits=(1, 1, 2)), "split list of 3 entries for a group of 2 ranks"),
        (dict(), "not on a CUDA device"),  # the operands here are on the CPU; on CUDA this call is taken
    ],
)
def test_declines(group_of_two, kwargs, why):
    choice = _REGISTRY[OP][f"triton:{eb.DEFAULT}"]
    assert why in (choice.declines(*_args(**kwargs)) or ""), choice.declines(*_args(**kwargs))


def test_declines_while_off(monkeypatch):
    monkeypatch.setitem(lo._group_sizes, "g2", 2)
    why = "switched off: config.implementations (FLUXCOMPILE_IMPLEMENTATIONS) leaves out 'dlrm'"
    for off in ({"implementations": tuple(f for f in IMPLEMENTATIONS if f != "dlrm")}, {"implementations": ("-dlrm",)}):
        with config.patch(**off):
            for name in eb.VARIANTS:
                assert _REGISTRY[OP][f"triton:{name}"].family == "dlrm"
                assert _REGISTRY[OP][f"triton:{name}"].declines(*_args()) == why


def test_operand_checks():
    w = [torch.randn(10, 16), torch.randn(12, 16)]
    i = [torch.randint(0, 10, (6,)), torch.randint(0, 12, (6,), dtype=torch.int32)]
    o = [torch.arange(0, 6, 2), torch.arange(0, 6, 2)]
    assert lo.check_operands(w, i, o, 0, False, cuda=False) == "index or offset tensors of mixed dtypes"
    i[1] = i[1].long()
    assert lo.check_operands(w, i, o, 1, False, cuda=False) is None
    assert lo.check_operands(w, i, o, 0, True, cuda=False) is None  # 3 offsets: 2 bags with the last offset
    assert lo.check_operands(w, i, [o[0], torch.arange(0, 6, 3)], 0, False, cuda=False) == "tables with different bag counts"
    assert lo.check_operands([w[0], torch.randn(16, 12).t()], i, o, 0, False, cuda=False) == (
        "a table whose rows are not contiguous"
    )
    assert lo.check_operands(w, i, o, 3, False, cuda=False) == "mode 3"


def test_variants_are_powers_of_two():
    with pytest.raises(ValueError, match="unroll=3 is not a power of two"):
        eb.Variant(8, 3, 4)
    assert eb.DEFAULT in eb.VARIANTS
    assert eb.Variant(8, 4, 4).column_block(20) == 32 and eb.Variant(8, 4, 4).column_block(1024) == eb.MAX_BLOCK_D


def test_error_message_words():
    assert eb.error_message([0, 0, 0, 0, 0, 0], "x") is None
    msg = eb.error_message([1, 3, 5, 7, 40, eb.KIND_ROWS], "op")
    assert msg.startswith("fluxcompile: op: rank 3 timed out in call 7 waiting for rank 5's pooled rows"), msg


def test_simulated_ranks_set_flags_once_when_their_first_calls_race(monkeypatch):
    """The one-GPU harness runs every rank's first call on its own thread, and each call sets the protocol's flags
    (``comm.init_flags``): exactly one fill, so none wipes what a faster rank already added to a peer's counter."""
    import time

    from fluxcompile.symm_mem import FlagArray
    from fluxcompile.testing.one_gpu_ranks import OneGpuRanks, _on_threads

    world = 4
    sim = OneGpuRanks(world, 1024, lo.FLAG_BYTES, tag="dlrm-init-race", device="cpu")
    handle = sim.flags.handle
    fills = []
    get_buffer = handle.get_buffer

    def slow_get_buffer(rank, shape, dtype, offset_elems=0):
        fills.append(rank)
        time.sleep(0.02)  # the other ranks' threads run meanwhile
        return get_buffer(rank, shape, dtype, offset_elems)

    monkeypatch.setattr(handle, "get_buffer", slow_get_buffer)

    def first_call(r):
        flags = FlagArray(sim.flags.ranks[r], lo.COUNTERS, (lo.PUB_FLAG + 8) // 4)
        sim.init_flags(flags, 0)
        # This rank's pooling signals its peers at once.
        for p in range(world):
            if p != r:
                get_buffer(p, (lo.MAX_WORLD,), torch.int64, lo.COUNTERS // 8)[r] += 1

    _on_threads(first_call, world, timeout_s=30.0)
    assert sorted(fills) == list(range(world)), f"flags filled {len(fills)} times: {fills}"
    for p in range(world):
        counters = get_buffer(p, (world,), torch.int64, lo.COUNTERS // 8).tolist()
        assert counters == [int(s != p) for s in range(world)], (p, counters)
