"""Block layout of the Dask engine: one contiguous 2-D block of C per worker.

This module covers: the worker grid (``pr x pc``, near square, as SUMMA's),
each worker's share of C in proportion to its throughput (and which workers
get none because their share would make the run slower), the blocks' edges
snapped onto allowed cuts (the output chunks' edges, or a quantum), the cell
grid the graph runs over (row groups by the union of the groups' column
edges, split further so that one task fits the memory budget), the owner of
every cell, the k groups of a product with fewer blocks than workers
(split-K, reduced along ``distmm.plan.reduction_tree``), and the bytes the
layout moves.
It does *not* cover: which workers exist or how fast they are
(``distmm.engine.dask.workers``), the tasks (``graph``, ``tasks``) or running
them (``eager``, ``lazy``). Everything here is pure: numpy only, no dask.

A worker's cells always form one rectangle of C: the layout splits C into
``pr`` row groups (heights in proportion to the groups' summed throughput),
each row group into its workers' column ranges (widths in proportion to
their throughput). Cells only refine those rectangles.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from distmm.engine.dask.chunks import nearest_cut
from distmm.plan import reduction_tree

__all__ = ["worker_grid", "shares", "BlockLayout", "block_layout", "snap", "split_k", "layout_devices",
           "MIN_BLOCK_SIDE", "MIN_K_GROUP", "MIN_SHARE", "HOST_BANDWIDTH", "TASK_OVERHEAD"]

#: a block smaller than this on a side is not worth a worker: k is split instead
MIN_BLOCK_SIDE = 256
#: a k group shorter than this is not worth a task
MIN_K_GROUP = 2048
#: bytes per second assumed for moving a block's panels to its worker (shares model)
HOST_BANDWIDTH = 5e9
#: smallest share of C a worker is given (below it: nothing)
MIN_SHARE = 0.05
#: seconds of fixed cost per worker taking part (scheduling, a task, a gather)
TASK_OVERHEAD = 0.02


def worker_grid(p: int, m: int, n: int) -> tuple[int, int]:
    """``(pr, pc)`` with ``pr * pc == p`` minimising a block's panels
    (``m / pr + n / pc``, what SUMMA moves per block); ties go to the squarer grid."""
    if p < 1:
        raise ValueError(f"a worker grid needs at least one worker, got {p}")
    best = None
    for pr in range(1, p + 1):
        if p % pr:
            continue
        pc = p // pr
        key = (m / pr + n / pc, abs(pr - pc), pr)
        if best is None or key < best[0]:
            best = (key, (pr, pc))
    return best[1]


def _makespan(rates, m: int, n: int, k: int, itemsize: int, bandwidth: float,
              overhead: float) -> float:
    """Modelled seconds of a product shared in proportion to ``rates`` (flop/s):
    each worker computes its share and receives the panels of a square block
    of its share's area. Every worker computes for the same time (shares follow the rates),
    so the slowest is the one with the largest share, and so the most panels: only the
    fastest worker's time is computed."""
    total = sum(rates)
    r = max(rates)
    share = r / total
    side = math.sqrt(share * m * n)
    panels = min(side, m) + min(side, n)
    return share * 2.0 * m * n * k / r + panels * k * itemsize / bandwidth + overhead


def shares(gflops, m: int, n: int, k: int, itemsize: int = 8, *,
           bandwidth: float = HOST_BANDWIDTH, overhead: float = TASK_OVERHEAD,
           min_share: float = MIN_SHARE) -> tuple[float, ...]:
    """Each worker's share of C (summing to 1), in proportion to its GFLOP/s.

    Workers join fastest first, and only while the modelled run time
    (``_makespan``: compute of the share, panels moved at ``bandwidth``, a
    fixed ``overhead``) gets shorter: a CPU worker beside a GPU gets 0 when its
    share would make the run slower than the GPU alone. A share under
    ``min_share`` is dropped too: a few percent gained on paper are lost to
    a straggler or an error of the model. Ties keep the
    workers' order. (A product too small to give every worker a block is
    cut into fewer blocks by ``block_layout``.)
    """
    rates = [max(float(g), 0.0) * 1e9 for g in gflops]
    if not rates:
        return ()
    order = sorted(range(len(rates)), key=lambda i: (-rates[i], i))
    if rates[order[0]] <= 0:
        rates = [1.0] * len(rates)
    chosen = [order[0]]
    best = _makespan([rates[order[0]]], m, n, k, itemsize, bandwidth, overhead)
    for i in order[1:]:
        if rates[i] <= 0:
            break
        t = _makespan([rates[j] for j in chosen + [i]], m, n, k, itemsize, bandwidth, overhead)
        if t >= best:
            break
        chosen.append(i)
        best = t
    total = sum(rates[i] for i in chosen)
    chosen = [i for i in chosen if rates[i] / total >= min_share] or [order[0]]
    total = sum(rates[i] for i in chosen)
    return tuple(rates[i] / total if i in chosen else 0.0 for i in range(len(rates)))


