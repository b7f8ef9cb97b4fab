"""The Dask engine: a ``Plan`` becomes a task graph on a ``distributed`` cluster.

This module covers: turning a plan into one task per C tile (one per k group
and tile when the plan splits k, then one reduction task per tile that sums the
partials along the plan's fixed tree), pinning tasks to the workers the plan
names (loosely, so a dead worker's tasks move), scattering numpy operands to
the cluster once as the blocks the tasks need, reading dask operands chunk by
chunk where they lie, and, for numpy operands, gathering C, with a progress bar
and an optional ``performance_report``. Tasks call the executor of the worker
they run on (CPU by default; the GPU executor where the worker sees a GPU).

It does *not* cover: tile arithmetic (``distmm.plan``), the numpy semantics
and validation of operands (``distmm.api``), or kernels (``distmm.executor``).

How a task gets its operands
----------------------------
A C tile ``(i, j)`` over k group ``s`` needs the rows ``plan.row_slice(i)`` of
A and the columns ``plan.col_slice(j)`` of B over ``plan.k_slice(s)``. For
numpy operands the engine scatters exactly those blocks of A (row tile x k
group) and B (k group x column tile), once each, to a worker that needs them.
For dask operands the task depends on the input chunks that overlap its panels
and nothing else: no rechunk is inserted. When the chunks line up with the
plan's tiles (the engine takes its tile size from regular chunks), the task
runs its k-loop over the chunks without copying them; where chunks straddle
tile edges, the task slices them, and k pieces shorter than the plan's k-block
are joined before they reach the executor. Whole matrices never go into a task.

Fault tolerance
---------------
Every task is pure and deterministic (the executor contract) and the reduction
order is the plan's, so a task recomputed on another worker gives the same
bits. Tasks of dask inputs are recomputed by the scheduler when a worker dies.
Scattered numpy blocks have no task that could recompute them: when a worker
holding some dies, the engine scatters the lost blocks again from the
client's arrays and resubmits the tiles not yet gathered.

See also: ``distmm.engine.local`` (the same tasks on threads in one process).
"""
from __future__ import annotations

import bisect
import logging
import sys
import time
import uuid
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from distmm.engine.base import Engine, Operands, Request
from distmm.engine.tiles import finish_tile, reduce_partials, tile_partial
from distmm.plan import Plan, tile_for_chunks

__all__ = ["DaskEngine", "worker_slots"]

log = logging.getLogger("distmm.engine.dask")

#: a run is "long" (progress bar on a terminal) above this estimated duration
_LONG_RUN_SECONDS = 10.0
_ASSUMED_FLOPS_PER_SLOT = 20e9
#: a tile's k pieces (chunks along k) run as separate tasks, then an ordered
#: sum, when there are at least 2 and at most this many (each piece's partial
#: tile is held until the sum)
_MAX_PIECE_TASKS = 8
#: how many times scattered blocks are sent again after workers die
_MAX_RESCATTERS = 5


# --------------------------------------------------------------------------
# Worker side: the task bodies. Module-level functions, pickled by reference.
# --------------------------------------------------------------------------

_EXECUTORS: dict[tuple, Any] = {}
_GPU: list[bool] = []


def _worker_has_gpu() -> bool:
    if not _GPU:
        from distmm.executor import gpu_available

        _GPU.append(gpu_available())
    return _GPU[0]


def _executor_for(backend: str, acc_dtype: str, block) -> Any:
    """The executor of this worker process, made once per (backend, dtype)."""
    from distmm.executor import GPU_BACKENDS, get_executor

    is_host = isinstance(block, np.ndarray)
    on_gpu = backend in GPU_BACKENDS or (backend == "auto" and (not is_host or _worker_has_gpu()))
    key = (backend, acc_dtype, on_gpu)
    ex = _EXECUTORS.get(key)
    if ex is None:
        ex = _EXECUTORS[key] = get_executor(backend, np.dtype(acc_dtype), on_gpu=on_gpu)
    return ex


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


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy  # a device chunk: the only other array type a worker holds here

    return cupy


