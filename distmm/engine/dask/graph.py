"""Graph building for the Dask engine: the product as one lazy layer.

This module covers: ``ProductLayer``, a ``dask.highlevelgraph.Layer`` that
holds the whole product symbolically, as dask's ``Blockwise`` does: one task
per output block and k group (the k-loop over the group's chunks runs inside
the task), then, when the plan splits k, one task per step of the plan's fixed
reduction tree. Nothing is materialised when the layer is built: its length is
arithmetic, culling keeps only the blocks asked for, and tasks are made when
a scheduler reads them. Placement is an annotation computed from the key
(``distmm.engine.dask.placement``), not a dictionary per task.
It does *not* cover: chunk geometry (``distmm.engine.dask.chunks``), task
bodies (``distmm.engine.dask.tasks``), running the graph (``eager``, ``lazy``).

This is the engine's one import site of dask's task specification
(``dask._task_spec``, added in dask 2024.9.0 by dask#11248); older dask gets the equivalent legacy
tuple tasks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.highlevelgraph import Layer

from distmm.engine.dask.chunks import Geometry, edges, locate
from distmm.engine.dask.blocks import block_product
from distmm.engine.dask.pull import Pull
from distmm.engine.dask.tasks import BlockSpec, TaskPlan, partial_block, sum_step

try:  # dask >= 2024.9.0
    from dask._task_spec import List as _List
    from dask._task_spec import Task as _Task
    from dask._task_spec import TaskRef as _TaskRef
except ImportError:  # pragma: no cover - older dask: legacy tuple tasks
    _Task = _TaskRef = _List = None

__all__ = ["OperandKeys", "ProductLayer", "CellTasks", "names_of", "make_task", "task_ref",
           "task_list"]


def make_task(key, func, *args):
    """Task ``key`` calling ``func(*args)``: a ``dask._task_spec.Task`` (a legacy tuple on
    older dask)."""
    if _Task is None:  # pragma: no cover
        return (func,) + tuple(args)
    return _Task(key, func, *args)


def task_ref(key):
    """A task's argument standing for ``key``'s result (a distributed Future as it is)."""
    if hasattr(key, "key"):  # a distributed Future: every dask version resolves it in a graph
        return key
    return key if _TaskRef is None else _TaskRef(key)


def _key(ref):
    return getattr(ref, "key", ref)


def _arg(ref):
    """A task's input: a reference to a key, or a ``pull.Pull`` as it is (no dependency)."""
    return ref if isinstance(ref, Pull) else task_ref(ref)


def task_list(items):
    """A task's argument holding ``items`` (task references among them)."""
    return list(items) if _List is None else _List(*items)


def names_of(name: str) -> tuple[str, str, str]:
    """The key prefixes of a product: output blocks, partial products, and
    the intermediate steps of the reduction tree."""
    return (name, name.replace("distmm-matmul", "distmm-partial", 1),
            name.replace("distmm-matmul", "distmm-sum", 1))


