"""fluxcompile's options: one dataclass, the only reader of ``FLUXCOMPILE_*`` environment variables.

Every field can be set three ways, later ones winning:
  1. its default here;
  2. the environment: ``FLUXCOMPILE_<FIELD NAME IN CAPITALS>`` (``FLUXCOMPILE_MATMUL_ALL_REDUCE=0``,
     ``FLUXCOMPILE_MIN_K=1024``, ``FLUXCOMPILE_IMPLEMENTATIONS=reference,triton``), read once at import; a
     malformed value ends the import with one line naming the variable and the values it accepts;
  3. code: ``fluxcompile.config.min_k = 1024`` or ``with fluxcompile.config.patch(min_k=1024): ...``, checked
     the same way (``ValueError``).

The rewrite pass's ``uuid()`` hashes the whole config, so changing a field never reuses a cached graph
compiled under another value. Fields marked ``tuning`` change which choices run or what they compute, so
the autotuner's key (``tuning_fingerprint``) covers them: a winner is never reused under other settings.
Everything else in the package reads these fields at call time, never at import, so ``patch`` reaches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
PREFIX = "FLUXCOMPILE_"
# Implementation families a fused op may choose from (lowerings/choices.py names each choice
# "<family>" or "<family>:<variant>"); a choice registered under a new family adds it (register_family).
IMPLEMENTATIONS = (
    "triton",
    "cuda",
    "cublas_pipelined",
    "async_input_mm",
    "torch_symm_mem",
    "schedules",
    "cutlass",
    "reference",
)
_families = list(IMPLEMENTATIONS)


def register_family(family: str) -> None:
    """Accept ``family`` in ``implementations`` (lowerings/choices.py calls this for every registered choice)."""
    if family not in _families:
        _families.append(family)


LOG_LEVELS = ("", "debug", "info", "warning", "error", "critical")
# Variables with this prefix that are not options (the test suite's seed).
_NOT_OPTIONS = ("FLUXCOMPILE_TEST_",)


class ConfigError(ValueError):
    """A field set to a value it does not accept (the message is one line)."""


def _field(default: Any, *, tuning: bool = False, choices: Sequence[str] | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"tuning": tuning, "choices": choices})


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
    # Embedding-bag pooling over this rank's tables, then the all-to-all to the batch owners (DLRM).
    embedding_bag_all_to_all: bool = True

    # Minimum sizes of the (local) matmul for a rewrite: M rows (after the collective), N columns, K
    # contraction. Below them the original ops stay and the report says which bound was missed.
    min_m: int = 1
    min_n: int = 1
    min_k: int = 1

    # Implementation families the lowering may choose from, in order of preference when autotuning is off.
    # "reference" (NCCL/gloo collective + matmul, runs everywhere) is always kept as the safe choice.
    implementations: tuple[str, ...] = _field(IMPLEMENTATIONS, tuning=True, choices=_families)

    # Rank-synchronized autotuning of the fused ops' implementations; off = fixed default choice.
    autotune: bool = _field(True, tuning=True)
    # Where a matched site's implementation is chosen while compiling (fx_passes/decide.py): "cuda" for sites on
    # CUDA tensors, "always", or "never". Where it is, a site whose unfused collective + matmul win keeps its
    # original ops (compiled as plain Inductor compiles them); elsewhere every matched site is rewritten and its
    # fused op chooses at run time.
    choose_at_compile: str = _field("cuda", choices=("cuda", "always", "never"))
    # Sites whose row count is symbolic are tuned at compile time at these row counts; each call then runs the
    # choice tuned at the nearest of them, on a log scale (fx_passes/decide.py, lowerings/compiled.py).
    dispatch_rows: tuple[int, ...] = (16, 128, 512, 2048, 8192)
    # How long a rank waits, at a site's compile-time choice, for the other ranks of its group to reach it.
    choose_timeout_s: float = 600.0
    # Where autotuning results are cached ("" = ~/.cache/fluxcompile).
    cache_dir: str = ""

    # Kernel families that run only when switched on: registered, but declining every call while off.
    # The persistent Triton all-gather+GEMM (kernels/ag_gemm.py) and GEMM+reduce-scatter (kernels/gemm_rs.py).
    experimental_triton_ag: bool = _field(False, tuning=True)
    experimental_triton_rs: bool = _field(False, tuning=True)
    # The cuBLAS-pipelined ":stages<g>" choices (one GEMM per group of peers).
    experimental_ag_stages: bool = _field(False, tuning=True)
    experimental_rs_stages: bool = _field(False, tuning=True)
    # The decode GEMM+all-reduce kernels (csrc/gemv_ar.cu, kernels/gemm_ar.py) and PyTorch's two-shot choice.
    experimental_decode: bool = _field(True, tuning=True)
    # csrc/gemv_ar.cu between GPUs (it runs at one rank either way).
    experimental_gemv_peers: bool = _field(True, tuning=True)
    # The schedule language's all-reduce choices (schedules/gpu_executor.py).
    experimental_schedules: bool = _field(True, tuning=True)
    # The Flux-style CUTLASS GEMMs of all_gather_matmul and matmul_reduce_scatter (csrc/flux_gemm.cuh), among the
    # autotuner's choices on Hopper (the first use builds them: csrc_cache).
    experimental_cutlass: bool = _field(True, tuning=True)
    # The Triton kernels of the all-to-all ops (MoE dispatch and combine: kernels/grouped_gemm.py) and of
    # embedding_bag_all_to_all (kernels/embedding_bag.py): the MoE kernels opt-in, the DLRM kernel on (README,
    # "Mixture-of-experts and DLRM").
    experimental_moe: bool = _field(False, tuning=True)
    experimental_dlrm: bool = _field(True, tuning=True)
    # Bounds (seconds) on the DLRM and MoE kernels' waits for their peers.
    dlrm_timeout_s: float = 60.0
    moe_timeout_s: float = 60.0

    # Inductor's generated code calls the fused ops' CUDA implementations directly, not through torch.ops
    # (the dispatcher's host time per call: lowerings/direct_calls.py).
    direct_calls: bool = True

    # The cuBLAS-pipelined choices' C++ stream sequences: a call whose arguments (pointers included) were
    # seen before is captured once as a CUDA graph and replayed (csrc/pipelined.cpp, "Replays"). At most this
    # many graphs per process; 0 turns it off.
    sequence_graphs: int = 1024

    # Bounds on waits for peers. signal_timeout_s: the watchdog's bound on the cuBLAS-pipelined choices' flag
    # waits (symm_mem/watchdog.py; 0 = off). decode_timeout_s / cutlass_timeout_s / sched_timeout_s: the in-kernel spin-waits
    # of the decode kernels, of the CUTLASS GEMMs and of the schedule executor.
    signal_timeout_s: float = 600.0
    decode_timeout_s: float = 60.0
    cutlass_timeout_s: float = 60.0
    sched_timeout_s: float = 60.0
    # Check the Triton kernels' wait errors after every call (synchronizes) instead of at the next call.
    check_signals: bool = False
    # Bytes of a chunk slice one program of the schedule executor moves (schedules/gpu_executor.py).
    sched_slice_bytes: int = _field(16 << 10, tuning=True)

    # Where the CUDA extensions of fluxcompile/csrc are built and cached ("" = ~/.cache/fluxcompile/csrc), and
    # whether their build prints its commands.
    csrc_cache: str = ""
    csrc_verbose: bool = False

    # The vLLM plugin (integrations/vllm.py) adds the rewrite pass to vLLM's compilation.
    vllm: bool = False
    # Log the rewrite report of every compiled graph at INFO on the "fluxcompile" logger.
    log_report: bool = True
    # Print fluxcompile's own log at this level to stderr ("" leaves logging alone).
    log: str = _field("", choices=LOG_LEVELS)

    def env_name(self, field: str) -> str:
        return PREFIX + field.upper()

    def load_env(self, environ: Mapping[str, str] | None = None) -> None:
        """Apply ``FLUXCOMPILE_*`` overrides; a malformed value raises :class:`ConfigError` naming the variable.
        Variables that name no option are reported on the log (a typo must not pass silently)."""
        environ = os.environ if environ is None else environ
        names = {self.env_name(f.name) for f in dataclasses.fields(self)}
        for f in dataclasses.fields(self):
            var = self.env_name(f.name)
            raw = environ.get(var)
            if raw is not None:
                try:
                    self._set(f.name, _parse(raw, getattr(self, f.name)))
                except ConfigError as e:
                    raise ConfigError(f"{var}={raw!r}: {e}") from None
        unknown = sorted(
            k for k in environ if k.startswith(PREFIX) and k not in names and not k.startswith(_NOT_OPTIONS)
        )
        if unknown:
            logging.getLogger("fluxcompile.config").warning(
                "fluxcompile: ignoring %s: no such option (options: %s)", ", ".join(unknown), ", ".join(sorted(names))
            )

    def patch(self, **changes: Any) -> contextlib.AbstractContextManager[Config]:
        """Temporarily change fields: ``with config.patch(min_k=1024): ...``."""
        return _patch(self, changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    def tuning_fingerprint(self) -> str:
        """The fields that change which choices run or what they compute (the autotuner's key)."""
        return json.dumps({f.name: getattr(self, f.name) for f in _TUNING}, sort_keys=True)

    @property
    def version(self) -> int:
        """A counter bumped by every change of a field: caches derived from the config compare it per call."""
        return self.__dict__.get("_version", 0)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELDS:
            raise AttributeError(f"fluxcompile.config has no option {name!r} (options: {', '.join(sorted(_FIELDS))})")
        if name not in self.__dict__:  # __init__: the defaults are trusted
            super().__setattr__(name, value)
            return
        try:
            self._set(name, value)
        except ConfigError as e:
            raise ConfigError(f"fluxcompile.config.{name}={value!r}: {e}") from None

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, _check(_FIELDS[name], value, getattr(self, name)))
        self.__dict__["_version"] = self.version + 1


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_TUNING = [f for f in dataclasses.fields(Config) if f.metadata.get("tuning")]


