"""Build spec of the Flux-style CUTLASS GEMM (csrc/flux_gemm.cuh): its tile variants, the translation units
generated from them, and CUTLASS's include directories.

``VARIANTS`` is the one list of tile configurations: the build (extensions.py) generates a translation unit per
variant (built in parallel) and the registry the binding reads; the launcher (cutlass_gemm.py) picks one by name.
CUTLASS's headers come from the ``nvidia-cutlass`` package (``cutlass_library/source/include``).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled tile configuration: both 16-bit dtypes and both weight layouts, or (``fp8``) e4m3 operands with
    K-major weights, tensor-wise and row-wise scales, with and without fast accumulation (one translation unit
    each) and a bf16 output."""

    tile: tuple[int, int, int]  # M, N, K of a CTA's tile
    cluster: tuple[int, int]  # CTAs of a cluster along M and N (TMA multicast of B and A)
    # "coop": two warp groups per tile; "pp" (ping-pong): one per tile, the other's epilogue overlapping its
    # mainloop; "sk": cooperative under CUTLASS's stream-K scheduler instead of the data-parallel one.
    schedule: str = "coop"
    # Also built with a source and the reduce-scatter ring's epilogue (flux_gemm_ring_<name>.cu); cooperative
    # schedules only (the ring's epilogue drains its stores mid-kernel, which the ping-pong schedule's warp groups,
    # sharing the epilogue's pipelines, do not allow: its multi-tile case failed its launch on the GPU).
    ring: bool = False
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.ring and self.schedule != "coop":
            raise ValueError(f"variant {self.name}: the ring's epilogue is built for the cooperative schedule only")
        if self.ring and self.fp8:
            raise ValueError(f"variant {self.name}: the ring is built for 16-bit operands only")

    @property
    def name(self) -> str:
        (tm, tn, tk), (cm, cn) = self.tile, self.cluster
        return (
            f"{tm}x{tn}x{tk}_c{cm}x{cn}"
            + ("" if self.schedule == "coop" else f"_{self.schedule}")
            + ("_e4m3" if self.fp8 else "")
        )

    @property
    def stream_k(self) -> bool:
        return self.schedule == "sk"

    @property
    def promotes(self) -> bool:
        """An fp8 variant also built without fast accumulation: CUTLASS's fp8 mainloop then keeps a second
        accumulator for its fp32 promotion, which fits a warp group's registers at 64 x 128 accumulators (the
        cooperative 128 x 128 tile) and spills from 128 x 128 on (measured with ``-Xptxas -v``)."""
        tm, tn, _ = self.tile
        return self.fp8 and (tm // 2 if self.schedule != "pp" else tm) * tn <= 64 * 128


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant((128, 256, 64), (2, 1), ring=True),
        Variant((128, 256, 64), (1, 2)),
        Variant((256, 128, 64), (2, 1), ring=True),
        Variant((256, 128, 64), (1, 2)),
        Variant((128, 192, 64), (2, 1)),
        Variant((128, 224, 64), (2, 1)),
        Variant((128, 128, 64), (2, 1), "pp"),
        Variant((128, 128, 64), (1, 2), "pp"),
        Variant((64, 256, 64), (1, 2), "pp"),
        Variant((128, 256, 64), (2, 1), "sk"),
        Variant((256, 128, 64), (1, 2), "sk"),
        Variant((256, 128, 64), (2, 1), "sk"),
        # fp8: a k-tile of 128 bytes, as the 16-bit tiles' 64 elements; built without fast accumulation where
        # that fits (``promotes``).
        Variant((128, 256, 128), (2, 1), fp8=True),
        Variant((128, 256, 128), (1, 2), fp8=True),
        Variant((256, 128, 128), (1, 2), fp8=True),
        Variant((256, 128, 128), (2, 1), fp8=True),
        Variant((128, 128, 128), (1, 2), fp8=True),
        Variant((128, 128, 128), (2, 1), fp8=True),
        Variant((128, 128, 128), (1, 2), "pp", fp8=True),
        Variant((192, 128, 128), (1, 2), "pp", fp8=True),
        Variant((64, 256, 128), (1, 2), "pp", fp8=True),
        Variant((128, 256, 128), (2, 1), "sk", fp8=True),
        Variant((128, 128, 128), (2, 1), "sk", fp8=True),
    )
}
FP8_PARTS = ((1, 0), (1, 1), (2, 0), (2, 1))  # (scale mode: 1 tensor-wise, 2 row-wise; fast accumulation)


