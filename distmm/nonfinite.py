"""numpy's Inf and NaN in complex products that distmm sums from parts.

This module covers: ``numpys_nonfinite``, which gives a complex64 or complex128 block of C
the form numpy's matmul of the whole ``m x n x k`` product gives its elements that are not
finite. numpy's BLAS multiplies each element's sum by ``alpha = 1 + 0j`` (OpenBLAS's gemm
and gemv), so an Inf in one part makes the other NaN; numpy's own loop (k == 1) does not,
and BLAS's dot (a 1 x 1 product) makes only the real part NaN. A block summed from tiles or
panels of other shapes (a 1 x 1 tile, a tile or panel one wide in k) keeps an Inf numpy's
element does not have. A block whose parts were all multiplied by calls that spread as the
whole product's does (``parts``: one tile of the whole product, numpy's own result) has its
NaN parts in numpy's form already: only its sums of parts (an Inf from adding them) are
spread. Every engine's host result goes through it (``distmm.engine.tiles.finish_tile``, the
batch stripes of ``distmm.engine.mpi.stream``).
It does *not* cover: overflows of finite operands in a block summed from parts that spread
otherwise (a 1 x 1 tile, a k group one wide) or without ``parts``, nor sums that overflow
only in some orders (numpy's own BLAS blocking decides those), real dtypes (no alpha),
complex long double (numpy's own loop) or device arrays (cuBLAS's results are left as
cuBLAS gives them).
"""
from __future__ import annotations

import functools

import numpy as np

from distmm.fpflags import as_matmul

__all__ = ["numpys_nonfinite"]


def numpys_nonfinite(product, c, parts=()):
    """The block ``c`` of ``product``'s C (anything with the whole product's ``m``, ``n``
    and ``k``: a ``Plan``, a ``GridPlan``) with its complex64 or complex128 elements that
    are not finite as numpy's matmul of the whole product gives them: a part NaN where the
    other part is not finite, where numpy's call for a product of that shape does so
    (``_spreads``). Changed in place and returned; anything else (``None``, another dtype,
    a cupy array) is returned as it is. An element whose row of A or column of B holds an
    Inf or NaN has a non-finite part in any sum of panel products, so it comes out as
    numpy's whatever the panels were. ``parts``: the ``(rows, columns, k)`` of the numpy
    matmul calls whose results ``c`` sums, where the caller knows them; when every one
    spreads as the whole product's call does, a NaN part is numpy's own (``inf+nanj`` from
    a sum that overflowed in one part) and is kept: only a part beside an Inf is spread.
    A block whose sum is finite is left as it is (one pass over it); otherwise only the
    elements whose form differs from numpy's are computed again, as numpy's ``1 * x - 0 *
    y`` and ``1 * y + 0 * x``: an Inf times 0 there reports numpy's "invalid value
    encountered in matmul" (``distmm.fpflags.as_matmul``: into the caller's ``collect``
    where there is one)."""
    if (not isinstance(c, np.ndarray) or c.dtype not in (np.complex64, np.complex128)
            or not c.size or not product.k):
        return c
    char = c.dtype.char
    spreads = _spreads(char, product.m == 1, product.n == 1, product.k == 1)
    to_real, to_imag = spreads
    with np.errstate(all="ignore"):  # one pass, no report: a finite sum, a finite block
        if not (to_real or to_imag) or np.isfinite(c.sum()):
            return c
    # parts spread as numpy's call: their NaN parts are numpy's; otherwise a NaN beside an
    # Inf may be a k == 1 product's inf * 0, which numpy's alpha spreads to both parts
    spread = bool(parts) and all(_spreads(char, r == 1, s == 1, w == 1) == spreads
                                 for r, s, w in parts)
    beside = np.isinf if spread else lambda z: ~np.isfinite(z)
    x, y = c.real, c.imag
    differs = np.zeros(c.shape, dtype=bool)
    if to_real:
        differs |= ~np.isnan(x) & beside(y)
    if to_imag:
        differs |= ~np.isnan(y) & beside(x)
    if not differs.any():
        return c
    z = c[differs]
    x, y = z.real.copy(), z.imag.copy()
    with as_matmul():
        if to_real:
            z.real = x - 0 * y
        if to_imag:
            z.imag = y + 0 * x
    c[differs] = z
    return c


@functools.lru_cache(maxsize=None)
def _spreads(char: str, one_row: bool, one_col: bool, one_k: bool) -> tuple[bool, bool]:
    """Whether numpy's matmul of a complex product of this kind (``m == 1``, ``n == 1``,
    ``k == 1``) makes an element's real part NaN where its imaginary part is not finite, and
    its imaginary part NaN where its real part is not: asked of numpy once, with an element
    whose sum is ``inf + infj`` (numpy's own loop, for k == 1, does neither; OpenBLAS's gemm
    and gemv do both, its dot the real part only)."""
    m, n, k = (1 if one else 2 for one in (one_row, one_col, one_k))
    a, b = np.ones((m, k), dtype=char), np.ones((k, n), dtype=char)
    a[0, 0], b[0, 0] = np.inf, 1 + 1j  # (inf + 0j) * (1 + 1j): inf + infj, no NaN on its way
    with np.errstate(all="ignore"):
        z = np.matmul(a, b)[0, 0]
    return bool(np.isnan(z.real)), bool(np.isnan(z.imag))
