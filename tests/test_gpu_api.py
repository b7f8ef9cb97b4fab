"""The public API on a GPU: cupy in gives cupy out, numpy in with a GPU backend
gives numpy out, with numpy's semantics for every dtype and shape."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_matches_numpy, random_array

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

import distmm  # noqa: E402

GPU_BACKENDS = ["raw", "cublas", "auto"]


SAME_DTYPES = ["float32", "float64", "int32", "int64", "int8", "uint16", "bool", "float16",
               "complex64"]
#: mixed pairs promote as numpy does (int32 @ float32 -> float64, int8 @ uint8 -> int16, ...),
#: as cupy's own matmul tests check
MIXED_DTYPES = [("int32", "float32"), ("int8", "uint8"), ("bool", "int16"), ("float16", "float32"),
                ("float32", "complex64"), ("int64", "float64"), ("complex128", "complex128")]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("da_,db_", [(d, d) for d in SAME_DTYPES] + MIXED_DTYPES)
def test_cupy_in_cupy_out_every_dtype(backend, da_, db_):
    rng = np.random.default_rng()
    a = random_array(rng, (33, 127), da_)
    b = random_array(rng, (127, 7), db_)
    got = distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend)
    assert isinstance(got, cupy.ndarray)
    with np.errstate(over="ignore"):
        assert_matches_numpy(cupy.asnumpy(got), a, b)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("a_shape,b_shape", [
    ((1, 1), (1, 1)), ((7, 33), (33, 4097)), ((1000, 1), (1, 127)), ((127,), (127, 33)),
    ((33, 127), (127,)), ((2, 3, 33, 7), (7, 5)), ((5, 0), (0, 3)), ((4097, 33), (33, 7)),
])
def test_cupy_shapes(backend, a_shape, b_shape):
    rng = np.random.default_rng()
    a = random_array(rng, a_shape, np.float64)
    b = random_array(rng, b_shape, np.float64)
    got = distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend)
    assert_matches_numpy(cupy.asnumpy(got), a, b)


def test_cupy_transposed_views_and_inputs_untouched():
    rng = np.random.default_rng()
    a = cupy.asarray(random_array(rng, (129, 65), np.float32))
    b = cupy.asarray(random_array(rng, (33, 129), np.float32))
    a0, b0 = a.copy(), b.copy()
    got = distmm.matmul(a.T, b.T, backend="raw")
    assert_matches_numpy(cupy.asnumpy(got), cupy.asnumpy(a).T, cupy.asnumpy(b).T)
    assert bool((a == a0).all()) and bool((b == b0).all())


@pytest.mark.parametrize("backend", ["raw", "cublas"])
def test_numpy_in_gpu_backend_numpy_out(backend):
    rng = np.random.default_rng()
    a = random_array(rng, (1000, 333), np.float32)
    b = random_array(rng, (333, 517), np.float32)
    got = distmm.matmul(a, b, backend=backend)
    assert isinstance(got, np.ndarray)
    assert_matches_numpy(got, a, b)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("trans", ["NN", "NT", "TN", "TT", "CC", "CN"])
@pytest.mark.parametrize("dtype,case", [("float64", "alpha-0"), ("float32", "alpha-0"),
                                        ("float64", "k-0")])
def test_gpu_gemm_without_a_product_is_beta_c_for_every_transpose(backend, trans, dtype, case):
    """alpha == 0 (A and B not read) or k == 0: C = beta * C. Found by a GPU fuzz: the
    empty slices of transposed views failed in cuBLAS with CUBLAS_STATUS_INVALID_VALUE."""
    rng = np.random.default_rng()
    m, k, n = 13, (0 if case == "k-0" else 7), 9
    a = random_array(rng, (k, m) if trans[0] != "N" else (m, k), dtype)
    b = random_array(rng, (n, k) if trans[1] != "N" else (k, n), dtype)
    c = random_array(rng, (m, n), dtype)
    c[0, 0] = np.finfo(dtype).smallest_subnormal * 6  # halved exactly, not flushed
    a[...] = np.nan  # never read
    got = distmm.gemm(cupy.asarray(a), cupy.asarray(b), cupy.asarray(c),
                      alpha=0.0 if case == "alpha-0" else 2.0, beta=0.5, trans_a=trans[0],
                      trans_b=trans[1], backend=backend)
    np.testing.assert_array_equal(cupy.asnumpy(got), (c * np.dtype(dtype).type(0.5)))


def test_gpu_gemm_alpha_beta():
    rng = np.random.default_rng()
    a = cupy.asarray(random_array(rng, (23, 22), np.float64))
    b = cupy.asarray(random_array(rng, (24, 23), np.float64))
    c = cupy.asarray(random_array(rng, (22, 24), np.float64))
    got = distmm.gemm(a, b, c, alpha=-1.5, beta=0.25, trans_a=True, trans_b=True, backend="raw")
    want = -1.5 * (cupy.asnumpy(a).T @ cupy.asnumpy(b).T) + 0.25 * cupy.asnumpy(c)
    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-12, atol=1e-12)


def test_gpu_nan_inf_propagate():
    a = np.ones((40, 50), np.float32)
    b = np.ones((50, 30), np.float32)
    a[3, 4] = np.nan
    a[5, 0] = np.inf
    b[0, 7] = 0.0
    got = cupy.asnumpy(distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend="raw"))
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got, a @ b)


@pytest.mark.parametrize("backend", ["raw", "cublas"])
def test_float32_subnormals_are_not_flushed(backend):
    # CuPy compiles raw kernels with -ftz=true; distmm's float32 arithmetic must not flush.
    rng = np.random.default_rng()
    for _ in range(20):  # operands whose float32 product has no element that is exactly 0
        a = (rng.standard_normal((33, 40)) * 1e-20).astype(np.float32)
        b = (rng.standard_normal((40, 7)) * 1e-20).astype(np.float32)  # products ~1e-40
        want = a @ b
        if np.count_nonzero(want) == want.size:
            break
    assert np.count_nonzero(want) == want.size
    got = cupy.asnumpy(distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend))
    # Subnormals carry few bits: allow ~70 ulps of the subnormal spacing (1.4e-45) for the
    # summation order, far below the values (~1e-39) that a flush would zero.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-43)
    c = cupy.asarray((rng.standard_normal((33, 7)) * 1e-39).astype(np.float32))  # subnormal C
    got = distmm.gemm(cupy.asarray(a), cupy.asarray(b), c, alpha=1.0, beta=1.0, backend=backend)
    np.testing.assert_allclose(cupy.asnumpy(got), want + cupy.asnumpy(c), rtol=1e-5, atol=1e-43)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cupy_vector_vector_and_batch_broadcast(backend):
    rng = np.random.default_rng()
    x, y = random_array(rng, (129,), np.float64), random_array(rng, (129,), np.float64)
    got = distmm.matmul(cupy.asarray(x), cupy.asarray(y), backend=backend)
    assert isinstance(got, cupy.ndarray) and got.shape == ()  # numpy gives a 0-d result
    assert abs(float(got) - float(x @ y)) <= 1e-12 * np.abs(x) @ np.abs(y)
    a = random_array(rng, (2, 1, 33, 4), np.float32)
    b = random_array(rng, (5, 4, 7), np.float32)
    got = distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend)
    assert got.shape == (2, 5, 33, 7)
    assert_matches_numpy(cupy.asnumpy(got), a, b)


def test_cupy_out_and_errors():
    rng = np.random.default_rng()
    a = cupy.asarray(random_array(rng, (33, 20), np.float64))
    b = cupy.asarray(random_array(rng, (20, 7), np.float64))
    out = cupy.full((33, 7), cupy.nan)
    got = distmm.matmul(a, b, out=out, backend="raw")
    assert got is out
    assert_matches_numpy(cupy.asnumpy(out), cupy.asnumpy(a), cupy.asnumpy(b))
    with pytest.raises(ValueError, match=r"\(33, 20\).*\(7, 20\)|\(7, 20\).*\(33, 20\)"):
        distmm.matmul(a, b.T, backend="raw")
    with pytest.raises(ValueError):
        distmm.matmul(a, b, out=cupy.empty((7, 33)), backend="raw")


def test_cupy_out_of_another_dtype_is_filled_as_numpy_fills_it():
    """A cupy out= of another dtype (numpy's casting rule), for a stack and for a vector @
    vector into a 0-d out: filled on the device (it went through numpy and raised cupy's
    TypeError on implicit conversion)."""
    rng = np.random.default_rng()
    s, t = random_array(rng, (3, 5, 4), np.float32), random_array(rng, (4, 6), np.float32)
    v, w = random_array(rng, (9,), np.float32), random_array(rng, (9,), np.float32)
    for a, b, shape in ((s, t, (3, 5, 6)), (v, w, ())):
        want = np.full(shape, np.nan)
        np.matmul(a, b, out=want)
        out = cupy.full(shape, cupy.nan)
        got = distmm.matmul(cupy.asarray(a), cupy.asarray(b), out=out)
        assert got is out and out.dtype == np.float64
        np.testing.assert_allclose(cupy.asnumpy(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.complex128, np.float64])
def test_gpu_gemm_blas_letters(dtype):
    """gemm with BLAS's 'C' / 'T' letters on cupy operands (conjugate transpose for complex)."""
    rng = np.random.default_rng()
    a = random_array(rng, (40, 9), dtype)
    b = random_array(rng, (11, 40), dtype)
    c = random_array(rng, (9, 11), dtype)
    got = distmm.gemm(cupy.asarray(a), cupy.asarray(b), cupy.asarray(c), alpha=2.0, beta=0.5,
                      trans_a="C", trans_b="t")
    assert isinstance(got, cupy.ndarray) and got.dtype == np.dtype(dtype)
    want = 2.0 * (a.conj().T @ b.T) + 0.5 * c
    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_second_identical_cupy_call_reuses_the_cached_request(backend, dtype):
    """A repeated call with cupy operands is served from distmm.api's call cache
    (no re-validation, re-resolution or re-planning) and gives the same bits."""
    from distmm.api import CALLS

    rng = np.random.default_rng()
    a = random_array(rng, (257, 131), dtype)
    b = random_array(rng, (131, 67), dtype)
    a_dev, b_dev = cupy.asarray(a), cupy.asarray(b)
    # Warm up first (kernel compilation, cuBLAS handle, memory pool): the auto memory
    # budget is a share of the GPU's free memory, re-measured once a second, so a first
    # call that compiles for seconds could otherwise change it before the second call.
    distmm.matmul(a_dev, b_dev, backend=backend)
    cupy.cuda.Device().synchronize()
    CALLS.clear()
    first = distmm.matmul(a_dev, b_dev, backend=backend)
    entry = CALLS.last
    assert (CALLS.misses, CALLS.hits) == (1, 0) and entry is not None
    assert entry.operands.family == "cupy" and entry.request.on_gpu
    second = distmm.matmul(a_dev, b_dev, backend=backend)
    assert (CALLS.misses, CALLS.hits) == (1, 1) and CALLS.last is entry
    third = distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend)  # new arrays
    assert CALLS.hits == 2
    for got in (second, third):
        assert isinstance(got, cupy.ndarray) and got.dtype == first.dtype
        assert cupy.asnumpy(got).tobytes() == cupy.asnumpy(first).tobytes()
    with np.errstate(over="ignore"):
        assert_matches_numpy(cupy.asnumpy(second), a, b)
    # host operands of the same shape are another signature: numpy out, numpy's result
    host = distmm.matmul(a, b)
    assert isinstance(host, np.ndarray) and CALLS.hits == 2
    with np.errstate(over="ignore"):
        assert_matches_numpy(host, a, b)
    CALLS.clear()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_repeated_2d_float_cupy_call_is_replayed_by_the_executor(backend, dtype):
    """2-D float products of cupy operands are replayed by the GPU executor's
    replayer (no request rebuilt, no budget read): the same bits as the full
    path, a new array each call, and new operand values read."""
    from distmm.api import CALLS

    rng = np.random.default_rng()
    a = random_array(rng, (301, 129), dtype)
    b = random_array(rng, (129, 77), dtype)
    a_dev, b_dev = cupy.asarray(a), cupy.asarray(b)
    CALLS.clear()
    first = distmm.matmul(a_dev, b_dev, backend=backend)
    entry = CALLS.last
    assert entry is not None and entry.replay is not None
    replayed = distmm.matmul(a_dev, b_dev, backend=backend)
    assert CALLS.hits == 1 and CALLS.last is entry
    assert replayed is not first and replayed.data.ptr != first.data.ptr
    assert cupy.asnumpy(replayed).tobytes() == cupy.asnumpy(first).tobytes()
    assert_matches_numpy(cupy.asnumpy(replayed), a, b)
    # new values written into the same operand, and new arrays: fresh products
    a2, b2 = random_array(rng, a.shape, dtype), random_array(rng, b.shape, dtype)
    a_dev[...] = cupy.asarray(a2)
    assert_matches_numpy(cupy.asnumpy(distmm.matmul(a_dev, b_dev, backend=backend)), a2, b)
    got = distmm.matmul(cupy.asarray(a2), cupy.asarray(b2), backend=backend)
    assert CALLS.hits == 3
    assert_matches_numpy(cupy.asnumpy(got), a2, b2)
    CALLS.clear()


