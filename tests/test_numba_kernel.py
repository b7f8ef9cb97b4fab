"""distmm's numba GEMM kernel (``kernels/numba_gemm.py``) against numpy.

Randomized checks of ``panel_product`` against a float64 reference with an
error bound per element: sizes ragged around the micro-tile (MR x NR), the
k block and the cache blocks; strided, transposed, Fortran-ordered and
reversed views; exact 64-bit integer products that wrap; NaN and Inf; bitwise
determinism across calls, threads and blockings; and the kernel under
``distmm.matmul(..., backend="numba")`` with small tiles.
"""
from __future__ import annotations

import concurrent.futures as cf
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distmm
from distmm.kernels import numba_gemm as ng

FLOATS = ["float32", "float64"]
INTS = ["int64", "uint64"]
MR, KC, MC = ng.MR, ng.KC, ng.MC


def nr(dtype) -> int:
    return ng.nr_for(dtype)


def operands(rng, m, k, n, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        a = rng.integers(-50, 50, size=(m, k)).astype(dtype)
        b = rng.integers(-50, 50, size=(k, n)).astype(dtype)
    else:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
    return a, b


def check_product(c, a, b):
    """``c`` equals ``a @ b``: exactly for integers, within the dot-product
    rounding bound ``(k + 2) * eps * (|a| @ |b|)`` element by element for floats."""
    assert c.dtype == a.dtype and c.shape == (a.shape[0], b.shape[1])
    assert c.strides[1] == c.itemsize  # row-major (rows may be padded)
    if a.dtype.kind in "iu":
        np.testing.assert_array_equal(c, a @ b)
        return
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64
    bound = (a.shape[1] + 2) * np.finfo(a.dtype).eps * (np.abs(a64) @ np.abs(b64))
    err = np.abs(c.astype(np.float64) - ref)
    assert np.all(err <= bound + np.finfo(a.dtype).tiny), (
        f"max error {err.max():.3e}, bound there {bound.flat[err.argmax()]:.3e}")


def ragged_shapes(dtype):
    r = nr(dtype)
    return [
        (1, 1, 1), (7, 7, 7), (1, 33, 1), (33, 1, 127), (127, 33, 7),
        (MR - 1, KC - 1, r - 1), (MR + 1, KC + 1, r + 1), (2 * MR, 2 * KC, 2 * r),
        (MC + MR + 3, 5, 2 * r + 3), (3, 3, ng.NC + r + 5),
    ]


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_ragged_sizes(dtype):
    rng = np.random.default_rng(1)
    for m, k, n in ragged_shapes(dtype):
        a, b = operands(rng, m, k, n, dtype)
        for tk in (256, 7):
            check_product(ng.panel_product(a, b, tk), a, b)


@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_views_any_layout_and_inputs_untouched(dtype):
    rng = np.random.default_rng(2)
    base_a, base_b = operands(rng, 70, 90, 80, dtype)
    views = [
        (base_a, base_b),
        (np.asfortranarray(base_a), np.asfortranarray(base_b)),
        (base_a.T.copy().T, base_b[:, ::-1]),                      # F-order A, reversed B
        (base_b[:40, :70].T, base_a[:50, :40].T),                  # transposed views
        (base_a[::2, ::3], base_b[::3, 1::2]),                     # strided in both axes
        (base_a[::-1, 5:], base_b[5:, ::-2]),                      # negative strides
    ]
    for a, b in views:
        a_before, b_before = a.copy(), b.copy()
        c = ng.panel_product(a, b, 16)
        check_product(c, np.ascontiguousarray(a), np.ascontiguousarray(b))
        np.testing.assert_array_equal(a, a_before)
        np.testing.assert_array_equal(b, b_before)
    swapped_a = base_a.astype(base_a.dtype.newbyteorder(">" if np.little_endian else "<"))
    check_product(ng.panel_product(swapped_a, base_b, 16), base_a, base_b)
    ro_a, ro_b = base_a.copy(), base_b.copy()
    ro_a.flags.writeable = ro_b.flags.writeable = False
    check_product(ng.panel_product(ro_a, ro_b), ro_a, ro_b)


@pytest.mark.parametrize("dtype", INTS)
def test_integers_exact_with_wraparound(dtype):
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    for m, k, n in [(9, 31, 25), (MR + 3, KC + 9, nr(dtype) + 7)]:
        a = rng.integers(info.min, info.max, size=(m, k), dtype=dtype, endpoint=True)
        b = rng.integers(info.min, info.max, size=(k, n), dtype=dtype, endpoint=True)
        expected = a @ b  # numpy wraps modulo 2**64
        np.testing.assert_array_equal(ng.panel_product(a, b, 8), expected)
        # Products overflow: the result is not the float64 product.
        assert not np.allclose(expected.astype(np.float64),
                               a.astype(np.float64) @ b.astype(np.float64))


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_inf_propagate_like_numpy(dtype):
    rng = np.random.default_rng(4)
    m, k, n = MR + 5, 2 * KC + 3, nr(dtype) + 9
    a, b = operands(rng, m, k, n, dtype)
    a[2, 7] = np.nan           # row 2 of C is NaN
    a[m - 1, k - 1] = np.inf   # row m-1: +-inf, or NaN where inf meets 0 or -inf
    b[k - 1, 3] = 0.0          # inf * 0 -> NaN at (m-1, 3)
    b[1, n - 1] = -np.inf      # column n-1: -+inf, NaN in row 2
    with np.errstate(invalid="ignore", over="ignore"):
        expected = a @ b
        c = ng.panel_product(a, b, 32)
    assert np.isnan(c[2]).all()
    assert np.isnan(c[m - 1, 3])
    np.testing.assert_array_equal(np.isnan(c), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(c), np.isinf(expected))
    np.testing.assert_array_equal(np.sign(c[np.isinf(c)]), np.sign(expected[np.isinf(expected)]))


@pytest.mark.parametrize("dtype", FLOATS)
def test_deterministic_across_calls_threads_and_blocking(dtype):
    rng = np.random.default_rng(5)
    a, b = operands(rng, 3 * MR + 1, 3 * KC + 17, 2 * nr(dtype) + 5, dtype)
    first = ng.panel_product(a, b, 256)
    with cf.ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda tk: ng.panel_product(a, b, tk), [256, 256, 7, 64, 1, 1000]))
    for c in again:  # k is summed in ascending order whatever the blocking
        assert c.tobytes() == first.tobytes()


