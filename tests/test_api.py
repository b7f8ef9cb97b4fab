"""distmm.matmul and distmm.gemm against numpy, on the in-process engine.

One test body per backend (numba, blas): shapes with odd sizes, ragged tiles,
empty dimensions, 1-D and batched operands, every numeric dtype, views.
"""
from __future__ import annotations

from fractions import Fraction

import importlib.util
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distmm
from conftest import assert_close, assert_matches_numpy, random_array

CPU_BACKENDS = ["numba", "blas"]

SHAPES = [
    ((7, 33), (33, 5)),
    ((1, 9), (9, 1)),
    ((9, 1), (1, 9)),
    ((33, 7), (7, 33)),
    ((4097, 3), (3, 2)),
    ((5, 0), (0, 3)),
    ((0, 4), (4, 6)),
    ((6, 4), (4, 0)),
    ((65, 130), (130, 67)),
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("a_shape,b_shape", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
@pytest.mark.parametrize("tile", [None, 4, (5, 7, 3)], ids=["auto", "4", "5x7x3"])
def test_shapes_and_ragged_tiles(backend, a_shape, b_shape, tile):
    rng = np.random.default_rng()
    a = random_array(rng, a_shape, np.float64)
    b = random_array(rng, b_shape, np.float64)
    assert_matches_numpy(distmm.matmul(a, b, backend=backend, tile=tile), a, b)


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "longdouble", "complex64", "complex128"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype(backend, dtype):
    rng = np.random.default_rng()
    a = random_array(rng, (13, 21), dtype)
    b = random_array(rng, (21, 11), dtype)
    with np.errstate(over="ignore"):
        assert_matches_numpy(distmm.matmul(a, b, backend=backend, tile=(4, 6, 5)), a, b)


@pytest.mark.parametrize("a_dtype,b_dtype", [("int8", "uint8"), ("uint64", "int64"), ("bool", "int32"),
                                             ("float16", "float32"), ("int32", "float32"),
                                             ("float32", "complex64"), ("uint8", "bool")])
def test_mixed_dtypes_follow_numpy(a_dtype, b_dtype):
    rng = np.random.default_rng()
    a = random_array(rng, (9, 17), a_dtype)
    b = random_array(rng, (17, 8), b_dtype)
    with np.errstate(over="ignore"):
        assert_matches_numpy(distmm.matmul(a, b, backend="numba", tile=5), a, b)


def test_integer_wraparound_is_numpys():
    a = np.array([[100, 100, 100]], dtype=np.int8)
    b = np.array([[2], [2], [2]], dtype=np.int8)
    np.testing.assert_array_equal(distmm.matmul(a, b, tile=1), np.matmul(a, b))
    big = np.full((2, 40), 2**62, dtype=np.int64)
    np.testing.assert_array_equal(distmm.matmul(big, big.T, tile=(1, 1, 3)), np.matmul(big, big.T))
    ub = np.full((3, 50), 2**63 + 5, dtype=np.uint64)
    np.testing.assert_array_equal(distmm.matmul(ub, ub.T, backend="numba", tile=7), np.matmul(ub, ub.T))


def test_bool_stays_bool_across_k_splits():
    rng = np.random.default_rng()
    a = rng.random((6, 400)) < 0.01
    b = rng.random((400, 5)) < 0.01
    got = distmm.matmul(a, b, tile=(3, 3, 16))
    assert got.dtype == np.bool_
    assert got.view(np.uint8).max() <= 1
    np.testing.assert_array_equal(got, np.matmul(a, b))


def test_object_dtype_is_exact():
    a = np.array([[Fraction(1, 3), 2, 10**30], [1, Fraction(5, 7), -1]], dtype=object)
    b = np.array([[1, 2], [Fraction(1, 2), 3], [10**30, 1]], dtype=object)
    got = distmm.matmul(a, b, tile=1)
    assert got.dtype == object
    np.testing.assert_array_equal(got, np.matmul(a, b))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_and_inf_propagate(backend):
    a = np.ones((5, 8))
    b = np.ones((8, 4))
    a[1, 3] = np.nan
    a[2, 0] = np.inf
    b[0, 2] = 0.0  # inf * 0 -> nan
    b[5, 1] = -np.inf
    got = distmm.matmul(a, b, backend=backend, tile=(2, 2, 3))
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got, np.matmul(a, b))


@pytest.mark.parametrize("a_shape,b_shape", [
    ((7,), (7,)), ((7,), (7, 3)), ((4, 7), (7,)), ((2, 3, 4, 5), (5,)), ((5,), (3, 5, 2)),
    ((2, 1, 4, 5), (3, 5, 6)), ((1, 3, 3), (7, 3, 3)), ((3, 0, 2), (2, 4)), ((0, 2, 3), (3, 2)),
])
def test_vectors_and_batches_broadcast(a_shape, b_shape):
    rng = np.random.default_rng()
    a = random_array(rng, a_shape, np.float64)
    b = random_array(rng, b_shape, np.float64)
    got = distmm.matmul(a, b, tile=2)
    assert_matches_numpy(got, a, b)
    if a.ndim == b.ndim == 1:
        assert isinstance(got, np.floating)  # numpy gives a scalar, not a 0-d array


def test_array_likes_and_views():
    rng = np.random.default_rng()
    a = np.asfortranarray(random_array(rng, (31, 17), np.float64))
    b = random_array(rng, (42, 93), np.float64)[::2, ::3].T  # strided, transposed view (31, 21)
    assert_matches_numpy(distmm.matmul(a.T, b, tile=8), a.T, b)
    assert distmm.matmul([[1, 2], [3, 4]], [5, 6]).tolist() == [17, 39]
    assert distmm.matmul([[True, False]], [[True], [True]]).tolist() == [[True]]


def test_inputs_are_not_modified():
    rng = np.random.default_rng()
    a = random_array(rng, (20, 30), np.float32)
    b = random_array(rng, (30, 10), np.float32)
    a0, b0 = a.copy(), b.copy()
    distmm.matmul(a, b, tile=(7, 3, 4), backend="numba")
    distmm.gemm(a, b, np.ones((20, 10), np.float32), alpha=2.0, beta=3.0)
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)


