"""Collective algorithms written in the schedule language. Each returns a traced ``Program``."""

from __future__ import annotations

from .program import INPUT, OUTPUT, SCRATCH, Program, chunk


def ring_all_gather(num_ranks: int, reverse: bool = False) -> Program:
    """Each rank's block travels once around the ring (R-1 hops); middle hops fuse to rcs. ``reverse``: the
    blocks travel from r to r - 1, so rank r receives r + 1's block first, then r + 2's, ... (Flux's order)."""
    R = num_ranks
    step = -1 if reverse else 1
    with Program(f"ring_all_gather_{R}{'_reverse' if reverse else ''}", "all_gather", R) as p:
        for r in range(R):
            c = chunk(INPUT, r, 0).copy(r, OUTPUT, r)
            for k in range(1, R):
                c = c.copy((r + step * k) % R, OUTPUT, r)
    return p


def direct_all_gather(num_ranks: int) -> Program:
    """Every rank sends its block straight to every rank."""
    R = num_ranks
    with Program(f"direct_all_gather_{R}", "all_gather", R) as p:
        for r in range(R):
            for q in range(R):
                chunk(INPUT, r, 0).copy(q, OUTPUT, r)
    return p


def ring_reduce_scatter(num_ranks: int) -> Program:
    """Block r starts at rank r+1 and is reduced along the ring, ending at rank r (rrs in between)."""
    R = num_ranks
    with Program(f"ring_reduce_scatter_{R}", "reduce_scatter", R) as p:
        for r in range(R):
            c = chunk(INPUT, (r + 1) % R, r)
            for k in range(2, R):
                c = chunk(INPUT, (r + k) % R, r).reduce(c)
            out = chunk(INPUT, r, r).copy(r, OUTPUT, 0)
            if R > 1:
                out.reduce(c)
    return p


def direct_reduce_scatter(num_ranks: int) -> Program:
    """Rank r receives block r from every rank and reduces it into its output."""
    R = num_ranks
    with Program(f"direct_reduce_scatter_{R}", "reduce_scatter", R) as p:
        for r in range(R):
            out = chunk(INPUT, r, r).copy(r, OUTPUT, 0)
            for q in range(R):
                if q != r:
                    out = out.reduce(chunk(INPUT, q, r))
    return p


def ring_all_reduce(num_ranks: int) -> Program:
    """Ring reduce-scatter then ring all-gather over R blocks, in the output buffer."""
    R = num_ranks
    with Program(f"ring_all_reduce_{R}", "all_reduce", R, chunk_factor=R) as p:
        for r in range(R):
            chunk(INPUT, r, 0, size=R).copy(r, OUTPUT, 0)
        for i in range(R):
            c = chunk(OUTPUT, (i + 1) % R, i)
            for k in range(2, R + 1):
                c = chunk(OUTPUT, (i + k) % R, i).reduce(c)
            for k in range(1, R):
                c = c.copy((i + k) % R, OUTPUT, i)
    return p


def one_shot_all_reduce(num_ranks: int) -> Program:
    """Every rank pulls every other rank's whole buffer and reduces it locally (latency-optimal)."""
    R = num_ranks
    with Program(f"one_shot_all_reduce_{R}", "all_reduce", R) as p:
        for r in range(R):
            out = chunk(INPUT, r, 0).copy(r, OUTPUT, 0)
            for q in range(R):
                if q != r:
                    out = out.reduce(chunk(INPUT, q, 0))
    return p


def two_shot_all_reduce(num_ranks: int) -> Program:
    """Direct reduce-scatter of R blocks, then direct all-gather of the reduced blocks."""
    R = num_ranks
    with Program(f"two_shot_all_reduce_{R}", "all_reduce", R, chunk_factor=R) as p:
        for i in range(R):
            out = chunk(INPUT, i, i).copy(i, OUTPUT, i)
            for q in range(R):
                if q != i:
                    out = out.reduce(chunk(INPUT, q, i))
            for q in range(R):
                if q != i:
                    out.copy(q, OUTPUT, i)
    return p


def direct_all_to_all(num_ranks: int) -> Program:
    R = num_ranks
    with Program(f"direct_all_to_all_{R}", "all_to_all", R) as p:
        for r in range(R):
            for q in range(R):
                chunk(INPUT, r, q).copy(q, OUTPUT, r)
    return p


