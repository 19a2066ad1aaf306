"""The DLRM exchange on torch's NVSHMEM backend between this run's processes (issue 58): the put-with-signal form
(choice ``put``, lowerings/embedding_bag_all_to_all/put.py: NVSHMEM's put-with-signal from a Triton kernel) forced
with ``exchange_transport="put"``, the P2P form (choice ``triton``) on NVSHMEM-allocated workspaces, the two
alternating on one workspace, a sub-group's own workspaces, and a peer that never comes (the bounded wait's error);
the backward's put form (lowerings/all_to_all_embedding_bag_backward/put.py) and its P2P form there too.

scripts/gpu-check's step ``nvshmem-pes`` runs it with FLUXCOMPILE_SYMM_MEM_BACKEND=nvshmem: between GPUs where the
machine has several, else as 2 and 4 processes sharing one GPU under an MPS server (NVSHMEM refuses several PEs on
one GPU without MPS; the processes' group is then gloo, as NCCL refuses a GPU twice). Expected outputs come by hand:
every rank draws every rank's operands from one fresh seed and pools them in fp32 (no collective reference). Each
case: eager calls with outputs from a NaN-poisoned allocator and one rank's launch delayed, then a CUDA graph
replayed with new indices (NaN-filled output before each replay)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import assert_on_every_rank, poison_allocator
from test_dlrm_ranks import Owner, Rank, expected, expected_grads

from fluxcompile import config
from fluxcompile.config import IMPLEMENTATIONS
from fluxcompile.kernels import embedding_bag as eb
from fluxcompile.kernels import embedding_bag_backward as ebb
from fluxcompile.lowerings import all_to_all_embedding_bag_backward as _registered_bw  # noqa: F401
from fluxcompile.lowerings import embedding_bag_all_to_all as _registered  # noqa: F401  (the CUDA implementation)
from fluxcompile.lowerings.all_to_all_embedding_bag_backward import triton as lo_bw
from fluxcompile.lowerings.choices import _REGISTRY
from fluxcompile.lowerings.embedding_bag_all_to_all import triton as lo
from fluxcompile.symm_mem.comm import cached_comm
from fluxcompile.testing.numerics import assert_close

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(config.symm_mem_backend != "nvshmem", reason="runs with FLUXCOMPILE_SYMM_MEM_BACKEND=nvshmem"),
    pytest.mark.peers,
]

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
PUT = f"put:{eb.DEFAULT}"
P2P = f"triton:{eb.DEFAULT}"
OP_NAME = "embedding_bag_all_to_all"
OP = torch.ops.fluxcompile.embedding_bag_all_to_all.default


def _seed() -> int:
    s = [int(torch.randint(0, 2**30, ()))]
    dist.broadcast_object_list(s, 0)
    return s[0]


class Case:
    """Every rank's operands (the same on every process), this rank's op arguments and its expected outputs."""

    def __init__(self, dtype: torch.dtype, group: dist.ProcessGroup, splits: str = "equal", last: bool = False):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        seed = _seed()
        self.bags_local, tables, dim = 24, 3, 64
        bags = self.bags_local * self.world
        self.ranks = [
            Rank(torch.Generator().manual_seed(seed + s), tables, bags, dim, dtype, torch.int64, last, 6, 300 + 11 * s)
            for s in range(self.world)
        ]
        self.out_shape = [bags, tables * dim]
        if splits == "equal":
            self.sizes = [[self.bags_local] * self.world for _ in range(self.world)]
            ins = outs = []
        else:  # rank s sends 2 rows more to rank s + 1 and 2 fewer to rank s + 2: every rank sends and receives
            # its batch's worth
            w = self.world
            self.sizes = [
                [self.bags_local + 2 * (int(r == (s + 1) % w) - int(r == (s + 2) % w)) for r in range(w)]
                for s in range(w)
            ]
            ins, outs = self.sizes[self.rank], [row[self.rank] for row in self.sizes]
        x = self.ranks[self.rank]
        self.args = (x.weights, x.indices, x.offsets, 0, last, self.out_shape, outs, ins, group.group_name)
        self.dtype = dtype

    def refresh(self) -> None:
        for x in self.ranks:
            x.refresh()

    def want(self) -> torch.Tensor:
        return expected(self.ranks, 0, self.out_shape, lambda s: self.sizes[s])[self.rank]


def _check(case: Case, got: torch.Tensor, what: str) -> str | None:
    try:
        assert_close(got, case.want(), TOL[case.dtype], f"rank {case.rank} {what}")
    except AssertionError as e:
        return str(e)
    return None


def _errors(group: dist.ProcessGroup) -> str | None:
    torch.cuda.synchronize()
    words = cached_comm(group.group_name, lo.TAG).errors.err.tolist()
    return eb.error_message(words, "the exchange") if words[0] else None


def _eager_then_graph(case: Case, choices: list[str], group: dist.ProcessGroup) -> None:
    """Eager calls (choice ``choices[call % len]``, the last rank's launch delayed in call 1), then a CUDA graph of
    the first choice replayed with new operands."""
    for choice in choices:  # a declined choice would run the reference instead
        assert _REGISTRY[OP_NAME][choice].declines(*case.args) is None, (
            choice,
            _REGISTRY[OP_NAME][choice].declines(*case.args),
        )
    for call in range(4):
        case.refresh()
        poison_allocator(1 << 26)
        if call == 1 and case.rank == case.world - 1:
            torch.cuda._sleep(100_000_000)  # the others wait for this rank's rows
        choice = choices[call % len(choices)]
        got = OP(*case.args, choice=choice)[0]
        assert_on_every_rank(_check(case, got, f"{choice} eager call {call}"), group)
    assert_on_every_rank(_errors(group), group)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        OP(*case.args, choice=choices[0])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*case.args, choice=choices[0])[0]
    for replay in range(3):
        case.refresh()
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier(group)
        graph.replay()
        torch.cuda.synchronize()
        assert_on_every_rank(_check(case, out, f"{choices[0]} replay {replay}"), group)
    assert_on_every_rank(_errors(group), group)


@pytest.mark.parametrize(
    ("dtype", "splits"), [(torch.float32, "equal"), (torch.bfloat16, "equal"), (torch.float32, "unequal")]
)
def test_put_form(dtype, splits):
    """Forced put-with-signal: every peer reached by NVSHMEM's put, no peer address dereferenced (unequal splits:
    the receivers put each source its offset first)."""
    with config.patch(implementations=IMPLEMENTATIONS, exchange_transport="put", check_signals=False):
        _eager_then_graph(Case(dtype, dist.group.WORLD, splits), [PUT], dist.group.WORLD)
    from torch.distributed import _symmetric_memory as symm

    assert symm.get_backend(torch.device("cuda")) == "NVSHMEM"


@pytest.mark.parametrize("splits", ["equal", "unequal"])
def test_p2p_form_on_nvshmem_workspaces(splits):
    """The P2P form (stores through the peers' addresses, which NVSHMEM maps on one host) on the NVSHMEM heap."""
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=False):
        _eager_then_graph(Case(torch.bfloat16, dist.group.WORLD, splits, last=True), [P2P], dist.group.WORLD)


