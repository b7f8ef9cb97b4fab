"""The in-process engine: a thread pool runs one task per (C tile, k group).

This module covers: running a ``Plan`` over (batches of) host arrays in this
process, for small work and whenever no cluster is around.
It does *not* cover: clusters (``distmm.engine.dask_engine``), MPI
(``distmm.engine.mpi``), or kernels (``distmm.executor``).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os

import numpy as np

from distmm.engine.base import finish_tile, reduce_partials, tile_partial
from distmm.plan import Plan

__all__ = ["run_local", "default_workers"]

log = logging.getLogger("distmm.engine.local")


def default_workers() -> int:
    """Threads the local engine uses: the CPUs this process may run on."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def run_local(plan: Plan, a, b, executor, *, threads: int | None = None, out=None):
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
        itself, as BLAS does).
    out : array, optional
        Where to write C (shape ``batch + (m, n)``, the plan's dtype): a numpy
        array, a memmap, a zarr array or an h5py dataset, written tile by tile.

    Returns
    -------
    ``out``, or a new ndarray of ``batch + (m, n)`` and the plan's result dtype.
    """
    batch = tuple(a.shape[:-2])
    if out is None:
        out = np.empty(batch + (plan.m, plan.n), dtype=np.dtype(plan.dtype))
    if out.size == 0:
        return out
    if plan.k == 0:
        out[...] = np.zeros(out.shape, dtype=out.dtype)
        return out
    if threads is None:
        threads = 1 if getattr(executor, "threads_inside", False) else plan.workers
    batch_index = list(np.ndindex(*batch))  # broadcast views are indexed, never reshaped (no copies)

    if hasattr(executor, "run_plan"):
        # Executors with a whole-product path (the GPU stream pipeline) take the plan as is.
        for idx in batch_index:
            if idx:
                executor.run_plan(plan, a[idx], b[idx], out[idx])
            else:  # 2-D: hand the operands over as they are (memmap, zarr, ...)
                executor.run_plan(plan, a, b, out)
        return out

    # Index with one tuple (batch index + slices) so that on-disk arrays read
    # and write only the panel at hand.
    def task(idx, i, j, s):
        ks = plan.k_slice(s)
        part = tile_partial(executor, plan, a[idx + (plan.row_slice(i), ks)],
                            b[idx + (ks, plan.col_slice(j))])
        return executor.to_host(part)

    def store(idx, i, j, parts):
        out[idx + (plan.row_slice(i), plan.col_slice(j))] = finish_tile(plan, reduce_partials(plan, parts))

    keys = [(idx, i, j) for idx in batch_index for i, j in plan.tiles()]
    if threads <= 1 or len(keys) * plan.k_splits == 1:
        for key in keys:
            store(*key, [task(*key, s) for s in range(plan.k_splits)])
        return out
    with cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="distmm-local") as pool:
        futures = {key: [pool.submit(task, *key, s) for s in range(plan.k_splits)] for key in keys}
        try:
            for key, futs in futures.items():
                store(*key, [f.result() for f in futs])
        except BaseException:
            for futs in futures.values():
                for f in futs:
                    f.cancel()
            raise
    return out
