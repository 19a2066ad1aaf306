"""torchao's float8 training with tensor parallelism, compiled with backend="fluxcompile" on gloo ranks: every
scaled site fuses, and outputs and gradients match the same fp8 model compiled by plain Inductor (the same
quantization kernels) and, within fp8's rounding, eager.

gloo has no fp8 type: fluxcompile.testing.fp8_gloo moves fp8 gathers as bytes (the fused ops' references do the
same)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

torchao = pytest.importorskip("torchao", reason="torchao is a test dependency (tests/integration/torchao)")


def _model(recipe: str, sequence_parallel: bool, float8_styles: bool, bias: bool, dtype: torch.dtype):
    """torchtitan's feed-forward TP plan on a norm + SwiGLU block, converted to torchao's float8 training."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(64, 128, bias=bias)
            self.w3 = nn.Linear(64, 128, bias=bias)
            self.w2 = nn.Linear(128, 64, bias=False)

        def forward(self, x):
            return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(64)
            self.ffn = FeedForward()

        def forward(self, x):
            return self.ffn(self.norm(x))

    torch.manual_seed(0)
    model = Block().to(dtype)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layout = Shard(1) if sequence_parallel else Replicate()
    if float8_styles:
        from torchao.float8 import float8_tensor_parallel as f8tp

        Col, Row = f8tp.Float8ColwiseParallel, f8tp.Float8RowwiseParallel
        prepare = f8tp.PrepareFloat8ModuleInput(
            input_layouts=(layout,), desired_input_layouts=(Replicate(),), float8_dtype=torch.float8_e4m3fn
        )
    else:
        Col, Row = ColwiseParallel, RowwiseParallel
        prepare = PrepareModuleInput(input_layouts=(layout,), desired_input_layouts=(Replicate(),))
    plan = {"ffn": prepare, "ffn.w1": Col(), "ffn.w3": Col(), "ffn.w2": Row(output_layouts=layout)}
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    return model


