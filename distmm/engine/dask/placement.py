"""Placement for the Dask engine: which worker runs which task.

This module covers: the worker slots a plan is made for (one per worker
thread), the ``Placement`` annotation that maps a task's key to the worker of
its plan owner (computed from the key, so the graph holds no table per task;
loose: a dead or busy worker's tasks move), and mapping the plan's owners
onto workers so that tasks find their persisted inputs in place; in block
mode (``distmm.plan_blocks``), ``BlockPlacement``: each cell's tasks
on the worker of the unit owning it.
It does *not* cover: the plan's owners themselves (``distmm.plan``) or the
tasks (``distmm.engine.dask.graph``).
"""
from __future__ import annotations

import weakref
from collections import defaultdict

from distmm.engine.dask.chunks import Geometry, locate
from distmm.plan import Plan

__all__ = ["worker_slots", "Placement", "BlockPlacement", "slots_by_locality", "who_has",
           "cluster_state"]


def worker_slots(client, wait: float = 30.0, info: dict | None = None) -> list[str]:
    """One entry per worker thread: the address of its worker, sorted by address.

    The plan is made for ``len(worker_slots(client))`` workers and its owner
    ``w`` maps to ``slots[w]``; single-thread workers give one slot each. A
    cluster with no worker yet is waited for up to ``wait`` seconds. ``info``:
    the scheduler's ``workers`` table when the caller has it already.
    """
    if info is None:
        info = client.scheduler_info(n_workers=-1)["workers"]
    if not info and wait > 0:
        try:
            client.wait_for_workers(1, timeout=wait)
        except Exception:
            return []
        info = client.scheduler_info(n_workers=-1)["workers"]
    return [addr for addr in sorted(info) for _ in range(max(int(info[addr].get("nthreads", 1)), 1))]


class Placement:
    """The ``workers=`` annotation of a product: key -> ``[address]``.

    The output block's plan owner (the owner of the plan tile holding its
    first element) computes its reduction; the partial of k group ``g`` goes
    to ``owner + g``, a reduction step to the owner of the partial it adds
    into, as ``Plan.owner_of_partial`` says.
    """

    def __init__(self, plan: Plan, geometry: Geometry, names: tuple[str, str, str],
                 batch_ndim: int, reduction, slots: list[str]):
        self.owners = plan.owners
        self.workers = plan.workers
        self.tile_rows, self.tile_cols = geometry.tile_rows, geometry.tile_cols
        self.names = names
        self.nb = batch_ndim
        self.dst = tuple(d for d, _ in reduction)
        self.slots = list(slots)

    def owner(self, key) -> int | None:
        if not isinstance(key, tuple) or len(key) < self.nb + 3:
            return None
        head = key[0]
        bi, bj = key[1 + self.nb], key[2 + self.nb]
        base = self.owners[self.tile_rows[bi]][self.tile_cols[bj]]
        if head == self.names[0]:
            return base
        if head == self.names[1]:
            return (base + key[-1]) % self.workers
        if head == self.names[2]:
            return (base + self.dst[key[-1]]) % self.workers
        return None

    def __call__(self, key):
        w = self.owner(key)
        if w is None or not self.slots:
            return None
        return [self.slots[w % len(self.slots)]]


class BlockPlacement:
    """The ``workers=`` annotation of a product in block mode: a cell's k
    group ``g`` runs on ``layout.unit_of_partial(bi, bj, g)``, a reduction
    step on the unit of its destination; ``addresses[u]`` is unit u's worker.
    Batch axes are not laid out in blocks (block mode is 2-D only)."""

    def __init__(self, layout, names: tuple[str, str, str], addresses: list[str],
                 moved: dict | None = None):
        self.layout = layout
        self.names = names
        self.addresses = list(addresses)
        self.moved = dict(moved or {})  # cell -> address: every task of that cell

    def unit(self, key) -> int | None:
        if not isinstance(key, tuple) or len(key) < 3:
            return None
        head, bi, bj = key[0], key[1], key[2]
        lay = self.layout
        if head == self.names[0] and len(key) == 3:
            if lay.groups == 1:
                return lay.unit_of_partial(bi, bj, 0)
            return lay.unit_of_step(bi, bj, len(lay.reduction) - 1)
        if head == self.names[1] and len(key) == 4:
            return lay.unit_of_partial(bi, bj, key[3])
        if head == self.names[2] and len(key) == 4:
            return lay.unit_of_step(bi, bj, key[3])
        return None

    def __call__(self, key):
        if self.moved and isinstance(key, tuple) and len(key) >= 3 and (key[1], key[2]) in self.moved:
            return [self.moved[(key[1], key[2])]]
        u = self.unit(key)
        if u is None or not self.addresses:
            return None
        return [self.addresses[u % len(self.addresses)]]


