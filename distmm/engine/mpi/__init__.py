"""The MPI engine: SUMMA on a process grid, for ``mpirun`` jobs and mpi4py programs.

This module covers: ``MPIEngine`` (the ``Engine`` for ``engine="mpi"``):
operands that every rank holds (numpy arrays, or memmaps, zarr arrays and
h5py datasets that every rank can slice) are cut into the grid's blocks, each
rank keeping (reading) only its own; SUMMA computes C's blocks; every rank gets
the whole product (``Allgatherv``), or its block goes straight into
``request.out`` when that is a shared on-disk target. ``run_distributed``
multiplies two ``DistArray`` s and returns one.

The process grid is ``distmm.grid.grid_for_plan(request.plan, ranks)``: a pure
function of the plan the API made, the same on every rank.
It does *not* cover: validation (``distmm.api``), grid choice (``distmm.grid``),
panel broadcasts (``comm``), the grid's communicators, made once per
communicator and reused (``gridcomms``), the algorithm (``summa``), files (``io``).
Ranks run BLAS with the threads the environment gives them (set
``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS`` to cores per rank).
"""
from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from distmm.engine.base import Engine, Operands, Request
from distmm.engine.mpi.distarray import DistArray, square_grid
from distmm.engine.mpi.gridcomms import cache_stats, grid_comms, local_gpu, release
from distmm.engine.mpi.agree import agree, differing, fingerprint
from distmm.engine.mpi.summa import LocalFailure, block_parts, summa
from distmm.engine.tiles import finish_tile
from distmm.plan import sums_whole_k
from distmm.errors import NotPicklable
from distmm.fpflags import collect, object_rows, placed, report
from distmm.grid import GridPlan, gpu_panels, grid_for_plan

__all__ = ["MPIEngine", "DistArray", "square_grid", "world", "cache_stats"]

log = logging.getLogger("distmm.engine.mpi")