def test_forms_alternate():
    """put, P2P, put, P2P on one workspace: they share its state, counters and halves."""
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=False):
        case = Case(torch.float32, dist.group.WORLD)
        for call in range(4):
            case.refresh()
            poison_allocator(1 << 26)
            choice = (PUT, P2P)[call % 2]
            with config.patch(exchange_transport="put" if choice == PUT else "p2p"):
                got = OP(*case.args, choice=choice)[0]
            assert_on_every_rank(_check(case, got, f"{choice} call {call}"), dist.group.WORLD)
        assert_on_every_rank(_errors(dist.group.WORLD), dist.group.WORLD)


def test_subgroup_and_a_peer_that_never_comes():
    """A sub-group's own workspaces (NVSHMEM rendezvous of a sub-group), then rank 0 calls alone: its bounded wait
    ends in an error naming the rank, the peer and the signal."""
    world = dist.get_world_size()
    sub = dist.new_group(list(range(world)))
    with config.patch(implementations=IMPLEMENTATIONS, exchange_transport="put", check_signals=False):
        case = Case(torch.float32, sub)
        got = OP(*case.args, choice=PUT)[0]
        assert_on_every_rank(_check(case, got, "sub-group"), sub)
        torch.cuda.synchronize()
        dist.barrier()
        error = None
        if case.rank == 0:
            with config.patch(wait_timeout_s=3.0, check_signals=True):
                try:
                    OP(*case.args, choice=PUT)
                    error = "no timeout"
                except RuntimeError as e:
                    if "rank 0 timed out in call 2 waiting for rank 1" not in str(e):
                        error = f"another error: {e}"
        assert_on_every_rank(error)


