"""A pipelined product of host-resident operands: budget, schedule, retries.

This module covers: ``run_pipelined``, computing ``out[...] = a @ b`` on one
GPU for operands in host memory (numpy arrays, memmaps, zarr arrays or
anything whose 2-D slices are numpy arrays) with the result written to a
host array, memmap or zarr array: it resolves the device budget, takes the
planner's schedule for it (``distmm.plan_pipeline.pipeline_tiling``), runs it
(``distmm.executor.pipeline.run``) and, when the device runs out of memory,
starts over with the planner's smaller tiling.

It does *not* cover: operands already on the GPU (``GPUExecutor`` multiplies
those directly), choosing kernels (the executor's ``device_gemm`` does), Dask
or MPI, or rendering timelines (``distmm.cli.trace``).

Numerics: ``float32`` and ``float64`` results (numpy's result dtype of the two
operands; operands are cast while they are staged). Each C element is a sum
over k-blocks in a fixed order for a given tiling; the tiling depends on the
memory budget, so results may differ in the last bits between budgets. Other
result dtypes raise ``TypeError``: the GPU executor's tile path handles them.
"""
from __future__ import annotations

import gc
import logging

import numpy as np

from distmm.executor.hostmem import TouchHold, hold_until, in_process_memory
from distmm.executor.pipeline.direct import is_page_locked
from distmm.executor.pipeline import keep
from distmm.executor.pipeline.device import CupyDevice, current_device_id
from distmm.executor.pipeline.panel import panel_bytes
from distmm.executor.pipeline.run import PipelineRun, host_threads
from distmm.executor.pipeline.startup import note_product, wait_running
from distmm.executor.pipeline.timeline import Timeline
from distmm.plan import is_bfloat16
from distmm.precision import REDUCED
from distmm.plan_pipeline import FAST_DTYPES, pipeline_tiling, shrink_tiling, spare_bytes

__all__ = ["run_pipelined", "operand_transport"]

log = logging.getLogger("distmm.executor.pipeline")


def _resolve_budget(device, device_memory_limit) -> int:
    available = int(0.95 * device.available_bytes())
    if device_memory_limit is None:
        from distmm.config import get_config

        device_memory_limit = get_config().device_memory_limit
    if device_memory_limit is None:
        return int(0.9 * device.available_bytes())
    if isinstance(device_memory_limit, str):
        from dask.utils import parse_bytes

        device_memory_limit = parse_bytes(device_memory_limit)
    return min(int(device_memory_limit), available)


def operand_transport(executor, a, b, dtype) -> np.dtype:
    """The dtype A and B cross to the device in: bfloat16 operands (``ml_dtypes``) that an
    executor of ``precision="bf16"`` multiplies as they are go as their bits (uint16: half of
    float32's bytes, and no conversion on the host); anything else as ``dtype``, the result's
    (cast while staging)."""
    if (np.dtype(dtype) == np.float32 and getattr(executor, "precision", "highest") == "bf16"
            and is_bfloat16(a.dtype) and is_bfloat16(b.dtype)):
        return np.dtype(np.uint16)
    return np.dtype(dtype)


#: ``distmm-debug.pipeline-direct``: true page-locks the caller's arrays in place so that A, B
#: and C cross straight (``direct_in``, ``direct_out``); off by default, since locking costs
#: more than the ring's host copies (bench/NOTES.md, host-resident bfloat16). Arrays already
#: page-locked by their owner cross straight without it.
DIRECT_KEY = "distmm-debug.pipeline-direct"


def _shaped(x) -> bool:
    """A C-contiguous, aligned, non-empty 2-D numpy array."""
    return (isinstance(x, np.ndarray) and x.ndim == 2 and x.flags.c_contiguous
            and x.flags.aligned and x.size > 0)


#: ``distmm-debug.pipeline-lead``: how many narrow units run k outer at the start beside
#: tensor-core GEMMs (``PipelineTiling.lead``); unset: the planner's ``LEAD``
LEAD_KEY = "distmm-debug.pipeline-lead"


def _lead() -> int | None:
    return _positive(LEAD_KEY)


def _positive(key: str) -> int | None:
    """The debug setting ``key`` as a positive integer; None where unset."""
    import dask.config

    value = dask.config.get(key, None)
    if value in (None, ""):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return number


#: ``distmm-debug.pipeline-columns``: C's units in this many column blocks, in a growing
#: order, where A, B and C all cross straight beside tensor-core GEMMs (``_columns``); unset
#: or 1: whole rows (bench/NOTES.md, host-resident bfloat16)
COLUMNS_KEY = "distmm-debug.pipeline-columns"


def _columns(straight_in, straight_out: bool) -> int:
    """C's column blocks (``choose_tiling``'s ``columns``), where asked and A, B and C all
    cross straight (page-locked), so that GEMMs start once one block of B has crossed; A's
    rows then stay on the device for every block (``APanels``). Through the ring, A would
    cross once a block."""
    columns = _positive(COLUMNS_KEY) or 1
    return columns if set(straight_in) == {"A", "B"} and straight_out else 1


