"""The collective schedule language (after GC3, arXiv 2201.11840): write a collective as chunk
routes, check it symbolically, compile it to per-rank threadblock instructions (a ``Plan``), and run
the plan: on CPU tensors of every rank (``cpu_executor``, a simulation for tests) or on this rank's
CUDA tensor over a real process group (``gpu_executor``: one persistent Triton kernel per rank that
interprets the plan's int32 tables, ``encoding``, over symmetric-memory mailboxes and epoch flags;
``emulator`` is a NumPy model of that kernel for CPU tests). ``all_reduce``, ``all_gather``,
``reduce_scatter`` and ``all_to_all`` run library programs by name. The GPU path backs the ``schedules:*``
choices of matmul_all_reduce and all_reduce_rmsnorm (lowerings/matmul_all_reduce/schedules.py), which run
while family ``schedules`` is in ``config.implementations`` (the default); tests/gpu/test_schedules_gpu.py
checks it on GPUs."""

from __future__ import annotations

import torch

from . import library
from .checker import CheckError, DeadlockError, check_deadlock, check_program
from .collectives import all_gather, all_reduce, all_to_all, library_plan, reduce_scatter
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
    "all_gather",
    "all_reduce",
    "all_to_all",
    "check_deadlock",
    "check_program",
    "chunk",
    "compile_program",
    "execute",
    "library",
    "library_plan",
    "reduce_scatter",
    "run",
]


def run(
    program: Program | Plan | str,
    tensors: list[torch.Tensor] | torch.Tensor,
    group: object = None,
    instances: int = 1,
    **kwargs: object,
) -> list[torch.Tensor] | torch.Tensor:
    """Run a collective program.

    * ``tensors`` a list of every rank's CPU tensors: compile (if needed), check for deadlock and simulate
      all ranks on the CPU; returns every rank's output. Chunks are slices along dim 0.
    * ``tensors`` this rank's CUDA tensor: run on the GPU over ``group`` (a ProcessGroup, its name, or
      None for the default group), every rank of which calls it alike; returns this rank's output
      (``kwargs``: ``out``, ``slices``, ``max_spin``; see ``gpu_executor.run_plan``).

    ``program`` may also be a library name (``"one_shot_all_reduce"``)."""
    if isinstance(tensors, torch.Tensor):
        if not tensors.is_cuda:
            raise ValueError(
                "fluxcompile.schedules.run: a single tensor runs on the GPU and must be a CUDA tensor; "
                "pass a list of every rank's CPU tensors to simulate all ranks"
            )
        from ..symm_mem.groups import group_size
        from .collectives import resolve
        from .gpu_executor import group_name_of, run_plan

        size = group_size(group_name_of(group))
        return run_plan(resolve(program, None, size, instances), tensors, group, **kwargs)
    if group is not None or any(t.is_cuda for t in tensors):
        raise ValueError(
            "fluxcompile.schedules.run: the CPU simulation takes a list of every rank's CPU tensors and no "
            "group; on GPUs pass this rank's CUDA tensor and the process group"
        )
    if isinstance(program, str):
        from .collectives import library_plan

        program = library_plan(program, len(tensors), instances)
    plan = program if isinstance(program, Plan) else compile_program(program, instances=instances)
    check_deadlock(plan)
    return execute(plan, tensors)
