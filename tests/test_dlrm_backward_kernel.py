"""The DLRM backward kernel (kernels/embedding_bag_backward.py) and its choice
(lowerings/all_to_all_embedding_bag_backward) on CPU: the scatter alone and the whole protocol between 2-3
simulated ranks with its bounded waits under Triton's interpreter (kernel_checks/dlrm_backward_interpreted.py), the
kernels compiled for sm_90, the layout of a call's rows, registration and the choice's reasons to decline. The
protocol on GPUs: tests/gpu/test_dlrm_ranks.py."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")

from test_dlrm_kernel import _compile_sm90

from fluxcompile import config
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import embedding_bag_backward as ebb
from fluxcompile.lowerings import all_to_all_embedding_bag_backward as lowering
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import triton as lo
from fluxcompile.lowerings.choices import _REGISTRY

HERE = os.path.dirname(os.path.abspath(__file__))
OP = "all_to_all_embedding_bag_backward"


def test_kernels_in_interpreter():
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "kernel_checks", "dlrm_backward_interpreted.py"), str(seed)],
        capture_output=True, text=True, env=env, timeout=600, cwd=os.path.join(HERE, "kernel_checks"),
    )  # fmt: skip
    assert out.returncode == 0, f"seed {seed}:\n{out.stderr[-4000:]}"
    results = json.loads(out.stdout.strip().splitlines()[-1])
    ready, offs = results.pop("timeouts")
    assert len(results) >= 8, sorted(results)
    for name, err in results.items():
        assert err <= 1e-5, f"{name}: relative error {err:.2e} of its dtype's tolerance (seed {seed})"
    assert "rank 0 timed out in call 1 waiting for rank 1's staged gradients (its ready flag never reached 1)" in ready
    assert "rank 0 timed out in call 1 waiting for rank 1's published split offsets" in offs, offs


# --- compiled for Hopper (no GPU needed: Triton's front end and ptxas) -----------------------------------------


@pytest.mark.parametrize(
    ("dtype", "mode", "sparse", "psw"), [("fp32", 0, False, False), ("bf16", 1, False, False), ("fp16", 0, False, True),
                                         ("bf16", 0, True, True)],
)  # fmt: skip
def test_scatter_compiles_for_sm90(dtype, mode, sparse, psw, tmp_path, monkeypatch):
    """The scatter's adds are fp32 reductions at GPU scope, relaxed (no fence per add); sparse values are stored."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    const = dict(MODE=mode, IDX64=True, OFF64=False, SIZE64=dtype != "bf16", ABS=mode == 1, SPARSE=sparse, PSW=psw,
                 PGRAD=psw, FREQ=not sparse, BLOCK_B=ebb.BLOCK_B, BLOCK_D=128)  # fmt: skip
    types = {
        "tables": "*i64", "dst": "*i64", "like": f"*{dtype}", "peer_send": "*i64", "src_off": "*i64",
        "recv_start": "*i64", "state": "*i64", "psw": "*i64", "freq": "*i64", "parity_elems": "i64",
    }  # fmt: skip
    k = _compile_sm90(ebb.scatter_kernel, const, types, ebb.NUM_WARPS)
    ptx = k.asm["ptx"]
    adds = re.findall(r"\b(?:atom|red)\.global(?:\.gpu)?(?:\.relaxed)?(?:\.gpu)?\.add\.f32", ptx)
    assert bool(adds) != sparse, "fp32 atomic adds for dense gradients only"
    assert ".sys." not in " ".join(adds) and "acq_rel" not in ptx


def test_protocol_kernels_compile_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    k = _compile_sm90(ebb.signal_kernel, {}, {"my_ready": "*i64", "state": "*i64"}, 1)
    assert re.search(r"atom\.(global\.)?(release\.sys|sys\.release)", k.asm["ptx"]), "the ready flag's release store"
    _compile_sm90(
        ebb.publish_kernel, {"BLOCK_W": 64},
        {"my_pub": "*i64", "my_flag": "*i64", "my_prefix": "*i64", "state": "*i64", "parity_elems": "i64"}, 1,
    )  # fmt: skip
    _compile_sm90(
        ebb.fetch_kernel, {"BLOCK_W": 64, "TIMED": True},
        {"peer_pub": "*i64", "peer_flags": "*i64", "src_off": "*i64", "state": "*i64", "err": "*i32"}, 1,
    )  # fmt: skip
    _compile_sm90(ebb.wait_kernel, {"TIMED": True}, {"peer_ready": "*i64", "state": "*i64", "err": "*i32"}, 1)
    _compile_sm90(
        ebb.stage_kernel, {"BLOCK": ebb.COPY_BLOCK},
        {"grad": "*bf16", "send": "*bf16", "state": "*i64", "total": "i64", "parity_elems": "i64"}, 4,
    )  # fmt: skip
    for cast in (False, True):
        _compile_sm90(
            ebb.rows_kernel, {"CAST": cast, "IDX64": False, "BLOCK_P": ebb.BLOCK_P, "BLOCK_D": 64},
            {"tables": "*i64", "acc": "*i64", "grads": "*i64", "like": "*bf16"}, ebb.NUM_WARPS,
        )  # fmt: skip


