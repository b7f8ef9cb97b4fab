"""Dask-array operands: the product as a lazy ``dask.array.Array``.

This module covers: wrapping a ``ProductLayer`` over the operands' own chunks
into a dask array (no rechunk is inserted; the input layers stay as they
are), in block mode (``lazy_blocks``) the layout's block tasks with one small
task per output chunk slicing it out of its block (on the block's worker,
where the block lies), and the array class whose optimisation keeps the
placement annotations.
It does *not* cover: the tasks or their geometry (``graph``, ``chunks``), or
numpy operands (``distmm.engine.dask.eager``).
"""
from __future__ import annotations

import numpy as np

from distmm.engine.dask.chunks import Geometry
from distmm.engine.dask.graph import OperandKeys, ProductLayer, names_of
from distmm.engine.dask.placement import Placement
from distmm.engine.dask.tasks import TaskPlan
from distmm.plan import Plan

__all__ = ["lazy_product", "lazy_blocks", "PinnedArray", "ChunkHomes"]


def output_chunks(geometry_chunks, batch) -> tuple:
    """Chunks of the result: one per element along batch axes."""
    return tuple((1,) * b if b else (0,) for b in batch) + tuple(geometry_chunks)


def lazy_product(ops, plan: Plan, a2, b2, geometry: Geometry, slots, backend: str):
    """The lazy ``A @ B`` of dask operands ``a2``, ``b2`` (1-D already
    promoted), with ``ops.out_shape`` and numpy's result dtype."""
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    dtype = np.dtype(ops.dtype)
    out_shape = ops.out_shape
    batch = tuple(ops.batch)
    chunks = output_chunks(geometry.chunks, batch)
    if 0 in out_shape or plan.k == 0:
        return da.zeros(out_shape, dtype=dtype, chunks=chunks)
    name = "distmm-matmul-" + tokenize(a2.name, b2.name, plan, geometry, backend, batch, slots)
    annotations = None
    if slots:
        placement = Placement(plan, geometry, names_of(name), len(batch), plan.reduction, slots)
        annotations = {"workers": placement, "allow_other_workers": True}
    layer = ProductLayer(name, geometry,
                         OperandKeys(tuple(a2.shape), a2.chunks, a2.name),
                         OperandKeys(tuple(b2.shape), b2.chunks, b2.name),
                         TaskPlan.of(plan), backend, batch, plan.reduction,
                         annotations=annotations)
    hlg = HighLevelGraph.from_collections(name, layer, dependencies=[a2, b2])
    meta = getattr(a2, "_meta", np.empty((0, 0)))
    out_meta = meta_from_array(meta, ndim=len(out_shape), dtype=dtype)
    cls = PinnedArray if annotations else da.Array
    return cls(hlg, name, chunks, dtype=dtype, meta=out_meta)


def lazy_blocks(ops, plan: Plan, a2, b2, geometry: Geometry, layout, addresses, cells,
                backend: str):
    """The lazy ``A @ B`` of 2-D dask operands in block mode: ``layout``'s
    cells (on ``geometry``'s output chunk edges) as tasks on ``addresses``
    (one per unit), the output chunks sliced out of them."""
    import bisect

    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    from distmm.engine.dask.graph import _ref, _task
    from distmm.engine.dask.placement import BlockPlacement
    from distmm.engine.dask.blocks import cut

    dtype = np.dtype(ops.dtype)
    chunks = tuple(geometry.chunks)
    if 0 in ops.out_shape or plan.k == 0:
        return da.zeros(ops.out_shape, dtype=dtype, chunks=chunks)
    token = tokenize(a2.name, b2.name, plan, layout, backend, addresses, cells)
    name = "distmm-matmul-" + token
    cell_geo = Geometry.of_cells(layout.row_edges, layout.col_edges, layout.k_edges,
                                 a2.chunks, b2.chunks)
    placement = BlockPlacement(layout, names_of(name), addresses)
    layer = ProductLayer(name, cell_geo, OperandKeys(tuple(a2.shape), a2.chunks, a2.name),
                         OperandKeys(tuple(b2.shape), b2.chunks, b2.name), TaskPlan.of(plan),
                         backend, (), layout.reduction,
                         annotations={"workers": placement, "allow_other_workers": True},
                         cells=cells)
    hlg = HighLevelGraph.from_collections(name, layer, dependencies=[a2, b2])
    out_name = "distmm-chunks-" + token
    rows, cols = geometry.row_edges, geometry.col_edges
    dsk, homes = {}, {}
    for ci in range(len(rows) - 1):
        bi = bisect.bisect_right(layout.row_edges, rows[ci]) - 1
        r0 = layout.row_edges[bi]
        for cj in range(len(cols) - 1):
            bj = bisect.bisect_right(layout.col_edges, cols[cj]) - 1
            c0 = layout.col_edges[bj]
            key = (out_name, ci, cj)
            dsk[key] = _task(key, cut, _ref((name, bi, bj)), rows[ci] - r0, rows[ci + 1] - r0,
                             cols[cj] - c0, cols[cj + 1] - c0)
            homes[(ci, cj)] = placement((name, bi, bj))
    layers = dict(hlg.layers)
    # pinned to their block's worker: many small tasks over few blocks are
    # "root-ish" to the scheduler, which would place them ignoring where the block is
    layers[out_name] = MaterializedLayer(dsk, annotations={
        "workers": ChunkHomes(out_name, homes), "allow_other_workers": True})
    deps = dict(hlg.dependencies)
    deps[out_name] = {name}
    graph = HighLevelGraph(layers, deps)
    meta = getattr(a2, "_meta", np.empty((0, 0)))
    out_meta = meta_from_array(meta, ndim=2, dtype=dtype)
    return PinnedArray(graph, out_name, chunks, dtype=dtype, meta=out_meta)


class ChunkHomes:
    """The ``workers=`` annotation of block mode's output chunks: each on the
    worker of the block it is cut from."""

    def __init__(self, name: str, homes: dict):
        self.name, self.homes = name, dict(homes)

    def __call__(self, key):
        if isinstance(key, tuple) and len(key) == 3 and key[0] == self.name:
            return self.homes.get((key[1], key[2]))
        return None


def _cull_only(dsk, keys, **kwargs):
    from dask.core import flatten
    from dask.highlevelgraph import HighLevelGraph

    if not isinstance(dsk, HighLevelGraph):
        dsk = HighLevelGraph.from_collections(str(id(dsk)), dsk, dependencies=())
    return dsk.cull(set(flatten(keys)))


def _pinned_array_class():
    import dask.array as da

    class PinnedArray(da.Array):
        """A ``dask.array.Array`` whose own optimisation only culls.

        dask.array's default optimisation fuses tasks into a plain dict and so
        drops per-key annotations, the plan's worker pins among them.
        Computing or persisting the result itself keeps them; arrays derived
        from it are plain ``dask.array.Array`` objects (correct, placed by the
        scheduler's own heuristics).
        """

        __slots__ = ()
        __dask_optimize__ = staticmethod(_cull_only)

    PinnedArray.__module__ = __name__
    return PinnedArray


PinnedArray = _pinned_array_class()