def snap(ideal, cuts) -> tuple[int, ...]:
    """Move each interior edge of ``ideal`` onto the nearest of ``cuts`` (sorted,
    from 0 to the length); edges that collide merge (a block with no cut
    inside it disappears)."""
    cuts = list(cuts)
    out = [cuts[0]]
    for e in ideal[1:-1]:
        near = nearest_cut(cuts, e)
        if cuts[near] > out[-1] and cuts[near] < cuts[-1]:
            out.append(cuts[near])
    out.append(cuts[-1])
    return tuple(out)


def _proportional(length: int, weights, cuts) -> list[int]:
    """Edges ``0 .. length`` splitting an axis in proportion to ``weights``,
    snapped onto ``cuts``; a part may come out empty (its edges equal)."""
    total = float(sum(weights))
    ideal = [0.0]
    for w in weights:
        ideal.append(ideal[-1] + length * w / total)
    ideal[-1] = length
    out = [0]
    for e in ideal[1:-1]:
        out.append(max(out[-1], cuts[nearest_cut(cuts, e)]))
    out.append(length)
    return out


def _subsplit(lo: int, hi: int, parts: int, cuts) -> list[int]:
    """Interior edges splitting ``[lo, hi)`` into about ``parts`` pieces on ``cuts``."""
    if parts <= 1:
        return []
    inner = [c for c in cuts if lo < c < hi]
    if not inner:
        return []
    ideal = [lo + (hi - lo) * s / parts for s in range(parts + 1)]
    return [e for e in snap(ideal, [lo] + inner + [hi])[1:-1]]