# --- layout -------------------------------------------------------------------------------------------------


def test_layout_equal_and_unequal_splits():
    # 4 ranks, 32 bags each (8 per source), 2 tables of 16: our chunk is rows 8..16 of every source's gradients
    lay = lo.layout(32, 2, 16, (), (), 1, 4)
    assert lay.uniform and lay.recv_start == (0, 8, 16, 24, 32) and lay.row_elems == 32
    assert lay.in_prefix == (0, 256, 512, 768) and lay.equal_src_off() == (256,) * 4
    assert lay.parity_elems == 1024 and lay.data_bytes(2) == 4096
    # unequal: rank 0 of 2 holds 8 rows, sends [3, 5], receives [3, 5] (its 8 bags)
    lay = lo.layout(8, 1, 16, (3, 5), (3, 5), 0, 2)
    assert not lay.uniform and lay.recv_start == (0, 3, 8) and lay.in_prefix == (0, 48)
    assert lay.parity_elems == 8 * 16
    assert lo.layout(8, 1, 16, (3, 4), (3, 5), 0, 2).bags == 7  # an owner of 7 bags, holding 8 rows
    with pytest.raises(ValueError, match="input splits add up to 7"):
        lo.layout(8, 1, 16, (3, 5), (3, 4), 0, 2)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((8, [1, 1, 6], [], 2), "split list of 3 entries for a group of 2 ranks"),
        ((8, [], [1, 2], 2), "input splits add up to 3"),
        ((7, [], [], 2), "equal splits of 7 rows over 2 ranks"),
        ((8, [-1, 9], [4, 4], 2), "negative output split"),
    ],
)
def test_split_problems(args, why):
    assert why in (lo.split_problem(*args) or ""), lo.split_problem(*args)


def test_bag_problems():
    offs, sizes = [torch.zeros(8, dtype=torch.long)], [torch.zeros(8, dtype=torch.long)]
    assert lo.bag_problem(8, offs, sizes, 1) is None
    assert lo.bag_problem(7, offs, sizes, 1) is None  # include_last_offset
    assert lo.bag_problem(6, offs, sizes, 0) == "offsets of 8 entries for 6 exchanged rows (one per bag)"
    assert lo.bag_problem(8, offs, [torch.zeros(0, dtype=torch.long)], 0) is None  # sum: bag sizes not read
    assert lo.bag_problem(8, offs, [torch.zeros(7, dtype=torch.long)], 1) == "bag sizes of fewer than 8 entries"


# --- registration and declines --------------------------------------------------------------------------------


def test_registered_choices():
    assert sorted(_REGISTRY[OP]) == ["put", "reference", "triton"]
    assert _REGISTRY[OP]["triton"].family == "dlrm"
    assert lowering.OP == OP
    assert "CUDA" in str(torch._C._dispatch_dump(f"fluxcompile::{OP}"))


def _args(dtype=torch.float32, mode=0, scale=False, tables=2, dim=16, bags=8, splits=(), last=False):
    indices = [torch.randint(0, 10, (12,)) for _ in range(tables)]
    offsets = [torch.arange(0, 2 * bags + int(last), 2) for _ in range(tables)]
    bag_size = [torch.full((bags,), 2) for _ in range(tables)]
    grad = torch.randn(bags, tables * dim, dtype=dtype)
    return (grad, indices, offsets, [torch.empty(0)] * tables, bag_size, [torch.empty(0)] * tables, [10] * tables,
            scale, mode, list(splits), list(splits), "g2")  # fmt: skip