@dataclass(frozen=True)
class _TileSpec:
    """What one task needs to assemble its panels: plain data, no references.

    ``k_pieces`` lists, per k piece, A's pieces along k and B's pieces along k
    (each ``(block, start, stop)``); ``a_rows`` and ``b_cols`` the pieces along
    m and n; ``a_lead``/``b_lead`` the index into the chunks' batch axes.
    """

    a_lead: tuple
    b_lead: tuple
    a_rows: tuple
    b_cols: tuple
    k_pieces: tuple
    a_keys: tuple  # block index (rb, kb) of each entry of the task's A list
    b_keys: tuple  # block index (kb, cb) of each entry of the task's B list
    finish: bool  # the plan does not split k: cast to the result dtype here
    batch_ndim: int = 0  # leading length-1 axes of the output chunk


def _partial_task(plan: Plan, backend: str, spec: _TileSpec, a_list, b_list):
    """One C tile over one k group: the k-loop over pieces, then (unsplit) the cast."""
    a_blocks = dict(zip(spec.a_keys, a_list))
    b_blocks = dict(zip(spec.b_keys, b_list))
    executor = _executor_for(backend, plan.acc_dtype, a_list[0])
    acc = None
    for a_k, b_k in spec.k_pieces:
        a_sub = _panel(a_blocks, spec.a_lead, spec.a_rows, a_k)
        b_sub = _panel(b_blocks, spec.b_lead, b_k, spec.b_cols)
        part = tile_partial(executor, plan, a_sub, b_sub)
        # Pieces are summed in ascending k, always in the same order; the
        # executor's result is a new array, so adding into it is safe.
        if acc is None:
            acc = part
        else:
            acc += part
    if isinstance(a_list[0], np.ndarray):
        acc = executor.to_host(acc)
    if not spec.finish:
        return acc
    return _as_chunk(finish_tile(plan, acc), spec.batch_ndim)


def _sum_pieces_task(plan: Plan, backend: str, parts, finish: bool, batch_ndim: int = 0):
    """Sum one tile's k pieces (computed by separate tasks) in ascending k.

    The same additions, in the same order and on the same executor, as the
    k-loop of ``_partial_task``: ``((p0 + p1) + p2) + ...``, so the bits do not
    depend on whether the pieces ran in one task or several, nor in which
    order they ran. The stored pieces are not modified (a task may rerun).
    """
    executor = _executor_for(backend, plan.acc_dtype, parts[0])
    acc_dtype = np.dtype(plan.acc_dtype)
    acc = executor.asarray(parts[0], acc_dtype) + executor.asarray(parts[1], acc_dtype)
    for part in parts[2:]:
        acc += executor.asarray(part, acc_dtype)
    if isinstance(parts[0], np.ndarray):
        acc = executor.to_host(acc)
    if not finish:
        return acc
    return _as_chunk(finish_tile(plan, acc), batch_ndim)


def _reduce_task(plan: Plan, partials, batch_ndim: int = 0):
    """Sum one tile's partials along the plan's fixed tree, then cast."""
    return _as_chunk(finish_tile(plan, reduce_partials(plan, list(partials))), batch_ndim)


def _as_chunk(tile, batch_ndim: int):
    return tile.reshape((1,) * batch_ndim + tile.shape) if batch_ndim else tile


# --------------------------------------------------------------------------
# Client side: the graph.
# --------------------------------------------------------------------------


