"""The plan of a file-to-file batch product under MPI: pure functions and a frozen dataclass.

This module covers: the process grid of a batch job (``rows x cols`` ranks, k never split,
so that every rank owns a block of C and writes it itself; ``ranks x 1`` when asked for whole
rows and B fits, so that each block is one contiguous range of the output file), the stripes
that cut each rank's C block into row ranges computed and written one after another (so that writing C
overlaps computing it, and a stopped job can resume at a stripe), the k panels of a stripe's
product (every owner's edge of A and B; finer for the first stripe, whose product starts while B's
panel is still arriving), and what one rank holds at once: B's column panel
(``k x n_j``, kept for every stripe), two A stripes and two C stripes, all in the accumulation
dtype. ``plan_batch`` refuses a product whose column panel of B does not fit the memory it is
given, before anything is read.

It does *not* cover: reading, moving or writing bytes (``distmm.engine.mpi.stream``), or the
in-memory SUMMA of ``distmm.grid``, whose grids it reuses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from distmm.grid import GridPlan, even_edges, make_grid

__all__ = ["BatchPlan", "plan_batch", "STRIPES_PER_RANK", "MIN_STRIPE_ROWS", "B_CHUNK_BYTES",
           "FIRST_STEP_CHUNKS", "RESUME_STRIPE_BYTES", "MAX_BATCH_EDGES"]

#: stripes each rank's C block is cut into, when memory allows (more: finer resume points and
#: an earlier first write; fewer: larger GEMMs)
STRIPES_PER_RANK = 8
#: the narrowest stripe memory may force (a GEMM of fewer rows runs well below the device's rate)
MIN_STRIPE_ROWS = 256
#: the most bytes of C in one stripe of a resumable run (``--resume``): a stop loses the stripes
#: in flight (computed or being written), so smaller ones lose less
RESUME_STRIPE_BYTES = 512 << 20
#: bytes of B's widest column panel read and copied to the device per chunk (the next chunk is
#: read while the last one is copied)
B_CHUNK_BYTES = 256 << 20
#: chunks of B per k step of the first stripe's product (each step starts once its rows of B
#: are on the device; larger steps: fewer passes over C, a later start)
FIRST_STEP_CHUNKS = 4
#: edges a batch plan lists along one axis (Python ints in its tuples): its stripes, of all
#: grid rows together, and its first stripe's k steps. A plan whose column panel of B fits a
#: rank lists a few thousand at most; more (a product of 10**8 each way planned without a
#: memory limit) took gigabytes before the plan could be refused
MAX_BATCH_EDGES = 2**20


@dataclass(frozen=True)
class BatchPlan:
    """A batch product ``C[m, n] = A[m, k] @ B[k, n]`` on ``grid.rows x grid.cols`` ranks.

    Rank ``(i, j)`` owns ``A[row_i, kA_j]`` and ``B[kB_i, col_j]`` (``grid.a_layout`` and
    ``grid.b_layout``) and computes ``C[row_i, col_j]`` stripe by stripe: for stripe ``s``
    of grid row ``i`` (rows ``stripe_edges[i][s]:stripe_edges[i][s+1]``) each rank of the
    row contributes its piece of A's stripe, and the product is summed over ``panels`` in k
    order against B's column panel, which the ranks of column ``j`` assemble once.

    Attributes
    ----------
    grid : GridPlan
        ``layers == 1``.
    stripe_edges : tuple of tuple of int
        Per grid row, absolute row edges of its stripes.
    panels : tuple of int
        k edges of the stripe product's panels (every owner's edge of A and B).
    held_bytes : tuple of int
        Per rank: bytes held at once on the device (or in host memory for CPU ranks).
    chunk_rows : int
        Rows of B's column panel read and copied per chunk (``B_CHUNK_BYTES`` of the widest).
    first_panels : tuple of int
        k edges of the first stripe's product on GPU ranks: ``panels`` cut every
        ``FIRST_STEP_CHUNKS`` chunks, so that its GEMMs run while B's panel arrives. Fixed by
        the plan, not by timing: a resumed run sums every stripe as an uninterrupted one does.
    """

    grid: GridPlan
    stripe_edges: tuple[tuple[int, ...], ...]
    panels: tuple[int, ...]
    held_bytes: tuple[int, ...]
    chunk_rows: int = 1
    first_panels: tuple[int, ...] = ()

    @property
    def stripes(self) -> int:
        """Most stripes of any grid row (rows differ by at most one stripe)."""
        return max(len(e) - 1 for e in self.stripe_edges)

    def stripe_count(self, i: int) -> int:
        return len(self.stripe_edges[i]) - 1

    def stripe_rows(self, i: int, s: int) -> tuple[int, int]:
        e = self.stripe_edges[i]
        return e[s], e[s + 1]

    def describe(self) -> str:
        g = self.grid
        return (f"batch grid {g.rows} x {g.cols} ranks, {self.stripes} stripe(s) per rank, "
                f"{len(self.panels) - 1} k panel(s); held per rank at most "
                f"{max(self.held_bytes) / 2**30:.2f} GiB")


def _held(grid: GridPlan, i: int, j: int, stripe: int) -> int:
    nj = grid.col_edges[j + 1] - grid.col_edges[j]
    return (grid.k * nj + 2 * stripe * grid.k + 2 * stripe * nj) * grid.itemsize


def plan_batch(m: int, n: int, k: int, dtype="float64", *, ranks: int,
               memory: int | None = None, stripes: int = STRIPES_PER_RANK,
               grid: tuple[int, int] | None = None, whole_rows: bool = False,
               stripe_bytes: int | None = None) -> BatchPlan:
    """Plan a batch product on ``ranks`` ranks.

    Parameters
    ----------
    m, n, k : int
    dtype : dtype
        numpy's result dtype.
    ranks : int
    memory : int, optional
        Bytes one rank may hold (its GPU's, or host memory for CPU ranks); ``None``: no limit.
    stripes : int
        Stripes per rank's C block (fewer when a block has fewer rows; more when two stripes
        would not fit ``memory``, down to ``MIN_STRIPE_ROWS`` rows each).
    grid : (rows, cols), optional
        Force the process grid.
    whole_rows : bool
        Prefer ``ranks x 1`` (each rank's C block whole rows: one contiguous range of a
        C-ordered file, written directly; every rank holds all of B) when B and two stripes
        fit ``memory`` and ``m >= ranks``; otherwise the grid ``distmm.grid.make_grid`` picks.
    stripe_bytes : int, optional
        More stripes where one would hold more than this many bytes of C (a resumable run
        passes ``RESUME_STRIPE_BYTES``).

    Raises
    ------
    ValueError
        Negative sizes, a forced grid that is not ``ranks``, a column panel of B
        (``k x n / cols``) that does not fit ``memory`` with two stripes of the narrowest
        width (the message says how much one rank needs), or more stripes or first-stripe
        k steps than ``MAX_BATCH_EDGES`` (told from the sizes, before any is listed).

    Examples
    --------
    >>> p = plan_batch(32768, 32768, 32768, "float32", ranks=4)
    >>> p.grid.shape, p.stripes, len(p.panels) - 1
    ((1, 2, 2), 8, 2)
    >>> p.stripe_edges[1][:3]
    (16384, 18432, 20480)
    >>> plan_batch(32768, 32768, 32768, "float32", ranks=4, whole_rows=True).grid.shape
    (1, 4, 1)
    """
    if stripes < 1:
        raise ValueError(f"stripes must be at least 1, got {stripes}")
    if whole_rows and grid is None and ranks > 1 and m >= ranks:
        try:
            return plan_batch(m, n, k, dtype, ranks=ranks, memory=memory, stripes=stripes,
                              grid=(ranks, 1), stripe_bytes=stripe_bytes)
        except ValueError:  # B does not fit one rank: the grid below shares it
            pass
    forced = None if grid is None else (1, int(grid[0]), int(grid[1]))
    g = make_grid(m, n, k, dtype, ranks=ranks, grid=forced, k_split=False)
    counts, held = [], [0] * g.ranks
    widest = max(g.col_edges[j + 1] - g.col_edges[j] for j in range(g.cols))  # of C's columns
    for i in range(g.rows):
        mi = g.row_edges[i + 1] - g.row_edges[i]
        count = stripes
        if stripe_bytes:
            count = max(count, -(-mi * widest * np.dtype(g.dtype).itemsize // int(stripe_bytes)))
        count = max(1, min(count, mi))
        if memory is not None:
            while True:
                width = math.ceil(mi / count) if mi else 0
                need = max(_held(g, i, j, width) for j in range(g.cols))
                if need <= memory or width <= MIN_STRIPE_ROWS or width <= 1:
                    break
                count *= 2
        counts.append(count)
        width = -(-mi // count)  # the widest of even_edges(mi, count), before it is listed
        for j in range(g.cols):
            held[g.rank_at(0, i, j)] = _held(g, i, j, width)
    if memory is not None and max(held) > memory:
        worst = max(range(g.ranks), key=held.__getitem__)
        raise ValueError(
            f"a {m} x {n} x {k} {np.dtype(dtype).name} product on {g.rows} x {g.cols} ranks needs "
            f"{max(held) / 2**30:.1f} GiB on rank {worst} (B's column panel k x n/{g.cols} and two "
            f"stripes), more than the {memory / 2**30:.1f} GiB it has: use more ranks")
    chunk_rows = max(1, B_CHUNK_BYTES // max(1, widest * g.itemsize))
    step = chunk_rows * FIRST_STEP_CHUNKS
    for what, listed in (("stripes", sum(counts)),
                         (f"first-stripe k steps of {step} rows", -(-k // step))):
        if listed > MAX_BATCH_EDGES:
            raise ValueError(
                f"a {m} x {n} x {k} {np.dtype(dtype).name} batch product on {g.rows} x {g.cols} "
                f"ranks has {listed:.3g} {what}; a batch plan lists at most {MAX_BATCH_EDGES}")
    edges = tuple(tuple(r0 + e for e in even_edges(r1 - r0, count))
                  for r0, r1, count in zip(g.row_edges, g.row_edges[1:], counts))
    panels = tuple(sorted(set(g.a_k_edges[0]) | set(g.b_k_edges[0])))
    first = tuple(sorted(set(panels) | set(range(0, k, step))))
    return BatchPlan(grid=g, stripe_edges=edges, panels=panels, held_bytes=tuple(held),
                     chunk_rows=chunk_rows, first_panels=first)