@pytest.fixture
def group_of_two(monkeypatch):
    monkeypatch.setitem(lo._group_sizes, "g2", 2)
    with config.patch(implementations=IMPLEMENTATIONS):
        yield


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        (dict(mode=2), "max pooling (mode 2)"),
        (dict(scale=True), "not on a CUDA device"),  # scale_grad_by_freq is taken on CUDA
        (dict(dtype=torch.float64), "dtype torch.float64"),
        (dict(splits=(1, 1, 6)), "split list of 3 entries for a group of 2 ranks"),
        (dict(bags=7), "equal splits of 7 rows over 2 ranks"),
        (dict(splits=(3, 3)), "input splits add up to 6, not the gradients' 8 rows"),
        (dict(), "not on a CUDA device"),  # the operands here are on the CPU; on CUDA this call is taken
        (dict(last=True), "not on a CUDA device"),  # offsets with the last one are taken too
    ],
)
def test_declines(group_of_two, kwargs, why):
    choice = _REGISTRY[OP]["triton"]
    assert why in (choice.declines(*_args(**kwargs)) or ""), choice.declines(*_args(**kwargs))


def test_operand_checks():
    grad, indices, offsets, _, bag_size, _, rows, *_ = _args()
    assert lo.check_operands(grad, indices, offsets, bag_size, rows, False, 1) is None
    assert lo.check_operands(grad[:, :31], indices, offsets, bag_size, rows, False, 0) == (
        "gradients [8, 31] are not 2 tables' rows side by side"
    )
    assert lo.check_operands(grad, [indices[0], indices[1].int()], offsets, bag_size, rows, False, 0) == (
        "index or offset tensors of mixed dtypes"
    )
    assert lo.check_operands(grad, indices, [offsets[0], offsets[1][:3]], bag_size, rows, False, 0) == (
        "tables with different bag counts"
    )
    assert lo.check_operands(grad, indices, offsets, bag_size, rows[:1], False, 0) == (
        "need one index, offset and bag-size tensor and one row count per table"
    )


def test_declines_while_off(monkeypatch):
    monkeypatch.setitem(lo._group_sizes, "g2", 2)
    with config.patch(implementations=tuple(f for f in IMPLEMENTATIONS if f != "dlrm")):
        assert _REGISTRY[OP]["triton"].declines(*_args()) == (
            "switched off: config.implementations (FLUXCOMPILE_IMPLEMENTATIONS) leaves out 'dlrm'"
        )


def test_error_message_words():
    assert ebb.error_message([0] * 6, "x") is None
    msg = ebb.error_message([1, 3, 5, 7, 7, ebb.KIND_READY], "op")
    assert msg.startswith("fluxcompile: op: rank 3 timed out in call 7 waiting for rank 5's staged gradients"), msg
    assert "published split offsets" in ebb.error_message([1, 0, 1, 2, 2, ebb.KIND_OFFSETS], "op")


def test_compile_time_samples_are_bags_like_a_real_calls():
    """decide.py tunes on materialized operands (integers as zeros: one bag of row 0); the DLRM ops' sample
    functions make equal bags over random rows, and the backward's bookkeeping as aten's forward makes it."""
    from fluxcompile.lowerings.choices import sample

    w = [torch.zeros(50, 8), torch.zeros(30, 8)]
    i = [torch.zeros(40, dtype=torch.int32), torch.zeros(41, dtype=torch.long)]
    o = [torch.zeros(5, dtype=torch.int32), torch.zeros(5, dtype=torch.long)]
    sample("embedding_bag_all_to_all", (w, i, o, 0, True, [4, 16], [], [], "g"))
    assert o[0].tolist() == [0, 10, 20, 30, 40] and o[1].tolist() == [0, 10, 20, 30, 41]
    assert int(i[0].max()) < 50 and int(i[1].max()) < 30 and len(set(i[0].tolist())) > 10
    o2b = [torch.zeros(40, dtype=torch.int32), torch.zeros(41, dtype=torch.long)]
    sizes = [torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.long)]
    args = (torch.zeros(4, 16), i, o, o2b, sizes, [], [50, 30], False, 1, [], [], "g")
    sample(OP, args)
    for t in range(2):
        _, want_o2b, want_sizes, _ = torch.ops.aten._embedding_bag(w[t], i[t].long(), o[t].long(), False, 1, False,
                                                                   None, True)  # fmt: skip
        assert torch.equal(o2b[t].long(), want_o2b) and torch.equal(sizes[t][:4].long(), want_sizes), t
