"""Block placement of the Dask engine as a pure planner: facts in, a ``BlockPlan`` out.

This module covers: the cluster's facts as plain frozen data (``WorkerInfo`` per
worker: address, threads, GPU or not, device, GFLOP/s, device memory;
``ClusterFacts``: the workers, where each persisted operand chunk lives and the
``(holder, reader)`` pairs whose chunks go through CUDA IPC; ``OperandFacts``: an
operand's chunking and item size), the units C is shared between (``units``: one per
GPU worker, one per CPU worker thread), the block layout (``block_layout``: one
contiguous rectangle of C per unit, near-square over the units as SUMMA's grid, sized
by throughput (``shares``), split-K for products with few blocks, cells cut to a memory
budget), the bytes a layout moves for an assignment of units to its positions
(``readers``, ``moved``, ``by_route``, ``cost``, ``partial_bytes``), the search for the
assignment, grid shape and unit set moving the fewest bytes (``choose``; co-located GPU
workers as one unit: ``merged``), and ``plan_blocks``, which puts them together: which
worker computes which block of C, which chunk moves to which worker by which route,
and the estimated bytes and seconds.
It does *not* cover: asking the cluster for those facts (``distmm.engine.dask``:
``placement.cluster_state``, ``workers.worker_info``, ``transfer.ipc_pairs``), the
tasks, or running anything. Pure: numpy and ``distmm.plan`` only; no dask,
distributed or cupy.

Layout
------
A unit's cells always form one rectangle of C: the layout splits C into ``pr`` row
groups (heights in proportion to the groups' summed throughput), each row group into
its units' column ranges (widths in proportion to their throughput). Cells only refine
those rectangles. A unit too slow to shorten the modelled run (``shares``) gets
nothing.

Locality
--------
Everything is in bytes of the operands' chunks as they lie: a chunk held by the worker
that reads it costs nothing; a chunk read by several units of one worker moves to it
once. Chunks held nowhere (``from_client``: scattered by the engine) cost one copy per
worker reading them. The search tries every distinct order of the units when there are
few (``EXACT_LIMIT`` layouts: five distinct GPU workers, or eight units of two kinds),
pairwise swaps from the given order beyond, each over every grid shape the layout
allows.

Routes and their weights
------------------------
A chunk reaches a worker lacking it by one of three routes (``by_route``): ``ipc``, when
one of its holders and the reader are a pair in ``ipc`` (GPU workers of one host whose
CUDA IPC works, device chunks: ``distmm.engine.dask.transfer`` decides), ``nccl`` when
they are a pair in ``nccl`` (GPU workers of different hosts joined by NCCL:
``distmm.engine.dask.nccl_route``), else ``tcp``.
The search minimises ``cost``: TCP bytes plus IPC bytes divided by ``IPC_COST_DIVISOR``
(256) plus NCCL bytes divided by ``NCCL_COST_DIVISOR`` (8), so layouts avoid TCP first
and, among those, move fewer bytes between hosts, then fewer IPC bytes. Why 256: TCP
between workers moves device chunks through host copies; IPC is one device-to-device copy,
over NVLink between two GPUs some hundreds of times faster than TCP's route (the TCP figure
is in ``bench/NOTES.md``); 256, a round power of two below that ratio, keeps IPC bytes
cheap without making them free: each
also costs a dedicated device copy on the holder and the reader, and a handle opened per
task. With no pairs the cost is the bytes. ``ipc_sources`` says which holder each
reader opens a chunk from (the graph's export tasks), by the same rule as ``by_route``.

Examples
--------
>>> from distmm.plan import make_plan
>>> from distmm.plan_blocks import ClusterFacts, OperandFacts, WorkerInfo, plan_blocks
>>> workers = (WorkerInfo("tcp://h:1", 1, True, "0", 1000.0, True),
...            WorkerInfo("tcp://h:2", 1, True, "1", 1000.0, True))
>>> plan = make_plan(4096, 4096, 4096, "float64", workers=2)
>>> bp = plan_blocks(plan, ClusterFacts(workers), OperandFacts(8), OperandFacts(8))
>>> bp.layout.grid, [u.address for u in bp.units]
((1, 2), ['tcp://h:1', 'tcp://h:2'])
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

import numpy as np

from distmm.plan import reduction_tree

__all__ = ["WorkerInfo", "Unit", "units", "OperandFacts", "ClusterFacts", "BlockPlan",
           "plan_blocks", "block_budget", "layout_for", "Move",
           "edges", "locate", "nearest_cut",
           "worker_grid", "shares", "BlockLayout", "block_layout", "snap", "split_k",
           "layout_devices", "readers", "moved", "by_route", "cost", "ipc_sources",
           "partial_bytes", "merged", "grids", "choose", "Choice",
           "MIN_BLOCK_SIDE", "MIN_K_GROUP", "MIN_SHARE", "HOST_BANDWIDTH", "TASK_OVERHEAD",
           "EXACT_LIMIT", "IPC_COST_DIVISOR", "DEVICE_FRACTION"]


# -- chunk offsets along an axis -------------------------------------------------------------

def edges(chunks) -> tuple[int, ...]:
    """Offsets ``0, c0, c0 + c1, ...`` of an axis chunked as ``chunks``."""
    out = [0]
    for c in chunks:
        out.append(out[-1] + int(c))
    return tuple(out)


def locate(offsets: tuple[int, ...], start: int, stop: int) -> tuple[tuple[int, int, int], ...]:
    """Blocks of an axis (given its chunk offsets) overlapping ``[start, stop)``,
    as ``(block, local start, local stop)``; empty chunks are skipped."""
    out = []
    blk = bisect.bisect_right(offsets, start) - 1
    while blk < len(offsets) - 1 and offsets[blk] < stop:
        lo, hi = max(start, offsets[blk]), min(stop, offsets[blk + 1])
        if hi > lo:
            out.append((blk, lo - offsets[blk], hi - offsets[blk]))
        blk += 1
    return tuple(out)


def nearest_cut(cuts, edge: int) -> int:
    """The index in ``cuts`` (sorted) of the cut nearest ``edge``; the lower one on a tie."""
    right = bisect.bisect_left(cuts, edge)
    return min((c for c in (right - 1, right) if 0 <= c < len(cuts)),
               key=lambda c: (abs(cuts[c] - edge), c))



# -- the cluster's facts ---------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerInfo:
    """One worker: its address, threads, whether it runs GPU tasks (and on
    which device), and its throughput in GFLOP/s for sharing C."""

    address: str
    nthreads: int
    gpu: bool
    device: str | None
    gflops: float
    cuda: bool  # the probe found a device (False for a worker marked GPU only by resources)
    device_memory: int | None = None  # the device's total bytes (where the probe found one)
    node: int | None = None  # the worker's emulated node (distmm.emulate), None where none


@dataclass(frozen=True)
class Unit:
    """What the layout gives one block: a GPU worker, or one thread of a CPU worker."""

    address: str
    gpu: bool
    gflops: float
    share_device: int = 1  # GPU workers on the same device as this one (itself included)
    device: str | None = None  # the device's PCI bus id (GPU workers whose probe found one)
    device_memory: int | None = None  # that device's total bytes


def units(workers: list[WorkerInfo]) -> list[Unit]:
    """The layout's units: one per GPU worker (a GPU runs one block at a
    time), one per thread of a CPU worker (its throughput split evenly)."""
    shared: dict = {}
    for w in workers:
        if w.gpu and w.device is not None:
            shared[w.device] = shared.get(w.device, 0) + 1
    out = []
    for w in workers:
        if w.gpu:
            out.append(Unit(w.address, True, w.gflops, shared.get(w.device, 1), w.device,
                            w.device_memory))
        else:
            out += [Unit(w.address, False, w.gflops / w.nthreads)] * w.nthreads
    return out


# -- the block layout ------------------------------------------------------------------------

#: a block smaller than this on a side is not worth a worker: k is split instead
MIN_BLOCK_SIDE = 256
#: a k group shorter than this is not worth a task
MIN_K_GROUP = 2048
#: bytes per second assumed for moving a block's panels to its worker (shares model)
HOST_BANDWIDTH = 5e9
#: a worker slower than this share of the fastest worker is given no part of C
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


def _makespan(total: float, fastest: float, m: int, n: int, k: int, itemsize: int,
              bandwidth: float, overhead: float) -> float:
    """Modelled seconds of a product shared in proportion to the rates (flop/s) of workers
    whose rates sum to ``total``, the fastest ``fastest``: each worker computes its share and
    receives the panels of a square block of its share's area. Every worker computes for the
    same time (shares follow the rates), so the slowest is the one with the largest share,
    and so the most panels: only the fastest worker's time is computed."""
    share = fastest / total
    side = math.sqrt(share * m * n)
    panels = min(side, m) + min(side, n)
    return share * 2.0 * m * n * k / fastest + panels * k * itemsize / bandwidth + overhead