def worker_slots(client) -> list[str]:
    """One entry per worker thread: the address of its worker, sorted by address.

    The plan is made for ``len(worker_slots(client))`` workers and its owner
    ``w`` maps to ``slots[w]``; single-thread workers give one slot each.
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    if not info:
        # a cluster still starting, or restarting a worker: wait briefly
        try:
            client.wait_for_workers(1, timeout=30)
        except Exception:
            return []
        info = client.scheduler_info(n_workers=-1)["workers"]
    return [addr for addr in sorted(info) for _ in range(max(int(info[addr].get("nthreads", 1)), 1))]


def _slots_by_locality(client, plan: Plan, slots: list[str], a2, b2,
                       who: dict | None = None) -> tuple[list[str], int]:
    """Map the plan's owners onto workers so that each owner's tiles find as
    much of their input already in place as possible.

    Only for operands already in the cluster's memory (persisted); otherwise
    the slots are returned as they are. The plan's balance is kept: only
    which worker plays which owner changes. Returns the slots and the number
    of input elements the tasks find on their own worker under that mapping.
    """
    if who is None:
        who = _who_has(client, a2, b2)
    if not who:
        return slots, 0
    a_rows, a_k = _edges_pieces(a2.chunks[-2]), _edges_pieces(a2.chunks[-1])
    b_k, b_cols = _edges_pieces(b2.chunks[-2]), _edges_pieces(b2.chunks[-1])
    score: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for i, j in plan.tiles():
        rs, cs = plan.row_slice(i), plan.col_slice(j)
        for s_ in range(plan.k_splits):
            owner = plan.owner_of_partial(i, j, s_)
            ks = plan.k_slice(s_)
            for rb, r0, r1 in _locate(a_rows, rs.start, rs.stop):
                for kb, k0, k1 in _locate(a_k, ks.start, ks.stop):
                    for addr in who.get((a2.name, rb, kb), ()):
                        score[owner][addr] += (r1 - r0) * (k1 - k0)
            for kb, k0, k1 in _locate(b_k, ks.start, ks.stop):
                for cb, c0, c1 in _locate(b_cols, cs.start, cs.stop):
                    for addr in who.get((b2.name, kb, cb), ()):
                        score[owner][addr] += (k1 - k0) * (c1 - c0)
    capacity: dict[str, int] = defaultdict(int)
    for addr in slots:
        capacity[addr] += 1
    mapping: dict[int, str] = {}
    local = 0
    owners = sorted(range(len(slots)), key=lambda w: -max(score[w].values(), default=0))
    for w in owners:
        free = [addr for addr in sorted(capacity) if capacity[addr] > 0]
        best = max(free, key=lambda addr: score[w].get(addr, 0))
        mapping[w] = best
        local += score[w].get(best, 0)
        capacity[best] -= 1
    return [mapping[w] for w in range(len(slots))], local


def _who_has(client, a2, b2) -> dict:
    """Where the persisted chunks of ``a2`` and ``b2`` are (empty: not persisted)."""
    from distributed import futures_of

    if not futures_of(a2) and not futures_of(b2):
        return {}
    try:
        who = {**client.who_has(a2), **client.who_has(b2)}
    except Exception:  # a worker leaving mid-call: placement is only a hint
        return {}
    return who if any(who.values()) else {}


def _resolve_client(client, *, required: bool):
    if client is not None:
        return client
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


def _edges_pieces(chunks: tuple[int, ...]) -> tuple[int, ...]:
    out = [0]
    for c in chunks:
        out.append(out[-1] + int(c))
    return tuple(out)


def _locate(offsets: tuple[int, ...], start: int, stop: int) -> tuple[tuple[int, int, int], ...]:
    """Blocks of an axis (given its chunk offsets) overlapping ``[start, stop)``,
    as ``(block, local start, local stop)``; empty chunks are skipped."""
    out = []
    blk = bisect.bisect_right(offsets, start) - 1
    while blk < len(offsets) - 1 and offsets[blk] < stop:
        lo, hi = max(start, offsets[blk]), min(stop, offsets[blk + 1])
        if hi > lo:
            out.append((blk, lo - offsets[blk], hi - offsets[blk]))
        blk += 1
    return tuple(out)


def _k_pieces(a_off, b_off, k0: int, k1: int, tk: int):
    """Split ``[k0, k1)`` at every chunk edge of A and B; join pieces shorter
    than the k-block ``tk`` to their neighbours so the executor is never handed
    slivers. Returns per piece (A's pieces along k, B's pieces along k)."""
    cuts = sorted({k0, k1} | {e for e in a_off + b_off if k0 < e < k1})
    merged = [cuts[0]]
    for e in cuts[1:]:
        if e - merged[-1] < tk and e != k1:
            continue
        if e == k1 and len(merged) > 1 and e - merged[-1] < tk:
            merged[-1] = e  # a short tail joins the piece before it
            continue
        merged.append(e)
    return tuple((_locate(a_off, lo, hi), _locate(b_off, lo, hi))
                 for lo, hi in zip(merged[:-1], merged[1:]))


@dataclass(frozen=True)
class _Operand:
    """Where the blocks of one 2-D-or-more operand are: chunks and references."""

    shape: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    ref: Callable[[tuple], Any]  # block index -> TaskRef or Future

    @property
    def batch(self) -> tuple[int, ...]:
        return self.shape[:-2]

    def offsets(self, axis: int) -> tuple[int, ...]:
        return _edges_pieces(self.chunks[axis])

    def batch_block(self, out_index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """For an index into the broadcast batch, this operand's batch block
        index and the index inside that block (broadcast dims read element 0)."""
        nb = len(self.batch)
        own = out_index[len(out_index) - nb:] if nb else ()
        blocks, lead = [], []
        for axis, (size, idx) in enumerate(zip(self.batch, own)):
            idx = 0 if size == 1 else idx
            (blk, lo, _), = _locate(self.offsets(axis), idx, idx + 1)
            blocks.append(blk)
            lead.append(lo)
        return tuple(blocks), tuple(lead)


class _Pins:
    """Per-key annotation value (``workers=``), picklable for the scheduler."""

    def __init__(self, table: dict):
        self.table = table

    def __call__(self, key):
        return self.table.get(key)


def _build_graph(plan: Plan, a: _Operand, b: _Operand, batch: tuple[int, ...], *,
                 backend: str, name: str, slots: list[str], only=None, piece_tasks: bool = True):
    """The graph of the product: ``{key: Task}``, the output keys by
    ``(batch index, i, j)``, and the worker each key is pinned to."""
    from dask._task_spec import DataNode, List, Task, TaskRef

    graph: dict = {}
    pins: dict = {}
    out_keys: dict = {}
    plan_key = f"{name}-plan"
    graph[plan_key] = DataNode(plan_key, plan)
    a_rows_off, a_k_off = a.offsets(-2), a.offsets(-1)
    b_k_off, b_cols_off = b.offsets(-2), b.offsets(-1)
    k_pieces = [_k_pieces(a_k_off, b_k_off, plan.k_slice(s).start, plan.k_slice(s).stop, plan.tile[2])
                for s in range(plan.k_splits)]
    split = plan.k_splits > 1
    partial_name = name.replace("distmm-matmul", "distmm-partial", 1)
    piece_name = name.replace("distmm-matmul", "distmm-piece", 1)
    for ob in np.ndindex(*batch):
        a_bb, a_lead = a.batch_block(ob)
        b_bb, b_lead = b.batch_block(ob)
        for i, j in plan.tiles():
            if only is not None and (ob, i, j) not in only:
                continue
            rs, cs = plan.row_slice(i), plan.col_slice(j)
            a_rows = _locate(a_rows_off, rs.start, rs.stop)
            b_cols = _locate(b_cols_off, cs.start, cs.stop)
            out_key = (name,) + ob + (i, j)
            partial_refs = []
            for s in range(plan.k_splits):
                pieces = k_pieces[s]
                key = (partial_name,) + ob + (i, j, s) if split else out_key
                pin = [slots[plan.owner_of_partial(i, j, s)]] if slots else None
                # Several k pieces (chunks along k): one task per piece, then
                # one task summing them in ascending k. A piece needs one A and
                # one B chunk, not the whole panels, so a worker can start on
                # the pieces whose chunks it already holds while the others
                # are fetched; the sum keeps the k-loop's order and its bits.
                per_piece = piece_tasks and 1 < len(pieces) <= _MAX_PIECE_TASKS
                piece_refs = []
                for p, piece_set in enumerate([(pc,) for pc in pieces] if per_piece else [pieces]):
                    a_keys = tuple(sorted({(rb, kb) for rb, _, _ in a_rows for a_k, _ in piece_set
                                           for kb, _, _ in a_k}))
                    b_keys = tuple(sorted({(kb, cb) for _, b_k in piece_set for kb, _, _ in b_k
                                           for cb, _, _ in b_cols}))
                    spec = _TileSpec(a_lead, b_lead, a_rows, b_cols, piece_set, a_keys, b_keys,
                                     finish=not split and not per_piece, batch_ndim=len(batch))
                    pkey = (piece_name,) + ob + (i, j, s, p) if per_piece else key
                    graph[pkey] = Task(pkey, _partial_task, TaskRef(plan_key), backend, spec,
                                       List(*(a.ref(a_bb + ab) for ab in a_keys)),
                                       List(*(b.ref(b_bb + bb) for bb in b_keys)))
                    if pin:
                        pins[pkey] = pin
                    piece_refs.append(TaskRef(pkey))
                if per_piece:
                    graph[key] = Task(key, _sum_pieces_task, TaskRef(plan_key), backend,
                                      List(*piece_refs), not split, len(batch))
                    if pin:
                        pins[key] = pin
                partial_refs.append(TaskRef(key))
            if split:
                graph[out_key] = Task(out_key, _reduce_task, TaskRef(plan_key), List(*partial_refs),
                                       len(batch))
                if slots:
                    pins[out_key] = [slots[plan.owner_of_tile(i, j)]]
            out_keys[(ob, i, j)] = out_key
    return graph, out_keys, pins


def _layer(graph: dict, pins: dict):
    from dask.highlevelgraph import MaterializedLayer

    annotations = {"workers": _Pins(pins), "allow_other_workers": True} if pins else None
    return MaterializedLayer(graph, annotations=annotations)


def _check_chunks(name: str, x) -> None:
    for axis_chunks in x.chunks:
        if any(isinstance(c, float) and np.isnan(c) for c in axis_chunks):
            raise ValueError(
                f"matmul: operand {name} has unknown chunk sizes (shape {x.shape}); "
                f"call {name}.compute_chunk_sizes() first"
            )


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


class DaskEngine(Engine):
    """Runs a request on a ``distributed`` cluster.

    Parameters
    ----------
    client : distributed.Client, optional
        Default: the current client. Dask operands without any client give a
        lazy array planned for this machine's cores, runnable on any scheduler.
    required : bool
        Whether a client must exist (host operands are computed eagerly).

    Raises
    ------
    ValueError
        No client when one is required; a cluster with no workers.
    """

    name = "dask"

    def __init__(self, client=None, *, required: bool = True):
        self.client = _resolve_client(client, required=required)
        self.slots = worker_slots(self.client) if self.client is not None else []
        if self.client is not None and not self.slots:
            raise ValueError("matmul: the Dask cluster has no workers")

    def workers(self, operands: Operands, *, on_gpu: bool) -> int:
        if self.slots:
            return len(self.slots)
        from distmm.engine.local import default_workers

        return default_workers()

    def plan_hints(self, operands: Operands, workers: int) -> dict:
        if operands.family != "dask":
            return {}
        a2, b2 = operands.a2, operands.b2
        _check_chunks("a", a2)
        _check_chunks("b", b2)
        tile = tile_for_chunks(operands.m, operands.n, operands.k, operands.dtype,
                               a2.chunks[-2], b2.chunks[-1], workers)
        return {"tile": tile} if tile is not None else {}

    def run(self, request: Request):
        """``numpy.ndarray`` for host operands (computed on the cluster and
        gathered), a lazy ``dask.array.Array`` for dask operands whose chunks
        are the plan's C tiles (one chunk per element along batch axes)."""
        ops, plan = request.operands, request.plan
        dtype = np.dtype(ops.dtype)
        out_shape = ops.out_shape
        slots = self.slots
        if ops.family == "dask":
            a2, b2 = ops.a2, ops.b2
            if slots and not ops.batch:
                slots, _ = _slots_by_locality(self.client, plan, slots, a2, b2)
            return _lazy(ops, plan, a2, b2, slots, request.backend, out_shape, dtype)
        return _eager(ops, plan, self.client, slots, request.backend, out_shape, dtype,
                      request.progress, request.report)


