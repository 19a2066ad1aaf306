"""The original ops as Inductor issues them (lowerings/decomposition.py) against the fused ops' references, on
gloo ranks: the same results for every op's forms (gather and scatter along another dim, several weights and
products, biases, avg, return_A), and the reference for arguments they leave to it (scaled matmuls)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import assert_close

from fluxcompile import ops
from fluxcompile.lowerings import decomposition


def compare() -> list[str]:
    from fluxcompile.testing import fp8_gloo

    fp8_gloo.install()  # the scaled all-gather moves fp8 over gloo
    group = dist.group.WORLD
    w, name = group.size(), group.group_name
    g = torch.Generator().manual_seed(dist.get_rank())

    def r(*shape):
        return torch.randn(*shape, generator=g)

    cases = [
        ("all_gather_matmul", (r(6, 16), [r(16, 8), r(16, 4)], [r(8), None], 0, w, name), {}),
        ("all_gather_matmul", (r(2, 3, 16), [r(16, 8)], [None], 1, w, name), {"return_A": False}),
        ("matmul_reduce_scatter", ([r(8, 16), r(8, 4)], [r(16, 6), r(4, 6)], r(6), [8, 6], 0, "sum", w, name), {}),
        ("matmul_reduce_scatter", ([r(8, 16)], [r(16, 6)], None, [1, 8, 6], 1, "avg", w, name), {}),
        ("matmul_reduce_scatter", ([r(8, 16)], [r(16, 6)], None, [8, 6], -1, "sum", w, name), {}),
        ("matmul_all_reduce", ([r(8, 16)], [r(16, 6)], r(6), [2, 4, 6], "sum", name), {}),
    ]
    # Scaled calls (fp8, the ops' ".scaled" keys): _scaled_mm after the collective, tensor-wise scales; the
    # reduce-scatter also with row-wise ones.
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16

    def f8(*shape):
        return r(*shape).to(e4m3)

    def s(*shape):
        return torch.rand(shape, generator=g) + 0.5

    cases += [
        ("all_gather_matmul.scaled", (f8(6, 16), [f8(8, 16).t()], [None], 0, w, name, s(), [s()], bf16, False), {}),
        ("matmul_reduce_scatter.scaled",
         ([f8(8, 16), f8(8, 32)], [f8(6, 16).t(), f8(6, 32).t()], None, [8, 6], 0, "sum", w, name,
          [s(), s()], [s(), s()], bf16, False), {}),
        ("matmul_reduce_scatter.scaled",
         ([f8(8, 16)], [f8(6, 16).t()], None, [8, 6], 0, "sum", w, name, [s(8, 1)], [s(1, 6)], bf16, False), {}),
        ("matmul_all_reduce.scaled", ([f8(8, 16)], [f8(6, 16).t()], None, [8, 6], "sum", name, [s()], [s()], bf16,
                                      False), {}),
    ]  # fmt: skip
    errors = []
    for op, args, kwargs in cases:
        got = decomposition.FUNCTIONS[op](*args, **kwargs)
        want = ops.REFERENCES[op.removesuffix(".scaled")](*args, **kwargs)
        gathers = op.startswith("all_gather_matmul")
        flat_got = [got[0], *got[1]] if gathers else [got]
        flat_want = [want[0], *want[1]] if gathers else [want]
        for i, (a, b) in enumerate(zip(flat_got, flat_want)):
            if a is None or b is None:
                if (a is None) != (b is None):
                    errors.append(f"{op} {kwargs} result {i}: {a is None=} {b is None=}")
                continue
            if a.shape != b.shape:
                errors.append(f"{op} result {i}: shape {tuple(a.shape)} != {tuple(b.shape)}")
                continue
            try:
                assert_close(a.float(), b.float(), 1e-6, f"{op} result {i}")
            except AssertionError as e:
                errors.append(str(e))
    return errors


def test_decomposition_matches_the_references(ranks):
    for errors in ranks(2).run(compare):
        assert not errors, errors


def test_every_op_with_a_compile_time_choice_has_one():
    plain = {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"}
    assert set(decomposition.FUNCTIONS) == plain | {f"{op}.scaled" for op in plain}