@pytest.mark.parametrize("splits", ["equal", "unequal"])
@pytest.mark.parametrize("choice", ["put", "triton"])
def test_backward(choice, splits):
    """The backward's put form (forced) and P2P form on NVSHMEM workspaces, sum and mean, fp32 and bf16, against
    aten's backward of the exchanged rows (every rank's gradients drawn from one seed); several calls, the last
    rank's launch delayed once."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    op = torch.ops.fluxcompile.all_to_all_embedding_bag_backward.default
    seed = _seed()
    bags_local, tables, dim = 24, 3, 64
    bags = bags_local * world
    w = world
    sizes = [  # unequal: rank s sends 2 rows more to rank s + 1 and 2 fewer to rank s + 2
        [
            bags_local + (2 * (int(r == (s + 1) % w) - int(r == (s + 2) % w)) if splits == "unequal" else 0)
            for r in range(w)
        ]
        for s in range(w)
    ]
    ins, outs = (sizes[rank], [row[rank] for row in sizes]) if splits == "unequal" else ([], [])
    transport = "put" if choice == "put" else "p2p"
    with config.patch(implementations=IMPLEMENTATIONS, exchange_transport=transport, check_signals=False):
        for dtype in (torch.float32, torch.bfloat16):
            for mode in (0, 1):
                owners = [
                    Owner(torch.Generator().manual_seed(seed + s), tables, bags, bags, dim, dtype, torch.int64, False,
                          mode, 200 + 7 * s)
                    for s in range(world)
                ]  # fmt: skip
                x = owners[rank]
                args = (x.grad, x.indices, x.offsets, x.offset2bag, x.bag_size, x.max_indices, x.num_weights, False,
                        mode, outs, ins, group.group_name)  # fmt: skip
                why = _REGISTRY["all_to_all_embedding_bag_backward"][choice].declines(*args)
                assert why is None, why
                for call in range(3):
                    for o in owners:
                        o.refresh()
                    poison_allocator(1 << 26)
                    if call == 1 and rank == world - 1:
                        torch.cuda._sleep(100_000_000)
                    got = op(*args, choice=choice)
                    want = expected_grads(owners, sizes)[rank]
                    error = None
                    for t, (a, b) in enumerate(zip(got, want)):
                        try:
                            assert_close(
                                a, b, TOL[dtype], f"rank {rank} {choice} {dtype} mode {mode} call {call} table {t}"
                            )
                        except AssertionError as e:
                            error = error or str(e)
                    assert_on_every_rank(error, group)
        torch.cuda.synchronize()
        words = cached_comm(group.group_name, lo_bw.TAG).errors.err.tolist()
        assert_on_every_rank(ebb.error_message(words, "backward") if words[0] else None, group)


# --- the MoE ops' vdev choice (torch's NVSHMEM all-to-all as the exchange) -----------------------------------------


def _moe_case(seed: int, world: int, tokens: int = 32, hidden: int = 64):
    """Every rank's rows and split sizes (rank s sends rank r ``splits[s][r]`` rows, a zero among them)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(tokens, hidden, generator=g).to(device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    splits = []
    for s in range(world):
        cuts = sorted(torch.randint(0, tokens + 1, (world - 1,), generator=g).tolist())
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]
        parts[(s + 1) % world] += parts[s]  # one empty chunk per source
        parts[s] = 0
        splits.append(parts)
    return rows, splits


def _exchanged(rows, splits, r):
    """What rank r receives: every source's chunk for r, in source order."""
    out = []
    for s, x in enumerate(rows):
        start = sum(splits[s][:r])
        out.append(x[start : start + splits[s][r]])
    return torch.cat(out)


