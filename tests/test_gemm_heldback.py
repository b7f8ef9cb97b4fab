"""Held-back cases of distmm.gemm against scipy.linalg.blas's ?gemm and numpy's own
``alpha * op(a) @ op(b) + beta * c``, on the local, Dask and MPI engines.

This module covers what tests/test_gemm_semantics.py does not try: Fortran-ordered,
strided and negative-stride views as a, b and c (values against scipy's ?gemm within a
float64-reference bound), a ``c`` numpy would broadcast (refused, as scipy refuses it), a
``c`` of another family (list, tuple, np.matrix, masked with a mask, read-only, a
memmap, byte-swapped) and its dask chunk sizes, np.matrix and masked operands with a dask
partner, alpha and beta as numpy scalars and 0-d
arrays, NaN, Inf and signed zeros as alpha and beta, integer wraparound and promotion
with c's dtype, booleans, float16, long double and objects, m, n or k of 0 or 1 with one-
element tiles, overflow and numpy's floating-point reports, a ``c`` that is ``a`` or
``b`` (the same buffer), and numpy integer transpose codes; on a Dask cluster and under
``mpiexec`` (1 and 2 ranks) a few of each, against the local engine's result, and dask
operands refused by engine="mpi" where no product is made.
It does *not* cover: what test_gemm_semantics.py and test_api.py's gemm tests cover
(every letter on object operands, complex Inf and NaN, scipy's own cases, scalar ranges,
MPI argument agreement), GPU gemm (tests/test_gpu_api.py).
"""
from __future__ import annotations

import itertools
import os
import warnings
from fractions import Fraction

import numpy as np
import pytest

import distmm
from conftest import identical, reported, run_rank_script

OPS = {"N": lambda x: x, "T": lambda x: x.T, "C": lambda x: x.conj().T}
SCIPY_TRANS = {"N": 0, "T": 1, "C": 2}


def _blas(dtype):
    blas = pytest.importorskip("scipy.linalg.blas")
    return {np.float32: blas.sgemm, np.float64: blas.dgemm, np.complex64: blas.cgemm,
            np.complex128: blas.zgemm}[dtype]


def _quarters(rng, shape, dtype):
    """Values in {-2, -1.75, ..., 2} (integers in -8..8 for integer dtypes; complex parts
    alike): every product and sum of the small sizes here is exact in any float dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -8, 9, shape).astype(dtype)
    x = rng.integers(-8, 9, shape) / 4
    if dtype.kind == "c":
        x = x + 1j * rng.integers(-8, 9, shape) / 4
    if dtype == object:
        return np.vectorize(Fraction, otypes=[object])(rng.integers(-8, 9, shape), 4)
    return x.astype(dtype)


def _result_dtype(a, b, c):
    """The docstring's dtype: numpy's matmul dtype of a and b, promoted with c's."""
    dtype = np.matmul(np.empty((0, 0), a.dtype), np.empty((0, 0), b.dtype)).dtype
    return dtype if c is None else np.result_type(dtype, np.asarray(c).dtype)


def _formula(a, b, c, alpha=1.0, beta=0.0, ta="N", tb="N"):
    """numpy's ``alpha * (op(a) @ op(b)) + beta * c`` in the promoted dtype, the scalars in
    it, with BLAS's rules: ``beta == 0`` reads no c, ``alpha == 0`` or k == 0 no a and b."""
    dtype = _result_dtype(a, b, c)
    al, be = dtype.type(alpha), dtype.type(beta)
    x, y = OPS[ta](np.asarray(a)).astype(dtype), OPS[tb](np.asarray(b)).astype(dtype)
    if al == 0 or x.shape[1] == 0:  # BLAS's C = beta * C: no zero product added
        if c is None or be == 0:
            return np.zeros((x.shape[0], y.shape[1]), dtype)
        return be * np.asarray(c).astype(dtype)
    product = al * (x @ y)
    return product if c is None or be == 0 else product + be * np.asarray(c).astype(dtype)


# -- layouts and views against scipy's ?gemm ------------------------------------------------

