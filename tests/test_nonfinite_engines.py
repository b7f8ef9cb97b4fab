"""The local and Dask engines and ``mpirun distmm matmul`` give numpy's NaN and Inf for
complex products whose operands hold them.

numpy's BLAS multiplies each element's sum by ``alpha = 1 + 0j`` (gemm, gemv), so where
an Inf or NaN meets an element both its parts are NaN; its dot (a 1 x 1 product) makes
only the real part NaN and its own loop (k == 1) neither. A ragged 1 x 1 tile, a k group
one wide or a rank's 1 x 1 block of C keeps an Inf numpy's element does not have unless
``distmm.nonfinite.numpys_nonfinite`` gives it numpy's form for the whole product's shape
(through ``finish_tile`` and the batch stripes).
Covers: fuzzed small products on the local engine over tile shapes (1 x 1 tiles, ragged
ones, k groups of one), the product first reported (a 1025 x 1025 C whose last tile is
1 x 1), the Dask engine on a real two-worker cluster (tiles and blocks, numpy and dask
operands, a product split along k), the batch path under real ``mpiexec`` on 2 and 4 ranks
(both panel paths), and real results left alone.
It does *not* cover: ``engine="mpi"`` (``tests/test_mpi_nonfinite.py``, with numpy's
floating-point reports), overflows of finite operands (numpy's own BLAS blocking decides
their Inf or NaN) or GPU results.
"""
from __future__ import annotations

import dask
import numpy as np
import pytest

import distmm
from conftest import NUMPY1_BLAS_FORMS

inf, nan = np.inf, np.nan
SPECIALS = [inf, -inf, nan, complex(0, inf), complex(0, -inf), complex(inf, inf),
            complex(nan, 0), complex(0, nan), complex(inf, nan), 0]
#: (tm, tn, tk): 1 x 1 tiles, 2 x 2 tiles ragged to 1 x 1 on odd shapes, k blocks of one
TILES = [(1, 1, 1), (2, 2, 1), (2, 2, 2), (1, 1, 3), (3, 3, 2), (4, 4, 4), None]


def pattern(z):
    """Where each part of each element is NaN and where Inf."""
    z = np.asarray(z)
    return np.stack([f(part) for part in (z.real, z.imag) for f in (np.isnan, np.isinf)])


def fuzzed(seed: int, count: int):
    """``count`` small complex64 / complex128 products, each operand with an Inf, a NaN or
    a 0 or two (m, n, k of 1 to 7: rows, columns, 1 x 1 results and k == 1 among them)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        dt = rng.choice([np.complex128, np.complex64])
        m, n, k = (int(rng.choice([1, 2, 3, 5, 7])) for _ in range(3))
        a = (rng.standard_normal((m, k)) + 1j * rng.standard_normal((m, k))).astype(dt)
        b = (rng.standard_normal((k, n)) + 1j * rng.standard_normal((k, n))).astype(dt)
        for x in (a, b):
            for _ in range(int(rng.integers(1, 3))):
                at = tuple(rng.integers(0, s) for s in x.shape)
                x[at] = SPECIALS[rng.integers(len(SPECIALS))]
        yield a, b


def differences(products, product) -> list[str]:
    """The products whose ``product(a, b)`` differs from numpy's in some element's NaN or
    Inf (the first element that differs, numpy's value and the one got)."""
    bad = []
    with np.errstate(all="ignore"):
        for a, b in products:
            want, got = a @ b, product(a, b)
            differ = (pattern(want) != pattern(got)).any(0)
            if differ.any():
                i = np.argwhere(differ)[0]
                bad.append(f"{a.shape} @ {b.shape} {a.dtype} at {tuple(i)}: numpy "
                           f"{want[tuple(i)]}, got {got[tuple(i)]}")
    return bad


@NUMPY1_BLAS_FORMS
def test_local_engine_fuzzed_products_are_numpys():
    """120 fuzzed products, each over seven tile shapes and with k groups of one (a
    64-byte memory budget): every element's parts NaN, Inf or finite as numpy's, where a
    1 x 1 tile (BLAS's dot) or a sum of k == 1 products (numpy's own loop) keeps an Inf
    that numpy's alpha turns NaN."""
    products = list(fuzzed(7, 120))
    bad = []
    for tile in TILES:
        bad += differences(products, lambda a, b: distmm.matmul(a, b, engine="local", tile=tile))
    with dask.config.set({"distmm.memory-budget": 64}):  # k split into groups of one
        plan = distmm.make_plan(2, 3, 9, "complex128", tile=(1, 1, 1), workers=2)
        assert plan.k_edges == tuple(range(10))
        bad += differences(products, lambda a, b: distmm.matmul(a, b, engine="local",
                                                                tile=(1, 1, 1)))
    assert not bad, f"{len(bad)} of {8 * len(products)}:\n" + "\n".join(bad[:20])


def test_local_engine_ragged_one_by_one_tile():
    """A 1025 x 1025 C whose last tile is 1 x 1 (BLAS's dot, ``nan+infj`` from a summed
    ``inf+infj``): its last row is ``nan+nanj`` throughout, as numpy's."""
    a, b = np.ones((1025, 300), complex), np.ones((300, 1025), complex)
    a[1024, 0] = complex(0, inf)
    plan = distmm.make_plan(1025, 1025, 300, complex)
    assert plan.row_edges[-2:] == (1024, 1025) and plan.col_edges[-2:] == (1024, 1025)
    with np.errstate(all="ignore"):
        got = distmm.matmul(a, b, engine="local")
    assert np.isnan(got[1024].real).all() and np.isnan(got[1024].imag).all(), got[1024, -3:]
    assert not differences([(a, b)], lambda x, y: got)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "longdouble",
                                   "clongdouble"])
