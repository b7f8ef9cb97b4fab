"""distmm.gemm against BLAS's semantics and numpy's ``alpha * op(a) @ op(b) + beta * c``.

This module covers what gemm adds to matmul, on every engine: ``op()`` of every kind
(conjugate transposes of object operands too), complex Inf and NaN and numpy's
floating-point reports as numpy's ``alpha * (a @ b) + beta * c`` gives them, ``c`` as
numpy's subclasses and on-disk arrays, transposed on-disk operands, alpha and beta that
are not numbers, a ``c`` of a dtype gemm cannot add, the engine's arguments checked when
the product is all zeros (``alpha == 0``, ``k == 0``), and, under ``mpiexec``, a call one
rank refuses or makes differently raising on every rank instead of leaving the others
waiting; and scipy.linalg.blas's ?gemm: the cases of scipy's own tests, a sweep of
letters, scalars and shapes against it, and where gemm differs from its wrappers on purpose.
It does *not* cover: matmul's own semantics (tests/test_api.py), gemm's scalar ranges and
BLAS letters on the local engine (tests/test_api.py), GPU gemm (tests/test_gpu_api.py).
"""
from __future__ import annotations

import decimal
import itertools
import warnings

import numpy as np
import pytest

import distmm
from conftest import random_array, reported

OPS = {"N": lambda x: x, "T": lambda x: x.T, "C": lambda x: x.conj().T}


def _operands(rng, dtype, ta, tb, m=5, n=7, k=9):
    """a, b, c for op(a) @ op(b) of shape (m, n) with inner size k."""
    if np.dtype(dtype) == object:
        def make(shape):
            x = rng.integers(-3, 4, shape) + 1j * rng.integers(-3, 4, shape)
            return x.astype(object)
    else:
        def make(shape):
            return random_array(rng, shape, dtype)
    a = make((m, k) if ta == "N" else (k, m))
    b = make((k, n) if tb == "N" else (n, k))
    return a, b, make((m, n))


def _want(a, b, c, alpha, beta, ta, tb):
    """numpy's alpha * op(a) @ op(b) + beta * c, scalars in the operands' dtype."""
    dtype = a.dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # integers wrap as numpy's do
        prod = OPS[ta](a) @ OPS[tb](b)
        if dtype == object:
            return alpha * prod + beta * c
        return dtype.type(alpha) * prod + dtype.type(beta) * c


SWEEP = [(np.int16, 2, -1), (np.float16, 0.5, -2.0), (np.longdouble, 0.75, -1.5),
         (np.complex128, 0.5 - 1j, 2.0), (object, 2, -1)]


def _sweep(**engine):
    """gemm of every transpose letter pair for the dtypes of SWEEP, against numpy (exact:
    small integers, or a dtype whose product is numpy's bits on every engine)."""
    rng = np.random.default_rng(3)
    for dtype, alpha, beta in SWEEP:
        for ta in "NTC":
            for tb in "NTC":
                a, b, c = _operands(rng, dtype, ta, tb)
                if np.dtype(dtype).kind in "fc":
                    a, b, c = (np.round(x * 4) / 4 for x in (a, b, c))  # exact sums
                got = distmm.gemm(a, b, c, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb,
                                  tile=3, **engine)
                want = _want(a, b, c, alpha, beta, ta, tb)
                assert type(got) is np.ndarray and got.dtype == want.dtype, (dtype, ta, tb)
                assert np.array_equal(got, want), (dtype, ta, tb)


def test_every_transpose_letter_on_the_local_engine():
    """'C' conjugates object operands of complex numbers too (it was a plain transpose)."""
    _sweep(engine="local")


@pytest.mark.slow  # ~2-3.5 s: the fast run keeps under 5 minutes on 2 cores
def test_every_transpose_letter_on_the_dask_engine(client):
    _sweep(engine="dask", client=client)