def test_moe_vdev_dispatch_and_combine():
    """all_to_all_matmul and matmul_all_to_all with choice vdev (expert weights grouped by offs) against the rows
    exchanged by hand and the reference's matmuls; three calls with fresh routing, the last rank delayed once."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dispatch = torch.ops.fluxcompile.all_to_all_matmul.default
    combine = torch.ops.fluxcompile.matmul_all_to_all.default
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=False):
        g = torch.Generator().manual_seed(_seed())
        w1 = torch.randn(2, 64, 32, generator=g).to(device="cuda", dtype=torch.bfloat16) / 8
        w2 = torch.randn(2, 32, 64, generator=g).to(device="cuda", dtype=torch.bfloat16) / 8
        for call in range(3):
            rows, splits = _moe_case(_seed(), world)
            ins, outs = splits[rank], [splits[s][rank] for s in range(world)]
            received = sum(outs)
            offs = torch.tensor([received // 2, received], dtype=torch.int32, device="cuda")
            args = (rows[rank], [w1], [None], outs, ins, group.group_name)
            why = _REGISTRY["all_to_all_matmul"]["vdev"].declines(*args, None, None, None, False, offs, None)
            assert why is None, why
            poison_allocator(1 << 26)
            if call == 1 and rank == world - 1:
                torch.cuda._sleep(100_000_000)
            got_A, (got_h,) = dispatch(*args, offs=offs, choice="vdev")
            want_A = _exchanged(rows, splits, rank)
            error = None
            try:
                torch.testing.assert_close(got_A, want_A, rtol=0, atol=0)  # moved, not computed: exact
                want_h = torch._grouped_mm(want_A, w1, offs=offs)
                assert_close(got_h, want_h, 1e-2, f"rank {rank} dispatch call {call}")
            except AssertionError as e:
                error = f"dispatch call {call}: {e}"
            assert_on_every_rank(error, group)
            # the combine sends every expert row back to its source
            back = torch._grouped_mm(got_h, w2, offs=offs)
            # out_shape: the rows before their exchange (those this rank received)
            got = combine([got_h], [w2], None, [received, 64], ins, outs, group.group_name, offs=offs, choice="vdev")
            # every rank's products (back, by source) gathered on CPU and exchanged by hand: rank d sends rank r
            # its products of r's rows
            backs: list = [None] * world
            dist.all_gather_object(backs, (back.float().cpu(), outs), group=group)
            want = torch.cat([
                backs[d][0][sum(backs[d][1][:rank]) : sum(backs[d][1][: rank + 1])] for d in range(world)
            ])  # fmt: skip
            error = None
            try:
                assert_close(got.float().cpu(), want, 1e-2, f"rank {rank} combine call {call}")
            except AssertionError as e:
                error = f"combine call {call}: {e}"
            assert_on_every_rank(error, group)


# --- the tensor-parallel fused choices on NVSHMEM workspaces --------------------------------------------------------

# Families whose kernels come from csrc (built by scripts/gpu-check's build step, minutes of device time): not run
# here; the others are every registered choice.
_BUILT = ("cublas_pipelined", "ag_stages", "rs_stages", "cutlass", "rs_ring")
_BUILT_NAMES = ("cuda:",)  # the decode family's csrc/gemv_ar.cu choices


def _tp_cases(op: str, world: int, seed: int, group_name: str):
    """(label, args, expected) per shape: every rank's operands drawn from one seed, expected in fp32 by hand."""

    def draw(s: int, *shape):
        g = torch.Generator(device="cuda").manual_seed(seed + 101 * s + len(shape))
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    rank = dist.get_rank()
    k, n = 256, 256
    if op == "all_gather_matmul":
        for rows in (128, 77):
            shards = [draw(s, rows, k) for s in range(world)]
            B = draw(999, k, n) / 16
            yield (
                f"rows {rows}",
                (shards[rank], [B], [None], 0, world, group_name),
                torch.cat(shards).float() @ B.float(),
            )
    elif op == "matmul_reduce_scatter":
        for rows in (128, 40):
            m = world * rows
            As = [draw(s, m, k) for s in range(world)]
            Bs = [draw(500 + s, k, n) / 16 for s in range(world)]
            total = sum(a.float() @ b.float() for a, b in zip(As, Bs))
            yield (
                f"rows {rows}",
                ([As[rank]], [Bs[rank]], None, [m, n], 0, "sum", world, group_name),
                (total[rank * rows : (rank + 1) * rows]),
            )
    else:  # matmul_all_reduce
        for m in (8, 128):
            As = [draw(s, m, k) for s in range(world)]
            Bs = [draw(500 + s, k, n) / 16 for s in range(world)]
            total = sum(a.float() @ b.float() for a, b in zip(As, Bs))
            yield f"m {m}", ([As[rank]], [Bs[rank]], None, [m, n], "sum", group_name), total


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_tp_choices_on_nvshmem_workspaces(op):
    """Every registered choice of the op (but those built from csrc) on NVSHMEM-allocated workspaces: it runs and
    matches, or it declines with its reason (printed: the table of outcomes is the result); none raises or
    differs. Two calls per shape (workspaces and flags reused), outputs from a poisoned allocator."""
    from fluxcompile.lowerings import choices_for

    group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seed = _seed()
    outcomes: dict[str, str] = {}
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=True, wait_timeout_s=20.0):
        for choice in choices_for(op):
            if choice.name == "reference" or choice.family in _BUILT or choice.name.startswith(_BUILT_NAMES):
                continue
            print(f"rank {rank}: {op} {choice.name} ...", flush=True)
            results = []
            for label, args, want in _tp_cases(op, world, seed, group.group_name):
                why = choice.declines(*args)
                if why is not None:
                    results.append(f"{label}: declines ({why})")
                    continue
                error = None
                for call in range(2):
                    poison_allocator(1 << 26)
                    try:
                        got = choice.fn(*args)
                        if op == "all_gather_matmul":
                            got = got[1][0]
                        torch.cuda.synchronize()
                        assert_close(got.float(), want, 1e-2, f"rank {rank} {choice.name} {label} call {call}")
                    except Exception as e:  # every outcome is reported, on every rank
                        error = error or f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                errors: list = [None] * world
                dist.all_gather_object(errors, error, group=group)
                bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
                results.append(f"{label}: {'FAILED ' + '; '.join(bad) if bad else 'ok'}")
            outcomes[choice.name] = " | ".join(results)
            print(f"rank {rank}: {op} {choice.name}: {outcomes[choice.name]}", flush=True)
    if rank == 0:
        print(
            f"== nvshmem choices {op} ({world} PEs)", *(f"{k}: {v}" for k, v in outcomes.items()), sep="\n", flush=True
        )
    failed = {k: v for k, v in outcomes.items() if "FAILED" in v}
    assert not failed, failed