def _layouts(x):
    """x as C and Fortran order, with reversed rows, reversed columns and both, and as a
    view of every other row and column of a larger array."""
    wide = np.zeros((2 * x.shape[0], 2 * x.shape[1]), x.dtype)
    wide[::2, ::2] = x
    return {"C": x, "F": np.asfortranarray(x), "rows-reversed": x[::-1].copy()[::-1],
            "cols-reversed": x[:, ::-1].copy()[:, ::-1],
            "both-reversed": np.ascontiguousarray(x[::-1, ::-1])[::-1, ::-1],
            "every-other": wide[::2, ::2]}


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
@pytest.mark.parametrize("tile", [None, (1, 1, 1), (2, 3, 2)], ids=["default", "1x1x1", "2x3x2"])
@pytest.mark.slow
def test_views_of_every_layout_against_scipys_gemm(dtype, tile):
    """a, b and c in every layout (Fortran order, negative strides, strided views), every
    letter pair, with ragged tiles: scipy's ?gemm's dtype and values within a bound of the
    float64 reference, and the inputs unchanged."""
    f = _blas(dtype)
    rng = np.random.default_rng()
    eps = np.finfo(dtype).eps
    m, n, k = 5, 7, 3

    def normal(shape):
        x = rng.standard_normal(shape)
        return (x + 1j * rng.standard_normal(shape) if np.dtype(dtype).kind == "c"
                else x).astype(dtype)

    names = list(_layouts(np.zeros((1, 1))))
    for (ta, tb), i in itertools.product(itertools.product("NTC", "NTC"), range(len(names))):
        la, lb, lc = names[i], names[(i + 1) % len(names)], names[(i + 3) % len(names)]
        a = normal((m, k) if ta == "N" else (k, m))
        b = normal((k, n) if tb == "N" else (n, k))
        c = normal((m, n))
        x, y, z = _layouts(a)[la], _layouts(b)[lb], _layouts(c)[lc]
        copies = [v.copy() for v in (x, y, z)]
        for alpha, beta in [(1.0, 0.0), (-1.5, 0.5), (0.25, 1.0)]:
            got = distmm.gemm(x, y, z, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb,
                              tile=tile)
            want = f(alpha, x, y, beta=beta, c=z, trans_a=SCIPY_TRANS[ta],
                     trans_b=SCIPY_TRANS[tb])
            assert type(got) is np.ndarray and got.dtype == want.dtype, (ta, tb, la, lb, lc)
            ref = (alpha * (OPS[ta](a.astype(np.complex128)) @ OPS[tb](b.astype(np.complex128)))
                   + beta * c.astype(np.complex128))
            scale = (abs(alpha) * (np.abs(OPS[ta](a)).astype(np.float64)
                                   @ np.abs(OPS[tb](b)).astype(np.float64))
                     + abs(beta) * np.abs(c).astype(np.float64))
            bound = 4 * (k + 2) * eps * scale
            assert np.all(np.abs(got - ref) <= bound), (ta, tb, la, lb, lc, alpha, beta)
            assert np.all(np.abs(want - ref) <= bound)  # the bound holds for scipy's too
        for v, copy in zip((x, y, z), copies):
            assert np.array_equal(v, copy)


# -- c's shape and family --------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 7), (5, 1), (7,), (), (1, 5, 7), (7, 5)], ids=str)
@pytest.mark.parametrize("family", ["numpy", "dask"])
def test_a_c_numpy_would_broadcast_is_refused_as_scipy_refuses_it(shape, family):
    """The docstring: c of shape (m, n). numpy's formula broadcasts a (1, n), (m, 1), (n,)
    or scalar c; BLAS takes none of them (scipy's dgemm: ValueError); gemm says which
    shape was wrong, whether or not c is read (beta == 0)."""
    rng = np.random.default_rng()
    a, b, c = rng.standard_normal((5, 3)), rng.standard_normal((3, 7)), rng.standard_normal(shape)
    if len(shape) <= 2 and shape != (7, 5):
        assert (a @ b + c).shape == (5, 7)  # numpy broadcasts it
    if len(shape) == 2:  # scipy reshapes a (1, m, n) c
        with pytest.raises(ValueError):
            _blas(np.float64)(1.0, a, b, beta=1.0, c=c)
    if family == "dask":
        da = pytest.importorskip("dask.array")
        a, b = da.from_array(a, chunks=2), da.from_array(b, chunks=2)
    for beta in (1.0, 0.0):
        with pytest.raises(ValueError, match=r"^gemm: c has shape " + repr(shape).replace(
                "(", r"\(").replace(")", r"\)")):
            distmm.gemm(a, b, c, beta=beta)


