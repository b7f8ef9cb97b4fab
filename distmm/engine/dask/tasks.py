"""Task bodies of the Dask engine: what runs on a worker.

This module covers: the executor each worker process keeps (CPU, or its GPU
where it has one), assembling a task's panels from the chunks it was given,
the k-loop of one output block over one k group, one step of the plan's
reduction tree, a 1-D dask operand's chunk as a row or a column (``as_row``, ``as_column``),
a batch chunk of a stack of whole matrices (``stack_block``), an output
block of a batch chunk of a stack whose matrices span chunks (``stack_panels``), the
final cast to numpy's result dtype, and the floating-point flags those raise (kept on
the worker under the call's token for the client to report as numpy's matmul would,
``recording_flags``/``pop_flags``; an object block's elements keep theirs by row,
``distmm.fpflags.Row``). Block mode's task bodies are in ``distmm.engine.dask.blocks``.
It does *not* cover: which chunks a task gets (``distmm.engine.dask.chunks``),
building the graph (``distmm.engine.dask.graph``) or kernels
(``distmm.executor``). The functions here are module-level, pickled by
reference, and import nothing of dask.

Every task is pure and deterministic: recomputed on another worker after a
failure, it gives the same bits.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from distmm.engine.tiles import finish_tile, tile_partial
from distmm.fpflags import collect

__all__ = ["TaskPlan", "BlockSpec", "StackSpec", "partial_block", "stack_block", "stack_panels",
           "sum_step", "block_parts", "executor_for", "cached_executor", "executors_made",
           "worker_has_gpu", "array_module", "panel", "as_chunk", "as_row", "as_column",
           "recording_flags", "pop_flags"]

_EXECUTORS: dict[tuple, Any] = {}
_GPU: list[bool] = []
#: the floating-point flags this process's tasks raised, by the token of the call
_FLAGS: dict[str, set[str]] = {}


@dataclass(frozen=True)
class TaskPlan:
    """The part of a ``Plan`` a task reads (``tile_partial``/``finish_tile``
    take it in place of the plan): small enough to ship in every task."""

    dtype: str
    acc_dtype: str
    tile: tuple[int, int, int]
    precision: str = "highest"  # the plan's mode: the task's executor applies it
    #: where a task keeps the flags it raised (``recording_flags``); "" raises them on the
    #: worker as numpy does (a lazy product, whose client never asks)
    flags: str = ""
    #: the whole product's ``m x n x k``: ``finish_tile`` gives a complex block numpy's Inf
    #: and NaN for it (``distmm.nonfinite``; ``k`` 0 leaves them as summed)
    m: int = 0
    n: int = 0
    k: int = 0

    @classmethod
    def of(cls, plan, flags: str = "") -> "TaskPlan":
        return cls(plan.dtype, plan.acc_dtype, tuple(plan.tile), plan.precision, flags,
                   plan.m, plan.n, plan.k)


def recording_flags(body):
    """A task body (its first argument a ``TaskPlan``) whose floating-point flags are kept
    in this process under ``tp.flags`` instead of reported here, for ``pop_flags``. A task
    run again after a failure raises the same flags again: the set is the same."""

    @functools.wraps(body)
    def run(tp, *args, **kwargs):
        if not tp.flags:
            return body(tp, *args, **kwargs)
        with collect() as seen:
            result = body(tp, *args, **kwargs)
        if seen:
            _FLAGS.setdefault(tp.flags, set()).update(seen)
        return result

    return run


def pop_flags(token: str) -> set[str]:
    """The flags this process's tasks of the call ``token`` raised, forgotten here (run on
    every worker by the client at the end of the call)."""
    return _FLAGS.pop(token, set())


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
    #: where the block starts in C, ``(*batch, row, column)``: an object block's elements
    #: report in numpy's order from there (``distmm.fpflags.object_rows``)
    at: tuple | None = None

    @property
    def whole_at(self) -> tuple | None:
        """``at`` where the task's k-loop is one piece (its panels hold the group's k)."""
        return self.at if len(self.k_pieces) == 1 else None


@dataclass(frozen=True)
class StackSpec:
    """What one task of a stack whose matrices span chunks needs (``stack_panels``): plain
    data, no references.

    ``a_index``/``b_index``: the index into every chunk's batch axes; ``a_keys``/``b_keys``
    the block index ``(row, col)`` of each chunk the task is handed, in order; ``a_rows`` and
    ``b_cols`` the pieces along m and n; ``groups`` the k pieces of each k group (one task's
    k-loop each: ``chunks.k_pieces``); ``reduction`` the plan's reduction tree over the groups
    (``()`` for one group); ``batch`` the shape of the output batch chunk; ``at`` where the
    block starts in C, ``(*batch, row, column)``.
    """

    a_index: tuple
    b_index: tuple
    a_keys: tuple
    b_keys: tuple
    a_rows: tuple
    b_cols: tuple
    groups: tuple
    reduction: tuple
    batch: tuple
    at: tuple


def worker_has_gpu() -> bool:
    """Whether this worker process sees a GPU (asked once per process)."""
    if not _GPU:
        from distmm.executor import gpu_available

        _GPU.append(gpu_available())
    return _GPU[0]


def cached_executor(backend: str, acc_dtype: str, on_gpu: bool,
                    precision: str = "highest") -> Any:
    """The executor of this worker process for ``backend``, the accumulation dtype, the
    device (``on_gpu``) and the precision mode, made once per process and reused by every
    tile and block task (``distmm.executor.get_executor``)."""
    key = (backend, acc_dtype, bool(on_gpu)) + ((precision,) if precision != "highest" else ())
    ex = _EXECUTORS.get(key)
    if ex is None:
        from distmm.executor import get_executor

        ex = _EXECUTORS[key] = get_executor(backend, np.dtype(acc_dtype), on_gpu=bool(on_gpu),
                                            precision=precision)
    return ex


def executors_made() -> tuple[tuple[str, str, bool], ...]:
    """The ``(backend, acc_dtype, on_gpu)`` of every executor this process has made
    (with the precision mode after them where it is not ``"highest"``)."""
    return tuple(_EXECUTORS)


def executor_for(backend: str, acc_dtype: str, block, precision: str = "highest") -> Any:
    """The executor of a tile task on this worker process: on the GPU for a GPU backend,
    or for ``"auto"`` where ``block`` is a device array or the worker has a GPU."""
    from distmm.executor import GPU_BACKENDS

    is_host = isinstance(block, np.ndarray)
    on_gpu = backend in GPU_BACKENDS or (backend == "auto" and (not is_host or worker_has_gpu()))
    return cached_executor(backend, acc_dtype, on_gpu, precision)


def array_module(x):
    """numpy for a host array, cupy for a device array."""
    if isinstance(x, np.ndarray):
        return np
    import cupy  # a device chunk: the only other array type a worker holds here

    return cupy


def panel(blocks: dict, lead: tuple, row_pieces, col_pieces):
    """The sub-panel of one operand over the given row and column pieces.

    ``blocks[(rb, cb)]`` is a chunk; ``lead`` indexes its batch axes (``(...,)``: all of
    them, a stack of panels); each piece is ``(block, start, stop)`` local to that block.
    One piece each: a view.
    """
    rows = []
    for rb, r0, r1 in row_pieces:
        cols = [blocks[(rb, cb)][lead + (slice(r0, r1), slice(c0, c1))] for cb, c0, c1 in col_pieces]
        rows.append(cols[0] if len(cols) == 1
                    else array_module(cols[0]).concatenate(cols, axis=-1))
    return rows[0] if len(rows) == 1 else array_module(rows[0]).concatenate(rows, axis=-2)


def as_chunk(tile, batch_ndim: int):
    """A 2-D tile with ``batch_ndim`` leading length-1 axes, as an output chunk."""
    return tile.reshape((1,) * batch_ndim + tile.shape) if batch_ndim else tile


def as_row(chunk):
    """A chunk of a 1-D operand as one row (``a``'s promotion in numpy's matmul)."""
    return chunk[None, :]


def as_column(chunk):
    """A chunk of a 1-D operand as one column (``b``'s promotion in numpy's matmul)."""
    return chunk[:, None]


@recording_flags
def partial_block(tp: TaskPlan, backend: str, spec: BlockSpec, a_list, b_list):
    """One output block over one k group: the k-loop over its pieces in
    ascending k, then (product not split) the cast to the result dtype."""
    if not spec.a_rows or not spec.b_cols:  # a zero-size chunk of A along m or of B along n
        return _empty_block(tp, spec, a_list or b_list)
    a_blocks = dict(zip(spec.a_keys, a_list))
    b_blocks = dict(zip(spec.b_keys, b_list))
    executor = executor_for(backend, tp.acc_dtype, a_list[0], tp.precision)
    acc = _k_loop(executor, tp, a_blocks, spec.a_lead, spec.a_rows, b_blocks, spec.b_lead,
                  spec.b_cols, spec.k_pieces, spec.whole_at)
    if isinstance(a_list[0], np.ndarray):
        acc = executor.to_host(acc)
    if not spec.finish:
        return acc
    parts = _host_parts(executor, spec.a_rows, spec.b_cols, spec.k_pieces)
    return as_chunk(finish_tile(tp, acc, parts), spec.batch_ndim)


@recording_flags
def stack_block(tp: TaskPlan, backend: str, a, a_index: tuple, b, b_index: tuple,
                batch: tuple, offset: tuple):
    """One batch chunk of a stack of whole matrices (``distmm.engine.dask.stacks``): the
    chunks ``a`` and ``b`` indexed by ``a_index``/``b_index`` along their batch axes,
    broadcast to ``batch``, and each element's product as ``partial_block`` computes the
    block of one element whose matrices are one chunk each (one k piece, then the cast).
    ``offset``: where the chunk starts in C's batch axes."""
    from distmm.plan import np_dtype

    a = a[a_index]
    b = b[b_index]
    executor = executor_for(backend, tp.acc_dtype, a, tp.precision)
    if _whole_stack(executor, tp):
        # numpy's matmul of a stack runs its loop of one matrix on each element, as it does
        # for one matrix of the same strides: the same bits as element by element (and it
        # broadcasts the batch axes itself: no copy per element of a broadcast matrix)
        acc = np_dtype(tp.acc_dtype)
        return finish_tile(tp, executor.panel_product(executor.asarray(a, acc),
                                                      executor.asarray(b, acc), tp.tile[2]),
                           _whole_parts(executor, a, b))
    a = np.broadcast_to(a, batch + a.shape[-2:])
    b = np.broadcast_to(b, batch + b.shape[-2:])
    out = np.empty(batch + (a.shape[-2], b.shape[-1]), np_dtype(tp.dtype))
    for idx in np.ndindex(*batch):
        at = tuple(o + i for o, i in zip(offset, idx)) + (0, 0)
        part = executor.to_host(tile_partial(executor, tp, a[idx], b[idx], at))
        out[idx] = finish_tile(tp, part, _whole_parts(executor, a, b))
    return out


