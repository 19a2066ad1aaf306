"""fluxcompile inside vLLM's own compilation (``CompilationMode.VLLM_COMPILE``).

vLLM compiles with Inductor and installs its ``PostGradPassManager`` as Inductor's
``post_grad_custom_post_pass``. Two ways to put fluxcompile's rewrite into it:

* the config route::

    --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass":
                           "fluxcompile.integrations.vllm.vllm_post_grad_pass"}}'

* the plugin route: ``FLUXCOMPILE_VLLM=1``. fluxcompile is a ``vllm.general_plugins`` entry point; vLLM
  calls :func:`register` in every process, which makes every ``PostGradPassManager`` add the pass
  (once, and not when the config route already put it there).

The pass matches vLLM's collectives (``torch.ops.vllm.all_reduce/all_gather/reduce_scatter``) and the
c10d functional ones, and rewrites them into fluxcompile's fused ops (see
``fluxcompile/fx_passes/vllm_collectives.py``). It allocates nothing: the fused ops find their
workspaces when they run, so a graph loaded from vLLM's compile cache runs as one compiled now. Its
``uuid()`` covers fluxcompile's version, its config and the pass sources, so the cache never returns a
graph rewritten by another version or under other settings.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch.fx import Graph
from vllm.compilation.passes.inductor_pass import InductorPass

from ..config import config as options
from ..fx_passes import graph_pass, vllm_collectives

log = logging.getLogger("fluxcompile")
PASS_KEY = "post_grad_custom_post_pass"
QUALNAME = "fluxcompile.integrations.vllm.vllm_post_grad_pass"


class FluxcompileVllmPass(InductorPass):
    """fluxcompile's rewrite as a vLLM post-grad pass (an ``InductorPass``: ``__call__(graph)``, ``uuid()``)."""

    def __call__(self, graph: Graph) -> None:
        vllm_collectives.register(graph_pass.HANDLERS)
        # vLLM compiles inference graphs only.
        graph_pass.rewrite_graph(graph, graph_pass.config, is_inference=True)

    def uuid(self) -> str:
        inner = graph_pass.FluxcompilePass().uuid()  # version, config and the sources of the rewrite
        return InductorPass.hash_dict(
            {"fluxcompile": inner.hex() if isinstance(inner, bytes) else str(inner), "vllm": self.hash_source(self)}
        )

    def __repr__(self) -> str:
        return "FluxcompileVllmPass()"


vllm_post_grad_pass = FluxcompileVllmPass()

# vLLM resolves a qualified pass name with ``__import__(module).__dict__[name]``: ``__import__`` returns the
# top-level package, so the name is looked up on ``fluxcompile`` itself. Importing this module (which that
# ``__import__`` does) puts the pass there too; a resolver that looks in the right module finds it here.
sys.modules[__package__.split(".")[0]].vllm_post_grad_pass = vllm_post_grad_pass


def _configured_pass(vllm_config: Any) -> Any:
    cc = getattr(vllm_config, "compilation_config", None)
    return (getattr(cc, "inductor_compile_config", None) or {}).get(PASS_KEY)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: with ``FLUXCOMPILE_VLLM=1``, add the pass to vLLM's passes.

    Patches ``PostGradPassManager.configure`` (once per process) to append the pass after vLLM's own
    passes (``VLLM_COMPILE``, the CUDA path), and ``VllmConfig.__post_init__`` to hand the pass to stock
    Inductor where vLLM compiles without its pass manager (the CPU path). ``fluxcompile.config.vllm`` is
    read again each time, so the patches are inert while it is off.
    """
    if not options.vllm:
        return
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    original = PostGradPassManager.configure
    if getattr(original, "_fluxcompile", False):
        return

    def configure(self: Any, config: Any) -> None:
        original(self, config)
        if not options.vllm:
            return
        if isinstance(_configured_pass(config), FluxcompileVllmPass):
            return  # the config route adds it already
        if not any(isinstance(p, FluxcompileVllmPass) for p in self.passes):
            self.passes.append(vllm_post_grad_pass)

    configure._fluxcompile = True  # type: ignore[attr-defined]
    PostGradPassManager.configure = configure  # type: ignore[method-assign]
    _hook_stock_inductor()


def _hook_stock_inductor() -> None:
    """Where vLLM compiles with stock Inductor (no ``PostGradPassManager``), hand Inductor the pass directly.

    vLLM's CPU platform turns ``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE`` with ``backend="inductor"``: Dynamo
    then calls Inductor with ``inductor_compile_config`` as its options, and no pass manager exists. There
    the plugin puts the pass under ``post_grad_custom_post_pass`` itself, which is what the config route does.
    """
    from vllm.config import CompilationMode, VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_fluxcompile", False):
        return

    def post_init(self: Any) -> None:
        original(self)
        if not options.vllm:
            return
        cc = self.compilation_config
        stock = cc.mode in (CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE)
        if not stock or cc.backend not in ("", "inductor"):
            return  # VLLM_COMPILE: the pass manager adds the pass (see configure above)
        current = cc.inductor_compile_config.get(PASS_KEY)
        if current is None:
            cc.inductor_compile_config[PASS_KEY] = vllm_post_grad_pass
        elif not isinstance(current, FluxcompileVllmPass):
            log.warning(
                "fluxcompile: %s is taken by %r and vLLM compiles with stock Inductor here; not adding the pass",
                PASS_KEY,
                current,
            )

    post_init._fluxcompile = True  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = post_init  # type: ignore[method-assign]