def test_out_argument_like_numpy():
    rng = np.random.default_rng()
    a = random_array(rng, (6, 5), np.float64)
    b = random_array(rng, (5, 4), np.float64)
    out = np.full((6, 4), np.nan, dtype=np.float32)
    got = distmm.matmul(a, b, out=out, tile=3)
    assert got is out
    np.testing.assert_allclose(out, a @ b, rtol=1e-6)
    # out may alias an input, as with numpy
    sq = random_array(rng, (5, 5), np.float64)
    want = sq @ sq
    distmm.matmul(sq, sq.copy(), out=sq, tile=2)
    assert_close(sq, want)
    with pytest.raises(ValueError, match=r"non-broadcastable output operand with shape \(6, 5\)"):
        distmm.matmul(a, b, out=np.empty((6, 5)))
    with pytest.raises(TypeError, match=r"Cannot cast ufunc 'matmul' output .*same_kind"):
        distmm.matmul(a, b, out=np.empty((6, 4), dtype=np.int64))


# -- numpy parity: cases from numpy's own matmul tests ------------------------

def test_out_is_positional_as_in_numpy():
    rng = np.random.default_rng()
    a, b = rng.standard_normal((7, 3)), rng.standard_normal((3, 5))
    out = np.full((7, 5), np.nan)
    assert distmm.matmul(a, b, out) is out
    assert_close(out, np.matmul(a, b))


@pytest.mark.parametrize("out_shape", [(4, 6, 5), (1, 6, 5)], ids=["batch4", "batch1"])
def test_result_broadcasts_into_a_larger_out_as_numpy_does(out_shape):
    rng = np.random.default_rng()
    a, b = rng.standard_normal((6, 3)), rng.standard_normal((3, 5))
    want, got = np.full(out_shape, np.nan), np.full(out_shape, np.nan)
    np.matmul(a, b, want)
    distmm.matmul(a, b, got)
    assert_close(got, want)


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [
    ((1, 6, 3), (3, 5), (6, 5)),        # a batch of one left out of out
    ((1, 1, 6, 3), (1, 3, 5), (6, 5)),
    ((1, 3), (3, 5), (5,)),             # a row's one left out
    ((1, 3), (3,), ()),
    ((3,), (3,), (1, 1)),
])
def test_out_may_leave_out_leading_ones_as_numpys(a_shape, b_shape, out_shape):
    """numpy fills an ``out`` that leaves out leading dimensions of size 1 (its flexible core
    dimensions too); distmm refused it as non-broadcastable."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    want, got = np.full(out_shape, np.nan), np.full(out_shape, np.nan)
    np.matmul(a, b, want)
    assert distmm.matmul(a, b, got) is got
    assert_close(got, want)


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [
    ((6, 3), (3, 5), (6, 4)),        # core dimension differs
    ((6, 3), (3, 5), (5,)),          # too few dimensions
    ((2, 6, 3), (3, 5), (3, 6, 5)),  # batch does not broadcast
    ((2, 6, 3), (3, 5), (6, 5)),     # a batch of two left out of out
    ((1, 3), (3, 1), ()),            # numpy's flexible dimensions refuse it
    ((1, 6, 3), (3, 1), (6,)),
])
def test_out_that_cannot_hold_the_result_is_refused_like_numpy(a_shape, b_shape, out_shape):
    a, b, out = np.ones(a_shape), np.ones(b_shape), np.zeros(out_shape)
    with pytest.raises(ValueError):
        np.matmul(a, b, out)
    with pytest.raises(ValueError, match="non-broadcastable output operand"):
        distmm.matmul(a, b, out)
    assert not out.any()  # refused before any work


def test_a_complex_to_real_loop_warns_as_often_as_numpys():
    """``dtype=float, casting="unsafe"`` on complex operands: numpy's two ComplexWarnings
    (one a cast), on the first call too (distmm's dtype probe on empty operands added two)."""
    from distmm.plan import _ufunc_dtype

    x = np.ones((2, 2), complex)
    _ufunc_dtype.cache_clear()
    for out in (None, np.zeros((2, 2))):
        counts = []
        for f in (np.matmul, distmm.matmul):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                f(x, x, out=out, dtype=float, casting="unsafe")
            counts.append([w.category for w in seen])
        assert counts[1] == counts[0] and counts[0], counts


def test_keywords_numpy_refuses_by_type():
    """A numpy scalar as ``out`` and a ``subok`` that is not True or False are TypeErrors in
    numpy (distmm: a ValueError "read-only", and a result)."""
    x = np.ones((2, 2))
    for f in (np.matmul, distmm.matmul):
        with pytest.raises(TypeError):
            f(np.ones(2), np.ones(2), out=np.float64(0))
        for subok in (0, 1, None, np.True_):
            with pytest.raises(TypeError, match="'subok' must be a boolean"):
                f(x, x, subok=subok)
    assert (distmm.matmul(x, x, subok=False) == 2).all()


@pytest.mark.parametrize("b_shape,out_dtype", [((3, 5), "f8"), ((4, 5), "f8"), ((3, 5), "i1")])
def test_read_only_out_is_numpys_first_error(b_shape, out_dtype):
    """numpy refuses a read-only out before shapes and casts; distmm ran the whole product
    (on a cluster too) and failed writing it."""
    out = np.zeros((2, 5), out_dtype)
    out.flags.writeable = False
    a, b = np.ones((2, 3)), np.ones(b_shape)
    with pytest.raises(ValueError, match="output array is read-only"):
        np.matmul(a, b, out=out)
    with pytest.raises(ValueError, match="matmul: output array is read-only"):
        distmm.matmul(a, b, out=out)
    with pytest.raises(ValueError, match="matmul: output array is read-only"):
        distmm.matmul(a, b, out=(out,))


@pytest.mark.parametrize("t", [np.longlong, np.int64, np.intc, np.ulonglong, np.float32,
                               np.longdouble, np.bool_, np.complex128])
def test_vector_dot_vector_is_numpy_scalar_type(t):
    a = (np.arange(1, 4) % 2).astype(t)
    want, got = np.matmul(a, a), distmm.matmul(a, a)
    assert type(got) is type(want)
    assert got == want


def test_void_operand_is_a_type_error_like_numpy():
    with pytest.raises(TypeError):
        np.matmul(np.arange(10), np.void(b"abc"))
    with pytest.raises(TypeError):
        distmm.matmul(np.arange(10), np.void(b"abc"))


# -- errors, raised before any work ------------------------------------------

def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(5, 2\)"):
        distmm.matmul(np.ones((3, 4)), np.ones((5, 2)))
    with pytest.raises(ValueError, match="do not broadcast"):
        distmm.matmul(np.ones((2, 3, 4)), np.ones((3, 4, 5)))
    with pytest.raises(ValueError):
        distmm.matmul(np.ones(3), np.ones(4))


@pytest.mark.parametrize("scalar_side", ["a", "b"])
def test_zero_dim_operand_is_value_error(scalar_side):
    args = (np.float64(2.0), np.ones((2, 2))) if scalar_side == "a" else (np.ones((2, 2)), 3)
    with pytest.raises(ValueError, match=f"operand {scalar_side} is 0-dimensional"):
        distmm.matmul(*args)


@pytest.mark.parametrize("bad", [np.array([["a", "b"]]), np.zeros((1, 2), "M8[s]"),
                                 np.zeros((1, 2), "m8[s]"), np.zeros((1, 2), "i4,i4")])
def test_non_numeric_dtype_is_type_error(bad):
    with pytest.raises(TypeError, match="dtype"):
        distmm.matmul(bad, np.ones((2, 2)))


def test_bad_engine_and_backend():
    with pytest.raises(ValueError, match="engine"):
        distmm.matmul(np.ones((2, 2)), np.ones((2, 2)), engine="spark")
    with pytest.raises(ValueError, match="backend"):
        distmm.matmul(np.ones((2, 2)), np.ones((2, 2)), backend="magic")
    with pytest.raises(ValueError, match="tile"):
        distmm.matmul(np.ones((2, 2)), np.ones((2, 2)), tile=0)


# -- gemm --------------------------------------------------------------------

@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (-2.5, 0.5), (0.0, 2.0), (1.0, 1.0)])
def test_gemm_blas_semantics(trans_a, trans_b, alpha, beta):
    rng = np.random.default_rng()
    m, n, k = 22, 23, 24  # PBLAS-style odd sizes
    a = random_array(rng, (k, m) if trans_a else (m, k), np.float64)
    b = random_array(rng, (n, k) if trans_b else (k, n), np.float64)
    c = random_array(rng, (m, n), np.float64)
    got = distmm.gemm(a, b, c, alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b, tile=5)
    want = alpha * ((a.T if trans_a else a) @ (b.T if trans_b else b)) + beta * c
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_gemm_beta_zero_ignores_nan_in_c_and_k_zero_gives_beta_c():
    a = np.ones((3, 2))
    b = np.ones((2, 4))
    c = np.full((3, 4), np.nan)
    np.testing.assert_array_equal(distmm.gemm(a, b, c, beta=0.0), np.full((3, 4), 2.0))
    c2 = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(distmm.gemm(np.ones((3, 0)), np.ones((0, 4)), c2, beta=3.0), 3 * c2)
    # alpha == 0: A and B are not read (BLAS), so NaN there does not propagate
    np.testing.assert_array_equal(distmm.gemm(a * np.nan, b, c2, alpha=0.0, beta=1.0), c2)