def _output_chunks(plan: Plan, batch) -> tuple:
    rows = tuple(np.diff(plan.row_edges).tolist()) or (0,)
    cols = tuple(np.diff(plan.col_edges).tolist()) or (0,)
    return tuple((1,) * b if b else (0,) for b in batch) + (rows, cols)


def _lazy(ops, plan, a2, b2, slots, backend, out_shape, dtype):
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    meta = getattr(a2, "_meta", np.empty((0, 0)))
    if 0 in out_shape or plan.k == 0:
        return da.zeros(out_shape, dtype=dtype, chunks=_output_chunks(plan, ops.batch))
    from dask._task_spec import TaskRef

    name = "distmm-matmul-" + tokenize(a2.name, b2.name, plan, backend, ops.batch, slots)
    a_op = _Operand(tuple(a2.shape), a2.chunks, lambda idx: TaskRef((a2.name,) + idx))
    b_op = _Operand(tuple(b2.shape), b2.chunks, lambda idx: TaskRef((b2.name,) + idx))
    graph, _, pins = _build_graph(plan, a_op, b_op, tuple(ops.batch), backend=backend,
                                  name=name, slots=slots)
    hlg = HighLevelGraph({name: _layer(graph, pins)}, {name: set()})
    hlg = HighLevelGraph.merge(hlg, a2.dask, b2.dask)
    # Declare the dependency so culling and optimisation keep the inputs.
    layers = dict(hlg.layers)
    deps = {k: set(v) for k, v in hlg.dependencies.items()}
    deps[name] = {a2.name, b2.name} & set(layers) or set()
    hlg = HighLevelGraph(layers, deps)
    from dask.array.utils import meta_from_array

    out_meta = meta_from_array(meta, ndim=len(out_shape), dtype=dtype)
    cls = _pinned_array_class() if pins else da.Array
    return cls(hlg, name, _output_chunks(plan, ops.batch), dtype=dtype, meta=out_meta)