def test_a_dask_c_of_unknown_chunk_sizes_is_named():
    """A c whose chunk sizes dask does not know (a boolean-masked selection) was refused as
    "c has shape (nan, 4) but op(a) @ op(b) has shape (6, 4)", a shape error for a c whose
    rows may well be six; a and b of unknown sizes are named as such, and c now is too."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a, b, c = rng.standard_normal((6, 3)), rng.standard_normal((3, 4)), rng.standard_normal((6, 4))
    dc = da.from_array(c, chunks=2)
    unknown = dc[dc[:, 0] < np.inf]  # all six rows, of sizes dask knows once computed
    assert np.isnan(unknown.shape[0])
    for beta in (1.0, 0.0):
        with pytest.raises(ValueError, match=r"^gemm: c has unknown chunk sizes \(shape "
                                             r"\(nan, 4\)\); call c.compute_chunk_sizes\(\)"):
            distmm.gemm(da.from_array(a, chunks=2), b, unknown, beta=beta)
    unknown.compute_chunk_sizes()
    got = distmm.gemm(da.from_array(a, chunks=2), b, unknown, beta=2.0)
    np.testing.assert_allclose(got.compute(scheduler="sync"), a @ b + 2.0 * c, rtol=1e-12)


def _families(c, tmp_path):
    """c as numpy's other families and array kinds, each with the values gemm reads."""
    read_only = c.copy()
    read_only.flags.writeable = False
    np.save(tmp_path / "c.npy", c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        matrix = np.matrix(c)
    masked = np.ma.masked_array(c, mask=c > 0)  # gemm reads its data, mask or not
    listed = c.tolist()  # Python numbers: numpy's float64, complex128 or int64
    rows = tuple(map(tuple, c))  # numpy scalars: c's dtype
    ints = np.round(c.real).astype(int)
    return {"list": (listed, np.array(listed)), "tuple": (rows, np.array(rows)),
            "matrix": (matrix, c),
            "masked": (masked, c), "read-only": (read_only, c),
            "memmap-r": (np.load(tmp_path / "c.npy", mmap_mode="r"), c),
            "memmap-c": (np.load(tmp_path / "c.npy", mmap_mode="c"), c),
            "big-endian": (c.astype(c.dtype.newbyteorder(">")), c),
            "int-list": (ints.tolist(), ints)}


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("dtype", [np.float32, np.complex128, np.int16])
def test_c_of_another_family_is_its_data_in_a_new_plain_array(dtype, tmp_path):
    """c as a list, tuple, np.matrix, masked array with a mask, read-only array, memmap or
    byte-swapped array: a new, writeable, plain ndarray of the promoted dtype (native byte
    order), numpy's formula's values on c's data, c untouched, for alpha 0 and 1 and beta 0,
    1 and -2."""
    rng = np.random.default_rng()
    a, b = _quarters(rng, (4, 3), dtype), _quarters(rng, (3, 5), dtype)
    c = _quarters(rng, (4, 5), dtype)
    for name, (given, data) in _families(c, tmp_path).items():
        before = np.array(np.asarray(given), copy=True)
        for alpha, beta in itertools.product((1, 0), (0, 1, -2)):
            got = distmm.gemm(a, b, given, alpha=alpha, beta=beta)
            want = _formula(a, b, data, alpha, beta)
            assert identical(got, want), (name, alpha, beta, got.dtype, want.dtype)
            assert got.dtype.isnative and got.flags.writeable, name
            assert not np.shares_memory(got, np.asarray(given)), (name, alpha, beta)
        assert np.array_equal(np.asarray(given), before), name


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("kind", ["matrix", "masked"])
@pytest.mark.parametrize("partner", ["b", "c"])
def test_a_subclass_operand_with_a_dask_partner_is_its_data(kind, partner):
    """An np.matrix or masked a (or b) with a dask b or a dask c: a dask result of the
    operand's data, as gemm gives with numpy partners (a plain ndarray, no mask). It was
    refused as "operand a is a dask array of numpy.matrix chunks", of an a that is none."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a, b, c = (_quarters(rng, s, np.float64) for s in ((4, 3), (3, 5), (4, 5)))
    sub = {"matrix": np.matrix, "masked": lambda x: np.ma.masked_array(x, mask=x > 0)}[kind]
    want = _formula(a, b, c, 2.0, -1.0)
    assert identical(distmm.gemm(sub(a), b, c, alpha=2.0, beta=-1.0), want)  # numpy partners
    lazy_a = da.from_array(a, chunks=2) if partner == "b" else a  # a dask partner of b
    lazy_b = da.from_array(b, chunks=2) if partner == "b" else b
    lazy_c = da.from_array(c, chunks=2) if partner == "c" else c
    for x, y, ta in [(sub(a), lazy_b, "N"), (sub(a.T), lazy_b, "T"), (lazy_a, sub(b), "N")]:
        got = distmm.gemm(x, y, lazy_c, alpha=2.0, beta=-1.0, trans_a=ta)
        assert isinstance(got, da.Array), type(got)
        assert identical(got.compute(scheduler="sync"), want), ta


# -- scalars ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.int32])
def test_numpy_scalars_and_0d_arrays_are_their_values(dtype):
    """alpha and beta as numpy scalars and 0-d arrays of every kind that holds their value
    exactly give what the Python numbers give, in the operands' dtype (as scipy's ?gemm:
    a float64 alpha does not make a float32 product float64)."""
    rng = np.random.default_rng()
    a, b, c = (_quarters(rng, s, dtype) for s in ((5, 4), (4, 3), (5, 3)))
    kinds = [np.float16, np.float32, np.float64, np.longdouble, np.int8, np.int64, np.uint8,
             np.complex64]
    for alpha, beta in [(2, 3), (0, 1), (1, 0)]:
        want = distmm.gemm(a, b, c, alpha=alpha, beta=beta)
        assert identical(want, _formula(a, b, c, alpha, beta))
        for kind in kinds:
            for wrap in (kind, lambda v, kind=kind: np.array(v, kind)):
                got = distmm.gemm(a, b, c, alpha=wrap(alpha), beta=wrap(beta))
                assert identical(got, want), (kind, alpha, beta)
    if np.dtype(dtype).kind in "fc":
        f = _blas(dtype)
        got = distmm.gemm(a, b, c, alpha=np.float64(0.5), beta=np.array(-1.25, np.float32))
        want = f(0.5, a, b, beta=-1.25, c=c)
        assert got.dtype == want.dtype and np.array_equal(got, want)
    for bad in (np.array([2.0]), np.array([[2.0]])):  # not 0-d: no scalar
        with pytest.raises(TypeError, match="^alpha must be a number"):
            distmm.gemm(a, b, c, alpha=bad)


def test_nonfinite_and_signed_zero_scalars_are_numpys_with_blas_zero_rules():
    """NaN, Inf, -Inf, 0.0 and -0.0 as alpha and beta, with a NaN in a and in c: numpy's
    formula's elements (NaN, Inf, signs) and reports; -0.0 is zero, so a NaN in c (beta)
    or in a (alpha) is not read, as BLAS's ``beta == 0`` / ``alpha == 0``."""
    rng = np.random.default_rng()
    a, b, c = (_quarters(rng, s, np.float64) for s in ((4, 3), (3, 5), (4, 5)))
    a[1, 1], c[2, 2] = np.nan, np.nan
    c[0, 0], c[0, 1] = -0.0, 0.0
    scalars = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0]
    for alpha, beta in itertools.product(scalars, scalars):
        want = reported(lambda: _formula(a, b, c, alpha, beta))
        got = reported(lambda: distmm.gemm(a, b, c, alpha=alpha, beta=beta))
        assert identical(got[0], want[0]) and got[1:] == want[1:], (alpha, beta, got, want)
    # -0.0 is zero: the NaNs are not read
    assert not np.isnan(distmm.gemm(a, b, c, alpha=-0.0, beta=1.0)[1]).any()
    assert not np.isnan(distmm.gemm(a[2:], b, c[2:], alpha=1.0, beta=-0.0)).any()


