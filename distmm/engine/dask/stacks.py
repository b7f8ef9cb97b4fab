"""Stacks of small matrices: one task per batch chunk (and output block) of the result.

This module covers: whether a product of dask operands is a stack of small elements
(``SMALL_FLOPS``) that runs a task per batch chunk (``applies``), the result's batch chunks
(the operands' batch chunk edges joined, broadcast as numpy broadcasts: an operand of batch
extent 1 is read by every chunk), and the lazy result over them, with no rechunk of the
operands: where every element's matrices lie whole in one chunk, one ``tasks.stack_block``
per output batch chunk; where they span chunks (or the plan splits k), one
``tasks.stack_panels`` per output batch chunk and output block (A's row chunks by B's
column chunks, as dask.array's), which is handed that batch chunk's k chunks and sums over
k as the per-element tasks do; for in-memory operands on a cluster
(``eager``), whether the product is such a stack (``eager_applies``) and its split into
about one rectangular batch block per worker slot (``batch_blocks``, ``operand_index``).
It does *not* cover: the per-element arithmetic (``tasks.stack_block`` and
``tasks.stack_panels``, which are ``partial_block``'s), device (cupy) chunks, elements above
``SMALL_FLOPS`` and output blocks other than the operands' chunks (a tile asked for): those
keep one task per element and output block (``lazy.lazy_product``).
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from distmm.engine.dask.chunks import Geometry, edges

__all__ = ["SMALL_FLOPS", "BLOCK_BYTES", "applies", "batch_chunks", "lazy_stack", "eager_applies",
           "batch_blocks", "operand_index"]

#: largest ``2 m n k`` of one element that the stack path takes (one 400^3 product): above
#: it an element is enough work for a task of its own, which keeps every worker busy on a
#: short stack of large matrices (``bench/NOTES.md``, "Stacks of small matrices")
SMALL_FLOPS = 2 ** 27

#: most bytes (both operands' elements and C's) an eager stack block holds, about: a larger
#: stack is split into more blocks than worker slots
BLOCK_BYTES = 64 * 2 ** 20


def applies(ops, plan, geometry: Geometry) -> bool:
    """Whether the product of dask operands ``ops`` runs one task per batch chunk (and
    output block): a stack (batch axes) of small elements (``SMALL_FLOPS``) in numpy chunks
    (device chunks keep one task per element) whose matrices are one chunk each in both
    operands with the plan's one output block and one k group per element, or whose output
    blocks ``geometry`` are the operands' chunks (``_spanning``)."""
    if not ops.batch or 2 * ops.m * ops.n * ops.k > SMALL_FLOPS:
        return False
    a2, b2 = ops.a2, ops.b2
    if not all(isinstance(getattr(x, "_meta", None), np.ndarray) for x in (a2, b2)):
        return False
    return _whole(a2, b2, geometry) or geometry == _spanning(plan, a2, b2)


def _whole(a2, b2, geometry: Geometry) -> bool:
    """Whether every element's matrices are one chunk each, one output block and one k
    group (``tasks.stack_block``)."""
    return (all(len(c) == 1 for c in a2.chunks[-2:] + b2.chunks[-2:])
            and geometry.grid == (1, 1) and geometry.groups == 1)


def _spanning(plan, a2, b2) -> Geometry:
    """The geometry of a stack whose matrices span chunks: output blocks on A's row chunks
    and B's column chunks, the plan's k groups on the chunk edges."""
    return Geometry.of(plan, a2.chunks, b2.chunks, follow_chunks=True)


def _axes(x, batch: tuple) -> list:
    """For each output batch axis, the axis of ``x`` aligned with it (from the right) and
    whether ``x`` spans it (its extent is the output's, not a broadcast 1), or None."""
    nb = x.ndim - 2
    out = []
    for j, size in enumerate(batch):
        axis = j - (len(batch) - nb)
        if axis < 0:
            out.append(None)
        else:
            out.append((axis, x.shape[axis] == size and size != 1))
    return out


