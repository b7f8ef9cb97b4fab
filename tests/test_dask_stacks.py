"""Stacks of small matrices in dask operands: one task per batch chunk of the result (and
output block where the matrices span chunks or the plan splits k;
``distmm.engine.dask.stacks``), with numpy's values and dtype, the per-element path's bits,
dask's output chunks, broadcasting, empty stacks and 1-d operands, on the local scheduler and
on a distributed client; and numpy operands on a client (``eager``): one task per batch block
of about a worker slot each, the per-element path's bits, ``out=``, floating-point flags and a
worker killed mid-run."""
from __future__ import annotations

from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
from conftest import NUMPY1_BLAS_FORMS, marking, random_array

import distmm

EXACT = ("f2", "i1", "i4", "i8", "u1", "?", "c8", "c16", "O")


def _own_tasks(c) -> int:
    """The tasks of distmm's own layer of the lazy result ``c``."""
    return len(c.dask.layers[c.name])


def _ref(x, y):
    with np.errstate(all="ignore"):
        return np.matmul(x, y)


def _check(got, x, y, dtype_exact: bool = False):
    want = _ref(x, y)
    assert isinstance(got, da.Array)
    assert got.shape == want.shape and got.dtype == want.dtype
    with np.errstate(all="ignore"):
        value = got.compute(scheduler="sync")
    assert value.dtype == want.dtype and value.shape == want.shape
    if dtype_exact:
        np.testing.assert_array_equal(value, want, strict=True)
    else:
        wide = np.promote_types(want.dtype, np.float64)  # float64 or complex128
        ref = np.matmul(x.astype(wide), y.astype(wide))
        tol = 1e-5 if want.dtype in (np.float32, np.complex64) else 1e-12
        np.testing.assert_allclose(value, ref, rtol=tol, atol=tol)
    return value


def test_a_stack_is_one_task_per_batch_chunk():
    # 2000 products of 4x5 @ 5x3 in two batch chunks: two tasks, not one per element
    rng = np.random.default_rng()
    x, y = rng.standard_normal((2000, 4, 5)), rng.standard_normal((2000, 5, 3))
    a, b = da.from_array(x, chunks=(1000, 4, 5)), da.from_array(y, chunks=(1000, 5, 3))
    c = distmm.matmul(a, b)
    assert _own_tasks(c) == 2
    assert len(c.__dask_graph__()) <= 10
    assert c.chunks == da.matmul(a, b).chunks == ((1000, 1000), (4,), (3,))
    _check(c, x, y)


def _operands(rng, dt, x_shape, y_shape):
    """Fresh operands of dtype ``dt`` (small integers as Python ints for object)."""
    if dt == "O":
        return (rng.integers(-9, 9, x_shape).astype(object),
                rng.integers(-9, 9, y_shape).astype(object))
    return random_array(rng, x_shape, dt), random_array(rng, y_shape, dt)


@pytest.mark.parametrize("x_shape,y_shape", [((37, 3, 7), (37, 7, 5)), ((1, 3, 7), (37, 7, 5)),
                                             ((3, 7), (2, 37, 7, 5)), ((37, 1, 7), (37, 7, 5)),
                                             ((37, 3, 7), (1, 7, 1))])
def test_stack_bits_are_the_per_element_paths(monkeypatch, x_shape, y_shape):
    from distmm.engine.dask import stacks

    rng = np.random.default_rng()
    elements = int(np.prod(np.broadcast_shapes(x_shape[:-2], y_shape[:-2])))
    for dt in ("f8", "f4", "c16", "i8", "f2", "O"):
        x, y = _operands(rng, dt, x_shape, y_shape)
        a = da.from_array(x, chunks=(10,) * (x.ndim - 2) + x_shape[-2:])
        b = da.from_array(y, chunks=(16,) * (y.ndim - 2) + y_shape[-2:])
        with np.errstate(all="ignore"):
            new = distmm.matmul(a, b)
            with monkeypatch.context() as m:
                m.setattr(stacks, "SMALL_FLOPS", -1)
                old = distmm.matmul(a, b)
            assert _own_tasks(old) == elements > _own_tasks(new)
            assert _own_tasks(new) == np.prod([len(c) for c in new.chunks])
            np.testing.assert_array_equal(new.compute(), old.compute(), strict=True)
            np.testing.assert_array_equal(new.compute(), _ref(x, y), strict=True)


@pytest.mark.parametrize("dta,dtb", [("f8", "f8"), ("f4", "f4"), ("f4", "f8"), ("f2", "f2"),
                                     ("i4", "i4"), ("u1", "i1"), ("i8", "i8"), ("?", "?"),
                                     ("c8", "f4"), ("c16", "c16"), ("?", "f4")])