# -- dtypes: integers, booleans, float16, long double, objects -------------------------------

@pytest.mark.parametrize("ab,cd", [(np.int8, np.int8), (np.int8, np.float64), (np.int8, np.int16),
                                   (np.uint8, np.int8), (np.int16, np.uint64),
                                   (np.int64, np.int64), (np.int8, np.complex64),
                                   (np.int32, object), (np.bool_, np.int64)], ids=str)
@pytest.mark.parametrize("tile", [None, (1, 1, 1)], ids=["default", "1x1x1"])
def test_integers_wrap_as_numpys_in_the_dtype_promoted_with_c(ab, cd, tile):
    """Integer operands over their whole range: the promoted dtype's product (int8
    operands with an int16 c sum in int16, with a float64 c in float64, without int8's
    wrap), numpy's wraparound, exactly; booleans promoted by an integer c count."""
    rng = np.random.default_rng()
    m, n, k = 5, 4, 7
    if np.dtype(ab).kind == "b":
        a, b = rng.random((m, k)) < 0.5, rng.random((k, n)) < 0.5
    else:
        info = np.iinfo(ab)
        a = rng.integers(info.min, info.max, (m, k), dtype=ab, endpoint=True)
        b = rng.integers(info.min, info.max, (k, n), dtype=ab, endpoint=True)
    c = rng.integers(0, 100, (m, n)).astype(cd)
    for alpha, beta in [(1, 1), (3, -1), (0, 2), (-5, 0)]:
        if np.dtype(ab).kind == "u" and np.dtype(_result_dtype(a, b, c)).kind == "u" and (
                alpha < 0 or beta < 0):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the float64 reference of uint64 may round
            want = _formula(a, b, c, alpha, beta)
        got = distmm.gemm(a, b, c, alpha=alpha, beta=beta, tile=tile)
        if want.dtype.kind in "fc":
            ok = got.dtype == want.dtype and np.allclose(got, want, rtol=1e-6 if
                                                         want.dtype.itemsize <= 8 else 1e-12)
        else:
            ok = identical(got, want)
        assert ok, (alpha, beta, got.dtype, want.dtype)


