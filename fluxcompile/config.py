"""fluxcompile's options: one dataclass, overridable from ``FLUXCOMPILE_*`` environment variables.

Every field can be set three ways, later ones winning:
  1. its default here;
  2. the environment: ``FLUXCOMPILE_<FIELD NAME IN CAPITALS>`` (``FLUXCOMPILE_MATMUL_ALL_REDUCE=0``,
     ``FLUXCOMPILE_MIN_K=1024``, ``FLUXCOMPILE_IMPLEMENTATIONS=reference,triton``), read at import;
  3. code: ``fluxcompile.config.min_k = 1024`` or ``with fluxcompile.config.patch(min_k=1024): ...``.

The rewrite pass's ``uuid()`` hashes the whole config, so changing a field never reuses a cached graph
that was compiled under another value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass
class Config:
    # Which patterns the rewrite pass fuses (all opt-out; turning one off keeps the original ops).
    all_gather_matmul: bool = True
    matmul_reduce_scatter: bool = True
    matmul_all_reduce: bool = True
    all_to_all_matmul: bool = True
    matmul_all_to_all: bool = True
    # The residual add + RMSNorm after an all-reduce, folded into it (decode's decoder-layer tail).
    all_reduce_rmsnorm: bool = True

    # Minimum sizes of the (local) matmul for a rewrite: M rows (after the collective), N columns, K
    # contraction. Below them the original ops stay and the report says which bound was missed.
    min_m: int = 1
    min_n: int = 1
    min_k: int = 1

    # Implementations the lowering may choose from, in order of preference when autotuning is off.
    # "reference" (NCCL/gloo collective + matmul, runs everywhere) is always kept as the safe choice.
    implementations: tuple[str, ...] = (
        "triton",
        "cuda",
        "cublas_pipelined",
        "async_input_mm",
        "torch_symm_mem",
        "schedules",
        "reference",
    )

    # Rank-synchronized autotuning of the fused ops' implementations; off = fixed default choice.
    autotune: bool = True
    # Where autotuning results are cached ("" = ~/.cache/fluxcompile).
    cache_dir: str = ""

    # Inductor's generated code calls the fused ops' CUDA implementations directly, not through torch.ops
    # (the dispatcher's host time per call: lowerings/direct_calls.py).
    direct_calls: bool = True

    # The cuBLAS-pipelined choices' C++ stream sequences: a call whose arguments (pointers included) were
    # seen before is captured once as a CUDA graph and replayed, one launch instead of 10-30 stream
    # operations (csrc/pipelined.cpp, "Replays"). At most this many graphs per process; 0 turns it off.
    sequence_graphs: int = 1024

    # Log the rewrite report of every compiled graph at INFO on the "fluxcompile" logger.
    log_report: bool = True

    def env_name(self, field: str) -> str:
        return "FLUXCOMPILE_" + field.upper()

    def load_env(self, environ: dict[str, str] | None = None) -> None:
        """Apply ``FLUXCOMPILE_*`` overrides; a malformed value is an error naming the variable."""
        environ = os.environ if environ is None else environ
        for f in dataclasses.fields(self):
            raw = environ.get(self.env_name(f.name))
            if raw is not None:
                setattr(self, f.name, _parse(self.env_name(f.name), raw, getattr(self, f.name)))

    def patch(self, **changes: Any) -> contextlib.AbstractContextManager[Config]:
        """Temporarily change fields: ``with config.patch(min_k=1024): ...``."""
        return _patch(self, changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in {f.name for f in dataclasses.fields(self)}:
            raise AttributeError(f"fluxcompile.config has no option {name!r}")
        if name == "implementations":
            value = tuple(value)
        super().__setattr__(name, value)


def _parse(var: str, raw: str, current: Any) -> Any:
    text = raw.strip()
    if isinstance(current, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{var}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{var}={raw!r}: expected an integer") from None
    if isinstance(current, tuple):
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return text


@contextlib.contextmanager
def _patch(cfg: Config, changes: dict[str, Any]) -> Iterator[Config]:
    old = {k: getattr(cfg, k) for k in changes}
    try:
        for k, v in changes.items():
            setattr(cfg, k, v)
        yield cfg
    finally:
        for k, v in old.items():
            setattr(cfg, k, v)


config = Config()
config.load_env()