#: per client: the running workers' thread counts the scheduler last reported, and the
#: worker table (``identity``) read then
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _running(table: dict) -> dict:
    return {a: w.get("nthreads") for a, w in table.items()
            if w.get("status", "running") == "running"}


def cluster_state(client, a2=None, b2=None) -> tuple[dict, dict]:
    """The scheduler's ``workers`` table and where the persisted chunks of ``a2`` and
    ``b2`` are (``who_has``: ``{}`` where none is persisted, or where that request failed,
    placement being only a hint), asked together in one round trip.

    The table (addresses, threads, memory limits, resources, status) is read in full
    (``identity()``, which lists every worker in each ``distributed``; the floor's takes no
    ``n_workers``) once per client, and again whenever the running workers or their thread
    counts (``ncores_running``, a small reply) differ from those it was read with: a
    worker joining, leaving, pausing or resuming. Both requests precede every product, and
    the full table's cost grows with the number of workers, so on a cluster of many workers
    one round trip and a kept table are a measurable saving per call (``bench/NOTES.md``,
    the mixed cluster)."""
    import asyncio

    from distributed import futures_of

    keys = list({f.key for x in (a2, b2) if x is not None for f in futures_of(x)})
    cached = _TABLES.get(client)

    async def ask():
        first = (client.scheduler.ncores_running() if cached is not None
                 else client.scheduler.identity())
        asks = [first] + ([client.scheduler.who_has(keys=keys)] if keys else [])
        got = await asyncio.gather(*asks, return_exceptions=True)
        if isinstance(got[0], BaseException):
            raise got[0]
        where = got[1] if keys else {}
        if cached is not None and dict(got[0]) == cached[0]:
            return cached[1], where
        info = got[0] if cached is None else await client.scheduler.identity()
        return dict(info.get("workers") or {}), where

    table, where = client.sync(ask)
    if cached is None or cached[1] is not table:
        try:
            _TABLES[client] = (_running(table), table)
        except TypeError:  # a client that takes no weak reference: asked in full each time
            pass
    if isinstance(where, BaseException):  # a worker leaving mid-call
        where = {}
    where = dict(where)
    return table, (where if any(where.values()) else {})


def who_has(client, a2, b2) -> dict:
    """Where the persisted chunks of ``a2`` and ``b2`` are (empty: not persisted)."""
    from distributed import futures_of

    if not futures_of(a2) and not futures_of(b2):
        return {}
    try:
        where = dict(client.who_has([a2, b2]))  # one request for both
    except Exception:  # a worker leaving mid-call: placement is only a hint
        return {}
    return where if any(where.values()) else {}


def slots_by_locality(client, plan: Plan, geometry: Geometry, slots: list[str], a2, b2,
                      where: dict | None = None) -> tuple[list[str], int]:
    """Map the plan's owners onto workers so that each owner's blocks find as
    much of their input already in place as possible.

    Only for operands already in the cluster's memory (persisted); otherwise
    the slots are returned as they are. The plan's balance is kept: only
    which worker plays which owner changes. Returns the slots and the number
    of input elements the tasks find on their own worker under that mapping.
    """
    if where is None:
        where = who_has(client, a2, b2)
    if not where:
        return slots, 0
    score: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    gm, gn = geometry.grid
    for bi in range(gm):
        a_rows = geometry.a_row_pieces(bi)
        for bj in range(gn):
            b_cols = geometry.b_col_pieces(bj)
            base = plan.owners[geometry.tile_rows[bi]][geometry.tile_cols[bj]]
            for g in range(geometry.groups):
                owner = (base + g) % plan.workers
                k0, k1 = geometry.k_groups[g], geometry.k_groups[g + 1]
                for rb, r0, r1 in a_rows:
                    for kb, c0, c1 in locate(geometry.a_k, k0, k1):
                        for addr in where.get((a2.name, rb, kb), ()):
                            score[owner][addr] += (r1 - r0) * (c1 - c0)
                for kb, c0, c1 in locate(geometry.b_k, k0, k1):
                    for cb, d0, d1 in b_cols:
                        for addr in where.get((b2.name, kb, cb), ()):
                            score[owner][addr] += (c1 - c0) * (d1 - d0)
    capacity: dict[str, int] = defaultdict(int)
    for addr in slots:
        capacity[addr] += 1
    mapping: dict[int, str] = {}
    local = 0
    for w in sorted(range(len(slots)), key=lambda w: -max(score[w].values(), default=0)):
        free = [addr for addr in sorted(capacity) if capacity[addr] > 0]
        best = max(free, key=lambda addr: score[w].get(addr, 0))
        mapping[w] = best
        local += score[w].get(best, 0)
        capacity[best] -= 1
    return [mapping[w] for w in range(len(slots))], local