_PINNED: list = []


def _pinned_array_class():
    """A ``dask.array.Array`` whose own optimisation only culls.

    dask.array's default optimisation fuses tasks into a plain dict and so
    drops per-key annotations, the plan's worker pins among them. Computing or
    persisting the result itself keeps them; arrays derived from it are plain
    ``dask.array.Array`` objects (correct, placed by the scheduler's own
    heuristics).
    """
    if _PINNED:
        return _PINNED[0]
    import dask.array as da
    from dask.core import flatten
    from dask.highlevelgraph import HighLevelGraph

    class PinnedArray(da.Array):
        __slots__ = ()

        @staticmethod
        def __dask_optimize__(dsk, keys, **kwargs):
            if not isinstance(dsk, HighLevelGraph):
                dsk = HighLevelGraph.from_collections(str(id(dsk)), dsk, dependencies=())
            return dsk.cull(set(flatten(keys)))

    PinnedArray.__module__ = __name__
    PinnedArray.__qualname__ = "PinnedArray"
    globals()["PinnedArray"] = PinnedArray  # picklable by reference
    _PINNED.append(PinnedArray)
    return PinnedArray


# -- numpy operands ------------------------------------------------------------


class _Scattered:
    """The blocks of one numpy operand as scattered futures, sent again when lost."""

    def __init__(self, client, array: np.ndarray, row_edges, col_edges, needers):
        self.client = client
        self.array = array
        self.row_edges = row_edges
        self.col_edges = col_edges
        self.needers = needers  # block index -> candidate worker addresses
        self.futures: dict[tuple, Any] = {}

    def block(self, idx):
        lead, r, c = idx[:-2], idx[-2], idx[-1]
        # batch axes stay (length 1), as in a dask chunk of one batch element
        return self.array[tuple(slice(x, x + 1) for x in lead) + (slice(self.row_edges[r], self.row_edges[r + 1]),
                                  slice(self.col_edges[c], self.col_edges[c + 1]))]

    def operand(self) -> _Operand:
        batch = self.array.shape[:-2]
        chunks = tuple((1,) * s if s else (0,) for s in batch) + (
            tuple(np.diff(self.row_edges).tolist()), tuple(np.diff(self.col_edges).tolist()))
        return _Operand(self.array.shape, chunks, lambda idx: self.futures[idx])

    def lost(self) -> list:
        return [idx for idx, f in self.futures.items() if f.status != "finished"]

    def scatter(self, indices, load: dict) -> None:
        """Send blocks, each to the least loaded worker among those needing it."""
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        by_worker: dict[str, list] = defaultdict(list)
        for idx in indices:
            candidates = [w for w in self.needers.get(idx, ()) if w in alive] or sorted(alive)
            worker = min(candidates, key=lambda w: load.get(w, 0))
            blk = self.block(idx)
            load[worker] = load.get(worker, 0) + blk.nbytes
            by_worker[worker].append(idx)
        for worker, idxs in by_worker.items():
            futs = self.client.scatter([self.block(i) for i in idxs], workers=[worker], hash=False)
            self.futures.update(zip(idxs, futs))