def test_moe_vdev_dispatch_in_cuda_graph():
    """The vdev dispatch captured in a CUDA graph (after an eager call made its buffers) and replayed with new rows in
    the captured input (same routing), NaN-filled outputs before each replay."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dispatch = torch.ops.fluxcompile.all_to_all_matmul.default
    with config.patch(implementations=IMPLEMENTATIONS, check_signals=False):
        g = torch.Generator().manual_seed(_seed())
        w1 = torch.randn(2, 64, 32, generator=g).to(device="cuda", dtype=torch.bfloat16) / 8
        rows, splits = _moe_case(_seed(), world)
        ins, outs = splits[rank], [splits[s][rank] for s in range(world)]
        received = sum(outs)
        offs = torch.tensor([received // 2, received], dtype=torch.int32, device="cuda")
        A = rows[rank].clone()
        args = (A, [w1], [None], outs, ins, group.group_name)
        dispatch(*args, offs=offs, choice="vdev")  # eager: the buffers
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dispatch(*args, offs=offs, choice="vdev")
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dist.barrier(group)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got_A, (got_h,) = dispatch(*args, offs=offs, choice="vdev")
        for replay in range(3):
            for s in range(world):  # every rank draws every rank's rows alike
                torch.manual_seed(1000 * replay + s)
                rows[s] = torch.randn(rows[s].shape, device="cuda").to(torch.bfloat16)
            A.copy_(rows[rank])
            got_A.fill_(float("nan"))
            got_h.fill_(float("nan"))
            torch.cuda.synchronize()
            dist.barrier(group)
            graph.replay()
            torch.cuda.synchronize()
            want_A = _exchanged(rows, splits, rank)
            error = None
            try:
                torch.testing.assert_close(got_A, want_A, rtol=0, atol=0)
                assert_close(got_h, torch._grouped_mm(want_A, w1, offs=offs), 1e-2, f"rank {rank} replay {replay}")
            except AssertionError as e:
                error = f"replay {replay}: {e}"
            assert_on_every_rank(error, group)