@dataclass(frozen=True)
class OperandKeys:
    """Where the chunks of one operand are: its shape, chunks, and the key of
    each chunk: ``(name,) + index`` for a dask array, or ``table[index]`` (the
    future) for scattered blocks; block mode scatters a copy to each worker
    reading a block, ``table[index]`` then maps worker -> future, and a task
    reads its own worker's copy (``home``). ``routes[(index, home)]``: the
    key of the export task (``transfer.export_chunk``) a task on worker
    ``home`` reads in place of chunk ``index`` (CUDA IPC from its holder), or
    a ``pull.Pull`` of it: an argument, not a dependency, fetched by the task
    from the holder itself."""

    shape: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    name: str | None = None
    table: Any = None
    routes: Any = None

    def key(self, idx: tuple, home: str | None = None):
        if self.table is None:
            if self.routes and (idx, home) in self.routes:
                return self.routes[(idx, home)]
            return (self.name,) + idx
        entry = self.table[idx]
        if isinstance(entry, dict):
            return entry.get(home) or entry[min(entry)]
        return entry

    @property
    def batch(self) -> tuple[int, ...]:
        return tuple(self.shape[:-2])

    def batch_block(self, out_index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """For an index into the broadcast batch, this operand's batch block
        index and the index inside that block (broadcast axes read element 0)."""
        nb = len(self.batch)
        own = out_index[len(out_index) - nb:] if nb else ()
        blocks, lead = [], []
        for axis, (size, idx) in enumerate(zip(self.batch, own)):
            idx = 0 if size == 1 else idx
            (blk, lo, _), = locate(edges(self.chunks[axis]), idx, idx + 1)
            blocks.append(blk)
            lead.append(lo)
        return tuple(blocks), tuple(lead)


@dataclass(frozen=True)
class CellTasks:
    """Block mode (``distmm.plan_blocks``): each output block is a whole
    block of a worker, its task the k group's whole panels at once
    (``tasks.block_product``), on a device per task.

    ``devices[(bi, bj, g)]``: ``("gpu" | "cpu", workers sharing that GPU)``
    (missing: CPU); ``fail``: the cells raising ``TileFailed`` on the GPU on
    purpose (``distmm-debug.fail-tiles``); ``fallback``: see ``block_product``;
    ``homes[(bi, bj, g)]``: the worker running that task (scattered operands:
    whose copy of a block it reads); ``exports_at[worker]``: the ``pull.Pull``
    of each export task pinned to that worker, which a block task there lets
    run before it queues its GEMM (``pull.await_own``).
    """

    devices: Any
    fail: frozenset = frozenset()
    fallback: tuple = ()  # CPU workers a failed GPU task hands its block to (lazy products)
    homes: Any = None
    exports_at: Any = None

    def device(self, bi: int, bj: int, g: int) -> tuple[str, int]:
        return self.devices.get((bi, bj, g), ("cpu", 1))

    def home(self, bi: int, bj: int, g: int) -> str | None:
        return None if self.homes is None else self.homes.get((bi, bj, g))

    def own_exports(self, bi: int, bj: int, g: int) -> tuple:
        if not self.exports_at:
            return ()
        return tuple(self.exports_at.get(self.home(bi, bj, g), ()))


def _step_inputs(groups: int, reduction) -> tuple:
    """For each step of the reduction tree, where its two inputs come from:
    ``("p", g)`` the partial of group g, ``("s", t)`` the result of step t."""
    latest = [("p", g) for g in range(groups)]
    out = []
    for t, (dst, src) in enumerate(reduction):
        out.append((latest[dst], latest[src]))
        latest[dst] = ("s", t)
    if reduction and reduction[-1][0] != 0:
        raise ValueError("the reduction tree must end in partial 0")
    return tuple(out)


class ProductLayer(Layer):
    """The tasks of ``C = A @ B``, generated on demand.

    Keys: output blocks ``(name, *batch, bi, bj)``; with a k split, partials
    ``(partial_name, *batch, bi, bj, g)`` and reduction steps
    ``(sum_name, *batch, bi, bj, t)``, the last step being the output block.
    ``blocks``: the ``(batch, bi, bj)`` this layer holds (``None``: all).
    """

    has_legacy_tasks = False  # the tasks are task-spec objects; never scanned

    def __init__(self, name: str, geometry: Geometry, a: OperandKeys, b: OperandKeys,
                 tp: TaskPlan, backend: str, batch: tuple[int, ...], reduction,
                 annotations=None, blocks=None, cells: CellTasks | None = None):
        super().__init__(annotations=annotations)
        self.cells = cells
        self.name = name
        self.out_name, self.partial_name, self.sum_name = names_of(name)
        self.geometry = geometry
        self.a, self.b = a, b
        self.tp, self.backend = tp, backend
        self.batch = tuple(batch)
        self.reduction = tuple(reduction)
        self.steps = _step_inputs(geometry.groups, self.reduction)
        self.blocks = None if blocks is None else frozenset(blocks)
        self._cache: dict = {}

    # -- blocks -------------------------------------------------------------
    @property
    def split(self) -> bool:
        return self.geometry.groups > 1

    def _per_block(self) -> int:
        return 1 if not self.split else self.geometry.groups + len(self.reduction)

    def iter_blocks(self):
        if self.blocks is not None:
            yield from sorted(self.blocks)
            return
        gm, gn = self.geometry.grid
        for ob in np.ndindex(*self.batch):
            for bi in range(gm):
                for bj in range(gn):
                    yield ob, bi, bj

    def _block_keys(self, ob, bi, bj):
        pos = ob + (bi, bj)
        out = (self.out_name,) + pos
        if not self.split:
            return [out]
        keys = [(self.partial_name,) + pos + (g,) for g in range(self.geometry.groups)]
        keys += [(self.sum_name,) + pos + (t,) for t in range(len(self.reduction) - 1)]
        keys.append(out)
        return keys

    def output_key(self, ob, bi, bj):
        return (self.out_name,) + tuple(ob) + (bi, bj)

    def _parse(self, key):
        """``(kind, (batch, bi, bj), extra)`` of a key of this layer, or None."""
        if not isinstance(key, tuple) or not key:
            return None
        nb = len(self.batch)
        head = key[0]
        if head == self.out_name and len(key) == nb + 3:
            kind, extra = "out", None
        elif self.split and head == self.partial_name and len(key) == nb + 4:
            kind, extra = "p", key[-1]
        elif self.split and head == self.sum_name and len(key) == nb + 4:
            kind, extra = "s", key[-1]
        else:
            return None
        block = (tuple(key[1:1 + nb]), key[1 + nb], key[2 + nb])
        if not self._holds(block, kind, extra):
            return None
        return kind, block, extra

    def _holds(self, block, kind, extra) -> bool:
        ob, bi, bj = block
        gm, gn = self.geometry.grid
        if not (0 <= bi < gm and 0 <= bj < gn and len(ob) == len(self.batch)
                and all(0 <= x < n for x, n in zip(ob, self.batch))):
            return False
        if kind == "p" and not 0 <= extra < self.geometry.groups:
            return False
        if kind == "s" and not 0 <= extra < len(self.reduction) - 1:
            return False
        return self.blocks is None or block in self.blocks

    # -- tasks ----------------------------------------------------------------
    def _partial_parts(self, ob, bi, bj, g):
        """The spec and the input keys of one output block over k group g."""
        geo = self.geometry
        a_bb, a_lead = self.a.batch_block(ob)
        b_bb, b_lead = self.b.batch_block(ob)
        ck = ("pieces", g)
        pieces = self._cache.get(ck)
        if pieces is None:  # block mode: the group's whole k in one piece
            tk = self.tp.tile[2] if self.cells is None else geo.k_groups[-1] + 1
            pieces = self._cache[ck] = geo.pieces(g, tk)
        a_rows = geo.a_row_pieces(bi)
        b_cols = geo.b_col_pieces(bj)
        a_keys = tuple(sorted({(rb, kb) for rb, _, _ in a_rows for a_k, _ in pieces for kb, _, _ in a_k}))
        b_keys = tuple(sorted({(kb, cb) for _, b_k in pieces for kb, _, _ in b_k for cb, _, _ in b_cols}))
        spec = BlockSpec(a_lead, b_lead, a_rows, b_cols, pieces, a_keys, b_keys,
                         finish=not self.split, batch_ndim=len(self.batch),
                         at=tuple(ob) + (geo.row_edges[bi], geo.col_edges[bj]))
        home = None if self.cells is None else self.cells.home(bi, bj, g)
        return spec, [self.a.key(a_bb + ab, home) for ab in a_keys], [
            self.b.key(b_bb + bb, home) for bb in b_keys]

    def _source_key(self, block, source):
        kind, idx = source
        pos = block[0] + block[1:]
        if kind == "p":
            return (self.partial_name,) + pos + (idx,)
        if idx == len(self.reduction) - 1:
            return (self.out_name,) + pos
        return (self.sum_name,) + pos + (idx,)

    def _step(self, kind, block, extra) -> int:
        return len(self.reduction) - 1 if kind == "out" else extra

    def __getitem__(self, key):
        parsed = self._parse(key)
        if parsed is None:
            raise KeyError(key)
        kind, block, extra = parsed
        ob, bi, bj = block
        if kind == "p" or (kind == "out" and not self.split):
            spec, a_refs, b_refs = self._partial_parts(ob, bi, bj, extra or 0)
            a_list, b_list = task_list(_arg(k) for k in a_refs), task_list(_arg(k) for k in b_refs)
            if self.cells is not None:
                device, share = self.cells.device(bi, bj, extra or 0)
                own = self.cells.own_exports(bi, bj, extra or 0)
                return make_task(key, block_product, self.tp, self.backend, spec, device,
                             (bi, bj) in self.cells.fail, share, a_list, b_list, (bi, bj),
                             self.cells.fallback, *((own,) if own else ()))
            return make_task(key, partial_block, self.tp, self.backend, spec, a_list, b_list)
        t = self._step(kind, block, extra)
        src_dst, src_src = self.steps[t]
        final = t == len(self.reduction) - 1
        parts = self._host_parts(bi, bj) if final else None
        return make_task(key, sum_step, self.tp, task_ref(self._source_key(block, src_dst)),
                     task_ref(self._source_key(block, src_src)), final, len(self.batch) if final else 0,
                     *(parts or ()))

    def _host_parts(self, bi, bj):
        """``sum_step``'s ``parts`` and ``if_cpu`` for block ``(bi, bj)`` of a complex product
        whose every k group's task multiplies with numpy's matmul on a CPU: a CPU backend's
        tiles (``"auto"``'s where the worker sees no GPU), block mode's CPU cells; the
        distinct ``(rows, columns, k)`` of its products (``tasks.block_parts``). ``None``
        otherwise: real dtypes (no parts to tell), a GPU backend, a GPU cell."""
        from distmm.executor import CPU_BACKENDS

        if np.dtype(self.tp.dtype) not in (np.complex64, np.complex128):
            return None
        if self.cells is not None:
            if any(self.cells.device(bi, bj, g)[0] != "cpu" for g in range(self.geometry.groups)):
                return None
            if_cpu = False
        elif self.backend in CPU_BACKENDS or self.backend == "auto":
            if_cpu = self.backend == "auto"
        else:
            return None
        widths = self._cache.get("k_widths")
        if widths is None:  # once per layer: the k of every group's pieces, each width once
            tk = self.tp.tile[2] if self.cells is None else self.geometry.k_groups[-1] + 1
            widths = self._cache["k_widths"] = tuple(sorted({
                sum(k1 - k0 for _, k0, k1 in a_k)
                for g in range(self.geometry.groups) for a_k, _ in self.geometry.pieces(g, tk)}))
        geo = self.geometry
        rows = geo.row_edges[bi + 1] - geo.row_edges[bi]
        cols = geo.col_edges[bj + 1] - geo.col_edges[bj]
        return tuple((rows, cols, w) for w in widths), if_cpu

    def get_dependencies(self, key, all_hlg_keys=None) -> set:
        parsed = self._parse(key)
        if parsed is None:
            raise KeyError(key)
        kind, block, extra = parsed
        ob, bi, bj = block
        if kind == "p" or (kind == "out" and not self.split):
            _, a_refs, b_refs = self._partial_parts(ob, bi, bj, extra or 0)
            return {_key(r) for r in a_refs + b_refs if not isinstance(r, Pull)}
        t = self._step(kind, block, extra)
        return {self._source_key(block, s) for s in self.steps[t]}

    # -- Mapping and Layer protocol -------------------------------------------
    def __iter__(self):
        for ob, bi, bj in self.iter_blocks():
            yield from self._block_keys(ob, bi, bj)

    def __len__(self) -> int:
        if self.blocks is not None:
            count = len(self.blocks)
        else:
            gm, gn = self.geometry.grid
            count = math.prod(self.batch) * gm * gn
        return count * self._per_block()

    def __contains__(self, key) -> bool:
        return self._parse(key) is not None

    def is_materialized(self) -> bool:
        return False

    def get_output_keys(self):
        return {self.output_key(*blk) for blk in self.iter_blocks()}

    def restricted(self, blocks) -> "ProductLayer":
        return ProductLayer(self.name, self.geometry, self.a, self.b, self.tp, self.backend,
                            self.batch, self.reduction, annotations=self.annotations,
                            blocks=blocks, cells=self.cells)

    def cull(self, keys, all_hlg_keys):
        wanted = set()
        for key in keys:
            parsed = self._parse(key)
            if parsed is not None:
                wanted.add(parsed[1])
        if not wanted:
            return self.restricted(()), {}
        layer = self if self.blocks is not None and wanted == self.blocks else self.restricted(wanted)
        deps = {k: layer.get_dependencies(k) for k in layer}
        return layer, deps

    def __reduce__(self):
        return (ProductLayer, (self.name, self.geometry, self.a, self.b, self.tp, self.backend,
                               self.batch, self.reduction, self.annotations, self.blocks,
                               self.cells))
