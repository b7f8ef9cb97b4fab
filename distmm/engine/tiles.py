"""Tile work every engine shares: the per-tile task body and the reduction.

This module covers: computing one (k group of one) C tile through an executor,
summing a tile's partials along the plan's fixed tree (all at once, or as they
arrive in k order: ``PartialSum``), and the final cast to numpy's result dtype (with a
complex tile's Inf and NaN in the form numpy's matmul of the whole product gives them:
``distmm.nonfinite``).
Engines decide only *where* these run.
It does *not* cover: choosing tiles (``distmm.plan``) or device kernels
(``distmm.executor``).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from distmm.fpflags import as_matmul, object_rows
from distmm.nonfinite import as_whole_call, numpys_nonfinite, part_shape
from distmm.plan import Plan, np_dtype

__all__ = ["tile_partial", "reduce_partials", "PartialSum", "finish_tile"]


def tile_partial(executor, plan: Plan, a_panel: Any, b_panel: Any,
                 at: tuple | None = None) -> Any:
    """Return ``a_panel @ b_panel`` in the plan's accumulation dtype.

    ``a_panel`` is the A row panel of one C tile over one k group and
    ``b_panel`` the matching B column panel; both may be views of any dtype
    and layout. ``at``: where the tile starts in C (``(*batch, row, column)``) when the
    panels hold all of k: an object tile's elements then keep their reports for the
    caller, in numpy's order (``distmm.fpflags.object_rows``, inside ``collect``).
    A ``Plan``'s complex host product of panels one wide in k (a k group of a product of
    more) has its elements that are not finite in the form of the tile's other k groups'
    calls (``distmm.nonfinite.as_whole_call``), as ``finish_tile``'s default ``parts`` tell
    (a Dask task's plan is left as numpy's loop gave it: its engine passes its pieces'
    calls as they were).
    """
    acc = np_dtype(plan.acc_dtype)
    a_dev = executor.asarray(a_panel, acc)
    b_dev = executor.asarray(b_panel, acc)
    if at is not None and acc == object and a_dev.ndim == 2:
        return object_rows(lambda x, y: executor.panel_product(x, y, plan.tile[2]), a_dev,
                           b_dev, at)
    part = executor.panel_product(a_dev, b_dev, plan.tile[2])
    if a_dev.shape[-1] == 1 and isinstance(plan, Plan):  # numpy's loop (k == 1): no alpha
        part = as_whole_call(plan, part)
    if (plan.dtype == "float16" and plan.precision == "highest" and isinstance(part, np.ndarray)
            and part.dtype != np.float16):
        _half_nans(part, a_dev, b_dev)
    return part


def _half_nans(part, a, b) -> None:
    """The NaNs of a float16 product's float32 sums (distmm's kernels: the panels hold
    all of k) given numpy's half loop's bits: which NaN an element ends with (its sign and
    payload) follows the order of that loop's operations, which the kernels do not keep.
    Only the NaN elements are computed again by numpy's own loop, at its speed: one by one
    (a stack of row @ column products), or where they are dense, the block of their rows
    and columns (a product that is NaN throughout takes numpy's time)."""
    nan = np.isnan(part)
    i, j = np.nonzero(nan)
    if not i.size:
        return
    rows, cols = np.flatnonzero(nan.any(1)), np.flatnonzero(nan.any(0))
    with np.errstate(all="ignore"):  # the flags were reported with the product
        if i.size * 8 > rows.size * cols.size:
            sub = np.ix_(rows, cols)
            again = np.matmul(a[rows].astype(np.float16), b[:, cols].astype(np.float16))
            part[sub] = np.where(nan[sub], again.astype(part.dtype), part[sub])
            return
        step = max(1, (32 << 20) // max(4 * a.shape[1], 1))  # 32 MiB of rows and columns
        for s in range(0, i.size, step):
            r, c = i[s:s + step], j[s:s + step]
            again = np.matmul(a[r].astype(np.float16)[:, None, :],
                              b[:, c].T.astype(np.float16)[:, :, None])
            part[r, c] = again[:, 0, 0]


def reduce_partials(plan: Plan, partials: Sequence[Any]) -> Any:
    """Sum a tile's partial products (one per k group) along the plan's tree.

    The order is fixed by ``plan.reduction``, so the bits do not depend on
    which partial finished first. The inputs are not modified.
    """
    if len(partials) != plan.k_splits:
        raise ValueError(f"expected {plan.k_splits} partials, got {len(partials)}")
    work = list(partials)
    with as_matmul():  # inf - inf or an overflow here is the product's, as in numpy's loop
        for dst, src in plan.reduction:
            work[dst] = work[dst] + work[src]
    return work[0]


class PartialSum:
    """A tile's partials summed along the plan's fixed tree as they arrive, in k order:
    ``reduce_partials``'s additions in its order (the same bits), holding at most
    ``log2(k_splits) + 1`` partials instead of all ``k_splits``.

    The tree adds aligned blocks of equal size (stride 1, 2, 4, ...); a block is summed as
    soon as its last partial arrives, so what is held is one sum per set bit of the count
    so far. The blocks left at the end (a count that is not a power of two) are added from
    the last one back, as the tree adds a ragged tail to the block before it.
    """

    def __init__(self, plan: Plan):
        self.count = plan.k_splits
        self.seen = 0
        self._blocks: list[list] = []  # [partials summed, sum], sizes decreasing

    @property
    def held(self) -> int:
        """Partials (or sums of them) held now."""
        return len(self._blocks)

    def add(self, part: Any) -> None:
        """The next partial (k group ``seen``); not modified."""
        self.seen += 1
        blocks = self._blocks
        blocks.append([1, part])
        with as_matmul():  # as in reduce_partials: the product's own flags
            while len(blocks) > 1 and blocks[-2][0] == blocks[-1][0]:
                size, upper = blocks.pop()
                blocks[-1] = [2 * size, blocks[-1][1] + upper]

    def result(self) -> Any:
        """The tile's sum, once every partial has been added."""
        if self.seen != self.count:
            raise ValueError(f"expected {self.count} partials, got {self.seen}")
        blocks = self._blocks
        with as_matmul():
            while len(blocks) > 1:
                _, upper = blocks.pop()
                blocks[-1][1] = blocks[-1][1] + upper
        return blocks[0][1]


def finish_tile(plan: Plan, acc_tile: Any, parts: tuple | None = None) -> Any:
    """Cast an accumulated tile to numpy's result dtype: booleans become
    ``count > 0``, integers wrap, float32 sums round to float16; a complex host tile's
    elements that are not finite take the form numpy's matmul of the whole ``plan.m x
    plan.n x plan.k`` product gives them (``distmm.nonfinite.numpys_nonfinite``, in place).
    ``parts``: the ``(rows, columns, k)`` of the products the tile sums; by default, with
    a ``Plan``, one per k group of a 2-D tile (``tile_partial``), otherwise unknown."""
    res = np_dtype(plan.dtype)
    if res.kind == "b":
        return acc_tile != 0
    if parts is None:
        parts = _parts(plan, acc_tile)
    if acc_tile.dtype == res:
        return numpys_nonfinite(plan, acc_tile, parts)
    if res.kind != "f":
        return numpys_nonfinite(plan, acc_tile.astype(res), parts)
    with as_matmul():  # float16's rounding overflows or underflows in numpy's matmul too
        return acc_tile.astype(res)


def _parts(plan, acc_tile) -> tuple:
    """The ``(rows, columns, k)`` of the products a ``Plan``'s 2-D tile sums: one per k
    group (``tile_partial``: a group one wide in the form of the others'); none by default
    for other plans (the Dask and MPI engines pass their blocks' own: pieces of the
    operands' chunks, SUMMA's panels)."""
    if not isinstance(plan, Plan) or getattr(acc_tile, "ndim", 0) != 2:
        return ()
    rows, cols = acc_tile.shape
    return tuple(part_shape(plan, rows, cols, plan.k_edges[s + 1] - plan.k_edges[s])
                 for s in range(len(plan.k_edges) - 1))
