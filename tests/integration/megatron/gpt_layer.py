"""Megatron-core's whole GPT transformer layer compiled with fluxcompile, against Megatron's own eager code.

    python -m torch.distributed.run --nproc-per-node 2 tests/integration/megatron/gpt_layer.py              # GPUs, NCCL
    python -m torch.distributed.run --nproc-per-node 2 tests/integration/megatron/gpt_layer.py --device cpu # gloo

One ``TransformerLayer`` of ``get_gpt_layer_local_spec()`` (no Transformer Engine: Megatron's
``ColumnParallelLinear`` / ``RowParallelLinear``, ``DotProductAttention``, torch's norms marked sequence-parallel,
``megatron_harness.SequenceParallelTorchNorm``), sequence parallel unless ``--no-sequence-parallel``, TP = the world
size. Every rank runs forward and backward with Megatron's own functions (the reference), then eagerly with
``fluxcompile.integrations.megatron.enable()``, then ``torch.compile(layer, backend="fluxcompile")``, and compares
the output and every gradient (input and parameters) with the reference. Rank 0 prints the rewrite report. The
process exits with 1 when a value differs, a graph breaks, or a collective is not matched: kept by the matcher.
On GPUs a matched site may keep its original ops by the compile-time choice (the unfused collective + matmul won
the autotuning); ``--choose never`` rewrites every matched site.

On CPU (``--device cpu``) ``torch.cuda.current_device()`` answers ``"cpu"`` (``megatron_harness.megatron_on_cpu``:
Megatron allocates its collective buffers and the core attention's score buffer there), and the layer needs
sequence parallelism (without it the core attention forks Megatron's CUDA RNG tracker).

The GPU machine (Python 3.12, no network) gets megatron-core as wheels in ``.whl/``, which ``scripts/gpu-check``
installs into /tmp/site; download them on a machine with network:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \\
      -d .whl megatron-core==0.16.1

(its other imports, numpy and packaging, are on that machine already).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_harness as harness

import fluxcompile
from fluxcompile.testing.numerics import TOLERANCE

SIZES = {"cuda": {"hidden": 1024, "heads": 16, "ffn": 4096, "seq": 2048, "batch": 2}, "cpu": harness.SIZES}
# Kept by the compile-time choice (fx_passes/decide.py), not by the matcher: the site was matched.
CHOSEN = ("autotuned at compile time", "no fused implementation of")


class Layer(nn.Module):
    """The transformer layer on ``x`` with a causal mask (Megatron builds its default mask on CUDA only)."""

    def __init__(self, layer: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.layer(x, attention_mask=self.mask)
        return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    for name in ("hidden", "heads", "ffn", "seq", "batch"):
        p.add_argument(
            f"--{name}", type=int, help=f"default: {SIZES['cuda'][name]} on GPUs, {SIZES['cpu'][name]} on CPU"
        )
    p.add_argument("--choose", choices=("cuda", "always", "never"), help="fluxcompile.config.choose_at_compile")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def expected(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """The layer's collectives per graph: each of its two column/row pairs fuses both of its collectives."""
    if sequence_parallel:
        pair = {"all_gather_matmul": 2, "matmul_reduce_scatter": 2}
        return {"forward": pair, "backward": pair}
    return {"forward": {"matmul_all_reduce": 2}, "backward": {"matmul_all_reduce": 2}}