def test_int64_overflow_wraps_as_numpys():
    """A product and a sum past int64's range wrap as numpy's (modulo 2**64)."""
    a = np.full((2, 3), 2**62, np.int64)
    b = np.array([[3, -1], [1, 2], [2**40, 7]], np.int64)
    c = np.full((2, 2), np.iinfo(np.int64).max, np.int64)
    for tile in (None, (1, 1, 1)):
        got = distmm.gemm(a, b, c, alpha=3, beta=5, tile=tile)
        exact = (3 * (a.astype(object) @ b.astype(object)) + 5 * c.astype(object))
        wrapped = np.array([[(v + 2**63) % 2**64 - 2**63 for v in row] for row in exact.tolist()],
                           np.int64)
        assert identical(got, wrapped)


@pytest.mark.parametrize("dtype", [np.bool_, np.float16, np.longdouble, np.complex64, object])
@pytest.mark.parametrize("mnk", [(0, 3, 2), (3, 0, 2), (3, 2, 0), (1, 1, 1), (1, 4, 1),
                                 (4, 1, 5), (2, 1, 0), (0, 0, 0), (3, 5, 4)], ids=str)
@pytest.mark.slow
def test_small_and_empty_shapes_of_every_letter_with_one_element_tiles(dtype, mnk):
    """m, n or k of 0 or 1, every letter pair, one-element and ragged tiles: numpy's
    formula's dtype, shape and values exactly (values that sum exactly in every dtype)."""
    rng = np.random.default_rng()
    m, n, k = mnk
    scalars = [(1, 0), (1, 1)] if dtype == np.bool_ else [(Fraction(1, 2) if dtype == object
                                                          else 0.5, -2), (0, 3), (1, 1)]
    for ta, tb in itertools.product("NTC", "NTC"):
        a = _quarters(rng, (m, k) if ta == "N" else (k, m), dtype)
        b = _quarters(rng, (k, n) if tb == "N" else (n, k), dtype)
        c = _quarters(rng, (m, n), dtype)
        for (alpha, beta), tile in itertools.product(scalars, [None, (1, 1, 1), (2, 1, 3)]):
            got = distmm.gemm(a, b, c, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb,
                              tile=tile)
            want = _formula(a, b, c, alpha, beta, ta, tb)
            assert identical(got, want), (ta, tb, alpha, beta, tile)


