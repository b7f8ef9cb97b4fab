"""Tile work every engine shares: the per-tile task body and the reduction.

This module covers: computing one (k group of one) C tile through an executor,
summing a tile's partials along the plan's fixed tree, and the final cast to
numpy's result dtype. Engines decide only *where* these run.
It does *not* cover: choosing tiles (``distmm.plan``) or device kernels
(``distmm.executor``).
"""
from __future__ import annotations

from typing import Any, Sequence

from distmm.fpflags import as_matmul
from distmm.plan import Plan, np_dtype

__all__ = ["tile_partial", "reduce_partials", "finish_tile"]


def tile_partial(executor, plan: Plan, a_panel: Any, b_panel: Any) -> Any:
    """Return ``a_panel @ b_panel`` in the plan's accumulation dtype.

    ``a_panel`` is the A row panel of one C tile over one k group and
    ``b_panel`` the matching B column panel; both may be views of any dtype
    and layout.
    """
    acc = np_dtype(plan.acc_dtype)
    a_dev = executor.asarray(a_panel, acc)
    b_dev = executor.asarray(b_panel, acc)
    return executor.panel_product(a_dev, b_dev, plan.tile[2])


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


def finish_tile(plan: Plan, acc_tile: Any) -> Any:
    """Cast an accumulated tile to numpy's result dtype: booleans become
    ``count > 0``, integers wrap, float32 sums round to float16."""
    res = np_dtype(plan.dtype)
    if res.kind == "b":
        return acc_tile != 0
    if acc_tile.dtype == res:
        return acc_tile
    if res.kind != "f":
        return acc_tile.astype(res)
    with as_matmul():  # float16's rounding overflows or underflows in numpy's matmul too
        return acc_tile.astype(res)