def batch_chunks(a2, b2, batch: tuple) -> tuple:
    """The result's chunks along its batch axes: every chunk edge of an operand spanning
    that axis (one chunk where the axis is broadcast from extent 1)."""
    chunks = []
    for j, size in enumerate(batch):
        cuts = {0, size}
        for x in (a2, b2):
            spec = _axes(x, batch)[j]
            if spec is not None and spec[1]:
                cuts |= set(edges(x.chunks[spec[0]]))
        cuts = sorted(cuts)
        chunks.append(tuple(hi - lo for lo, hi in zip(cuts[:-1], cuts[1:])) or (0,))
    return tuple(chunks)


def _offsets(x, batch: tuple) -> list:
    """For each output batch axis: None where ``x`` lacks it, else the chunk offsets of
    ``x`` along it where it spans it (None where it is broadcast from extent 1), found once
    for every batch block's ``_reads``."""
    return [None if spec is None else (edges(x.chunks[spec[0]]) if spec[1] else None,)
            for spec in _axes(x, batch)]


def _reads(offsets: list, lo: tuple, hi: tuple) -> tuple[tuple, tuple]:
    """The key index of the chunk of an operand (its ``_offsets``) that an output batch
    block ``[lo, hi)`` reads and the index into it (its batch axes, then its whole
    matrix)."""
    block, index = [], []
    for j, spec in enumerate(offsets):
        if spec is None:
            continue
        cuts = spec[0]
        if cuts is None:
            block.append(0)
            index.append(slice(None))
            continue
        c = bisect.bisect_right(cuts, lo[j]) - 1
        block.append(c)
        index.append(slice(lo[j] - cuts[c], hi[j] - cuts[c]))
    return tuple(block) + (0, 0), tuple(index)


def lazy_stack(ops, plan, a2, b2, backend: str, annotations=None):
    """The lazy ``A @ B`` of dask operands ``a2``, ``b2`` (1-D already promoted) for which
    ``applies``: ``ops.out_shape``, numpy's result dtype, one task per output batch chunk and
    output block (``annotations``: the layer's, an enclosing ``dask.annotate``'s where
    None)."""
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    from distmm.engine.dask.graph import make_task, task_list, task_ref
    from distmm.engine.dask.tasks import StackSpec, TaskPlan, stack_block, stack_panels

    dtype = np.dtype(ops.dtype)
    batch = tuple(ops.batch)
    bchunks = batch_chunks(a2, b2, batch)
    geometry = _spanning(plan, a2, b2)
    whole = _whole(a2, b2, geometry)
    chunks = bchunks + (((ops.m,), (ops.n,)) if whole else geometry.chunks)
    if 0 in ops.out_shape or plan.k == 0:
        return da.zeros(ops.out_shape, dtype=dtype, chunks=chunks)
    tp = TaskPlan.of(plan)
    name = "distmm-matmul-" + tokenize("stack", a2.name, b2.name, tp, backend, batch, bchunks,
                                       geometry, () if whole else tuple(plan.reduction))
    offsets = [edges(c) for c in bchunks]
    a_offsets, b_offsets = _offsets(a2, batch), _offsets(b2, batch)
    gm, gn = geometry.grid
    blocks = {} if whole else {(bi, bj): _block_parts(plan, tp, geometry, bi, bj)
                               for bi in range(gm) for bj in range(gn)}
    dsk = {}
    for blk in np.ndindex(*(len(c) for c in bchunks)):
        lo = tuple(offsets[j][i] for j, i in enumerate(blk))
        hi = tuple(offsets[j][i + 1] for j, i in enumerate(blk))
        a_key, a_index = _reads(a_offsets, lo, hi)
        b_key, b_index = _reads(b_offsets, lo, hi)
        shape = tuple(h - l for l, h in zip(lo, hi))
        if whole:
            key = (name,) + blk + (0, 0)
            dsk[key] = make_task(key, stack_block, tp, backend, task_ref((a2.name,) + a_key),
                                 a_index, task_ref((b2.name,) + b_key), b_index, shape, lo)
            continue
        for (bi, bj), parts in blocks.items():
            key = (name,) + blk + (bi, bj)
            spec = StackSpec(a_index, b_index, *parts, shape,
                             lo + (geometry.row_edges[bi], geometry.col_edges[bj]))
            dsk[key] = make_task(
                key, stack_panels, tp, backend, spec,
                task_list(task_ref((a2.name,) + a_key[:-2] + ab) for ab in spec.a_keys),
                task_list(task_ref((b2.name,) + b_key[:-2] + bb) for bb in spec.b_keys))
    layer = MaterializedLayer(dsk, annotations=annotations)
    hlg = HighLevelGraph.from_collections(name, layer, dependencies=[a2, b2])
    meta = meta_from_array(a2._meta, ndim=len(ops.out_shape), dtype=dtype)
    return da.Array(hlg, name, chunks, dtype=dtype, meta=meta)