def _k_loop(executor, tp: TaskPlan, a_blocks: dict, a_lead: tuple, a_rows, b_blocks: dict,
            b_lead: tuple, b_cols, pieces, at):
    """The sum over ``pieces`` (one k group), in ascending k, of the panels' products in the
    accumulation dtype (``at``: ``tile_partial``'s)."""
    acc = None
    for a_k, b_k in pieces:
        a_sub = panel(a_blocks, a_lead, a_rows, a_k)
        b_sub = panel(b_blocks, b_lead, b_k, b_cols)
        part = tile_partial(executor, tp, a_sub, b_sub, at)
        # the executor's result is a new array: adding into it is safe
        if acc is None:
            acc = part
        else:
            acc += part
    return acc


def _reduce(partials: list, reduction: tuple):
    """The partials of the k groups summed as ``sum_step`` does along the plan's reduction
    tree: ``partial[dst] + partial[src]`` per step, in order; the sum ends in partial 0."""
    latest = list(partials)
    for dst, src in reduction:
        latest[dst] = latest[dst] + latest[src]
    return latest[0]


@recording_flags
def stack_panels(tp: TaskPlan, backend: str, spec: StackSpec, a_list, b_list):
    """One output block of a batch chunk of a stack whose matrices span chunks
    (``distmm.engine.dask.stacks``): for each element, what the per-element tasks compute
    (``partial_block``'s k-loop per k group, the reduction tree's steps in order, the cast),
    with the same bits; the chunks ``a_list``/``b_list`` (``spec.a_keys``/``b_keys``) indexed
    by ``spec.a_index``/``b_index`` along their batch axes, broadcast to ``spec.batch``. Where
    the executor's product is ``numpy.matmul`` (``_whole_stack``) each k piece is one call on
    the whole batch chunk (numpy runs its one-matrix loop on each element)."""
    from distmm.plan import np_dtype

    rows = sum(r1 - r0 for _, r0, r1 in spec.a_rows)
    cols = sum(c1 - c0 for _, c0, c1 in spec.b_cols)
    if not rows or not cols:  # a zero-size chunk of A along m or of B along n
        return finish_tile(tp, np.zeros(spec.batch + (rows, cols), np_dtype(tp.acc_dtype)))
    a_list = [x[spec.a_index] for x in a_list]
    b_list = [x[spec.b_index] for x in b_list]
    executor = executor_for(backend, tp.acc_dtype, a_list[0], tp.precision)
    parts = _host_parts(executor, spec.a_rows, spec.b_cols,
                       [piece for pieces in spec.groups for piece in pieces])
    if _whole_stack(executor, tp):
        a_blocks = dict(zip(spec.a_keys, a_list))
        b_blocks = dict(zip(spec.b_keys, b_list))
        partials = [_k_loop(executor, tp, a_blocks, (...,), spec.a_rows, b_blocks, (...,),
                            spec.b_cols, pieces, None) for pieces in spec.groups]
        return finish_tile(tp, _reduce(partials, spec.reduction), parts)
    a_blocks = {key: np.broadcast_to(x, spec.batch + x.shape[-2:])
                for key, x in zip(spec.a_keys, a_list)}
    b_blocks = {key: np.broadcast_to(x, spec.batch + x.shape[-2:])
                for key, x in zip(spec.b_keys, b_list)}
    out = np.empty(spec.batch + (rows, cols), np_dtype(tp.dtype))
    nb = len(spec.batch)
    for idx in np.ndindex(*spec.batch):
        at = tuple(o + i for o, i in zip(spec.at, idx)) + spec.at[nb:]
        partials = [executor.to_host(_k_loop(executor, tp, a_blocks, idx, spec.a_rows, b_blocks,
                                             idx, spec.b_cols, pieces,
                                             at if len(pieces) == 1 else None))
                    for pieces in spec.groups]
        out[idx] = finish_tile(tp, _reduce(partials, spec.reduction), parts)
    return out


