"""The ``torch.compile`` backend: Inductor with fluxcompile's rewrite pass; also ``enable()``/``explain()``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .fx_passes import FluxcompilePass
from .fx_passes import report as _report


def _pass_over(existing: Any) -> FluxcompilePass:
    """Our pass, chained after whatever pre-pass(es) the user already installed (never stacked twice)."""
    if isinstance(existing, FluxcompilePass):
        return existing
    if isinstance(existing, (list, tuple)):
        ours = [p for p in existing if isinstance(p, FluxcompilePass)]
        if ours:
            return ours[0]
    return FluxcompilePass(previous=existing)


def fluxcompile_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    """``torch.compile(model, backend="fluxcompile", mode=..., options=...)``: Inductor plus the rewrite pass.

    ``mode`` and ``options`` mean what they mean for ``backend="inductor"`` (Inductor config patches).
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    _apply_symm_mem_backend()
    patches = {**(list_mode_options(mode) if mode else {}), **(options or {})}
    patches["post_grad_custom_pre_pass"] = _pass_over(
        patches.get("post_grad_custom_pre_pass", inductor_config.post_grad_custom_pre_pass)
    )
    # compile_fx keeps the patches for the backward graph, compiled lazily at the first backward.
    return compile_fx(gm, example_inputs, config_patches=patches)


def _apply_symm_mem_backend() -> None:
    """The configured symmetric-memory backend (symm_mem/backend.py), set before anything compiled here allocates:
    a no-op with the default backend or without CUDA."""
    from .config import config
    from .symm_mem import backend as symm_backend

    if config.symm_mem_backend != "cuda" and torch.cuda.is_available():
        symm_backend.apply()


_saved: list[Any] = []


def enable() -> None:
    """Install the rewrite pass into plain Inductor, for frameworks that call ``torch.compile`` themselves."""
    from torch._inductor import config as inductor_config

    current = inductor_config.post_grad_custom_pre_pass
    if isinstance(current, FluxcompilePass):
        return
    _saved.append(current)
    inductor_config.post_grad_custom_pre_pass = _pass_over(current)


def disable() -> None:
    """Undo :func:`enable`."""
    from torch._inductor import config as inductor_config

    if _saved and isinstance(inductor_config.post_grad_custom_pre_pass, FluxcompilePass):
        inductor_config.post_grad_custom_pre_pass = _saved.pop()


def explain(model: Callable, *inputs: Any, backward: bool | None = None, **kwargs: Any) -> _report.Report:
    """Compile ``model`` with fluxcompile, run it once on ``inputs`` and return the rewrite report.

    Resets Dynamo (as ``torch._dynamo.explain`` does) and turns the compile caches off for this call, so
    every graph is really rewritten. ``backward`` (default: when an output requires grad) also compiles and
    runs the backward graph, with ``torch.autograd.grad`` so no ``.grad`` is touched.
    """
    torch._dynamo.reset()
    with (
        _report.collect() as rep,
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        out = torch.compile(model, backend=fluxcompile_backend)(*inputs, **kwargs)
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if backward is None:
            backward = bool(outs)
        if backward and outs:
            wrt = [t for t in (*_parameters(model), *inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
    return rep


def _parameters(model: Any) -> list[torch.Tensor]:
    return list(model.parameters()) if isinstance(model, torch.nn.Module) else []
