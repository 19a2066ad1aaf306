"""A vLLM harness: small models made of vLLM's real parallel layers, compiled by vLLM with fluxcompile on.

Runs inside a rank process that already has the default (gloo) process group (``fluxcompile.testing
.RankPool``). :func:`check` sets up vLLM's distributed state once per process (``init_distributed_environment``
reuses the existing default group, ``initialize_model_parallel`` makes the ``tp`` group), builds a decoder
layer from ``RMSNorm``, ``QKVParallelLinear``, ``RowParallelLinear``, ``MergedColumnParallelLinear`` and
``SiluAndMul`` under ``@support_torch_compile``, compiles it through vLLM's compilation config with
fluxcompile's pass added by the config route (``inductor_passes``) or the plugin route
(``FLUXCOMPILE_VLLM=1`` + ``load_general_plugins()``), runs it, and compares with the same weights run
uncompiled (``CompilationMode.NONE``).

What vLLM does on CPU, and what the harness changes to match CUDA:

* Collectives: ``CpuPlatform.use_custom_op_collectives()`` is False, so vLLM would call its communicator
  directly; the harness opts the CPU platform in (as ``CudaPlatform`` is), so the traced graphs hold
  ``torch.ops.vllm.all_reduce/all_gather/reduce_scatter`` as they do on CUDA.
* GEMMs: on CPU the unquantized linear method may pick oneDNN/packed custom ops; the harness uses
  ``F.linear`` (``aten.mm`` in the graph), as the CUDA path does.
* Compilation: vLLM's CPU platform itself turns ``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE`` with stock
  Inductor (``CpuPlatform.check_and_update_config``), so there is no ``VllmBackend``/``PostGradPassManager``
  on CPU. ``vllm_backend=False`` keeps what vLLM does: the pass reaches Inductor as
  ``post_grad_custom_post_pass`` of ``inductor_compile_config`` (the config route directly, the plugin
  route through its ``VllmConfig`` hook). ``vllm_backend=True`` restores ``VLLM_COMPILE`` after the
  platform's change (with vLLM's CUDA-only fusion passes off and ``compile_sizes=[]``), so the layer is
  compiled by ``VllmBackend`` and the pass runs inside its ``PostGradPassManager``, as on CUDA (the
  config route through ``PostGradPassManager.add``, the plugin route through its ``configure`` hook).

vLLM 0.32 has no sequence-parallel compilation pass, so the sequence-parallel variant writes the layout
by hand with vLLM's own collective API, as vLLM's models do (``RowParallelLinear(reduce_results=False)``
then ``tensor_model_parallel_reduce_scatter(dim=0)``, ``tensor_model_parallel_all_gather(dim=0)`` before
the column-parallel layers).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fluxcompile

EXPECTED_VLLM = "0.32"
REQUIRED = {
    "vllm.distributed.parallel_state": [
        "init_distributed_environment",
        "initialize_model_parallel",
        "get_tp_group",
        "_groups",
    ],
    "vllm.distributed.communication_op": ["tensor_model_parallel_all_gather", "tensor_model_parallel_reduce_scatter"],
    "vllm.model_executor.layers.linear": ["QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear"],
    "vllm.model_executor.layers.layernorm": ["RMSNorm"],
    "vllm.model_executor.layers.activation": ["SiluAndMul"],
    "vllm.config": ["VllmConfig", "CompilationConfig", "CompilationMode", "ParallelConfig", "set_current_vllm_config"],
    "vllm.compilation.decorators": ["support_torch_compile"],
    "vllm.compilation.passes.pass_manager": ["PostGradPassManager"],
    "vllm.compilation.passes.inductor_pass": ["InductorPass"],
    "vllm.plugins": ["load_general_plugins"],
    "vllm.platforms": ["current_platform"],
}


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"


def check_layout() -> str:
    """vLLM's version; raises naming the version and every missing module/name if the layout differs."""
    version = vllm_version()
    missing = []
    for module, names in REQUIRED.items():
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            missing.append(f"{module} ({type(e).__name__}: {e})")
            continue
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(
            f"fluxcompile's vLLM harness was written against vLLM {EXPECTED_VLLM}; vLLM {version} lacks: "
            + "; ".join(missing)
        )
    return version