def test_dtypes_and_values_are_numpys(dta, dtb):
    rng = np.random.default_rng()
    x, y = random_array(rng, (23, 3, 6), dta), random_array(rng, (23, 6, 4), dtb)
    a, b = da.from_array(x, chunks=(7, 3, 6)), da.from_array(y, chunks=(7, 6, 4))
    c = distmm.matmul(a, b)
    assert _own_tasks(c) == 4
    exact = dta in EXACT and dtb in EXACT or dta == dtb == "f2"
    _check(c, x, y, dtype_exact=exact)


def test_object_stacks():
    rng = np.random.default_rng()
    x = rng.integers(-10**18, 10**18, (9, 2, 3)).astype(object) * 10**9  # beyond int64
    y = rng.integers(-100, 100, (9, 3, 2)).astype(object)
    c = distmm.matmul(da.from_array(x, chunks=(4, 2, 3)), da.from_array(y, chunks=(5, 3, 2)))
    assert _own_tasks(c) == 4  # batch edges 0, 4, 5, 8, 9
    _check(c, x, y, dtype_exact=True)


@pytest.mark.parametrize("x_shape,y_shape,x_chunks,y_chunks,tasks", [
    ((1, 4, 5), (31, 5, 2), (1, 4, 5), (10, 5, 2), 4),       # a broadcast over b's chunks
    ((31, 4, 5), (5, 2), (8, 4, 5), (5, 2), 4),              # a 2-d b
    ((6, 1, 4, 5), (7, 5, 2), (4, 1, 4, 5), (3, 5, 2), 6),   # both broadcast, more batch axes
    ((19, 4, 5), (19, 5, 3), (5, 4, 5), (7, 5, 3), 6),       # unequal batch chunks: joined
    ((3, 1, 4, 5), (1, 11, 5, 3), (2, 1, 4, 5), (1, 4, 5, 3), 6),
])
def test_broadcast_batch_axes(x_shape, y_shape, x_chunks, y_chunks, tasks):
    rng = np.random.default_rng()
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    a, b = da.from_array(x, chunks=x_chunks), da.from_array(y, chunks=y_chunks)
    for d1, d2 in [(a, b), (x, b), (a, y)]:
        c = distmm.matmul(d1, d2)
        if d1 is a and d2 is b:
            assert _own_tasks(c) == tasks
            ours = da.matmul(a, b).chunks
            assert c.chunks == ours  # dask's own batch chunks
        _check(c, x, y)


@pytest.mark.parametrize("x_shape,y_shape", [((0, 4, 5), (0, 5, 3)), ((3, 0, 5), (3, 5, 2)),
                                             ((3, 4, 0), (3, 0, 2)), ((0, 4, 5), (5, 3)),
                                             ((2, 0, 4, 5), (1, 5, 3))])
def test_empty_stacks(x_shape, y_shape):
    rng = np.random.default_rng()
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    c = distmm.matmul(da.from_array(x, chunks=2), da.from_array(y, chunks=3))
    _check(c, x, y)


@pytest.mark.parametrize("x_shape,y_shape", [((5,), (33, 5, 4)), ((33, 4, 5), (5,)),
                                             ((2, 17, 1, 5), (5,))])
def test_vectors_with_stacks(x_shape, y_shape):
    rng = np.random.default_rng()
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    a = da.from_array(x, chunks=tuple(10 if s > 10 else s for s in x_shape))
    b = da.from_array(y, chunks=tuple(10 if s > 10 else s for s in y_shape))
    c = distmm.matmul(a, b)
    assert c.chunks == da.matmul(a, b).chunks
    _check(c, x, y)


def test_large_elements_keep_a_task_each():
    rng = np.random.default_rng()
    # 2 m n k above stacks.SMALL_FLOPS (2**27)
    x, y = rng.standard_normal((2, 411, 409)), rng.standard_normal((2, 409, 413))
    c = distmm.matmul(da.from_array(x, chunks=(2, 411, 409)),
                      da.from_array(y, chunks=(2, 409, 413)))
    assert _own_tasks(c) == 2
    _check(c, x, y)
    c = distmm.matmul(da.from_array(x, chunks=(2, 206, 205)),
                      da.from_array(y, chunks=(2, 205, 207)))
    assert _own_tasks(c) == 8  # 2 x 2 output blocks per element
    _check(c, x, y)


# stacks whose matrices span chunks, or that the plan splits along k: one task per batch chunk
# and output block, handed that batch chunk's k chunks