def float8_tp(recipe: str, sequence_parallel: bool, float8_styles: bool, bias: bool, dtype_name: str = "float32") -> dict:
    import fluxcompile
    from fluxcompile.testing import fp8_gloo
    from fluxcompile.testing.numerics import rel_err

    fp8_gloo.install()
    dtype = getattr(torch, dtype_name)
    model = _model(recipe, sequence_parallel, float8_styles, bias, dtype)
    inductor, eager = copy.deepcopy(model), copy.deepcopy(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # fresh inputs every run, alike on every rank (each takes its shard)
    seq = 14 * world  # ragged: 14 rows a rank per batch row
    full = torch.randn(2, seq, 64, dtype=dtype)
    x = full.chunk(world, dim=1)[rank].contiguous() if sequence_parallel else full
    results = {}
    for name, m, backend in (("fluxcompile", model, "fluxcompile"), ("inductor", inductor, "inductor"), ("eager", eager, None)):
        xi = x.clone().requires_grad_(True)
        with torch._inductor.config.patch(fx_graph_cache=False), fluxcompile.collect_reports() as rep:
            fn = torch.compile(m, backend=backend) if backend else m
            out = fn(xi)
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
            out.pow(2).sum().backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in m.parameters()]
        results[name] = (out.detach(), xi.grad, grads, rep)
    rep = results["fluxcompile"][3]

    def error(a: str, b: str) -> float:
        (o1, x1, g1, _), (o2, x2, g2, _) = results[a], results[b]
        return max(rel_err(o1, o2), rel_err(x1, x2), *(rel_err(p, q) for p, q in zip(g1, g2)))

    errors = {"inductor": error("fluxcompile", "inductor"), "eager": error("fluxcompile", "eager")}
    errors["inductor_vs_eager"] = error("inductor", "eager")
    counts = {
        kind: {op: rep.count(op, kind) for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")}
        for kind in ("forward", "backward")
    }
    return {"errors": errors, "counts": counts, "report": str(rep)}


def _check_errors(r: dict, dtype: torch.dtype) -> None:
    """fluxcompile's results equal plain Inductor's for the same fp8 model (its quantization kernels are the same),
    and differ from eager's no more than Inductor's do (fp8 rounds Inductor's and eager's amax alike only in fp32)."""
    from fluxcompile.testing.numerics import TOLERANCE

    e = r["errors"]
    assert e["inductor"] <= TOLERANCE[dtype], e
    assert e["eager"] <= max(e["inductor_vs_eager"] * 1.05, TOLERANCE[dtype]), e


def _run(ranks, *args) -> dict:
    results = ranks(2).run(float8_tp, *args)
    assert results[0]["counts"] == results[1]["counts"], "ranks rewrote their graphs differently"
    return results[0]


# Bias and dtype paired rather than crossed: each of the four combinations compiles the same sites (the bias adds
# to the gathered matmuls' epilogue, the dtype changes only the unscaled tensors).
@pytest.mark.parametrize(("bias", "dtype_name"), [(False, "float32"), (True, "bfloat16")], ids=["nobias-float32", "bias-bfloat16"])
def test_tensorwise_float8_styles_sequence_parallel(ranks, bias, dtype_name):
    r = _run(ranks, "tensorwise", True, True, bias, dtype_name)
    # Forward: the fp8 gather (bytes, viewed back) into w1 and w3, w2's partial into the reduce-scatter; backward:
    # the fp8 gradient gathered into w2's input-gradient matmul, and w1's + w3's input gradients (a sum of two
    # scaled matmuls) reduce-scattered.
    assert r["counts"]["forward"] == {"all_gather_matmul": 1, "matmul_reduce_scatter": 1, "matmul_all_reduce": 0}, r["report"]
    assert r["counts"]["backward"] == {"all_gather_matmul": 1, "matmul_reduce_scatter": 1, "matmul_all_reduce": 0}, r["report"]
    assert "2 scaled matmul(s)" in r["report"] and "sum of 2 scaled matmul(s)" in r["report"], r["report"]
    _check_errors(r, getattr(torch, dtype_name))


def test_tensorwise_float8_styles_all_reduce(ranks):
    r = _run(ranks, "tensorwise", False, True, False, "float32")
    assert r["counts"]["forward"] == {"all_gather_matmul": 0, "matmul_reduce_scatter": 0, "matmul_all_reduce": 1}, r["report"]
    assert r["counts"]["backward"] == {"all_gather_matmul": 0, "matmul_reduce_scatter": 0, "matmul_all_reduce": 1}, r["report"]
    _check_errors(r, torch.float32)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_rowwise_plain_styles(ranks, sequence_parallel):
    """The row-wise recipe with PyTorch's plain TP styles: w2's forward (a row-wise scaled matmul with fast
    accumulation) fuses with its reduce-scatter or all-reduce. The gathered activations are quantized after the
    gather, and the backward's matmuls rescale their products after the matmul (torchao's row-wise matmuls without
    fast accumulation): both stay, and the report says why."""
    r = _run(ranks, "rowwise", sequence_parallel, False, False, "bfloat16")
    op = "matmul_reduce_scatter" if sequence_parallel else "matmul_all_reduce"
    assert r["counts"]["forward"][op] == 1, r["report"]
    if sequence_parallel:
        assert "quantized to fp8 after the gather" in r["report"], r["report"]
    _check_errors(r, torch.bfloat16)


def float8_llama_block(recipe: str) -> dict:
    """fluxcompile's TP Llama block (torchtitan's plan; torchao's float8 styles for tensor-wise) in float8 training,
    forward and backward, against the same model compiled by plain Inductor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import fluxcompile
    from fluxcompile.models.llama import Block, BlockArgs, parallelize_block
    from fluxcompile.testing import fp8_gloo
    from fluxcompile.testing.numerics import rel_err

    fp8_gloo.install()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = convert_to_float8_training(
        Block(BlockArgs(dim=64, n_heads=4, ffn_dim=96)), config=Float8LinearConfig.from_recipe_name(recipe)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(99)
    x = torch.randn(2, 12 * world, 64).chunk(world, dim=1)[rank].contiguous()
    out, grads, reports = {}, {}, {}
    for backend in ("fluxcompile", "inductor"):
        m = parallelize_block(copy.deepcopy(base), mesh, True, recipe == "tensorwise")
        xi = x.clone().requires_grad_(True)
        with torch._inductor.config.patch(fx_graph_cache=False), fluxcompile.collect_reports() as rep:
            y = torch.compile(m, backend=backend)(xi)
            y.pow(2).sum().backward()
        out[backend] = y.full_tensor() if hasattr(y, "full_tensor") else y
        grads[backend] = [xi.grad] + [p.grad.full_tensor() for p in m.parameters()]
        reports[backend] = rep
    err = max(rel_err(out["fluxcompile"], out["inductor"]), *map(rel_err, grads["fluxcompile"], grads["inductor"]))
    rep = reports["fluxcompile"]
    counts = {k: sum(rep.count(op, k) for op in ("all_gather_matmul", "matmul_reduce_scatter")) for k in ("forward", "backward")}
    return {"error": err, "counts": counts, "report": str(rep)}


def test_tensorwise_float8_llama_block(ranks):
    """Every TP site of the block (q/k/v and w1/w3 gathers, wo and w2 scatters, and their backward mirrors: the
    input-gradient sums of 3 and 2 scaled matmuls) fuses in fp8."""
    r = ranks(2).run(float8_llama_block, "tensorwise")[0]
    assert r["counts"] == {"forward": 4, "backward": 4}, r["report"]
    assert "3 scaled matmul(s)" in r["report"] and "sum of 3 scaled matmul(s)" in r["report"], r["report"]
    assert r["error"] <= 1e-5, r["error"]


def float8_prefill(recipe: str, float8_styles: bool) -> dict:
    """Forward only (no grad, as in prefill), sequence parallel, bf16: fluxcompile against plain Inductor and eager,
    with Inductor's intermediates rounded as eager rounds them."""
    import fluxcompile
    from fluxcompile.testing import fp8_gloo
    from fluxcompile.testing.numerics import rel_err

    fp8_gloo.install()
    model = _model(recipe, True, float8_styles, False, torch.bfloat16)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(4321)
    x = torch.randn(2, 14 * world, 64, dtype=torch.bfloat16).chunk(world, dim=1)[rank].contiguous()
    outs, reports = {}, {}
    for backend in ("fluxcompile", "inductor", "eager"):
        m = copy.deepcopy(model)
        patch = torch._inductor.config.patch(fx_graph_cache=False, emulate_precision_casts=True)
        with torch.no_grad(), patch, fluxcompile.collect_reports() as rep:
            y = torch.compile(m, backend=backend)(x) if backend != "eager" else m(x)
        outs[backend] = y.full_tensor() if hasattr(y, "full_tensor") else y
        reports[backend] = rep
    errors = {
        "inductor": rel_err(outs["fluxcompile"], outs["inductor"]),
        "eager": rel_err(outs["fluxcompile"], outs["eager"]),
        "inductor_vs_eager": rel_err(outs["inductor"], outs["eager"]),
    }
    return {"errors": errors, "report": str(reports["fluxcompile"])}


def _rowwise_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's row-wise float8 quantization as its graphs hold it: a power-of-two scale from each row's amax."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float64).clamp_min(1e-12)
    scale = torch.exp2(torch.floor(torch.log2((448.0 / amax).to(torch.float32))))
    return (x.to(torch.float32) * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def quantize_then_gather(seed: int) -> dict:
    """An all-gather (sequence dim) whose rows are quantized row-wise and multiplied by two fp8 weights, compiled
    with fluxcompile (quantization moved before the gather) and with Inductor, and run eagerly."""
    import warnings

    import torch.distributed._functional_collectives as funcol

    import fluxcompile
    from fluxcompile.testing import fp8_gloo

    fp8_gloo.install()
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_tensor: DTensor's form of the gather
    torch.manual_seed(seed)
    ws = [torch.randn(n, 64).to(torch.float8_e4m3fn) for n in (96, 48)]  # [N, K]: nn.Linear's layout
    sws = [torch.rand(1, n) + 0.5 for n in (96, 48)]
    torch.manual_seed(seed + 1 + dist.get_rank())
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)  # ragged: 7 rows a rank per sequence

    def layer(x):
        q, s = _rowwise_quantize(funcol.all_gather_tensor(x, 1, dist.group.WORLD))
        a, sa = q.reshape(-1, 64), (1.0 / s).reshape(-1, 1)
        return [torch._scaled_mm(a, w.t(), sa, 1.0 / sw, out_dtype=torch.bfloat16) for w, sw in zip(ws, sws)]

    outs = {}
    for backend in ("fluxcompile", "inductor", None):
        torch._dynamo.reset()
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), fluxcompile.collect_reports() as rep:
            outs[str(backend)] = (torch.compile(layer, backend=backend) if backend else layer)(x)
        if backend == "fluxcompile":
            report = str(rep)
    equal = {k: all(torch.equal(a, b) for a, b in zip(outs["fluxcompile"], outs[k])) for k in ("inductor", "None")}
    return {"equal": equal, "report": report}


