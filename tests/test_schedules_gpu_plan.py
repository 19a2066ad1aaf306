"""The GPU half of fluxcompile.schedules, checked on CPU: the plan encoding round-trips, the NumPy model
of the interpreter kernel (schedules/emulator.py) gives the right result for every library program over
several calls with random interleavings, a protocol without the per-call ack is caught, the kernel
compiles for sm_90 with 16-byte vector loads and stores, and a wait on a missing peer is the error raised, also
when a threadblock dependency behind it timed out first (error words, and the kernel in Triton's interpreter)."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from fluxcompile.schedules import compile_program, library
from fluxcompile.schedules.emulator import Emulator
from fluxcompile.schedules.encoding import decode, encode

SIZES = (2, 3, 4, 8)
FACTORS = {4: (2, 2), 8: (2, 4)}


def _programs():
    for name, f in library.FLAT.items():
        for R in SIZES:
            yield pytest.param(f, (R,), id=f"{name}-{R}")
    for name, f in library.HIERARCHICAL.items():
        for R, nm in FACTORS.items():
            yield pytest.param(f, nm, id=f"{name}-{R}")


def _expected(collective: str, xs: list[np.ndarray]) -> list[np.ndarray | None]:
    R = len(xs)
    if collective == "all_gather":
        return [np.concatenate(xs)] * R
    if collective == "reduce_scatter":
        return list(np.split(sum(xs), R))
    if collective == "all_reduce":
        return [sum(xs)] * R
    if collective == "all_to_all":
        blocks = [np.split(x, R) for x in xs]
        return [np.concatenate([blocks[q][r] for q in range(R)]) for r in range(R)]
    if collective == "all_to_next":
        return [None, *xs[:-1]]
    raise AssertionError(collective)


@pytest.mark.parametrize(("make", "args"), list(_programs()))
@pytest.mark.parametrize("instances", [1, 2])
def test_encoding_round_trips(make, args, instances):
    plan = compile_program(make(*args), instances=instances)
    enc = encode(plan)
    assert decode(enc) == plan
    for rc in enc.ranks:
        assert rc.code.dtype == np.int32 and rc.code.shape[1] == 16
    assert sum(enc.mailbox_chunks) == sum(
        i.count
        for rp in plan.ranks
        for tb in rp.threadblocks
        for i in tb.instrs
        if i.op in ("send", "rcs", "rrcs", "rrs")
    )


@pytest.mark.parametrize(("make", "args"), list(_programs()))
@pytest.mark.parametrize(("slices", "rows"), [(1, 4), (3, 7)])  # 7 rows over 3 slices: a ragged last slice
def test_emulated_kernel_matches_collective(make, args, slices, rows):
    plan = compile_program(make(*args))
    enc = encode(plan)
    R = plan.num_ranks
    rng = np.random.default_rng(R * 100 + slices)
    calls = [[rng.integers(-64, 64, size=enc.in_chunks * rows).astype(np.float64) for _ in range(R)] for _ in range(3)]
    emu = Emulator(R, max(enc.mailbox_chunks) * rows + 1)
    outs = emu.run(enc, calls, slices=slices, block=2, seed=slices)
    for c, xs in enumerate(calls):
        for r, want in enumerate(_expected(plan.collective, xs)):
            if want is not None:
                np.testing.assert_array_equal(outs[c][r], want, err_msg=f"{plan.name} call {c} rank {r}")
    assert emu.epoch == [3] * R


def test_emulator_catches_a_protocol_without_the_ack():
    """Without waiting for the peer's ack of the previous call, a fast sender overwrites a mailbox slot
    its peer has not read yet: some interleavings give wrong sums."""
    enc = encode(compile_program(library.one_shot_all_reduce(2)))
    wrong = 0
    for seed in range(30):
        rng = np.random.default_rng(seed)
        calls = [[rng.integers(-50, 50, size=8).astype(float) for _ in range(2)] for _ in range(4)]
        outs = Emulator(2, 64).run(enc, calls, slices=1, block=1, seed=seed, wait_ack=False)
        wrong += any(not np.array_equal(outs[c][r], sum(calls[c])) for c in range(4) for r in range(2))
    assert wrong > 0


def test_slices_and_output_shapes():
    import torch

    from fluxcompile.schedules.gpu_executor import choose_slices, output_shape

    enc = encode(compile_program(library.one_shot_all_reduce(2)))
    assert choose_slices(enc, 64 << 10, 132, slice_bytes=16 << 10) == 4
    assert choose_slices(enc, 256 << 20, 132) == 132  # every SM, no more (all programs resident)
    enc8 = encode(compile_program(library.direct_all_to_all(8)))
    assert enc8.max_tbs * choose_slices(enc8, 256 << 20, 132) <= 132
    x = torch.empty(6, 4)
    assert output_shape(x, 24) == (6, 4)
    assert output_shape(x, 48) == (12, 4)
    assert output_shape(x, 12) == (3, 4)
    assert output_shape(x, 6) == (6,)


def test_library_names_resolve():
    from fluxcompile.schedules.collectives import resolve

    assert resolve("one_shot", "all_reduce", 2).name == "one_shot_all_reduce_2"
    assert resolve("hierarchical:2x2", "all_reduce", 4).name == "hierarchical_all_reduce_2x2"
    assert resolve("one_shot", "all_reduce", 2) is resolve("one_shot_all_reduce", "all_reduce", 2)
    with pytest.raises(ValueError, match="not an all_gather"):
        resolve("one_shot_all_reduce", "all_gather", 2)
    with pytest.raises(ValueError, match="no library program"):
        resolve("nope", "all_reduce", 2)


# ---------------------------------------------------------------------------------------------
# The kernel for sm_90 (no GPU needed).


def _compile(dtype: str, vec: int, aligned: bool):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fluxcompile.schedules.plan_exec import plan_exec_kernel as k

    names = list(inspect.signature(k.fn).parameters)
    esize = {"bf16": 2, "fp32": 4}[dtype]
    const = dict(VEC=vec, BLOCK=4096, ALIGN=vec * esize)
    ptrs = {p: f"*{dtype}" for p in ("inp", "out", "scr")}
    types = {**ptrs, "peer_mbox": "*i64", "peer_flags": "*i64"}
    types.update({p: "*i32" for p in ("code", "tbs", "deps", "done", "state", "err")})
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    # What Triton's launcher specializes for 16-byte aligned tensors.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in types} if aligned else {}
    src = ASTSource(fn=k, signature=sig, constexprs={(names.index(a),): v for a, v in const.items()}, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


@pytest.mark.parametrize(("dtype", "vec"), [("bf16", 8), ("fp32", 4)])
def test_plan_exec_compiles_for_sm90_with_vector_accesses(dtype, vec, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptx = _compile(dtype, vec, aligned=True).asm["ptx"]
    data = set(re.findall(r"(?:ld|st)\.global(?:\.cg)?\.[\w.]+", ptx))
    assert {"ld.global.cg.v4.b32", "st.global.v4.b32"} <= data, data
    assert not any(op.endswith((".b16",)) for op in data), f"scalar data accesses left: {data}"
    assert "st.global.b32" not in data or dtype == "bf16", data
    assert "ld.global.sys.acquire.b32" in ptx or "atom.global.sys.acquire" in ptx  # the peer waits
    assert "atom.global.sys.release.exch.b32" in ptx  # the signals


def test_plan_exec_compiles_unaligned(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    _compile("bf16", 1, aligned=False)


def test_schedules_choices_registered_and_gated():
    import torch

    from fluxcompile import config
    from fluxcompile.lowerings import choices_for

    a, b = torch.randn(4, 8), torch.randn(8, 32)
    args = ([a], [b], None, [4, 32], "sum", "0")
    names = {c.name: c for c in choices_for("matmul_all_reduce")}
    assert {"schedules:one_shot", "schedules:two_shot"} <= set(names)
    assert "needs CUDA tensors" in names["schedules:one_shot"].declines(*args)
    a_cuda = type("FakeCuda", (), {"is_cuda": True})()
    with config.patch(implementations=tuple(f for f in config.implementations if f != "schedules")):
        why = names["schedules:one_shot"].declines([a_cuda], [b], None, [4, 32], "sum", "0")
    assert why == "switched off: config.implementations (FLUXCOMPILE_IMPLEMENTATIONS) leaves out 'schedules'"


# ---------------------------------------------------------------------------------------------
# Timeouts: which error is raised (schedules/wait_errors.py), and the kernel under Triton's interpreter.


def _words(peer: list[int] | None = None, dependency: list[int] | None = None) -> list[int]:
    from fluxcompile.schedules.wait_errors import DEP_SLOT, ERR_WORDS

    w = [0] * ERR_WORDS
    if peer:
        w[: len(peer)] = peer
    if dependency:
        w[DEP_SLOT : DEP_SLOT + len(dependency)] = dependency
    return w


def test_a_peer_wait_error_wins_over_a_dependency_error():
    """Both slots set (a dependency timed out behind a wait on a missing peer, whichever expired first): the
    peer's error is raised; a dependency error alone does not claim to know its cause."""
    from fluxcompile.schedules.wait_errors import DEPENDENCY, MESSAGE, check_error, error_message

    assert error_message(_words(), "g") is None
    check_error(_words(), "g")
    dependency = [1, 0, -1, 4, 2, DEPENDENCY]  # rank 0 waited on done flag 4 at epoch 2
    message = [1, 0, 3, 9, 2, MESSAGE]  # rank 0 waited on rank 3's message 9
    with pytest.raises(RuntimeError, match=r"rank 0 of group g timed out waiting for rank 3's message") as ex:
        check_error(_words(peer=message, dependency=dependency), "g")
    assert "message 9 never reached epoch 2" in str(ex.value)
    assert "dependency (done flag 4) timed out as well" in str(ex.value)
    assert "resident" not in str(ex.value)
    alone = error_message(_words(dependency=dependency), "g")
    assert "rank 0 of group g timed out in a threadblock dependency (done flag 4, call epoch 2)" in alone
    assert "no wait on a peer timed out" in alone
    assert "not every program of the launch became resident" in alone and "a peer far behind" in alone