def block_parts(a_rows, b_cols, pieces) -> tuple:
    """The ``(rows, columns, k)`` of the products a block sums, one per k piece
    (``BlockSpec.k_pieces``' form; ``a_rows``/``b_cols`` the block's pieces along m and n):
    ``finish_tile``'s ``parts`` where each is ``numpy.matmul``'s on the host."""
    rows = sum(r1 - r0 for _, r0, r1 in a_rows)
    cols = sum(c1 - c0 for _, c0, c1 in b_cols)
    return tuple((rows, cols, sum(k1 - k0 for _, k0, k1 in a_k)) for a_k, _ in pieces)


def _host_parts(executor, a_rows, b_cols, pieces) -> tuple:
    """``block_parts`` where ``executor`` multiplies with ``numpy.matmul`` on the host (the
    CPU executor: its numba kernels take no complex dtype); ``()`` otherwise."""
    from distmm.executor.cpu import CPUExecutor

    if not isinstance(executor, CPUExecutor):
        return ()
    return block_parts(a_rows, b_cols, pieces)


def _whole_parts(executor, a, b) -> tuple:
    """``_host_parts`` of one product of whole matrices (a stack's elements)."""
    return _host_parts(executor, ((0, 0, a.shape[-2]),), ((0, 0, b.shape[-1]),),
                       [(((0, 0, a.shape[-1]),), ())])