def _asked(key: str = DIRECT_KEY) -> bool:
    """Whether the debug setting ``key`` is on (off unless set true)."""
    import dask.config

    return str(dask.config.get(key, False)).lower() in ("1", "true", "yes", "on")


def _straight(x, device) -> bool:
    """``x`` crosses straight: page-locked by its owner already, or, where ``DIRECT_KEY``
    asks, the process's own memory (never a file's pages) to be locked in place."""
    return _shaped(x) and (is_page_locked(device, x) or (_asked() and in_process_memory(x)))


def panel_room(tiling, budget: int, precision: str) -> int:
    """Device bytes A's whole-row panels (``distmm.executor.pipeline.panel``) may take: the
    budget's spare beside tensor-core GEMMs, where the copies are the limit; none beside SIMT
    ones, where the first panel's wait cost 4-6% against column slices straight from the
    rows (bench/NOTES.md, host-resident bfloat16)."""
    return spare_bytes(tiling, budget) if precision in REDUCED else 0


def direct_in(a, b, in_dtype, device=None) -> tuple:
    """Which of ``"A"``, ``"B"`` are copied straight from the caller's array
    (``distmm.executor.pipeline.direct``) instead of through the staging ring and a host
    copy: operands whose bytes cross as they are (``in_dtype``: no cast while staging) and
    that ``_straight`` takes."""
    in_dtype = np.dtype(in_dtype)

    def as_is(x):
        return x.dtype == in_dtype or (in_dtype == np.uint16 and is_bfloat16(x.dtype))

    return tuple(name for name, x in (("A", a), ("B", b))
                 if isinstance(x, np.ndarray) and as_is(x) and _straight(x, device))


def direct_out(out, dtype, device=None) -> bool:
    """Whether C's row blocks are copied straight into ``out``: a result of the result dtype
    that ``_straight`` takes."""
    return isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype) and _straight(out, device)


def _check_shapes(a, b, out, m, n, k) -> None:
    for name, x, shape in (("a", a, (m, k)), ("b", b, (k, n)), ("out", out, (m, n))):
        if len(x.shape) != 2 or tuple(x.shape) != shape:
            raise ValueError(f"pipelined matmul: {name} has shape {tuple(x.shape)}, expected {shape} "
                             f"(a {tuple(a.shape)}, b {tuple(b.shape)})")


def run_pipelined(executor, plan, a, b, out, *, device_memory_limit=None, pinned_pool=None,
                  trace: Timeline | None = None, tiles: tuple[int, int, int] | None = None,
                  info: dict | None = None, _device=None):
    """Compute ``out[...] = a @ b`` on the GPU from host-resident operands.

    Parameters
    ----------
    executor
        Any object with ``device_gemm(a_dev, b_dev, c_dev, *, alpha, beta,
        stream)`` computing into a preallocated cupy array on a stream
        (``GPUExecutor``, or ``distmm.executor.cublas.CublasGemm``).
    plan : Plan
        The product (``m``, ``n``, ``k``, ``dtype``); the schedule run is
        ``distmm.plan_pipeline.pipeline_tiling(plan, budget)``, the planner's
        tiling for this device's budget (the plan's own tile grid is for CPUs
        and clusters).
    a, b : array-like of shape (m, k), (k, n)
        numpy arrays, memmaps, zarr or h5py arrays: anything whose 2-D slices
        are numpy arrays; read tile by tile, never whole.
    out : writable array of shape (m, n)
        numpy array, memmap or zarr array; every element is written.
    device_memory_limit : int or str, optional
        Device bytes the pipeline may use. Default: ``distmm.device-memory-limit``,
        else 90% of the free device memory. Products far larger than this
        run in pieces.
    pinned_pool : PinnedPool, optional
        Staging buffers; default: the process-wide pool (``distmm.pinned-pool``).
    trace : Timeline, optional
        Filled with the start and end of every copy and kernel.
    tiles : (tm, tn, tk), optional
        Force square tiles of these sizes (mainly for tests).
    info : dict, optional
        Filled with the tiling used, the retries after out-of-memory errors,
        bytes copied each way and wall seconds.

    Returns
    -------
    out

    Raises
    ------
    TypeError
        A result dtype other than float32 / float64.
    ValueError
        Shapes that do not match the plan.
    MemoryError
        The device ran out of memory even with the smallest tiles (no partial
        result is returned).
    """
    m, n, k = int(plan.m), int(plan.n), int(plan.k)
    dtype = np.dtype(plan.dtype)
    if dtype not in FAST_DTYPES:
        raise TypeError(f"the stream pipeline computes float32 and float64 results, got {dtype}; "
                        f"use the GPU executor's tile path for this dtype")
    _check_shapes(a, b, out, m, n, k)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out[...] = 0
        return out
    if pinned_pool is None:
        from distmm.executor.pinned import default_pinned_pool

        pinned_pool = default_pinned_pool()
    note_product()
    wait_running()  # a warm-up still pinning its ring finishes that first
    # A fresh process's start-up, overlapped: cuBLAS starts on a thread while this one
    # allocates device buffers and pins the ring, and the background first touch of a
    # fresh result (hostmem) waits meanwhile, since it holds the lock those calls take.
    hold = TouchHold()
    start = getattr(executor, "start_cublas", None) if _device is None else None
    if start is not None:  # usually started already by the executor's ``begin``
        hold_until(start(dtype))
    try:
        return _run(executor, plan, a, b, out, device_memory_limit, pinned_pool, trace, tiles,
                    info, _device, hold)
    finally:
        hold.release()