def _needers(plan: Plan, slots, batch, a_op_batch, b_op_batch):
    """For every scattered block, the workers whose tasks read it."""
    from itertools import product

    a_need: dict = defaultdict(list)
    b_need: dict = defaultdict(list)
    for ob in product(*(range(n) for n in batch)):
        a_lead = tuple(0 if s == 1 else x for s, x in zip(a_op_batch, ob[len(ob) - len(a_op_batch):]))
        b_lead = tuple(0 if s == 1 else x for s, x in zip(b_op_batch, ob[len(ob) - len(b_op_batch):]))
        for i, j in plan.tiles():
            for s in range(plan.k_splits):
                w = slots[plan.owner_of_partial(i, j, s)]
                for table, idx in ((a_need, a_lead + (i, s)), (b_need, b_lead + (s, j))):
                    if w not in table[idx]:
                        table[idx].append(w)
    return a_need, b_need


def _show_progress(progress, plan: Plan, batch, slots) -> bool:
    if progress is not None:
        return bool(progress)
    count = int(np.prod(batch, dtype=np.int64)) if batch else 1
    estimate = plan.flops * count / (max(len(slots), 1) * _ASSUMED_FLOPS_PER_SLOT)
    return estimate > _LONG_RUN_SECONDS and sys.stderr.isatty()