def test_conjugate_transpose_of_a_dask_object_operand():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(4)
    a, b, c = _operands(rng, object, "C", "N")
    got = distmm.gemm(da.from_array(a, chunks=-1), b, c, beta=1, trans_a="C").compute()
    assert got.tolist() == (a.conj().T @ b + c).tolist()


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("kind", ["matrix", "masked"])
def test_a_subclass_c_gives_a_plain_ndarray(kind):
    """As the docstring says of subclasses: a plain ndarray, no mask (c's subclass leaked
    into the result through beta * c)."""
    rng = np.random.default_rng(5)
    a, b, c = (rng.standard_normal(s) for s in ((4, 3), (3, 5), (4, 5)))
    if kind == "matrix":
        sub = np.matrix(c)
    else:
        sub = np.ma.masked_array(c, mask=np.zeros(c.shape, bool))
        sub[0, 0] = np.ma.masked
    for beta in (1.0, 2.0):
        got = distmm.gemm(a, b, sub, beta=beta)
        assert type(got) is np.ndarray
        np.testing.assert_allclose(got, a @ b + beta * c, rtol=1e-13)


def test_on_disk_c_and_transposed_on_disk_operands(tmp_path):
    """An h5py dataset as c (it failed after the product: Dataset.astype takes no copy=),
    and as an operand with trans 'T' or 'C' (AttributeError: no .T)."""
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(6)
    a = random_array(rng, (6, 4), np.complex128)
    b = random_array(rng, (6, 5), np.complex128)
    c = random_array(rng, (4, 5), np.complex128)
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["a"], f["c"] = a, c
    with h5py.File(tmp_path / "x.h5", "r") as f:
        for beta in (1.0, -0.5):
            got = distmm.gemm(a.T, b, f["c"], beta=beta)
            np.testing.assert_allclose(got, a.T @ b + beta * c, rtol=1e-12)
        for ta in "TC":
            got = distmm.gemm(f["a"], b, f["c"], alpha=2.0, beta=1.0, trans_a=ta)
            np.testing.assert_allclose(got, 2.0 * OPS[ta](a) @ b + c, rtol=1e-12)
        # beta == 0: c is not read, whatever it is
        np.testing.assert_allclose(distmm.gemm(f["a"], b, f["c"], trans_a="C"),
                                   a.conj().T @ b, rtol=1e-12)


@pytest.mark.parametrize("bad", [np.full((4, 5), "x"), np.zeros((4, 5), "M8[s]"),
                                 np.zeros((4, 5), "m8[s]"), np.zeros((4, 5), "i4,i4")],
                         ids=["str", "datetime", "timedelta", "structured"])
def test_a_c_gemm_cannot_add_is_a_type_error_naming_c(bad):
    """It was numpy's matmul error for (c's dtype, c's dtype), which named neither c nor
    the call."""
    for beta in (1.0, 0.0):
        with pytest.raises(TypeError, match=r"^gemm: c must be boolean or numeric, got dtype"):
            distmm.gemm(np.ones((4, 3)), np.ones((3, 5)), bad, beta=beta)


@pytest.mark.parametrize("value", [np.datetime64("2020"), np.timedelta64(2, "s"),
                                   np.void(b"\x01"), decimal.Decimal("sNaN")],
                         ids=["datetime64", "timedelta64", "void", "decimal-snan"])
@pytest.mark.parametrize("dtype", [np.float64, np.int64, object])
@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_scalars_that_are_not_numbers_are_refused_before_the_product(value, dtype, name):
    """datetime64('2020') scaled a float product by 50 (years since 1970), a timedelta by its
    count; a void or a signalling NaN failed in numpy or after the product, unnamed."""
    x = np.ones((2, 2), dtype)
    with pytest.raises(TypeError, match=f"^{name}"):
        distmm.gemm(x, x, x, **{name: value})


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("kw,match", [(dict(engine="spark"), "engine"),
                                      (dict(backend="magic"), "backend"),
                                      (dict(tile=0), "tile")], ids=["engine", "backend", "tile"])
def test_a_zero_product_still_checks_the_engine_arguments(kw, match, k):
    """alpha == 0 or k == 0 makes no product, but the call's arguments are the call's:
    they were ignored there (a zero matrix instead of the ValueError of alpha == 1)."""
    a, b, c = np.ones((2, k)), np.ones((k, 2)), np.ones((2, 2))
    with pytest.raises(ValueError, match=match):
        distmm.gemm(a, b, c, alpha=1.0, beta=1.0, **kw)
    with pytest.raises(ValueError, match=match):
        distmm.gemm(a, b, c, alpha=0.0, beta=1.0, **kw)


