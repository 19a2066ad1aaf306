"""The collective schedule language (after GC3, arXiv 2201.11840): write a collective as chunk
routes, check it symbolically, compile it to per-rank threadblock instructions (a ``Plan``), and
run the plan on CPU tensors. A GPU executor over real process groups is a later step."""

from __future__ import annotations

import torch

from . import library
from .checker import CheckError, DeadlockError, check_deadlock, check_program
from .compiler import compile_program
from .cpu_executor import execute
from .plan import Instr, Plan, RankPlan, Threadblock
from .program import INPUT, OUTPUT, SCRATCH, ChunkRef, Collective, Program, ProgramError, chunk

__all__ = [
    "INPUT",
    "OUTPUT",
    "SCRATCH",
    "CheckError",
    "ChunkRef",
    "Collective",
    "DeadlockError",
    "Instr",
    "Plan",
    "Program",
    "ProgramError",
    "RankPlan",
    "Threadblock",
    "check_deadlock",
    "check_program",
    "chunk",
    "compile_program",
    "execute",
    "library",
    "run",
]


def run(
    program: Program | Plan, tensors: list[torch.Tensor], group: object = None, instances: int = 1
) -> list[torch.Tensor]:
    """Compile (if needed), check for deadlock and run on the CPU simulator: ``tensors`` holds
    every rank's input; returns every rank's output. Chunks are slices along dim 0."""
    if group is not None or isinstance(tensors, torch.Tensor) or any(t.is_cuda for t in tensors):
        raise NotImplementedError(
            "fluxcompile.schedules.run(program, tensor, group) on CUDA tensors with a real process group "
            "needs the GPU executor, which is not written yet; pass a list of every rank's CPU tensors "
            "to simulate all ranks"
        )
    plan = program if isinstance(program, Plan) else compile_program(program, instances=instances)
    check_deadlock(plan)
    return execute(plan, tensors)
