"""The CUTLASS families' shipped tuning tables (lowerings/<op>/cutlass_tuning.json, lowerings/tuning_table.py): they
parse, name only launches their family has, say where every entry comes from, cover the op-level local shapes at
world sizes 2, 4 and 8 in bf16 and fp16, and are what benchmarks/cutlass_tuning.py writes from the raw files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fluxcompile.lowerings import tuning_table
from fluxcompile.lowerings.all_gather_matmul import cutlass as ag
from fluxcompile.lowerings.matmul_reduce_scatter import cutlass as rs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import cutlass_tuning  # noqa: E402
import ops  # noqa: E402
import ops_rs  # noqa: E402

FAMILIES = {"all_gather_matmul": (ag, ops.AG_SHAPES), "matmul_reduce_scatter": (rs, ops_rs.RS_SHAPES)}
MARKED = ("fused op: ", "GEMM alone: ", "bf16's ", "not timed at this key")


@pytest.mark.parametrize("op", FAMILIES)
def test_table_parses_and_names_its_launches_and_sources(op):
    lowering, _ = FAMILIES[op]
    table = lowering.table()
    assert table.op == op and table.family == "cutlass" and 1 <= len(table.candidates) <= 3
    for launch in {*table.candidates, *table.entries.values()}:
        lowering.parse(launch)
    for key, source in table.sources.items():
        assert source.startswith(MARKED), (key, source)
        assert key.arch == "sm90" and key.dtype in ("bf16", "fp16")


@pytest.mark.parametrize("op", FAMILIES)
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_table_covers_the_op_level_local_shapes(op, world, dtype):
    lowering, shapes = FAMILIES[op]
    for _, m, n, k in shapes:
        gemm = cutlass_tuning.gemm_shape(op, world, m, n, k)
        key = tuning_table.Key.of("sm90", world, dtype, *gemm)
        assert lowering.table().lookup(key) is not None, (op, world, dtype, gemm)


def test_tables_are_what_the_generator_writes():
    for op in FAMILIES:
        family = cutlass_tuning.Family(op)
        assert family.path.read_text() == cutlass_tuning.render(cutlass_tuning.build(family)), (
            f"{family.path} is stale: run python benchmarks/cutlass_tuning.py"
        )


def test_a_miss_times_the_candidates_that_take_the_call():
    table = tuning_table.parse(
        '{"op": "x", "family": "cutlass", "candidates": ["a", "b", "c"], "entries": [{"arch": "sm90", "world": 4,'
        ' "dtype": "bf16", "m": 1024, "n": 2048, "k": 4096, "launch": "b", "source": "fused op: test"}]}'
    )
    hit = tuning_table.Key.of("sm90", 4, torch.bfloat16, 1000, 2100, 4000)
    assert hit == tuning_table.Key("sm90", 4, "bf16", 1024, 2048, 4096)
    takes_all = lambda launch: None  # noqa: E731
    assert table.launches(hit, takes_all) == ["b"]
    assert table.launches(tuning_table.Key.of("sm90", 8, torch.bfloat16, 1024, 2048, 4096), takes_all) == ["a", "b", "c"]
    declines_b = lambda launch: "no" if launch == "b" else None  # noqa: E731
    assert table.launches(hit, declines_b) == ["a", "c"]
    assert table.launches(hit, lambda launch: "no") == ["a"]  # declined, with the first candidate's reason


@pytest.mark.parametrize(
    "text, words",
    [
        ("{", "JSONDecodeError"),
        ('{"op": "x", "family": "f", "entries": []}', "KeyError: 'candidates'"),
        ('{"op": "x", "family": "f", "candidates": [], "entries": []}', "no candidates"),
        (
            '{"op": "x", "family": "f", "candidates": ["a"], "entries": [{"arch": "sm90", "world": 4, "dtype": "bf16",'
            ' "m": 1000, "n": 2048, "k": 4096, "launch": "a", "source": "s"}]}',
            "must be bucketed",
        ),
    ],
)
def test_a_malformed_table_is_one_line_naming_it(text, words):
    with pytest.raises(ValueError, match=r"malformed tuning table t\.json") as e:
        tuning_table.parse(text, "t.json")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bucket_rounds_on_the_log_scale():
    assert [tuning_table.bucket(x) for x in (1, 3, 5, 6144, 7168, 12288, 24576)] == [1, 4, 4, 8192, 8192, 16384, 32768]


def test_the_compile_cache_key_covers_the_tables():
    """The rewrite pass's uuid covers the registered choices' names with their launch tables' digests, so a new
    table (or a launch gone from a family) never replays a graph compiled against the old one."""
    from fluxcompile.lowerings.choices import registered_names

    names = registered_names()
    for op, (lowering, _) in FAMILIES.items():
        digest = lowering.launches().digest
        assert f"cutlass@{digest}" in names.split(f"{op}:")[1].split(";")[0]
        assert lowering.table().digest != digest  # the family's launches count too, not the table alone