def _eager(ops, plan, client, slots, backend, out_shape, dtype, progress, report):
    out = np.empty(out_shape, dtype=dtype)
    if out.size == 0:
        return out
    if plan.k == 0:
        out[...] = 0
        return out
    from distributed import as_completed, performance_report
    from distributed.client import FutureCancelledError

    a2 = ops.a[None, :] if ops.a_vector else ops.a
    b2 = ops.b[:, None] if ops.b_vector else ops.b
    batch = tuple(ops.batch)
    a_need, b_need = _needers(plan, slots, batch, a2.shape[:-2], b2.shape[:-2])
    a_sc = _Scattered(client, a2, plan.row_edges, plan.k_edges, a_need)
    b_sc = _Scattered(client, b2, plan.k_edges, plan.col_edges, b_need)
    pending = {(ob, i, j) for ob in np.ndindex(*batch) for i, j in plan.tiles()}
    show = _show_progress(progress, plan, batch, slots)
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pending), unit="tile", desc="distmm matmul", file=sys.stderr)
    token = uuid.uuid4().hex[:12]
    ctx = performance_report(filename=report) if report else nullcontext()
    attempts = 0
    t0 = time.perf_counter()
    try:
        with ctx:
            load: dict = {}
            a_sc.scatter(list(a_need), load)
            b_sc.scatter(list(b_need), load)
            while pending:
                name = f"distmm-matmul-{token}-{attempts}"
                graph, out_keys, pins = _build_graph(
                    plan, a_sc.operand(), b_sc.operand(), batch, backend=backend, name=name,
                    slots=slots, only=pending)
                where = {key: pos for pos, key in out_keys.items()}
                futures = _submit(client, graph, pins, list(where))
                failed = None
                for fut in as_completed(futures):
                    try:
                        tile_out = fut.result()
                    except (FutureCancelledError, _lost_errors()) as exc:
                        failed = exc
                        continue
                    ob, i, j = where[fut.key]
                    out[ob + (plan.row_slice(i), plan.col_slice(j))] = tile_out.reshape(
                        tile_out.shape[-2:])
                    pending.discard((ob, i, j))
                    if bar is not None:
                        bar.update(1)
                    fut.release()
                if not pending:
                    break
                lost = (a_sc.lost(), b_sc.lost())
                attempts += 1
                if attempts > _MAX_RESCATTERS or not (lost[0] or lost[1]):
                    raise RuntimeError(
                        f"distmm dask engine: {len(pending)} tiles failed after "
                        f"{attempts} attempt(s) and no scattered block was lost ({failed!r})"
                        if not (lost[0] or lost[1]) else
                        f"distmm dask engine: workers kept dying; gave up after {attempts} attempts"
                    ) from failed
                log.warning("workers lost %d scattered blocks; sending them again (attempt %d)",
                            len(lost[0]) + len(lost[1]), attempts)
                a_sc.scatter(lost[0], {})
                b_sc.scatter(lost[1], {})
    finally:
        if bar is not None:
            bar.close()
    log.info("matmul %s on %d worker slot(s): %.3f s", out_shape, len(slots), time.perf_counter() - t0)
    return out


def _lost_errors():
    from concurrent.futures import CancelledError

    return CancelledError


def _submit(client, graph: dict, pins: dict, keys: list):
    """Send the graph (with per-key worker pins) and return futures for ``keys``."""
    from dask.highlevelgraph import HighLevelGraph

    name = keys[0][0]
    hlg = HighLevelGraph({name: _layer(graph, pins)}, {name: set()})
    return client.get(hlg, keys, sync=False)