def world():
    """``MPI.COMM_WORLD`` (mpi4py is imported on first use)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


class MPIEngine(Engine):
    """SUMMA over the ranks of ``comm`` (default ``MPI.COMM_WORLD``).

    Every rank must call ``distmm.matmul`` with the same operands (same shapes
    and dtypes); the result is the full product on every rank.

    Parameters
    ----------
    comm : mpi4py communicator, optional
    comm_backend : str
        Panel broadcasts: ``"auto"``, ``"mpi"``, ``"nccl"``, ``"cuda-aware"``, ``"staged"``.
    abort_on_error : bool
        An exception on one rank while the ranks exchange panels, and a
        ``KeyboardInterrupt`` on one rank (Ctrl-C, SIGINT at that rank) anywhere in the
        product, print one line naming the rank and call ``MPI_Abort`` (status 130 for the
        interrupt, 1 otherwise; the others would wait for it forever); errors found before
        any exchange (operands that differ between ranks, a missing backend, a
        ``MemoryError`` allocating the result or its gather on one rank) are raised on every
        rank,
        and so are those of a rank's own work after its last exchange (an object element
        numpy cannot multiply: numpy's error on every rank) and numpy's floating-point
        reports of the whole product under ``np.errstate`` (``distmm.engine.mpi.agree``).
        Object elements that do not pickle or unpickle where they would move raise
        ``NotPicklable`` on every rank; ``run`` (operands every rank holds) then has each
        rank compute the whole product with numpy's own loop.

    The row and column communicators of each grid shape (NCCL ones on GPUs) are made by
    the first product on ``comm`` and reused by every later one; they go when ``comm`` is
    freed, at exit, or with ``distmm.engine.mpi.gridcomms.release(comm)`` (call it on every
    rank after a failed product when ``abort_on_error=False``: a broadcast may have been
    left half done).
    """

    name = "mpi"

    def __init__(self, comm=None, comm_backend: str = "auto", *, abort_on_error: bool = True):
        self.comm = comm if comm is not None else world()
        self.comm_backend = comm_backend
        self.abort_on_error = abort_on_error
        #: what the last product moved: bytes this rank received, the estimate, the grid
        self.last_stats: dict = {}

    def workers(self, operands: Operands, *, on_gpu: bool) -> int:
        return self.comm.size

    def check_operands(self, operands: Operands) -> None:
        if operands.family == "dask":
            raise ValueError("engine='mpi' takes numpy, cupy or on-disk operands, not dask arrays")

    def run(self, request: Request):
        self.check_operands(request.operands)
        # a Ctrl-C on one rank, between collectives (it waits for a blocking MPI call to
        # return), would leave the others waiting in the next one: it ends the job
        with self._one_rank_ends_the_job(KeyboardInterrupt):
            return self._run(request)

    def _run(self, request: Request):
        ops, plan = request.operands, request.plan
        on_gpu = request.on_gpu or ops.family == "cupy"
        values = (fingerprint(ops.a2), fingerprint(ops.b2)) if self.comm.size > 1 else None
        _same_on_every_rank(self.comm, (tuple(ops.a.shape), ops.a.dtype.str, tuple(ops.b.shape),
                                        ops.b.dtype.str, ops.dtype.str,
                                        "GPU" if on_gpu else "CPU", plan.precision), values)
        grid = grid_for_plan(plan, self.comm.size)
        batch = tuple(ops.batch)
        a = ops.a2 if not batch else np.broadcast_to(ops.a2, batch + (ops.m, ops.k))
        b = ops.b2 if not batch else np.broadcast_to(ops.b2, batch + (ops.k, ops.n))
        if ops.family == "cupy":
            import cupy

            a = ops.a2 if not batch else cupy.broadcast_to(ops.a2, batch + (ops.m, ops.k))
            b = ops.b2 if not batch else cupy.broadcast_to(ops.b2, batch + (ops.k, ops.n))
        out = request.out
        if out is None:
            xp = np
            if ops.family == "cupy":
                import cupy as xp
            out_arr, error = None, None
            try:  # a MemoryError on one rank alone: raised on every rank, before any exchange
                out_arr = xp.empty(batch + (ops.m, ops.n), dtype=np.dtype(plan.dtype))
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
                error = exc
            agree(self.comm, error, (), into=set(), when="allocating the product")
        else:
            out_arr = out
        flags: set = set()  # reported once for the whole stack, as numpy's loop does
        for idx in np.ndindex(*batch):
            a2 = a[idx] if idx else a
            b2 = b[idx] if idx else b
            # compared above: each rank cuts its blocks without comparing them again
            da = DistArray.from_agreed(_host(a2), self.comm, grid.a_layout)
            db = DistArray.from_agreed(_host(b2), self.comm, grid.b_layout)
            seen: set = set()  # an object product's rows, placed in the stack below
            try:
                c = self.run_distributed(da, db, grid, request.backend, on_gpu=on_gpu,
                                         precision=plan.precision, flags=seen)
                full = c.gather(root=None)
            except NotPicklable:  # raised on every rank: each holds both operands whole
                with collect() as seen:  # numpy's own object loop, on every rank
                    full = object_rows(np.matmul, _host(a2), _host(b2), (0, 0))
            flags |= placed(seen, idx)
            if ops.family == "cupy":
                import cupy

                full = cupy.asarray(full)
            if idx:
                out_arr[idx] = full
            else:
                out_arr[...] = full
        report(flags)  # after out is filled, as numpy reports after its loop
        return out_arr

    def run_distributed(self, a: DistArray, b: DistArray, grid: GridPlan, backend: str, *,
                        on_gpu: bool = False, phases=None,
                        streamed: bool | None = None, precision: str = "highest",
                        flags: set | None = None) -> DistArray:
        """``a @ b`` for distributed operands on ``grid`` (made by the planner
        for ``a.shape[0], b.shape[1], a.shape[1]``): operands not in the grid's
        layout are redistributed first; the result is in ``grid.c_layout``. Operands that
        do not live on the engine's communicator or a ``Dup`` of it (``MPI.Comm.Compare``
        neither IDENT nor CONGRUENT) are a ``ValueError`` on every rank, before any work.

        ``streamed``: the product runs in stripes (``distmm.engine.mpi.stream``: each
        rank's host blocks stay in host memory, pieces of A's stripes and B's column panel
        are broadcast, C is written into a host block stripe by stripe) on a ``rows x
        cols`` grid with k not split, whose ``c_layout`` the result then has. ``None``
        (default): streamed for GPU ranks whose host blocks, with C's, would not fit the
        device memory all ranks have.

        ``precision``: ``distmm.precision``'s mode, which every rank's executor applies
        to the panels it multiplies (checked against the grid's dtype by the caller).

        Host products report numpy's floating-point flags of the whole product on every
        rank (``distmm.engine.mpi.agree``); with ``flags`` (a set) they are added to it
        instead, for a caller that reports once for several products.

        With ``abort_on_error``, a ``KeyboardInterrupt`` on one rank (Ctrl-C, or SIGINT at
        that rank) anywhere in the product ends the job with one line and status 130
        (``MPI_Abort``): the other ranks would wait for it in their next collective call."""
        _one_communicator(self.comm, a, b)
        # a Ctrl-C on one rank, between the collectives below (it waits for a blocking MPI
        # call to return), would leave the others waiting in the next one: it ends the job
        with self._one_rank_ends_the_job(KeyboardInterrupt):
            return self._distributed(a, b, grid, backend, on_gpu=on_gpu, phases=phases,
                                     streamed=streamed, precision=precision, flags=flags)

    def _distributed(self, a: DistArray, b: DistArray, grid: GridPlan, backend: str, *,
                     on_gpu: bool, phases, streamed, precision: str, flags) -> DistArray:
        """``run_distributed``'s work, once the operands are known to share the communicator."""
        from distmm.executor import get_executor

        a.settle()  # from_array's operands: the same array on every rank (collective)
        b.settle()
        acc = np.dtype(grid.acc_dtype)
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"inner dimensions differ: a has shape {a.shape}, b has shape {b.shape}")
        if streamed is None:
            streamed = on_gpu and _too_big_for_the_device(self.comm, a, b, grid)
        if streamed:
            return self._streamed(a, b, grid, backend, on_gpu=on_gpu, phases=phases,
                                  precision=precision, flags=flags)
        a = a.moved(grid.a_layout)
        b = b.moved(grid.b_layout)
        from distmm.phases import Phases

        # device synchronizations only where the caller asked for the phases: otherwise the
        # product stays asynchronous on the device, as before the phases were recorded
        sync = _synchronizer(on_gpu and phases is not None)
        phases = phases if phases is not None else Phases()
        device = None
        start = time.perf_counter()
        if on_gpu:
            device = local_gpu(self.comm)
        executor = get_executor(backend, acc, on_gpu=on_gpu, precision=precision)
        # host products: numpy's floating-point reports are collected while the panels move
        # and reported once every rank has agreed (distmm.engine.mpi.agree); so is what a
        # rank's own work raised after its last exchange (an object element's TypeError)
        error = None
        with collect() if not on_gpu else contextlib.nullcontext(set()) as seen:
            try:
                comms = grid_comms(self.comm, grid, on_gpu=on_gpu, prefer=self.comm_backend,
                                   device=device)
                if on_gpu:  # wide panels on one host, narrow across hosts (grid.gpu_panels)
                    grid = gpu_panels(grid, across_hosts=comms.hosts > 1)
                before = comms.bytes_received
                phases.add("startup", start, time.perf_counter())
                with executor:
                    with phases.phase("h2d" if on_gpu else "read"):
                        put = _device if on_gpu else executor.asarray
                        a_dev, b_dev = put(a.local, acc), put(b.local, acc)
                        sync()
                    xp = np
                    if on_gpu:
                        import cupy as xp
                    with phases.phase("gemm"):  # panel broadcasts overlap it
                        c = summa(grid, a_dev, b_dev, executor, comms, xp=xp)
                        sync()
                    received = comms.bytes_received - before
            except LocalFailure as failed:
                error, c, received = failed.error, None, 0
            except BaseException as exc:
                # The other ranks may be waiting in a broadcast for this one: end the job
                # rather than leave it hanging; a Ctrl-C with a shell's status (130).
                self._end_the_job(exc)
                raise
            start = time.perf_counter()
            on_device = on_gpu and hasattr(a.local, "__cuda_array_interface__")  # C stays there
            local = None
            try:  # float16's rounding reports its flags too
                local = _finish(grid, c, grid.c_layout.local_shape(self.comm.rank),
                                on_device=on_device, parts=_host_parts(grid, self.comm.rank,
                                                                       executor, on_gpu))
            except Exception as exc:
                if on_gpu:
                    raise
                error = exc
        if not on_gpu:
            agree(self.comm, error, seen, into=flags)
        phases.add("d2h", start, time.perf_counter())
        result = DistArray(local, grid.c_layout, self.comm)
        result.stats = self.last_stats = {
            "grid": grid.shape, "bytes_received": int(received),
            "bytes_estimated": int(grid.bytes_received(
                self.comm.rank, whole_k=not on_gpu and sums_whole_k(grid.dtype))),
            "panels_per_layer": [len(p) - 1 for p in grid.panel_edges] if grid.ranks > 1 else [1],
        }
        return result


    def _end_the_job(self, exc: BaseException) -> None:
        """``MPI_Abort`` after one line naming this rank and ``exc`` (status 130 for a Ctrl-C,
        1 otherwise), where ``abort_on_error`` and the other ranks may be waiting for this one
        in a collective call; returns otherwise (the caller raises ``exc``)."""
        if not self.abort_on_error or self.comm.size == 1 or \
                getattr(exc, "_distmm_every_rank", False):
            return
        import sys

        if isinstance(exc, KeyboardInterrupt):
            print(f"distmm: rank {self.comm.rank} of {self.comm.size} interrupted "
                  f"during the product; calling MPI_Abort", file=sys.stderr, flush=True)
            self.comm.Abort(130)
        log.critical("rank %d of %d failed during the product (%s: %s); aborting the "
                     "job", self.comm.rank, self.comm.size, type(exc).__name__, exc)
        print(f"distmm: rank {self.comm.rank} of {self.comm.size} failed during the "
              f"product ({type(exc).__name__}: {exc}); calling MPI_Abort",
              file=sys.stderr, flush=True)
        self.comm.Abort(1)

    @contextlib.contextmanager
    def _one_rank_ends_the_job(self, kinds=BaseException):
        """``_end_the_job`` for an exception of ``kinds`` raised in the block (one every rank
        raised together, marked by ``_streamed``, passes)."""
        try:
            yield
        except kinds as exc:
            self._end_the_job(exc)
            raise

    def _streamed(self, a: DistArray, b: DistArray, grid: GridPlan, backend: str, *,
                  on_gpu: bool, phases, precision: str = "highest", flags=None) -> DistArray:
        """The stripes of ``distmm.engine.mpi.stream`` from host blocks into a host block."""
        from distmm.engine.mpi.stop import PeerStopped, StopWatch
        from distmm.engine.mpi.stream import BlockSink, PanelSource, device_memory, run_stripes
        from distmm.executor import get_executor
        from distmm.phases import Phases
        from distmm.plan_batch import plan_batch

        phases = phases if phases is not None else Phases()
        comm, rank = self.comm, self.comm.rank
        device = local_gpu(comm) if on_gpu else None
        forced = (grid.rows, grid.cols) if grid.layers == 1 else None
        plan = plan_batch(grid.m, grid.n, grid.k, grid.dtype, ranks=comm.size,
                          memory=device_memory(on_gpu, comm), grid=forced)
        g = plan.grid
        a = a.moved(g.a_layout)
        b = b.moved(g.b_layout)
        ar0, _, ac0, _ = g.a_layout.local_bounds(rank)
        br0, _, bc0, _ = g.b_layout.local_bounds(rank)
        cr0, _, cc0, _ = g.c_layout.local_bounds(rank)
        c_local = np.empty(g.c_layout.local_shape(rank), dtype=np.dtype(g.dtype))
        comms = grid_comms(comm, g, on_gpu=on_gpu, prefer=self.comm_backend, device=device)
        before = comms.bytes_received
        watch = StopWatch(comm)
        error, seen = None, set()
        try:
            with get_executor(backend, np.dtype(g.acc_dtype), on_gpu=on_gpu,
                              precision=precision) as executor:
                seen = run_stripes(plan, rank, PanelSource(a._host_local(), (ar0, ac0)),
                                    PanelSource(b._host_local(), (br0, bc0)),
                                    BlockSink(c_local, (cr0, cc0)), executor, comms, watch,
                                    phases, on_gpu=on_gpu,
                                    todo=range(plan.stripe_count(g.coords(rank)[1])))
        except BaseException as exc:  # noqa: BLE001 - the ranks agree on it below
            error = exc
            # the rank that stopped first told everyone; an error held until this rank's
            # last broadcast (``watch.held``) is not told: the others finish and agree
            if not isinstance(exc, PeerStopped) and exc is not watch.held:
                watch.tell(f"{type(exc).__name__}: {exc}", 1)
        finally:
            watch.close()
        # A rank whose stripes needed nothing from a failed one may have finished: every rank
        # learns the outcome, raises the error of the rank that stopped first and makes the
        # grid's communicators again (a broadcast may be left half done).
        own = None if isinstance(error, PeerStopped) else error
        try:
            agree(comm, own, seen, before_raise=lambda: release(comm), into=flags)
        except BaseException as exc:
            exc._distmm_every_rank = True  # every rank raises it: no job to end
            raise
        if error is not None:  # stopped by a rank outside the agreement (cannot happen)
            release(comm)
            raise error
        result = DistArray(c_local, g.c_layout, comm)
        result.stats = self.last_stats = {
            "grid": g.shape, "bytes_received": int(comms.bytes_received - before),
            "bytes_estimated": int(g.bytes_received(rank)), "stripes": plan.stripes,
            "streamed": True, "phases": phases.totals(),
        }
        return result


