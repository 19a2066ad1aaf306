"""Which registered choices ever won: every row of the raw files under benchmarks/results/ (the JSON files, and the
JSON rows the logs print) that records the autotuner's times (``choices_ms``) and pick (``choice``), per op. A
choice "wins" a row where it was the pick or within ``--within`` (default 2%) of the fastest time; for each
registered choice the table gives its rows won, the rows it ran in, and its best ratio to a row's fastest with that
row's file, op and shape (the row that condemns a choice that never won).

    python benchmarks/choice_wins.py [--within 0.02] [--op all_gather_matmul]

Runs on the CPU: it reads files and the choice registry, nothing else. Only rows that record ``choices_ms`` count
(the decode, MoE and DLRM tables record their picks otherwise: their choices show as never timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Row:
    file: str
    op: str  # the fused op, "<op>" or "<op>.scaled" (a row's op names "fp8" for the scaled choices)
    shape: str
    choice: str | None
    times: dict[str, float]


def _objects(path: Path) -> Iterator[object]:
    text = path.read_text(errors="replace")
    try:
        yield json.loads(text)
        return
    except ValueError:
        pass
    for line in text.splitlines():
        start = line.find('{"')
        if start >= 0:
            try:
                yield json.loads(line[start:])
            except ValueError:
                continue


def _rows_in(obj: object, file: str) -> Iterator[Row]:
    if isinstance(obj, dict):
        times = obj.get("choices_ms")
        if isinstance(times, dict):
            kept = {k: float(v) for k, v in times.items() if isinstance(v, (int, float)) and math.isfinite(v)}
            words = str(obj.get("op", "?")).split()
            op = words[0] + (".scaled" if "fp8" in words[1:] else "")
            shape = " x ".join(str(obj[d]) for d in ("m", "n", "k") if d in obj)
            if kept:
                yield Row(file, op, shape, obj.get("choice"), kept)
        for value in obj.values():
            yield from _rows_in(value, file)
    elif isinstance(obj, list):
        for value in obj:
            yield from _rows_in(value, file)


def rows(root: Path = RESULTS) -> list[Row]:
    """Every row with the autotuner's times under ``root``."""
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".log", ".jsonl")):
        for obj in _objects(path):
            out.extend(_rows_in(obj, str(path.relative_to(root))))
    return out


@dataclasses.dataclass
class Record:
    won: int = 0
    ran: int = 0
    best: float = math.inf  # its lowest ratio to a row's fastest
    where: str = ""


def table(all_rows: list[Row], within: float) -> dict[str, dict[str, Record]]:
    """Per op, per registered choice (and any other name the rows hold), its :class:`Record`."""
    import fluxcompile  # registers the choices
    from fluxcompile.lowerings.choices import registered_names

    assert fluxcompile
    out: dict[str, dict[str, Record]] = {}
    for entry in registered_names().split(";"):
        op, _, names = entry.partition(":")
        out[op] = {name: Record() for name in names.split(",") if name}
    for row in all_rows:
        fastest = min(row.times.values())
        records = out.setdefault(row.op, {})
        for name, t in row.times.items():
            rec = records.setdefault(name, Record())
            rec.ran += 1
            ratio = t / fastest
            if ratio <= 1 + within or name == row.choice:
                rec.won += 1
            if ratio < rec.best:
                rec.best, rec.where = ratio, f"{row.file}: {row.op} {row.shape}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--op", default=None)
    args = parser.parse_args()
    for op, records in sorted(table(rows(), args.within).items()):
        if args.op and op != args.op:
            continue
        print(f"== {op}: rows won / ran, best ratio to a row's fastest (where)")
        for name, r in sorted(records.items(), key=lambda kv: (-kv[1].won, kv[1].best)):
            best = f"{r.best:.3f} ({r.where})" if r.ran else "never timed"
            print(f"  {name:40s} {r.won:3d} / {r.ran:3d}  {best}")


if __name__ == "__main__":
    main()
