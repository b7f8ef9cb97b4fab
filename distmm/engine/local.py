"""The in-process engine: a thread pool runs one task per (C tile, k group).

This module covers: running a ``Request`` in this process: cupy operands
through the GPU executor's batched path, host operands (numpy arrays,
memmaps, zarr arrays, h5py datasets) tile by tile on threads or through the
GPU stream pipeline, for small work and whenever no cluster is around.
It does *not* cover: clusters (``distmm.engine.dask``), MPI
(``distmm.engine.mpi``), or kernels (``distmm.executor``).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import logging
import threading
import time

import numpy as np

from distmm.config import available_cpus
from distmm.engine.base import Engine, Operands, Request
from distmm.engine.tiles import PartialSum, finish_tile, tile_partial
from distmm.executor import get_executor
from distmm.fpflags import as_matmul, collect
from distmm.plan import Plan, np_dtype
from distmm.threads import submit

__all__ = ["LocalEngine", "run_local", "default_workers"]

log = logging.getLogger("distmm.engine.local")


def default_workers() -> int:
    """Threads the local engine uses: the CPUs this process may run on
    (``distmm.config.available_cpus``: its affinity, re-read once a second)."""
    return available_cpus()


def _batched(ops: Operands, xp):
    """The operands as ``batch + (m, k)`` and ``batch + (k, n)`` arrays: 2-D
    operands as they are (on-disk arrays stay on disk), others as broadcast
    views (never copies)."""
    if not ops.batch and not ops.a_vector and not ops.b_vector and ops.a.ndim == ops.b.ndim == 2:
        return ops.a, ops.b
    a = xp.broadcast_to(ops.a2, ops.batch + (ops.m, ops.k))
    b = xp.broadcast_to(ops.b2, ops.batch + (ops.k, ops.n))
    return a, b


class LocalEngine(Engine):
    """Threads in this process (or this process's GPU).

    Parameters
    ----------
    threads : int, optional
        Pool size for CPU tiles; default: the CPUs this process may use.
    """

    name = "local"

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def workers(self, operands: Operands, *, on_gpu: bool) -> int:
        return 1 if on_gpu or operands.family == "cupy" else (self.threads or default_workers())

    def replayer(self, request: Request):
        """For 2-D cupy operands (no batch, no 1-D operand): the GPU executor's
        replayer of the product (``GPUExecutor.replayer``). The plan of a cupy
        product carries only m, n, k and the dtype to the executor, so neither
        the worker count nor the memory budget can change what it computes."""
        ops = request.operands
        if ops.family != "cupy" or ops.batch or ops.a_vector or ops.b_vector:
            return None
        executor = get_executor(request.backend, np_dtype(request.plan.acc_dtype),
                                on_gpu=request.on_gpu, precision=request.plan.precision)
        return getattr(executor, "replayer", lambda plan, a_dtype, b_dtype: None)(
            request.plan, ops.a.dtype, ops.b.dtype)

    def run(self, request: Request):
        ops, plan = request.operands, request.plan
        executor = get_executor(request.backend, np_dtype(plan.acc_dtype), on_gpu=request.on_gpu,
                                precision=plan.precision)
        if ops.family == "cupy":
            import cupy

            return executor.run_batched(plan, *_batched(ops, cupy))
        with executor:
            return run_local(plan, *_batched(ops, np), executor, out=request.out,
                             progress=request.progress)


def _one_tile(plan: Plan, a, b, executor, out):
    """A product of one tile and one k group (small products): no pool, no bar."""
    if out is not None and plan.dtype == "object" and isinstance(out, np.ndarray):
        # numpy's object loop writes out element by element: an element whose arithmetic
        # raises leaves the elements before it written, as numpy's own call does
        return np.matmul(executor.asarray(a, np.dtype(object)),
                         executor.asarray(b, np.dtype(object)), out=out)
    rows = _strip_rows(plan, executor)  # in strips where allowed: a signal is seen between
    if rows is not None and a.shape[-2] <= rows[0]:
        rows = None  # one strip: the kernel at once, as below
    if rows is not None or (plan.acc_dtype != plan.dtype and np_dtype(plan.dtype).kind == "f"):
        # the kernel's flags (its strips') and its sum's rounding (float16) are reported once,
        # in numpy's order (overflow before invalid under errstate "raise"), as for a tiled
        # product
        with as_matmul():
            acc = finish_tile(plan, _partial_in_strips(executor, plan, a, b, rows, _NEVER))
    else:
        acc = finish_tile(plan, tile_partial(executor, plan, a, b))
    if out is None:
        result = executor.to_host(acc) if acc.dtype == np_dtype(plan.dtype) else acc
        # the numba kernel's C is a view of a buffer with padded rows; numpy's is contiguous
        return np.ascontiguousarray(result) if isinstance(result, np.ndarray) else result
    out[...] = acc
    return out


def _progress_bar(progress, plan: Plan, count: int):
    """A tqdm bar over C tiles when asked for, or (``None``) on a terminal for
    products estimated to run over ten seconds at 20 GFLOP/s per worker."""
    import sys

    if progress is None:
        progress = plan.flops * max(count, 1) / (20e9 * plan.workers) > 10 and sys.stderr.isatty()
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=count * plan.grid[0] * plan.grid[1], unit="tile",
                desc="distmm matmul", file=sys.stderr)


def _nothing(_plan) -> None:
    pass


#: seconds that one kernel call takes, about, where a tile is computed a strip of rows at a
#: time: numba's kernels and numpy's loops check no signal, so a stopped product's running
#: tasks end within about that
STRIP_SECONDS = 0.1

#: seconds a stopped product waits for its running tasks to end at their next strip
STOP_WAIT = 0.5

#: flops of a tile's first strip (later ones are sized by the time the last one took)
STRIP_FLOPS = 1 << 26


#: the stop of a product that runs in the caller's thread only (a signal stops it there)
_NEVER = threading.Event()


def _strip_rows(plan: Plan, executor) -> tuple[int, int] | None:
    """The rows of a tile's first strip and the fewest of any strip (the executor's
    ``strip_rows``), or ``None`` where a tile is computed at once."""
    fewest = getattr(executor, "strip_rows", lambda dtype: None)(np_dtype(plan.acc_dtype))
    if fewest is None:
        return None
    kg = max(plan.k_slice(s).stop - plan.k_slice(s).start for s in range(plan.k_splits))
    return max(fewest, STRIP_FLOPS // max(2 * kg * plan.tile[1], 1)), fewest


def _partial_in_strips(executor, plan: Plan, a_panel, b_panel, rows, stop: threading.Event):
    """``tile_partial`` of the panels, a strip of ``a_panel``'s rows at a time (``rows``:
    the first strip's and the fewest, ``_strip_rows``; later strips take about
    ``STRIP_SECONDS``), or at once where ``rows`` is ``None``; ``None`` where ``stop`` is
    set before a strip starts."""
    m = a_panel.shape[0]
    if rows is None or m <= rows[0]:
        return tile_partial(executor, plan, a_panel, b_panel)
    step, fewest = rows
    b_panel = executor.asarray(b_panel, np_dtype(plan.acc_dtype))  # converted once
    part = None
    r = 0
    while r < m:
        if stop.is_set():
            return None
        start = time.perf_counter()
        strip = tile_partial(executor, plan, a_panel[r:r + step], b_panel)
        took = time.perf_counter() - start
        if part is None:
            part = np.empty((m,) + strip.shape[1:], strip.dtype)
        part[r:r + step] = strip
        r += step
        step = max(fewest, int(step * min(4.0, STRIP_SECONDS / max(took, 1e-6))))
    return part


class _Ends:
    """The pool's tasks as they end: those that raised, in the order they did, and a wake-up
    for the thread waiting on the next task's partial at each end (one callback a task,
    rather than a wait on the whole window for each partial)."""

    def __init__(self):
        self.failed: list = []
        self.wake = threading.Event()

    def watch(self, future):
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.failed.append(future)
        self.wake.set()

    def result(self, head):
        """``head``'s result, waited for; where a task failed first, its exception at once,
        not once the tasks before it are done."""
        while True:
            self.wake.clear()  # before the checks: an end after them sets it again
            if self.failed:
                self.failed[0].result()  # raises it
            if head.done():
                return head.result()
            self.wake.wait()


def run_local(plan: Plan, a, b, executor, *, threads: int | None = None, out=None,
              progress: bool | None = False):
    """Compute ``a @ b`` on this process following ``plan``.

    Parameters
    ----------
    plan : Plan
        Made for the trailing ``(m, k) @ (k, n)`` shapes.
    a, b : ndarray or sliceable array
        Shapes ``batch + (m, k)`` and ``batch + (k, n)`` with the same batch
        shape (broadcast views are fine); any dtype, layout and strides. 2-D
        operands may also be on disk (memmaps, zarr arrays, h5py datasets):
        only the panels a task needs are read.
    executor : Executor
    threads : int, optional
        Pool size; defaults to ``plan.workers`` (1 when the executor threads
        itself, as BLAS does for float32, float64 and complex).
    out : array, optional
        Where to write C (shape ``batch + (m, n)``, the plan's dtype): a numpy
        array, a memmap, a zarr array or an h5py dataset, written tile by tile.
        A product stopped early (KeyboardInterrupt, a tile's exception) leaves
        each C tile of ``out`` either as it was or finished (of a zarr array:
        each chunk, written one at a time).
    progress : bool, optional
        Show a progress bar over C tiles; ``None``: on a terminal for long runs.

    Returns
    -------
    ``out``, or a new ndarray of ``batch + (m, n)`` and the plan's result dtype.
    """
    if (plan.single_task and plan.k and isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
            and a.ndim == 2 and not hasattr(executor, "run_plan")):
        return _one_tile(plan, a, b, executor, out)
    batch = tuple(a.shape[:-2])
    getattr(executor, "begin", _nothing)(plan)
    if out is None:
        # the GPU executor's host arrays are faulted in while it computes (hostmem)
        out = getattr(executor, "empty_host", np.empty)(batch + (plan.m, plan.n), np_dtype(plan.dtype))
    if out.size == 0:
        return out
    if plan.k == 0:
        out[...] = np.zeros(out.shape, dtype=out.dtype)
        return out
    if threads is None:
        threads = 1 if executor.threads_inside(plan.acc_dtype) else plan.workers
    if np_dtype(plan.acc_dtype) == object:
        # numpy's object loop holds the GIL (threads would add nothing) and its elements'
        # arithmetic (numpy scalars) reports its own flags, "in scalar multiply" or "in
        # scalar add", under the caller's errstate: its tiles run in the caller's thread
        threads = 1
    batch_index = list(np.ndindex(*batch))  # broadcast views are indexed, never reshaped (no copies)
    bar = _progress_bar(progress, plan, len(batch_index))
    try:
        return _run(plan, a, b, executor, threads, out, batch_index, bar)
    finally:
        if bar is not None:
            bar.close()


def _run(plan: Plan, a, b, executor, threads: int, out, batch_index, bar):
    if hasattr(executor, "run_plan"):
        # Executors with a whole-product path (the GPU stream pipeline) take the plan as is.
        for idx in batch_index:
            if idx:
                executor.run_plan(plan, a[idx], b[idx], out[idx])
            else:  # 2-D: hand the operands over as they are (memmap, zarr, ...)
                executor.run_plan(plan, a, b, out)
            if bar is not None:
                bar.update(plan.grid[0] * plan.grid[1])
        return out

    # numpy's floating-point reports, once for the product; an object product's elements
    # report their own as they go (in this thread, as numpy's object loop)
    own = np_dtype(plan.acc_dtype) == object
    with contextlib.nullcontext(set()) if own else as_matmul() as flags:
        return _tiles(plan, a, b, executor, threads, out, batch_index, bar, flags, own)


def _tiles(plan: Plan, a, b, executor, threads: int, out, batch_index, bar, flags: set,
           own: bool = False):
    # Set where the product stops early (a signal, a task's exception): the tasks running
    # end at their next strip of rows (waited for ``STOP_WAIT`` seconds at most).
    stop = threading.Event()
    rows = _strip_rows(plan, executor)

    # Index with one tuple (batch index + slices) so that on-disk arrays read
    # and write only the panel at hand.
    def task(idx, i, j, s):
        if stop.is_set():
            return None, set()
        ks = plan.k_slice(s)
        # a pool thread: its flags go to the caller's report (own: the tile reports them)
        with contextlib.nullcontext(set()) if own else collect() as seen:
            part = _partial_in_strips(executor, plan, a[idx + (plan.row_slice(i), ks)],
                                      b[idx + (ks, plan.col_slice(j))], rows, stop)
        return (None if part is None else executor.to_host(part)), seen

    def keys():
        for idx in batch_index:
            for i, j in plan.tiles():
                for s in range(plan.k_splits):
                    yield idx, i, j, s

    total = PartialSum(plan)

    def take(key, done):
        """A task's partial, in k order: added to its tile's sum (``PartialSum``, which
        keeps a few); with the tile's last, the tile is stored."""
        nonlocal total
        part, seen = done
        flags.update(seen)
        total.add(part)
        idx, i, j, s = key
        if s + 1 == plan.k_splits:
            out[idx + (plan.row_slice(i), plan.col_slice(j))] = finish_tile(plan, total.result())
            total = PartialSum(plan)
            if bar is not None:
                bar.update(1)

    count = len(batch_index) * plan.grid[0] * plan.grid[1] * plan.k_splits
    if threads <= 1 or count == 1:
        for key in keys():
            take(key, task(*key))
        return out

    # Tasks are handed to the pool at most 2 x threads ahead of the one whose partial is
    # taken next: the threads always have the next ones, and the partials finished but not
    # yet taken (a slow write of C, a tile's k groups) are a few, not the whole product's.
    # A pool that takes no new work (the interpreter shutting down while this thread still
    # runs, no thread to start) leaves them to this thread (``distmm.threads.submit``).
    pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="distmm-local")
    window: collections.deque = collections.deque()
    ends = _Ends()
    try:
        for key in keys():
            window.append((key, ends.watch(submit(pool, task, *key))))
            if len(window) > 2 * threads:
                take(window[0][0], ends.result(window[0][1]))
                window.popleft()
        while window:
            take(window[0][0], ends.result(window[0][1]))
            window.popleft()
    except BaseException:
        # a signal or a failure: the tasks not started are dropped and the running ones end
        # at their next strip, waited for that long (``STOP_WAIT``), not for a task that
        # cannot stop meanwhile (numba compiling its kernel, a BLAS call, a file's read)
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        cf.wait([future for _, future in window], timeout=STOP_WAIT)
        raise
    try:
        pool.shutdown(wait=True)
    except BaseException:  # a signal while the idle threads exit: they are gone at once
        pool.shutdown(wait=True)
        raise
    return out