@pytest.mark.parametrize("case", ["alpha-0", "k-0"])
def test_gemm_zero_product_of_dask_object_operands_is_beta_c(case):
    """alpha == 0 or k == 0 makes a zero product; dask's automatic chunks refused it for
    object dtype (NotImplementedError at the call)."""
    da = pytest.importorskip("dask.array")
    k = 0 if case == "k-0" else 2
    a = da.from_array(np.arange(2 * k).reshape(2, k).astype(object), chunks=-1)
    b, c = np.ones((k, 2), object), np.full((2, 2), 10**20, object)  # beyond int64
    got = distmm.gemm(a, b, c, alpha=0 if case == "alpha-0" else 1, beta=1).compute()
    assert got.dtype == object and got.tolist() == c.tolist()


def test_gemm_integers_wrap_and_reject_fractional_scalars():
    a = np.full((2, 3), 100, dtype=np.int8)
    b = np.full((3, 2), 2, dtype=np.int8)
    c = np.full((2, 2), 7, dtype=np.int8)
    got = distmm.gemm(a, b, c, alpha=3, beta=-2)
    with np.errstate(over="ignore"):
        want = (np.int8(3) * np.matmul(a, b) + np.int8(-2) * c).astype(np.int8)
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="alpha"):
        distmm.gemm(a, b, c, alpha=0.5)


def test_gemm_errors():
    with pytest.raises(ValueError, match="2-D"):
        distmm.gemm(np.ones(3), np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"c has shape \(2, 2\)"):
        distmm.gemm(np.ones((3, 4)), np.ones((4, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(3, 2\)"):
        distmm.gemm(np.ones((3, 4)), np.ones((3, 2)))


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64, np.float64])
def test_gemm_blas_transpose_letters(dtype):
    """TRANSA / TRANSB as BLAS and PBLAS spell them: 'N', 'T', 'C' (conjugate transpose),
    any case; 'C' is 'T' for real types."""
    rng = np.random.default_rng()
    m, n, k = 7, 9, 33
    a = random_array(rng, (k, m), dtype)
    b = random_array(rng, (n, k), dtype)
    c = random_array(rng, (m, n), dtype)
    ops = {"N": lambda x: x, "T": lambda x: x.T, "C": lambda x: x.conj().T}
    for ta, tb in (("C", "T"), ("t", "c"), ("C", "C")):
        got = distmm.gemm(a, b, c, alpha=0.5, beta=-1.0, trans_a=ta, trans_b=tb, tile=4)
        want = 0.5 * (ops[ta.upper()](a) @ ops[tb.upper()](b)) - c
        assert got.dtype == np.dtype(dtype)
        tol = 1e-5 if np.dtype(dtype).itemsize <= 8 and np.dtype(dtype).kind == "c" else 1e-12
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    a0 = a.copy()
    distmm.gemm(a, np.ones((k, 2), dtype), trans_a="C")
    np.testing.assert_array_equal(a, a0)  # the conjugate is a copy; the input is untouched
    for bad in ("X", "transpose", 3, None):  # 0, 1, 2: scipy's codes
        with pytest.raises(ValueError, match="trans_a"):
            distmm.gemm(a, b.T, trans_a=bad)


def test_gemm_promotes_to_c_dtype():
    rng = np.random.default_rng()
    a = random_array(rng, (5, 6), np.float32)
    b = random_array(rng, (6, 7), np.float32)
    c = random_array(rng, (5, 7), np.float64)
    got = distmm.gemm(a, b, c, alpha=1.0, beta=1.0)
    assert got.dtype == np.float64
    assert_close(got, a.astype(np.float64) @ b + c)


# -- randomized sweep ----------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(0, 40), n=st.integers(0, 40), k=st.integers(0, 70),
    tm=st.integers(1, 17), tn=st.integers(1, 17), tk=st.integers(1, 33),
    dtype=st.sampled_from(["float32", "float64", "int64", "int16", "uint32", "bool", "complex128"]),
    backend=st.sampled_from(CPU_BACKENDS),
    fortran=st.booleans(),
)
def test_randomized_sweep(m, n, k, tm, tn, tk, dtype, backend, fortran):
    rng = np.random.default_rng()
    a = random_array(rng, (m, k), dtype)
    b = random_array(rng, (k, n), dtype)
    if fortran:
        a = np.asfortranarray(a)
    with np.errstate(over="ignore"):
        assert_matches_numpy(distmm.matmul(a, b, tile=(tm, tn, tk), backend=backend), a, b)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_warmup_without_cupy_says_what_is_missing():
    with pytest.raises(ImportError, match="cupy"):
        distmm.warmup()