def _per_element(monkeypatch, a, b):
    """distmm's lazy product of ``a`` and ``b`` with one task per element and output block
    (the stack path off)."""
    from distmm.engine.dask import stacks

    with monkeypatch.context() as m:
        m.setattr(stacks, "SMALL_FLOPS", -1)
        return distmm.matmul(a, b)


def _close_or_exact(got, x, y):
    """``got`` is numpy's product: exactly for integers and objects, within the dtype's
    rounding for floats (the k pieces sum in another order than numpy's call)."""
    want = _ref(x, y)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind in "iuO":
        np.testing.assert_array_equal(got, want, strict=True)
        return
    wide = np.promote_types(want.dtype, np.float64)
    tol = {"e": 1e-2, "f": 1e-4, "F": 1e-4}.get(want.dtype.char, 1e-12)
    np.testing.assert_allclose(got, np.matmul(x.astype(wide), y.astype(wide)), rtol=tol,
                               atol=tol * max(x.shape[-1], 1))


def test_a_spanning_stack_is_one_task_per_batch_chunk_and_block():
    # 61 products of 9x7 @ 7x5 in chunks of 20 x 4x3 and 20 x 3x2: 4 batch chunks by 3 x 3
    # output blocks, not a task per element and output block (549)
    rng = np.random.default_rng()
    x, y = rng.standard_normal((61, 9, 7)), rng.standard_normal((61, 7, 5))
    a, b = da.from_array(x, chunks=(20, 4, 3)), da.from_array(y, chunks=(20, 3, 2))
    c = distmm.matmul(a, b)
    assert _own_tasks(c) == 36
    assert c.chunks == da.matmul(a, b).chunks == ((20, 20, 20, 1), (4, 4, 1), (2, 2, 1))
    _check(c, x, y)


@pytest.mark.parametrize("x_shape,y_shape,x_chunks,y_chunks", [
    ((37, 9, 7), (37, 7, 5), (10, 4, 3), (16, 3, 2)),     # ragged last chunks, batch joined
    ((1, 9, 7), (37, 7, 5), (1, 5, 4), (10, 4, 5)),       # A broadcast; B's columns whole
    ((9, 7), (2, 37, 7, 5), (4, 3), (1, 10, 3, 5)),       # a 2-d A
    ((6, 1, 4, 7), (7, 7, 3), (4, 1, 3, 2), (3, 2, 2)),   # both broadcast, two batch axes
    ((7,), (23, 7, 5), (3,), (10, 3, 2)),                 # a vector A, promoted
    ((23, 9, 7), (7,), (10, 4, 3), (3,)),                 # a vector B, promoted
    ((21, 9, 7), (21, 7, 5), ((10, 11), (4, 0, 5), (3, 4)), (10, 3, 2)),  # an empty row chunk
])
@pytest.mark.slow
@NUMPY1_BLAS_FORMS
def test_spanning_stack_bits_are_the_per_element_paths(monkeypatch, x_shape, y_shape, x_chunks,
                                                       y_chunks):
    rng = np.random.default_rng()
    for dt in ("f8", "f4", "c16", "i8", "f2", "O"):
        x, y = _operands(rng, dt, x_shape, y_shape)
        a, b = da.from_array(x, chunks=x_chunks), da.from_array(y, chunks=y_chunks)
        with np.errstate(all="ignore"):
            new, old = distmm.matmul(a, b), _per_element(monkeypatch, a, b)
            assert _own_tasks(new) == np.prod([len(c) for c in new.chunks]) < _own_tasks(old)
            assert new.chunks == da.matmul(a, b).chunks
            got = new.compute()
            np.testing.assert_array_equal(got, old.compute(), strict=True)
            _close_or_exact(got, x, y)


@pytest.mark.parametrize("k_chunk", [500, 3000])
def test_a_stack_the_plan_splits_along_k(monkeypatch, k_chunk):
    # k = 3000 in two k groups and a sum per element on the per-element path (also where
    # k is one chunk): here one task per batch chunk, the same sums in the same order
    rng = np.random.default_rng()
    for dt in ("f8", "f4", "c16", "i8"):
        x, y = random_array(rng, (41, 3, 3000), dt), random_array(rng, (41, 3000, 2), dt)
        a = da.from_array(x, chunks=(20, 3, k_chunk))
        b = da.from_array(y, chunks=(20, k_chunk, 2))
        new, old = distmm.matmul(a, b), _per_element(monkeypatch, a, b)
        assert _own_tasks(old) > 41 * 2  # partials and their sums
        assert _own_tasks(new) == 3
        got = new.compute()
        np.testing.assert_array_equal(got, old.compute(), strict=True)
        _close_or_exact(got, x, y)


