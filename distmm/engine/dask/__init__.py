"""The Dask engine: a ``Request`` becomes a task graph on a ``distributed`` cluster.

This package covers: ``DaskEngine``, which reads the request (operands, plan,
backend) and runs it: dask operands give a lazy array over their own chunks
(``lazy``), numpy and on-disk operands are scattered, computed and gathered
(``eager``). Its modules, one idea each:

``tasks``      the task bodies that run on workers
``blocks``     block mode's task bodies: a whole block on a GPU or a CPU
``chunks``     chunk geometry: output blocks, k groups, the pieces a task reads
``placement``  worker slots and the placement annotation (plan owner per key)
``graph``      the product as one lazy ``Layer``: blockwise over output blocks,
               the k-loop inside the task, the plan's reduction tree after it
``eager``      the scatter/gather loop for in-memory operands, with retries
               and, in block mode, the fallback of failed GPU cells to CPU workers
``lazy``       dask-array operands: the lazy result array
``workers``    GPU workers (a "GPU" resource or a probe) and each worker's GFLOP/s
``layout``     block mode: one contiguous 2-D block of C per worker unit,
               shares by throughput, split-K for products with few blocks
``locality``   block mode: which unit computes which block (and the grid
               shape) to move the fewest bytes, co-located workers as one unit
``transfer``   device (cupy) chunks between GPU workers of one host through
               CUDA IPC: the mode, the probe per cluster, the export tasks'
               offers and opening them, with TCP as the fallback
``pull``       block tasks fetch those offers straight from the holders, not
               through the scheduler
``stats``      ``last_stats`` (tasks, estimated bytes) and ``transfer_report``

It does *not* cover: tile arithmetic (``distmm.plan``), numpy's semantics and
validation (``distmm.api``) or kernels (``distmm.executor``).

How a task gets its operands
----------------------------
By default the output chunks are dask.array's for ``A @ B``: A's row chunks by
B's column chunks (the plan's tiles when a tile was asked for). A task reads
the chunks of A and B that overlap its output block over its k group and
nothing else: no rechunk is inserted. Where chunks straddle block edges, the
task slices them, and k pieces shorter than the plan's k-block are joined
before they reach the executor. When the plan splits k (a long k, or too few
blocks for the workers), each group is one task, its edges moved onto chunk
edges, and the partials are summed along the plan's fixed tree, one task per
step, so the bits never depend on which task finished first.

Tiles or blocks
---------------
By default (``distmm.dask-layout: auto``) a cluster with a GPU worker runs in
block mode: C is split into one contiguous 2-D block per unit (a GPU worker,
or a CPU worker thread), near-square over the units as SUMMA's grid, sized in
proportion to each unit's GFLOP/s (``distmm.dask-worker-gflops`` or measured;
a CPU worker gets nothing where its share would slow the run), and each block
is one task (or a few, to fit the memory budget) running the whole block
through the GPU executor's stream pipeline or the CPU executor. Each A row
panel and B column panel goes to a worker once. Which unit computes which
block, and the grid's shape, are chosen to move the fewest bytes: dask
operands by where their persisted chunks are, numpy operands scattered
straight to each worker reading them; GPU workers sharing one device are one
unit (on the worker holding most of its operands) where that moves fewer
bytes (``last_stats()["locality"]`` says what was chosen and what the
naive order would have moved). Persisted cupy chunks that a GPU worker needs
from another GPU worker of its host go device to device through CUDA IPC
(``distmm.dask-device-transfer``, ``transfer``): an export task pinned to
the holder publishes a small handle in place of the chunk, which the block
task asks the holder for (``pull``), and the cost model counts those bytes
at 1/256 of a TCP byte. Dask operands keep their
chunks: block edges lie on output chunk edges and each output chunk is a
slice of its block. A GPU task that fails (``TileFailed``: out of memory
after the pipeline's retries, a lost device) is run again on a CPU worker,
and the log names the moved cells. CPU-only clusters keep one task per plan
tile (``tiles``) unless ``blocks`` is configured: on two CPU cores the two
shapes ran equally fast (``bench/NOTES.md``), and tiles keep the pinned,
stealable small tasks the fault and memory tests rely on.

Memory
------
``plan_hints`` gives the planner a memory budget from the workers'
``memory_limit`` (a quarter of it per worker thread), so that tiles and k
groups fit workers that dask.array's own ``A @ B`` fits.
"""
from __future__ import annotations