# -- overflow and numpy's reports ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64])
def test_overflow_values_and_reports_are_numpys(dtype):
    """A huge alpha or beta, a c at the dtype's largest value, a product that overflows:
    numpy's formula's elements, its warnings in order and its error under 'raise'."""
    rng = np.random.default_rng()
    big = float(np.finfo(dtype).max)
    a, b, c = (_quarters(rng, s, dtype) for s in ((4, 3), (3, 5), (4, 5)))
    huge_a = a.copy()
    huge_a[0] = big / 2
    cases = [(a, b, c, big, 1.0), (a, b, c, 1.0, big), (a, b, np.full_like(c, big), 1.0, 1.0),
             (huge_a, b, c, 1.0, 0.0), (huge_a, b, c, 2.0, -1.0), (a, b, c, big, big)]
    for x, y, z, alpha, beta in cases:
        want = reported(lambda: _formula(x, y, z, alpha, beta))
        got = reported(lambda: distmm.gemm(x, y, z, alpha=alpha, beta=beta))
        assert identical(got[0], want[0]) and got[1:] == want[1:], (alpha, beta, got[1:],
                                                                      want[1:])


# -- aliasing and transpose codes -------------------------------------------------------------

def test_c_that_is_a_or_b_or_shares_their_buffer():
    """c the very array a or b is, or a view into the buffer a and b are views of: the
    formula's result from copies, and no input changed (gemm returns a new array)."""
    rng = np.random.default_rng()
    sq = _quarters(rng, (5, 5), np.float64)
    buf = _quarters(rng, (6, 6), np.float64)
    cases = [(sq, sq, sq, "N", "N"), (sq, sq, sq, "T", "N"), (sq, sq.T, sq, "N", "C"),
             (buf[:5, :3], buf[1:4, 1:6], buf[:5, 1:6], "N", "N"),
             (buf[::-1, :5], buf[:6, ::-2], buf[:5, ::2][::-1, :3], "T", "N")]
    for x, y, z, ta, tb in cases:
        before = buf.copy(), sq.copy()
        want = _formula(x.copy(), y.copy(), z.copy(), 2.0, 1.0, ta, tb)
        for tile in (None, (1, 1, 1)):
            got = distmm.gemm(x, y, z, alpha=2.0, beta=1.0, trans_a=ta, trans_b=tb, tile=tile)
            assert identical(got, want)
            assert not any(np.shares_memory(got, v) for v in (x, y, z))
        assert np.array_equal(buf, before[0]) and np.array_equal(sq, before[1])


def test_numpy_integer_transpose_codes_and_others_refused():
    """scipy's codes as numpy integers of any width give the letters; numbers that are not
    codes (negative, 3, floats), bytes and 0-d arrays are refused with the ValueError."""
    zgemm = _blas(np.complex128)
    rng = np.random.default_rng()
    a = rng.standard_normal((4, 3)) + 1j * rng.standard_normal((4, 3))
    b = rng.standard_normal((5, 4)) + 1j * rng.standard_normal((5, 4))
    for code in (np.uint8(2), np.int16(2), np.uint64(2)):
        got = distmm.gemm(a, b, trans_a=code, trans_b=np.int8(1))
        want = zgemm(1.0, a, b, trans_a=2, trans_b=1)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    for bad in (np.int8(-1), np.uint64(3), 1.0, 2.0, b"C", "CT", np.array(1), np.array("T")):
        with pytest.raises(ValueError, match="^gemm: trans_b must be a bool, one of"):
            distmm.gemm(a, b, trans_b=bad)


# -- the Dask engine ----------------------------------------------------------------------------