# -- numpy's ufunc protocol: keywords, out tuples, subclasses, overrides, error order --------

def _numpy_and_distmm(call):
    """``call(np)`` and ``call(distmm)``: each the result, or the exception's exact type."""
    outcomes = []
    for mod in (np, distmm):
        try:
            outcomes.append(call(mod))
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            outcomes.append(type(exc))
    return outcomes


def _same_outcome(want, got):
    if isinstance(want, type):
        assert got is want, f"numpy raised {want.__name__}, distmm gave {got!r}"
        return
    assert type(got) is type(want)
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if isinstance(want, np.ma.MaskedArray):
        np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(want))


class _Sub(np.ndarray):
    pass


_A, _B = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
_STACK_A, _STACK_B = np.arange(60.0).reshape(3, 5, 4), np.arange(24.0).reshape(3, 4, 2)
_M = np.matrix([[1.0, 2.0], [3.0, 4.0]])
_MASKED = np.ma.array([[1.0, 2.0], [3.0, 4.0]], mask=[[0, 1], [0, 0]])
PROTOCOL_CASES = {
    # numpy checks the loop and the casts before any shape
    "out-cast-before-shape": lambda m: m.matmul(_A, _B, out=np.empty((5, 5), np.int64)),
    "out-cast-before-k": lambda m: m.matmul(_A, _A, out=np.empty((2, 4), np.int64)),
    "no-loop-str": lambda m: m.matmul(np.array([["a"]]), np.array([["b"]])),
    "no-loop-before-k": lambda m: m.matmul(np.zeros((2, 3), "m8[s]"), np.zeros((2, 3), "m8[s]")),
    "out-tuple": lambda m: m.matmul(_A, _B, out=(np.zeros((2, 4)),)),
    "out-tuple-none": lambda m: m.matmul(_A, _B, out=(None,)),
    "out-tuple-two": lambda m: m.matmul(_A, _B, out=(np.zeros((2, 4)), np.zeros((2, 4)))),
    "dtype-float32": lambda m: m.matmul(_A, _B, dtype=np.float32),
    "dtype-from-ints": lambda m: m.matmul(np.arange(4).reshape(2, 2), np.eye(2, dtype=int),
                                          dtype="float16"),
    "dtype-refused": lambda m: m.matmul(_A, _B, dtype=np.int64),
    "dtype-unknown": lambda m: m.matmul(_A, _B, dtype="bogus"),
    "casting-no": lambda m: m.matmul(np.ones((2, 2), np.int8), np.ones((2, 2), np.float32),
                                     casting="no"),
    "casting-unsafe-out": lambda m: m.matmul(_A, _B, out=np.zeros((2, 4), np.int32),
                                             casting="unsafe"),
    "casting-unknown": lambda m: m.matmul(_A, _B, casting="bogus"),
    "order-unknown": lambda m: m.matmul(_A, _B, order="X"),
    "order-none": lambda m: m.matmul(_A, _B, order=None),
    "order-not-str": lambda m: m.matmul(_A, _B, order=1),
    "matrix": lambda m: m.matmul(_M, _M),
    "matrix-vector": lambda m: m.matmul(_M, [1.0, 1.0]),
    "vector-matrix": lambda m: m.matmul([1.0, 2.0], _M),
    "masked-left": lambda m: m.matmul(_MASKED, np.ones((2, 2))),
    "masked-right": lambda m: m.matmul(np.ones((2, 2)), _MASKED),
    "subclass-right": lambda m: m.matmul(np.ones((2, 3)), np.ones((3, 2)).view(_Sub)),
    "subclass-vectors": lambda m: m.matmul(np.ones(3).view(_Sub), np.ones(3)),
    "subok-false": lambda m: m.matmul(np.ones((2, 3)).view(_Sub), np.ones((3, 2)), subok=False),
    "subclass-out": lambda m: m.matmul(_A, _B, out=np.zeros((2, 4)).view(_Sub)),
    "axes-operands": lambda m: m.matmul(_STACK_A.transpose(1, 2, 0), _STACK_B,
                                        axes=[(0, 1), (1, 2), (1, 2)]),
    "axes-result": lambda m: m.matmul(_STACK_A, _STACK_B, axes=[(1, 2), (1, 2), (0, 1)]),
    "axes-vector": lambda m: m.matmul(np.arange(4.0), _STACK_B, axes=[(0,), (1, 2), (1,)]),
    "axes-vectors": lambda m: m.matmul(np.arange(4.0), np.arange(4.0), axes=[0, 0, ()]),
    "axes-out": lambda m: m.matmul(_STACK_A, _STACK_B, out=np.zeros((5, 2, 3)),
                                   axes=[(1, 2), (1, 2), (0, 1)]),
    "axes-two-entries": lambda m: m.matmul(_STACK_A, _STACK_B, axes=[(0, 1), (0, 1)]),
    "axes-out-of-bounds": lambda m: m.matmul(_STACK_A, _STACK_B, axes=[(0, 9), (0, 1), (0, 1)]),
    "axis": lambda m: m.matmul(_STACK_A, _STACK_B, axis=0),
    # a Python scalar is weak (NEP 50): under numpy 2 a strict cast passes and the missing
    # dimension is the error; under numpy 1.26 the cast fails first
    "scalar-casting-no": lambda m: m.matmul(0, np.ones(2), casting="no"),
    "scalar-float-into-ints": lambda m: m.matmul(1.5, np.ones(2, int), casting="no"),
    "scalar-object-equiv": lambda m: m.matmul(0, np.ones(2, object), casting="equiv"),
    "scalar-dtype": lambda m: m.matmul(np.ones(2), 3, dtype="f4"),
}