@pytest.mark.parametrize("shapes", [((3, 40, 30), (30, 20)), ((40,), (40, 20)), ((40, 30), (30,))])
def test_batched_and_vector_cupy_calls_are_not_replayed(shapes):
    """Stacks and 1-D operands go through the full request on a hit (their result is
    reshaped afterwards): no replayer, the same result as numpy."""
    from distmm.api import CALLS

    rng = np.random.default_rng()
    a, b = (random_array(rng, s, np.float32) for s in shapes)
    CALLS.clear()
    distmm.matmul(cupy.asarray(a), cupy.asarray(b))
    assert CALLS.last is not None and CALLS.last.replay is None
    got = distmm.matmul(cupy.asarray(a), cupy.asarray(b))
    assert CALLS.hits == 1
    assert got.shape == (a @ b).shape
    assert_matches_numpy(cupy.asnumpy(got), a, b)
    CALLS.clear()


def test_int_cupy_call_is_not_replayed():
    """Integer products keep the executor's full path on a hit (no replayer)."""
    from distmm.api import CALLS

    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    CALLS.clear()
    distmm.matmul(cupy.asarray(a), cupy.asarray(a.T))
    assert CALLS.last.replay is None
    got = distmm.matmul(cupy.asarray(a), cupy.asarray(a.T))
    assert CALLS.hits == 1 and cupy.asnumpy(got).tolist() == (a @ a.T).tolist()
    CALLS.clear()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_numpys_keywords_on_cupy_operands(backend):
    """dtype= casts both operands into the loop, order= lays the cupy result out, and a cast
    into out that same_kind refuses is numpy's TypeError, before any shape is looked at."""
    rng = np.random.default_rng()
    a, b = random_array(rng, (33, 65), "float64"), random_array(rng, (65, 17), "float64")
    got = distmm.matmul(cupy.asarray(a), cupy.asarray(b), dtype=np.float32, order="F",
                        backend=backend)
    assert isinstance(got, cupy.ndarray) and got.dtype == np.float32 and got.flags.f_contiguous
    assert_matches_numpy(cupy.asnumpy(got), a.astype(np.float32), b.astype(np.float32))
    with pytest.raises(TypeError, match="Cannot cast ufunc 'matmul' output"):
        distmm.matmul(cupy.asarray(a), cupy.asarray(a), out=cupy.empty((1, 1), np.int64))