def _parse(raw: str, current: Any) -> Any:
    """A field's value from its environment text (the type is the current value's)."""
    text = raw.strip()
    if isinstance(current, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"expected one of {', '.join(_TRUE + _FALSE)}")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError("expected an integer") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError("expected a number") from None
    if isinstance(current, tuple):
        parts = tuple(p.strip() for p in text.split(",") if p.strip())
        if current and isinstance(current[0], int):
            try:
                return tuple(int(p) for p in parts)
            except ValueError:
                raise ConfigError("expected integers separated by commas") from None
        return parts
    return text


def _check(field: dataclasses.Field, value: Any, current: Any) -> Any:
    """``value`` as the field stores it, or :class:`ConfigError` saying what the field accepts."""
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ConfigError("expected True or False")
        return value
    if isinstance(current, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(current, int) and value != int(value)):
            raise ConfigError(f"expected {'an integer' if isinstance(current, int) else 'a number'}")
        if value < 0:
            raise ConfigError("expected a value >= 0")
        return type(current)(value)
    allowed = field.metadata.get("choices")
    if isinstance(current, tuple) and current and isinstance(current[0], int):
        value = (value,) if isinstance(value, int) else tuple(value)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value) or list(value) != sorted(set(value)):
            raise ConfigError("expected increasing integers >= 1")
        return value
    if isinstance(current, tuple):
        value = (value,) if isinstance(value, str) else tuple(value)
        bad = [v for v in value if allowed and v not in allowed]
        if bad:
            raise ConfigError(f"unknown {', '.join(map(repr, bad))}; valid: {', '.join(allowed)}")
        return value
    if not isinstance(value, str):
        raise ConfigError("expected a string")
    if allowed and value.lower() not in allowed:
        raise ConfigError(f"expected one of {', '.join(repr(a) for a in allowed)}")
    return value.lower() if allowed else value


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
try:
    config.load_env()
except ConfigError as _e:
    # A one-line message instead of an import traceback: the fix is in the user's environment.
    raise SystemExit(f"fluxcompile: {_e}") from None