def test_other_dtypes_are_left_as_summed(dtype):
    """``numpys_nonfinite`` returns a block of any other dtype untouched, the same array
    (real products have no alpha to spread a NaN; complex long double is numpy's own
    loop), so their Inf stays an Inf."""
    from distmm.nonfinite import numpys_nonfinite

    c = np.array([[inf, -inf], [nan, 1]], dtype=dtype)
    if c.dtype.kind == "c":
        c[0, 1] = complex(0, inf)
    before = c.copy()
    plan = distmm.make_plan(2, 2, 3, dtype)
    assert numpys_nonfinite(plan, c) is c
    np.testing.assert_array_equal(c, before)
    cplx = np.array([[complex(0, inf), 1]], dtype=np.complex128)  # the check above can fail
    with np.errstate(all="raise"), pytest.raises(FloatingPointError, match="invalid value "
                                                 "encountered in matmul"):
        numpys_nonfinite(plan, cplx.copy())  # numpy's 1 * 0 - 0 * inf, reported as numpy's
    with np.errstate(all="ignore"):
        assert np.isnan(numpys_nonfinite(plan, cplx)[0, 0].real)


@pytest.mark.slow
def test_dask_engine_products_are_numpys(client):
    """The Dask engine on two worker processes: fuzzed products with 1 x 1 tiles and 2 x 2
    tiles ragged to 1 x 1, in tile and block layout, with numpy operands and dask
    operands (a lazy product), and one split along k into groups of one (the sums of the
    reduction tree's last task)."""
    import dask.array as da

    products = list(fuzzed(11, 6))
    bad = []
    for layout in ("tiles", "blocks"):
        with dask.config.set({"distmm.dask-layout": layout}):
            for tile in ((1, 1, 1), (2, 2, 2)):
                bad += differences(products, lambda a, b: distmm.matmul(
                    a, b, engine="dask", client=client, tile=tile))
    bad += differences(products, lambda a, b: distmm.matmul(
        da.from_array(a, chunks=2), da.from_array(b, chunks=2), engine="dask", client=client,
        tile=(2, 2, 2)).compute())
    a, b = np.full((1, 9), 1 + 1j), np.full((9, 1), 1 + 1j)
    a[0, 4] = complex(0, inf)  # numpy's dot: nan+infj; a sum of k == 1 loops: inf+infj
    with dask.config.set({"distmm.memory-budget": 64, "distmm.dask-layout": "tiles"}):
        bad += differences([(a, b)], lambda x, y: distmm.matmul(
            x, y, engine="dask", client=client, tile=(1, 1, 1)))
    assert not bad, "\n".join(bad)


def _batch_operands(folder, m, k, n):
    a, b = np.full((m, k), 1 + 1j), np.full((k, n), 1 + 1j)
    a[m - 1, 0], a[0, k - 1] = complex(0, inf), inf
    b[k - 1, n - 1] = nan
    np.save(folder / "a.npy", a)
    np.save(folder / "b.npy", b)
    return a, b


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,shape,panels", [
    (2, (600, 3, 600), "broadcast"),
    pytest.param(4, (600, 3, 600), "broadcast", marks=pytest.mark.slow),
    pytest.param(4, (2, 2, 2), "read", marks=pytest.mark.slow),
    pytest.param(2, (2, 2, 2), "read", marks=pytest.mark.slow),
    pytest.param(2, (1, 5, 1), "broadcast", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_batch_path_products_are_numpys(tmp_path, mpirun, ranks, shape, panels):
    """``mpirun distmm matmul`` (the striped batch path) writes numpy's NaN and Inf: a
    broadcast stripe's pieces one wide in k (numpy's own loop, no alpha), a 2 x 2 grid of
    1 x 1 blocks (BLAS's dot), a 1 x 1 product."""
    m, k, n = shape
    a, b = _batch_operands(tmp_path, m, k, n)
    out = tmp_path / "c.npy"
    r = mpirun(ranks, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o",
               out, "--engine", "mpi", env={"DISTMM_BATCH_PANELS": panels}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(out)
    assert got.dtype == np.complex128 and got.shape == (m, n)
    bad = differences([(a, b)], lambda x, y: got)
    assert not bad, bad