def _whole_stack(executor, tp: TaskPlan) -> bool:
    """Whether ``executor``'s product of a tile is ``numpy.matmul`` of its panels in the
    result's dtype: the CPU executor's BLAS dtypes at the highest precision."""
    from distmm.executor.cpu import CPUExecutor
    from distmm.plan import np_dtype

    acc = np_dtype(tp.acc_dtype)
    return (isinstance(executor, CPUExecutor) and tp.precision == "highest"
            and acc == np_dtype(tp.dtype) and executor.threads_inside(acc))


def _empty_block(tp: TaskPlan, spec: BlockSpec, blocks):
    """The output block of a zero-size row or column chunk (boolean indexing then
    ``compute_chunk_sizes()`` makes them): no rows or no columns, on the operands' side."""
    from distmm.plan import np_dtype

    shape = (sum(r1 - r0 for _, r0, r1 in spec.a_rows), sum(c1 - c0 for _, c0, c1 in spec.b_cols))
    xp = array_module(blocks[0]) if blocks else np
    acc = xp.zeros(shape, np_dtype(tp.acc_dtype))
    return as_chunk(finish_tile(tp, acc), spec.batch_ndim) if spec.finish else acc


@recording_flags
def sum_step(tp: TaskPlan, dst, src, finish: bool, batch_ndim: int = 0, parts=None,
             if_cpu: bool = False):
    """One step ``partial[dst] + partial[src]`` of the plan's reduction tree
    (``distmm.engine.tiles.reduce_partials`` runs the same additions in the
    same order); the last step casts. The inputs are not modified. ``parts``: the
    products every k group's task summed (``block_parts`` of all of them), ``finish_tile``'s;
    ``None``: not known. ``if_cpu``: ``parts`` hold only where this worker sees no GPU
    (backend ``"auto"``, whose tasks take a worker's GPU where it has one)."""
    acc = dst + src
    if not finish:
        return acc
    if if_cpu and worker_has_gpu():
        parts = None
    return as_chunk(finish_tile(tp, acc, parts), batch_ndim)

