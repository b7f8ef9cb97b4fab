"""Process-grid planning for the MPI engine: pure functions and frozen dataclasses.

This module covers: choosing the process grid ``layers x rows x cols`` for P
ranks (``layers > 1`` splits k, as 2.5D/3D algorithms do), the block layouts of
A, B and C on that grid with ragged edges (``BlockLayout``, a descriptor of the
same size as ScaLAPACK's: edges and one owner per block), the SUMMA panels of
each layer, the fixed reduction tree over the layers, and the bytes each rank
is estimated to receive.

It does *not* cover: running anything or talking to MPI (``distmm.engine.mpi``),
or the tiles inside one rank's local product (``distmm.plan``). It imports
numpy and ``distmm.plan`` only.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

import numpy as np

from distmm.plan import MAX_WORKERS, Plan, accumulate_dtype, reduction_tree, sums_whole_k

__all__ = ["BlockLayout", "GridPlan", "make_grid", "grid_for_plan", "even_edges", "widen_panels",
           "gpu_panels", "grid_shapes", "GPU_MIN_PANEL",
           "DEFAULT_RANK_FLOPS", "DEFAULT_LINK_BYTES"]

#: flop rate of one rank the grid choice assumes (only the ratio to the link matters)
DEFAULT_RANK_FLOPS = 40e9
#: bytes per second one rank receives over its link
DEFAULT_LINK_BYTES = 4e9
#: SUMMA panels per layer the planner aims for (each at least MIN_PANEL wide)
PANELS_PER_LAYER = 4
MIN_PANEL = 256
#: narrowest SUMMA panel for in-core GPU blocks: a rank-4096 update runs near cuBLAS's peak
GPU_MIN_PANEL = 4096


def even_edges(length: int, parts: int) -> tuple[int, ...]:
    """Edges of ``parts`` blocks of ``length`` whose sizes differ by at most one
    (the larger ones first), as mpi4py-fft's ``_blockdist`` splits an axis.

    >>> even_edges(10, 3)
    (0, 4, 7, 10)
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    q, r = divmod(int(length), parts)
    edges = [0]
    for p in range(parts):
        edges.append(edges[-1] + q + (p < r))
    return tuple(edges)


