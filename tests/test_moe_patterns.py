"""The all-to-all rewrites of MoE layers and DLRM embeddings on small graphs written the way users write them:
which sites fuse (forward and backward) and that compiled results equal eager ones, on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

import fluxcompile
from fluxcompile.testing import fresh_compiles
from fluxcompile.testing.numerics import rel_err

A2AMM, MMA2A, POOLED = "all_to_all_matmul", "matmul_all_to_all", "embedding_bag_all_to_all"
POOLED_BACKWARD = "all_to_all_embedding_bag_backward"


def _seed() -> int:
    t = torch.randint(0, 2**31 - 1, (1,))
    dist.broadcast(t, 0)
    return int(t)


def dropless(x, router, w1, w2, experts: int, top_k: int, pad: bool = False):
    """torchtitan's dropless layer in plain ops: sort by expert, exchange counts and rows, permute by index into
    the experts' order, grouped_mm, un-permute by index_put, exchange back; with ``pad``, torchtitan's zero row
    appended before the permutation (one padding index at the end of the last expert's rows)."""
    group, world = dist.group.WORLD, dist.get_world_size()
    local, d = experts // world, x.shape[-1]
    weights, ids = torch.softmax(x.float() @ router, -1).topk(top_k, -1)
    order = ids.flatten().argsort(stable=True)
    rows = x.repeat_interleave(top_k, 0)[order]
    counts = torch.histc(ids.flatten().float(), bins=experts, min=0, max=experts - 1).long()
    recv_counts = fc.all_to_all_single(counts, None, None, group)
    send = counts.view(world, local).sum(1).tolist()
    recv = recv_counts.view(world, local).sum(1).tolist()
    routed = fc.all_to_all_single_autograd(rows, recv, send, group)
    segment = torch.searchsorted(recv_counts.cumsum(0), torch.arange(routed.shape[0]), right=True)
    perm = torch.argsort(segment % local, stable=True)
    offs = recv_counts.view(world, local).sum(0).cumsum(0).to(torch.int32)
    if pad:
        routed = torch.vstack((routed, routed.new_zeros(routed.shape[-1])))
        perm = torch.cat([perm, perm.new_full((1,), routed.shape[0] - 1)])
        offs = offs + (torch.arange(local) == local - 1).to(torch.int32)
    y = torch._grouped_mm(torch.relu(torch._grouped_mm(routed[perm], w1, offs=offs)), w2, offs=offs)
    out = y.new_empty(routed.shape[0], y.shape[-1])
    out[perm] = y
    if pad:
        out = out[:-1]
    back = fc.all_to_all_single_autograd(out, send, recv, group)
    unsorted = torch.empty_like(back)
    unsorted[order] = back
    return (unsorted.view(-1, top_k, d).float() * weights.unsqueeze(-1)).sum(1)


def capacity(x, w1, w2, capacity_rows: int):
    """GShard's layout: [world, E, C, d] blocks transposed to [E, world * C, d], bmm per expert, and back."""
    group, world = dist.group.WORLD, dist.get_world_size()
    local, d = w1.shape[0], x.shape[-1]
    routed = fc.all_to_all_single_autograd(x[: world * local * capacity_rows], None, None, group)
    xe = routed.view(world, local, capacity_rows, d).transpose(0, 1).reshape(local, -1, d)
    y = torch.bmm(torch.relu(torch.bmm(xe, w1)), w2)
    back = y.view(local, world, capacity_rows, d).transpose(0, 1).reshape(-1, d)
    return fc.all_to_all_single_autograd(back, None, None, group)


def moe_inference_case(world: int) -> tuple[int, float, str]:
    """The dropless layer without gradients: only the experts read the exchanged rows."""
    torch.manual_seed(_seed())
    experts, d, f, dtype = 2 * world, 16, 32, torch.bfloat16
    w1 = torch.randn(experts // world, d, f, dtype=dtype)
    w2 = torch.randn(experts // world, f, d, dtype=dtype)
    router = torch.randn(d, experts)
    x = torch.randn(12 + dist.get_rank(), d, dtype=dtype)
    fn = lambda x: dropless(x, router, w1, w2, experts, 2)  # noqa: E731
    with fresh_compiles(), torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad(), \
            fluxcompile.collect_reports() as rep:  # fmt: skip
        out = torch.compile(fn, backend="fluxcompile")(x)
        ref = fn(x)
    return rep.count(A2AMM), rel_err(out, ref), rep.format()


@pytest.mark.parametrize("world", [2, 4])
def test_moe_dispatch_without_its_exchanged_rows(ranks, world):
    """Where only the experts read the exchanged rows, the fused dispatch does not return them (``return_A``
    False: the reference, and any choice, may skip them) and the results still equal eager ones."""
    for count, err, report in ranks(world).run(moe_inference_case, world):
        assert count == 1, report
        assert "exchanged rows not returned" in report, report
        assert err <= 1e-2, report


def moe_case(form: str) -> tuple[dict, float]:
    torch.manual_seed(_seed())
    world, dtype = dist.get_world_size(), torch.bfloat16
    experts, d, f = 2 * world, 16, 32
    w1 = torch.randn(experts // world, d, f, dtype=dtype, requires_grad=True)
    w2 = torch.randn(experts // world, f, d, dtype=dtype, requires_grad=True)
    x = torch.randn(12 + dist.get_rank(), d, dtype=dtype)
    if form.startswith("dropless"):
        router = torch.randn(d, experts)
        fn = lambda x: dropless(x, router, w1, w2, experts, 2, pad=form == "dropless-padded")  # noqa: E731
    else:
        fn = lambda x: capacity(x, w1, w2, 2)  # noqa: E731
    params = [w1, w2]
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with fresh_compiles(), torch._dynamo.config.patch(capture_scalar_outputs=True), fluxcompile.collect_reports() as rep:
        out = torch.compile(fn, backend="fluxcompile")(xc)
        grad = torch.randn_like(out)
        out.backward(grad)
    compiled_grads = [xc.grad, *(p.grad for p in params)]
    for p in params:
        p.grad = None
    ref = fn(xe)
    ref.backward(grad)
    errs = [rel_err(out, ref), *(rel_err(a, b) for a, b in zip(compiled_grads, [xe.grad, *(p.grad for p in params)]))]
    counts = {k: {op: rep.count(op, k) for op in (A2AMM, MMA2A)} for k in ("forward", "backward")}
    return counts, max(errs), rep.format()


# Four ranks: tests/test_moe_model.py::test_dropless_grouped_mm_four_ranks.
@pytest.mark.parametrize(("world", "form"), [(2, "dropless"), (2, "dropless-padded"), (2, "capacity")])
def test_moe_dispatch_and_combine_fuse(ranks, world, form):
    for counts, err, report in ranks(world).run(moe_case, form):
        # Forward: dispatch and combine; backward: the combine's backward is a dispatch and vice versa.
        assert counts == {"forward": {A2AMM: 1, MMA2A: 1}, "backward": {A2AMM: 1, MMA2A: 1}}, report
        assert err <= 1e-2, report
    if form.startswith("dropless"):
        assert "permutation by index, accumulating" in report
    else:
        assert "permutation by layout" in report


def dlrm_case(train: bool, mode: str = "mean", weighted: bool = False) -> tuple[int, float, str]:
    torch.manual_seed(_seed())
    world, T, D, B = dist.get_world_size(), 3, 8, 4
    tables = [torch.randn(20 + t, D, requires_grad=train) for t in range(T)]
    lengths = [torch.randint(0, 5, (B * world,)) for _ in range(T)]
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)[:-1]]) for n in lengths]
    indices = [torch.randint(0, 20, (int(n.sum()),)) for n in lengths]
    # per-sample weights (sum pooling), learned: their gradients too
    psw = [torch.rand(i.numel(), requires_grad=train) if weighted else None for i in indices]

    def pooled_exchange(indices, offsets):
        pooled = [
            F.embedding_bag(i, w, o, mode=mode, per_sample_weights=p) for w, i, o, p in zip(tables, indices, offsets, psw)
        ]
        p = torch.stack(pooled, dim=1).reshape(B * world, T * D)
        r = fc.all_to_all_single_autograd(p, None, None, dist.group.WORLD)
        return r.view(world, B, T * D).transpose(0, 1).reshape(B, world * T * D)

    grad = torch.randn(B, world * T * D)
    with fresh_compiles(), fluxcompile.collect_reports() as rep, torch.set_grad_enabled(train):
        out = torch.compile(pooled_exchange, backend="fluxcompile")(indices, offsets)
        if train:
            out.backward(grad)
    learned = tables + [p for p in psw if p is not None]
    compiled_grads = [t.grad for t in learned] if train else []
    for t in learned:
        t.grad = None
    with torch.set_grad_enabled(train):
        ref = pooled_exchange(indices, offsets)
        if train:
            ref.backward(grad)
    errs = [rel_err(out, ref), *(rel_err(a, t.grad) for a, t in zip(compiled_grads, learned))]
    return rep.count(POOLED) + rep.count(POOLED_BACKWARD, "backward"), max(errs), rep.format()


@pytest.mark.parametrize("world", [2, 4])
def test_dlrm_embedding_bags_fuse_in_inference(ranks, world):
    for count, err, report in ranks(world).run(dlrm_case, False):
        assert count == 1, report
        assert err <= 1e-6, report


@pytest.mark.parametrize(("world", "mode"), [(2, "mean"), (2, "sum"), (4, "mean")])
def test_dlrm_training_fuses_forward_and_backward(ranks, world, mode):
    """The training forward fuses its bags and exchange (the fused op makes the backward's bookkeeping), the
    backward its exchange of the pooled gradients and the tables' embedding-bag backwards; the output and every
    table's gradient equal eager's."""
    for count, err, report in ranks(world).run(dlrm_case, True, mode):
        assert count == 2 and "with the bookkeeping of 3 for the backward" in report, report
        assert "3 embedding bag backward(s)" in report, report
        assert err <= 1e-6, report


@pytest.mark.parametrize("world", [2, 4])
def test_dlrm_training_with_per_sample_weights(ranks, world):
    """Learned per-sample weights (sum pooling): the forward fuses with them, the backward makes the tables' and
    the weights' gradients; all equal eager's."""
    for count, err, report in ranks(world).run(dlrm_case, True, "sum", True):
        assert count == 2 and "(sum, per-sample weights)" in report, report
        assert "per-sample weights and their gradients" in report, report
        assert err <= 1e-6, report


def test_dlrm_training_with_max_pooling_keeps_its_forward_bags(ranks):
    """Max pooling's max_indices are per column: the forward keeps its bags; the backward (which reads them as
    the bags made them) still fuses."""
    for count, err, report in ranks(2).run(dlrm_case, True, "max"):
        assert count == 1 and "max pooling whose max_indices a backward reads" in report, report
        assert err <= 1e-6, report