_READY = False


def setup_vllm_distributed() -> None:
    """vLLM's distributed init on this rank (once per process), with collectives traced as custom ops."""
    global _READY
    if _READY:
        return
    from vllm.distributed import parallel_state as ps
    from vllm.platforms import current_platform

    # The CUDA platform opts in; the CPU platform does not. Opt in the same way before the groups exist.
    type(current_platform).use_custom_op_collectives = classmethod(lambda cls: True)
    rank, world = dist.get_rank(), dist.get_world_size()
    from vllm.config import set_current_vllm_config

    # vLLM's CPU worker names its shared-memory communicator group by this before the groups exist; its
    # CpuCommunicator reads it whenever vLLM's compiled CPU ops are loadable (KeyError without it).
    # One name per pool of ranks: rank 0's, sent to the others.
    ident = [f"fluxcompile-{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(ident, src=0)
    os.environ.setdefault("VLLM_DIST_IDENT", ident[0])
    with set_current_vllm_config(vllm_config("eager", "none")):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            # The default group exists already, so vLLM builds its groups on it and never rendezvouses.
            distributed_init_method="env://",
            local_rank=rank,
            backend="gloo",
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=world, backend="gloo")
    tp = ps.get_tp_group()
    if not tp.use_custom_op_call:
        raise RuntimeError("vLLM's tp group does not trace its collectives as torch.ops.vllm.* custom ops")
    _READY = True


def make_block_cls() -> type:
    from vllm.compilation.decorators import support_torch_compile
    from vllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_reduce_scatter
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    @support_torch_compile(dynamic_arg_dims={"x": 0})
    class DecoderLayer(nn.Module):
        """A decoder layer of vLLM layers; the attention is a token-local stand-in (q * sigmoid(k) + v)."""

        def __init__(self, *, vllm_config: Any, prefix: str = "", dims: tuple = (64, 4, 96, False)) -> None:
            super().__init__()
            hidden, heads, ffn, self.sp = dims
            head_dim = hidden // heads
            self.norm1 = RMSNorm(hidden, eps=1e-6)
            self.qkv = QKVParallelLinear(hidden, head_dim, heads, heads, bias=False, prefix=f"{prefix}.qkv")
            self.o = RowParallelLinear(hidden, hidden, bias=False, reduce_results=not self.sp, prefix=f"{prefix}.o")
            self.norm2 = RMSNorm(hidden, eps=1e-6)
            self.gate_up = MergedColumnParallelLinear(hidden, [ffn, ffn], bias=False, prefix=f"{prefix}.gate_up")
            self.act = SiluAndMul()
            self.down = RowParallelLinear(ffn, hidden, bias=False, reduce_results=not self.sp, prefix=f"{prefix}.down")
            self.local = self.qkv.num_heads * head_dim

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # x: [tokens, hidden]; with sequence parallelism, this rank's tokens only.
            h = self.norm1(x)
            if self.sp:
                h = tensor_model_parallel_all_gather(h, dim=0)
            qkv, _ = self.qkv(h)
            q, k, v = qkv.split([self.local] * 3, dim=-1)
            a, _ = self.o(q * torch.sigmoid(k) + v)
            if self.sp:
                a = tensor_model_parallel_reduce_scatter(a, dim=0)
            x = x + a
            h = self.norm2(x)
            if self.sp:
                h = tensor_model_parallel_all_gather(h, dim=0)
            g, _ = self.gate_up(h)
            y, _ = self.down(self.act(g))
            if self.sp:
                y = tensor_model_parallel_reduce_scatter(y, dim=0)
            return x + y

    return DecoderLayer


_BLOCK_CLS: type | None = None