def two_step_all_to_all(num_nodes: int, gpus_per_node: int) -> Program:
    """GC3 Figure 1: input block (n, g) of rank (m, i) goes to scratch[(m, g)][(n, i)] inside node m,
    then one coalesced G-block transfer per remote node lands it in output[(n, g)][(m, i)]."""
    N, G = num_nodes, gpus_per_node
    R = N * G

    def rk(n: int, g: int) -> int:
        return n * G + g

    with Program(f"two_step_all_to_all_{N}x{G}", "all_to_all", R) as p:
        for n in range(N):
            for g in range(G):
                for m in range(N):
                    for i in range(G):
                        c = chunk(INPUT, rk(m, i), rk(n, g))
                        if n == m:
                            c.copy(rk(n, g), OUTPUT, rk(m, i))
                        else:
                            c.copy(rk(m, g), SCRATCH, rk(n, i))
        for m in range(N):
            for g in range(G):
                for n in range(N):
                    if n != m:
                        chunk(SCRATCH, rk(m, g), n * G, size=G).copy(rk(n, g), OUTPUT, m * G)
    return p


def hierarchical_all_reduce(num_nodes: int, gpus_per_node: int) -> Program:
    """Intra-node ring reduce-scatter of G blocks, ring all-reduce of block g across the nodes'
    GPUs g (reduce along nodes 0..N-1, then broadcast back), intra-node ring all-gather."""
    N, G = num_nodes, gpus_per_node
    R = N * G

    def rk(n: int, g: int) -> int:
        return n * G + g

    with Program(f"hierarchical_all_reduce_{N}x{G}", "all_reduce", R, chunk_factor=G) as p:
        for r in range(R):
            chunk(INPUT, r, 0, size=G).copy(r, OUTPUT, 0)
        block = {}
        for n in range(N):
            for j in range(G):
                c = chunk(OUTPUT, rk(n, (j + 1) % G), j)
                for k in range(2, G + 1):
                    c = chunk(OUTPUT, rk(n, (j + k) % G), j).reduce(c)
                block[n, j] = c  # node n's partial sum of block j, at GPU j
        for j in range(G):
            c = block[0, j]
            for n in range(1, N):
                c = block[n, j].reduce(c)
            # broadcast the total from node N-1 to 0, 1, ..., N-2
            for n in range(N - 1):
                c = c.copy(rk(n, j), OUTPUT, j)
        for n in range(N):
            for j in range(G):
                c = chunk(OUTPUT, rk(n, j), j)
                for k in range(1, G):
                    c = c.copy(rk(n, (j + k) % G), OUTPUT, j)
    return p


def all_to_next(num_nodes: int, gpus_per_node: int) -> Program:
    """GC3 section 6.4 / Figure 10: rank r's buffer goes to rank r+1. Inside a node it is one
    direct send; across nodes the last GPU scatters its G blocks over the node's GPUs so that G
    inter-node links carry them in parallel, and they are gathered at GPU 0 of the next node."""
    N, G = num_nodes, gpus_per_node
    R = N * G

    def rk(n: int, g: int) -> int:
        return n * G + g

    with Program(f"all_to_next_{N}x{G}", "all_to_next", R, chunk_factor=G) as p:
        for n in range(N):
            for g in range(G):
                if g != G - 1:
                    chunk(INPUT, rk(n, g), 0, size=G).copy(rk(n, g + 1), OUTPUT, 0)
                    continue
                if n == N - 1:
                    continue
                for i in range(G):
                    c = chunk(INPUT, rk(n, g), i)
                    if i == 0:
                        c = c.copy(rk(n, 0), SCRATCH, 0)
                        c.copy(rk(n + 1, 0), OUTPUT, 0)
                    elif i == G - 1:
                        c = c.copy(rk(n + 1, i), SCRATCH, i)
                        c.copy(rk(n + 1, 0), OUTPUT, i)
                    else:
                        c = c.copy(rk(n, i), SCRATCH, 0)
                        c = c.copy(rk(n + 1, i), SCRATCH, i)
                        c.copy(rk(n + 1, 0), OUTPUT, i)
    return p


FLAT = {
    "ring_all_gather": ring_all_gather,
    "direct_all_gather": direct_all_gather,
    "ring_reduce_scatter": ring_reduce_scatter,
    "direct_reduce_scatter": direct_reduce_scatter,
    "ring_all_reduce": ring_all_reduce,
    "one_shot_all_reduce": one_shot_all_reduce,
    "two_shot_all_reduce": two_shot_all_reduce,
    "direct_all_to_all": direct_all_to_all,
}
HIERARCHICAL = {
    "two_step_all_to_all": two_step_all_to_all,
    "hierarchical_all_reduce": hierarchical_all_reduce,
    "all_to_next": all_to_next,
}
