"""The decode choices of matmul_all_reduce / all_reduce_rmsnorm as registered, and how they decline where
they cannot run (CPU tensors, their family switched off) — rank-independent reasons only; the check of
their error words."""

from __future__ import annotations

import pytest
import torch

from fluxcompile import config
from fluxcompile.kernels import gemv_ar
from fluxcompile.lowerings import choices_for
from fluxcompile.lowerings.choices import choice_named
from fluxcompile.lowerings.matmul_all_reduce import fused_kernels as decode_ar

OPS = ("matmul_all_reduce", "all_reduce_rmsnorm")


def _args(op: str):
    a, b = torch.randn(4, 64), torch.randn(64, 32)
    if op == "matmul_all_reduce":
        return ([a], [b], None, [4, 32], "sum", "0")
    return (None, [a], [b], None, [4, 32], torch.randn(4, 32), torch.ones(32), 1e-5, True, False, "sum", "0")


def test_registered_for_both_ops():
    for op in OPS:
        names = [c.name for c in choices_for(op)]
        assert {f"cuda:gemv-{mode}" for mode in gemv_ar.MODES} <= set(names)
        assert {"torch_symm_mem:one_shot", "reference"} <= set(names)
        assert "triton" in names and not any(n.startswith("triton:") for n in names)  # one choice, its tiles as launches
        triton = next(c for c in choices_for(op) if c.name == "triton")
        for v in decode_ar.TRITON_VARIANTS:
            assert choice_named(op, f"triton:{v}").family == "decode"
        assert triton.launches.for_call(*_args(op)), "at least one launch, declined by its reason where none fits"
        with pytest.raises(ValueError, match="no Triton decode launch"):
            triton.variant("nope")
        assert names[-1] == "reference"


def test_decode_choices_decline_unless_enabled():
    """The decode kernels are family "decode"; PyTorch's two-shot choice (family "torch_symm_mem") follows it."""
    left_out = tuple(f for f in config.implementations if f != "decode")
    why = "switched off: config.implementations (FLUXCOMPILE_IMPLEMENTATIONS) leaves out 'decode'"
    for op in OPS:
        kinds = {c.name.partition(":")[0] for c in choices_for(op) if c.family == "decode"}
        assert kinds == {"cuda", "triton"}, op
        with config.patch(implementations=left_out):
            assert not any(c.family == "decode" for c in choices_for(op))  # not offered
            two_shot = {c.name: c for c in choices_for(op)}["torch_symm_mem:two_shot"]
            assert two_shot.declines(*_args(op)) == f"the two-shot choice follows family 'decode': {why}"
        with config.patch(implementations=("-decode",)):
            assert not any(c.family == "decode" for c in choices_for(op))


def test_cpu_tensors_are_declined():
    for op in OPS:
        for c in choices_for(op):
            if c.name != "reference":
                assert "needs CUDA tensors" in (c.declines(*_args(op)) or ""), c.name


def test_bare_all_reduce_is_left_to_the_unfused_choices():
    x = torch.randn(4, 32)
    args = (x, [], [], None, [4, 32], torch.randn(4, 32), torch.ones(32), 1e-5, True, False, "sum", "0")
    for c in choices_for("all_reduce_rmsnorm"):
        if c.family == "decode":
            assert "bare all-reduce" in (c.declines(*args) or ""), c.name


def test_decode_sized_calls_are_tuned_as_graph_replays():
    from fluxcompile.lowerings import autotune

    for op in OPS:
        predicate = autotune._graph_timed[op]
        args = list(_args(op))
        shape_at = 3 if op == "matmul_all_reduce" else 4
        for rows, graphs in ((1, True), (512, True), (513, False), (8192, False)):
            args[shape_at] = [rows, 32]
            assert predicate(tuple(args)) is graphs, (op, rows)
        args[shape_at] = [2, 8, 32]  # N-D: the rows are every dim but the last
        assert predicate(tuple(args))


def _cuda_args(monkeypatch, world: int):
    """Arguments of a bf16 call the CUDA kernel takes, on a stub group of ``world`` ranks (the checks shared
    with the other kernels pass)."""

    monkeypatch.setattr(decode_ar, "_common_supports", lambda *a, **k: None)
    monkeypatch.setattr(decode_ar, "group_size", lambda name: world)
    a = torch.randn(4, 64, dtype=torch.bfloat16)
    b = torch.randn(32, 64, dtype=torch.bfloat16).t()  # nn.Linear's weight, transposed
    return ([a], [b], None, [4, 32], "sum", "0")


def test_cuda_kernel_declines_between_gpus_until_validated(monkeypatch):
    """The rewritten csrc kernel has run on one GPU only: at world size 2 it declines unless enabled."""
    args = _cuda_args(monkeypatch, 2)
    why = "csrc/gemv_ar.cu between GPUs: switched off: config.implementations (FLUXCOMPILE_IMPLEMENTATIONS) leaves out"
    with config.patch(implementations=tuple(f for f in config.implementations if f != "gemv_peers")):
        for mode in gemv_ar.MODES:
            assert (decode_ar.cuda_supports(mode, *args) or "").startswith(why)
    assert "gemv_peers" not in (decode_ar.cuda_supports("oneshot", *args) or "")  # in implementations by default


def test_ll_variants_need_a_peer(monkeypatch):
    """LL words and LL128 lines only travel between ranks: at world size 1 either choice would be the one-shot
    one again."""
    args = _cuda_args(monkeypatch, 1)
    for mode in ("oneshot-ll", "oneshot-ll128"):
        assert "one rank" in (decode_ar.cuda_supports(mode, *args) or "")


def test_ll128_lines_fit_the_ll_region():
    """An LL region is two slots of at least the partial's bytes: LL128's lines of 7 vectors fit it at every m
    once a ragged last tile's lines are counted (the kernel refuses a launch where they do not)."""
    for m in (1, 2, 3, 7, 16, 37, 64):
        for n in (8, 200, 4104, 8192):
            lines = -(-m * 4 // 7)  # 16-byte vectors of a 32-column tile row: 4
            assert gemv_ar.ll128_bytes(m, n) == -(-n // 32) * lines * 128
            assert 2 * gemv_ar.slot_need(m, n, 2) >= gemv_ar.ll128_bytes(m, n)  # an LL region: two slots
            if n % 32 == 0:  # no more bytes than LL's twice the data (fewer from m = 3 on)
                assert gemv_ar.ll128_bytes(m, n) <= 2 * m * n * 2
                assert m < 3 or gemv_ar.ll128_bytes(m, n) < 2 * m * n * 2


def _resolved_size() -> int:
    import torch.distributed as dist

    return decode_ar.group_size(dist.group.WORLD.group_name)


def test_group_resolves_a_real_process_group(ranks):
    """The support checks and launches find the group by name (the other tests stub it)."""
    assert ranks(2).run(_resolved_size) == [2, 2]


def test_error_words_name_the_rank_the_peer_and_the_signal():
    """The decode kernels' error words (``symm_mem.ErrorWords``) are read by kernels/gemm_ar.py's check, naming the
    group; zero words pass."""
    check = decode_ar._checker("tp")
    check(torch.zeros(decode_ar.ERR_WORDS, dtype=torch.int32), "a call")
    words = torch.tensor([1, 0, 1, 5, 3, 1, 0, 0], dtype=torch.int32)  # rank 0 waited for rank 1's tile 5
    with pytest.raises(RuntimeError, match=r"rank 0 of group tp timed out waiting for rank 1's partial tile 5"):
        check(words, "a call")