inf, nan = np.inf, np.nan
#: complex values numpy's multiply by a scalar changes (1 * (inf + 0j) is inf + nanj)
NONFINITE = [inf, complex(inf, nan), complex(nan, inf), complex(0, -inf), complex(inf, inf), nan]


def _numpys_gemm(a, b, c, alpha, beta):
    """numpy's ``alpha * (a @ b) + beta * c``, scalars in the result dtype, with BLAS's
    rules: ``beta == 0`` reads no c, ``alpha == 0`` (or k == 0) no a and b."""
    dtype = np.result_type(a, b, c)
    al, be = dtype.type(alpha), dtype.type(beta)
    if al == 0 or a.shape[1] == 0:  # BLAS's C = beta * C: no zero product added
        return np.zeros(c.shape, dtype) if be == 0 else be * c
    prod = al * (a @ b)
    return prod if be == 0 else prod + be * c


def _form(z):
    """Each part of each element: NaN, or its value and sign (-0.0 is not 0.0)."""
    parts = np.stack([z.real, z.imag])
    return np.isnan(parts), np.where(np.isnan(parts), 0, parts), np.signbit(parts)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.slow
def test_complex_non_finite_values_and_reports_are_numpys_alpha_a_b_plus_beta_c(dtype):
    """An Inf or NaN in a, b or c, alpha and beta among 0, 1, -1, 1j and 2, m x n x k of
    1 x 1 x 1, 1 x 1 x 4, 3 x 4 x 1, 3 x 4 x 0 and 3 x 5 x 7: every element's parts (NaN,
    Inf, sign) and numpy's reports (warnings in order, the error under 'raise') are those
    of numpy's ``alpha * (a @ b) + beta * c``. alpha == 1 and beta == 1 were skipped
    (inf + 0j stayed, where numpy's 1 * (inf + 0j) is inf + nanj with "invalid value
    encountered in multiply"), and the scalars multiplied from the right, where numpy's
    complex loop reports an Inf times 0 in the other order or not at all (c = inf + nanj,
    beta = -1: numpy reports, gemm did not)."""
    rng = np.random.default_rng(11)
    bad = []
    for m, n, k in [(1, 1, 1), (1, 1, 4), (3, 4, 1), (3, 4, 0), (3, 5, 7)]:
        def ints(shape):
            return (rng.integers(-3, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dtype)

        for where, value in [(w, v) for w in "abc" for v in NONFINITE]:
            a, b, c = ints((m, k)), ints((k, n)), ints((m, n))
            x = {"a": a, "b": b, "c": c}[where]
            if not x.size:
                continue
            x[0, 0] = value
            for alpha, beta in itertools.product([0, 1, -1, 1j, 2], repeat=2):
                want = reported(lambda: _numpys_gemm(a, b, c, alpha, beta))
                got = reported(lambda: distmm.gemm(a, b, c, alpha=alpha, beta=beta,
                                                    engine="local"))
                nan_w, val_w, sign_w = _form(want[0])
                nan_g, val_g, sign_g = _form(got[0])
                same = (got[0].dtype == want[0].dtype and (nan_g == nan_w).all()
                        and (val_g == val_w).all() and (sign_g == sign_w).all())
                if not same or got[1:] != want[1:]:
                    bad.append(f"{m}x{n}x{k} {where}[0, 0]={value} alpha={alpha} "
                               f"beta={beta}: numpy {want[0].ravel()[0]} {want[1:]}, "
                               f"got {got[0].ravel()[0]} {got[1:]}")
    assert not bad, f"{len(bad)} differ, first: " + "\n".join(bad[:5])


def test_default_alpha_multiplies_a_complex_product_as_numpy_does():
    """gemm(a, b) is numpy's ``1 * (a @ b)`` (and BLAS's zgemm's, which multiplies by
    alpha = 1 too): an element inf + infj is nan + nanj, with numpy's "invalid value"; gemm
    gave matmul's inf + infj, silently."""
    a, b = np.array([[inf + 0j]]), np.array([[1 + 1j]])
    with np.errstate(all="ignore"):
        assert np.isinf((a @ b)[0, 0].real)
        got = distmm.gemm(a, b)
    assert np.isnan(got[0, 0].real) and np.isnan(got[0, 0].imag)
    with pytest.raises(FloatingPointError, match="invalid value encountered in multiply"):
        with np.errstate(all="raise"):
            distmm.gemm(a, b)



# -- scipy.linalg.blas ?gemm: the cases of scipy's own tests, and a sweep against them --------

#: BLAS's TRANSA as scipy's wrappers take it (0, 1, 2) for each of gemm's letters
SCIPY_TRANS = {"N": 0, "T": 1, "C": 2}


def _blas(dtype):
    blas = pytest.importorskip("scipy.linalg.blas")
    return {np.float32: blas.sgemm, np.float64: blas.dgemm, np.complex64: blas.cgemm,
            np.complex128: blas.zgemm}[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
def test_scipys_test_gemm_cases(dtype):
    """scipy's test_blas.py::TestFBLAS3Simple::test_gemm, its 1-element operands as the 1x1
    matrices scipy's wrapper makes of them (gemm takes 2-D operands only)."""
    f = _blas(dtype)
    one = lambda v: np.array([[v]], dtype)  # noqa: E731
    cases = [((3, one(3), one(-4)), {}), ((3, one(3), one(-4)), dict(beta=3, c=one(5)))]
    if np.dtype(dtype).kind == "c":
        cases += [((3j, one(3 - 4j), one(-4)), {}),
                  ((3j, one(3 - 4j), one(-4)), dict(beta=3, c=one(5j)))]
    for (alpha, a, b), kw in cases:
        got = distmm.gemm(a, b, kw.get("c"), alpha=alpha, beta=kw.get("beta", 0.0))
        want = f(alpha, a, b, **kw)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_scipys_cython_dgemm_transposes_and_shapes():
    """scipy's test_cython_blas.py::TestDGEMM: strided views and their transposes."""
    dgemm = _blas(np.float64)
    a = np.arange(12, dtype="d").reshape((3, 4))[:2, :2]
    b = np.arange(1, 13, dtype="d").reshape((4, 3))[:2, :2]
    for x, y in itertools.product((a, a.T), (b, b.T)):
        for ta, tb in itertools.product("NT", repeat=2):
            got = distmm.gemm(x, y, trans_a=ta, trans_b=tb)
            want = dgemm(1.0, x, y, trans_a=SCIPY_TRANS[ta], trans_b=SCIPY_TRANS[tb])
            np.testing.assert_array_equal(got, want)
    a = np.arange(6, dtype="d").reshape((3, 2))
    b = np.arange(-6, 2, dtype="d").reshape((2, 4))
    np.testing.assert_array_equal(distmm.gemm(a, b), a.dot(b))
    np.testing.assert_array_equal(distmm.gemm(b.T, a.T), b.T.dot(a.T))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
@pytest.mark.parametrize("family", ["numpy", "dask"])
@pytest.mark.slow
def test_against_scipys_gemm(dtype, family):
    """Every letter pair, alpha and beta (zero, one, others; complex ones for complex
    results), with and without c, on odd shapes: scipy's ?gemm's dtype and values, within
    the dtype's rounding (distmm rounds as numpy's matmul, not as this BLAS)."""
    f = _blas(dtype)
    rng = np.random.default_rng()
    tol = 1e-5 if dtype in (np.float32, np.complex64) else 1e-13
    scalars = [(1.0, 0.0), (2.5, 0.0), (1.0, 1.0), (-0.5, 2.0), (0.0, 1.5)]
    if np.dtype(dtype).kind == "c":
        scalars.append((1 - 2j, 0.5j))
    shapes = [(7, 5, 3), (1, 9, 13), (13, 1, 2)][:1 if family == "dask" else None]
    for (m, n, k), ta, tb in itertools.product(shapes, "NTC", "NTC"):
        a, b, c = _operands(rng, dtype, ta, tb, m=m, n=n, k=k)
        for alpha, beta in scalars:
            want = f(alpha, a, b, beta=beta, c=c, trans_a=SCIPY_TRANS[ta],
                     trans_b=SCIPY_TRANS[tb])
            x, y, z = (a, b, c)
            if family == "dask":
                da = pytest.importorskip("dask.array")
                x, y, z = da.from_array(a, chunks=4), da.from_array(b, chunks=3), c
            got = distmm.gemm(x, y, z, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb)
            if family == "dask":
                got = got.compute(scheduler="sync")
            assert got.dtype == want.dtype, (m, n, k, ta, tb, alpha, beta)
            scale = abs(alpha) * (np.abs(OPS[ta](a)) @ np.abs(OPS[tb](b))) + abs(beta) * abs(c)
            assert np.all(np.abs(got - want) <= tol * (scale + 1)), (m, n, k, ta, tb, alpha,
                                                                     beta)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_blas_zero_scalars_against_scipys_gemm(dtype):
    """beta == 0: c is not read (its NaN does not propagate), as in scipy's ?gemm; alpha ==
    0: A and B are not read, as the reference BLAS says (scipy's OpenBLAS dgemm reads them
    and gives NaN for a NaN in A: distmm follows the reference); k == 0: beta * c (scipy's
    wrapper refuses empty operands)."""
    f = _blas(dtype)
    rng = np.random.default_rng()
    a, b, c = _operands(rng, dtype, "N", "N", m=4, n=5, k=3)
    nan_c = np.full_like(c, np.nan)
    np.testing.assert_allclose(distmm.gemm(a, b, nan_c, beta=0.0), f(1.0, a, b, beta=0.0,
                                                                      c=nan_c), rtol=1e-13)
    nan_a = a.copy()
    nan_a[0, 0] = np.nan
    got = distmm.gemm(nan_a, b, c, alpha=0.0, beta=2.0)
    np.testing.assert_array_equal(got, 2.0 * c)
    got = distmm.gemm(np.ones((4, 0), dtype), np.ones((0, 5), dtype), c, alpha=3.0, beta=2.0)
    np.testing.assert_array_equal(got, 2.0 * c)


def test_scipys_transpose_codes_are_the_letters():
    """scipy's ?gemm codes 0, 1, 2 ('N', 'T', 'C') give what the letters give (they were
    refused as ValueError); other numbers still are."""
    rng = np.random.default_rng()
    for ta, tb in itertools.product("NTC", "NTC"):
        a, b, c = _operands(rng, np.complex128, ta, tb, m=5, n=3, k=4)
        codes = distmm.gemm(a, b, c, alpha=2.0, beta=-1.0, trans_a=SCIPY_TRANS[ta],
                            trans_b=np.int64(SCIPY_TRANS[tb]))
        letters = distmm.gemm(a, b, c, alpha=2.0, beta=-1.0, trans_a=ta, trans_b=tb)
        np.testing.assert_array_equal(codes, letters)
    for bad in (3, -1):
        with pytest.raises(ValueError, match="trans_a must be a bool, one of 'N', 'T', 'C'"):
            distmm.gemm(np.eye(2), np.eye(2), trans_a=bad)


@pytest.mark.parametrize("alpha, k", [(0.0, 5), (1.0, 0)])
def test_a_zero_products_dask_chunks_are_the_products(alpha, k):
    """alpha == 0 or k == 0 on dask operands: zeros (plus beta * c) in the chunks the
    product would have, op(a)'s rows by op(b)'s columns (dask's automatic chunks were
    one 9 x 5 chunk where the product has (3, 3, 3) x (3, 2))."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a = da.from_array(rng.standard_normal((9, k)), chunks=(3, 2))
    b = da.from_array(rng.standard_normal((k, 5)), chunks=(2, 3))
    got = distmm.gemm(a, b, alpha=alpha)
    assert got.chunks == ((3, 3, 3), (3, 2)), got.chunks
    np.testing.assert_array_equal(got.compute(scheduler="sync"), np.zeros((9, 5)))
    objects = distmm.gemm(a.astype(object), b.astype(object), alpha=alpha)
    assert objects.chunks == ((3, 3, 3), (3, 2)) and objects.dtype == object
    assert (objects.compute(scheduler="sync") == 0).all()


def test_where_gemm_differs_from_scipys_wrappers_on_purpose():
    """scipy's f2py wrappers reshape a 1-D or (1, m, k) operand to a matrix, drop a
    complex alpha's imaginary part for a real routine and cast every operand to the
    routine's dtype; gemm takes 2-D operands only, refuses a lossy scalar, and computes in
    numpy's promoted dtype (float32 operands with a float64 c give float64)."""
    dgemm, sgemm = _blas(np.float64), _blas(np.float32)
    rng = np.random.default_rng()
    a, b, c = (rng.standard_normal(s) for s in ((4, 3), (3, 5), (4, 5)))
    assert dgemm(3.0, np.array([3.0]), np.array([-4.0])).shape == (1, 1)
    with pytest.raises(ValueError, match="2-D"):
        distmm.gemm(np.array([3.0]), np.array([-4.0]))
    with pytest.raises(ValueError, match="2-D"):
        distmm.gemm(a[None], b)
    assert dgemm(1j, a, b).dtype == np.float64
    with pytest.raises(TypeError, match="complex"):
        distmm.gemm(a, b, alpha=1j)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    assert sgemm(1.0, a32, b32, beta=1.0, c=c).dtype == np.float32
    got = distmm.gemm(a32, b32, c, beta=1.0)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, a32.astype(np.float64) @ b32 + c, rtol=1e-13)


MPI_SCRIPT = """
import sys
import numpy as np
from mpi4py import MPI
import distmm
rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
a, b, c = np.ones((4, 3)), np.ones((3, 5)), np.arange(20.0).reshape(4, 5)
last = rank == size - 1
refused = {  # valid on every rank but the last
    "c of the wrong shape": dict(c=np.ones((5, 4)) if last else c),
    "alpha not a number": dict(alpha="2" if last else 2.0),
    "a bad trans_a": dict(trans_a="X" if last else "N"),
    "tile=0": dict(tile=0 if last else None),
    "alpha == 0 on one rank": dict(alpha=0.0 if last else 1.0),
    "beta differs": dict(beta=2.0 if last else 1.0),
    "c's values differ": dict(c=c + 1 if last else c),
}
lines = []  # printed by rank 0 alone at the end: mpiexec may interleave the ranks' writes
for what, kw in refused.items():
    kw = {"c": c, "beta": 1.0, **kw}
    try:
        distmm.gemm(a, b, kw.pop("c"), engine="mpi", **kw)
        lines.append(f"rank {rank}: {what}: no error")
    except (TypeError, ValueError) as exc:
        one_line = "\\n" not in str(exc)
        named = last or (str(exc).startswith("gemm: engine='mpi' needs")
                         and f"rank {size - 1}" in str(exc))
        lines.append(f"rank {rank}: {what}: {'ok' if one_line and named else 'BAD'} "
                     f"{type(exc).__name__}: {exc}")
# the ranks are in step after the refusals: a product of object operands, conjugated
z = (np.arange(12).reshape(3, 4) + 1j * np.arange(12).reshape(3, 4)[::-1]).astype(object)
got = distmm.gemm(z, z, c[:4, :4].astype(object), alpha=2, beta=-1, trans_a="C", engine="mpi")
want = 2 * (z.conj().T @ z) - c[:4, :4]
lines.append(f"rank {rank}: product: {'ok' if got.tolist() == want.tolist() else 'BAD'}")
for mine in MPI.COMM_WORLD.gather(lines) or []:
    print("\\n".join(mine), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_an_mpi_call_one_rank_refuses_or_makes_differently_raises_on_every_rank(tmp_path,
                                                                                mpirun):
    """gemm(engine="mpi") agrees on every rank's arguments before the engine, as matmul
    does: a call the last rank refuses left rank 0 waiting in the engine for ever (the
    timeout), alpha == 0 on one rank too, and a beta or c that differ gave each rank its
    own result."""
    script = tmp_path / "gemm_ranks.py"
    script.write_text(MPI_SCRIPT)
    r = mpirun(2, script, timeout=90)
    lines = [line for line in r.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 16 and all(": ok" in line for line in lines), r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