def _one_communicator(comm, a: DistArray, b: DistArray) -> None:
    """``ValueError`` unless ``a`` and ``b`` live on ``comm`` or a ``Dup`` of it (the same
    ranks in the same order): checked locally, so every rank refuses alike, before any
    collective (blocks placed by another communicator's ranks would meet the wrong panels
    in SUMMA, and a rank failing mid-exchange ends the job)."""
    from mpi4py import MPI

    if any(MPI.Comm.Compare(x.comm, comm) not in (MPI.IDENT, MPI.CONGRUENT) for x in (a, b)):
        raise ValueError("matmul: both DistArrays must live on one communicator (the same "
                         "ranks in the same order; a Dup of it will do)")


def _too_big_for_the_device(comm, a: DistArray, b: DistArray, grid: GridPlan) -> bool:
    """Whether any rank's host blocks of A and B, with its block of C, exceed the device
    memory every rank has (the in-core product copies all three to the GPU).

    Collective. Where cupy does not import on some rank, every rank raises
    ``BackendUnavailable`` with the install hint, as the local engine does for a GPU
    backend, before any work on the device."""
    if hasattr(a.local, "__cuda_array_interface__") or hasattr(b.local, "__cuda_array_interface__"):
        return False
    from distmm.engine.mpi.stream import device_memory
    from distmm.errors import BackendUnavailable

    try:
        import cupy  # noqa: F401
        why = None
    except ImportError as exc:
        why = f"rank {comm.rank}: {exc}"
    why = next((w for w in comm.allgather(why) if w), None)
    if why is not None:
        raise BackendUnavailable(f"a GPU backend needs cupy and a CUDA GPU on every rank: "
                                 f"pip install \"distmm[gpu]\" ({why})")
    local_gpu(comm)
    item = np.dtype(grid.acc_dtype).itemsize
    need = max((grid.a_layout.local_shape(r)[0] * grid.a_layout.local_shape(r)[1]
                + grid.b_layout.local_shape(r)[0] * grid.b_layout.local_shape(r)[1]
                + grid.c_layout.local_shape(r)[0] * grid.c_layout.local_shape(r)[1]) * item
               for r in range(comm.size))
    return need > device_memory(True, comm)