@pytest.mark.parametrize("case", sorted(PROTOCOL_CASES))
def test_numpy_protocol_cases_match_numpy(case):
    want, got = _numpy_and_distmm(PROTOCOL_CASES[case])
    _same_outcome(want, got)


@pytest.mark.parametrize("order", ["K", "A", "C", "F", "f"])
@pytest.mark.parametrize("layout", ["C", "F"])
def test_order_gives_numpys_memory_layout(order, layout):
    rng = np.random.default_rng()
    a = np.asarray(random_array(rng, (5, 7), np.float64), order=layout)
    b = np.asarray(random_array(rng, (7, 6), np.float64), order=layout)
    want, got = np.matmul(a, b, order=order), distmm.matmul(a, b, order=order, tile=3)
    assert (got.flags.c_contiguous, got.flags.f_contiguous) == (want.flags.c_contiguous,
                                                                 want.flags.f_contiguous)
    assert_close(got, a @ b)


def _stack(rng, shape, layout):
    """A float stack of ``shape`` laid out as ``layout`` says (batch axes permuted, reversed,
    broadcast, or Fortran)."""
    if layout == "permuted":
        return rng.standard_normal((shape[1], shape[0]) + shape[2:]).transpose(1, 0, 2, 3)
    if layout == "reversed":
        return rng.standard_normal(shape)[::-1]
    if layout == "broadcast":
        return np.broadcast_to(rng.standard_normal((1,) + shape[1:]), shape).transpose(1, 0, 2, 3)
    if layout == "fortran":
        return np.asfortranarray(rng.standard_normal(shape))
    return rng.standard_normal(shape)


@pytest.mark.parametrize("layout", ["permuted", "reversed", "broadcast", "fortran", "C"])
@pytest.mark.parametrize("other", ["matrix", "vector", "C-stack", "same"])
def test_order_k_keeps_a_stacks_batch_order_as_numpy(layout, other):
    """numpy's default ``order="K"`` lays a stack's result out in the order of the operands'
    batch axes (distmm gave C order); three calls, so the call cache's answers too."""
    rng = np.random.default_rng()
    a = _stack(rng, (3, 2, 5, 4), layout)
    b = {"matrix": rng.standard_normal((4, 6)), "vector": rng.standard_normal(4),
         "C-stack": rng.standard_normal(a.shape[:2] + (4, 6)),
         "same": _stack(rng, (3, 2, 4, 6), layout)}[other]
    want = np.matmul(a, b)
    for _ in range(3):
        got = distmm.matmul(a, b)
        assert got.strides == want.strides
        assert_close(got, want)


_LAYOUT_PAIRS = {
    "column-row": (np.ones((3, 1)), np.ones((1, 5))),  # C- and F-contiguous at once
    "fortran-stack-vector": (np.asfortranarray(np.ones((2, 3, 4))), np.ones(4)),
    "empty-bool": (np.ones((2, 0), bool), np.ones((0, 3), bool)),
    "int64": (np.ones((3, 4), np.int64), np.ones((4, 5), np.int64)),  # the numba kernel's C
    "int64-matrix-vector": (np.ones((3, 4), np.int64), np.ones(4, np.int64)),
    "fortran-float": (np.asfortranarray(np.ones((3, 4))), np.asfortranarray(np.ones((4, 5)))),
}


@pytest.mark.parametrize("order", ["K", "A", "C", "F"])
@pytest.mark.parametrize("pair", sorted(_LAYOUT_PAIRS))
@pytest.mark.parametrize("backend", ["numba", "blas"])
def test_result_strides_are_numpys(pair, order, backend):
    """numpy's ``order="A"`` is Fortran when every operand is F-contiguous, even when also
    C-contiguous; and a result is always contiguous (the numba kernel's padded rows showed
    through small int64 products as a non-contiguous view)."""
    a, b = _LAYOUT_PAIRS[pair]
    want = np.matmul(a, b, order=order)
    got = distmm.matmul(a, b, order=order, backend=backend)
    assert (got.strides, got.flags.c_contiguous, got.flags.f_contiguous) == (
        want.strides, want.flags.c_contiguous, want.flags.f_contiguous)
    np.testing.assert_array_equal(got, want)


def test_out_tuple_returns_the_array_itself():
    out = np.full((2, 4), np.nan)
    assert distmm.matmul(_A, _B, out=(out,)) is out
    np.testing.assert_array_equal(out, _A @ _B)


def test_memmap_operands_give_a_plain_array_as_numpy(tmp_path):
    mm = np.memmap(tmp_path / "a.bin", dtype=np.float64, mode="w+", shape=(9, 9))
    mm[:] = np.arange(81.0).reshape(9, 9)
    for a, b in ((mm, mm), (mm, np.eye(9)), (np.eye(9), mm)):
        want, got = np.matmul(a, b), distmm.matmul(a, b, tile=4)
        assert type(got) is type(want)
        np.testing.assert_array_equal(got, want)


class _Overrides:
    """An operand with its own ``__array_ufunc__``: numpy hands it the call."""

    def __init__(self, data):
        self.data = np.asarray(data)
        self.shape, self.dtype, self.ndim = self.data.shape, self.data.dtype, self.data.ndim

    def __array__(self, dtype=None, copy=None):
        return self.data

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return ("handled", ufunc.__name__, tuple(sorted(kwargs)), kwargs.get("dtype"))


def test_an_array_ufunc_override_takes_the_call_as_in_numpy():
    x = _Overrides(np.ones((2, 2)))
    for kw in ({"dtype": np.float32}, {}, {"order": "F", "casting": "unsafe"}):
        want = np.matmul(x, np.ones((2, 2)), **kw)
        assert want[:2] == ("handled", "matmul")
        assert distmm.matmul(x, np.ones((2, 2)), **kw) == want, kw
        assert distmm.matmul(np.ones((2, 2)), x, **kw) == np.matmul(np.ones((2, 2)), x, **kw)


def test_object_sums_are_numpys_when_k_could_be_split():
    """numpy adds an object element's k products in one ascending sum; partial sums of k
    groups round differently (here 1e16 + seven ones)."""
    a = np.array([[1e16] + [1.0] * 7], dtype=object)
    b = np.ones((8, 1), dtype=object)
    want = np.matmul(a, b)
    assert distmm.make_plan(1, 1, 8, "O", workers=4, tile=1).k_splits == 1
    for tile in (None, 1, 3):
        got = distmm.matmul(a, b, tile=tile)
        assert got.dtype == object and got[0, 0] == want[0, 0]


