"""The demo's command line and its ranks: a rank that dies ends the run at once with that rank's error.

Without the liveness check a rank that dies at start-up leaves the parent waiting for the pool's whole
timeout; these tests give it ten minutes and require the error well before.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import fluxcompile.testing
from fluxcompile import __main__ as cli
from fluxcompile import demo
from fluxcompile.testing.ranks import RankDied, RankPool

FAST_S = 60  # spawning two ranks that import torch takes seconds on a loaded two-core machine


def rank_id() -> int:
    return torch.distributed.get_rank()


def raise_on_rank(rank: int) -> int:
    if torch.distributed.get_rank() == rank:
        raise ValueError("planned failure")
    return rank


def exit_on_rank(rank: int) -> None:
    if torch.distributed.get_rank() == rank:
        os._exit(3)


def test_rank_dying_at_start_up_ends_run():
    start = time.monotonic()
    with RankPool(2, "no-such-backend", timeout_s=600) as pool, pytest.raises(RankDied) as e:
        pool.run(rank_id)
    assert time.monotonic() - start < FAST_S
    assert re.match(r"rank [01] died at start-up: \w+Error: .*no-such-backend", e.value.summary), e.value.summary
    assert "\n" not in e.value.summary and "Traceback" in e.value.details
    assert not pool.alive()


def test_rank_dying_mid_run_ends_run():
    with RankPool(2, "gloo", timeout_s=600) as pool:
        assert pool.run(rank_id) == [0, 1]
        with pytest.raises(AssertionError, match="planned failure"):  # an exception leaves the pool usable
            pool.run(raise_on_rank, 1)
        assert pool.alive()
        start = time.monotonic()
        with pytest.raises(RankDied, match=r"^rank 1 exited with code 3 \(exit_on_rank\)") as e:
            pool.run(exit_on_rank, 1)
        assert time.monotonic() - start < 10
        assert e.value.rank == 1 and not pool.alive()
        with pytest.raises(RuntimeError, match="gone"):
            pool.run(rank_id)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs: NCCL ranks would start")
def test_demo_ends_at_once_when_a_rank_dies_at_start_up(monkeypatch, capsys):
    # The parent believes it has two GPUs; a rank without one dies in torch.cuda.set_device.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    start = time.monotonic()
    assert demo.main(["--backend", "nccl"]) == 1
    assert time.monotonic() - start < FAST_S
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"fluxcompile demo: rank [01] died at start-up: \w+: .+", err[-1]), err


def test_demo_refuses_nccl_without_a_gpu_per_rank(monkeypatch, capsys):
    def no_pool(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(fluxcompile.testing, "RankPool", no_pool)
    world = torch.cuda.device_count() + 1
    assert demo.main(["--backend", "nccl", "--world-size", str(world)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"fluxcompile demo: --backend nccl needs one GPU per rank: {world} ranks, {world - 1} GPU(s) visible"
    ]


def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if not isinstance(a, argparse._SubParsersAction)]


def test_demo_help_gives_every_option_a_sentence():
    p = demo.parser()
    assert "``" not in p.description
    for action in options(p):
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings
    out = subprocess.run(
        [sys.executable, "-m", "fluxcompile", "demo", "--help"], check=True, capture_output=True, text=True
    ).stdout
    assert "``" not in out
    for action in options(p):
        assert action.option_strings[-1] in out


def test_cli_help_gives_every_command_a_sentence(capsys):
    p = cli.parser()
    commands = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert commands.help and all(c.help for c in commands._choices_actions)
    assert all(a.help for a in options(p))
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "``" not in out


def test_cli_without_a_command_says_so(capsys):
    assert cli.main([]) == 2
    assert "a command is required" in capsys.readouterr().err


def test_demo_parses_the_model_options():
    a, _ = demo.parse(["--backend", "gloo"])
    assert (a.model, a.batch, a.dtype) == ("llama", demo.DemoArgs.batch, "float32")
    moe = "--model moe --experts 4 --top-k 1 --tokens 24 --capacity-factor 1.5 --expert-form bmm"
    a, _ = demo.parse(["--backend", "gloo", *moe.split()])
    assert (a.model, a.experts, a.top_k, a.tokens, a.capacity_factor, a.expert_form, a.dtype) == (
        "moe", 4, 1, 24, 1.5, "bmm", "float32"
    )
    a, _ = demo.parse(["--backend", "gloo", "--model", "moe"])  # grouped experts compile in bfloat16 only
    assert (a.capacity_factor, a.expert_form, a.dtype) == (None, "grouped", "bfloat16")
    a, _ = demo.parse(["--backend", "gloo", "--model", "dlrm", "--inference"])
    assert a.inference and not demo.parse(["--backend", "gloo", "--model", "dlrm"])[0].inference
    dlrm = "--model dlrm --tables 4 --rows 10 --bag-size 2 --dense-in 5 --pooling mean --interaction cat"
    a, _ = demo.parse(["--backend", "gloo", *dlrm.split()])
    assert (a.model, a.tables, a.rows, a.bag_size, a.dense_in, a.pooling, a.interaction, a.batch) == (
        "dlrm", 4, 10, 2, 5, "mean", "cat", demo.DLRM_BATCH
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "moe", "--experts", "3"], "--experts 3 must be a multiple of --world-size 2"),
        (["--model", "moe", "--expert-form", "bmm"], "--expert-form bmm needs --capacity-factor"),
        (["--model", "moe", "--dtype", "float32"], "--expert-form grouped compiles in bfloat16 only"),
        (["--model", "dlrm", "--tables", "5"], "--tables 5 must be a multiple of --world-size 2"),
    ],
)
def test_demo_refuses_a_model_it_cannot_build(monkeypatch, capsys, argv, message):
    def no_pool(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(fluxcompile.testing, "RankPool", no_pool)
    assert demo.main(["--backend", "gloo", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, problems",
    [
        (
            ["--world-size", "3"],
            ["--heads 8 must be a multiple of --world-size 3", "--ffn 688 must be a multiple of --world-size 3",
             "--seq 64 must be a multiple of --world-size 3"],
        ),
        (
            ["--dim", "100", "--heads", "3"],
            ["--dim 100 must be a multiple of --heads 3", "--heads 3 must be a multiple of --world-size 2"],
        ),
        (
            ["--world-size", "3", "--seq", "66", "--heads", "6"],
            ["--dim 256 must be a multiple of --heads 6", "--ffn 688 must be a multiple of --world-size 3"],
        ),
        (["--seq", "0"], ["--seq must be at least 1, not 0"]),
        (["--model", "moe", "--dim", "100"], ["--dim 100 must be a multiple of 8"]),
    ],
)  # fmt: skip
def test_demo_refuses_sizes_its_sharding_cannot_take(monkeypatch, capsys, argv, problems):
    def no_pool(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(fluxcompile.testing, "RankPool", no_pool)
    assert demo.main(["--backend", "gloo", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fluxcompile demo: "), err
    found = [p.split(" (")[0] for p in err[0].removeprefix("fluxcompile demo: ").split("; ")]
    assert found == problems, err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--no-sequence-parallel", "--world-size", "3", "--heads", "6", "--dim", "252", "--ffn", "690", "--seq", "7"],
        ["--world-size", "3", "--heads", "6", "--dim", "252", "--ffn", "690", "--seq", "66"],
        ["--model", "moe"],
        ["--model", "moe", "--capacity-factor", "1.5", "--expert-form", "bmm", "--dim", "100"],
        ["--model", "dlrm"],
    ],
)
def test_demo_accepts_sizes_its_sharding_takes(argv):
    a, _ = demo.parse(["--backend", "gloo", *argv])
    assert demo.model_error(a) is None