def test_a_tile_asked_for_keeps_a_task_per_element():
    # output blocks on the tile, not on the operands' chunks: one task per element and block
    rng = np.random.default_rng()
    x, y = rng.standard_normal((21, 9, 7)), rng.standard_normal((21, 7, 5))
    a, b = da.from_array(x, chunks=(10, 4, 3)), da.from_array(y, chunks=(10, 3, 2))
    c = distmm.matmul(a, b, tile=(3, 3, 256))
    assert c.chunks == ((1,) * 21, (3, 3, 3), (3, 2))
    assert _own_tasks(c) == 21 * 6
    _check(c, x, y)


@pytest.mark.parametrize("x_shape,y_shape", [((0, 9, 7), (0, 7, 5)), ((5, 9, 0), (5, 0, 5)),
                                             ((5, 0, 7), (5, 7, 5)), ((5, 9, 7), (1, 7, 0))])
def test_empty_spanning_stacks(x_shape, y_shape):
    rng = np.random.default_rng()
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    a, b = da.from_array(x, chunks=(2, 4, 3)), da.from_array(y, chunks=(3, 3, 2))
    c = distmm.matmul(a, b)
    assert c.chunks == da.matmul(a, b).chunks
    _check(c, x, y)


def test_the_stack_product_is_lazy(tmp_path):
    marks = tmp_path / "computed"
    mark = marking(marks)

    rng = np.random.default_rng()
    x, y = rng.random((40, 3, 4)), rng.random((40, 4, 2))
    meta = np.empty((0, 0, 0))
    a = da.from_array(x, chunks=(20, 3, 4)).map_blocks(mark, dtype=float, meta=meta)
    b = da.from_array(y, chunks=(20, 4, 2)).map_blocks(mark, dtype=float, meta=meta)
    c = distmm.matmul(a, b)
    assert not Path(marks).exists()
    assert _own_tasks(c) == 2
    np.testing.assert_allclose(c.compute(scheduler="sync"), x @ y)
    assert Path(marks).exists()


@pytest.mark.slow
def test_on_a_client_with_annotations(client):
    rng = np.random.default_rng()
    x, y = rng.standard_normal((501, 3, 5)), rng.standard_normal((501, 5, 4))
    a, b = da.from_array(x, chunks=(100, 3, 5)), da.from_array(y, chunks=(251, 5, 4))
    a, b = client.persist(a), client.persist(b)
    with dask.annotate(retries=3, priority=7):
        c = distmm.matmul(a, b)
    assert _own_tasks(c) == 7
    annotations = c.dask.layers[c.name].annotations
    assert annotations["retries"] == 3 and annotations["priority"] == 7
    got = c.compute()
    np.testing.assert_allclose(got, np.matmul(x, y), rtol=1e-12, atol=1e-12)
    xi, yi = random_array(rng, (77, 3, 5), "i4"), random_array(rng, (77, 5, 4), "i4")
    ci = distmm.matmul(da.from_array(xi, chunks=(40, 3, 5)), da.from_array(yi, chunks=(40, 5, 4)),
                       client=client)
    assert _own_tasks(ci) == 2
    np.testing.assert_array_equal(client.compute(ci).result(), np.matmul(xi, yi), strict=True)


@pytest.mark.slow
@NUMPY1_BLAS_FORMS
def test_a_spanning_stack_on_a_client(client, monkeypatch):
    rng = np.random.default_rng()
    for dt in ("f8", "i4"):
        x, y = random_array(rng, (41, 9, 7), dt), random_array(rng, (41, 7, 5), dt)
        a, b = da.from_array(x, chunks=(20, 4, 3)), da.from_array(y, chunks=(15, 3, 2))
        a, b = client.persist(a), client.persist(b)
        with dask.annotate(retries=2):
            c = distmm.matmul(a, b)
        assert _own_tasks(c) == 5 * 3 * 3  # batch edges 0, 15, 20, 30, 40, 41
        assert c.dask.layers[c.name].annotations["retries"] == 2
        got = client.compute(c).result()
        old = client.compute(_per_element(monkeypatch, a, b)).result()
        np.testing.assert_array_equal(got, old, strict=True)
        _close_or_exact(got, x, y)


# numpy operands on a client (the eager path): a stack of small matrices is sent and computed
# in about one batch block per worker slot (``stacks.batch_blocks``), not one per element


def _eager(x, y, client, out=None):
    from distmm.engine.dask.stats import last_stats

    got = distmm.matmul(x, y, engine="dask", client=client, out=out)
    return got, last_stats()["tasks"]


