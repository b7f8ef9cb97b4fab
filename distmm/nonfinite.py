"""numpy's Inf and NaN in complex products that distmm sums from parts.

This module covers: ``numpys_nonfinite``, which gives a complex64 or complex128 block of C
the form numpy's matmul of the whole ``m x n x k`` product gives its elements that are not
finite. numpy's BLAS multiplies each element's sum by ``alpha = 1 + 0j`` (OpenBLAS's gemm
and gemv), so an Inf in one part makes the other NaN; numpy's own loop (k == 1) does not,
and BLAS's dot (a 1 x 1 product) makes only the real part NaN. A block summed from tiles or
panels of other shapes (a 1 x 1 tile, a tile or panel one wide in k) keeps an Inf numpy's
element does not have. ``as_whole_call`` gives the product of a part one wide in k (numpy's
own loop: no alpha) the form numpy's call of its rows and columns over more of k gives, the
form of the block's other parts, where that is the whole product's call's form; such a part
is told to ``numpys_nonfinite`` as a call over all of k (``part_shape``). A block whose
parts were all multiplied by calls that spread as the whole product's does (``parts``: one
tile of the whole product, numpy's own result, tiles and panels of more than one row and
column) has its NaN parts in numpy's form already: only its sums of parts (an Inf from
adding them) are spread. Every engine's host result goes through it
(``distmm.engine.tiles.finish_tile``, the batch stripes of ``distmm.engine.mpi.stream``).
It does *not* cover: overflows of finite operands in a block summed from parts that spread
otherwise (a 1 x 1 tile of a larger product) or without ``parts``, nor sums that overflow
only in some orders (numpy's own BLAS blocking decides those), real dtypes (no alpha),
complex long double (numpy's own loop) or device arrays (cuBLAS's results are left as
cuBLAS gives them).
"""
from __future__ import annotations

import functools

import numpy as np

from distmm.fpflags import as_matmul

__all__ = ["numpys_nonfinite", "as_whole_call", "part_shape"]


def numpys_nonfinite(product, c, parts=()):
    """The block ``c`` of ``product``'s C (anything with the whole product's ``m``, ``n``
    and ``k``: a ``Plan``, a ``GridPlan``) with its complex64 or complex128 elements that
    are not finite as numpy's matmul of the whole product gives them: a part NaN where the
    other part is not finite, where numpy's call for a product of that shape does so
    (``_spreads``). Changed in place and returned; anything else (``None``, another dtype,
    a cupy array) is returned as it is. An element whose row of A or column of B holds an
    Inf or NaN has a non-finite part in any sum of panel products, so it comes out as
    numpy's whatever the panels were. ``parts``: the ``(rows, columns, k)`` of the numpy
    matmul calls whose results ``c`` sums, where the caller knows them (``part_shape``: a
    call one wide in k whose result ``as_whole_call`` gave its form counts as a call over
    all of k); when every one spreads as the whole product's call does, a NaN part is
    numpy's own (``inf+nanj`` from a sum that overflowed in one part) and is kept: only a
    part beside an Inf is spread.
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
    _alpha(c, differs, to_real, to_imag)
    return c


def as_whole_call(product, part):
    """``part``, the complex64 or complex128 host result of one numpy matmul call one wide
    in k that a block of ``product``'s C sums (a k group, a SUMMA panel or a k piece of a
    product whose ``k`` is more than 1), with its elements that are not finite in the form
    numpy's call of the same rows and columns over more of k gives them, where that is the
    form of numpy's call for the whole product (a block of more than one row and column in
    a product of more, a row of a row, a 1 x 1 block of a 1 x 1 product): numpy's own loop
    (``k == 1``) leaves a sum as it is, where BLAS's alpha makes a part NaN beside the
    other's Inf or NaN (``_spreads``; gemm and gemv both parts, dot the real part). The
    block's parts then spread alike, as the whole product's call does: told so
    (``part_shape``), ``numpys_nonfinite`` keeps an ``inf+nanj`` numpy's whole call gives
    from a sum that overflowed in one part, not taking it for a one-wide part's ``inf *
    0``. A 1 x 1 block of a larger product (BLAS's dot, not the whole call's gemm or gemv)
    is left as numpy's loop gave it, as ``numpys_nonfinite`` then needs. Changed in place
    and returned; anything else (another dtype, a cupy array, a product whose ``k`` is 1:
    numpy's own loop there too) is returned as it is. An Inf times 0 reports "invalid value
    encountered in matmul" as numpy's alpha does (into the caller's ``collect`` where there
    is one)."""
    if (not isinstance(part, np.ndarray) or part.dtype not in (np.complex64, np.complex128)
            or not part.size or product.k <= 1):
        return part
    rows, cols = part.shape[-2:]
    char = part.dtype.char
    to_real, to_imag = _spreads(char, rows == 1, cols == 1, False)
    if (to_real, to_imag) != _spreads(char, product.m == 1, product.n == 1, False):
        return part  # a block that spreads otherwise (a 1 x 1 one of a larger product)
    with np.errstate(all="ignore"):  # one pass, no report: a finite sum, a finite part
        if not (to_real or to_imag) or np.isfinite(part.sum()):
            return part
    x, y = part.real, part.imag
    differs = np.zeros(part.shape, dtype=bool)
    if to_real:
        differs |= ~np.isnan(x) & ~np.isfinite(y)
    if to_imag:
        differs |= ~np.isnan(y) & ~np.isfinite(x)
    if differs.any():
        _alpha(part, differs, to_real, to_imag)
    return part


def part_shape(product, rows: int, cols: int, k: int) -> tuple[int, int, int]:
    """The ``(rows, columns, k)`` that ``numpys_nonfinite``'s ``parts`` takes for a numpy
    matmul call of ``rows x cols x k`` in a block of ``product``'s C whose result, where one
    wide in k, went through ``as_whole_call``: such a part spreads as a call over all of
    ``product.k`` (or, where ``as_whole_call`` left it, spreads otherwise than the whole
    product's call, as a k == 1 call does too); any other call as it is."""
    return (rows, cols, product.k if k == 1 else k)


def _alpha(c, where, to_real: bool, to_imag: bool) -> None:
    """The elements of ``c`` at ``where`` multiplied by BLAS's ``alpha = 1 + 0j`` as numpy's
    BLAS does, in the parts ``to_real``/``to_imag`` says: ``1 * x - 0 * y`` and ``1 * y + 0 *
    x`` (an Inf times 0 reports numpy's "invalid value encountered in matmul",
    ``distmm.fpflags.as_matmul``). In place."""
    z = c[where]
    x, y = z.real.copy(), z.imag.copy()
    with as_matmul():
        if to_real:
            z.real = x - 0 * y
        if to_imag:
            z.imag = y + 0 * x
    c[where] = z


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
