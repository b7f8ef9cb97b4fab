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
``stacks``     dask-array stacks of small matrices each whole in a chunk: one task per
               batch chunk of the result
``workers``    GPU workers (a "GPU" resource or a probe) and each worker's GFLOP/s
``transfer``   device (cupy) chunks between GPU workers of one host through
               CUDA IPC: the mode, the probe per cluster, the export tasks'
               offers and opening them, with TCP as the fallback
``pull``       block tasks fetch those offers straight from the holders, not
               through the scheduler
``stats``      ``last_stats`` (tasks, estimated bytes), ``transfer_mark`` and
               ``transfer_report``
``files``      operands in files every worker sees (``.npy``, zarr, HDF5): the
               workers read their own blocks; a dask operand's reads of an HDF5 file
               go to the workers checked to read it, and no other
``sink``       C written by the workers into a staged output file (``out=``)
``scheduler``  the address of a client's scheduler

It does *not* cover: tile arithmetic (``distmm.plan``), block mode's placement
(``distmm.plan_blocks``: the layout, which unit computes which block, what moves
where; a pure planner fed the facts ``run`` gathers), numpy's semantics and
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
at 1/256 of a TCP byte; those of GPU workers on different hosts (or emulated nodes) go
device to device through NCCL (``nccl_route``: the export task publishes the chunk, the
block task asks the holder to send it and receives it while its first GEMMs run), counted
at 1/8. ``run`` gathers the facts (the worker table and
where the chunks are in one round trip, the workers' probes and the IPC
pairs, both cached), plans (``distmm.plan_blocks.plan_blocks``), then runs. Dask operands keep their
chunks: block edges lie on output chunk edges and each output chunk is a
slice of its block. A GPU task that fails (``TileFailed``: out of memory
after the pipeline's retries, a lost device) is run again on a CPU worker,
and the log names the moved cells. CPU-only clusters keep one task per plan
tile (``tiles``) unless ``blocks`` is configured: on two CPU cores the two
shapes ran equally fast (``bench/NOTES.md``), and tiles keep the pinned,
stealable small tasks the fault and memory tests rely on. A GPU backend (``raw``,
``cublas``) is refused before any work where none of the workers' probes found a CUDA
device, and in tile mode (stacks, or ``tiles`` configured) where some have none: tiles go
to every worker; in block mode a mixed cluster's CPU workers run CPU blocks.

Memory
------
``plan_hints`` gives the planner a memory budget from the workers'
``memory_limit`` (a quarter of it per worker thread), so that tiles and k
groups fit workers that dask.array's own ``A @ B`` fits.
"""
from __future__ import annotations

import functools
import logging
import sys
import time

from distmm.engine.base import Engine, Operands, Request, replace_fast
from distmm.engine.dask.chunks import Geometry, check_chunks, chunk_tile
from distmm.engine.dask.placement import slots_by_locality, worker_slots
from distmm.engine.dask.scheduler import scheduler_address
from distmm.engine.dask.stats import last_stats, record, transfer_mark, transfer_report
from distmm.errors import SchedulerLost
from distmm.fpflags import report as report_flags
from distmm.plan_blocks import ClusterFacts, OperandFacts, plan_blocks

__all__ = ["DaskEngine", "worker_slots", "MEMORY_FRACTION", "last_stats", "transfer_mark",
           "transfer_report", "FAIL_TILES_KEY"]

log = logging.getLogger("distmm.engine.dask")

#: share of a worker's ``memory_limit`` (per thread) one task may hold: the
#: rest is the process itself, inputs fetched for the next tasks, and results
#: waiting to be gathered, below dask's spill (60%) and pause (80%) thresholds
MEMORY_FRACTION = 0.25

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


def _scheduler_gone(client, exc: BaseException | None = None) -> bool:
    """Whether ``exc`` ended a call because the client's scheduler went away (None: whether
    it has, as the client sees it): the client is no longer running (reconnecting, or
    closed), or the error is a failed connection to the scheduler's own address (raised
    before the client notices)."""
    if getattr(client, "status", "running") in ("connecting", "closing", "closed"):
        return True
    address = scheduler_address(client)
    return bool(address) and isinstance(exc, OSError) and address in str(exc)


def _scheduler_lost(client, exc: BaseException | None, address: str | None,
                    during: str) -> SchedulerLost:
    """The ``SchedulerLost`` of a call whose scheduler went away ``during`` (the set-up,
    the run, with the function the user called): ``client_gone``'s words, then what failed
    where that says more (a connection to the scheduler that failed, not the ``KeyError`` of
    a worker table a closed client returns empty). ``address``: the scheduler's, which a
    closed client no longer knows."""
    from distmm.engine.dask.eager import client_gone

    text = client_gone(client, address=address, during=during)
    if isinstance(exc, OSError):
        text += f": {type(exc).__name__}: {' '.join(str(exc).split())}"
    return SchedulerLost(text)


def _no_workers(what: str, address: str | None, waited: float) -> str:
    """The one line of a cluster where no worker joined within ``waited`` seconds
    (``distmm.retry-timeout``): how long it waited, and how to start workers."""
    at = f" at {address}" if address else ""
    where = address or "SCHEDULER-ADDRESS"
    return (f"{what}: the Dask cluster{at} has no workers: none joined within {waited:g} s "
            f"(distmm.retry-timeout); start workers for it (dask worker {where}), or a "
            f"cluster with its workers (distmm cluster --scheduler-file FILE)")


def _resolve_client(client, *, required: bool, what: str = "matmul"):
    if client is not None:
        if getattr(client, "status", None) in ("closing", "closed"):
            if getattr(client, "scheduler_comm", True) is None:
                # closed by distributed itself, which drops the scheduler's comm when it
                # tries to reconnect (a client its caller closed keeps its closed comm): the
                # scheduler was lost, which the caller did not do (status 1, not 2)
                raise SchedulerLost(f"distmm dask engine: the distributed.Client lost its "
                                    f"scheduler before {what} began (distributed closed it "
                                    f"after failing to reconnect; the client is "
                                    f"{client.status})")
            # a closed client has no scheduler left: refused here with its state, not an
            # AttributeError from deep inside distributed
            raise ValueError(f"engine='dask' got a distributed.Client that is {client.status}: "
                             f"pass an open client (or none, for the default one)")
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
                "(distributed.Client(...)) first"
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


@functools.lru_cache(maxsize=64)
def _chunk_hint(m: int, n: int, k: int, dtype, a_row_chunks, b_col_chunks) -> tuple[int, int, int]:
    """The plan tile chunked operands suggest (``chunk_tile`` with the planner's k-block
    for one worker): pure, kept for the few shapes of a session so that ``run`` reads
    the same answer ``plan_hints`` gave without planning twice."""
    from distmm.plan import make_plan

    return chunk_tile(a_row_chunks, b_col_chunks, make_plan(m, n, k, dtype, workers=1).tile[2])


def _chunk_tile_of(ops: Operands) -> tuple[int, int, int]:
    return _chunk_hint(ops.m, ops.n, ops.k, ops.dtype, tuple(ops.a2.chunks[-2]),
                       tuple(ops.b2.chunks[-1]))


def _operand_facts(x) -> OperandFacts:
    """A dask operand as the block planner sees it: its name and last two axes' chunks."""
    return OperandFacts(x.dtype.itemsize, x.name, (tuple(x.chunks[-2]), tuple(x.chunks[-1])))


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
        ``distmm.errors.WorkersLost``; also how long a cluster with no worker yet is
        waited for before any work.
    operands : Operands, optional
        The call's operands: for dask operands, where their persisted chunks are
        is asked together with the worker table.
    what : str
        The function the user called (``"matmul"``, ``"gemm"``), which a
        ``SchedulerLost`` names.

    Raises
    ------
    ValueError
        No client when one is required; a cluster where no worker joined within
        ``retry_timeout``.
    distmm.errors.SchedulerLost
        The client's scheduler was lost while the cluster's facts were gathered (here, or in
        ``run`` before any task is sent), or before: a client distributed closed itself.
    """

    name = "dask"

    def __init__(self, client=None, *, required: bool = True, retry_timeout: float = 60.0,
                 operands: Operands | None = None, what: str = "matmul"):
        if not retry_timeout > 0:
            raise ValueError(f"retry_timeout must be positive, got {retry_timeout!r}")
        self.what = what
        self.client = _resolve_client(client, required=required, what=what)
        self.retry_timeout = float(retry_timeout)
        # one round trip per call: the scheduler's worker table (read by the slots, the
        # budget and the units) and, for the call's dask ``operands``, where their
        # persisted chunks are
        self._info, self.slots, self._where = None, [], None
        # whether an operand's reads of a file are pinned to the workers that read it: the
        # lazy result is then a ``lazy.PinnedArray``, whose optimisation keeps those pins
        self._reads_pinned = False
        # the scheduler's address, for the words of a SchedulerLost after the client closed
        self._address = scheduler_address(self.client)
        if self.client is not None:
            from distmm.engine.dask.placement import cluster_state

            dask_ops = operands is not None and operands.family == "dask"
            try:
                info, where = cluster_state(self.client, *((operands.a2, operands.b2)
                                                           if dask_ops else ()))
                self._info = info or None
                if dask_ops:
                    self._where = (operands.a, operands.b, where)
                self.slots = worker_slots(self.client, wait=self.retry_timeout, info=self._info)
            except Exception as exc:
                # a scheduler lost here fails the request as it would any other: the
                # connection's error, a closed pool, a closed client's missing scheduler
                if _scheduler_gone(self.client, exc):
                    raise self._lost(exc) from exc
                raise
            if not self.slots:
                if _scheduler_gone(self.client):  # the wait for a worker ended with it
                    raise self._lost(None)
                raise ValueError(_no_workers(self.what, self._address, self.retry_timeout))

    def _lost(self, exc: BaseException | None) -> SchedulerLost:
        """The ``SchedulerLost`` of a scheduler lost while the call was set up."""
        return _scheduler_lost(self.client, exc, self._address,
                               f"while {self.what} set up its run")

    def _check_scheduler(self) -> None:
        """``SchedulerLost`` where the client's scheduler went away during the set-up: the
        probes take a failed request for a worker leaving and go on without its answer, so
        a scheduler lost meanwhile ends the call here, not in a lazy result over chunks that
        went with it or in a scatter to no cluster."""
        if self.client is not None and _scheduler_gone(self.client):
            raise self._lost(None)

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
        """``memory_budget`` from the workers' ``memory_limit`` (``memory_budget``) and,
        for dask operands, the ``tile`` their chunks suggest (``chunk_tile``). Stores
        nothing: ``run`` follows the operands' chunks when the plan's tile is that one.

        Raises
        ------
        ValueError
            A dask operand with unknown chunk sizes.
        """
        hints: dict = {}
        if self.client is not None:
            budget = memory_budget(self.client, self._info)
            if budget:
                hints["memory_budget"] = budget
        if operands.family != "dask":
            return hints
        check_chunks("a", operands.a2)
        check_chunks("b", operands.b2)
        hints["tile"] = _chunk_tile_of(operands)
        return hints

    def run(self, request: Request):
        """``numpy.ndarray`` for host operands (computed on the cluster and
        gathered), ``request.out`` filled when there is one (by the workers
        themselves when it is a staged output file they all see:
        ``distmm.engine.dask.sink``), a lazy ``dask.array.Array`` for dask operands (dask.array's
        output chunks, or the plan's tiles when a tile was asked for; one
        chunk per element along batch axes, except for a stack of small matrices in numpy
        chunks, whole or spanning chunks: the operands' batch chunks, ``stacks``; in-memory
        stacks of whole matrices go as about one batch block per worker slot). Gathers the cluster's
        facts, plans block mode's placement (``distmm.plan_blocks``) where it applies, then
        runs.

        Raises
        ------
        distmm.errors.BackendUnavailable
            A GPU backend whose tasks would reach workers without a CUDA device
            (``_check_devices``), before any work is sent."""
        try:
            return self._run(request)
        except SchedulerLost:
            raise
        except Exception as exc:
            # a scheduler that died fails whatever asks it next (a KeyError of its worker
            # table, a closed connection pool): said as what happened
            if _scheduler_gone(self.client, exc):
                raise _scheduler_lost(self.client, exc, self._address,
                                      f"during {self.what}") from exc
            raise

    def _run(self, request: Request):
        t0, started = time.perf_counter(), time.time()
        ops = request.operands
        if ops.family == "dask":
            ops = self._promoted(self._check_datasets(ops))
            request = replace_fast(request, operands=ops)
        facts, transfer_info = self._facts(ops, request.backend)
        self._check_scheduler()
        stats: dict = {"mode": "blocks" if facts else "tiles", "started": started,
                       "shape": (ops.m, ops.n, ops.k), "moved": []}
        if transfer_info is not None:
            stats["transfer"] = transfer_info
        if ops.family == "dask":
            result = self._run_lazy(request, facts, stats)
            self._check_scheduler()  # the set-up's end: no lazy result of a cluster gone
            return result
        if ops.family == "cupy":
            return self._run_from_device(request, facts, stats, t0)
        return self._run_eager(request, facts, stats, t0)

    def _promoted(self, ops: Operands) -> Operands:
        """``ops`` with a 1-D operand promoted under distmm's own keys (``lazy.promoted``);
        where its chunks are (asked with the worker table) is kept for the promoted one."""
        from distmm.engine.dask.lazy import promoted

        own = promoted(ops)
        kept = self._where
        if own is not ops and kept is not None and kept[0] is ops.a and kept[1] is ops.b:
            self._where = (own.a, own.b, kept[2])
        return own

    def _check_datasets(self, ops: Operands) -> Operands:
        """``ops`` with the tasks of a dask operand that read an HDF5 dataset
        (``dask.array.from_array``) pinned to the workers checked to read its file, and no
        other (``lazy.pin_reads``: a worker that does not see the file, or that joins after
        the check, would fail the read). The workers are asked in one round trip
        (``files.visible``); where some do not see the files, each worker is asked for each
        file. A dataset stored through a filter some worker's HDF5 lacks is refused before
        any task, where that worker sees its file: it would fail on its first chunk. A file
        no worker sees is not pinned (its reads fail where they run)."""
        self._reads_pinned = False
        if self.client is None:
            return ops
        from distmm.engine.dask import files
        from distmm.hdf5_filters import datasets_of

        kind = "dask array of HDF5 dataset"
        found = []  # (dataset, its FileSource, the name of its operand)
        for name, x in (("a", ops.a), ("b", ops.b)):
            for ds in datasets_of(x):
                found.append((ds, files.source_of(ds), f"{self.what}: operand {name}"))
        found = [f for f in found if f[1] is not None]
        if not found:
            return ops
        workers = sorted(self._info or self.client.scheduler_info(n_workers=-1)["workers"])
        sources, names = [f[1] for f in found], [f[2] for f in found]
        if files.visible(self.client, sources, workers, names=names, kind=kind):
            readers = {id(ds): workers for ds, _, _ in found}
        else:
            readers = {id(ds): [w for w in workers
                                if files.visible(self.client, [src], [w], names=[name], kind=kind)]
                       for ds, src, name in found}
        return self._pinned_reads(ops, lambda ds: readers.get(id(ds)))

    def _pinned_reads(self, ops: Operands, readers) -> Operands:
        """``ops`` with each dask operand's reads pinned (``lazy.pin_reads``); where its
        chunks are (asked with the worker table) is kept for the pinned ones (same keys)."""
        from distmm.engine.dask.lazy import pin_reads

        a, pinned_a = pin_reads(ops.a, readers)
        b, pinned_b = pin_reads(ops.b, readers)
        if not (pinned_a or pinned_b):
            return ops
        self._reads_pinned = True
        kept = self._where
        if kept is not None and kept[0] is ops.a and kept[1] is ops.b:
            self._where = (a, b, kept[2])
        return replace_fast(ops, a=a, b=b)

    def _run_from_device(self, request: Request, facts: ClusterFacts | None, stats: dict,
                         t0: float):
        """cupy operands of this process's GPU: their blocks go to the workers from host
        memory (as numpy operands' do), and C comes back to this GPU (a cupy array, or the
        cupy ``out=`` filled)."""
        import cupy

        ops = request.operands
        host = replace_fast(ops, a=cupy.asnumpy(ops.a), b=cupy.asnumpy(ops.b), family="numpy")
        out = request.out
        result = self._run_eager(replace_fast(request, operands=host, out=None), facts, stats, t0,
                                 report=False)  # cupy's matmul reports no flags
        if out is None:
            return cupy.asarray(result)
        out[...] = cupy.asarray(result)
        return out

    def _facts(self, ops: Operands, backend: str):
        """Block mode's ``ClusterFacts`` (None: one task per plan tile) and, for dask
        operands, the CUDA IPC summary for ``last_stats()["transfer"]``. A GPU ``backend``
        whose tasks would reach workers without a CUDA device is refused here, before any
        work (``_check_devices``)."""
        from distmm.config import get_config
        from distmm.executor import GPU_BACKENDS

        cfg = get_config()
        tiles = cfg.dask_layout == "tiles" or self.client is None or ops.batch
        gpu_backend = backend in GPU_BACKENDS and self.client is not None
        if tiles and not gpu_backend:
            return None, None
        from distmm.engine.dask.workers import found_devices, worker_info

        table = self._info
        if table is None:
            table = self.client.scheduler_info(n_workers=-1)["workers"]
        infos = worker_info(self.client, cfg.dask_worker_gflops, table)
        tiles = tiles or not infos or (cfg.dask_layout == "auto" and not any(w.gpu for w in infos))
        if gpu_backend:
            self._check_devices(backend, found_devices(sorted(table), table), len(table), tiles)
        if tiles:
            return None, None
        if ops.family != "dask":
            return ClusterFacts(infos), None
        from distmm.engine.dask import nccl_route, transfer

        where = self._where_of(ops)
        device = bool(where) and transfer.device_chunks(ops.a2, ops.b2)
        pairs, info = transfer.ipc_pairs(self.client, infos, cfg.dask_device_transfer, device)
        nccl, info["nccl"] = nccl_route.pairs(self.client, infos, cfg.dask_device_transfer,
                                              device)
        return ClusterFacts(infos, where, pairs, nccl), info

    def _check_devices(self, backend: str, found: dict, workers: int, tiles: bool) -> None:
        """``BackendUnavailable`` where the GPU ``backend``'s tasks would reach a worker
        without a CUDA device: none of the ``workers`` has one, or, in tile mode (``tiles``:
        each worker takes tiles), some have none. In block mode a mixed cluster runs: GPU
        blocks go to the GPU workers, CPU workers' blocks run the CPU executor. ``found``:
        each answered worker's probe (``workers.found_devices``); a worker that did not
        answer is not counted as one without."""
        blind = sorted(a for a, cuda in found.items() if not cuda)
        if not blind or (len(blind) < workers and not tiles):
            return
        from distmm.errors import BackendUnavailable

        if len(blind) == workers:
            raise BackendUnavailable(
                f"{self.what}: backend {backend!r} needs cupy and a CUDA GPU, and none of the "
                f"Dask cluster's {workers} worker{'s' if workers != 1 else ''} has one "
                f"(backend 'auto' runs on the workers' CPUs)")
        raise BackendUnavailable(
            f"{self.what}: backend {backend!r} needs cupy and a CUDA GPU on every Dask worker "
            f"that takes tiles (stacks, distmm.dask-layout 'tiles'), and {len(blind)} of the "
            f"cluster's {workers} workers have none ({', '.join(blind[:3])}"
            f"{', ...' if len(blind) > 3 else ''})")

    def _run_lazy(self, request: Request, facts: ClusterFacts | None, stats: dict):
        from distmm.engine.dask import stacks
        from distmm.engine.dask.lazy import lazy_product, pinned

        ops, plan = request.operands, request.plan
        a2, b2 = ops.a2, ops.b2
        geometry = Geometry.of(plan, a2.chunks, b2.chunks,
                               follow_chunks=tuple(plan.tile) == _chunk_tile_of(ops))
        if facts is not None:
            result = self._lazy_blocks(request, facts, geometry, stats)
        elif stacks.applies(ops, plan, geometry):
            result = stacks.lazy_stack(ops, plan, a2, b2, request.backend)
            stats.update(tasks=len(result.dask.layers[result.name]), cells=1,
                         estimated_bytes={"plan": plan.bytes_moved})
        else:
            slots = self.slots
            if slots and not ops.batch:
                slots, _ = slots_by_locality(self.client, plan, geometry, slots, a2, b2,
                                             where=self._where_of(ops))
            result = lazy_product(ops, plan, a2, b2, geometry, slots, request.backend)
            gm, gn = geometry.grid
            stats.update(tasks=len(result.dask.layers[result.name]), cells=gm * gn,
                         estimated_bytes={"plan": plan.bytes_moved})
        record(stats)
        return pinned(result) if self._reads_pinned else result

    def _lazy_blocks(self, request: Request, facts: ClusterFacts, geometry, stats: dict):
        """Block mode over dask operands: plan on the output chunks' edges, then build
        the graph (``lazy.lazy_blocks``), export tasks where chunks go through CUDA IPC."""
        import numpy as np

        from distmm.config import get_config
        from distmm.engine.dask import transfer
        from distmm.engine.dask.graph import CellTasks
        from distmm.engine.dask.lazy import lazy_blocks

        ops, plan = request.operands, request.plan
        a2, b2 = ops.a2, ops.b2
        bp = plan_blocks(plan, facts, _operand_facts(a2), _operand_facts(b2),
                         row_cuts=geometry.row_edges, col_cuts=geometry.col_edges,
                         k_cuts=sorted(set(geometry.a_k) | set(geometry.b_k)),
                         configured_budget=get_config().memory_budget)
        stats["locality"] = dict(bp.locality)
        sources = dict(bp.sources)
        # each cell's worker: whose export of a chunk its task opens
        cells = CellTasks(bp.devices(), _fail_tiles(), bp.fallback_workers(),
                          bp.homes() if sources else None)
        pull = bool(sources) and transfer.ensure_lifetime(self.client)
        result = lazy_blocks(ops, plan, a2, b2, geometry, bp.layout, bp.addresses, cells,
                             request.backend, sources=sources, pull=pull,
                             nccl=facts.nccl if pull else frozenset())
        if sources:
            stats["transfer"]["pull"] = pull
        stats["transfer"]["exports"] = len({(k, h) for (k, _), h in sources.items()})
        stats.update(bp.stats(np.dtype(plan.acc_dtype).itemsize))
        stats["estimated_bytes"] = dict(bp.estimated_bytes)
        return result

    def _run_eager(self, request: Request, facts: ClusterFacts | None, stats: dict, t0: float,
                   *, report: bool = True):
        import numpy as np

        from distmm.config import get_config
        from distmm.engine.dask.eager import run_eager

        ops, plan = request.operands, request.plan
        layout = units = None
        if facts is not None:
            bp = plan_blocks(plan, facts, OperandFacts(ops.a2.dtype.itemsize),
                             OperandFacts(ops.b2.dtype.itemsize),
                             configured_budget=get_config().memory_budget)
            layout, units = bp.layout, list(bp.units)
            stats["locality"] = dict(bp.locality)
            stats.update(bp.stats(np.dtype(plan.acc_dtype).itemsize))
        else:
            stats.update(cells=plan.grid[0] * plan.grid[1],
                         estimated_bytes={"plan": plan.bytes_moved})
        flags: set[str] = set()
        out = run_eager(ops, plan, self.client, self.slots, request.backend,
                        progress=request.progress, report=request.report,
                        retry_timeout=self.retry_timeout, layout=layout, units=units,
                        fail=_fail_tiles() if layout is not None else (), stats=stats,
                        out=request.out, flags=flags, what=self.what)
        stats["seconds"] = time.perf_counter() - t0
        record(stats)
        if report:  # as numpy's matmul: after C is filled, under the caller's errstate
            report_flags(flags)
        return out