def _run(executor, plan, a, b, out, device_memory_limit, pinned_pool, trace, tiles, info,
         _device, ready_hold):
    m, n, k = int(plan.m), int(plan.n), int(plan.k)
    dtype = np.dtype(plan.dtype)
    # the previous product's pool where it is kept (its blocks reused, not freed and taken
    # again); any pool being freed is free before the budget is read
    device = _device if _device is not None else (keep.take(current_device_id())
                                                   or CupyDevice(1 << 62))
    budget = _resolve_budget(device, device_memory_limit)
    if _device is None:
        if device.pool.total_bytes() > budget:
            device.release()  # a kept pool's blocks are reused without the limit's check
        device.pool.set_limit(size=budget)
    gemm = executor.device_gemm
    in_dtype = operand_transport(executor, a, b, dtype)
    precision = getattr(executor, "precision", "highest")
    straight_in, straight_out = direct_in(a, b, in_dtype, device), direct_out(out, dtype, device)
    lead = _lead()
    tiling = pipeline_tiling(plan, budget, tiles=tiles, precision=precision, lead=lead,
                             columns=_columns(straight_in, straight_out))
    if len(tiling.col_edges) > 2 and tiling.b_resident and (
            panel_bytes(tiling, in_dtype.itemsize) > panel_room(tiling, budget, precision)):
        # column blocks need all of A's rows held: where those panels do not fit, whole rows
        tiling = pipeline_tiling(plan, budget, tiles=tiles, precision=precision, lead=lead)
    retries = 0
    while True:
        run = PipelineRun(device, gemm, tiling, a, b, out, dtype, pinned_pool,
                           Timeline() if trace is not None else None, host_threads(),
                           on_ready=ready_hold.release, in_dtype=in_dtype,
                           direct_out=straight_out, direct_in=straight_in,
                           panel_bytes=panel_room(tiling, budget, precision))
        failure = None
        try:
            run.execute()
        except device.oom_errors as exc:
            failure = f"{type(exc).__name__}: {exc}"
        except BaseException:
            device.release()
            raise
        if failure is None:
            if _device is None:
                from distmm.config import get_config

                keep.give(device, get_config().device_keep)  # cudaFree off the caller's path
            else:
                device.release()
            break
        device.release()
        # The whole product starts over: every element of out is written again,
        # so no tile of the failed attempt survives.
        gc.collect()      # the failed attempt's frames are gone: free its buffers
        device.release()
        retries += 1
        smaller = shrink_tiling(tiling, m, n, k, dtype.itemsize, budget)
        if smaller is None:
            raise MemoryError(f"the GPU ran out of memory even with {tiling.tm_max} x "
                              f"{tiling.tn_max} tiles (budget {budget} bytes): {failure}")
        log.warning("GPU out of memory with %d x %d x %d tiles (%s); retrying with %d x %d x %d",
                    tiling.tm_max, tiling.tn_max, tiling.tk_max, failure,
                    smaller.tm_max, smaller.tn_max, smaller.tk_max)
        tiling = smaller
    if trace is not None:
        trace.ops.extend(run.timeline.ops)
        trace.meta.update(m=m, n=n, k=k, dtype=dtype.name, device=getattr(device, "name", "?"),
                          tiling=tiling.describe(), retries=retries, seconds=run.seconds,
                          bytes_h2d=run.bytes_h2d, bytes_d2h=run.bytes_d2h,
                          tflops=2 * m * n * k / run.seconds / 1e12 if run.seconds else None,
                          budget=budget, pinned_limit=pinned_pool.limit)
    if info is not None:
        info.update(tiling=tiling.describe(), retries=retries, seconds=run.seconds,
                    bytes_h2d=run.bytes_h2d, bytes_d2h=run.bytes_d2h, budget=budget,
                    operands_as=in_dtype.name, direct_out=run.direct_out,
                    direct_in=list(run.direct_in), a_panel=run.a_panel,
                    **getattr(run, "phases", {}))
    log.debug("pipelined %d x %d x %d %s: %.3f s, %d retries, %s mode, %s", m, n, k, dtype.name,
              run.seconds, retries, tiling.mode, getattr(run, "phases", {}))
    return out