import logging
import sys

from distmm.engine.base import Engine, Operands, Request
from distmm.engine.dask.chunks import Geometry, check_chunks, chunk_tile
from distmm.engine.dask.placement import slots_by_locality, worker_slots
from distmm.engine.dask.stats import last_stats, record, transfer_report

__all__ = ["DaskEngine", "worker_slots", "MEMORY_FRACTION", "last_stats", "transfer_report",
           "FAIL_TILES_KEY"]

log = logging.getLogger("distmm.engine.dask")

#: share of a worker's ``memory_limit`` (per thread) one task may hold: the
#: rest is the process itself, inputs fetched for the next tasks, and results
#: waiting to be gathered, below dask's spill (60%) and pause (80%) thresholds
MEMORY_FRACTION = 0.25

#: share of a GPU worker's device (split between the workers sharing it) one block task
#: may hold: its panels and its cell live there, beside the operands' chunks
DEVICE_FRACTION = 0.5

#: debug configuration (outside the checked ``distmm`` section): a list of
#: cells ``[i, j]`` of the block layout whose GPU task raises ``TileFailed``
#: on purpose, so that the CPU fallback can be tested without a GPU
FAIL_TILES_KEY = "distmm-debug.fail-tiles"


def _fail_tiles() -> frozenset:
    import dask.config

    raw = dask.config.get(FAIL_TILES_KEY, None) or ()
    try:
        return frozenset((int(i), int(j)) for i, j in raw)
    except (TypeError, ValueError):
        raise ValueError(f"{FAIL_TILES_KEY} must be a list of [i, j] cells, got {raw!r}") from None


def _resolve_client(client, *, required: bool):
    if client is not None:
        return client
    if not required and "distributed" not in sys.modules:
        return None  # no client can exist without distributed imported: skip its import
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        if required:
            raise ValueError(
                "engine='dask' needs a distributed.Client: pass client= or create one "
                "(distributed.Client(...)) before calling matmul"
            ) from None
        return None


def memory_budget(client, info: dict | None = None) -> int | None:
    """Bytes one task may hold on this cluster: ``MEMORY_FRACTION`` of the
    smallest per-thread ``memory_limit`` of its workers (None: no limits);
    ``info``: the scheduler's ``workers`` table when the caller has it already."""
    try:
        if info is None:
            info = client.scheduler_info(n_workers=-1)["workers"]
    except Exception:  # a cluster in trouble: the configured budget stands
        return None
    limits = [int(w["memory_limit"]) // max(int(w.get("nthreads", 1)), 1)
              for w in info.values() if w.get("memory_limit")]
    return int(min(limits) * MEMORY_FRACTION) if limits else None


def block_budget(plan_budget: int, units) -> int:
    """Bytes one block task may hold. Where ``units`` (those given a block) are all GPU
    workers with a device the probe measured: ``DEVICE_FRACTION`` of the smallest device
    (split between the workers sharing it), bounded by a ``distmm.memory-budget`` given as
    a size. Else the plan's budget: the lower of the configured one and the workers' host
    limits (``plan_hints``). Measured need: on two H100s the client-side budget (half the
    free memory of a device the workers' pools held) cut each GPU's block of a float32
    32768 product into 8 cells and 2 k groups, whose partials crossed TCP (4.4 GB); in a
    mixed cluster whose CPU workers got no block, the host budget cut the GPU's block
    into 16 cells and 3 k groups (H100, fp32 32768: 1.54 s against 1.35 s alone)."""
    from distmm.config import get_config

    shares = [u.device_memory // max(u.share_device, 1) for u in units
              if u.gpu and u.device_memory]
    if not units or len(shares) != len(units):
        return plan_budget
    budget = int(min(shares) * DEVICE_FRACTION)
    configured = get_config().memory_budget
    return min(budget, configured) if configured is not None else budget