def fp8_parts(v: Variant) -> list[tuple[int, int]]:
    """The (scale mode, fast accumulation) kernels built for the fp8 variant ``v``."""
    return [(scale, fast) for scale, fast in FP8_PARTS if fast or v.promotes]
SCHEDULES = {"coop": 0, "pp": 1, "sk": 2}  # csrc/flux_gemm.cuh's Schedule


def generated_sources() -> dict[str, str]:
    """The build's generated files: one translation unit per variant and the registry."""
    files = {}
    rows = []
    for name, v in VARIANTS.items():
        (tm, tn, tk), (cm, cn) = v.tile, v.cluster
        sched = SCHEDULES[v.schedule]
        args = f"{name}, {tm}, {tn}, {tk}, {cm}, {cn}, {sched}"
        if v.fp8:
            macro = "FLUX_GEMM_FP8_VARIANT" if v.promotes else "FLUX_GEMM_FP8_FAST_VARIANT"
            files[f"flux_gemm_{name}.cu"] = f'#include "flux_gemm.cuh"\n{macro}({name})\n'
            for scale, fast in fp8_parts(v):
                files[f"flux_gemm_{name}_s{scale}{fast}.cu"] = (
                    f'#include "flux_gemm.cuh"\nFLUX_GEMM_FP8_PART({args}, {scale}, {fast})\n'
                )
        else:
            files[f"flux_gemm_{name}.cu"] = f'#include "flux_gemm.cuh"\nFLUX_GEMM_VARIANT({args})\n'
        if v.ring:
            files[f"flux_gemm_ring_{name}.cu"] = f'#include "flux_gemm.cuh"\nFLUX_GEMM_RING_VARIANT({args})\n'
        rows.append((name, v))
    sig = "(const FluxGemmProblem&, cudaStream_t, size_t*);"
    decls = "\n".join(
        [f"cudaError_t flux_gemm_{n}{sig}" for n, _ in rows]
        + [f"cudaError_t flux_gemm_ring_{n}{sig}" for n, v in rows if v.ring]
    )
    table = ",\n".join(
        f'    {{"{n}", {v.tile[0]}, {v.tile[1]}, {v.tile[2]}, {v.cluster[0]}, {v.cluster[1]}, '
        f"{SCHEDULES[v.schedule]}, &flux_gemm_{n}, {f'&flux_gemm_ring_{n}' if v.ring else 'nullptr'}}}"
        for n, v in rows
    )
    files["flux_gemm_registry.cpp"] = (
        '#include "flux_gemm.h"\nnamespace fluxcompile {\n'
        f"{decls}\n"
        f"static const FluxGemmVariant kVariants[] = {{\n{table}\n}};\n"
        "const FluxGemmVariant* flux_gemm_variants(int* count) {\n"
        "  *count = sizeof(kVariants) / sizeof(kVariants[0]);\n  return kVariants;\n}\n}  // namespace fluxcompile\n"
    )
    return files


@functools.cache
def cutlass_include() -> list[str] | None:
    """CUTLASS's include directories from the ``nvidia-cutlass`` package (None if it is not installed)."""
    import importlib.util

    # The package's location only: importing cutlass_library runs its (slow) kernel generators.
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).resolve() / "source"
    dirs = [root / "include", root / "tools" / "util" / "include"]
    return [str(d) for d in dirs if d.is_dir()] if (root / "include" / "cutlass").is_dir() else None