def test_quantize_then_gather_equals_gather_then_quantize(ranks):
    """Row-wise quantization is row-local: quantizing each rank's rows and gathering the fp8 rows with their scales
    gives bit for bit what gathering bf16 rows and quantizing them gives."""
    for seed in (0, 1):
        r = ranks(2).run(quantize_then_gather, seed)[0]
        assert "row-wise fp8 quantization moved before the gather" in r["report"], r["report"]
        assert r["equal"] == {"inductor": True, "None": True}, r


def test_rowwise_quantization_moves_before_the_gather(ranks):
    """In the block (prefill: nothing else reads the gathered bf16 rows) both scaled matmuls take the moved
    quantization's fp8 rows. With Inductor rounding its intermediates as eager does (``emulate_precision_casts``:
    otherwise it keeps some bf16 values of the fused kernels in fp32, differently around a fused op than around its
    own matmuls, and fp8 quantization turns that into whole fp8 steps), the block's output equals Inductor's and
    eager's bit for bit."""
    r = ranks(2).run(float8_prefill, "rowwise", False)[0]
    assert "row-wise fp8 quantization moved before the gather" in r["report"], r["report"]
    assert "2 scaled matmul(s)" in r["report"], r["report"]
    e = r["errors"]
    assert e == {"inductor": 0.0, "eager": 0.0, "inductor_vs_eager": 0.0}, e