def test_a_tile_that_is_not_an_int_is_named():
    with pytest.raises(TypeError, match=r"tile must be an int .*1\.5"):
        distmm.matmul(_A, _B, tile=1.5)


@pytest.mark.parametrize("dtype,kw", [
    (np.int8, dict(alpha=300)), (np.uint8, dict(beta=-1)), (np.int64, dict(alpha=2**70)),
    (np.int64, dict(alpha=float(2**63))), (np.float16, dict(alpha=1e6)),
    (np.float32, dict(beta=1e300)), (np.int64, dict(alpha=1 + 1j)),
], ids=["int8-300", "uint8-minus1", "int64-2e70", "int64-2e63", "float16-1e6", "float32-1e300",
        "int64-complex"])
def test_gemm_scalars_out_of_the_results_range_are_type_errors(dtype, kw):
    x = np.ones((2, 2), dtype)
    with pytest.raises(TypeError, match="alpha|beta"):
        distmm.gemm(x, x, x, **kw)


def test_gemm_takes_complex_scalars_without_an_imaginary_part():
    x = np.ones((2, 3), np.float32)
    y = np.ones((3, 2), np.float32)
    for alpha in (2 + 0j, np.complex64(2), np.complex128(2 + 0j)):
        got = distmm.gemm(x, y, alpha=alpha)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.full((2, 2), 6.0, np.float32))
    i = np.ones((2, 2), np.int64)
    np.testing.assert_array_equal(distmm.gemm(i, i, alpha=3 + 0j), np.full((2, 2), 6))


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.float64])
def test_gemm_takes_exact_decimals_and_0d_arrays_as_scalars(dtype):
    """An integral Decimal scales an integer result exactly, and a 0-d array is its element,
    as numpy takes one for a scalar (both were refused)."""
    from decimal import Decimal

    rng = np.random.default_rng()
    x, y = rng.integers(-3, 4, (3, 4)).astype(dtype), rng.integers(-3, 4, (4, 5)).astype(dtype)
    want = (2 * np.matmul(x.astype(np.int64), y.astype(np.int64))).astype(dtype)
    for alpha in (Decimal(2), Decimal("2.000"), np.array(2), np.array(2.0)):
        got = distmm.gemm(x, y, alpha=alpha)
        assert got.dtype == want.dtype and np.array_equal(got, want), alpha
    if np.dtype(dtype).kind == "i":
        for alpha in (Decimal("2.5"), Decimal("NaN"), np.array(0.5)):
            with pytest.raises(TypeError, match="without rounding"):
                distmm.gemm(x, y, alpha=alpha)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex128])
def test_gemm_takes_fractions_and_decimals_as_scalars(dtype):
    """numpy has no isfinite loop for Fraction or Decimal: their finiteness is their own."""
    from decimal import Decimal
    from fractions import Fraction

    rng = np.random.default_rng()
    x, y, c = (rng.standard_normal(s).astype(dtype) for s in ((3, 4), (4, 5), (3, 5)))
    want = dtype(0.5) * np.matmul(x, y) + dtype(-1.25) * c
    for alpha, beta in ((Fraction(1, 2), Fraction(-5, 4)), (Decimal("0.5"), Decimal("-1.25"))):
        got = distmm.gemm(x, y, c, alpha=alpha, beta=beta)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=2e-3 if dtype == np.float16 else 1e-5)
    for big in (Decimal("1e400"), Fraction(10**400)):
        with pytest.raises(TypeError, match="out of range"):
            distmm.gemm(x.astype(np.float32), y.astype(np.float32), alpha=big)


def test_a_dtype_keyword_is_never_mistaken_for_the_default():
    """``np.dtype("float64") == None`` is True in numpy: a cached call without ``dtype=``
    must not answer one with it."""
    i = np.arange(4).reshape(2, 2)
    distmm.matmul(i, i)
    distmm.matmul(i, i)  # cached now
    for dt in (np.dtype("float64"), np.float64, "float64"):
        got = distmm.matmul(i, i, dtype=dt)
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, np.matmul(i, i, dtype=dt))


@pytest.mark.parametrize("kw", [
    dict(dtype=np.complex128, casting="no", axis=0),
    dict(dtype=np.int32, casting="same_kind", axes=[(-2, -1), (-2, -1)]),
    dict(dtype=np.float16, casting="no", axes=[(-2, -1), (-2, -1)]),
    dict(out=np.zeros((3, 3), np.int64), axes=[(-2, -1), (-2, -1)]),
    dict(casting="bogus", axis=0),
], ids=["complex-no-axis", "int32-same-kind-axes", "float16-no-axes", "out-cast-axes",
        "bad-casting-axis"])