@pytest.mark.parametrize("batch,count,blocks", [((10000,), 2, 2), ((3, 10000), 2, 2),
                                                ((2, 3, 1001), 2, 2), ((10001, 2), 3, 3),
                                                ((7,), 10, 7), ((5, 1, 3), 4, 4),
                                                ((1,), 2, 1), ((6,), 4, 3)])
def test_batch_blocks_cover_the_stack_once(batch, count, blocks):
    from distmm.engine.dask.stacks import batch_blocks

    got = batch_blocks(batch, count)
    assert len(got) == blocks
    seen = np.zeros(batch, dtype=int)
    for lo, hi in got:
        seen[tuple(slice(a, b) for a, b in zip(lo, hi))] += 1
    assert (seen == 1).all()


@pytest.mark.slow
def test_a_numpy_stack_on_a_client_is_a_task_per_worker(client):
    # 2001 products of 4x5 @ 5x3: one task per worker slot (2), not one per element
    rng = np.random.default_rng()
    x, y = rng.standard_normal((2001, 4, 5)), rng.standard_normal((2001, 5, 3))
    got, tasks = _eager(x, y, client)
    assert tasks == 2
    np.testing.assert_array_equal(got, np.matmul(x, y), strict=True)
    xi, yi = random_array(rng, (3, 677, 4, 5), "i4"), random_array(rng, (677, 5, 3), "i4")
    got, tasks = _eager(xi, yi, client)
    assert tasks == 2
    np.testing.assert_array_equal(got, np.matmul(xi, yi), strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("x_shape,y_shape", [((37, 3, 7), (37, 7, 5)), ((1, 3, 7), (37, 7, 5)),
                                             ((3, 7), (2, 37, 7, 5)), ((6, 1, 4, 5), (7, 5, 2)),
                                             ((37, 3, 7), (7,)), ((5,), (3, 1, 11, 5, 4))])
@NUMPY1_BLAS_FORMS
def test_numpy_stack_bits_and_out_are_the_per_element_paths(client, monkeypatch, x_shape, y_shape):
    from distmm.engine.dask import stacks

    rng = np.random.default_rng()
    elements = int(np.prod(np.broadcast_shapes(x_shape[:-2] if len(x_shape) > 1 else (),
                                               y_shape[:-2] if len(y_shape) > 1 else ())))
    for dt in ("f8", "f4", "c16", "i8", "f2", "O"):
        x, y = _operands(rng, dt, x_shape, y_shape)
        want = _ref(x, y)
        with np.errstate(all="ignore"):
            new, tasks = _eager(x, y, client)
            out = np.full_like(want, 7)
            into, _ = _eager(x, y, client, out=out)
            with monkeypatch.context() as m:
                m.setattr(stacks, "SMALL_FLOPS", -1)
                old, old_tasks = _eager(x, y, client)
        assert old_tasks == elements > tasks == 2
        assert into is out
        np.testing.assert_array_equal(new, old, strict=True)
        np.testing.assert_array_equal(out, old, strict=True)
        if dt != "f4":  # float32: numpy's own bits only where the BLAS is the same
            np.testing.assert_array_equal(new, want, strict=True)


@pytest.mark.slow
def test_numpy_stack_reports_numpys_floating_point_flags(client):
    x = np.full((41, 2, 3), 1e300)
    y = np.full((41, 3, 2), 1e300)
    with pytest.warns(RuntimeWarning, match="overflow"):
        want = np.matmul(x, y)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        np.matmul(x, y)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        _eager(x, y, client)
    with np.errstate(over="ignore"):
        got, tasks = _eager(x, y, client)
    assert tasks == 2
    np.testing.assert_array_equal(got, want, strict=True)


@pytest.mark.slow
def test_a_numpy_stack_survives_a_worker_killed_mid_run(client):
    # object elements: seconds of work per batch block, long enough to kill a worker in
    from conftest import kill_workers, start_call

    rng = np.random.default_rng()
    x = rng.integers(-9, 9, (801, 40, 40)).astype(object)
    y = rng.integers(-9, 9, (801, 40, 40)).astype(object)
    run, out = start_call(distmm.matmul, x, y, engine="dask", client=client)
    try:
        killed = kill_workers(client, run, kills=1, gap=0.05)
    finally:
        run.join(240)
    assert not run.is_alive()
    assert killed == 1
    assert "c" in out, f"raised instead of retrying: {out.get('error')!r}"
    np.testing.assert_array_equal(out["c"], np.matmul(x, y), strict=True)