def test_dependency_waits_outlast_peer_waits():
    from fluxcompile.schedules.wait_errors import DEP_SPIN_FACTOR, dependency_spin

    assert DEP_SPIN_FACTOR >= 2
    for spin in (1, 20_000, 60_000_000):
        assert dependency_spin(spin) == DEP_SPIN_FACTOR * spin
    assert dependency_spin(1 << 30) == 2**31 - 1  # a 32-bit kernel argument


def test_plan_exec_in_interpreter_names_the_missing_peer():
    """tests/kernel_checks/plan_exec_interpreted.py: rank 0 of the 4-rank one-shot all-reduce, a healthy call,
    then one peer's message missing, with the library's threadblock order and with the programs that depend on
    the waiting one run (and time out) first."""
    pytest.importorskip("triton", reason="Triton is needed for the kernel checks (in the test extra)")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(here, "kernel_checks", "plan_exec_interpreted.py")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["healthy"] is None, results["healthy"]
    missing = "rank 0 of group test timed out waiting for rank 1's message"
    in_order, reversed_ = results["in order"], results["reversed"]
    assert in_order["first call"] is None
    assert missing in in_order["second call"] and "dependency" not in in_order["second call"], in_order
    # Reversed: the dependencies time out before the peer wait starts, in both calls.
    assert "timed out in a threadblock dependency" in reversed_["first call"], reversed_
    assert "call epoch 1" in reversed_["first call"] and "resident" in reversed_["first call"]
    assert missing in reversed_["second call"], reversed_
    assert reversed_["dependency slot"][0] == 1 and reversed_["dependency slot"][4] == 2, reversed_
    p = reversed_["peer slot"]  # set, rank 0, peer 1, message, epoch 2, a message wait
    assert (p[0], p[1], p[2], p[4], p[5]) == (1, 0, 1, 2, 11), reversed_
