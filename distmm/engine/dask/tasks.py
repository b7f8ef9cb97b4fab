"""Task bodies of the Dask engine: what runs on a worker.

This module covers: the executor each worker process keeps (CPU, or its GPU
where it has one), assembling a task's panels from the chunks it was given,
the k-loop of one output block over one k group, one step of the plan's
reduction tree, the final cast to numpy's result dtype, and one whole block
of C in one task (``block_product``: the GPU executor's stream pipeline on a
GPU worker's device, raising ``distmm.errors.TileFailed`` when the device
fails, or the CPU executor).
It does *not* cover: which chunks a task gets (``distmm.engine.dask.chunks``),
building the graph (``distmm.engine.dask.graph``) or kernels
(``distmm.executor``). The functions here are module-level, pickled by
reference, and import nothing of dask.

Every task is pure and deterministic: recomputed on another worker after a
failure, it gives the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from distmm.engine.tiles import finish_tile, tile_partial

__all__ = ["TaskPlan", "BlockSpec", "partial_block", "sum_step", "block_product", "cut"]

_EXECUTORS: dict[tuple, Any] = {}
_GPU: list[bool] = []


@dataclass(frozen=True)
class TaskPlan:
    """The part of a ``Plan`` a task reads (``tile_partial``/``finish_tile``
    take it in place of the plan): small enough to ship in every task."""

    dtype: str
    acc_dtype: str
    tile: tuple[int, int, int]

    @classmethod
    def of(cls, plan) -> "TaskPlan":
        return cls(plan.dtype, plan.acc_dtype, tuple(plan.tile))


@dataclass(frozen=True)
class BlockSpec:
    """What one task needs to assemble its panels: plain data, no references.

    ``k_pieces`` lists, per k piece, A's pieces along k and B's pieces along k
    (each ``(block, start, stop)``); ``a_rows`` and ``b_cols`` the pieces along
    m and n; ``a_lead``/``b_lead`` the index into the chunks' batch axes;
    ``a_keys``/``b_keys`` the block index ``(row, col)`` of each chunk the task
    is handed, in order.
    """

    a_lead: tuple
    b_lead: tuple
    a_rows: tuple
    b_cols: tuple
    k_pieces: tuple
    a_keys: tuple
    b_keys: tuple
    finish: bool  # the product is not split along k: cast to the result dtype here
    batch_ndim: int = 0  # leading length-1 axes of the output chunk


def _worker_has_gpu() -> bool:
    if not _GPU:
        from distmm.executor import gpu_available

        _GPU.append(gpu_available())
    return _GPU[0]


def executor_for(backend: str, acc_dtype: str, block) -> Any:
    """The executor of this worker process, made once per (backend, dtype)."""
    from distmm.executor import GPU_BACKENDS, get_executor

    is_host = isinstance(block, np.ndarray)
    on_gpu = backend in GPU_BACKENDS or (backend == "auto" and (not is_host or _worker_has_gpu()))
    key = (backend, acc_dtype, on_gpu)
    ex = _EXECUTORS.get(key)
    if ex is None:
        ex = _EXECUTORS[key] = get_executor(backend, np.dtype(acc_dtype), on_gpu=on_gpu)
    return ex


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy  # a device chunk: the only other array type a worker holds here

    return cupy


def _panel(blocks: dict, lead: tuple, row_pieces, col_pieces):
    """The sub-panel of one operand over the given row and column pieces.

    ``blocks[(rb, cb)]`` is a chunk; ``lead`` indexes its batch axes; each piece
    is ``(block, start, stop)`` local to that block. One piece each: a view.
    """
    rows = []
    for rb, r0, r1 in row_pieces:
        cols = [blocks[(rb, cb)][lead + (slice(r0, r1), slice(c0, c1))] for cb, c0, c1 in col_pieces]
        rows.append(cols[0] if len(cols) == 1 else _xp(cols[0]).concatenate(cols, axis=1))
    return rows[0] if len(rows) == 1 else _xp(rows[0]).concatenate(rows, axis=0)


def as_chunk(tile, batch_ndim: int):
    """A 2-D tile with ``batch_ndim`` leading length-1 axes, as an output chunk."""
    return tile.reshape((1,) * batch_ndim + tile.shape) if batch_ndim else tile


def partial_block(tp: TaskPlan, backend: str, spec: BlockSpec, a_list, b_list):
    """One output block over one k group: the k-loop over its pieces in
    ascending k, then (product not split) the cast to the result dtype."""
    a_blocks = dict(zip(spec.a_keys, a_list))
    b_blocks = dict(zip(spec.b_keys, b_list))
    executor = executor_for(backend, tp.acc_dtype, a_list[0])
    acc = None
    for a_k, b_k in spec.k_pieces:
        a_sub = _panel(a_blocks, spec.a_lead, spec.a_rows, a_k)
        b_sub = _panel(b_blocks, spec.b_lead, b_k, spec.b_cols)
        part = tile_partial(executor, tp, a_sub, b_sub)
        # the executor's result is a new array: adding into it is safe
        if acc is None:
            acc = part
        else:
            acc += part
    if isinstance(a_list[0], np.ndarray):
        acc = executor.to_host(acc)
    if not spec.finish:
        return acc
    return as_chunk(finish_tile(tp, acc), spec.batch_ndim)


def sum_step(tp: TaskPlan, dst, src, finish: bool, batch_ndim: int = 0):
    """One step ``partial[dst] + partial[src]`` of the plan's reduction tree
    (``distmm.engine.tiles.reduce_partials`` runs the same additions in the
    same order); the last step casts. The inputs are not modified."""
    acc = dst + src
    if not finish:
        return acc
    return as_chunk(finish_tile(tp, acc), batch_ndim)


def _device_error(exc: BaseException) -> bool:
    """An error of the device rather than of the inputs: cupy's and CUDA's own,
    no GPU after all, or the pipeline's out-of-memory after its retries."""
    from distmm.errors import BackendUnavailable

    mod = type(exc).__module__ or ""
    return mod.startswith(("cupy", "cupy_backends")) or isinstance(exc, (BackendUnavailable,
                                                                         MemoryError))


