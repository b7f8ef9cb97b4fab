"""Complex products whose finite terms overflow in one part give numpy's Inf and NaN and
numpy's floating-point warnings on the local engine.

numpy's BLAS multiplies each element's sum by ``alpha = 1 + 0j``: a sum ``inf + xj`` (x
finite) comes out ``inf+nanj`` with one "invalid value encountered in matmul". A tile that
is numpy's own call (one tile, a stack's elements) or that sums calls of the same kind
(tiles and k groups of more than one row, column and k) holds that form already, which
``distmm.nonfinite.numpys_nonfinite`` keeps: spread again it is ``nan+nanj``, with
"invalid" reported a second time on the one-tile path.
The operands make every term of the overflowing elements overflow by itself, so numpy's
result does not depend on its BLAS's order of the sum.
Covers: one tile, tiles along m and n, k split in groups, a stack, complex64 and
complex128, both parts; ``numpys_nonfinite`` with and without its ``parts``.
It does *not* cover: sums that overflow only in some orders (numpy's BLAS blocking decides
them), 1 x 1 tiles or k groups of one of a larger product (BLAS's dot and numpy's loop
spread otherwise), the Dask and MPI engines.
"""
from __future__ import annotations


import numpy as np
import pytest

import distmm
from conftest import recorded
from distmm.nonfinite import numpys_nonfinite

inf, nan = np.inf, np.nan


def overflowing(rng, shape_a, shape_b, dtype):
    """Random operands (a stack where the shapes have three axes) whose row 1 of A makes
    real parts overflow (``inf + xj``) and row 3 imaginary ones (``x + infj``), term by
    term; B's imaginary parts are small, so the other part stays finite."""
    big = np.finfo(dtype).max / 2
    a = rng.standard_normal(shape_a) + 1j * rng.standard_normal(shape_a)
    b = (1 + rng.random(shape_b)) + 1e-3j * rng.uniform(-1, 1, shape_b)
    k = shape_a[-1]
    a[..., 1, :] = big * (1 + rng.random(k))          # real * real: each term inf
    a[..., 3, :] = 1j * big * (1 + rng.random(k))     # imag * real: each term inf
    return a.astype(dtype), b.astype(dtype)


def assert_numpys(want, got, exact=True):
    """NaN and Inf where numpy's are, part by part; the other values equal (``exact``: one
    BLAS call as numpy's) or as close as a sum in another order."""
    assert got.dtype == want.dtype and got.shape == want.shape
    for part in ("real", "imag"):
        w, g = getattr(want, part), getattr(got, part)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=part)
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w), err_msg=part)
        if exact:
            np.testing.assert_array_equal(g, w, err_msg=part)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=part)


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("tile", [None, (4, 4, 16), (4, 4, 4), (2, 3, 4)],
                         ids=["one-tile", "m-n-tiles", "k-groups", "ragged"])
def test_overflowing_part_is_numpys(dtype, tile):
    """``inf+nanj`` and ``nan+infj`` as numpy's (``nan+nanj`` before), with numpy's
    warnings once each: overflow, invalid (one-tile: invalid twice before)."""
    rng = np.random.default_rng()
    a, b = overflowing(rng, (7, 11), (11, 9), dtype)
    want, warned = recorded(np.matmul, a, b)
    assert np.isinf(want[1].real).all() and np.isnan(want[1].imag).all()  # the case at hand
    assert np.isnan(want[3].real).all() and np.isinf(want[3].imag).all()
    got, got_warned = recorded(lambda x, y: distmm.matmul(x, y, engine="local", tile=tile),
                               a, b)
    assert_numpys(want, got, exact=tile is None)
    assert got_warned == warned


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
def test_one_tile_warns_as_numpy(dtype):
    """One tile is numpy's own call: its "invalid value encountered in matmul" once, as
    numpy's, and the result is numpy's bits."""
    rng = np.random.default_rng()
    a, b = overflowing(rng, (5, 13), (13, 3), dtype)
    want, warned = recorded(np.matmul, a, b)
    got, got_warned = recorded(lambda x, y: distmm.matmul(x, y, engine="local"), a, b)
    assert [m for _, m in warned].count("invalid value encountered in matmul") == 1
    assert got_warned == warned
    assert_numpys(want, got)


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
def test_overflowing_part_in_a_stack_is_numpys(dtype):
    rng = np.random.default_rng()
    a, b = overflowing(rng, (3, 5, 9), (3, 9, 7), dtype)
    want, warned = recorded(np.matmul, a, b)
    got, got_warned = recorded(lambda x, y: distmm.matmul(x, y, engine="local"), a, b)
    assert_numpys(want, got)
    assert got_warned == warned


def test_spread_parts_keep_numpys_nan():
    """A block summed from calls that spread as the whole product's keeps ``inf+nanj``
    and spreads a sum's ``inf+1j``; parts unknown (or a k == 1 part) spread both, as a
    NaN there may be an ``inf * 0``."""
    plan = distmm.make_plan(5, 7, 9, "complex128", tile=(5, 7, 9))
    block = np.array([[complex(inf, nan), complex(inf, 1), complex(nan, -inf), 2 + 1j]])
    want = np.array([[complex(inf, nan), complex(inf, nan), complex(nan, -inf), 2 + 1j]])
    with np.errstate(all="ignore"):
        assert_numpys(want, numpys_nonfinite(plan, block.copy(), ((5, 7, 4), (5, 7, 5))))
        spread = np.array([[complex(nan, nan), complex(inf, nan), complex(nan, nan), 2 + 1j]])
        assert_numpys(spread, numpys_nonfinite(plan, block.copy()))
        assert_numpys(spread, numpys_nonfinite(plan, block.copy(), ((5, 7, 8), (5, 7, 1))))
