"""fluxcompile: a torch.compile backend that fuses tensor-parallel collectives with their matmuls.

model = torch.compile(model, backend="fluxcompile")   # or fluxcompile.enable() before a framework compiles
print(fluxcompile.explain(model, x))                  # what fused, what did not, and why
"""

import logging as _logging

from . import ops
from .backend import disable, enable, explain, fluxcompile_backend
from .config import config
from .fx_passes.report import collect as collect_reports
from .fx_passes.report import reports
from .version import __version__


def _register_backend() -> None:
    """Make backend="fluxcompile" work without the entry point too (a source checkout on PYTHONPATH)."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if "fluxcompile" in registry._COMPILER_FNS:
        return
    if any(ep.name == "fluxcompile" for ep in entry_points(group="torch_dynamo_backends")):
        return  # Dynamo loads it through the entry point (registering here too would clash)
    registry.register_backend(fluxcompile_backend, name="fluxcompile")


_register_backend()

__all__ = ["__version__", "collect_reports", "config", "disable", "enable", "explain", "fluxcompile_backend", "ops", "reports"]


def _log_to_stderr() -> None:
    """``config.log`` (``FLUXCOMPILE_LOG=info``, debug, ...) prints fluxcompile's own log (the autotuner's
    tables, the rewrite decisions) to stderr, without configuring anybody else's loggers."""
    level = config.log
    if not level:
        return
    logger = _logging.getLogger("fluxcompile")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("[fluxcompile %(name)s] %(message)s"))
        logger.addHandler(handler)


_log_to_stderr()

# The fused ops' CUDA implementations (the autotuned choices) register when lowerings is imported. Without
# this import a compiled model's fused ops run their reference implementations (cuBLAS + NCCL), not the fused
# kernels. Last, after config is bound.
try:
    from . import lowerings  # noqa: F401
except ImportError as _e:  # e.g. no Triton in a CPU-only install: the reference implementations run
    _logging.getLogger("fluxcompile").warning("fluxcompile: fused CUDA implementations unavailable: %s", _e)