@pytest.mark.slow  # a cluster of two worker processes
def test_on_a_dask_cluster_numpy_and_dask_operands(client):
    """engine="dask" with numpy operands (strided and Fortran views, one-element tiles),
    dask operands and a dask c, integer and boolean promotion with c, m, n or k of 0 or 1,
    nonfinite scalars: the local engine's result (itself numpy's formula, above), exactly,
    and numpy's reports where the product is made in this process."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    m, n, k = 7, 5, 6
    x, y, z = (_quarters(rng, s, np.float64) for s in ((k, m), (k, n), (m, n)))
    i8 = [rng.integers(-128, 128, s).astype(np.int8) for s in ((m, k), (k, n))]
    cases = [
        ("views", (np.asfortranarray(x)[:, ::-1], y[::-1], z[:, ::-1].copy()[:, ::-1]),
         dict(alpha=0.5, beta=-1.0, trans_a="T", tile=(1, 1, 1))),
        ("int8 with int16 c", (*i8, z.astype(np.int16)), dict(alpha=3, beta=-1, tile=(2, 3, 2))),
        ("bool with int c", (x.T > 0, y > 0, z.astype(np.int64)), dict(beta=1)),
        ("float16", (x.T.astype(np.float16), y.astype(np.float16), z.astype(np.float16)),
         dict(alpha=2.0, beta=0.5)),
        ("object", (x.T.astype(object), y.astype(object), z.astype(object)),
         dict(alpha=Fraction(1, 3), beta=2)),
        ("nan alpha", (x.T, y, z), dict(alpha=np.nan, beta=1.0)),
        ("beta -0.0", (x.T, y, np.full((m, n), np.nan)), dict(beta=-0.0)),
        ("k 0", (x.T[:, :0], y[:0], z), dict(alpha=2.0, beta=3.0)),
        ("m n k 1", (x[:1, :1], y[:1, :1], z[:1, :1]), dict(alpha=2.0, beta=3.0, trans_a="C")),
        ("m 0", (x.T[:0], y, z[:0]), dict(beta=1.0)),
    ]
    for name, (a, b, c), kw in cases:
        want = reported(lambda: distmm.gemm(a, b, c, engine="local", **kw))
        got = reported(lambda: distmm.gemm(a, b, c, engine="dask", client=client, **kw))
        assert identical(got[0], want[0]) and got[1:] == want[1:], name
        lazy = distmm.gemm(da.from_array(a, chunks=2), da.from_array(b, chunks=3),
                           da.from_array(c, chunks=4), engine="dask", client=client,
                           **{key: v for key, v in kw.items() if key != "tile"})
        assert lazy.dtype == want[0].dtype and lazy.shape == want[0].shape, name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the product's reports are the workers'
            assert identical(lazy.compute(), want[0]), name


# -- MPI ------------------------------------------------------------------------------------------

MPI_SCRIPT = '''
import sys
import warnings
from fractions import Fraction
import numpy as np
import dask.array as da
from mpi4py import MPI
import distmm

sys.path.insert(0, sys.argv[1])
from conftest import identical

comm = MPI.COMM_WORLD
rank = comm.rank
rng = np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy if rank == 0 else None))
lines = []


def reported(f):
    with warnings.catch_warnings(record=True) as seen, np.errstate(all="warn"):
        warnings.simplefilter("always")
        try:
            out = f()
        except Exception as exc:
            return type(exc), [str(w.message) for w in seen]
    return out, [str(w.message) for w in seen]


def same(got, want):
    if isinstance(got, type) or isinstance(want, type):
        return got is want
    return identical(got, want)


def case(name, a, b, c=None, **kw):
    """engine="mpi" against the local engine on this rank: values (exact: the operands
    are quarters), dtype, reports, or the exception's type."""
    want = reported(lambda: distmm.gemm(a, b, c, engine="local", **kw))
    got = reported(lambda: distmm.gemm(a, b, c, engine="mpi", **kw))
    ok = same(got[0], want[0]) and got[1] == want[1]
    lines.append(f"rank {rank}: {name}: " + ("ok" if ok else
                                              f"BAD got {str(got)[-200:]} want {str(want)[-200:]}"))


def quarters(shape):
    return rng.integers(-8, 9, shape) / 4


