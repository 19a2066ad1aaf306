"""The README's configuration table against ``fluxcompile.config.Config``: every field in exactly one row, no name
that is not a field, and each default as the table shows it; the LICENSE matches the package's metadata."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from fluxcompile.config import DEFAULT_IMPLEMENTATIONS, IMPLEMENTATIONS, OFF_BY_DEFAULT, Config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def config_table(text: str) -> list[tuple[list[str], list[str]]]:
    """The rows of the table under ``## Configuration``: (field names, default cells), defaults split on ", "."""
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0].split("|")[1:3] == [" field ", " default "], rows[0]
    table = []
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, line
        table.append((re.findall(r"`(\w+)`", cells[0]), cells[1].split(", ")))
    return table


def shown(value: Any) -> str:
    """A default as the table writes it: on/off, a number, `a,b` for a tuple, `""` for an empty string."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float)):
        return f"{value:g}"
    if value == IMPLEMENTATIONS:
        return "all"
    if value == DEFAULT_IMPLEMENTATIONS and DEFAULT_IMPLEMENTATIONS == tuple(f for f in IMPLEMENTATIONS if f not in OFF_BY_DEFAULT):
        return "all but those off by default"
    if isinstance(value, tuple):
        return "`" + ",".join(map(str, value)) + "`"
    return f"`{value}`" if value else '`""`'


def test_readme_config_table_names_every_field_once():
    fields = [f.name for f in dataclasses.fields(Config)]
    named = [name for names, _ in config_table(README.read_text()) for name in names]
    assert not set(named) - set(fields), f"the README names options Config does not have: {set(named) - set(fields)}"
    assert not set(fields) - set(named), f"the README's table misses {sorted(set(fields) - set(named))}"
    assert len(named) == len(set(named)), f"named twice: {sorted({n for n in named if named.count(n) > 1})}"


def test_readme_config_table_shows_the_defaults():
    defaults = Config()
    for names, cells in config_table(README.read_text()):
        # One default for the whole row, or one per field in the order named.
        assert len(cells) in (1, len(names)), (names, cells)
        for name, cell in zip(names, cells * len(names) if len(cells) == 1 else cells):
            assert cell == shown(getattr(defaults, name)), f"{name}: the README shows {cell}"


def test_readme_names_the_families_off_by_default():
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `implementations` |"))
    named = re.search(r"Off by default: ([^.]*)\.", row).group(1)
    assert re.findall(r"`(\w+)`", named) == list(OFF_BY_DEFAULT)


@pytest.mark.parametrize("text, problem", [("| `min_q` | 1 | x |", "does not have"), ("", "misses")])
def test_readme_config_check_catches_a_wrong_table(monkeypatch, tmp_path, text, problem):
    table = "| `min_m`, `min_n`, `min_k` | 1 | minimum local matmul sizes for a rewrite |"
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text().replace(table, text))
    monkeypatch.setattr(sys.modules[__name__], "README", readme)
    with pytest.raises(AssertionError, match=problem):
        test_readme_config_table_names_every_field_once()


def test_license_matches_the_metadata():
    assert re.search(r'^license = .*"BSD-3-Clause"', (ROOT / "pyproject.toml").read_text(), re.M)
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n") and "Copyright (c) 2026, the fluxcompile authors" in text
