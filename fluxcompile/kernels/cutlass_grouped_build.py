"""Build spec of the experts' CUTLASS grouped GEMM (csrc/cutlass_grouped.cuh): its tile variants and the translation
units generated from them (CUTLASS's include directories: cutlass_build.cutlass_include)."""

from __future__ import annotations

import dataclasses

from .cutlass_build import SCHEDULES


@dataclasses.dataclass(frozen=True)
class GroupedVariant:
    """One tile configuration of the experts' grouped GEMM (csrc/cutlass_grouped.cuh), both weight layouts."""

    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    schedule: str = "coop"  # "coop" or "pp" (ping-pong)

    @property
    def name(self) -> str:
        (tm, tn, tk), (cm, cn) = self.tile, self.cluster
        return f"{tm}x{tn}x{tk}_c{cm}x{cn}" + ("" if self.schedule == "coop" else f"_{self.schedule}")


GROUPED_VARIANTS: dict[str, GroupedVariant] = {
    v.name: v
    for v in (
        GroupedVariant((128, 256, 64), (2, 1)),
        GroupedVariant((256, 128, 64), (2, 1)),
        GroupedVariant((128, 128, 64), (1, 2), "pp"),
        GroupedVariant((64, 256, 64), (1, 2), "pp"),
    )
}


def grouped_sources() -> dict[str, str]:
    """The ``cutlass_grouped`` build's generated files: one translation unit per grouped variant and the registry."""
    files = {}
    for name, v in GROUPED_VARIANTS.items():
        (tm, tn, tk), (cm, cn) = v.tile, v.cluster
        sched = SCHEDULES[v.schedule]
        files[f"cutlass_grouped_{name}.cu"] = (
            f'#include "cutlass_grouped.cuh"\nGROUPED_VARIANT({name}, {tm}, {tn}, {tk}, {cm}, {cn}, {sched})\n'
        )
    sig = "(const GroupedProblem&, cudaStream_t, size_t*);"
    decls = "\n".join(f"cudaError_t cutlass_grouped_{n}{sig}" for n in GROUPED_VARIANTS)
    table = ",\n".join(
        f'    {{"{n}", {v.tile[0]}, {v.tile[1]}, {v.tile[2]}, {v.cluster[0]}, {v.cluster[1]}, '
        f"{SCHEDULES[v.schedule]}, &cutlass_grouped_{n}}}"
        for n, v in GROUPED_VARIANTS.items()
    )
    files["cutlass_grouped_registry.cpp"] = (
        '#include "cutlass_grouped.h"\nnamespace fluxcompile {\n'
        f"{decls}\n"
        f"static const GroupedVariant kVariants[] = {{\n{table}\n}};\n"
        "const GroupedVariant* grouped_variants(int* count) {\n"
        "  *count = sizeof(kVariants) / sizeof(kVariants[0]);\n  return kVariants;\n}\n}  // namespace fluxcompile\n"
    )
    return files