def use_aten_linear(model: nn.Module) -> None:
    """Run vLLM's unquantized linear layers through ``F.linear``, as on CUDA.

    On CPU, ``UnquantizedLinearMethod.process_weights_after_loading`` picks a GEMM (oneDNN/packed custom
    ops when the CPU has the features, ``F.linear`` otherwise) and stores it as ``layer.cpu_linear``; on
    CUDA the same layers trace to ``aten.mm``, which is what fluxcompile fuses. The harness sets the
    ``F.linear`` choice explicitly so the CPU graphs hold the same matmuls as the CUDA ones.
    """
    from vllm.model_executor.layers.linear import LinearBase

    for m in model.modules():
        if isinstance(m, LinearBase):
            m.cpu_linear = torch.nn.functional.linear


@dataclasses.dataclass
class Result:
    vllm_version: str
    route: str
    max_rel_err: float
    counts: dict[str, int]  # fused op -> how many
    kept: list[str]  # report lines of collectives left alone
    entries: list[tuple[str, str, str | None]]  # (collective, group, fused op) in graph order
    graphs: list[str]  # op sequence of each graph right after the rewrite
    manager_passes: list[list[str]]  # the PostGradPassManager's passes at each run (empty: stock Inductor)
    report: str


def vllm_config(mode: str, route: str, vllm_backend: bool = False) -> Any:
    from vllm.config import CompilationConfig, CompilationMode, ParallelConfig, VllmConfig

    kw: dict[str, Any] = {}
    if mode == "compile":
        kw = dict(
            mode=CompilationMode.VLLM_COMPILE,
            backend="inductor",
            cudagraph_mode="NONE",
            splitting_ops=[],
            # Every check compiles (and so runs the pass): no reuse of an earlier check's Inductor graph.
            inductor_compile_config={"fx_graph_cache": False, "fx_graph_remote_cache": False},
        )
        if route == "config":
            from fluxcompile.integrations.vllm import QUALNAME

            kw["inductor_passes"] = {"post_grad_custom_post_pass": QUALNAME}
    else:
        kw = dict(mode=CompilationMode.NONE)
    cfg = VllmConfig(
        compilation_config=CompilationConfig(**kw),
        parallel_config=ParallelConfig(tensor_parallel_size=dist.get_world_size()),
    )
    if mode == "compile" and vllm_backend:
        # Undo the CPU platform's switch to DYNAMO_TRACE_ONCE: compile through VllmBackend and its
        # PostGradPassManager, as vLLM does on CUDA.
        cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
        cfg.compilation_config.backend = "inductor"
        if route == "plugin":
            # The plugin's stock-Inductor hook saw the CPU platform's DYNAMO_TRACE_ONCE and handed the pass to
            # Inductor directly; on CUDA it would not have. Undo that, so the pass manager hook is what adds it.
            icc = cfg.compilation_config.inductor_compile_config
            if type(icc.get("post_grad_custom_post_pass")).__name__ == "FluxcompileVllmPass":
                del icc["post_grad_custom_post_pass"]
        if cfg.compilation_config.compile_sizes is None:
            cfg.compilation_config.compile_sizes = []
        # vLLM's own fusion passes are CUDA/ROCm kernels (their classes are not even imported on CPU).
        pc = cfg.compilation_config.pass_config
        for f in dataclasses.fields(pc):
            if (f.name.startswith("fuse_") or f.name.startswith("enable_")) and getattr(pc, f.name) is True:
                setattr(pc, f.name, False)
    return cfg


def check(route: str, sequence_parallel: bool, tokens: int = 32, vllm_backend: bool = False) -> Result:
    """Compile the layer through vLLM with fluxcompile on by ``route`` ('config' or 'plugin') and check it."""
    version = check_layout()
    setup_vllm_distributed()
    _record_rewritten_graphs()

    fluxcompile.config.vllm = route == "plugin"
    if route == "plugin":
        from importlib.metadata import entry_points

        from vllm.plugins import load_general_plugins

        if not any(ep.value.startswith("fluxcompile.") for ep in entry_points(group="vllm.general_plugins")):
            raise RuntimeError("fluxcompile's vllm.general_plugins entry point is not installed (pip install -e .)")
        load_general_plugins()  # what vLLM's engine and workers call at startup
        from vllm.compilation.passes.pass_manager import PostGradPassManager

        if not getattr(PostGradPassManager.configure, "_fluxcompile", False):
            raise RuntimeError("vLLM loaded its general plugins but fluxcompile's register() did not hook the passes")
    # Every check compiles and so runs the pass: fresh vLLM and Inductor caches, no AOTAutograd cache (a hit
    # there returns the graph an earlier check rewrote, correctly, but without running the pass again).
    cache_root = tempfile.mkdtemp(prefix="fluxcompile-vllm-")
    saved = {k: os.environ.get(k) for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_DISABLE_COMPILE_CACHE")}
    os.environ.update(
        VLLM_CACHE_ROOT=cache_root,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_root, "inductor"),
        VLLM_DISABLE_COMPILE_CACHE="1",
    )
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return _check(version, route, sequence_parallel, tokens, vllm_backend)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(cache_root, ignore_errors=True)