def shares(gflops, m: int, n: int, k: int, itemsize: int = 8, *,
           bandwidth: float = HOST_BANDWIDTH, overhead: float = TASK_OVERHEAD,
           min_share: float = MIN_SHARE) -> tuple[float, ...]:
    """Each worker's share of C (summing to 1), in proportion to its GFLOP/s.

    Workers join fastest first, and only while the modelled run time
    (``_makespan``: compute of the share, panels moved at ``bandwidth``, a
    fixed ``overhead``) gets shorter: a CPU worker beside a GPU gets 0 when its
    share would make the run slower than the GPU alone. A worker slower than
    ``min_share`` of the fastest is dropped too: the few percent it would add on
    paper are lost to a straggler or an error of the model (many equal workers
    all take part, however small each one's share). Ties keep the workers'
    order. (A product too small to give every worker a block is cut into fewer
    blocks by ``block_layout``.)
    """
    rates = [max(float(g), 0.0) * 1e9 for g in gflops]
    if not rates:
        return ()
    order = sorted(range(len(rates)), key=lambda i: (-rates[i], i))
    if rates[order[0]] <= 0:
        rates = [1.0] * len(rates)
    fastest = rates[order[0]]
    chosen, total = [order[0]], fastest
    best = _makespan(total, fastest, m, n, k, itemsize, bandwidth, overhead)
    for i in order[1:]:
        if rates[i] <= 0 or rates[i] < min_share * fastest:
            break
        t = _makespan(total + rates[i], fastest, m, n, k, itemsize, bandwidth, overhead)
        if t >= best:
            break
        chosen.append(i)
        total += rates[i]
        best = t
    kept = set(chosen)
    return tuple(rates[i] / total if i in kept else 0.0 for i in range(len(rates)))


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
        The worker grid ``(pr, pc)`` (``choose`` picks it
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


# -- locality: the bytes an assignment moves, and the search ----------------------------------

#: the most layouts (distinct unit orders times grid shapes) costed in an
#: exhaustive search; beyond, pairwise swaps. Each layout is built and costed in
#: full on the client, so the limit bounds the planning time the search adds per call
EXACT_LIMIT = 1000

#: an IPC byte costs 1 / IPC_COST_DIVISOR of a TCP byte (module docstring: why 256)
IPC_COST_DIVISOR = 256
#: NCCL bytes (device chunks between GPU workers of different hosts) at 1/8 of TCP's: on
#: the same loopback NCCL's sockets moved 4.2-4.6 GB/s, distributed's TCP 0.45 GB/s a worker
#: (``bench/NOTES.md``, the Dask engine across emulated nodes)
NCCL_COST_DIVISOR = 8



def readers(layout, a_chunks, b_chunks, a_name, b_name, a_itemsize: int, b_itemsize: int):
    """Every chunk of A and B the layout's tasks read: ``(key, nbytes,
    positions)``, positions being the layout's unit indices reading it.
    ``a_chunks``/``b_chunks``: the operands' chunk sizes along their two last axes;
    a chunk's key is ``(name, row block, column block)``."""
    a_rows, a_k = edges(a_chunks[-2]), edges(a_chunks[-1])
    b_k, b_cols = edges(b_chunks[-2]), edges(b_chunks[-1])
    k_groups = layout.k_edges
    who: dict = {}
    for bi, bj in layout.cells():
        for g in range(layout.groups):
            u = layout.unit_of_partial(bi, bj, g)
            ks_a = locate(a_k, k_groups[g], k_groups[g + 1])
            ks_b = locate(b_k, k_groups[g], k_groups[g + 1])
            for rb, _, _ in locate(a_rows, layout.row_edges[bi], layout.row_edges[bi + 1]):
                for kb, _, _ in ks_a:
                    who.setdefault((a_name, rb, kb), set()).add(u)
            for kb, _, _ in ks_b:
                for cb, _, _ in locate(b_cols, layout.col_edges[bj], layout.col_edges[bj + 1]):
                    who.setdefault((b_name, kb, cb), set()).add(u)
    out = []
    for key, units_ in who.items():
        name, r, c = key
        if name == a_name:  # A @ A: one array, the same chunks either way
            rows, cols, size = a_rows, a_k, a_itemsize
        else:
            rows, cols, size = b_k, b_cols, b_itemsize
        out.append((key, (rows[r + 1] - rows[r]) * (cols[c + 1] - cols[c]) * size,
                    frozenset(units_)))
    return out


def moved(reads, addresses, where: dict, *, from_client: bool = False) -> int:
    """Bytes the chunks of ``reads`` (``readers``) move when position ``u``
    runs on ``addresses[u]``; ``where``: key -> workers holding it. A chunk
    held nowhere counts as made on one of its readers, or, ``from_client``,
    as sent to each of them."""
    total = 0
    for key, nbytes, units in reads:
        want = {addresses[u] for u in units}
        held = where.get(key)
        if held:
            total += nbytes * len(want.difference(held))
        else:
            total += nbytes * (len(want) if from_client else len(want) - 1)
    return total


def _ipc_holder(held, reader: str, ipc) -> str | None:
    """The holder a reader opens a chunk from through IPC (the first by address), or None."""
    if not ipc:
        return None
    return min((h for h in held if (h, reader) in ipc), default=None)


def _pulled(held, reader: str, ipc, nccl) -> tuple:
    """``(holder, route)``: the holder a reader pulls a chunk from and by which route,
    ``"ipc"`` before ``"nccl"`` (each the first holder by address); ``(None, "tcp")``
    where neither pairs them."""
    holder = _ipc_holder(held, reader, ipc)
    if holder is not None:
        return holder, "ipc"
    holder = _ipc_holder(held, reader, nccl)
    return (holder, "nccl") if holder is not None else (None, "tcp")


def by_route(reads, addresses, where: dict, *, ipc=frozenset(), from_client: bool = False,
             memo: dict | None = None, nccl=frozenset()) -> dict:
    """``moved``'s bytes split by route: ``{"tcp": ..., "ipc": ..., "nccl": ...}``; a
    chunk goes by ``ipc`` to a reader that one of its holders is paired with
    in ``ipc`` (``(holder, reader)`` address pairs), else by ``nccl`` where a holder is
    paired with it in ``nccl``, else by ``tcp``. Chunks
    held nowhere (made on a reader, or scattered) count as ``tcp``. ``memo``: a
    dict kept across calls with the same ``where``, ``ipc`` and ``nccl`` (a layout
    search), remembering each (chunk, reader)'s route."""
    out = {"tcp": 0, "ipc": 0, "nccl": 0}
    for key, nbytes, units in reads:
        want = {addresses[u] for u in units}
        held = where.get(key)
        if held:
            for w in want.difference(held):
                via = None if memo is None else memo.get((key, w))
                if via is None:
                    via = _pulled(held, w, ipc, nccl)[1]
                    if memo is not None:
                        memo[(key, w)] = via
                out[via] += nbytes
        else:
            out["tcp"] += nbytes * (len(want) if from_client else len(want) - 1)
    return out


def cost(routes: dict) -> int:
    """TCP-equivalent bytes of ``by_route``'s split: IPC bytes at 1/``IPC_COST_DIVISOR``,
    NCCL bytes at 1/``NCCL_COST_DIVISOR``."""
    return (int(routes.get("tcp", 0)) + int(routes.get("ipc", 0)) // IPC_COST_DIVISOR
            + int(routes.get("nccl", 0)) // NCCL_COST_DIVISOR)


def ipc_sources(reads, addresses, where: dict, ipc, nccl=frozenset()) -> dict:
    """``(chunk key, reader address) -> holder address`` for every chunk that
    ``by_route`` sends by IPC or NCCL: where the reader's export of it is pulled from
    (``(holder, reader)`` in ``nccl`` says which go through NCCL)."""
    out = {}
    if not ipc and not nccl:
        return out
    for key, _nbytes, units in reads:
        held = where.get(key)
        if not held:
            continue
        for w in sorted({addresses[u] for u in units}.difference(held)):
            h = _pulled(held, w, ipc, nccl)[0]
            if h is not None:
                out[(key, w)] = h
    return out


def partial_bytes(layout, addresses, itemsize: int) -> int:
    """Bytes of the partials of split cells sent to the worker of their reduction."""
    out = 0
    for bi, bj in layout.cells():
        area = (layout.row_edges[bi + 1] - layout.row_edges[bi]) * (
            layout.col_edges[bj + 1] - layout.col_edges[bj])
        for dst, src in layout.reduction:
            a = addresses[layout.unit_of_partial(bi, bj, dst) % len(addresses)]
            b = addresses[layout.unit_of_partial(bi, bj, src) % len(addresses)]
            if a != b:
                out += area * itemsize
    return out


def merged(units) -> list[list]:
    """The unit lists with the GPU workers of each shared device taken as one
    unit (one list per choice of the worker that runs it; empty: no device
    is shared). The unit keeps the device's throughput (the fastest of its
    workers: they measured the same device) and no longer shares it."""
    groups: dict = {}
    for i, u in enumerate(units):
        if u.gpu and getattr(u, "device", None) is not None:
            groups.setdefault(u.device, []).append(i)
    shared = [idx for idx in groups.values() if len(idx) > 1]
    if not shared:
        return []
    out = []
    for pick in itertools.islice(itertools.product(*shared), 64):
        drop = {i for idx in shared for i in idx} - set(pick)
        fast = {i: max(units[j].gflops for j in idx) for idx in shared for i in pick if i in idx}
        out.append([replace(u, gflops=fast[i], share_device=1) if i in fast else u
                    for i, u in enumerate(units) if i not in drop])
    return out


def grids(p: int) -> list[tuple[int, int]]:
    """Every ``(pr, pc)`` with ``pr * pc == p``."""
    return [(r, p // r) for r in range(1, p + 1) if p % r == 0]


def _distinct_orders(sigs) -> int:
    count = math.factorial(len(sigs))
    for c in Counter(sigs).values():
        count //= math.factorial(c)
    return count


def _busy(layout) -> int:
    """Units given a block: a grid whose cuts leave a unit idle is no candidate
    (fewer bytes, but the work no longer shared)."""
    return sum(1 for b in layout.blocks if b is not None)


@dataclass
class Choice:
    """The assignment chosen: ``units`` in layout order, its ``layout`` and
    ``bytes``; ``naive_bytes``: the units in their given order on the default
    grid; ``method``: ``"exact"`` or ``"swaps"``; ``candidates``: layouts costed."""

    units: list
    layout: object
    bytes: int
    naive_bytes: int
    method: str
    candidates: int
    grid: tuple = ()
    tried: dict = field(default_factory=dict)


def choose(units, make_layout, cost, *, orders: bool = True, limit: int = EXACT_LIMIT) -> Choice:
    """The order of ``units`` and grid shape whose layout moves the fewest bytes.

    ``make_layout(units, grid)``: the layout of the units in that order
    (``grid`` None: the default shape); ``cost(layout, units)``: its bytes.
    ``orders``: search unit orders (False: only grid shapes, for operands all
    sent from the client, where the order moves nothing). Ties keep the
    given order and the default grid.
    """
    units = list(units)
    layouts: dict = {}
    evaluated = 0

    def evaluate(order, grid):
        nonlocal evaluated
        us = [units[i] for i in order]
        sig = (tuple((u.gflops, u.gpu) for u in us), grid)
        lay = layouts.get(sig)
        if lay is None:
            lay = layouts[sig] = make_layout(us, grid)
        evaluated += 1
        return cost(lay, us), lay, us

    naive, lay0, _ = evaluate(tuple(range(len(units))), None)
    best = (naive, 0, lay0, units, tuple(range(len(units))), None)
    p = _busy(lay0) if lay0.groups == 1 else 0
    shapes = [None] + ([g for g in grids(p) if g != lay0.grid] if p > 1 else [])
    sigs = [(u.address, u.gflops, u.gpu) for u in units]
    # units of a throughput no unit of which got a block stay idle in every order (shares
    # follow the throughputs, not the positions): kept last, out of the search. Otherwise
    # a GPU worker beside many CPU workers too slow for a share multiplies the orders
    # searched, in client time per product (bench/NOTES.md, the mixed cluster).
    busy = {(u.gflops, u.gpu) for u, b in zip(units, lay0.blocks) if b is not None}
    active = [i for i, u in enumerate(units) if (u.gflops, u.gpu) in busy]
    idle = tuple(sorted(set(range(len(units))) - set(active)))
    exact = not orders or _distinct_orders([sigs[i] for i in active]) * len(shapes) <= limit
    for rank, grid in enumerate(shapes):
        if not orders:
            candidates = [tuple(range(len(units)))]
        elif exact:
            seen, candidates = set(), []
            for perm in itertools.permutations(active):
                key = tuple(sigs[i] for i in perm)
                if key not in seen:
                    seen.add(key)
                    candidates.append(perm + idle)
        else:
            candidates = None
        if candidates is not None:
            for order in candidates:
                c, lay, us = evaluate(order, grid)
                if (c, rank) < best[:2] and _busy(lay) >= p:
                    best = (c, rank, lay, us, order, grid)
            continue
        order = list(active) + list(idle)  # swaps of two active units while one improves
        c, lay, us = evaluate(tuple(order), grid)
        current = (c, lay, us)
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(len(active)), 2):
                if sigs[order[i]] == sigs[order[j]]:
                    continue
                trial = list(order)
                trial[i], trial[j] = trial[j], trial[i]
                c, lay, us = evaluate(tuple(trial), grid)
                if c < current[0]:
                    order, current, improved = trial, (c, lay, us), True
        if (current[0], rank) < best[:2] and _busy(current[1]) >= p:
            best = (current[0], rank, current[1], current[2], tuple(order), grid)
    c, _, lay, us, _, _ = best
    return Choice(list(us), lay, int(c), int(naive), "exact" if exact else "swaps", evaluated,
                  lay.grid)


# -- the planner -----------------------------------------------------------------------------

#: share of a GPU worker's device (split between the workers sharing it) one block task
#: may hold: its panels and its cell live there, beside the operands' chunks
DEVICE_FRACTION = 0.5


def block_budget(plan_budget: int, units, configured: int | None = None) -> int:
    """Bytes one block task may hold.

    Where ``units`` (those given a block) are all GPU workers with a device the probe
    measured: ``DEVICE_FRACTION`` of the smallest device (split between the workers
    sharing it), bounded by ``configured`` (``distmm.memory-budget`` given as a size).
    Else ``plan_budget``: the plan's, the lower of the configured one and the workers'
    host limits. A host budget would cut a GPU's block into cells and k groups whose
    partials cross workers (``bench/NOTES.md`` has the measurements)."""
    per_device = [u.device_memory // max(u.share_device, 1) for u in units
                  if u.gpu and u.device_memory]
    if not units or len(per_device) != len(units):
        return plan_budget
    budget = int(min(per_device) * DEVICE_FRACTION)
    return min(budget, configured) if configured is not None else budget


def layout_for(plan, units, *, grid=None, weights=None, configured_budget: int | None = None,
               **cuts) -> BlockLayout:
    """``block_layout`` of ``plan``'s product (``m``, ``n``, ``k``, its accumulation dtype,
    k-block and memory budget) over ``units`` in this order.

    ``weights``: the units' shares where the caller has them (default ``shares``). The
    budget comes from the units given a block (``block_budget``): in a mixed cluster
    whose CPU workers get nothing, the GPU's device, not the host limit a CPU block would
    need. ``cuts``: ``row_cuts``, ``col_cuts``, ``k_cuts`` of ``block_layout``."""
    itemsize = np.dtype(plan.acc_dtype).itemsize
    if weights is None:
        weights = shares([u.gflops for u in units], plan.m, plan.n, plan.k, itemsize)
    working = [u for u, w in zip(units, weights) if w > 0] or list(units)
    return block_layout(plan.m, plan.n, plan.k, weights, itemsize=itemsize,
                        memory_budget=block_budget(plan.memory_budget, working,
                                                   configured_budget),
                        tk=plan.tile[2], grid=grid, **cuts)


@dataclass(frozen=True)
class OperandFacts:
    """One operand as the planner sees it.

    ``itemsize``: bytes per element. ``name`` and ``chunks`` (its chunk sizes along its
    two last axes) for a dask array, whose chunk ``(r, c)`` has the key ``(name, r, c)``;
    both None for an operand the engine scatters from the client, one block per cell of
    the layout (keys ``("a", r, c)`` and ``("b", r, c)``)."""

    itemsize: int
    name: str | None = None
    chunks: tuple | None = None

    @property
    def scattered(self) -> bool:
        return self.chunks is None


@dataclass(frozen=True)
class ClusterFacts:
    """What the planner knows of the cluster, as plain data asked in one round trip.

    ``workers``: every worker (``WorkerInfo``), sorted by address. ``where``: chunk key
    ``(name, r, c)`` -> the addresses holding it (persisted operands; empty: none).
    ``ipc``: the ``(holder, reader)`` address pairs whose chunks go through CUDA IPC;
    ``nccl``: those (GPU workers of different hosts) whose chunks go through NCCL."""

    workers: tuple
    where: Mapping = field(default_factory=lambda: MappingProxyType({}))
    ipc: frozenset = frozenset()
    nccl: frozenset = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "workers", tuple(self.workers))
        object.__setattr__(self, "where", MappingProxyType(dict(self.where)))
        object.__setattr__(self, "ipc", frozenset(self.ipc))
        object.__setattr__(self, "nccl", frozenset(self.nccl))


@dataclass(frozen=True)
class Move:
    """One chunk sent to one worker: its ``key``, ``nbytes``, the reader ``to``, the
    ``route`` (``"tcp"``, ``"ipc"``, ``"nccl"`` or ``"scatter"``, from the client) and the
    ``holder`` it comes from (None: scattered, or made on another reader)."""

    key: tuple
    nbytes: int
    to: str
    route: str
    holder: str | None = None


@dataclass(frozen=True)
class BlockPlan:
    """Block mode's placement of one product: made before anything runs.

    Attributes
    ----------
    layout : BlockLayout
        The cells of C and, per cell and k group, the position (unit index) computing it.
    units : tuple of Unit
        The units in layout order: position ``u`` runs on ``units[u].address``; units
        given no block come last (a failed GPU cell's CPU fallback).
    locality : mapping
        What the search chose (``last_stats()["locality"]``).
    reads : tuple
        ``(chunk key, nbytes, positions)`` of every chunk the tasks read (``readers``).
    moves : tuple of Move
        Every chunk sent to a worker lacking it, by route.
    sources : mapping
        ``(chunk key, reader address) -> holder address`` for the chunks sent through
        CUDA IPC (``ipc_sources``: the graph's export tasks).
    estimated_bytes : mapping
        By route: ``worker_to_worker`` (TCP chunks and partials), ``ipc`` (dask
        operands) or ``scatter`` (scattered operands), ``gather`` (C).
    estimated_seconds : float
        Modelled time: the slowest unit's compute at its GFLOP/s plus the bytes its
        worker receives at ``HOST_BANDWIDTH`` (IPC bytes at 1/``IPC_COST_DIVISOR`` of
        that), plus ``TASK_OVERHEAD``.
    """

    layout: BlockLayout
    units: tuple
    locality: Mapping
    reads: tuple
    moves: tuple
    sources: Mapping
    estimated_bytes: Mapping
    estimated_seconds: float

    @property
    def addresses(self) -> list[str]:
        """Each position's worker."""
        return [u.address for u in self.units]

    def devices(self) -> dict:
        """``layout_devices``: ``(bi, bj, g) -> ("gpu", workers sharing the device)``."""
        return layout_devices(self.layout, self.units)

    def homes(self) -> dict:
        """``(bi, bj, g) -> address`` of the worker running each task."""
        lay, addresses = self.layout, self.addresses
        return {(bi, bj, g): addresses[lay.unit_of_partial(bi, bj, g)]
                for bi, bj in lay.cells() for g in range(lay.groups)}

    def fallback_workers(self) -> tuple[str, ...]:
        """The CPU workers a failed GPU cell moves to (every worker where none is a CPU's)."""
        cpu = sorted({u.address for u in self.units if not u.gpu})
        return tuple(cpu or sorted({u.address for u in self.units}))

    def stats(self, acc_itemsize: int) -> dict:
        """The layout's part of ``last_stats()``: ``cells``, ``groups``, ``units`` (each
        position's worker, GPU or not, GFLOP/s, block, share of C), ``grid``, the
        layout's own ``estimated_bytes`` (``BlockLayout.bytes_moved``) and ``tasks``."""
        lay = self.layout
        gm, gn = lay.grid
        total = max(lay.m * lay.n, 1)
        per_unit = [{"address": unit.address, "gpu": unit.gpu, "gflops": unit.gflops,
                     "block": lay.blocks[u], "share": lay.area(u) / total}
                    for u, unit in enumerate(self.units)]
        return {"cells": gm * gn, "groups": lay.groups, "units": per_unit,
                "grid": (gm, gn), "estimated_bytes": lay.bytes_moved(acc_itemsize),
                "tasks": gm * gn * (1 if lay.groups == 1 else lay.groups + len(lay.reduction))}


class _Search:
    """The layouts one placement search makes and costs, each read once."""

    def __init__(self, plan, a: OperandFacts, b: OperandFacts, where, ipc, cuts: dict,
                 configured_budget, nccl=frozenset()):
        self.plan, self.a, self.b = plan, a, b
        self.where, self.ipc, self.nccl, self.cuts = where, ipc, nccl, cuts
        self.configured_budget = configured_budget
        self.acc = np.dtype(plan.acc_dtype).itemsize
        self.scattered = a.scattered
        self._reads: dict = {}
        self._routes: dict = {}  # (chunk key, reader) -> route: by_route's memo

    def make(self, units, grid, weights=None) -> BlockLayout:
        return layout_for(self.plan, units, grid=grid, weights=weights,
                          configured_budget=self.configured_budget, **self.cuts)

    def read(self, lay):
        got = self._reads.get(id(lay))
        if got is not None:
            return got[1]
        if not self.scattered:
            got = readers(lay, self.a.chunks, self.b.chunks, self.a.name, self.b.name,
                          self.a.itemsize, self.b.itemsize)
        else:  # the scattered blocks are the layout's own cells
            rows, cols, ks = (tuple(np.diff(e).tolist()) for e in
                              (lay.row_edges, lay.col_edges, lay.k_edges))
            got = readers(lay, (rows, ks), (ks, cols), "a", "b", self.a.itemsize,
                          self.b.itemsize)
        self._reads[id(lay)] = (lay, got)  # the layout kept alive: its id stays its own
        return got

    def routes(self, lay, addresses) -> dict:
        return by_route(self.read(lay), addresses, self.where, ipc=self.ipc,
                        from_client=self.scattered, memo=self._routes, nccl=self.nccl)

    def cost(self, lay, units) -> int:
        addresses = [u.address for u in units]
        return cost(self.routes(lay, addresses)) + partial_bytes(lay, addresses, self.acc)


def _place(search: _Search, units: list, plan):
    """The layout and its units in layout order moving the fewest bytes, and
    ``last_stats()["locality"]``. Units no layout gives a share (CPU workers beside a GPU:
    ``shares`` follows the throughputs alone) stay out of the search and are kept last,
    blockless (a GPU worker beside 15 CPU workers would otherwise cost every layout for
    16 units); GPU workers sharing a device are taken as one unit where that moves fewer
    bytes (``merged``)."""
    orders = not search.scattered and bool(search.where)
    acc = search.acc
    weights = shares([u.gflops for u in units], plan.m, plan.n, plan.k, acc)
    idle = [u for u, w in zip(units, weights) if w <= 0]
    working = [u for u, w in zip(units, weights) if w > 0]
    best = split = choose(working if idle else units, search.make, search.cost, orders=orders)
    if idle:  # the working units' shares, unchanged by the idle ones (0 each)
        full = best.units + idle
        kept = shares([u.gflops for u in best.units], plan.m, plan.n, plan.k, acc)
        best = split = replace(best, units=full,
                               layout=search.make(full, best.grid, kept + (0.0,) * len(idle)))
    colocated = None
    options = [choose(us, search.make, search.cost, orders=orders) for us in merged(units)]
    if options:
        one = min(options, key=lambda c: c.bytes)
        pick = "device" if one.bytes <= split.bytes else "worker"
        best = one if pick == "device" else split
        colocated = {"chosen": f"one unit per {pick}",
                     "bytes": {"one unit per device": one.bytes,
                               "one unit per worker": split.bytes}}
    addresses = [u.address for u in best.units]
    info = {"route": "scatter" if search.scattered else "worker_to_worker",
            "estimated_bytes": best.bytes, "naive_bytes": split.naive_bytes,
            "method": best.method if orders else "grid", "candidates": best.candidates,
            "grid": best.grid, "colocated": colocated,
            "routes": search.routes(best.layout, addresses),
            "assignment": [u.address for u, blk in zip(best.units, best.layout.blocks)
                           if blk is not None]}
    return best.layout, best.units, info


def _moves(reads, addresses, where, ipc, scattered: bool, nccl=frozenset()) -> tuple:
    """Every chunk sent to a worker lacking it (``by_route``'s rule, one ``Move`` each);
    a chunk held nowhere and not scattered counts as made on its first reader by
    address."""
    out = []
    for key, nbytes, positions in reads:
        want = sorted({addresses[u] for u in positions})
        held = where.get(key)
        if held:
            for w in want:
                if w in held:
                    continue
                holder, route = _pulled(held, w, ipc, nccl)
                out.append(Move(key, nbytes, w, route, min(held) if holder is None else holder))
        elif scattered:
            out += [Move(key, nbytes, w, "scatter") for w in want]
        else:
            out += [Move(key, nbytes, w, "tcp", want[0]) for w in want[1:]]
    return tuple(out)


def _seconds(layout, units, moves) -> float:
    """``BlockPlan.estimated_seconds``: the slowest unit's compute plus what its worker
    receives, and ``TASK_OVERHEAD``."""
    flops = [0.0] * len(units)
    for bi, bj in layout.cells():
        area = (layout.row_edges[bi + 1] - layout.row_edges[bi]) * (
            layout.col_edges[bj + 1] - layout.col_edges[bj])
        for g in range(layout.groups):
            kg = layout.k_edges[g + 1] - layout.k_edges[g]
            flops[layout.unit_of_partial(bi, bj, g)] += 2.0 * area * kg
    incoming: dict = {}
    for mv in moves:
        weight = {"ipc": 1.0 / IPC_COST_DIVISOR, "nccl": 1.0 / NCCL_COST_DIVISOR}.get(
            mv.route, 1.0)
        incoming[mv.to] = incoming.get(mv.to, 0.0) + mv.nbytes * weight
    worst = 0.0
    for u, unit in enumerate(units):
        if flops[u] <= 0:
            continue
        rate = max(unit.gflops, 1e-9) * 1e9
        worst = max(worst, flops[u] / rate + incoming.get(unit.address, 0.0) / HOST_BANDWIDTH)
    return worst + TASK_OVERHEAD


def plan_blocks(plan, cluster: ClusterFacts, a: OperandFacts, b: OperandFacts, *,
                row_cuts=None, col_cuts=None, k_cuts=None,
                configured_budget: int | None = None) -> BlockPlan:
    """Which worker computes which block of C, and what moves where.

    Parameters
    ----------
    plan : distmm.plan.Plan
        The product (2-D: ``m``, ``n``, ``k``), its accumulation dtype, k-block
        (``tile[2]``) and memory budget.
    cluster : ClusterFacts
        The workers, where the persisted chunks are, and the CUDA IPC pairs.
    a, b : OperandFacts
        The operands: both dask arrays (their chunks) or both scattered.
    row_cuts, col_cuts, k_cuts : sequence of int, optional
        Where block edges may lie (dask operands: the output chunks' edges and the
        operands' chunk edges along k); default: every 64 elements.
    configured_budget : int, optional
        ``distmm.memory-budget`` given as a size: bounds a GPU block's device budget
        (``block_budget``).

    Returns
    -------
    BlockPlan
        Deterministic: the same facts give the same plan.

    Raises
    ------
    ValueError
        No workers; one operand scattered and the other not.

    Examples
    --------
    >>> from distmm.plan import make_plan
    >>> w = (WorkerInfo("tcp://h:1", 1, True, None, 3000.0, False),
    ...      WorkerInfo("tcp://h:2", 2, False, None, 100.0, False))
    >>> bp = plan_blocks(make_plan(2048, 2048, 2048, "float64", workers=3), ClusterFacts(w),
    ...                  OperandFacts(8), OperandFacts(8))
    >>> [(u.address, u.gpu) for u in bp.units]
    [('tcp://h:1', True), ('tcp://h:2', False), ('tcp://h:2', False)]
    >>> bp.layout.blocks[1:]  # the CPU worker's threads are too slow for a share
    (None, None)
    """
    if not cluster.workers:
        raise ValueError("a block plan needs at least one worker, got none")
    if a.scattered != b.scattered:
        raise ValueError(f"operands must be both scattered or both chunked, got a "
                         f"{'scattered' if a.scattered else 'chunked'} and b "
                         f"{'scattered' if b.scattered else 'chunked'}")
    names: dict = {}
    if not a.scattered:  # planned by where the chunks lie, whatever the operands are called
        names = {a.name: _NAME_A}
        names.setdefault(b.name, _NAME_B)
        a, b = replace(a, name=names[a.name]), replace(b, name=names[b.name])
        cluster = replace(cluster, where={_rename(k, names): v for k, v in cluster.where.items()})
    try:
        key = (plan, cluster.workers, cluster.ipc, cluster.nccl, a, b, configured_budget,
               tuple(sorted((k, tuple(sorted(v))) for k, v in cluster.where.items())),
               *(None if c is None else tuple(c) for c in (row_cuts, col_cuts, k_cuts)))
        hash(key)
    except TypeError:  # facts that do not hash: plan afresh
        key = None
    if key is not None and key in _PLANS:
        _PLANS.move_to_end(key)
        bp = _PLANS[key]
    else:
        bp = _plan_blocks(plan, cluster, a, b, row_cuts, col_cuts, k_cuts, configured_budget)
        if key is not None:
            _PLANS[key] = bp
            while len(_PLANS) > _PLANS_KEPT:
                _PLANS.popitem(last=False)
    return _with_names(bp, {v: k for k, v in names.items()}) if names else bp


#: the names the memo plans dask operands under (no dask key is spelled so)
_NAME_A, _NAME_B = "\x00distmm-a", "\x00distmm-b"


def _rename(key, names: dict):
    """Chunk key ``(name, r, c)`` with its name looked up in ``names`` (others as they are)."""
    if isinstance(key, tuple) and key and key[0] in names:
        return (names[key[0]],) + key[1:]
    return key


def _with_names(bp: "BlockPlan", names: dict) -> "BlockPlan":
    """``bp`` (planned under the memo's names) with its chunk keys named as ``names`` says."""
    return replace(bp, reads=tuple((_rename(k, names), nb, pos) for k, nb, pos in bp.reads),
                   moves=tuple(replace(mv, key=_rename(mv.key, names)) for mv in bp.moves),
                   sources=MappingProxyType({(_rename(k, names), r): h
                                             for (k, r), h in bp.sources.items()}))


#: plans kept for facts seen again: a product repeated on operands whose chunks lie where an
#: earlier product's did (the same persisted operands, or new ones made alike) on the same
#: workers is planned once (the layout search is the client's largest cost of a warm call)
_PLANS_KEPT = 32
_PLANS: OrderedDict = OrderedDict()


def _plan_blocks(plan, cluster: ClusterFacts, a: OperandFacts, b: OperandFacts, row_cuts,
                 col_cuts, k_cuts, configured_budget) -> BlockPlan:
    cuts = {name: c for name, c in (("row_cuts", row_cuts), ("col_cuts", col_cuts),
                                    ("k_cuts", k_cuts)) if c is not None}
    search = _Search(plan, a, b, cluster.where, cluster.ipc, cuts, configured_budget,
                     cluster.nccl)
    layout, placed, info = _place(search, units(list(cluster.workers)), plan)
    addresses = [u.address for u in placed]
    reads = tuple(search.read(layout))
    moves = _moves(reads, addresses, cluster.where, cluster.ipc, a.scattered, cluster.nccl)
    partials = partial_bytes(layout, addresses, search.acc)
    c_bytes = plan.m * plan.n * np.dtype(plan.dtype).itemsize
    if a.scattered:
        estimated = {"scatter": sum(mv.nbytes for mv in moves), "worker_to_worker": partials,
                     "gather": c_bytes}
        sources: dict = {}
    else:
        routes = by_route(reads, addresses, cluster.where, ipc=cluster.ipc, nccl=cluster.nccl)
        estimated = {"worker_to_worker": routes["tcp"] + partials, "ipc": routes["ipc"],
                     "gather": c_bytes}
        if routes["nccl"]:
            estimated["nccl"] = routes["nccl"]
        sources = ipc_sources(reads, addresses, cluster.where, cluster.ipc, cluster.nccl)
    return BlockPlan(layout, tuple(placed), MappingProxyType(info), reads, moves,
                     MappingProxyType(sources), MappingProxyType(estimated),
                     _seconds(layout, placed, moves))
