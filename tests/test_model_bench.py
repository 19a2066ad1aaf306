"""benchmarks/model.py on CPU (gloo, 2 ranks, a tiny block), so it is not first run on the GPU: the
zero-communication rewrite, and the whole benchmark loop (variants, numerics, report, table, JSON)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
from helpers import fresh_compiles
from torch.torch_version import TorchVersion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    """benchmarks/model.py as module ``bench_model`` (registered first: its dataclass needs it; benchmarks/ on the
    path: it imports ``timing``)."""
    if "bench_model" not in sys.modules:
        bench = os.path.join(ROOT, "benchmarks")
        if bench not in sys.path:
            sys.path.append(bench)
        spec = importlib.util.spec_from_file_location("bench_model", os.path.join(bench, "model.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_model"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_model"]


def zero_comm_rank() -> None:
    import torch.distributed._functional_collectives as funcol

    m = _load()
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())  # different data per rank: a real collective would show

    def f(x):
        gathered = funcol.all_gather_tensor(x, 0, group)
        scattered = funcol.reduce_scatter_tensor(x * 2, "sum", 0, group)
        reduced = funcol.all_reduce(x + 1, "sum", group)
        return gathered * 1, scattered * 1, reduced * 1

    x = torch.randn(4, 3)
    zc = m.ZeroCommPass()
    with fresh_compiles():
        g, s, r = torch.compile(f, backend=m.zero_comm_backend, options={"post_grad_custom_pre_pass": zc})(x)
    torch.testing.assert_close(g, x.repeat(2, 1))  # all-gather: the local shard, repeated
    torch.testing.assert_close(s, (x * 2)[:2])  # reduce-scatter: the first rows
    torch.testing.assert_close(r, x + 1)  # all-reduce: identity
    assert zc.graphs == [{"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 1}], zc.graphs


def test_zero_comm_rewrite_makes_collectives_local(ranks):
    ranks(2).run(zero_comm_rank)


def bench_rank(out: str) -> tuple[list[dict], str | None]:
    m = _load()
    argv = "--device cpu --dim 64 --heads 4 --ffn 96 --regimes train,decode --seqs 16 --batches 2"
    argv += " --variants inductor,fluxcompile,zero_comm --iters 2 --rounds 1 --warmup 0 --graph-calls 2"
    args = m.parse([*argv.split(), "--out", out])
    rows = m.bench(args)
    return rows, m.finish(args, rows) if dist.get_rank() == 0 else None


def test_benchmark_runs_on_cpu(ranks, tmp_path):
    rows, text = ranks(2).run(bench_rank, str(tmp_path))[0]
    by = {r["regime"]: r for r in rows}
    assert set(by) == {"train", "decode"}
    for r in rows:
        assert r["ok"] and not r["failed"], r
        assert set(r["us"]) == {"inductor", "fluxcompile", "zero_comm"} and min(r["us"].values()) > 0, r["us"]
        assert not any(g.get("collectives") for g in r["census"]["zero_comm"].values()), r["census"]
        assert not any(g.get("collectives") for g in r["census"]["fluxcompile"].values()), r["census"]
    train, decode = by["train"], by["decode"]
    # Train: 2 all-gathers + 2 reduce-scatters in each of forward and backward, all made local / fused.
    assert train["census"]["inductor"] == {"forward": {"collectives": 4}, "backward": {"collectives": 4}}
    assert train["zero_comm"] == [{"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}] * 2
    assert {k: (v["fused"], v["collectives"]) for k, v in train["fused"].items()} == {
        "forward": (4, 4),
        "backward": (4, 4),
    }
    assert "grad feed_forward.w2.weight" in train["errors"]["fluxcompile"]
    assert decode["zero_comm"] == [{"all_reduce": 2}]
    # Torch 2.11 does not tell the post-grad pass that a graph is an inference graph, so the report names
    # it "forward" there (measured on the GPU machine); 2.13 does.
    kinds = ("inference",) if TorchVersion(torch.__version__) >= "2.13" else ("inference", "forward")
    assert len(decode["fused"]) == 1 and next(iter(decode["fused"])) in kinds, decode["fused"]
    assert next(iter(decode["fused"].values()))["fused"] == 2
    assert "output (CUDA graph)" in decode["errors"]["fluxcompile"]  # the chained-call path
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("== table"))
    assert lines[head + 2].split()[:2] == ["train", "16"] and lines[head + 3].split()[:2] == ["decode", "b=2"]
    assert "numerics (fluxcompile vs Inductor): all ok" in text
    assert "fluxcompile rewrite report, train 16 tok" in text
    with open(tmp_path / "model.json") as f:
        assert len(json.load(f)["rows"]) == 2


def gqa_rank(out: str) -> list[dict]:
    m = _load()
    argv = "--device cpu --dim 64 --heads 4 --kv-heads 2 --ffn 96 --regimes prefill --seqs 16"
    argv += " --variants inductor,fluxcompile --iters 2 --rounds 1 --warmup 0"
    return m.bench(m.parse([*argv.split(), "--out", out]))


def test_grouped_query_block_runs_on_cpu(ranks, tmp_path):
    """--kv-heads: the key/value projections narrower than the query's, still fused with it under one gather."""
    (row,) = ranks(2).run(gqa_rank, str(tmp_path))[0]
    assert row["ok"] and not row["failed"], row
    (fused,) = row["fused"].values()
    assert fused["fused"] == fused["collectives"] == 4, row["fused"]  # 2 gathers (q, k, v share one), 2 scatters


def test_table_gain_and_bar():
    m = _load()
    row = {
        "regime": "prefill", "size": 8192, "us": {"inductor": 100.0, "async_tp": 95.0, "fluxcompile": 88.0,
        "zero_comm": 80.0}, "errors": {"fluxcompile": {"output": 1e-3}}, "failed": {}, "ok": True,
        "census": {"async_tp": {"forward": {"symm_mem": 2, "collectives": 2}}}, "fused": {},
    }  # fmt: skip
    m._derive(row)
    assert abs(row["gain"]["fluxcompile"] - 0.6) < 1e-9 and abs(row["speedup"]["async_tp"] - 100 / 95) < 1e-9
    text = m.table([row])
    assert "60%" in text and "2 fused, 2 left" in text
    assert "0 of 1 measured; short: prefill 8192 tok" in text
    assert "slower than Inductor: nowhere" in text