def _check(version: str, route: str, sequence_parallel: bool, tokens: int, vllm_backend: bool) -> Result:
    global _BLOCK_CLS
    from vllm.config import set_current_vllm_config

    import fluxcompile

    if _BLOCK_CLS is None:
        _BLOCK_CLS = make_block_cls()
    dims = (64, 4, 96, sequence_parallel)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = torch.randn(tokens, dims[0])
    x = full.chunk(world)[rank].contiguous() if sequence_parallel else full

    eager_cfg = vllm_config("eager", route)
    with set_current_vllm_config(eager_cfg):
        eager = _BLOCK_CLS(vllm_config=eager_cfg, prefix="eager", dims=dims)
    torch.manual_seed(1 + rank)  # this rank's weight shards
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * 0.1 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    compile_cfg = vllm_config("compile", route, vllm_backend)
    with set_current_vllm_config(compile_cfg):
        compiled = _BLOCK_CLS(vllm_config=compile_cfg, prefix="compiled", dims=dims)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        use_aten_linear(model)

    with torch.inference_mode():
        with set_current_vllm_config(eager_cfg):
            want = eager(x)
        _GRAPHS.clear()
        _MANAGER_PASSES.clear()
        with fluxcompile.collect_reports() as rep, set_current_vllm_config(compile_cfg):
            got = compiled(x)
            got = compiled(x)  # a second call runs the compiled graph
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    entries = rep.entries()
    counts: dict[str, int] = {}
    for e in entries:
        if e.fused:
            counts[e.fused_op] = counts.get(e.fused_op, 0) + 1
    fused_targets = list(_GRAPHS)
    manager_passes = [list(p) for p in _MANAGER_PASSES]
    return Result(
        version,
        route,
        err,
        counts,
        [e.line() for e in entries if not e.fused],
        [(e.collective, e.group_name, e.fused_op) for e in entries],
        fused_targets,
        manager_passes,
        rep.format(),
    )


_GRAPHS: list[str] = []  # the op sequence of every graph right after fluxcompile's rewrite
_MANAGER_PASSES: list[list[str]] = []  # the passes of each PostGradPassManager run (VllmBackend only)


def _record_rewritten_graphs() -> None:
    """Record each rewritten graph's op sequence (the fused graph both routes must agree on)."""
    from fluxcompile.fx_passes import graph_pass

    rewrite = graph_pass.rewrite_graph
    if getattr(rewrite, "_harness", False):
        return

    def recording(graph: Any, *args: Any, **kwargs: Any) -> Any:
        report = rewrite(graph, *args, **kwargs)
        # A fused op told not to return its first result (all_gather_matmul's return_A) is marked "[no A]".
        ops = [
            str(n.target) + (" [no A]" if n.kwargs.get("return_A", True) is False else "")
            for n in graph.nodes
            if n.op == "call_function"
        ]
        _GRAPHS.append(" ".join(ops))
        return report

    recording._harness = True  # type: ignore[attr-defined]
    graph_pass.rewrite_graph = recording

    from vllm.compilation.passes.pass_manager import PostGradPassManager

    run_passes = PostGradPassManager.__call__

    def recording_manager(self: Any, graph: Any) -> None:
        _MANAGER_PASSES.append([type(p).__name__ for p in self.passes])
        run_passes(self, graph)

    PostGradPassManager.__call__ = recording_manager