class DaskEngine(Engine):
    """Runs a request on a ``distributed`` cluster.

    Parameters
    ----------
    client : distributed.Client, optional
        Default: the current client. Dask operands without any client give a
        lazy array planned for this machine's cores, runnable on any scheduler.
    required : bool
        Whether a client must exist (host operands are computed eagerly).
    retry_timeout : float
        Seconds the scatter/gather loop keeps retrying after workers are lost
        (waiting for one when none is alive) before it raises
        ``distmm.errors.WorkersLost``.

    Raises
    ------
    ValueError
        No client when one is required; a cluster with no workers.
    """

    name = "dask"

    def __init__(self, client=None, *, required: bool = True, retry_timeout: float = 60.0,
                 operands: Operands | None = None):
        if not retry_timeout > 0:
            raise ValueError(f"retry_timeout must be positive, got {retry_timeout!r}")
        self.client = _resolve_client(client, required=required)
        self.retry_timeout = float(retry_timeout)
        # one round trip per call: the scheduler's worker table (read by the slots, the
        # budget and the units) and, for the call's dask ``operands``, where their
        # persisted chunks are
        self._info, self.slots, self._where = None, [], None
        if self.client is not None:
            from distmm.engine.dask.placement import cluster_state

            dask_ops = operands is not None and operands.family == "dask"
            info, where = cluster_state(self.client, *((operands.a2, operands.b2) if dask_ops
                                                       else ()))
            self._info = info or None
            if dask_ops:
                self._where = (operands.a, operands.b, where)
            self.slots = worker_slots(self.client, info=self._info)
            if not self.slots:
                raise ValueError("matmul: the Dask cluster has no workers")
        self._chunk_tile = None

    def _where_of(self, ops: Operands) -> dict:
        """Where the persisted chunks of ``ops`` are: as asked with the worker table when
        these are the operands the engine was made for, else asked now."""
        from distmm.engine.dask.placement import who_has

        if self._where is not None and self._where[0] is ops.a and self._where[1] is ops.b:
            return self._where[2]
        return who_has(self.client, ops.a2, ops.b2)

    def workers(self, operands: Operands, *, on_gpu: bool) -> int:
        if self.slots:
            return len(self.slots)
        from distmm.engine.local import default_workers

        return default_workers()

    def plan_hints(self, operands: Operands, workers: int) -> dict:
        hints: dict = {}
        if self.client is not None:
            budget = memory_budget(self.client, self._info)
            if budget:
                hints["memory_budget"] = budget
        if operands.family != "dask":
            return hints
        a2, b2 = operands.a2, operands.b2
        check_chunks("a", a2)
        check_chunks("b", b2)
        from distmm.plan import make_plan

        tk = make_plan(operands.m, operands.n, operands.k, operands.dtype, workers=1).tile[2]
        self._chunk_tile = chunk_tile(a2.chunks[-2], b2.chunks[-1], tk)
        hints["tile"] = self._chunk_tile
        return hints

    def _block_units(self, ops: Operands):
        """The units of block mode, or None for one task per plan tile."""
        from distmm.config import get_config

        cfg = get_config()
        if cfg.dask_layout == "tiles" or self.client is None or ops.batch:
            return None
        from distmm.engine.dask.workers import units, worker_info

        infos = worker_info(self.client, cfg.dask_worker_gflops, self._info)
        if not infos or (cfg.dask_layout == "auto" and not any(w.gpu for w in infos)):
            return None
        return units(infos)

    def _layout(self, ops: Operands, plan, units, grid=None, weights=None, **cuts):
        """``weights``: the units' shares where the caller has them (default ``shares``)."""
        import numpy as np

        from distmm.engine.dask.layout import block_layout, shares

        itemsize = np.dtype(plan.acc_dtype).itemsize
        if weights is None:
            weights = shares([u.gflops for u in units], ops.m, ops.n, ops.k, itemsize)
        # budgeted by the units that get a block: in a mixed cluster whose CPU workers get
        # nothing, the GPU's device, not the host limit a CPU block would need
        working = [u for u, w in zip(units, weights) if w > 0] or list(units)
        return block_layout(ops.m, ops.n, ops.k, weights, itemsize=itemsize,
                            memory_budget=block_budget(plan.memory_budget, working),
                            tk=plan.tile[2], grid=grid, **cuts)

    def _place(self, ops: Operands, plan, units, where: dict, a2=None, b2=None, ipc=frozenset(),
               **cuts):
        """Block mode's layout and units in layout order, chosen to move the
        fewest bytes (``locality``): dask operands (``a2``, ``b2``) by where
        their chunks are (``where``), numpy operands by what is scattered;
        co-located GPU workers as one unit where that moves fewer bytes;
        ``ipc``: the ``(holder, reader)`` worker pairs whose chunks go through
        CUDA IPC (``transfer.ipc_pairs``), their bytes weighted by
        ``locality.cost``. Returns ``(layout, units, stats["locality"],
        reads)``, ``reads`` being ``locality.readers`` of the chosen layout."""
        from dataclasses import replace

        import numpy as np

        from distmm.engine.dask import locality as loc

        acc = np.dtype(plan.acc_dtype).itemsize
        reads: dict = {}

        def make(us, grid, weights=None):
            return self._layout(ops, plan, us, grid=grid, weights=weights, **cuts)

        def read(lay):
            got = reads.get(id(lay))
            if got is not None:
                return got[1]
            if a2 is not None:
                got = loc.readers(lay, a2.chunks, b2.chunks, a2.name, b2.name,
                                  a2.dtype.itemsize, b2.dtype.itemsize)
            else:  # the scattered blocks are the layout's own cells
                rows, cols, ks = (tuple(np.diff(e).tolist()) for e in
                                  (lay.row_edges, lay.col_edges, lay.k_edges))
                got = loc.readers(lay, (rows, ks), (ks, cols), "a", "b",
                                  ops.a2.dtype.itemsize, ops.b2.dtype.itemsize)
            reads[id(lay)] = (lay, got)  # the layout kept alive: its id stays its own
            return got

        def cost(lay, us):
            addrs = [u.address for u in us]
            routes = loc.by_route(read(lay), addrs, where, ipc=ipc, from_client=a2 is None)
            return loc.cost(routes) + loc.partial_bytes(lay, addrs, acc)

        orders = a2 is not None and bool(where)
        # units no layout gives a share (CPU workers beside a GPU: shares() follows the
        # throughputs alone) stay out of the search and are kept last, blockless. Measured
        # need: with a GPU worker beside 15 CPU workers, every layout costed shared C
        # between 16 units again (in a CPU rehearsal on a 2-core machine the call's client time
        # was 5.0 ms against 2.9 ms with the GPU worker alone)
        from distmm.engine.dask.layout import shares

        weights = shares([u.gflops for u in units], ops.m, ops.n, ops.k, acc)
        idle = [u for u, w in zip(units, weights) if w <= 0]
        working = [u for u, w in zip(units, weights) if w > 0]
        best = split = loc.choose(working if idle else units, make, cost, orders=orders)
        if idle:  # the working units' shares, unchanged by the idle ones (0 each)
            full = best.units + idle
            kept = shares([u.gflops for u in best.units], ops.m, ops.n, ops.k, acc)
            best = split = replace(best, units=full,
                                   layout=make(full, best.grid, kept + (0.0,) * len(idle)))
        colocated = None
        options = [loc.choose(us, make, cost, orders=orders) for us in loc.merged(units)]
        if options:
            one = min(options, key=lambda c: c.bytes)
            pick = "device" if one.bytes <= split.bytes else "worker"
            best = one if pick == "device" else split
            colocated = {"chosen": f"one unit per {pick}",
                         "bytes": {"one unit per device": one.bytes,
                                   "one unit per worker": split.bytes}}
        addrs = [u.address for u in best.units]
        chosen = read(best.layout)
        info = {"route": "worker_to_worker" if a2 is not None else "scatter",
                "estimated_bytes": best.bytes, "naive_bytes": split.naive_bytes,
                "method": best.method if orders else "grid", "candidates": best.candidates,
                "grid": best.grid, "colocated": colocated,
                "routes": loc.by_route(chosen, addrs, where, ipc=ipc, from_client=a2 is None),
                "assignment": [u.address for u, blk in zip(best.units, best.layout.blocks)
                               if blk is not None]}
        return best.layout, best.units, info, chosen

    def run(self, request: Request):
        """``numpy.ndarray`` for host operands (computed on the cluster and
        gathered), a lazy ``dask.array.Array`` for dask operands (dask.array's
        output chunks, or the plan's tiles when a tile was asked for; one
        chunk per element along batch axes)."""
        import time

        ops, plan = request.operands, request.plan
        slots = self.slots
        units = self._block_units(ops)
        stats: dict = {"mode": "blocks" if units else "tiles", "started": time.time(),
                       "shape": (ops.m, ops.n, ops.k), "moved": []}
        t0 = time.perf_counter()
        if ops.family == "dask":
            from distmm.engine.dask.lazy import lazy_blocks, lazy_product

            a2, b2 = ops.a2, ops.b2
            follow = self._chunk_tile is not None and tuple(plan.tile) == self._chunk_tile
            geometry = Geometry.of(plan, a2.chunks, b2.chunks, follow_chunks=follow)
            if units:
                from distmm.engine.dask.graph import CellTasks
                from distmm.engine.dask.layout import layout_devices

                from distmm.config import get_config
                from distmm.engine.dask import transfer
                from distmm.engine.dask.locality import ipc_sources

                where = self._where_of(ops)
                pairs, stats["transfer"] = transfer.ipc_pairs(
                    self.client, units, get_config().dask_device_transfer,
                    bool(where) and transfer.device_chunks(a2, b2))
                layout, units, stats["locality"], reads = self._place(
                    ops, plan, units, where, a2, b2, ipc=pairs, row_cuts=geometry.row_edges,
                    col_cuts=geometry.col_edges,
                    k_cuts=sorted(set(geometry.a_k) | set(geometry.b_k)))
                addresses = [u.address for u in units]
                sources = ipc_sources(reads, addresses, where, pairs)
                homes = None
                if sources:  # each cell's worker: whose export of a chunk its task opens
                    homes = {(bi, bj, g): addresses[layout.unit_of_partial(bi, bj, g)]
                             for bi, bj in layout.cells() for g in range(layout.groups)}
                cpu = sorted({u.address for u in units if not u.gpu}) or sorted(
                    {u.address for u in units})
                cells = CellTasks(layout_devices(layout, units), _fail_tiles(), tuple(cpu), homes)
                pull = bool(sources) and transfer.ensure_lifetime(self.client)
                result = lazy_blocks(ops, plan, a2, b2, geometry, layout, addresses, cells,
                                     request.backend, sources=sources, pull=pull)
                if sources:
                    stats["transfer"]["pull"] = pull
                stats["transfer"]["exports"] = len({(k, h) for (k, _), h in sources.items()})
                stats.update(_layout_stats(layout, units, plan))
                stats["estimated_bytes"] = _lazy_estimate(ops, plan, layout, addresses, a2, b2,
                                                          where, pairs)
                record(stats)
                return result
            if slots and not ops.batch:
                slots, _ = slots_by_locality(self.client, plan, geometry, slots, a2, b2,
                                             where=self._where_of(ops))
            result = lazy_product(ops, plan, a2, b2, geometry, slots, request.backend)
            gm, gn = geometry.grid
            stats.update(tasks=len(result.dask.layers[result.name]), cells=gm * gn,
                         estimated_bytes={"plan": plan.bytes_moved})
            record(stats)
            return result
        from distmm.engine.dask.eager import run_eager

        layout = None
        if units:
            layout, units, stats["locality"], _ = self._place(ops, plan, units, {})
            stats.update(_layout_stats(layout, units, plan))
        else:
            stats.update(cells=plan.grid[0] * plan.grid[1],
                         estimated_bytes={"plan": plan.bytes_moved})
        out = run_eager(ops, plan, self.client, slots, request.backend,
                        progress=request.progress, report=request.report,
                        retry_timeout=self.retry_timeout, layout=layout, units=units,
                        fail=_fail_tiles() if layout is not None else (), stats=stats)
        stats["seconds"] = time.perf_counter() - t0
        record(stats)
        return out


def _lazy_estimate(ops, plan, layout, addresses, a2, b2, where, ipc=frozenset()) -> dict:
    import numpy as np

    from distmm.engine.dask.stats import estimate_lazy

    return estimate_lazy(layout, addresses, a2, b2, where, np.dtype(plan.acc_dtype).itemsize,
                         ops.m * ops.n * np.dtype(ops.dtype).itemsize, ipc=ipc)


def _layout_stats(layout, units, plan) -> dict:
    import numpy as np

    gm, gn = layout.grid
    per_unit = []
    total = max(layout.m * layout.n, 1)
    for u, unit in enumerate(units):
        per_unit.append({"address": unit.address, "gpu": unit.gpu, "gflops": unit.gflops,
                         "block": layout.blocks[u], "share": layout.area(u) / total})
    est = layout.bytes_moved(np.dtype(plan.acc_dtype).itemsize)
    return {"cells": gm * gn, "groups": layout.groups, "units": per_unit,
            "grid": (gm, gn), "estimated_bytes": est,
            "tasks": gm * gn * (1 if layout.groups == 1 else layout.groups + len(layout.reduction))}
