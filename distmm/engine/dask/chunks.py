"""Chunk geometry of the Dask engine: which operand chunks each task reads.

This module covers: the output blocks of a product (dask.array's ``A @ B`` chunks
by default: A's row chunks by B's column chunks; the plan's tiles when a tile
was asked for), the k groups of a split product laid on the operands' chunk
edges, the k pieces of one task's k-loop, and the tile hint the engine gives
the planner for chunked operands.
It does *not* cover: chunk offsets along an axis and locating the chunks that
overlap a range (``distmm.plan_blocks``: ``edges``, ``locate``, ``nearest_cut``,
re-exported here), tiling arithmetic of the plan itself (``distmm.plan``),
building tasks (``distmm.engine.dask.graph``) or where tasks run
(``distmm.engine.dask.placement``). Everything here is pure: no dask imports.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from distmm.plan import Plan
from distmm.plan_blocks import edges, locate, nearest_cut

__all__ = ["edges", "locate", "k_pieces", "nearest_cut", "Geometry", "chunk_tile", "check_chunks"]


def k_pieces(a_off, b_off, k0: int, k1: int, tk: int):
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
    return tuple((locate(a_off, lo, hi), locate(b_off, lo, hi))
                 for lo, hi in zip(merged[:-1], merged[1:]))


def _group_edges(plan: Plan, cuts: tuple[int, ...]) -> tuple[int, ...]:
    """The plan's k groups moved onto chunk edges.

    A task receives whole chunks, so a group edge inside a chunk makes two
    tasks each hold that chunk. Each interior edge of ``plan.k_edges`` moves to
    the nearest chunk edge (``cuts``), keeping the plan's number of groups (and
    so its reduction tree); with fewer chunks than groups the plan's edges stay.
    """
    groups = plan.k_splits
    if groups == 1:
        return (0, plan.k)
    if len(cuts) - 1 < groups:
        return tuple(plan.k_edges)
    idx = [0]
    for s in range(1, groups):
        near = max(nearest_cut(cuts, plan.k_edges[s]), idx[-1] + 1)
        near = min(near, len(cuts) - 1 - (groups - s))
        idx.append(near)
    idx.append(len(cuts) - 1)
    return tuple(cuts[c] for c in idx)


def _tiles_of(tile_edges, block_edges) -> tuple[int, ...]:
    """For each output block (edges ``block_edges``), the plan tile (edges ``tile_edges``)
    holding its first element; an empty block at the end, which starts at m or n, gets
    the last tile."""
    last = max(len(tile_edges) - 2, 0)
    return tuple(min(bisect.bisect_right(tile_edges, e) - 1, last) for e in block_edges[:-1])


@dataclass(frozen=True)
class Geometry:
    """Output blocks and k groups of one product, and the operands' chunk edges.

    ``row_edges``/``col_edges``: output blocks along m and n. ``k_groups``: the
    edges of the plan's k groups (one group: ``(0, k)``). ``a_rows``, ``a_k``,
    ``b_k``, ``b_cols``: chunk offsets of A and B along their two last axes.
    ``tile_rows``/``tile_cols``: for each output block, the plan tile holding
    its first element (for the plan's owners).
    """

    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    k_groups: tuple[int, ...]
    a_rows: tuple[int, ...]
    a_k: tuple[int, ...]
    b_k: tuple[int, ...]
    b_cols: tuple[int, ...]
    tile_rows: tuple[int, ...]
    tile_cols: tuple[int, ...]

    @classmethod
    def of(cls, plan: Plan, a_chunks, b_chunks, *, follow_chunks: bool) -> "Geometry":
        """The geometry of ``plan`` over operands chunked as ``a_chunks`` and
        ``b_chunks`` (their two last axes). ``follow_chunks``: output blocks
        are A's row chunks by B's column chunks; otherwise the plan's tiles."""
        a_rows, a_k = edges(a_chunks[-2]), edges(a_chunks[-1])
        b_k, b_cols = edges(b_chunks[-2]), edges(b_chunks[-1])
        if follow_chunks:
            rows, cols = a_rows, b_cols
        else:
            rows, cols = tuple(plan.row_edges), tuple(plan.col_edges)
        cuts = tuple(sorted(set(a_k) | set(b_k)))
        tile_rows = _tiles_of(plan.row_edges, rows)
        tile_cols = _tiles_of(plan.col_edges, cols)
        return cls(rows, cols, _group_edges(plan, cuts), a_rows, a_k, b_k, b_cols,
                   tile_rows, tile_cols)

    @classmethod
    def of_cells(cls, row_edges, col_edges, k_groups, a_chunks, b_chunks) -> "Geometry":
        """The geometry of a block layout's cells (``distmm.plan_blocks``)
        over operands chunked as ``a_chunks`` and ``b_chunks``; ``k_groups``
        already lie on chunk edges."""
        gm, gn = len(row_edges) - 1, len(col_edges) - 1
        return cls(tuple(row_edges), tuple(col_edges), tuple(k_groups),
                   edges(a_chunks[-2]), edges(a_chunks[-1]), edges(b_chunks[-2]),
                   edges(b_chunks[-1]), tuple(range(gm)), tuple(range(gn)))

    @property
    def grid(self) -> tuple[int, int]:
        return len(self.row_edges) - 1, len(self.col_edges) - 1

    @property
    def groups(self) -> int:
        return len(self.k_groups) - 1

    @property
    def chunks(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The output chunks along m and n."""
        return (tuple(np.diff(self.row_edges).tolist()) or (0,),
                tuple(np.diff(self.col_edges).tolist()) or (0,))

    def a_row_pieces(self, bi: int):
        return locate(self.a_rows, self.row_edges[bi], self.row_edges[bi + 1])

    def b_col_pieces(self, bj: int):
        return locate(self.b_cols, self.col_edges[bj], self.col_edges[bj + 1])

    def pieces(self, g: int, tk: int):
        """The k pieces of group ``g``: the k-loop of one task."""
        return k_pieces(self.a_k, self.b_k, self.k_groups[g], self.k_groups[g + 1], tk)


def chunk_tile(a_row_chunks, b_col_chunks, tk: int) -> tuple[int, int, int]:
    """The plan tile for operands chunked as given: A's largest row chunk by
    B's largest column chunk (dask.array's output chunks of ``A @ B`` when the
    chunks are regular), and the planner's k-block ``tk``."""
    tm = max((int(c) for c in a_row_chunks), default=1) or 1
    tn = max((int(c) for c in b_col_chunks), default=1) or 1
    return (tm, tn, tk)


def check_chunks(name: str, x) -> None:
    """Raise a clear error for an operand with unknown chunk sizes."""
    for axis_chunks in x.chunks:
        if any(isinstance(c, float) and np.isnan(c) for c in axis_chunks):
            raise ValueError(
                f"matmul: operand {name} has unknown chunk sizes (shape {x.shape}); "
                f"call {name}.compute_chunk_sizes() first"
            )