def test_type_errors_come_before_axes_errors_as_in_numpy(kw):
    """numpy resolves the loop and its casts before it reads ``axes``/``axis``."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    with pytest.raises(Exception) as want:
        np.matmul(a, b, **kw)
    with pytest.raises(Exception) as got:
        distmm.matmul(a, b, **kw)
    assert type(got.value) is type(want.value), (got.value, want.value)


def test_bfloat16_dtype_keyword_error_comes_before_axes_error():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng().standard_normal((3, 3)).astype(ml_dtypes.bfloat16)
    kw = dict(dtype=ml_dtypes.bfloat16, axes=[(-2, -1), (-2, -1)])
    with pytest.raises(TypeError, match="No loop matching") as want:
        np.matmul(x, x, **kw)
    with pytest.raises(TypeError, match="No loop matching") as got:
        distmm.matmul(x, x, **kw)
    assert type(got.value) is type(want.value)


@pytest.mark.parametrize("case", ["reversed-column-row", "fortran-cast", "c-cast"])
def test_order_a_decides_on_the_operands_as_given(case):
    """``order="A"`` with ``dtype=``: numpy looks at the operands it was given, not at the
    cast copies (a reversed (4, 1) column is neither C nor F; its copy is both)."""
    rng = np.random.default_rng()
    if case == "reversed-column-row":
        a, b = rng.standard_normal((4, 1))[::-1], rng.standard_normal((1, 5))
    else:
        lay = "F" if case == "fortran-cast" else "C"
        a = np.asarray(rng.standard_normal((4, 6)), order=lay)
        b = np.asarray(rng.standard_normal((6, 5)), order=lay)
    want = np.matmul(a, b, order="A", dtype=np.complex128)
    got = distmm.matmul(a, b, order="A", dtype=np.complex128)
    assert (got.flags.c_contiguous, got.flags.f_contiguous) == (want.flags.c_contiguous,
                                                                 want.flags.f_contiguous)
    assert got.dtype == want.dtype
    assert_close(got, want)


@pytest.mark.parametrize("kw", [dict(alpha=3), dict(alpha=-1), dict(beta=2), dict(alpha=0.5)],
                         ids=["alpha-3", "alpha-minus1", "beta-2", "alpha-half"])
def test_gemm_bool_result_refuses_scalars_other_than_0_and_1(kw):
    x = np.random.default_rng().integers(0, 2, (3, 3)).astype(bool)
    with pytest.raises(TypeError, match="alpha|beta"):
        distmm.gemm(x, x, x, **kw)


@pytest.mark.parametrize("alpha,beta", [(1, 0), (True, False), (1.0, 1), (0, True)])
def test_gemm_bool_result_takes_0_and_1(alpha, beta):
    rng = np.random.default_rng()
    a, b, c = (rng.integers(0, 2, (3, 3)).astype(bool) for _ in range(3))
    want = (np.matmul(a, b) & bool(alpha)) | (c & bool(beta))
    got = distmm.gemm(a, b, c, alpha=alpha, beta=beta)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shapes", [((3, 0, 0), (3, 0, 357)), ((3, 0, 357), (357, 0)),
                                    ((2, 0, 4), (4, 1000))], ids=str)
@pytest.mark.parametrize("dask_side", ["a", "b"])
def test_dask_operand_with_an_empty_numpy_partner(shapes, dask_side):
    """The numpy partner of a dask operand is wrapped without dask's automatic chunks,
    which divide by zero for some empty shapes."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    want = np.matmul(a, b)
    if dask_side == "a":
        got = distmm.matmul(da.from_array(a, chunks=-1), b)
    else:
        got = distmm.matmul(a, da.from_array(b, chunks=-1))
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    result = got.compute()
    assert (type(result), result.shape, result.dtype) == (type(want), want.shape, want.dtype)


def _masked(rng, shape, dtype):
    """A masked array of random values with at least one masked element."""
    mask = rng.random(shape) < 0.3
    mask.flat[rng.integers(mask.size)] = True
    return np.ma.masked_array(random_array(rng, shape, dtype), mask=mask)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int16, np.complex64])
def test_a_masked_out_gets_numpys_mask_or_error(dtype):
    """numpy passes the product through a masked ``out``'s ``__array_wrap__``: it sets
    ``out.mask`` from the operands' masks, or raises where they do not broadcast (k > 1)."""
    rng = np.random.default_rng()
    for _ in range(6):
        m, k, n = (int(x) for x in rng.integers(1, 5, 3))
        a = _masked(rng, (m, k), dtype)
        b = _masked(rng, (k, n), dtype) if rng.random() < 0.5 else random_array(rng, (k, n), dtype)
        outs, outcomes = [], []
        for mod in (np, distmm):
            outs.append(np.ma.masked_array(np.zeros((m, n), np.result_type(a.dtype, b.dtype))))
            try:
                outcomes.append(mod.matmul(a, b, out=outs[-1]))
            except Exception as exc:  # noqa: BLE001 - the type is what is compared
                outcomes.append(type(exc))
        _same_outcome(*outcomes)
        _same_outcome(*outs)
        if not isinstance(outcomes[0], type):
            assert outcomes[1] is outs[1]


def _swap(x):
    """``x`` with its matrix axes swapped (a vector as it is)."""
    return x if x.ndim < 2 else x.swapaxes(-1, -2)


def _not_numeric(rng, shape, kind):
    if kind == "structured":
        return np.zeros(shape, [("x", "f8")])
    words = rng.choice(["a", "bc", "xyz"], shape)
    return words.astype("S3") if kind == "bytes" else words


@pytest.mark.parametrize("partner", ["object", "dtype-object"])
@pytest.mark.parametrize("kind", ["str", "bytes", "structured"])
def test_strings_and_structs_in_numpys_object_loop(kind, partner):
    """numpy's object loop takes a string, bytes or structured operand paired with an object
    operand (or under ``dtype=object``): strings repeat, an empty product is empty. numpy
    refuses the same operand with itself, with floats, and a cast into object under
    ``casting="no"``."""
    rng = np.random.default_rng()
    for _ in range(6):
        m, k, n = (int(x) for x in rng.integers(0, 4, 3))
        batch = tuple(int(x) for x in rng.integers(1, 3, rng.integers(0, 2)))
        shapes = [batch + (m, k), (k, n)]
        if rng.random() < 0.3:
            shapes[int(rng.integers(2))] = (k,)
        odd, ints = _not_numeric(rng, shapes[0], kind), rng.integers(0, 4, shapes[1])
        kw = {"dtype": object} if partner == "dtype-object" else {}
        other = ints.astype(object) if partner == "object" else ints
        flip = rng.random() < 0.5
        for x, y, extra in ((odd, other, {}), (odd, _not_numeric(rng, shapes[1], kind), {}),
                            (odd, ints.astype(float), {}),
                            (odd, ints, {"dtype": object, "casting": "no"})):
            pair = (_swap(y), _swap(x)) if flip else (x, y)
            _same_outcome(*_numpy_and_distmm(lambda mod: mod.matmul(*pair, **{**kw, **extra})))


@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")
@pytest.mark.parametrize("signature", [
    (None, None, np.float32), (np.float64, np.float64, np.float64), ("f4", None, None),
    (None, None, None), "dd->d", "ff->f", "ii->i", "FF->F", (None, None), "bogus",
    ("d", "d"), "dd->dd",
], ids=repr)
def test_signature_keyword_is_numpys(signature):
    """``signature=`` selects numpy's loop as in ``numpy.matmul``, with numpy's errors."""
    rng = np.random.default_rng()
    for dtype in (np.float64, np.float32, np.int32, np.int64, np.complex64):
        m, k, n = (int(x) for x in rng.integers(1, 6, 3))
        a, b = random_array(rng, (m, k), dtype), random_array(rng, (k, n), dtype)
        _same_outcome(*_numpy_and_distmm(lambda mod: mod.matmul(a, b, signature=signature)))
        _same_outcome(*_numpy_and_distmm(
            lambda mod: mod.matmul(a, b, out=np.zeros((m, n), np.complex128),
                                   signature=signature, casting="unsafe")))
        _same_outcome(*_numpy_and_distmm(
            lambda mod: mod.matmul(a, b, signature=signature, dtype=np.float64)))
        _same_outcome(*_numpy_and_distmm(lambda mod: mod.matmul(a, b, signature="dd->f")))