def _ints(values, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints; TypeError naming ``what`` for anything that is
    not a sequence of integers (a float, a bool)."""
    try:
        items = tuple(values)
        if any(isinstance(v, (bool, np.bool_)) for v in items):
            raise TypeError
        return tuple(operator.index(v) for v in items)
    except TypeError:
        raise TypeError(f"a BlockLayout's {what} must be integers, got {values!r}") from None


@dataclass(frozen=True)
class BlockLayout:
    """Where the blocks of a 2-D matrix live: one block per owning rank.

    ``owners[bi][bj]`` is the rank holding rows ``row_edges[bi]:row_edges[bi+1]``
    and columns ``col_edges[bj]:col_edges[bj+1]``. A rank owns at most one
    block; ranks that own none hold an empty local block.
    """

    shape: tuple[int, int]
    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    owners: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        # whole numbers, kept as Python ints: a float edge failed on the ranks whose blocks
        # it bounds, the others waiting for them in the exchange; numpy ints or arrays
        # compared and hashed unlike the same layout of ints
        shape = _ints(self.shape, "shape")
        if len(shape) != 2:
            raise ValueError(f"a BlockLayout's shape has two sizes, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "row_edges", _ints(self.row_edges, "row edges"))
        object.__setattr__(self, "col_edges", _ints(self.col_edges, "column edges"))
        try:
            owners = tuple(tuple(row) for row in self.owners)
        except TypeError:
            raise TypeError(f"a BlockLayout's owners are rows of ranks, got "
                            f"{self.owners!r}") from None
        object.__setattr__(self, "owners", tuple(_ints(row, "owners") for row in owners))
        if len(self.row_edges) < 2 or self.row_edges[0] != 0 or \
                self.row_edges[-1] != self.shape[0]:
            raise ValueError(f"row edges {self.row_edges} do not cover {self.shape[0]} rows")
        if len(self.col_edges) < 2 or self.col_edges[0] != 0 or \
                self.col_edges[-1] != self.shape[1]:
            raise ValueError(f"column edges {self.col_edges} do not cover {self.shape[1]} columns")
        # a block whose end comes before its start has a negative size: the rank owning it
        # would fail alone, the others waiting for it in their next collective
        for what, edges in (("row", self.row_edges), ("column", self.col_edges)):
            if any(e1 < e0 for e0, e1 in zip(edges, edges[1:])):
                raise ValueError(f"{what} edges {edges} decrease: each must be at least the "
                                 f"one before it")
        flat = [r for row in self.owners for r in row]
        if len(flat) != len(set(flat)):
            raise ValueError("a rank may own at most one block")

    @property
    def blocks(self) -> tuple[int, int]:
        return len(self.row_edges) - 1, len(self.col_edges) - 1

    def block_of(self, rank: int) -> tuple[int, int] | None:
        """The block index ``(bi, bj)`` that ``rank`` owns, or None."""
        for bi, row in enumerate(self.owners):
            for bj, r in enumerate(row):
                if r == rank:
                    return bi, bj
        return None

    def bounds(self, bi: int, bj: int) -> tuple[int, int, int, int]:
        """``(r0, r1, c0, c1)`` of block ``(bi, bj)``."""
        return (self.row_edges[bi], self.row_edges[bi + 1],
                self.col_edges[bj], self.col_edges[bj + 1])

    def local_bounds(self, rank: int) -> tuple[int, int, int, int]:
        """Bounds of ``rank``'s block; an empty ``(0, 0, 0, 0)`` when it owns none."""
        b = self.block_of(rank)
        return self.bounds(*b) if b is not None else (0, 0, 0, 0)

    def local_shape(self, rank: int) -> tuple[int, int]:
        r0, r1, c0, c1 = self.local_bounds(rank)
        return r1 - r0, c1 - c0

    @classmethod
    def single(cls, shape, rank: int = 0) -> "BlockLayout":
        """The whole matrix on one rank."""
        return cls(tuple(shape), (0, shape[0]), (0, shape[1]), ((rank,),))

    @classmethod
    def grid(cls, shape, rows: int, cols: int) -> "BlockLayout":
        """Even blocks on a ``rows x cols`` grid of ranks numbered row-major."""
        return cls(tuple(shape), even_edges(shape[0], rows), even_edges(shape[1], cols),
                   tuple(tuple(i * cols + j for j in range(cols)) for i in range(rows)))


@dataclass(frozen=True)
class GridPlan:
    """A SUMMA plan for ``C[m, n] = A[m, k] @ B[k, n]`` on ``layers x rows x cols`` ranks.

    Rank ``r`` sits at ``(layer, i, j)`` with ``r = (layer * rows + i) * cols + j``.
    Layer ``l`` multiplies the k range ``layer_edges[l]:layer_edges[l+1]``; inside
    it A is split into ``rows x cols`` blocks (its k range cut by ``a_k_edges[l]``)
    and B into ``rows x cols`` blocks (cut by ``b_k_edges[l]``). Panels of A go
    along process rows, panels of B along process columns. With more than one
    layer, the layers' C blocks are summed onto layer 0 along ``reduction``
    (fixed, so the bits do not depend on timing).
    """

    m: int
    n: int
    k: int
    dtype: str
    acc_dtype: str
    ranks: int
    layers: int
    rows: int
    cols: int
    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    layer_edges: tuple[int, ...]
    a_k_edges: tuple[tuple[int, ...], ...]
    b_k_edges: tuple[tuple[int, ...], ...]
    panel_edges: tuple[tuple[int, ...], ...]
    reduction: tuple[tuple[int, int], ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.layers, self.rows, self.cols

    @property
    def itemsize(self) -> int:
        return np.dtype(self.acc_dtype).itemsize

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(layer, i, j)`` of ``rank``."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} outside 0..{self.ranks - 1}")
        layer, rest = divmod(rank, self.rows * self.cols)
        i, j = divmod(rest, self.cols)
        return layer, i, j

    def rank_at(self, layer: int, i: int, j: int) -> int:
        return (layer * self.rows + i) * self.cols + j

    # -- layouts ------------------------------------------------------------
    @property
    def a_layout(self) -> BlockLayout:
        cols = [0]
        owners = [[0] * (self.layers * self.cols) for _ in range(self.rows)]
        for layer in range(self.layers):
            cols.extend(self.a_k_edges[layer][1:])
            for i in range(self.rows):
                for j in range(self.cols):
                    owners[i][layer * self.cols + j] = self.rank_at(layer, i, j)
        return BlockLayout((self.m, self.k), self.row_edges, tuple(cols),
                           tuple(tuple(r) for r in owners))

    @property
    def b_layout(self) -> BlockLayout:
        rows = [0]
        owners = []
        for layer in range(self.layers):
            rows.extend(self.b_k_edges[layer][1:])
            for i in range(self.rows):
                owners.append(tuple(self.rank_at(layer, i, j) for j in range(self.cols)))
        return BlockLayout((self.k, self.n), tuple(rows), self.col_edges, tuple(owners))

    @property
    def c_layout(self) -> BlockLayout:
        """C on layer 0: block ``(i, j)`` on rank ``(0, i, j)``."""
        return BlockLayout((self.m, self.n), self.row_edges, self.col_edges,
                           tuple(tuple(self.rank_at(0, i, j) for j in range(self.cols))
                                 for i in range(self.rows)))

    # -- estimates ------------------------------------------------------------
    def bytes_received(self, rank: int, *, whole_k: bool = False) -> int:
        """Bytes ``rank`` receives (panels it does not own, and layer partials
        it sums), in the accumulation dtype: the estimate the benchmark checks
        against what the engine counts. ``whole_k``: a product that keeps k whole
        (``distmm.plan.sums_whole_k`` on the host), whose other layers send layer 0
        their panels of A's rows and B's columns instead of C partials."""
        layer, i, j = self.coords(rank)
        size = self.itemsize
        mi = self.row_edges[i + 1] - self.row_edges[i]
        nj = self.col_edges[j + 1] - self.col_edges[j]
        kl = self.layer_edges[layer + 1] - self.layer_edges[layer]
        own_a = self.a_k_edges[layer][j + 1] - self.a_k_edges[layer][j]
        own_b = self.b_k_edges[layer][i + 1] - self.b_k_edges[layer][i]
        total = (mi * (kl - own_a) + (kl - own_b) * nj) * size
        if whole_k:
            if layer == 0:
                total += (mi + nj) * (self.k - kl) * size
        else:
            total += sum(1 for dst, _ in self.reduction if dst == layer) * mi * nj * size
        return total

    def slowest_seconds(self, rank_flops: float, link_bytes: float) -> float:
        """The slowest rank's ``flops / rank_flops + bytes_received / link_bytes``: the
        maximum over every rank, taken over one rank of each kind. A rank's time depends on
        its row's and column's sizes and the parts of its layer's k it owns, and on its
        layer's length and partial sums; the even splits give few kinds of each, and layers
        alike in length and sums alike in their rows and columns."""
        sums: dict[int, int] = {}
        for dst, _ in self.reduction:
            sums[dst] = sums.get(dst, 0) + 1
        slowest, seen = 0.0, set()
        for layer in range(self.layers):
            kind = (self.layer_edges[layer + 1] - self.layer_edges[layer], sums.get(layer, 0))
            if kind in seen:
                continue
            seen.add(kind)
            a_k, b_k = self.a_k_edges[layer], self.b_k_edges[layer]
            rows = {(self.row_edges[i + 1] - self.row_edges[i], b_k[i + 1] - b_k[i]): i
                    for i in range(self.rows)}
            cols = {(self.col_edges[j + 1] - self.col_edges[j], a_k[j + 1] - a_k[j]): j
                    for j in range(self.cols)}
            for i in rows.values():
                for j in cols.values():
                    rank = self.rank_at(layer, i, j)
                    slowest = max(slowest, self.flops(rank) / rank_flops
                                  + self.bytes_received(rank) / link_bytes)
        return slowest

    @property
    def bytes_per_rank(self) -> tuple[int, ...]:
        return tuple(self.bytes_received(r) for r in range(self.ranks))

    def flops(self, rank: int) -> int:
        layer, i, j = self.coords(rank)
        return 2 * ((self.row_edges[i + 1] - self.row_edges[i])
                    * (self.col_edges[j + 1] - self.col_edges[j])
                    * (self.layer_edges[layer + 1] - self.layer_edges[layer]))

    def describe(self) -> str:
        per = self.bytes_per_rank
        return (f"process grid {self.layers} x {self.rows} x {self.cols} (layers x rows x cols) "
                f"for {self.ranks} rank{'s' if self.ranks != 1 else ''}; panels per layer "
                f"{[len(p) - 1 for p in self.panel_edges]}; bytes received per rank "
                f"max {max(per):.3e}, total {sum(per):.3e}")


def _panels(k0: int, k1: int, cuts, width: int) -> tuple[int, ...]:
    """Panel edges over ``k0:k1``: every owner cut, then pieces of at most ``width``."""
    bounds = sorted(set([k0, k1] + [c for c in cuts if k0 <= c <= k1]))
    edges = [k0]
    for lo, hi in zip(bounds, bounds[1:]):
        pieces = max(1, math.ceil((hi - lo) / width))
        edges.extend(lo + e for e in even_edges(hi - lo, pieces)[1:])
    return tuple(edges)


def _build(m, n, k, res, acc, layers, rows, cols) -> GridPlan:
    layer_edges = even_edges(k, layers)
    a_k, b_k, panels = [], [], []
    for layer in range(layers):
        k0, k1 = layer_edges[layer], layer_edges[layer + 1]
        ae = tuple(k0 + e for e in even_edges(k1 - k0, cols))
        be = tuple(k0 + e for e in even_edges(k1 - k0, rows))
        width = max(MIN_PANEL, math.ceil((k1 - k0) / PANELS_PER_LAYER))
        a_k.append(ae)
        b_k.append(be)
        panels.append(_panels(k0, k1, ae + be, width) if k1 > k0 else (k0,))
    return GridPlan(m=m, n=n, k=k, dtype=res.name, acc_dtype=acc.name, ranks=layers * rows * cols,
                    layers=layers, rows=rows, cols=cols, row_edges=even_edges(m, rows),
                    col_edges=even_edges(n, cols), layer_edges=layer_edges,
                    a_k_edges=tuple(a_k), b_k_edges=tuple(b_k), panel_edges=tuple(panels),
                    reduction=reduction_tree(layers))


def grid_shapes(ranks: int):
    """Every ``(layers, rows, cols)`` with product ``ranks``: no k-split first,
    then square-ish grids before long ones (the order breaks ties)."""
    out = [(layers, rows, ranks // layers // rows) for layers in _divisors(ranks)
           for rows in _divisors(ranks // layers)]
    return sorted(out, key=lambda g: (g[0] > 1, abs(math.log(g[1] / g[2])), g[0], g[1]))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division up to its square root)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def make_grid(m: int, n: int, k: int, dtype="float64", *, ranks: int,
              grid: tuple[int, int, int] | None = None,
              rank_flops: float = DEFAULT_RANK_FLOPS,
              link_bytes: float = DEFAULT_LINK_BYTES, k_split: bool = True) -> GridPlan:
    """Choose the process grid for ``ranks`` ranks and plan SUMMA on it.

    Every factorisation ``layers * rows * cols == ranks`` is scored by the
    slowest rank's time: its flops at ``rank_flops`` plus the bytes it
    receives at ``link_bytes``; the lowest wins, ties going to no k-split and
    square-ish grids. Tall-skinny products get a ``ranks x 1`` or ``1 x ranks``
    grid (nothing of the long operand moves), long-k products split k.

    Parameters
    ----------
    m, n, k : int
        The problem; zero is allowed.
    dtype : dtype
        numpy's result dtype.
    ranks : int
        Number of MPI ranks.
    grid : (layers, rows, cols), optional
        Force a grid (its product must be ``ranks``).
    k_split : bool
        Whether grids with more than one layer are considered (a batch job that writes C
        from every rank takes ``False``: each rank then owns a block of C). A float16 or
        object result never splits k unless ``grid`` forces it: numpy sums each of its
        elements over all of k at once, which layers' partial sums would not reproduce
        (``distmm.plan.sums_whole_k``).

    Raises
    ------
    ValueError
        Negative sizes, ``ranks`` outside 1 to ``MAX_WORKERS``, or a forced grid of the wrong
        size.

    Examples
    --------
    >>> make_grid(4096, 4096, 4096, ranks=4).shape
    (1, 2, 2)
    >>> make_grid(100000, 50, 50, ranks=4).shape
    (1, 4, 1)
    >>> make_grid(64, 64, 10**6, ranks=4).shape
    (4, 1, 1)
    """
    for name, v in (("m", m), ("n", n), ("k", k)):
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if int(ranks) != ranks or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    if ranks > MAX_WORKERS:
        raise ValueError(f"ranks must be at most {MAX_WORKERS}, got {ranks}")
    m, n, k, ranks = int(m), int(n), int(k), int(ranks)
    res = np.dtype(dtype)
    acc = accumulate_dtype(res)
    if grid is not None:
        if len(grid) != 3 or math.prod(grid) != ranks or min(grid) < 1:
            raise ValueError(f"grid {tuple(grid)} must be 3 positive counts whose product is {ranks}")
        return _build(m, n, k, res, acc, *map(int, grid))
    k_split = k_split and not sums_whole_k(res)
    best, best_time = None, math.inf
    for layers, rows, cols in grid_shapes(ranks):
        if layers > 1 and not k_split:
            continue
        plan = _build(m, n, k, res, acc, layers, rows, cols)
        time = plan.slowest_seconds(rank_flops, link_bytes)
        if time < best_time * (1 - 1e-9):
            best, best_time = plan, time
    return best


def widen_panels(grid: GridPlan, min_width: int) -> GridPlan:
    """``grid`` with SUMMA panels at least ``min_width`` wide (or a layer's k over
    ``PANELS_PER_LAYER``, when wider), still cut at every owner's edge; layouts,
    grid and bytes moved stay the same.

    >>> g = make_grid(16384, 16384, 8192, ranks=2)
    >>> [len(p) - 1 for p in widen_panels(g, 4096).panel_edges]
    [2]
    """
    panels = []
    for layer in range(grid.layers):
        k0, k1 = grid.layer_edges[layer], grid.layer_edges[layer + 1]
        width = max(int(min_width), MIN_PANEL, math.ceil((k1 - k0) / PANELS_PER_LAYER))
        cuts = grid.a_k_edges[layer] + grid.b_k_edges[layer]
        panels.append(_panels(k0, k1, cuts, width) if k1 > k0 else (k0,))
    panels = tuple(panels)
    if panels == grid.panel_edges:
        return grid
    return dataclasses.replace(grid, panel_edges=panels)


def gpu_panels(grid: GridPlan, *, across_hosts: bool = False) -> GridPlan:
    """The SUMMA panels of in-core GPU blocks.

    Within one host: ``widen_panels(grid, GPU_MIN_PANEL)``, few wide panels, each
    rank-k update near cuBLAS's rate. Across hosts (a network between some ranks):
    panels ``GPU_MIN_PANEL`` wide (still cut at every owner's edge), because nothing
    hides the first panel's broadcast and over a network that broadcast is long; the
    later ones move while the earlier panels multiply. Layouts, grid and bytes moved
    stay the same.

    >>> g = make_grid(65536, 65536, 65536, ranks=4)
    >>> [len(p) - 1 for p in gpu_panels(g).panel_edges]
    [4]
    >>> [len(p) - 1 for p in gpu_panels(g, across_hosts=True).panel_edges]
    [16]
    """
    if not across_hosts:
        return widen_panels(grid, GPU_MIN_PANEL)
    panels = []
    for layer in range(grid.layers):
        k0, k1 = grid.layer_edges[layer], grid.layer_edges[layer + 1]
        cuts = grid.a_k_edges[layer] + grid.b_k_edges[layer]
        panels.append(_panels(k0, k1, cuts, max(GPU_MIN_PANEL, MIN_PANEL)) if k1 > k0
                      else (k0,))
    panels = tuple(panels)
    if panels == grid.panel_edges:
        return grid
    return dataclasses.replace(grid, panel_edges=panels)


def grid_for_plan(plan: Plan, ranks: int, grid=None) -> GridPlan:
    """The process grid for a ``Plan`` made by ``distmm.api`` (same m, n, k and dtype)."""
    return make_grid(plan.m, plan.n, plan.k, plan.dtype, ranks=ranks, grid=grid)