def _device_limit(share: int):
    """Device bytes the pipeline may use when ``share`` workers use this GPU
    (None: the pipeline's own default, ``distmm.device-memory-limit`` or 90%
    of the free memory)."""
    from distmm.config import get_config

    if share <= 1 or get_config().device_memory_limit is not None:
        return None
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return int(min(0.85 * total / share, 0.95 * free))


def _gpu_block(tp: TaskPlan, backend: str, a, b, share: int):
    """``a @ b`` in the accumulation dtype on this worker's GPU: host float
    panels through the stream pipeline, others through the device."""
    from distmm.executor import GPU_BACKENDS, get_executor

    acc = np.dtype(tp.acc_dtype)
    name = backend if backend in GPU_BACKENDS else "auto"
    key = (name, tp.acc_dtype, True)
    ex = _EXECUTORS.get(key)
    if ex is None:
        ex = _EXECUTORS[key] = get_executor(name, acc, on_gpu=True)
    host = isinstance(a, np.ndarray)
    if host and acc.name in ("float32", "float64") and a.shape[1]:
        from distmm.executor.pipeline import run_pipelined
        from distmm.plan import make_plan

        m, k = a.shape
        n = b.shape[1]
        out = ex.empty_host((m, n), acc)
        run_pipelined(ex, make_plan(m, n, k, acc, workers=1), a.astype(acc, copy=False),
                      b.astype(acc, copy=False), out, device_memory_limit=_device_limit(share))
        return out
    part = tile_partial(ex, tp, a, b)
    return ex.to_host(part) if host else part


def _cpu_block(tp: TaskPlan, backend: str, a, b):
    from distmm.executor import CPU_BACKENDS, get_executor

    if not isinstance(a, np.ndarray):  # device chunks falling back to the CPU
        a, b = _xp(a).asnumpy(a), _xp(b).asnumpy(b)
    name = backend if backend in CPU_BACKENDS else "auto"
    key = (name, tp.acc_dtype, False)
    ex = _EXECUTORS.get(key)
    if ex is None:
        ex = _EXECUTORS[key] = get_executor(name, np.dtype(tp.acc_dtype), on_gpu=False)
    return tile_partial(ex, tp, a, b)


def block_product(tp: TaskPlan, backend: str, spec: BlockSpec, device: str, fail: bool,
                  share: int, a_list, b_list):
    """One block of C (over one k group) in one task.

    ``device``: ``"gpu"`` runs the GPU executor on this worker's device (the
    CPU executor where the worker is marked GPU but has none); a failure of
    the device raises ``TileFailed`` for the engine to run the block again on
    a CPU worker; ``fail`` raises it on purpose (``distmm-debug.fail-tiles``).
    ``"cpu"`` runs the CPU executor. ``share``: workers using this GPU.
    """
    from distmm.errors import TileFailed

    a_blocks = dict(zip(spec.a_keys, a_list))
    b_blocks = dict(zip(spec.b_keys, b_list))
    host = isinstance(a_list[0], np.ndarray)
    acc = None
    for a_k, b_k in spec.k_pieces:
        a_sub = _panel(a_blocks, spec.a_lead, spec.a_rows, a_k)
        b_sub = _panel(b_blocks, spec.b_lead, b_k, spec.b_cols)
        if device == "gpu" and fail:
            raise TileFailed("block failed on purpose (distmm-debug.fail-tiles)")
        if device == "gpu" and (not host or _worker_has_gpu()):
            try:
                part = _gpu_block(tp, backend, a_sub, b_sub, share)
            except Exception as exc:
                if not _device_error(exc):
                    raise
                raise TileFailed(f"the GPU failed on a {a_sub.shape[0]} x {b_sub.shape[1]} block: "
                                 f"{type(exc).__name__}: {exc}") from exc
        else:
            part = _cpu_block(tp, backend, a_sub, b_sub)
        acc = part if acc is None else acc + part
    if not spec.finish:
        return acc
    return as_chunk(finish_tile(tp, acc), spec.batch_ndim)


def cut(block, r0: int, r1: int, c0: int, c1: int):
    """One output chunk of a block-mode block: ``block[r0:r1, c0:c1]``."""
    return block[r0:r1, c0:c1]
