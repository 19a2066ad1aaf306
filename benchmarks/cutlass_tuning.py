"""Writes the shipped tuning tables of the CUTLASS all-gather and reduce-scatter (fluxcompile/lowerings/<op>/
cutlass_tuning.json, read by fluxcompile/lowerings/tuning_table.py) from the recorded runs under benchmarks/results/.

A table's key is (arch, world size, dtype, the kernel's GEMM M x N x K bucketed to powers of two). The keys written
are the op-level local shapes of benchmarks/ops.py (AG_SHAPES, RS_SHAPES) at world sizes 2, 4 and 8 in bf16 and
fp16, and every key a recorded fused-op row holds. Each entry's launch comes from, in this order:

1. the fused op's own times: the rows that record the autotuner's times (``choices_ms``, read by choice_wins.py) of
   the family's launches, their world size and GPU from the raw file's name (``<world>xh100``, ``<world>xh200``);
   the launch with the lowest mean ratio to its row's fastest launch, among those timed in half the key's rows;
2. the GEMM alone (benchmarks/cutlass_gemm.py's raw files, cutlass-gemm-*.json): the best configuration's variant
   and raster, marked "GEMM alone" (the fused op's waits can change the order; the grouped tile order won there);
3. else the fp16 key takes the bf16 entry of the same key (same tiles, same bytes), marked so;
4. else the family's most frequent pick over all fused-op rows, marked "not timed at this key".

The candidates (what the autotuner times where a table has no entry) are the launches within 2% of their row's
fastest launch in the most fused-op rows, one per tile variant, three at most.

    python benchmarks/cutlass_tuning.py          # writes both tables
    python benchmarks/cutlass_tuning.py --check  # exits 1 where a checked-in table differs from what it would write

Runs on the CPU: it reads files and the registry of variants, nothing else.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import choice_wins

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORLDS = (2, 4, 8)
DTYPES = ("bf16", "fp16")
WITHIN = 0.02
ARCH = {"h100": "sm90", "h200": "sm90"}
_MACHINE = re.compile(r"(\d+)x(h100|h200)")


def _op_shapes(op: str) -> list[tuple[int, int, int]]:
    if op == "all_gather_matmul":
        from ops import AG_SHAPES as shapes
    else:
        from ops_rs import RS_SHAPES as shapes
    return [(m, n, k) for _, m, n, k in shapes]


def gemm_shape(op: str, world: int, m: int, n: int, k: int) -> tuple[int, int, int]:
    """The kernel's GEMM of an op-level shape at ``world``: the all-gather's gathered rows by its local weight's
    columns; the reduce-scatter's rows by its columns over its local K."""
    return (m, n // world, k) if op == "all_gather_matmul" else (m, n, k // world)


class Family:
    """What the generator needs of one op's CUTLASS family."""

    def __init__(self, op: str) -> None:
        from fluxcompile.kernels import cutlass_gemm

        self.op = op
        if op == "all_gather_matmul":
            from fluxcompile.lowerings.all_gather_matmul import cutlass as lowering

            self.variants = cutlass_gemm.variants()
        else:
            from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as lowering

            self.variants = cutlass_gemm.ring_variants()
        self.lowering = lowering
        self.path = lowering.TABLE_PATH

    def valid(self, launch: str, world: int, m: int, n: int) -> bool:
        """Whether ``launch`` names a launch of the family that takes an ``[m, n]`` GEMM at ``world``."""
        try:
            self.lowering.parse(launch)
        except ValueError:
            return False
        if self.op == "matmul_reduce_scatter":
            return self.lowering.chunk_declines(launch, m, n, world, 0) is None
        return True

    def from_gemm(self, config: str) -> str | None:
        """The launch of a GEMM-alone configuration ``variant/raster/swizzle``, where the family has it."""
        variant, raster, *_ = config.split("/")
        if variant not in self.variants:
            return None
        if self.op == "all_gather_matmul" and raster in ("m", "n"):
            return f"{variant}:{raster}"
        return variant


def _key(arch: str, world: int, dtype: str, gemm: tuple[int, int, int]) -> tuple:
    from fluxcompile.lowerings.tuning_table import bucket

    return (arch, world, dtype, *(bucket(x) for x in gemm))


def fused_rows(family: Family) -> dict[tuple, list[tuple[str, dict[str, float]]]]:
    """key -> [(where, {launch: ms})] of the recorded fused-op rows (bf16: the plain op's rows)."""
    out: dict[tuple, list] = collections.defaultdict(list)
    seen: set[tuple] = set()
    for row in choice_wins.rows(RESULTS):
        machine = _MACHINE.search(row.file)
        if row.op != family.op or machine is None:
            continue
        world, arch = int(machine.group(1)), ARCH[machine.group(2)]
        m, n, k = (int(x) for x in row.shape.split(" x "))
        gm, gn, gk = gemm_shape(family.op, world, m, n, k)
        times = {name.removeprefix("cutlass:"): t for name, t in row.times.items() if name.startswith("cutlass:")}
        times = {launch: t for launch, t in times.items() if family.valid(launch, world, gm, gn)}
        if times and (world, row.shape, tuple(sorted(times.items()))) not in seen:  # a JSON file and the log printing it
            seen.add((world, row.shape, tuple(sorted(times.items()))))
            out[_key(arch, world, "bf16", (gm, gn, gk))].append((f"{row.file}: {row.shape}", times))
    return out


def best_of(rows: list[tuple[str, dict[str, float]]]) -> tuple[str, float, int]:
    """(launch, mean ratio to its row's fastest launch over the rows that timed it) among the launches timed in at
    least half the rows (runs that timed the launch options and runs that timed the variants alone mix)."""
    counts = collections.Counter(launch for _, times in rows for launch in times)
    ratios = {}
    for launch in sorted(counts):
        if 2 * counts[launch] >= len(rows):
            timed = [times[launch] / min(times.values()) for _, times in rows if launch in times]
            ratios[launch] = sum(timed) / len(timed)
    launch = min(ratios, key=lambda x: (ratios[x], x))
    return launch, ratios[launch], counts[launch]


def gemm_rows(family: Family) -> dict[tuple, tuple[str, str]]:
    """key -> (launch, where) of the GEMM-alone tables' best configurations (the newest file last wins)."""
    short = "ag" if family.op == "all_gather_matmul" else "rs"
    out: dict[tuple, tuple[str, str]] = {}
    for path in sorted(RESULTS.glob("cutlass-gemm-*.json")):
        raw = json.loads(path.read_text())
        device = str(raw.get("device", "")).lower()
        gpu = "h200" if "h200" in device else "h100"
        for r in raw.get("rows", []):
            if r.get("op") != short or r.get("table") not in DTYPES:
                continue
            launch = family.from_gemm(str(r["config"]))
            if launch is None or not family.valid(launch, int(r["tp"]), int(r["m"]), int(r["n"])):
                continue
            key = _key(ARCH[gpu], int(r["tp"]), r["table"], (int(r["m"]), int(r["n"]), int(r["k"])))
            where = f"GEMM alone: {path.name}: {r['m']} x {r['n']} x {r['k']} at tp {r['tp']} ({r['config']})"
            out[key] = (launch, where)
    return out


def candidates(family: Family, rows: dict[tuple, list]) -> list[str]:
    """The launches within WITHIN of their row's fastest in the most rows, one per tile variant, three at most."""
    won: collections.Counter[str] = collections.Counter()
    for key_rows in rows.values():
        for _, times in key_rows:
            fastest = min(times.values())
            won.update(launch for launch, t in times.items() if t <= fastest * (1 + WITHIN))
    picked: list[str] = []
    for launch, _ in sorted(won.items(), key=lambda kv: (-kv[1], kv[0])):
        if launch.split(":")[0] not in {p.split(":")[0] for p in picked}:
            picked.append(launch)
    return picked[:3] or [family.variants[0]]


def build(family: Family) -> dict:
    fused = fused_rows(family)
    alone = gemm_rows(family)
    cands = candidates(family, fused)
    keys = set(fused)
    for world in WORLDS:
        for m, n, k in _op_shapes(family.op):
            for dtype in DTYPES:
                keys.add(_key("sm90", world, dtype, gemm_shape(family.op, world, m, n, k)))
    entries = []
    for key in sorted(keys):
        arch, world, dtype, m, n, k = key
        bf16 = (arch, world, "bf16", m, n, k)
        if key in fused:
            launch, ratio, timed = best_of(fused[key])
            where = "; ".join(w for w, _ in fused[key])
            source = f"fused op: {ratio:.3f} of its row's fastest launch, mean of the {timed} of {len(fused[key])} rows that timed it ({where})"
        elif key in alone:
            launch, source = alone[key]
        elif dtype == "fp16" and bf16 in fused:
            launch, ratio, timed = best_of(fused[bf16])
            source = f"bf16's fused-op entry (fp16 not timed; {ratio:.3f} of its row's fastest launch over {timed} rows)"
        elif dtype == "fp16" and bf16 in alone:
            launch, where = alone[bf16]
            source = f"bf16's entry (fp16 not timed): {where}"
        else:
            launch = cands[0]
            source = "not timed at this key: the launch within 2% of the fastest in the most fused-op rows"
        entries.append(dict(arch=arch, world=world, dtype=dtype, m=m, n=n, k=k, launch=launch, source=source))
    return {
        "op": family.op,
        "family": "cutlass",
        "generated_by": "benchmarks/cutlass_tuning.py",
        "key": "arch, world size, dtype, and the kernel's GEMM M x N x K each rounded to the nearest power of two",
        "candidates": cands,
        "entries": entries,
    }


def render(table: dict) -> str:
    head = {k: v for k, v in table.items() if k != "entries"}
    body = ",\n".join("  " + json.dumps(e) for e in table["entries"])
    return json.dumps(head, indent=1)[:-2] + ',\n "entries": [\n' + body + "\n ]\n}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        family = Family(op)
        text = render(build(family))
        json.loads(text)
        if args.check:
            if not family.path.exists() or family.path.read_text() != text:
                stale.append(str(family.path.relative_to(ROOT)))
        else:
            family.path.write_text(text)
            print(f"wrote {family.path.relative_to(ROOT)}")
    if stale:
        print(f"stale (run benchmarks/cutlass_tuning.py): {', '.join(stale)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