def _block_parts(plan, tp, geometry: Geometry, bi: int, bj: int) -> tuple:
    """What the ``tasks.StackSpec`` of output block ``(bi, bj)`` holds in every batch chunk:
    the chunks read (``a_keys``, ``b_keys``), the pieces along m and n, the k pieces of every
    k group (the per-element tasks' k-loops) and the reduction tree over the groups."""
    groups = tuple(geometry.pieces(g, tp.tile[2]) for g in range(geometry.groups))
    a_rows, b_cols = geometry.a_row_pieces(bi), geometry.b_col_pieces(bj)
    a_keys = tuple(sorted({(rb, kb) for rb, _, _ in a_rows for pieces in groups
                           for a_k, _ in pieces for kb, _, _ in a_k}))
    b_keys = tuple(sorted({(kb, cb) for pieces in groups for _, b_k in pieces
                           for kb, _, _ in b_k for cb, _, _ in b_cols}))
    reduction = tuple(plan.reduction) if len(groups) > 1 else ()
    return a_keys, b_keys, a_rows, b_cols, groups, reduction


def eager_applies(ops, plan) -> bool:
    """Whether the product of in-memory operands ``ops`` runs one task per batch block: a
    stack of small elements (``SMALL_FLOPS``) that the plan keeps whole (one output tile
    and one k group)."""
    if not ops.batch or 2 * ops.m * ops.n * ops.k > SMALL_FLOPS:
        return False
    return (len(plan.row_edges) == 2 and len(plan.col_edges) == 2 and len(plan.k_edges) == 2
            and plan.k_splits == 1)


def batch_blocks(batch: tuple, count: int) -> list[tuple[tuple, tuple]]:
    """About ``count`` (at least one) rectangular blocks ``(lo, hi)`` covering the batch
    axes ``batch`` in C order: the trailing axes whole where a block holds them all, the
    first axis not held whole split evenly, the axes before it one index at a time."""
    total = math.prod(batch)
    target = max(-(-total // max(count, 1)), 1)
    axis, inner = len(batch) - 1, 1
    while axis > 0 and inner * batch[axis] <= target:
        inner *= batch[axis]
        axis -= 1
    size = batch[axis]
    pieces = min(max(-(-size * inner // target), 1), size)
    cuts = [size * i // pieces for i in range(pieces + 1)]
    out = []
    for head in np.ndindex(*batch[:axis]):
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            out.append((head + (lo,) + (0,) * (len(batch) - axis - 1),
                        tuple(h + 1 for h in head) + (hi,) + tuple(batch[axis + 1:])))
    return out


def operand_index(shape: tuple, batch: tuple, lo: tuple, hi: tuple) -> tuple:
    """The index into an operand of ``shape`` of what the output batch block ``[lo, hi)``
    reads: its batch axes aligned with the output's from the right (an axis of extent 1
    whole: broadcast), then its whole matrix."""
    nb = len(shape) - 2
    lead = len(batch) - nb
    index = tuple(slice(None) if shape[ax] == 1 else slice(lo[lead + ax], hi[lead + ax])
                  for ax in range(nb))
    return index + (slice(None), slice(None))
