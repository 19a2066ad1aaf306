"""benchmarks/choice_wins.py: the rows with the autotuner's times, read from JSON files and from the JSON rows of
logs, and each choice's rows won (the pick, or within the margin of the fastest) with its best ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import choice_wins


def test_rows_and_wins(tmp_path):
    row = {"op": "all_gather_matmul", "m": 8, "n": 4, "k": 2, "choice": "b",
           "choices_ms": {"a": 1.0, "b": 1.05, "reference": 1.015, "c": float("inf")}}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps([row]))
    logs = tmp_path / "logs"
    logs.mkdir()
    fp8 = {**row, "op": "all_gather_matmul fp8", "choice": "a"}
    (logs / "run.log").write_text("noise\n" + "[rank0] " + json.dumps(fp8) + "\n")
    rows = choice_wins.rows(tmp_path)
    assert sorted(r.op for r in rows) == ["all_gather_matmul", "all_gather_matmul.scaled"]
    assert all("c" not in r.times for r in rows)  # infinite: declined
    table = choice_wins.table(rows, 0.02)
    ag = table["all_gather_matmul"]
    assert (ag["a"].won, ag["b"].won, ag["reference"].won) == (1, 1, 1)  # fastest, the pick, within 2%
    assert ag["b"].best == 1.05 and ag["b"].where == "run.json: all_gather_matmul 8 x 4 x 2"
    assert ag["cublas_pipelined"].ran == 0  # registered, never timed in these rows
    assert table["all_gather_matmul.scaled"]["b"].won == 0