def float8_llama_prefill(recipe: str) -> dict:
    """fluxcompile's TP Llama block in float8 (plain TP styles for row-wise, as torchtitan), forward only, SP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import fluxcompile
    from fluxcompile.models.llama import Block, BlockArgs, parallelize_block
    from fluxcompile.testing import fp8_gloo
    from fluxcompile.testing.numerics import rel_err

    fp8_gloo.install()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = convert_to_float8_training(
        Block(BlockArgs(dim=64, n_heads=4, ffn_dim=96)).to(torch.bfloat16),
        config=Float8LinearConfig.from_recipe_name(recipe),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    x = torch.randn(1, 12 * world, 64, dtype=torch.bfloat16).chunk(world, dim=1)[rank].contiguous()
    outs, reports = {}, {}
    for backend in ("fluxcompile", "inductor"):
        m = parallelize_block(copy.deepcopy(base), mesh, True, recipe == "tensorwise")
        patch = torch._inductor.config.patch(fx_graph_cache=False, emulate_precision_casts=True)
        with torch.no_grad(), patch, fluxcompile.collect_reports() as rep:
            y = torch.compile(m, backend=backend)(x)
        outs[backend] = y.full_tensor() if hasattr(y, "full_tensor") else y
        reports[backend] = rep
    rep = reports["fluxcompile"]
    return {"error": rel_err(outs["fluxcompile"], outs["inductor"]), "report": str(rep),
            "counts": {op: rep.count(op) for op in ("all_gather_matmul", "matmul_reduce_scatter")}}  # fmt: skip


def test_rowwise_llama_block_prefill_gathers_fp8(ranks):
    """The block's gathers (q/k/v, w1/w3) flatten the gathered rows before quantizing them: the moved quantization
    gathers the flattened fp8 rows; every TP site of the prefill fuses."""
    r = ranks(2).run(float8_llama_prefill, "rowwise")[0]
    assert r["counts"] == {"all_gather_matmul": 2, "matmul_reduce_scatter": 2}, r["report"]
    assert r["report"].count("row-wise fp8 quantization moved before the gather") == 2, r["report"]
    assert r["error"] <= 1e-2, r["error"]