def test_empty_and_unsupported():
    a = np.ones((3, 0))
    assert np.array_equal(ng.panel_product(a, np.ones((0, 4))), np.zeros((3, 4)))
    assert ng.panel_product(np.ones((0, 5)), np.ones((5, 2))).shape == (0, 2)
    with pytest.raises(TypeError, match="int32"):
        ng.panel_product(np.ones((2, 2), np.int32), np.ones((2, 2), np.int32))
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        ng.panel_product(np.ones((2, 3)), np.ones((2, 3)))
    assert ng.SUPPORTED == ("float32", "float64", "int64", "uint64")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 60), k=st.integers(1, 300), n=st.integers(1, 120),
       tk=st.sampled_from([1, 5, 64, 256]), dtype=st.sampled_from(FLOATS + INTS),
       seed=st.integers(0, 2**16))
def test_random_shapes(m, k, n, tk, dtype, seed):
    a, b = operands(np.random.default_rng(seed), m, k, n, dtype)
    check_product(ng.panel_product(a, b, tk), a, b)


@pytest.mark.parametrize("dtype", ["float64", "float32", "int64", "uint64", "int32"])
@pytest.mark.parametrize("tile", [(16, 24, 8), (MR + 1, 13, KC + 1), 40])
def test_through_distmm_matmul_small_tiles(dtype, tile):
    rng = np.random.default_rng(6)
    m, k, n = 77, 301, 93
    a, b = operands(rng, m, k, n, dtype)
    c = distmm.matmul(a, b, backend="numba", engine="local", tile=tile)
    if np.dtype(dtype).kind in "iu":
        np.testing.assert_array_equal(c, a @ b)
    else:
        check_product(c, a, b)
    # a transposed view goes through the same path
    check_product(distmm.matmul(b.T, a.T, backend="numba", engine="local", tile=tile),
                  np.ascontiguousarray(b.T), np.ascontiguousarray(a.T))


def _has_avx512() -> bool:
    try:
        return bool(re.search(r"\bavx512f\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="needs an AVX-512 CPU")
def test_microkernel_uses_zmm_fmas():
    import numba

    @numba.njit
    def call(kc, ap, bp, c):  # not cached, so its assembly can be inspected
        ng._microkernel(kc, ap, 0, bp, 0, c, 0, 24, 0, 1)

    r = nr("float64")
    ap, bp, c = np.ones(4 * MR), np.ones(4 * r), np.zeros(MR * 24 + r)
    call(4, ap, bp, c)
    assert np.all(c[: r] == 4.0)
    asm = call.inspect_asm(call.signatures[0])
    fmas = re.findall(r"vfmadd\d+pd\s+[^\n]*zmm", asm)
    assert len(fmas) >= MR * ng.NV
