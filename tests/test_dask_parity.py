"""distmm.matmul on dask operands against dask.array's own matmul tests.

This module covers the cases of dask's ``dask/array/tests`` that multiply matrices
(``test_routines.py::test_matmul``, ``test_array_core.py::test_matmul``, ``tensordot`` and
``dot`` where they are a matrix product, ``test_optimization.py``'s duplicate dependency),
run through ``distmm.matmul`` with dask's ``assert_eq`` (values, dtype, meta, chunk shapes)
against numpy: every mix of dask and numpy operands, 1-d operands, broadcast stacks, empty
arrays and zero-size chunks, the result staying lazy (nothing computed while the graph is
built), 2-D output chunks as dask.array's own ``a @ b`` has them, and numpy's exception
types; a few of them on a two-worker cluster too.
It does *not* cover: the graph's tasks and placement (tests/test_dask_graph.py,
tests/test_dask_placement.py), numpy operands on a cluster (tests/test_dask_engine.py),
gemm (tests/test_gemm_semantics.py).
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import distmm
from conftest import marking, random_array

da = pytest.importorskip("dask.array")
from dask.array.utils import assert_eq  # noqa: E402

#: dask's test_routines.py::test_matmul shapes and chunks (a subset: every kind of case)
ROUTINE_CASES = [
    [(7,), (7,), (), ()],
    [(11,), (11, 7), (), ()],
    [(15,), (7, 15, 11), (), ()],
    [(7, 11), (11,), (), ()],
    [(11, 15), (7, 15, 11), (), ()],
    [(7, 11, 15), (15,), (), ()],
    [(7, 11, 15, 19), (11, 19, 13), (), ()],
    [(7, 11), (11, 7), (1, 1), (1, 1)],
    [(7, 11), (11, 7), (3, 5), (4, 2)],
    [(11, 15, 19), (7, 11, 19, 15), (7, 7, 7), (3, 9, 9, 9)],
    [(3, 3, 20, 30), (3, 3, 30, 20), (1, 3, 2, 6), (1, 3, 5, 10)],
]


@pytest.mark.parametrize("x_shape, y_shape, x_chunks, y_chunks", ROUTINE_CASES)
def test_dask_routines_matmul_cases(x_shape, y_shape, x_chunks, y_chunks):
    rng = np.random.default_rng()
    x, y = rng.random(x_shape), rng.random(y_shape)
    a = da.from_array(x, chunks=x_chunks or tuple(i // 2 for i in x.shape))
    b = da.from_array(y, chunks=y_chunks or tuple(i // 2 for i in y.shape))
    expected = np.matmul(x, y)
    for d1, d2 in itertools.product([a, x], [b, y]):
        got = distmm.matmul(d1, d2)
        if isinstance(d1, da.Array) or isinstance(d2, da.Array):
            assert isinstance(got, da.Array)
        assert_eq(expected, got)


@pytest.mark.parametrize("x_shape, y_shape", [((), ()), ((), (7, 11)), ((7,), ()),
                                              ((7, 11, 15), ())])
def test_a_0d_operand_is_numpys_value_error(x_shape, y_shape):
    rng = np.random.default_rng()
    x, y = rng.random(x_shape)[()], rng.random(y_shape)[()]
    a = da.from_array(x, chunks=tuple(i // 2 for i in np.shape(x)))
    b = da.from_array(y, chunks=tuple(i // 2 for i in np.shape(y)))
    for d1, d2 in itertools.product([a, x], [b, y]):
        if not (isinstance(d1, da.Array) or isinstance(d2, da.Array)):
            continue
        with pytest.raises(ValueError):
            distmm.matmul(d1, d2)


def test_dask_array_core_matmul_cases():
    rng = np.random.default_rng()
    x, y = rng.random((5, 5)), rng.random((5, 2))
    a, b = da.from_array(x, chunks=(1, 5)), da.from_array(y, chunks=(5, 1))
    assert_eq(distmm.matmul(a, b), a.dot(b))
    assert_eq(distmm.matmul(a, b), x @ y)
    assert_eq(distmm.matmul(a, y), distmm.matmul(x, b))
    vec = list(range(1, 6))
    assert_eq(distmm.matmul(vec, b), np.matmul(vec, y))
    assert_eq(distmm.matmul(x, vec), distmm.matmul(a, vec))
    z = rng.random((5, 5, 5))
    c = da.from_array(z, chunks=(1, 5, 1))
    assert_eq(distmm.matmul(a, z), distmm.matmul(x, c))
    assert_eq(distmm.matmul(z, a), distmm.matmul(c, x))


def test_tensordot_and_dot_cases_that_are_a_matrix_product():
    x = np.arange(400).reshape((20, 20))
    y = np.arange(200).reshape((20, 10))
    a, b = da.from_array(x, chunks=(5, 4)), da.from_array(y, chunks=(4, 5))
    want = np.tensordot(x, y, axes=1)
    for d1, d2 in [(a, b), (x, b), (a, y)]:
        assert_eq(distmm.matmul(d1, d2), want)
    # the same product, the same keys (dask's same_keys)
    assert distmm.matmul(a, b).name == distmm.matmul(a, b).name
    assert_eq(distmm.matmul(da.from_array(x, chunks=5), da.from_array(y, chunks=5)), x.dot(y))


def test_persisted_operands_give_the_same_product():
    rng = da.random.default_rng()
    x = rng.random((4, 4), chunks=(2, 2))
    x[x < 0.65] = 0
    y = x.persist(scheduler="sync")
    z = x.compute(scheduler="sync")
    np.testing.assert_allclose(distmm.matmul(x, x).compute(scheduler="sync"), z @ z)
    np.testing.assert_allclose(distmm.matmul(y, y).compute(scheduler="sync"), z @ z)


@pytest.mark.parametrize("optimize_graph", [True, False])
def test_an_operand_used_twice_after_blockwise(optimize_graph):
    xx = da.from_array(np.array([[1, 1], [2, 2]]), chunks=1) * 2
    got = distmm.matmul(xx, xx).compute(optimize_graph=optimize_graph, scheduler="sync")
    assert_eq(got, np.array([[12, 12], [24, 24]]))


@pytest.mark.parametrize("a_chunks,b_chunks", [
    (((3, 0, 6), (2, 0, 5)), ((2, 0, 5), (0, 5))),   # zero-size chunks on every axis
    (((3, 0, 6), (4, 3)), ((2, 5), (3, 0, 2))),      # and k chunks that do not line up
])
def test_zero_size_chunks(a_chunks, b_chunks):
    rng = np.random.default_rng()
    x, y = rng.standard_normal((9, 7)), rng.standard_normal((7, 5))
    a, b = da.from_array(x, chunks=a_chunks), da.from_array(y, chunks=b_chunks)
    got = distmm.matmul(a, b)
    assert got.chunks == (a @ b).chunks
    assert_eq(got, x @ y)


@pytest.mark.parametrize("x_shape,y_shape,x_chunks,y_chunks", [
    ((0, 5), (5, 3), (1, 2), (2, 2)),
    ((7, 0), (0, 3), (3, 1), (1, 2)),
    ((0,), (0,), 1, 1),
    ((0, 4, 5), (5, 3), (1, 2, 2), (2, 2)),
    ((2, 0, 4, 5), (1, 5, 3), (1, 1, 2, 2), (1, 2, 2)),
    ((3, 4, 0), (3, 0, 2), (2, 2, 1), (2, 1, 2)),
])
def test_empty_operands(x_shape, y_shape, x_chunks, y_chunks):
    rng = np.random.default_rng()
    x, y = rng.random(x_shape), rng.random(y_shape)
    got = distmm.matmul(da.from_array(x, chunks=x_chunks), da.from_array(y, chunks=y_chunks))
    assert isinstance(got, da.Array)
    assert_eq(got, np.matmul(x, y))


@pytest.mark.parametrize("x_shape,y_shape,x_chunks,y_chunks", [
    ((13,), (13,), 4, 5),
    ((5,), (3, 5, 4), 2, (2, 2, 3)),
    ((3, 4, 5), (5,), (2, 3, 2), 3),
    ((1, 4, 5), (6, 5, 2), (1, 3, 3), (4, 2, 2)),
    ((6, 1, 4, 5), (7, 5, 2), (4, 1, 3, 3), (3, 2, 2)),
])
def test_vectors_and_broadcast_stacks(x_shape, y_shape, x_chunks, y_chunks):
    rng = np.random.default_rng()
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    a, b = da.from_array(x, chunks=x_chunks), da.from_array(y, chunks=y_chunks)
    for d1, d2 in [(a, b), (x, b), (a, y)]:
        assert_eq(distmm.matmul(d1, d2), np.matmul(x, y))


@pytest.mark.parametrize("dta,dtb", [("i4", "i4"), ("u1", "i1"), ("?", "?"), ("f4", "f8"),
                                     ("c8", "f4"), ("f2", "f2"), ("?", "f4"), ("i8", "f4")])
def test_result_dtype_is_numpys(dta, dtb):
    # numpy's dtype (int32 @ int32 is int32; dask's own lazy matmul says int64)
    rng = np.random.default_rng()
    x, y = random_array(rng, (7, 5), dta), random_array(rng, (5, 3), dtb)
    a, b = da.from_array(x, chunks=(3, 2)), da.from_array(y, chunks=(2, 2))
    for d1, d2 in [(a, b), (x, b), (a, y)]:
        got = distmm.matmul(d1, d2)
        assert got.dtype == np.matmul(x, y).dtype
        with np.errstate(over="ignore"):
            assert_eq(got, np.matmul(x, y), atol=1e-2 if "f2" in (dta, dtb) else 1e-6)


def test_the_product_is_lazy(tmp_path):
    """Nothing of the operands is computed while distmm builds the graph."""
    marks = tmp_path / "computed"
    mark = marking(marks)

    rng = np.random.default_rng()
    x, y = rng.random((9, 7)), rng.random((7, 5))
    meta = np.empty((0, 0))
    a = da.from_array(x, chunks=3).map_blocks(mark, dtype=float, meta=meta)
    b = da.from_array(y, chunks=3).map_blocks(mark, dtype=float, meta=meta)
    c = da.from_array(rng.random((9, 5)), chunks=4).map_blocks(mark, dtype=float, meta=meta)
    results = [distmm.matmul(a, b), distmm.matmul(a, y), distmm.gemm(a, b, c, beta=2.0),
               distmm.gemm(b, a, trans_a="T", trans_b="T")]
    assert not Path(marks).exists()
    assert all(isinstance(r, da.Array) for r in results)
    np.testing.assert_allclose(results[0].compute(scheduler="sync"), x @ y)
    assert Path(marks).exists()


def test_2d_output_chunks_are_dask_arrays():
    rng = np.random.default_rng()
    x, y = rng.random((13, 11)), rng.random((11, 9))
    for xc, yc in [((4, 3), (5, 2)), ((13, 11), (11, 9)), (((1, 12), (5, 6)), ((2, 9), (8, 1)))]:
        a, b = da.from_array(x, chunks=xc), da.from_array(y, chunks=yc)
        assert distmm.matmul(a, b).chunks == (a @ b).chunks


@pytest.mark.parametrize("x,y", [
    (np.ones((4, 5)), np.ones((4, 6))),              # inner dimensions
    (np.ones(3), np.ones(4)),
    (np.ones((2, 3, 4)), np.ones((3, 4, 5))),        # batch dimensions
    (np.full((2, 2), "a"), np.full((2, 2), "b")),    # no loop
    (np.zeros((2, 2), "M8[s]"), np.zeros((2, 2), "M8[s]")),
    (np.zeros((2, 2), [("a", "f8")]), np.zeros((2, 2), [("a", "f8")])),
])
def test_errors_are_numpys_types(x, y):
    with pytest.raises(Exception) as numpy_error:
        np.matmul(x, y)
    for d1, d2 in [(da.from_array(x), da.from_array(y)), (x, da.from_array(y))]:
        with pytest.raises(type(numpy_error.value)):
            distmm.matmul(d1, d2)


@pytest.mark.slow  # a two-worker cluster
def test_dask_cases_on_a_cluster(client):
    rng = np.random.default_rng()
    for x_shape, y_shape, x_chunks, y_chunks in ROUTINE_CASES[3:9:2]:
        x, y = rng.random(x_shape), rng.random(y_shape)
        a = da.from_array(x, chunks=x_chunks or tuple(i // 2 for i in x.shape))
        b = da.from_array(y, chunks=y_chunks or tuple(i // 2 for i in y.shape))
        for d1, d2 in [(a, b), (x, b), (a, y)]:
            assert_eq(distmm.matmul(d1, d2), np.matmul(x, y), scheduler=None)
    p = da.from_array(rng.random((9, 7)), chunks=(4, 3)).persist()
    q = da.from_array(rng.random((7, 5)), chunks=(2, 5)).persist()
    got = distmm.matmul(p, q)
    assert got.chunks == (p @ q).chunks
    assert_eq(got, p.compute() @ q.compute(), scheduler=None)
