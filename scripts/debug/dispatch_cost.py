"""Host µs the dispatcher adds to a Python-implemented custom op, by signature and device (one process).

The fused ops are torch.library ops with Python CUDA implementations; Inductor's generated code calls them
through ``torch.ops``. benchmarks/host_cost.py measures the whole op path; this isolates the dispatcher:
the same trivial body called directly and through ops of several signatures.

    python scripts/debug/dispatch_cost.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SIGS = {
    "tensor": "(Tensor a) -> Tensor",
    "lists": "(Tensor[] As, Tensor[] Bs, Tensor? bias, SymInt[] out_shape, int d, str r, int g, str n) -> Tensor",
}


def bench(fn: Callable[[], object], calls: int = 2000, rounds: int = 7) -> float:
    for _ in range(200):
        fn()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / calls)
    return sorted(per)[rounds // 2]


def main() -> None:
    lib = torch.library.Library("dispatch_cost", "DEF")
    rows: list[tuple[str, float]] = []
    for device in ("cpu", "cuda"):
        a = torch.randn(4, 4, device=device)
        args = {"tensor": (a,), "lists": ([a], [a], None, [4, 4], 0, "sum", 2, "0")}
        for sig, schema in SIGS.items():
            for variant in ("plain", "autograd_fallthrough", "as_fluxcompile"):
                name = f"{sig}_{variant}_{device}"
                lib.define(name + schema)

                def body(*xs, a=a):
                    return a

                lib.impl(name, body, "CPU" if device == "cpu" else "CUDA")
                if variant == "as_fluxcompile":  # fluxcompile/ops.py: a reference for every backend, and a fake
                    lib.impl(name, body, "CompositeExplicitAutograd")
                    torch.library.register_fake(f"dispatch_cost::{name}", body, lib=lib)
                if variant == "autograd_fallthrough":
                    lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
                op = getattr(torch.ops.dispatch_cost, name).default
                x = args[sig]
                rows.append((f"{name}: body alone", bench(lambda x=x: body(*x))))
                rows.append((f"{name}: through torch.ops", bench(lambda op=op, x=x: op(*x))))
    print("== dispatch table: host µs per call (median of 7 loops)")
    for name, t in rows:
        print(f"  {name:<56} {t:8.2f}")


if __name__ == "__main__":
    main()
