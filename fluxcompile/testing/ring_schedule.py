"""A CPU model of the reduce-scatter ring's schedule (lowerings/matmul_reduce_scatter/cutlass.py): every rank's
persistent CUTLASS GEMM as the CTAs of its grid taking their tiles in CUTLASS's order, each tile's epilogue
waiting for the running sums it adds, its count published when the CTA's next tile reaches its epilogue, the
CTAs of a cluster sharing their mainloop's pipeline, and each rank's side stream (its waits on the counters, its
pushes, the arrival and done flags), over calls back to back whose variants and shapes may differ, as
csrc/flux_gemm.cuh's RingEpilogue and csrc/sequences_flux.cpp's ``rs_ring`` issue them.

    outcome = simulate(world=4, calls=[RingCall("256x128x64_c2x1", 1024, 12288, 0)], sm_count=132)
    outcome.deadlock   # what every agent that cannot go on waits for, or [] when every rank finished

Every step that can run runs until none can. Once true, a wait stays true until its own waiter resets it (a
counter, an arrival or done flag), so the order of the steps changes no outcome (``seed`` shuffles it to show so;
``slow`` holds one rank back as far as the flags allow). A deadlock is reported with its wait-for cycle
(``Outcome.cycle``). The model also checks the data: a tile adds the running sums pushed in the same call, and a
push never lands in running sums that the receiver's GEMM of the previous call may still read (``hazards``).

What it holds: the tile order (grid size, raster, clusters, the ring's rotation), the waits, the counts and
flags. What it does not: memory ordering (the fences and release/acquire of the kernel), times, and residency:
every CTA of every rank is resident (each rank its own GPU; the one-GPU harness gives each rank its SMs).

Mirrors, by name, of the kernel's host and device code: :func:`grid_clusters` (CUTLASS's persistent tile
scheduler's grid, ``PersistentTileSchedulerSm90Params::get_grid_shape``, no max-active-clusters hint),
:func:`cta_tiles` (its ``get_work_idx_m_and_n``, unswizzled) and :func:`rotated` (flux_gemm.cuh's ``rotated``).
The chunk, sub-chunk, count and raster rules are the product's own (``sub_chunk``, ``tiles_per_chunk``,
``ring_raster``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator, Sequence

from ..kernels import cutlass_gemm
from ..kernels.cutlass_build import VARIANTS
from ..lowerings.matmul_reduce_scatter import cutlass as rs

MAX_SM_PER_GPC = 18  # CUTLASS's assumption for GH100 (8 GPCs x 9 TPCs x 2 SMs)


@dataclasses.dataclass(frozen=True)
class RingCall:
    """One call of the ring: every rank's ``[m, n]`` partial scattered along ``axis`` with ``variant``."""

    variant: str
    m: int
    n: int
    axis: int


@dataclasses.dataclass
class Outcome:
    deadlock: list[str]  # every blocked agent and what it waits for; [] when every rank finished every call
    cycle: list[str]  # the wait-for cycle through the first blocked CTA: each waits for the next, the last the first
    hazards: list[str]  # data read or overwritten out of turn
    steps: int  # steps the model ran

    @property
    def ok(self) -> bool:
        return not self.deadlock and not self.hazards


# --- CUTLASS's persistent tile order ----------------------------------------------------------------------


