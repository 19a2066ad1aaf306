"""fluxcompile.schedules: the chunk language, its checker, compiler and CPU executor (pure CPU)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from fluxcompile.schedules import (
    INPUT,
    OUTPUT,
    SCRATCH,
    CheckError,
    Collective,
    DeadlockError,
    Instr,
    Plan,
    Program,
    ProgramError,
    RankPlan,
    Threadblock,
    check_deadlock,
    check_program,
    chunk,
    compile_program,
    execute,
    library,
    run,
)
from fluxcompile.schedules.cpu_executor import interpret

SIZES = (2, 3, 4, 8, 16)
# ranks -> (nodes, gpus per node) for the hierarchical programs; 2 and 3 do not factor as N>=2, G>=2
FACTORS = {4: (2, 2), 8: (2, 4), 16: (4, 4)}


def _expected(collective: str, xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    R = len(xs)
    if collective == "all_gather":
        return [torch.cat(xs)] * R
    if collective == "reduce_scatter":
        return list(torch.stack(xs).sum(0).chunk(R))
    if collective == "all_reduce":
        return [torch.stack(xs).sum(0)] * R
    if collective == "all_to_all":
        blocks = [x.chunk(R) for x in xs]
        return [torch.cat([blocks[q][r] for q in range(R)]) for r in range(R)]
    if collective == "all_to_next":
        return [None, *xs[:-1]]
    raise AssertionError(collective)


def _inputs(prog: Program, rows_per_chunk: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(prog.in_chunks * rows_per_chunk, 3, generator=g, dtype=torch.float64) for _ in range(prog.num_ranks)
    ]


def _check_numerics(prog: Program, instances: int = 1) -> Plan:
    plan = compile_program(prog, instances=instances)
    check_deadlock(plan)
    xs = _inputs(prog, rows_per_chunk=2 * instances)
    outs = execute(plan, xs)
    for r, (got, want) in enumerate(zip(outs, _expected(prog.collective.name, xs))):
        if want is not None:
            torch.testing.assert_close(got, want, msg=lambda m, r=r: f"{prog.name} rank {r}: {m}")
    return plan


def _cases():
    for name, f in library.FLAT.items():
        for R in SIZES:
            yield pytest.param(f, (R,), id=f"{name}-{R}")
    for name, f in library.HIERARCHICAL.items():
        for R in SIZES:
            if R in FACTORS:
                N, G = FACTORS[R]
                yield pytest.param(f, (N, G), id=f"{name}-{R}={N}x{G}")
            else:
                yield pytest.param(
                    f, None, id=f"{name}-{R}-skip-not-NxG", marks=pytest.mark.skip(reason=f"{R} is not N x G, N,G >= 2")
                )


@pytest.mark.parametrize(("factory", "args"), list(_cases()))
def test_library_program(factory, args):
    prog = factory(*args)
    check_program(prog)
    _check_numerics(prog)


@pytest.mark.parametrize(
    ("factory", "args"),
    [
        (library.ring_all_reduce, (4,)),
        (library.ring_all_gather, (3,)),
        (library.ring_reduce_scatter, (4,)),
        (library.two_step_all_to_all, (2, 2)),
        (library.all_to_next, (2, 3)),
        (library.hierarchical_all_reduce, (2, 2)),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
@pytest.mark.parametrize("instances", [2, 3])
def test_instances(factory, args, instances):
    prog = factory(*args)
    check_program(prog, instances=instances)
    plan = _check_numerics(prog, instances=instances)
    # every instance runs on its own channel, so there are at least `instances` threadblocks per rank
    assert plan.instances == instances
    assert plan.in_chunks == prog.in_chunks * instances
    assert all(len(rp.threadblocks) >= instances for rp in plan.ranks if any(tb.instrs for tb in rp.threadblocks))


def test_fused_instructions_in_rings():
    ops = compile_program(library.ring_all_reduce(4)).op_counts()
    assert ops.get("rrcs", 0) > 0 and ops.get("rcs", 0) > 0
    ops = compile_program(library.ring_reduce_scatter(4)).op_counts()
    assert ops.get("rrs", 0) > 0  # partial sums never stored in the middle of the ring
    # one threadblock per rank for a ring: receive from r-1, send to r+1
    plan = compile_program(library.ring_all_reduce(4))
    for rp in plan.ranks:
        assert [(tb.send_peer, tb.recv_peer) for tb in rp.threadblocks] == [((rp.rank + 1) % 4, (rp.rank - 1) % 4)]
    unfused = compile_program(library.ring_all_reduce(4), fuse_instructions=False)
    assert set(unfused.op_counts()) <= {"send", "recv", "copy", "rrc"}
    xs = _inputs(library.ring_all_reduce(4))
    for a, b in zip(execute(plan, xs), execute(unfused, xs)):
        torch.testing.assert_close(a, b)


def test_missing_contribution_rejected():
    with Program("bad_ag", "all_gather", 4) as p:
        for r in range(4):
            for q in range(4):
                if (r, q) != (3, 2):
                    chunk(INPUT, r, 0).copy(q, OUTPUT, r)
    with pytest.raises(CheckError, match=r"output\[2\]\[3\] is never written"):
        check_program(p)

    with Program("bad_ar", "all_reduce", 4) as p:
        for r in range(4):
            out = chunk(INPUT, r, 0).copy(r, OUTPUT, 0)
            for q in range(4):
                if q != r and not (r == 2 and q == 3):
                    out = out.reduce(chunk(INPUT, q, 0))
    with pytest.raises(CheckError, match=r"output\[2\]\[0\] is missing input\[3\]\[0\]"):
        check_program(p)


def test_duplicated_contribution_rejected():
    with Program("dup_rs", "reduce_scatter", 4) as p:
        for r in range(4):
            out = chunk(INPUT, r, r).copy(r, OUTPUT, 0)
            for q in range(4):
                if q != r:
                    out = out.reduce(chunk(INPUT, q, r))
            if r == 2:
                out.reduce(chunk(INPUT, 0, 2))
    with pytest.raises(CheckError, match=r"output\[2\]\[0\] has input\[0\]\[2\] twice"):
        check_program(p)


def test_wrong_source_and_uninitialized_rejected():
    with Program("swap", "all_to_all", 2) as p:
        for r in range(2):
            for q in range(2):
                chunk(INPUT, r, 1 - q).copy(q, OUTPUT, r)
    with pytest.raises(CheckError, match=r"output\[0\]\[0\] is missing input\[0\]\[0\]"):
        check_program(p)
    with Program("uninit", "all_reduce", 2) as p:
        chunk("scratch", 0, 0).copy(1, OUTPUT, 0)
    with pytest.raises(CheckError, match=r"reads uninitialized scratch\[0\]\[0\]"):
        check_program(p)


def test_stale_reference_and_bad_slot_rejected():
    with Program("stale", "all_reduce", 2):
        old = chunk(OUTPUT, 1, 0)
        chunk(INPUT, 0, 0).copy(1, OUTPUT, 0)
        with pytest.raises(ProgramError, match="overwritten"):
            old.copy(0, OUTPUT, 0)
        with pytest.raises(ProgramError, match="out of range"):
            chunk(INPUT, 2, 0)
        with pytest.raises(ProgramError, match="unknown hint"):
            chunk(INPUT, 0, 0).copy(1, OUTPUT, 0, tb=3)
    with pytest.raises(ProgramError, match="outside"):
        chunk(INPUT, 0, 0)


def _deadlock_plan() -> Plan:
    def rank(r: int) -> RankPlan:
        peer = 1 - r
        return RankPlan(
            r,
            [
                Threadblock(
                    peer,
                    peer,
                    0,
                    [Instr("recv", dst_buf=OUTPUT, dst_index=peer), Instr("send", src_buf=INPUT, src_index=0)],
                )
            ],
        )

    return Plan("recv_first", "all_gather", 2, 1, 2, [0, 0], 1, [rank(0), rank(1)])


def test_deadlock_rejected_with_cycle():
    plan = _deadlock_plan()
    with pytest.raises(DeadlockError, match=r"deadlock cycle: rank 0 tb 0 instr \d \((recv|send)") as e:
        check_deadlock(plan)
    msg = str(e.value)
    for part in ("rank 0 tb 0 instr 0 (recv from 1)", "rank 1 tb 0 instr 1 (send to 0)", "rank 1 tb 0 instr 0"):
        assert part in msg, msg
    with pytest.raises(DeadlockError, match=r"rank 0 tb 0 instr 0 \(recv\) waits for a message from rank 1"):
        execute(plan, [torch.zeros(2), torch.zeros(2)])
    # swapping one rank's order (send first) breaks the cycle
    plan.ranks[0].threadblocks[0].instrs.reverse()
    check_deadlock(plan)
    out = execute(plan, [torch.ones(1), 2 * torch.ones(1)])
    assert out[0][1].item() == 2 and out[1][0].item() == 1


def test_unmatched_send_rejected():
    plan = _deadlock_plan()
    del plan.ranks[1].threadblocks[0].instrs[0]
    with pytest.raises(DeadlockError, match=r"channel 0->1 ch 0: 1 send\(s\) but 0 receive\(s\)"):
        check_deadlock(plan)


def test_plan_json_round_trip():
    plan = compile_program(library.two_step_all_to_all(2, 2), instances=2)
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    xs = _inputs(library.two_step_all_to_all(2, 2), rows_per_chunk=2)
    for a, b in zip(execute(back, xs), execute(plan, xs)):
        torch.testing.assert_close(a, b)


def test_manual_threadblocks_and_channels():
    # a 2-rank exchange with explicit threadblocks (GC3 5.4)
    with Program("manual", "all_gather", 2) as p:
        for r in range(2):
            chunk(INPUT, r, 0).copy(r, OUTPUT, r, sendtb=0)
            chunk(INPUT, r, 0).copy(1 - r, OUTPUT, r, sendtb=1, recvtb=2)
    plan = _check_numerics(p)
    assert [len(rp.threadblocks) for rp in plan.ranks] == [3, 3]
    # channel directives give two parallel connections to the same peer
    with Program("channels", "all_gather", 2, chunk_factor=2) as p:
        for r in range(2):
            for i in range(2):
                chunk(INPUT, r, i).copy(r, OUTPUT, 2 * r + i)
                chunk(INPUT, r, i).copy(1 - r, OUTPUT, 2 * r + i, ch=i)
    plan = _check_numerics(p)
    assert {tb.channel for tb in plan.ranks[0].threadblocks} == {0, 1}
    # manual threadblocks on some operations only are refused (as in GC3)
    with Program("partial", "all_gather", 2) as p:
        chunk(INPUT, 0, 0).copy(1, OUTPUT, 0, sendtb=0, recvtb=0)
        chunk(INPUT, 1, 0).copy(0, OUTPUT, 1)
    with pytest.raises(ProgramError, match="every operation"):
        compile_program(p, check=False)


def test_run_helper_and_bad_arguments():
    prog = library.ring_all_reduce(3)
    xs = _inputs(prog)
    for out in run(prog, xs):
        torch.testing.assert_close(out, sum(xs))
    for out in run("ring_all_reduce", xs):
        torch.testing.assert_close(out, sum(xs))
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        run(prog, xs[0], group=object())
    with pytest.raises(ValueError, match="no group"):
        run(prog, xs, group=object())


class _Free(Collective):
    """No post-condition: random programs are compared with the reference interpreter instead."""

    name = "free"

    def in_chunks(self) -> int:
        return 4 * self.chunk_factor

    def out_chunks(self) -> int:
        return 4 * self.chunk_factor

    def expected(self, rank: int, index: int) -> Counter | None:
        return None


def _random_program(rng: random.Random, num_ranks: int, num_ops: int) -> Program:
    with Program("random", _Free(num_ranks), num_ranks) as p:
        for _ in range(num_ops):
            size = rng.choice([1, 1, 1, 2])
            sb, db = rng.choice([INPUT, OUTPUT, SCRATCH]), rng.choice([OUTPUT, OUTPUT, SCRATCH, INPUT])
            sr, dr = rng.randrange(num_ranks), rng.randrange(num_ranks)
            si, di = rng.randrange(5 - size), rng.randrange(5 - size)
            if (sb, sr) == (db, dr) and abs(si - di) < size:
                continue  # overlapping ranges of one op: piecewise (instances) and whole copies differ
            hints = {"ch": rng.randrange(2)} if rng.random() < 0.2 else {}
            src = chunk(sb, sr, si, size)
            if rng.random() < 0.5:
                src.copy(dr, db, di, **hints)
            else:
                chunk(db, dr, di, size).reduce(src, **hints)
    return p


@pytest.mark.parametrize("seed", range(60))
def test_random_programs_match_reference(seed):
    """Lowering, fusion, ordering and threadblock assignment keep the program's meaning and never
    deadlock, for arbitrary (not collective-shaped) programs."""
    rng = random.Random(seed)
    prog = _random_program(rng, rng.choice([2, 3, 4]), rng.randrange(5, 40))
    instances = rng.choice([1, 1, 2])
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(prog.in_chunks * 2 * instances, generator=g, dtype=torch.float64) for _ in range(prog.num_ranks)]
    want = interpret(prog, xs)
    for fused in (True, False):
        plan = compile_program(prog, instances=instances, fuse_instructions=fused, check=False)
        check_deadlock(plan)
        for r, (a, b) in enumerate(zip(execute(plan, xs), want)):
            torch.testing.assert_close(a, b, msg=lambda m, r=r, f=fused: f"seed {seed} fused={f} rank {r}: {m}")


@pytest.mark.parametrize(("N", "G"), [(1, 4), (4, 1), (3, 2), (2, 3)])
@pytest.mark.parametrize(
    "factory",
    [library.two_step_all_to_all, library.hierarchical_all_reduce, library.all_to_next],
    ids=lambda f: f.__name__,
)
def test_hierarchical_uneven_shapes(factory, N, G):
    prog = factory(N, G)
    check_program(prog)
    _check_numerics(prog)


def test_program_chunk_counts():
    p = Program("ag", "all_gather", 4, in_chunks=2)
    assert (p.in_chunks, p.out_chunks) == (2, 8)
    p = Program("rs", "reduce_scatter", 4, out_chunks=3)
    assert (p.in_chunks, p.out_chunks) == (12, 3)
    with pytest.raises(ProgramError, match="multiple of 4"):
        Program("a2a", "all_to_all", 4, in_chunks=6)
    with pytest.raises(ProgramError, match="disagrees"):
        Program("ag", "all_gather", 4, in_chunks=2, out_chunks=4)
    with pytest.raises(ProgramError, match="unknown collective"):
        Program("x", "broadcast_all", 4)


def test_two_senders_on_one_channel_rejected():
    plan = _deadlock_plan()
    plan.ranks[0].threadblocks.append(Threadblock(1, None, 0, [Instr("send", src_buf=INPUT, src_index=0)]))
    with pytest.raises(DeadlockError, match="rank 0: threadblocks 0 and 1 both send to 1 on channel 0"):
        check_deadlock(plan)


@pytest.mark.parametrize("seed", range(60))
def test_random_manual_threadblocks(seed):
    """Manual sendtb/recvtb (GC3 5.4): either refused for breaking the one-peer-per-direction rule,
    or compiled to a deadlock-free plan that matches the reference interpreter."""
    rng = random.Random(seed)
    R = rng.choice([2, 3])
    with Program("manual_random", _Free(R), R) as p:
        for _ in range(rng.randrange(2, 10)):
            sb, db = rng.choice([INPUT, OUTPUT, SCRATCH]), rng.choice([OUTPUT, SCRATCH])
            sr, dr, si, di = rng.randrange(R), rng.randrange(R), rng.randrange(4), rng.randrange(4)
            if (sb, sr, si) == (db, dr, di):
                continue
            hints = {"sendtb": rng.randrange(3), "recvtb": rng.randrange(3)}
            if rng.random() < 0.5:
                chunk(sb, sr, si).copy(dr, db, di, **hints)
            else:
                chunk(db, dr, di).reduce(chunk(sb, sr, si), **hints)
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(R)]
    try:
        plan = compile_program(p, check=False)
    except ProgramError as e:
        assert "cannot also" in str(e) or "channel" in str(e)
        return
    check_deadlock(plan)
    for a, b in zip(execute(plan, xs), interpret(p, xs)):
        torch.testing.assert_close(a, b)


def test_ring_order_of_the_fused_choices_is_the_library_rings():
    """The exchange's ring order (symm_mem/exchange.py), in which the AG / RS choices take their peers' blocks, is
    the arrival order of library.ring_all_gather(reverse=True): rank + 1 first, for every world size the checker
    covers."""
    from fluxcompile.schedules.orders import arrival_order
    from fluxcompile.symm_mem.exchange import ring_order

    for world in SIZES:
        ring = library.ring_all_gather(world, reverse=True)
        for rank in range(world):
            assert list(ring_order(rank, world)) == arrival_order(ring, rank)
    # The forward ring delivers the other way round: rank - 1 first.
    assert arrival_order(library.ring_all_gather(4), 0) == [3, 2, 1]
