"""A kernel family's shipped tuning table: which launch variant (tile shape, cluster, raster, chunks, tile order) a
fused op's call runs, keyed by the GPU's arch, the world size, the dtype and the kernel's GEMM shape ``M x N x K``
(each rounded to the nearest power of two: :func:`bucket`).

A table is a JSON file beside its op's choice (``lowerings/<op>/<family>_tuning.json``), written by
``benchmarks/cutlass_tuning.py`` from the fused op's recorded times (every entry names its source: the raw file and
rows, or that it was timed on the GEMM alone, or copied from another key that was timed). Where the table has no
entry for a call, its ``candidates`` (two or three launches) are what the autotuner times at compile time: a
missing shape never raises. Flux's per-op ``tuning_config/`` is the model.

    {"op": ..., "family": ..., "candidates": [launch, ...],
     "entries": [{"arch": "sm90", "world": 4, "dtype": "bf16", "m": 4096, "n": 16384, "k": 16384,
                  "launch": "128x256x64_c2x1:g16", "source": "..."}, ...]}
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def bucket(x: int) -> int:
    """``x`` rounded to the nearest power of two (on the log scale; at least 1)."""
    return 1 << max(0, round(math.log2(max(x, 1))))


def arch_of(device: torch.device) -> str:
    """``"sm<major><minor>"`` of a CUDA device ("cpu" elsewhere)."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


@dataclasses.dataclass(frozen=True)
class Key:
    arch: str
    world: int
    dtype: str
    m: int
    n: int
    k: int

    @classmethod
    def of(cls, arch: str, world: int, dtype: torch.dtype | str, m: int, n: int, k: int) -> Key:
        """The key of a call: its GEMM's sizes bucketed."""
        name = dtype if isinstance(dtype, str) else DTYPES.get(dtype, str(dtype).removeprefix("torch."))
        return cls(arch, int(world), name, bucket(m), bucket(n), bucket(k))


@dataclasses.dataclass(frozen=True)
class TuningTable:
    op: str
    family: str
    candidates: tuple[str, ...]
    entries: dict[Key, str]
    sources: dict[Key, str]
    digest: str

    def lookup(self, key: Key) -> str | None:
        """The launch of ``key``'s entry (None: the table has none)."""
        return self.entries.get(key)

    def launches(self, key: Key, declines: Callable[[str], str | None]) -> list[str]:
        """The launches to run a call of ``key`` with: the entry's, where the table has one and it takes the call
        (``declines(launch)`` is None), else the candidates that take it (the autotuner times them); at least one,
        so a call that no launch takes is declined by the first candidate's reason."""
        hit = self.lookup(key)
        if hit is not None and declines(hit) is None:
            return [hit]
        taken = [c for c in self.candidates if declines(c) is None]
        return taken or [self.candidates[0]]


def parse(text: str, where: str = "<table>") -> TuningTable:
    """The table in ``text``; a malformed one is a ValueError naming ``where`` and what is wrong."""
    try:
        raw = json.loads(text)
        candidates = tuple(str(c) for c in raw["candidates"])
        entries: dict[Key, str] = {}
        sources: dict[Key, str] = {}
        for e in raw["entries"]:
            key = Key(str(e["arch"]), int(e["world"]), str(e["dtype"]), int(e["m"]), int(e["n"]), int(e["k"]))
            if key in entries:
                raise ValueError(f"two entries for {key}")
            if any(bucket(v) != v for v in (key.m, key.n, key.k)):
                raise ValueError(f"{key}: sizes must be bucketed (powers of two)")
            entries[key] = str(e["launch"])
            sources[key] = str(e["source"])
        if not candidates:
            raise ValueError("no candidates")
        op, family = str(raw["op"]), str(raw["family"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"fluxcompile: malformed tuning table {where}: {type(e).__name__}: {e}") from None
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return TuningTable(op, family, candidates, entries, sources, digest)


@functools.cache
def load(path: Path) -> TuningTable:
    """The table at ``path`` (read once)."""
    return parse(Path(path).read_text(), str(path))