def grid_clusters(sm_count: int, cluster: tuple[int, int], total_clusters: int) -> int:
    """Clusters of the persistent grid for ``sm_count`` SMs (CUTLASS's persistent scheduler, truncated by the
    problem's ``total_clusters``)."""
    size = cluster[0] * cluster[1]
    if size == 1:
        ctas = sm_count
    else:
        gpcs = 1 if sm_count < MAX_SM_PER_GPC else sm_count // MAX_SM_PER_GPC
        ctas = gpcs * (MAX_SM_PER_GPC - MAX_SM_PER_GPC % size)
        residual = 0 if sm_count < MAX_SM_PER_GPC else sm_count % MAX_SM_PER_GPC
        ctas += residual - residual % size
        ctas = min(sm_count, ctas)
    return max(1, min(ctas // size, total_clusters))


def cta_tiles(
    tiles_m: int, tiles_n: int, cluster: tuple[int, int], clusters: int, raster: str
) -> list[list[tuple[int, int]]]:
    """Per CTA of the grid (cluster by cluster, CTA (i, j) of a cluster at ``g * cm * cn + i * cn + j``), the
    scheduler's tiles (m, n) in the order it takes them: cluster g takes the cluster tiles g, g + clusters, ...
    of the problem rounded up to whole clusters, along N (``raster`` "n": consecutive clusters along N) or
    along M; tiles past the problem are the clusters' padding."""
    cm, cn = cluster
    mb_count, nb_count = -(-tiles_m // cm), -(-tiles_n // cn)
    total = mb_count * nb_count
    out = []
    for g in range(clusters):
        order = []
        for c in range(g, total, clusters):
            mb, nb = divmod(c, nb_count) if raster == "n" else divmod(c, mb_count)[::-1]
            order.append((mb, nb))
        for i in range(cm):
            for j in range(cn):
                out.append([(mb * cm + i, nb * cn + j) for mb, nb in order])
    return out


def rotated(idx: int, tiles: int, tile: int, elems: int) -> int:
    """flux_gemm.cuh's ``rotated``: tile ``idx`` of ``tiles`` rotated to start at the tile of element ``elems``."""
    if idx >= tiles or tiles <= 0:
        return idx
    return (idx + (elems // tile) % tiles) % tiles


# --- one rank's call --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tile:
    m: int  # the tile after the rotation
    n: int
    lo: int  # its elements [lo, hi) along the scatter axis
    hi: int
    step: int  # the ring's step its chunk is at on this rank (-1: padding past the axis)
    waits: tuple[int, ...]  # the sub-chunks whose running sums its epilogue loads
    counts: tuple[int, ...]  # the counters its store adds 1 to


@dataclasses.dataclass
class _Plan:
    """A call's geometry at one rank, as the choice and the kernel make it."""

    sub: int
    subs: int  # sub-chunks per chunk
    targets: list[int]  # per sub-chunk: its counter's value once every tile is stored (tiles_per_chunk)
    ctas: list[list[_Tile]]  # a cluster's CTAs consecutive (cta_tiles' order)
    cluster_size: int


def _plan(call: RingCall, rank: int, world: int, sm_count: int) -> _Plan:
    v = VARIANTS[call.variant]
    (tm, tn, _), cluster = v.tile, v.cluster
    m, n, axis = call.m, call.n, call.axis
    chunk = rs.layout(m, n, world, axis)[0]
    tile_axis = tm if axis == 0 else tn
    sub = rs.sub_chunk(chunk, tile_axis)
    tiles_m, tiles_n = -(-m // tm), -(-n // tn)
    total = -(-tiles_m // cluster[0]) * -(-tiles_n // cluster[1])
    clusters = grid_clusters(sm_count, cluster, total)
    nxt = (rank + 1) % world
    extent = m if axis == 0 else n
    ctas = []
    for order in cta_tiles(tiles_m, tiles_n, cluster, clusters, cutlass_gemm.ring_raster(axis)):
        tiles = []
        for tm_i, tn_i in order:
            if axis == 0:
                tm_i = rotated(tm_i, tiles_m, tm, nxt * chunk)
            else:
                tn_i = rotated(tn_i, tiles_n, tn, nxt * chunk)
            lo = tm_i * tm if axis == 0 else tn_i * tn
            hi = min(extent, lo + tile_axis)
            inside_other = tn_i * tn < n if axis == 0 else tm_i * tm < m
            if lo >= extent:
                tiles.append(_Tile(tm_i, tn_i, lo, lo, -1, (), ()))
                continue
            q = lo // chunk
            step = (q - nxt) % world
            waits = () if q == nxt else tuple(range(lo // sub, (hi - 1) // sub + 1))
            counts = tuple(range(lo // sub, (hi - 1) // sub + 1)) if inside_other and q != rank else ()
            tiles.append(_Tile(tm_i, tn_i, lo, hi, step, waits, counts))
        ctas.append(tiles)
    size = cluster[0] * cluster[1]
    targets = cutlass_gemm.tiles_per_chunk(call.variant, m, n, sub, axis)
    return _Plan(sub, chunk // sub, targets, ctas, size)


# --- the model --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Wait:
    ready: Callable[[], bool]
    what: Callable[[], str]
    on: Callable[[], _Agent | None]  # the agent whose next steps would make it ready (the wait-for edge)


class _Agent:
    def __init__(self, rank: int, name: str, body: Iterator[_Wait]):
        self.rank, self.name, self.body = rank, name, body
        self.wait: _Wait | None = None
        self.finished = False
        self._advance()

    def _advance(self) -> None:
        try:
            self.wait = next(self.body)
        except StopIteration:
            self.finished, self.wait = True, None

    def step(self) -> bool:
        if self.finished or not self.wait.ready():
            return False
        self._advance()
        return True

    def __str__(self) -> str:
        return f"{self.name} waits for {self.wait.what()}" if not self.finished else f"{self.name}: finished"


@dataclasses.dataclass
class _Cta:
    """A CTA's progress, for the wait-for edges: its tiles, the next one to store, the counts it holds back."""

    tiles: list[_Tile]
    at: int = 0
    pending: tuple[int, ...] = ()
    agent: _Agent | None = None

    def owes(self, j: int) -> bool:
        return j in self.pending or any(j in t.counts for t in self.tiles[self.at :])


class _Model:
    def __init__(self, world: int, calls: Sequence[RingCall], sm_count: int, coupled: bool, deferred: bool):
        self.world = world
        self.coupled, self.deferred = coupled, deferred
        self.plans = [[_plan(c, r, world, sm_count) for c in calls] for r in range(world)]
        longest = max((c.m if c.axis == 0 else c.n) for c in calls)
        # the finest grain of the running sums the model tracks: a divisor of every call's sub-chunks
        self.unit = math.gcd(*(p.sub for plans in self.plans for p in plans))
        self.counters = [[0] * (longest // self.unit + 1) for _ in range(world)]
        self.arrived = [[0] * (longest // self.unit + 1) for _ in range(world)]
        self.done = [1] * world  # rank r-1 has read its running sums: rank r may push into them
        self.incoming = [[-1] * (longest // self.unit + 1) for _ in range(world)]  # the call each unit came from
        self.gemms_done = [0] * world
        self.main_at = [0] * world  # calls whose main stream's work is complete
        self.side_at = [0] * world  # calls whose side stream's work is complete
        self.ctas: list[list[_Cta]] = [[] for _ in range(world)]  # each rank's GEMM of its current call
        self.hazards: list[str] = []
        self.agents: list[_Agent] = []
        self.mains = [_Agent(r, f"rank {r} main stream", self._main(r)) for r in range(world)]
        self.sides = [_Agent(r, f"rank {r} side stream", self._side(r)) for r in range(world)]
        self.agents += self.mains + self.sides

    def _blocked_cta(self, r: int, pick: Callable[[_Cta], bool]) -> _Agent | None:
        return next((c.agent for c in self.ctas[r] if pick(c) and not c.agent.finished), None)

    # main stream: the GEMM, the arrival flags' reset, the join of the side stream, done at rank + 1
    def _main(self, r: int) -> Iterator[_Wait]:
        for k, plan in enumerate(self.plans[r]):
            epi = [0] * len(plan.ctas)  # per CTA: tiles whose epilogue finished
            self.ctas[r] = [_Cta(tiles) for tiles in plan.ctas]
            for c, cta in enumerate(self.ctas[r]):
                cta.agent = _Agent(r, f"rank {r} call {k} CTA {c}", self._cta(r, k, plan, c, epi))
                self.agents.append(cta.agent)
            yield _Wait(
                lambda: all(c.agent.finished for c in self.ctas[r]),
                lambda: "its GEMM to finish",
                lambda: self._blocked_cta(r, lambda c: True),
            )
            self.gemms_done[r] += 1
            for j in range(plan.subs * self.world):
                self.arrived[r][j] = 0
            yield _Wait(lambda k=k: self.side_at[r] > k, lambda k=k: f"its side stream's call {k}", lambda: self.sides[r])
            self.done[(r + 1) % self.world] = 1
            self.main_at[r] = k + 1

    # side stream: per sub-chunk in push order, wait for its count, reset it, [consume done], push, flag
    def _side(self, r: int) -> Iterator[_Wait]:
        w = self.world
        prev = (r - 1) % w
        for k, plan in enumerate(self.plans[r]):
            yield _Wait(
                lambda k=k: self.main_at[r] >= k, lambda k=k: f"its main stream's call {k - 1} (join)", lambda: self.mains[r]
            )
            first = True
            for step in range(w - 1):
                q = (r + 1 + step) % w
                for j in range(q * plan.subs, (q + 1) * plan.subs):
                    want = plan.targets[j]
                    yield _Wait(
                        lambda j=j, want=want: self.counters[r][j] == want,
                        lambda j=j, want=want, q=q, step=step: f"its counter of sub-chunk {j} (chunk {q}, step {step}): "
                        f"{self.counters[r][j]} of {want} tiles counted",
                        lambda j=j: self._blocked_cta(r, lambda c: c.owes(j)),
                    )
                    self.counters[r][j] = 0
                    if first:
                        yield _Wait(
                            lambda: self.done[r] == 1,
                            lambda: f"done (rank {prev} has read its running sums of the call before)",
                            lambda: self.mains[prev],
                        )
                        self.done[r] = 0
                        first = False
                    if self.gemms_done[prev] < k:
                        self.hazards.append(
                            f"rank {r} call {k} pushed sub-chunk {j} into rank {prev}'s running sums while its GEMM "
                            f"of call {k - 1} may read them"
                        )
                    lo = j * plan.sub // self.unit
                    for u in range(lo, lo + plan.sub // self.unit):
                        self.incoming[prev][u] = k
                    self.arrived[prev][j] = 1
            self.side_at[r] = k + 1

    # a CTA: per tile, [mainloop: the cluster's pipeline] -> [count the last tile] -> epilogue: wait, load, store
    def _cta(self, r: int, k: int, plan: _Plan, c: int, epi: list[int]) -> Iterator[_Wait]:
        me = self.ctas[r][c]
        first = c - c % plan.cluster_size
        partners = range(first, first + plan.cluster_size)
        nxt = (r + 1) % self.world
        for i, t in enumerate(me.tiles):
            where = f"tile ({t.m}, {t.n}) of step {t.step}"
            if self.coupled and i > 0:
                yield _Wait(
                    lambda i=i: all(epi[p] >= i for p in partners),
                    lambda i=i, where=where: f"the mainloop of {where}: its cluster's CTA "
                    f"{next(p for p in partners if epi[p] < i)} is in the epilogue of the tile before",
                    lambda i=i: next((self.ctas[r][p].agent for p in partners if epi[p] < i), None),
                )
            if self.deferred:
                self._count(r, me.pending)
                me.pending = ()
            for j in t.waits:
                yield _Wait(
                    lambda j=j: self.arrived[r][j] != 0,
                    lambda j=j, where=where: f"the epilogue of {where}: rank {nxt}'s running sums of sub-chunk {j}",
                    lambda: self.sides[nxt],
                )
            for u in range(t.lo // self.unit, -(-t.hi // self.unit)) if t.waits else ():
                if self.incoming[r][u] != k:
                    self.hazards.append(
                        f"rank {r} call {k} tile ({t.m}, {t.n}) added running sums of call {self.incoming[r][u]}"
                    )
                    break
            epi[c] = me.at = i + 1
            if self.deferred:
                me.pending = t.counts
            else:
                self._count(r, t.counts)
        self._count(r, me.pending)
        me.pending = ()

    def _count(self, r: int, counters: tuple[int, ...]) -> None:
        for j in counters:
            self.counters[r][j] += 1

    def cycle(self) -> list[str]:
        """The wait-for cycle through the first blocked CTA (each agent waits for the next, the last for the
        first), or the chain to an agent that waits for nothing blocked."""
        start = next((a for a in self.agents if not a.finished and " CTA " in a.name), None)
        start = start or next((a for a in self.agents if not a.finished), None)
        chain: list[_Agent] = []
        a = start
        while a is not None and not a.finished and a not in chain:
            chain.append(a)
            a = a.wait.on()
        if a in chain:
            chain = chain[chain.index(a) :]
        return [str(x) for x in chain]

    def run(self, seed: int | None, slow: int | None = None) -> Outcome:
        rng = random.Random(seed) if seed is not None else None
        steps = 0
        while True:
            moved = False
            self.agents = [a for a in self.agents if not a.finished]
            for lagging in (False, True):  # rank ``slow``'s agents step only where no other agent can
                agents = [a for a in self.agents if (a.rank == slow) == lagging]
                if rng is not None:
                    rng.shuffle(agents)
                for a in agents:
                    while a.step():
                        steps += 1
                        moved = True
                        if rng is not None:
                            break
                    if moved and lagging:
                        break
                if moved:
                    break
            if not moved:
                break
        blocked = [str(a) for a in self.agents if not a.finished]
        return Outcome(blocked, self.cycle() if blocked else [], self.hazards, steps)


def simulate(
    world: int,
    calls: Sequence[RingCall],
    sm_count: int,
    *,
    coupled: bool = True,
    deferred: bool = True,
    seed: int | None = None,
    slow: int | None = None,
) -> Outcome:
    """Run ``calls`` back to back on ``world`` ranks whose GEMMs each have ``sm_count`` SMs. ``coupled``: a CTA's
    next mainloop waits until every CTA of its cluster has finished its epilogue (their TMA multicast shares the
    pipeline's stages, so this holds once a tile has more k-blocks than the pipeline has stages); ``deferred``: a
    tile's count is added when the CTA's next tile reaches its epilogue (the kernel's TileCounts), else at once.
    ``seed``: steps in a shuffled order; ``slow``: a rank whose agents step only where no other agent can (the
    most delayed it can be)."""
    return _Model(world, calls, sm_count, coupled, deferred).run(seed, slow)


def harness_sm_count(world: int, sms: int = 132) -> int:
    """The SMs of each rank's GEMM in the one-GPU harness (testing/one_gpu_ranks.py's ``sm_count``)."""
    from .one_gpu_ranks import RESERVED_SMS

    return max(2, ((sms - RESERVED_SMS) // world) // 2 * 2)
