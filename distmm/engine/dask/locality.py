"""Block mode's placement by locality: which unit computes which block.

This module covers: the bytes a block layout moves to its workers for a
given assignment of units to the layout's positions (``readers``, ``moved``:
each chunk to every reader's worker not holding it; ``partial_bytes``: the
partials of split cells sent to their reduction), the search for the
assignment, grid shape and unit set moving the fewest bytes (``choose``:
every distinct order of the units when there are few (``EXACT_LIMIT``
layouts: five distinct GPU workers, or eight units of two kinds), pairwise
swaps from the given order beyond, each over every grid shape the layout
allows), and
co-located GPU workers (several workers on one device) taken as one unit
on the worker holding most of its operands (``merged``).
It does *not* cover: where chunks are (the caller's ``client.who_has``),
which workers exist (``workers``), the layout itself (``layout``: the
caller's ``make_layout`` builds it) or running anything. Pure: no dask.

Everything is in bytes of the operands' chunks as they lie: a chunk held by
the worker that reads it costs nothing; a chunk read by several units of one
worker moves to it once. Chunks held nowhere (``from_client``: scattered by
the engine) cost one copy per worker reading them.

Routes and their weights
------------------------
A chunk reaches a worker lacking it by one of two routes (``by_route``):
``ipc``, when one of its holders and the reader are a pair in ``ipc`` (GPU
workers of one host whose CUDA IPC works, device chunks:
``distmm.engine.dask.transfer`` decides), else ``tcp``. The search minimises
``cost``: TCP bytes plus IPC bytes divided by ``IPC_COST_DIVISOR`` (256), so
layouts avoid TCP first and, among those, move fewer IPC bytes. Why 256: TCP
between workers moves device chunks through host copies at about 1 GB/s (H100,
measured in bench/results/dask-gpu-*); IPC is one device-to-device copy, about
1.3 TB/s on one H100 and 300-400 GB/s between two over NVLink. The slower IPC
route is ~300x TCP; 256 (a round power of two below) keeps IPC bytes cheap
without making them free: each also costs a dedicated device copy on the
holder and the reader, and a handle opened per task. With no pairs the cost
is the bytes, as before. ``ipc_sources`` says which holder each reader opens
a chunk from (the graph's export tasks), by the same rule as ``by_route``.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field, replace

from distmm.engine.dask.chunks import Geometry, locate

__all__ = ["readers", "moved", "by_route", "cost", "ipc_sources", "partial_bytes", "merged",
           "grids", "choose", "Choice", "EXACT_LIMIT", "IPC_COST_DIVISOR"]

#: the most layouts (distinct unit orders times grid shapes) costed in an
#: exhaustive search; beyond, pairwise swaps. A layout costs about 0.5 ms to
#: build and cost (32768^2, chunks 4096): 1000 of them add about half a second
EXACT_LIMIT = 1000

#: an IPC byte costs 1 / IPC_COST_DIVISOR of a TCP byte (module docstring: why 256)
IPC_COST_DIVISOR = 256


def readers(layout, a_chunks, b_chunks, a_name, b_name, a_itemsize: int, b_itemsize: int):
    """Every chunk of A and B the layout's tasks read: ``(key, nbytes,
    positions)``, positions being the layout's unit indices reading it."""
    geo = Geometry.of_cells(layout.row_edges, layout.col_edges, layout.k_edges, a_chunks, b_chunks)
    who: dict = {}
    for bi, bj in layout.cells():
        for g in range(layout.groups):
            u = layout.unit_of_partial(bi, bj, g)
            ks_a = locate(geo.a_k, geo.k_groups[g], geo.k_groups[g + 1])
            ks_b = locate(geo.b_k, geo.k_groups[g], geo.k_groups[g + 1])
            for rb, _, _ in geo.a_row_pieces(bi):
                for kb, _, _ in ks_a:
                    who.setdefault((a_name, rb, kb), set()).add(u)
            for kb, _, _ in ks_b:
                for cb, _, _ in geo.b_col_pieces(bj):
                    who.setdefault((b_name, kb, cb), set()).add(u)
    out = []
    for key, units in who.items():
        name, r, c = key
        if name == a_name:  # A @ A: one array, the same chunks either way
            rows, cols, size = geo.a_rows, geo.a_k, a_itemsize
        else:
            rows, cols, size = geo.b_k, geo.b_cols, b_itemsize
        out.append((key, (rows[r + 1] - rows[r]) * (cols[c + 1] - cols[c]) * size, frozenset(units)))
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


def by_route(reads, addresses, where: dict, *, ipc=frozenset(), from_client: bool = False) -> dict:
    """``moved``'s bytes split by route: ``{"tcp": ..., "ipc": ...}``; a
    chunk goes by ``ipc`` to a reader that one of its holders is paired with
    in ``ipc`` (``(holder, reader)`` address pairs), else by ``tcp``. Chunks
    held nowhere (made on a reader, or scattered) count as ``tcp``."""
    tcp = ipc_bytes = 0
    for key, nbytes, units in reads:
        want = {addresses[u] for u in units}
        held = where.get(key)
        if held:
            for w in want.difference(held):
                if _ipc_holder(held, w, ipc) is not None:
                    ipc_bytes += nbytes
                else:
                    tcp += nbytes
        else:
            tcp += nbytes * (len(want) if from_client else len(want) - 1)
    return {"tcp": tcp, "ipc": ipc_bytes}


def cost(routes: dict) -> int:
    """TCP-equivalent bytes of ``by_route``'s split: IPC bytes at 1/``IPC_COST_DIVISOR``."""
    return int(routes.get("tcp", 0)) + int(routes.get("ipc", 0)) // IPC_COST_DIVISOR


def ipc_sources(reads, addresses, where: dict, ipc) -> dict:
    """``(chunk key, reader address) -> holder address`` for every chunk that
    ``by_route`` sends by IPC: where the reader's export of it is opened from."""
    out = {}
    if not ipc:
        return out
    for key, _nbytes, units in reads:
        held = where.get(key)
        if not held:
            continue
        for w in sorted({addresses[u] for u in units}.difference(held)):
            h = _ipc_holder(held, w, ipc)
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
    # follow the throughputs, not the positions): kept last, out of the search. Measured
    # need: a GPU worker beside 15 CPU workers too slow for a share cost 366 layouts,
    # 37 ms of the client's time per product on the H100 machine.
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