@pytest.mark.parametrize("out,casting", [
    (np.zeros((), np.int8), "unsafe"), (np.zeros(2, np.int16), "same_kind"),
    (np.zeros((), object), "same_kind"), (np.zeros((), np.uint8), "unsafe")])
def test_vector_product_cast_into_out_as_numpy(out, casting):
    """vector @ vector into a 0-d or broadcast ``out=`` of another dtype is cast as numpy
    casts its loop's output (an int8 out wraps; an object out holds a Python int): the
    scalar result was converted through a Python number (OverflowError)."""
    x = np.array([300, 300], np.int64)
    want, got = out.copy(), out.copy()
    np.matmul(x, x, out=want, casting=casting)
    assert distmm.matmul(x, x, out=got, casting=casting) is got
    assert got.dtype == want.dtype and got.tolist() == want.tolist()
    assert [type(v) for v in got.reshape(-1).tolist()] == [type(v) for v in want.reshape(-1).tolist()]
    if out.dtype == object:
        assert type(got[()]) is type(want[()]) is int


def test_dtype_cast_comes_after_the_shape_check_as_numpy():
    """With ``dtype=``, numpy checks the core dimensions before it casts the values: a
    shape mismatch is its ValueError, with no cast warning first (distmm cast first, and
    raised the cast's FloatingPointError or OverflowError)."""
    import warnings

    cases = [(np.array([[np.nan]]), np.ones((2, 2)), np.int64, None),
             (np.array([[2**70]], dtype=object), np.ones((2, 2)), np.int16, None),
             # shapes that multiply, an out they do not fit: also before the cast
             (np.full((2, 3), 1e300), np.ones((3, 2)), np.float32, np.empty((3, 3), np.float32)),
             (np.full((2, 3), np.nan), np.ones((3, 2)), np.int64, np.empty((2, 5), np.int64))]
    for a, b, dt, out in cases:
        with pytest.raises(ValueError) as want:
            np.matmul(a, b, out=out, dtype=dt, casting="unsafe")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with np.errstate(all="raise"), pytest.raises(ValueError) as got:
                distmm.matmul(a, b, out=out, dtype=dt, casting="unsafe")
        assert type(got.value) is type(want.value)


@pytest.mark.slow  # the tiles already running finish in the background: about 7 s
def test_ctrl_c_stops_a_long_double_product_at_once():
    # numpy's long double loop runs on one thread and checks no signal: the tiles ran one by
    # one in the caller's thread (as if BLAS threaded them), and a real SIGINT waited for the
    # first of its two tiles (about 4 s here) instead of the pool's next wait
    import os
    import signal
    import threading
    import time

    import dask

    a = np.ones((1100, 1100), dtype=np.longdouble)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    with dask.config.set({"distmm.local-threads": 2}):
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            distmm.matmul(a, a, engine="local", backend="auto", tile=(1100, 550, 1100))
        elapsed = time.monotonic() - start
    timer.join()
    for t in threading.enumerate():  # the tiles already running end on their own
        if t.name.startswith("distmm-local"):
            t.join(30)
    assert elapsed < 2.5, f"KeyboardInterrupt came {elapsed:.1f} s after the product started"


@pytest.mark.parametrize("kw", [{}, {"tile": 2}, {"backend": "numba", "engine": "local"}])
def test_float16_nans_are_numpys_bits(kw):
    """float16 results are numpy's bits, NaNs too: numpy's half loop's NaN (its sign and
    payload) follows its order of operations (inf * 0 gives the negative default NaN, a
    NaN term keeps the first NaN); the numba kernel's sums kept another one."""
    neg = np.float16(-np.nan)
    pay = np.array([0x7E05], np.uint16).view(np.float16)[0]
    a = np.array([[np.inf, 0, np.nan], [np.nan, 1, 1], [neg, 1, 1], [pay, 1, 2], [1, 2, 3]],
                 np.float16)
    b = np.array([[0, 1, 1, 1], [np.inf, neg, np.nan, 1], [1, 1, 1, pay]], np.float16)
    with np.errstate(all="ignore"):
        want = np.matmul(a, b)
        got = distmm.matmul(a, b, **kw)
    assert np.isnan(want).sum() > 10
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("tile", [None, 1, 2])
def test_object_out_keeps_the_elements_before_a_failing_one_as_numpy(tile):
    """numpy's object loop writes out element by element: when an element's arithmetic
    raises, the elements before it stay written; one tile left out untouched."""
    class Bad:
        def __mul__(self, other):
            raise ValueError("no product")

        __rmul__ = __mul__

    a = np.arange(16.0).reshape(4, 4).astype(object)
    a[2, 1] = Bad()
    b = np.ones((4, 3)).astype(object)
    want, got = np.zeros((4, 3), object), np.zeros((4, 3), object)
    with pytest.raises(ValueError, match="no product"):
        np.matmul(a, b, out=want)
    with pytest.raises(ValueError, match="no product"):
        distmm.matmul(a, b, out=got, tile=tile)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("bad", [dict(engine="bogus"), dict(engine=3), dict(backend="bogus"),
                                 dict(backend=None), dict(tile=-3), dict(tile=2.5)], ids=repr)
def test_engine_backend_and_tile_refused_on_numpys_own_routes(bad):
    """Values of ``engine=``, ``backend=`` and ``tile=`` that a plain call refuses are refused
    on the routes numpy computes itself too (``signature=``, an operand overriding
    ``__array_ufunc__``, a masked ``out``), with the plain call's exception and line: they
    were taken silently there, and the override was handed the call."""
    rng = np.random.default_rng()
    a = rng.standard_normal((5, 7))
    b = rng.standard_normal((7, 3))

    class Override:
        called = False

        def __array_ufunc__(self, ufunc, method, *args, **kwargs):
            Override.called = True
            return "override"

    with pytest.raises((ValueError, TypeError)) as plain:
        distmm.matmul(a, b, **bad)
    for route, call in {
            "signature": lambda: distmm.matmul(a, b, signature="dd->d", **bad),
            "override": lambda: distmm.matmul(a, Override(), **bad),
            "masked out": lambda: distmm.matmul(a, b, out=np.ma.zeros((5, 3)), **bad)}.items():
        with pytest.raises(plain.type) as exc:
            call()
        assert str(exc.value) == str(plain.value) and "\n" not in str(exc.value), route
    assert not Override.called