m, n, k = 7, 5, 6
a, b, c = quarters((m, k)), quarters((k, n)), quarters((m, n))
case("views", np.asfortranarray(a)[::-1], b[:, ::-1], c[::-2, ::-1].copy()[::-1],
     alpha=0.5, beta=-2.0, tile=(1, 1, 1))
case("c list", a, b, c.tolist(), beta=1.0)
case("c masked", a, b, np.ma.masked_array(c, mask=c > 0), beta=2.0)
case("int8 c float64", (a * 50).astype(np.int8), (b * 50).astype(np.int8), c, alpha=3, beta=1)
case("int16 wraps", (a * 4e3).astype(np.int16), (b * 4e3).astype(np.int16),
     (c * 4e3).astype(np.int16), alpha=7, beta=-3)
case("bool", a > 0, b > 0, c > 0, alpha=True, beta=1)
case("float16", a.astype(np.float16), b.astype(np.float16), c.astype(np.float16),
     alpha=0.5, beta=1.5)
case("longdouble c", a, b, c.astype(np.longdouble), alpha=0.5, beta=1.5)
case("object", a.astype(object), b.astype(object), c.astype(object), alpha=Fraction(1, 3),
     beta=-1)
case("nan alpha, inf beta", a, b, c, alpha=np.nan, beta=np.inf)
case("beta -0.0, nan c", a, b, np.full((m, n), np.nan), beta=-0.0)
case("huge alpha", a.astype(np.float32), b.astype(np.float32), c.astype(np.float32),
     alpha=np.float32(3e38), beta=1.0)
sq = quarters((k, k))
case("c is a and b", sq, sq, sq, alpha=2.0, beta=1.0, trans_a="T")
z = quarters((k, m)) + 1j * quarters((k, m))
case("complex C", z, b.astype(np.complex64), c, alpha=1 - 2j, beta=0.5, trans_a="C")
case("m n k 1 0", a[:1, :0], b[:0, :1], c[:1, :1], beta=3.0)
case("broadcastable c", a, b, c[:1], beta=1.0)
case("trans code 3", a, b, trans_a=np.int8(3))
case("complex alpha, real result", a, b, alpha=1j)


def refused(name, f):
    """A ValueError naming dask arrays, on every rank."""
    try:
        f()
        lines.append(f"rank {rank}: {name}: BAD no error")
    except Exception as exc:
        ok = type(exc) is ValueError and "not dask arrays" in str(exc)
        lines.append(f"rank {rank}: {name}: " + ("ok" if ok else f"BAD {exc!r}"))


# the engine refuses dask operands where it multiplies; a zero product made none (a dask
# result on every rank)
refused("dask a, alpha 0", lambda: distmm.gemm(da.from_array(a, chunks=3), b, c, alpha=0.0,
                                                beta=1.0, engine="mpi"))
refused("dask c, k 0", lambda: distmm.gemm(a[:, :0], b[:0], da.from_array(c, chunks=3),
                                            beta=1.0, engine="mpi"))
refused("dask b, alpha 1", lambda: distmm.gemm(a, da.from_array(b, chunks=3), c, beta=1.0,
                                                engine="mpi"))
for mine in comm.gather(lines) or []:
    print("\\n".join(mine), flush=True)
'''


@pytest.mark.mpi
@pytest.mark.slow  # one mpiexec launch each, ~5 s on 2 cores
@pytest.mark.parametrize("ranks", [1, 2])
def test_under_mpiexec_gemm_is_the_local_engines(ranks, tmp_path, mpirun):
    """engine="mpi" on 1 and 2 ranks: views, c of another family, integer, boolean, float16,
    long double and object promotion, nonfinite and signed-zero scalars, overflow, a c that
    is a and b, 'C' on complex, an empty k, and the refusals (a broadcastable c, code 3, a
    complex alpha for a real result) on every rank: the local engine's result and reports.
    Dask operands are refused on every rank where no product is made too (alpha == 0 or
    k == 0 gave a dask array: the engine refuses them only where it multiplies)."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "gemm_heldback.py", MPI_SCRIPT, ranks,
                                    os.path.dirname(os.path.abspath(__file__)), timeout=180)
    assert len(lines) == 21 * ranks and not bad, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
