"""Collectives from the library as plain ops on CUDA tensors: ``all_reduce(x, group, program="one_shot")``.

A program is named by its library entry without the collective's suffix (``"one_shot"``, ``"ring"``,
``"direct"``, ``"two_step"``, ``"hierarchical:2x4"``), by a full library name, or given as a ``Program`` /
``Plan``. Named plans are compiled once per (name, ranks, instances) and cached.
"""

from __future__ import annotations

import functools

from torch import Tensor

from . import library
from .checker import check_deadlock
from .compiler import compile_program
from .gpu_executor import group_name_of, run_plan
from .plan import Plan
from .program import Program

DEFAULTS = {
    "all_reduce": "one_shot",
    "all_gather": "direct",
    "reduce_scatter": "direct",
    "all_to_all": "direct",
}
_programs: dict[int, tuple[Program, Plan]] = {}


@functools.cache
def library_plan(name: str, num_ranks: int, instances: int = 1) -> Plan:
    """The checked, compiled plan of library program ``name`` (``"hierarchical_all_reduce:2x4"`` for the
    hierarchical ones) for ``num_ranks`` ranks."""
    base, _, shape = name.partition(":")
    if base in library.FLAT:
        prog = library.FLAT[base](num_ranks)
    elif base in library.HIERARCHICAL:
        if not shape:
            raise ValueError(f"fluxcompile.schedules: {base} needs its node shape, e.g. '{base}:2x{num_ranks // 2}'")
        nodes, gpus = (int(v) for v in shape.split("x"))
        if nodes * gpus != num_ranks:
            raise ValueError(f"fluxcompile.schedules: {name} is for {nodes * gpus} ranks, not {num_ranks}")
        prog = library.HIERARCHICAL[base](nodes, gpus)
    else:
        known = sorted(library.FLAT) + sorted(library.HIERARCHICAL)
        raise ValueError(f"fluxcompile.schedules: no library program {name!r}; known: {known}")
    plan = compile_program(prog, instances=instances)
    check_deadlock(plan)
    return plan


def resolve(program: Program | Plan | str, collective: str | None, num_ranks: int, instances: int = 1) -> Plan:
    """A Plan for ``program``; a str is a library name, completed with ``_<collective>`` when short."""
    if isinstance(program, Plan):
        plan = program
    elif isinstance(program, Program):
        hit = _programs.get(id(program))
        if hit is None or hit[0] is not program:
            plan = compile_program(program, instances=instances)
            check_deadlock(plan)
            hit = _programs[id(program)] = (program, plan)
        plan = hit[1]
    else:
        base, sep, shape = program.partition(":")
        if collective and base not in library.FLAT and base not in library.HIERARCHICAL:
            base = f"{base}_{collective}"
        plan = library_plan(base + sep + shape, num_ranks, instances)
    if collective is not None and plan.collective != collective:
        raise ValueError(f"fluxcompile.schedules: {plan.name} is a {plan.collective}, not an {collective}")
    return plan


def _run(collective: str, x: Tensor, group: object, program, out: Tensor | None, **kw) -> Tensor:
    from ..symm_mem.groups import group_size

    size = group_size(group_name_of(group))
    plan = resolve(program or DEFAULTS[collective], collective, size)
    return run_plan(plan, x, group, out, **kw)


def all_reduce(x: Tensor, group: object = None, program: Program | Plan | str | None = None,
               out: Tensor | None = None, **kw) -> Tensor:  # fmt: skip
    """Sum of every rank's ``x`` (any shape whose size divides into the program's chunks)."""
    return _run("all_reduce", x, group, program, out, **kw)


def all_gather(x: Tensor, group: object = None, program: Program | Plan | str | None = None,
               out: Tensor | None = None, **kw) -> Tensor:  # fmt: skip
    """Every rank's ``x`` concatenated in rank order along dim 0."""
    return _run("all_gather", x, group, program, out, **kw)


def reduce_scatter(x: Tensor, group: object = None, program: Program | Plan | str | None = None,
                   out: Tensor | None = None, **kw) -> Tensor:  # fmt: skip
    """Block ``rank`` (of world equal blocks along dim 0) of the sum of every rank's ``x``."""
    return _run("reduce_scatter", x, group, program, out, **kw)


def all_to_all(x: Tensor, group: object = None, program: Program | Plan | str | None = None,
               out: Tensor | None = None, **kw) -> Tensor:  # fmt: skip
    """Block q of this rank's ``x`` goes to rank q; block p of the result came from rank p."""
    return _run("all_to_all", x, group, program, out, **kw)