def _same_on_every_rank(comm, key, values=None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks passed the same shapes and dtypes
    and chose the same device kind and precision (``key``: a's shape and dtype, b's, the
    result dtype, the device kind and the precision, in that order), and
    operands whose ``values`` (``agree.fingerprint`` of each) agree."""
    if comm.size == 1:
        return
    keys = comm.allgather((key, values))
    other = next((r for r, (k, _) in enumerate(keys) if k != keys[0][0]), None)
    if other is not None:
        raise ValueError(f"engine='mpi' needs the same operands and settings on every rank; got "
                         f"(a shape, a dtype, b shape, b dtype, result dtype, device, precision) "
                         f"{keys[0][0]} on rank 0 "
                         f"but {keys[other][0]} on rank {other}")
    other = next((r for r, (_, v) in enumerate(keys) if v != keys[0][1]), None)
    if other is not None:
        raise ValueError(f"engine='mpi' needs the same operands on every rank: the values of "
                         f"{differing(keys[0][1], keys[other][1])} differ between rank 0 and rank {other} (sampled elements); "
                         f"a matrix whose blocks live on different ranks is a distmm.DistArray")


def _finish(grid: GridPlan, c, shape, *, on_device: bool, parts=None):
    """This rank's C block in the result dtype (``finish_tile``, given ``parts``), from the
    accumulated block ``c`` (``None``: a rank with no block of its own); on the device where
    ``on_device``."""
    res = np.dtype(grid.dtype)
    if c is None:
        local = np.empty(shape, dtype=res)
        if on_device:
            import cupy

            local = cupy.asarray(local)
        return local
    local = finish_tile(grid, c, parts)
    if on_device:
        import cupy

        return cupy.ascontiguousarray(local.astype(res, copy=False))
    if not isinstance(local, np.ndarray):
        local = local.get()
    return np.ascontiguousarray(local, dtype=res)


def _host_parts(grid: GridPlan, rank: int, executor, on_gpu: bool):
    """``summa.block_parts`` where the rank's products are numpy's matmul on the host (the
    CPU executor's: its numba kernels take no complex dtype); ``None`` otherwise."""
    from distmm.executor.cpu import CPUExecutor

    if on_gpu or not isinstance(executor, CPUExecutor):
        return None
    return block_parts(grid, rank)


def _synchronizer(on_gpu: bool):
    """A function that waits for this device's queued work (nothing on CPUs)."""
    if not on_gpu:
        return lambda: None
    import cupy

    return cupy.cuda.Device().synchronize


def _host(x):
    """numpy view of a host operand; cupy operands are copied to the host once per rank
    (each rank then keeps only its block)."""
    if hasattr(x, "__cuda_array_interface__"):
        return x.get()
    return x


def _device(x, dtype):
    import cupy

    return cupy.asarray(x, dtype=dtype)