def split_k(k: int, groups: int, tk: int) -> tuple[int, ...]:
    """Edges of ``groups`` k groups of whole ``tk`` blocks (as ``make_plan`` splits k)."""
    if not k:
        return (0, 0)
    blocks = math.ceil(k / tk)
    groups = max(1, min(groups, blocks))
    return tuple(min(k, (blocks * s // groups) * tk) for s in range(groups)) + (k,)


@dataclass(frozen=True)
class BlockLayout:
    """Blocks of C per worker unit and the cells the graph runs over.

    ``row_edges``/``col_edges``: the cell grid. ``owner[bi][bj]``: the unit
    (index into the units the layout was made for) computing cell
    ``(bi, bj)``. ``blocks[u]``: unit ``u``'s rectangle ``(r0, r1, c0, c1)``
    (None: it gets nothing). ``k_edges``: the k groups (one: ``(0, k)``);
    ``rotation``: the units partial products go round, starting at the cell's
    owner (empty: every group of a cell runs on its owner, as when the memory budget
    alone split k); ``reduction``: the fixed tree over the groups.
    """

    m: int
    n: int
    k: int
    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    owner: tuple[tuple[int, ...], ...]
    blocks: tuple
    k_edges: tuple[int, ...]
    rotation: tuple[int, ...]
    reduction: tuple[tuple[int, int], ...]

    @property
    def grid(self) -> tuple[int, int]:
        return len(self.row_edges) - 1, len(self.col_edges) - 1

    @property
    def groups(self) -> int:
        return len(self.k_edges) - 1

    def cells(self):
        gm, gn = self.grid
        for bi in range(gm):
            for bj in range(gn):
                yield bi, bj

    def unit_of_partial(self, bi: int, bj: int, g: int) -> int:
        """The unit computing k group ``g`` of cell ``(bi, bj)`` (its owner for g = 0)."""
        base = self.owner[bi][bj]
        if g == 0 or len(self.rotation) <= 1:
            return base
        pos = self.rotation.index(base) if base in self.rotation else 0
        return self.rotation[(pos + g) % len(self.rotation)]

    def unit_of_step(self, bi: int, bj: int, t: int) -> int:
        """The unit running step ``t`` of the reduction: the owner of its destination."""
        return self.unit_of_partial(bi, bj, self.reduction[t][0])

    def area(self, unit: int) -> int:
        blk = self.blocks[unit]
        return 0 if blk is None else (blk[1] - blk[0]) * (blk[3] - blk[2])

    def bytes_moved(self, itemsize: int) -> dict:
        """Bytes the layout moves: ``"panels"``, each unit's A rows and B
        columns over all of k (each moved to it once), ``"partials"``, the
        partials of split cells sent to their reduction, and ``"c"``, the
        result."""
        panels = 0
        for blk in self.blocks:
            if blk is not None:
                r0, r1, c0, c1 = blk
                panels += ((r1 - r0) + (c1 - c0)) * self.k * itemsize
        if self.groups > 1 and len(self.rotation) > 1:  # groups spread over the units
            panels = (self.m + self.n) * self.k * itemsize  # each group's slice, once each
        partials = 0
        for bi, bj in self.cells():
            area = (self.row_edges[bi + 1] - self.row_edges[bi]) * (
                self.col_edges[bj + 1] - self.col_edges[bj])
            for dst, src in self.reduction:
                if self.unit_of_partial(bi, bj, dst) != self.unit_of_partial(bi, bj, src):
                    partials += area * itemsize
        return {"panels": panels, "partials": partials, "c": self.m * self.n * itemsize}


def _axis_cuts(cuts, length: int, quantum: int):
    if cuts is not None:
        cuts = sorted(set(int(c) for c in cuts) | {0, length})
        return cuts
    return sorted(set(range(0, length, max(quantum, 1))) | {length})


def block_layout(m: int, n: int, k: int, weights, *, itemsize: int = 8, row_cuts=None,
                 col_cuts=None, quantum: int = 64, memory_budget: int | None = None,
                 tk: int = 256, k_groups: int | None = None, k_cuts=None,
                 grid: tuple[int, int] | None = None) -> BlockLayout:
    """Lay C out as one rectangle per unit with a positive weight.

    Parameters
    ----------
    weights : sequence of float
        One per unit (a GPU worker, or a CPU worker thread): its share of C
        (``shares``); units with 0 get nothing.
    row_cuts, col_cuts : sequence of int, optional
        Where block edges may lie (the output chunks' edges); default: every
        ``quantum`` elements.
    memory_budget : int, optional
        Bytes one task may hold (its panels, twice, and its cell): blocks over
        it are cut into several cells.
    k_groups : int, optional
        Force the number of k groups; default: split k only when C is too
        small to give every unit a block of ``MIN_BLOCK_SIDE`` squared.
    k_cuts : sequence of int, optional
        Where k group edges may lie (the operands' chunk edges along k);
        groups that would share a chunk merge.
    grid : (int, int), optional
        The worker grid ``(pr, pc)`` (``distmm.engine.dask.locality`` picks it
        by where the operands are); default, or when it does not multiply to
        the units given blocks: ``worker_grid``.
    """
    weights = [max(float(w), 0.0) for w in weights]
    active = [u for u, w in enumerate(weights) if w > 0] or ([0] if weights else [])
    if not active:
        raise ValueError("a block layout needs at least one unit")
    rcuts, ccuts = _axis_cuts(row_cuts, m, quantum), _axis_cuts(col_cuts, n, quantum)
    rotation = tuple(active)
    # too small a C for every unit: fewer blocks, k split over the rest
    if k_groups is None:
        affordable = max(1, (m * n) // (MIN_BLOCK_SIDE * MIN_BLOCK_SIDE))
        groups = 1
        if affordable < len(active):
            keep = sorted(active, key=lambda u: (-weights[u], u))[:affordable]
            groups = max(1, min(math.ceil(len(active) / affordable), k // MIN_K_GROUP))
            active = sorted(keep)
    else:
        groups = max(1, int(k_groups))
    # k groups go round the units only for these reasons (too small a C, or asked for); a
    # k split the memory budget forces below stays with each cell's owner: its partials
    # never cross workers
    spread = groups > 1
    pr, pc = worker_grid(len(active), m, n)
    if grid is not None and grid[0] * grid[1] == len(active):
        pr, pc = int(grid[0]), int(grid[1])
    rows = [active[g * pc:(g + 1) * pc] for g in range(pr)]
    row_edges = _proportional(m, [sum(weights[u] for u in grp) for grp in rows], rcuts)
    blocks: list = [None] * len(weights)
    group_cols = []
    for g, grp in enumerate(rows):
        r0, r1 = row_edges[g], row_edges[g + 1]
        cols = _proportional(n, [weights[u] for u in grp], ccuts)
        group_cols.append(cols)
        for u, c0, c1 in zip(grp, cols[:-1], cols[1:]):
            if r1 > r0 and c1 > c0:
                blocks[u] = (r0, r1, c0, c1)
    k_edges = split_k(k, groups, tk)
    if k_cuts is not None and len(k_edges) > 2:
        k_edges = snap(k_edges, sorted(set(int(c) for c in k_cuts) | {0, k}))
    kg = max(np.diff(k_edges).tolist(), default=0)
    # cells: the groups' row edges and the union of their column edges, cut
    # further where a block's task would overflow the budget
    all_rows, all_cols = set(row_edges), set()
    for cols in group_cols:
        all_cols.update(cols)
    if memory_budget:
        for blk in blocks:
            if blk is None:
                continue
            r0, r1, c0, c1 = blk
            parts = 1
            while parts < 4096:
                rh, cw = math.ceil((r1 - r0) / parts), math.ceil((c1 - c0) / parts)
                if (2 * (rh + cw) * kg + rh * cw) * itemsize <= memory_budget:
                    break
                parts *= 2
            all_rows.update(_subsplit(r0, r1, parts, rcuts))
            all_cols.update(_subsplit(c0, c1, parts, ccuts))
    r_edges = tuple(sorted(all_rows)) if m else (0,)
    c_edges = tuple(sorted(all_cols)) if n else (0,)
    if memory_budget and k:
        # cells as small as the cuts allow and still over the budget: split k
        rh = max(np.diff(r_edges).tolist(), default=0)
        cw = max(np.diff(c_edges).tolist(), default=0)
        room = memory_budget - rh * cw * itemsize
        need = 2 * (rh + cw) * k * itemsize
        if need > max(room, 1) * (len(k_edges) - 1):
            groups = max(len(k_edges) - 1, math.ceil(need / max(room, need / max(k // tk, 1))))
            k_edges = split_k(k, groups, tk)
            if k_cuts is not None and len(k_edges) > 2:
                k_edges = snap(k_edges, sorted(set(int(c) for c in k_cuts) | {0, k}))
    owner = []
    for bi in range(len(r_edges) - 1):
        g = bisect.bisect_right(row_edges, r_edges[bi]) - 1
        g = min(g, len(rows) - 1)
        cols = group_cols[g]
        line = []
        for bj in range(len(c_edges) - 1):
            j = min(bisect.bisect_right(cols, c_edges[bj]) - 1, len(rows[g]) - 1)
            line.append(rows[g][j])
        owner.append(tuple(line))
    return BlockLayout(m, n, k, r_edges, c_edges, tuple(owner), tuple(blocks), k_edges,
                       rotation if spread else (), reduction_tree(len(k_edges) - 1))


def layout_devices(layout, units) -> dict:
    """``(bi, bj, g) -> ("gpu", workers sharing the device)`` for every task of
    ``layout`` whose unit is a GPU worker (the rest run on the CPU)."""
    table = {}
    for bi, bj in layout.cells():
        for g in range(layout.groups):
            unit = units[layout.unit_of_partial(bi, bj, g)]
            if unit.gpu:
                table[(bi, bj, g)] = ("gpu", unit.share_device)
    return table