def run(a: argparse.Namespace) -> tuple[list[str], str]:
    """Build, run and compare on this rank: the failures (empty: passed) and what to print."""
    warnings.filterwarnings("ignore", module="megatron")
    if a.device == "cpu" and not a.sequence_parallel:
        raise SystemExit(
            "--device cpu needs sequence parallelism: without it the core attention forks Megatron's CUDA RNG"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("megatron gpt layer: needs 2+ ranks (tensor parallelism over all of them)")
    sizes = {k: getattr(a, k) or v for k, v in SIZES[a.device].items()}
    device = torch.device(a.device, torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype)
    harness.setup_parallel_state()
    cfg = harness.transformer_config(
        a.sequence_parallel,
        hidden_size=sizes["hidden"],
        ffn_hidden_size=sizes["ffn"],
        num_attention_heads=sizes["heads"],
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    if a.device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(a.seed)
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(a.seed)
    s, b, h = sizes["seq"], sizes["batch"], sizes["hidden"]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    model = Layer(build_module(harness.gpt_layer_spec(), config=cfg, layer_number=1).to(device), mask)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    torch.manual_seed(a.seed + 1)
    x = torch.randn(s, b, h, device=device, dtype=dtype)
    grad = torch.randn(s, b, h, device=device, dtype=dtype)
    if a.sequence_parallel:
        x, grad = x.chunk(world)[rank].contiguous(), grad.chunk(world)[rank].contiguous()

    on_cpu = harness.megatron_on_cpu() if a.device == "cpu" else contextlib.nullcontext()
    choose = fluxcompile.config.patch(choose_at_compile=a.choose) if a.choose else contextlib.nullcontext()
    with on_cpu, choose:  # on CPU the core attention's score buffer needs the device answer in every run
        eager, got, rep = harness.three_ways(model, params, x, grad)
    return report(a, rep, eager, got, TOLERANCE[dtype])


def report(a: argparse.Namespace, rep: Any, eager: dict, got: dict, tol: float) -> tuple[list[str], str]:
    """The failures, and what fused and how close the results are."""
    failures = []
    graphs = harness.graphs_of(rep)
    if graphs != {"forward": 1, "backward": 1}:
        failures.append(f"graph breaks: {graphs}")
    sites = harness.sites_of(rep)
    unmatched = [s for s in sites if s.fused_op is None and not s.detail.startswith(CHOSEN)]
    failures += [f"{s.graph} {s.collective} not matched: {s.detail}" for s in unmatched]
    matched: dict[str, dict[str, int]] = {}
    for s in sites:
        if s not in unmatched:
            op = s.fused_op or _op_of(s)
            matched.setdefault(s.graph, {}).setdefault(op, 0)
            matched[s.graph][op] += 1
    if matched != expected(a.sequence_parallel):
        failures.append(f"matched sites {matched}, expected {expected(a.sequence_parallel)}")
    sp = "sequence parallel" if a.sequence_parallel else "no sequence parallelism"
    lines = [f"== megatron gpt layer: TP={dist.get_world_size()}, {sp}, {a.dtype}, {a.device}", rep.format()]
    for what, errors in (("eager with enable()", eager), ("compiled", got)):
        failures += [f"{what}: {k} rel err {v:.2e} > {tol:g}" for k, v in errors.items() if not v <= tol]
        lines.append(f"{what} vs Megatron's own code: max rel err {max(errors.values()):.2e} (tolerance {tol:g})")
    fused = sum(1 for s in sites if s.fused_op)
    chosen = sum(1 for s in sites if s.fused_op is None and s not in unmatched)
    lines.append(
        f"sites: {len(sites)} collectives, {fused} fused, {chosen} kept by the compile-time choice, "
        f"{len(unmatched)} not matched"
    )
    return failures, "\n".join(lines)


def _op_of(site: harness.Site) -> str:
    """The fused op a site kept by the compile-time choice matched (its decision names it)."""
    for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        if op in site.detail:
            return op
    return site.collective


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    try:
        failures, text = run(a)
        if dist.get_rank() == 0:
            print(text, flush=True)
        # Every rank's verdict, so all exit alike.
        flag = torch.tensor([len(failures)], device="cuda" if a.device == "cuda" else "cpu")
        dist.all_reduce(flag)
        for f in failures:
            print(f"rank {dist.get_rank()}: FAIL {f}", flush=True)
        if dist.get_rank() == 0:
            print("megatron gpt layer: " + ("FAIL" if flag.item() else "PASS"), flush=True)
        return 1 if flag.item() else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
