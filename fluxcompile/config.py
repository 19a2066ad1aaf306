"""fluxcompile's options: one dataclass, the only reader of ``FLUXCOMPILE_*`` environment variables.

Every field can be set three ways, later ones winning:
  1. its default here;
  2. the environment: ``FLUXCOMPILE_<FIELD NAME IN CAPITALS>`` (``FLUXCOMPILE_MATMUL_ALL_REDUCE=0``,
     ``FLUXCOMPILE_MIN_K=1024``, ``FLUXCOMPILE_IMPLEMENTATIONS=reference,cutlass``), read once at import; a
     malformed value ends the import with one line naming the variable and the values it accepts;
  3. code: ``fluxcompile.config.min_k = 1024`` or ``with fluxcompile.config.patch(min_k=1024): ...``, checked
     the same way (``ValueError``).

The rewrite pass's ``uuid()`` hashes the whole config, so changing a field never reuses a cached graph
compiled under another value. Fields marked ``tuning`` change which choices run or what they compute, so
the autotuner's key (``tuning_fingerprint``) covers them: a winner is never reused under other settings.
Everything else in the package reads these fields at call time, never at import, so ``patch`` reaches it.

Which implementation families run is ``implementations`` alone: a family runs while it is in the list. The
families off by default (``OFF_BY_DEFAULT``) are left out of its default; ``+family`` / ``-family`` entries change
the default list (``FLUXCOMPILE_IMPLEMENTATIONS=+moe``). Options that are gone (``REMOVED``, ``REMOVED_FAMILIES``),
set in the environment or in code, end with one line naming what replaces them.
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
# Implementation families, in the default order of preference: every choice has one (lowerings/choices.py; a
# choice's name is "<kind>" or "<kind>:<variant>", and its family is given where it is not the kind). Each family
# that can be switched on or off alone is one name here; a choice registered under a new family adds it
# (register_family).
IMPLEMENTATIONS = (
    "triton_ag",  # off by default: the persistent Triton all-gather+GEMM (kernels/ag_gemm.py)
    "triton_rs",  # off by default: the persistent Triton GEMM+reduce-scatter (kernels/gemm_rs.py)
    # The decode GEMM+all-reduce kernels: csrc/gemv_ar.cu ("cuda:gemv-*") and kernels/gemm_ar.py ("triton:*");
    # PyTorch's two-shot all-reduce choice ("torch_symm_mem:two_shot") runs only with this family too.
    "decode",
    # csrc/gemv_ar.cu between GPUs: a condition on "decode"'s CUDA choices, which run at one rank without it.
    "gemv_peers",
    "moe",  # off by default: the MoE dispatch and combine kernels (kernels/grouped_gemm.py)
    "dlrm",  # the DLRM embedding-bag exchange kernel (kernels/embedding_bag.py)
    "cublas_pipelined",  # cuBLAS GEMMs behind copy-engine transfers (csrc/sequences.h's sequences)
    "ag_stages",  # off by default: all_gather_matmul's "cublas_pipelined:stages<g>" (one GEMM per group of peers)
    "rs_stages",  # off by default: matmul_reduce_scatter's "cublas_pipelined:stages<g>"
    "torch_symm_mem",  # PyTorch's symm_mem fused ops and all-reduces
    "schedules",  # the schedule language's all-reduce choices (schedules/gpu_executor.py)
    "cutlass",  # the Flux-style CUTLASS GEMMs (csrc/flux_gemm.cuh; Hopper; built on first use)
    "rs_ring",  # off by default: the reduce-scatter's ring in one CUTLASS GEMM (that op's "cutlass" choice)
    "reference",  # the collective, then the matmuls (NCCL/gloo + cuBLAS): runs everywhere
)
# The families off by default: left out of ``implementations``' default, each runs once it is added.
OFF_BY_DEFAULT = ("triton_ag", "triton_rs", "ag_stages", "rs_stages", "moe", "rs_ring")
DEFAULT_IMPLEMENTATIONS = tuple(f for f in IMPLEMENTATIONS if f not in OFF_BY_DEFAULT)
# Family names that are gone, and the families each stood for.
REMOVED_FAMILIES = {"triton": ("triton_ag", "triton_rs", "decode", "moe", "dlrm"), "cuda": ("decode", "gemv_peers")}
# Families retired because no benchmark table ever picked them (BENCHMARKS.md, benchmarks/choice_wins.py): why.
RETIRED_FAMILIES = {
    "async_input_mm": "no benchmark row picked it by more than noise; the all-gather's cublas_pipelined and cutlass "
    "choices run instead",
}
_families = list(IMPLEMENTATIONS)


def register_family(family: str) -> None:
    """Accept ``family`` in ``implementations`` (lowerings/choices.py calls this for every registered choice)."""
    if family in REMOVED_FAMILIES or family in RETIRED_FAMILIES or family.startswith(("+", "-")):
        raise ValueError(f"fluxcompile: {family!r} cannot name a family")
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
    # Its backward: the all-to-all of the pooled rows' gradients back to the tables' owners, then the tables'
    # embedding-bag gradients.
    all_to_all_embedding_bag_backward: bool = True

    # Minimum sizes of the (local) matmul for a rewrite: M rows (after the collective), N columns, K
    # contraction. Below them the original ops stay and the report says which bound was missed.
    min_m: int = 1
    min_n: int = 1
    min_k: int = 1

    # Implementation families the lowering may choose from (IMPLEMENTATIONS above), in order of preference when
    # autotuning is off: a family runs while it is here, and only then; the default leaves out OFF_BY_DEFAULT.
    # "+family" / "-family" entries change the default list instead of naming it whole. "reference"
    # (NCCL/gloo collective + matmul, runs everywhere) is always kept as the safe choice.
    implementations: tuple[str, ...] = _field(DEFAULT_IMPLEMENTATIONS, tuning=True, choices=_families)

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

    # Inductor's generated code calls the fused ops' CUDA implementations directly, not through torch.ops
    # (the dispatcher's host time per call: lowerings/direct_calls.py).
    direct_calls: bool = True

    # The cuBLAS-pipelined choices' C++ stream sequences: a call whose arguments (pointers included) were
    # seen before is captured once as a CUDA graph and replayed (csrc/replays.h). At most this
    # many graphs per process; 0 turns it off.
    sequence_graphs: int = 1024

    # The bound (seconds) on every wait for a peer that runs inside a kernel: the decode kernels, the CUTLASS GEMMs,
    # the schedule executor, the DLRM and the MoE kernels. The wait gives up, records the rank, the peer and the
    # signal in error words, and the call (or the next one) raises with them.
    wait_timeout_s: float = 60.0
    # The bound (seconds) on the stream waits (cuStreamWaitValue32 of the cuBLAS-pipelined and CUTLASS
    # choices), which cannot time out themselves: symm_mem/watchdog.py's thread times each eager call from
    # the host and ends the process past it (0 = off). A bound of its own, not wait_timeout_s, because it is
    # another kind of wait: its clock runs from when the host queued the call, so it also counts the work queued
    # ahead of it on the stream, and passing it ends the process (a blocked stream cannot be cancelled) where an
    # in-kernel wait raises an error; it keeps NCCL's watchdog default.
    watchdog_timeout_s: float = 600.0
    # Check the Triton kernels' wait errors after every call (synchronizes) instead of at the next call.
    check_signals: bool = False
    # The backend of every symmetric workspace: "cuda" (torch's default: CUDA IPC between the GPUs of one host) or
    # "nvshmem" (torch's NVSHMEM backend: one heap per process, peers on other hosts reachable by put/get). torch
    # sets it once per process, before its first symmetric allocation (symm_mem/backend.py applies it then, and
    # names what allocated first where that is too late); "nvshmem" sizes NVSHMEM's heap
    # (NVSHMEM_SYMMETRIC_SIZE, where not set) to ``nvshmem_heap_mb``.
    symm_mem_backend: str = _field("cuda", tuning=True, choices=("cuda", "nvshmem"))
    nvshmem_heap_mb: int = 2048
    # How the all-to-all exchanges reach their peers (DLRM's embedding exchange): "p2p" stores into peers' memory
    # from the kernels that make the rows (one host), with NVSHMEM's put-with-signal only where a peer is on another
    # host; "put" uses put-with-signal for every peer (needs symm_mem_backend "nvshmem"): the form a group across
    # hosts runs, forced on one host so that it runs and is tested there.
    exchange_transport: str = _field("p2p", tuning=True, choices=("p2p", "put"))
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
        """Apply ``FLUXCOMPILE_*`` overrides; a malformed value raises :class:`ConfigError` naming the variable, and
        so does an option that is gone (``REMOVED``), naming what replaces it. Variables that name no option are
        reported on the log (a typo must not pass silently)."""
        environ = os.environ if environ is None else environ
        for old, instead in REMOVED.items():
            var = self.env_name(old)
            if var in environ:
                raise ConfigError(f"{var} is no longer an option: {_replacement(old, instead, env=True)}")
        names = {self.env_name(f.name) for f in dataclasses.fields(self)}
        for f in dataclasses.fields(self):
            var = self.env_name(f.name)
            raw = environ.get(var)
            if raw is not None:
                try:
                    self._set(f.name, _parse(raw, getattr(self, f.name)))
                except ConfigError as e:
                    raise ConfigError(f"{var}={raw!r}: {e}") from None
        unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in names and not k.startswith(_NOT_OPTIONS))
        if unknown:
            _log.warning(
                "fluxcompile: ignoring %s: no such option (options: %s)", ", ".join(unknown), ", ".join(sorted(names))
            )

    @staticmethod
    def nvshmem_heap_env() -> str | None:
        """NVSHMEM's own heap size variable (``NVSHMEM_SYMMETRIC_SIZE``) where the environment sets it: read here, at
        call time, as every variable the package touches (symm_mem/backend.py sets it through
        :meth:`export_nvshmem_heap` where unset)."""
        return os.environ.get("NVSHMEM_SYMMETRIC_SIZE") or None

    def export_nvshmem_heap(self) -> str:
        """``NVSHMEM_SYMMETRIC_SIZE`` set to ``nvshmem_heap_mb`` (NVSHMEM reads it when it starts); returns it."""
        value = os.environ["NVSHMEM_SYMMETRIC_SIZE"] = f"{self.nvshmem_heap_mb}M"
        return value

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

    def family_declines(self, family: str) -> str | None:
        """Why the choices of implementation family ``family`` do not run under this config, naming what enables
        them; None where they may ("reference" always may)."""
        if family == "reference":
            return None
        if family not in self.implementations:
            var = self.env_name("implementations")
            if family in OFF_BY_DEFAULT:
                return f"off by default: adding {family!r} to config.implementations ({var}=+{family}) enables it"
            return f"switched off: config.implementations ({var}) leaves out {family!r}"
        return None

    @property
    def version(self) -> int:
        """A counter bumped by every change of a field: caches derived from the config compare it per call."""
        return self.__dict__.get("_version", 0)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in REMOVED:
            raise ConfigError(f"fluxcompile.config.{name} is no longer an option: {_replacement(name, REMOVED[name])}")
        if name not in _FIELDS:
            raise AttributeError(f"fluxcompile.config has no option {name!r} (options: {', '.join(sorted(_FIELDS))})")
        if name not in self.__dict__:  # __init__: the defaults are trusted
            super().__setattr__(name, value)
            return
        try:
            self._set(name, value)
        except ConfigError as e:
            raise ConfigError(f"fluxcompile.config.{name}={value!r}: {e}") from None

    def __getattr__(self, name: str) -> Any:
        """Only names no attribute has reach this: an option that is gone says what replaces it."""
        if name in REMOVED:
            raise AttributeError(f"fluxcompile.config.{name} is no longer an option: {_replacement(name, REMOVED[name])}")
        raise AttributeError(f"fluxcompile.config has no option {name!r}")

    def _set(self, name: str, value: Any) -> None:
        if name == "implementations":
            value = _resolve_families(value)
        object.__setattr__(self, name, _check(_FIELDS[name], value, getattr(self, name)))
        self.__dict__["_version"] = self.version + 1


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_TUNING = [f for f in dataclasses.fields(Config) if f.metadata.get("tuning")]
_log = logging.getLogger("fluxcompile.config")

# Options that are gone -> what replaces each: a field, or "family:<name>", that family's name in
# ``implementations`` (the switches of the families). The per-kernel bounds on in-kernel waits became the one
# ``wait_timeout_s``, the watchdog's bound ``watchdog_timeout_s``.
REMOVED: dict[str, str] = {
    **{f"experimental_{f}": f"family:{f}" for f in (*OFF_BY_DEFAULT, "decode", "gemv_peers", "schedules", "cutlass", "dlrm")},
    "signal_timeout_s": "watchdog_timeout_s",
    **{f"{k}_timeout_s": "wait_timeout_s" for k in ("decode", "cutlass", "sched", "dlrm", "moe")},
}


def _replacement(old: str, instead: str, env: bool = False) -> str:
    """What replaces the removed option ``old``, in the words of the environment or of code."""
    if not instead.startswith("family:"):
        return f"{PREFIX + instead.upper() if env else 'config.' + instead} replaces it"
    family = instead.partition(":")[2]
    sign = "+" if family in OFF_BY_DEFAULT else "-"
    what = (
        f"add {family!r} to implementations (off by default)"
        if sign == "+"
        else f"{family!r} in implementations says whether it runs (there by default)"
    )
    how = f"{PREFIX}IMPLEMENTATIONS={sign}{family}" if env else f"config.implementations = ({sign + family!r},)"
    return f"{what}: {how}"


def _with_family(families: tuple[str, ...], family: str, on: bool) -> tuple[str, ...]:
    """``families`` without ``family`` (``on`` False) or with it: after the last family that precedes it in
    ``IMPLEMENTATIONS``, else before the first (its place in the default order)."""
    if not on:
        return tuple(f for f in families if f != family)
    if family in families:
        return families
    rank = {f: i for i, f in enumerate(_families)}
    before = [i for i, f in enumerate(families) if rank.get(f, len(rank)) < rank.get(family, len(rank))]
    at = before[-1] + 1 if before else 0
    return (*families[:at], family, *families[at:])


def _resolve_families(value: Any) -> Any:
    """``implementations`` as a list of families: ``+family`` / ``-family`` entries (all of them so) change the
    default list; a removed family name raises, naming what it stood for."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        return value
    for n in names:
        if n.lstrip("+-") in REMOVED_FAMILIES:
            stood = ", ".join(REMOVED_FAMILIES[n.lstrip("+-")])
            raise ConfigError(f"the family {n.lstrip('+-')!r} is no longer a name: name the families it stood for ({stood})")
        if n.lstrip("+-") in RETIRED_FAMILIES:
            raise ConfigError(f"the family {n.lstrip('+-')!r} is retired: {RETIRED_FAMILIES[n.lstrip('+-')]}")
    changes = [n.startswith(("+", "-")) for n in names]
    if not any(changes):
        return tuple(names)
    if not all(changes):
        raise ConfigError("expected families, or +family / -family changes to the default, not both")
    out = DEFAULT_IMPLEMENTATIONS
    for n in names:
        if n[1:] not in _families:
            raise ConfigError(f"unknown {n[1:]!r}; valid: {', '.join(_families)}")
        out = _with_family(out, n[1:], n[0] == "+")
    return out


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
    old = {f: getattr(cfg, f) for f in changes}
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
