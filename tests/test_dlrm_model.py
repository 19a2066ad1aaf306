"""The DLRM with table-wise sharded embeddings (fluxcompile/models/dlrm.py) on gloo ranks: eager == the model in
one process, compiled with backend="fluxcompile" == eager, forward and backward (dense-input grad and every
parameter's grad, the tables' dense grads included).

The training forward's bags and exchange fuse (the fused op makes the backward's bookkeeping), and so do the
backward's exchange of the pooled gradients and the tables' embedding-bag backwards (issue 57). ``--inference``
(the forward alone, no gradients) fuses its one graph.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fluxcompile.demo import DemoArgs, ModelResult, check_dlrm, dlrm_case, dlrm_reference_errors
from fluxcompile.models.dlrm import DLRMArgs, ModelParallelDLRM

SMALL = {"dim": 16, "ffn": 32, "batch": 6, "tables": 4, "rows": 50, "bag_size": 3, "dense_in": 13, "seed": 0}


def dlrm_on_world(a: DemoArgs) -> ModelResult:
    return check_dlrm(dist.group.WORLD, a)


def eager_on_world(a: DemoArgs) -> tuple[dict[str, float], float]:
    from fluxcompile.testing.numerics import TOLERANCE

    da, params, dense, sparse, grads = dlrm_case(dist.group.WORLD, a)
    model = ModelParallelDLRM(da, dist.group.WORLD, params)
    rows = slice(model.rank * a.batch, (model.rank + 1) * a.batch)
    mine = sparse[model.rank * model.local_tables : (model.rank + 1) * model.local_tables]
    d = dense[rows].clone().requires_grad_()
    out = model(d, mine)
    out.backward(grads[rows])
    return dlrm_reference_errors(model, params, dense, sparse, grads, out, d.grad), TOLERANCE[dense.dtype]


def run(ranks, world: int, **kw) -> list[ModelResult]:
    a = DemoArgs(**{**SMALL, **kw})
    results = ranks(world).run(dlrm_on_world, a)
    for rank, r in enumerate(results):
        assert r.ok, f"rank {rank}: {r}"
        assert r.graphs == {"forward": 1, "backward": 1}, f"rank {rank}: graph breaks: {r.graphs}\n{r.report}"
        assert any(name.startswith("tables.") for name in r.grad_errors), r.grad_errors
    assert all(r.counts == results[0].counts for r in results), "ranks rewrote their graphs differently"
    assert results[0].counts["forward"]["embedding_bag_all_to_all"] == 1, results[0].report
    assert results[0].counts["backward"]["all_to_all_embedding_bag_backward"] == 1, results[0].report
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_eager_model_matches_one_process(ranks, world):
    for pooling in ("sum", "mean"):
        for interaction in ("dot", "cat"):
            a = DemoArgs(**{**SMALL, "tables": 8, "pooling": pooling, "interaction": interaction})
            for rank, (errors, tol) in enumerate(ranks(world).run(eager_on_world, a)):
                bad = {k: v for k, v in errors.items() if not v <= tol}
                assert not bad, f"{pooling}/{interaction}, rank {rank} of {world}: {bad}"


def test_compiled_sum_pooling_dot_interaction(ranks):
    run(ranks, 2, pooling="sum", interaction="dot")


def test_compiled_mean_pooling_cat_interaction_four_ranks(ranks):
    run(ranks, 4, pooling="mean", interaction="cat", tables=8, batch=5)


def test_compiled_padding_index(ranks):
    """nn.EmbeddingBag's padding_idx (row 3 of 8: every bag meets it often) in mean pooling: both graphs fuse,
    the padding row pools nothing, counts in no mean and gets no gradient."""
    results = run(ranks, 2, pooling="mean", interaction="dot", rows=8, padding_idx=3)
    assert "padding_idx 3" in results[0].report, results[0].report


@pytest.mark.parametrize("world", [2, 4])
def test_inference_form_fuses(ranks, world):
    a = DemoArgs(**{**SMALL, "tables": 8, "inference": True})
    results = ranks(world).run(dlrm_on_world, a)
    for rank, r in enumerate(results):
        assert r.ok and not r.grad_errors, f"rank {rank}: {r}"
        assert r.graphs.get("backward", 0) == 0 and "1 embedding_bag_all_to_all" in r.report, r.report


def test_dlrm_args_refuse_unknown_pooling():
    with pytest.raises(ValueError, match="mode"):
        DLRMArgs(mode="max")
