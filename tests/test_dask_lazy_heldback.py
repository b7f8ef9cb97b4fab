"""Held-back cases of the lazy product of dask operands (``distmm.engine.dask.lazy``,
``chunks``, ``graph``, ``stacks``) against dask.array's own ``a @ b``, with no client and
on a two-worker cluster: unknown chunk sizes on any axis (refused), k chunks of A and B that
do not line up, 1-D operands beside numpy ones, broadcast stacks (batch chunks of 1 and n),
dtype promotion and ``dtype=``, laziness with vectors and stacks, the same bits from every
computation and scheduler, the graph's name, ``persist()``, and a pickled or copied result
(its worker pins kept on a cluster).
It does *not* cover dask's own test cases (tests/test_dask_parity.py) or the tasks' placement
(tests/test_dask_placement.py).

Documented differences from dask.array checked here: an operand with unknown (NaN) chunk
sizes is refused before any work (``chunks.check_chunks``; dask's ``a @ b`` builds its graph),
and a stack of elements above ``stacks.SMALL_FLOPS`` has one output chunk per
element along its batch axes (``lazy.output_chunks``; dask's follows the operands' chunks).
"""
from __future__ import annotations

import copy
import pickle
from fractions import Fraction

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
from dask.array.utils import assert_eq  # noqa: E402

import distmm  # noqa: E402
from conftest import marking  # noqa: E402
from distmm.engine.dask.lazy import PinnedArray  # noqa: E402
from distmm.engine.dask.stacks import SMALL_FLOPS  # noqa: E402


def _unknown_rows(rng, rows: int, cols: int, chunks):
    """A dask array of ``rows`` x ``cols`` values with NaN row chunks (boolean indexing)."""
    x = da.from_array(rng.standard_normal((rows, cols)), chunks=chunks)
    keep = da.from_array(rng.random(rows) > 0.3, chunks=chunks[0])
    return x[keep]


def test_unknown_chunk_sizes_on_any_axis_are_refused_before_any_work():
    """NaN chunks along m, k, n or a vector's only axis, beside a dask or numpy operand:
    one ValueError naming the operand, raised at the call (dask's ``a @ b`` builds its graph
    instead: a documented choice, ``chunks.check_chunks``)."""
    rng = np.random.default_rng()
    u = _unknown_rows(rng, 23, 5, (7, 3))            # (nan, 5)
    v = da.from_array(rng.standard_normal(23), chunks=6)
    v = v[v > 0]                                     # (nan,)
    cases = [("a", u, np.ones((5, 3))), ("b", np.ones((4, 5)), u.T), ("a", u.T, u),
             ("b", da.ones((2, 5), chunks=2), u.T), ("a", v, v), ("b", np.ones((2, 3, 5)), u.T)]
    for which, x, y in cases:
        assert isinstance(x @ y, da.Array)  # dask takes it
        with pytest.raises(ValueError, match=f"operand {which} has unknown chunk sizes"):
            distmm.matmul(x, y)
    u.compute_chunk_sizes()
    got = distmm.matmul(u.T, u)
    assert got.chunks == (u.T @ u).chunks
    want = u.compute()
    np.testing.assert_allclose(got.compute(), want.T @ want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("a_chunks, b_chunks", [
    (((5, 8), (3, 9, 1, 6)), ((4, 4, 11), (2, 7))),       # no inner edge shared
    (((13,), (1,) * 19), ((19,), (9,))),                  # one-wide k chunks against one
    (((4, 9), (10, 0, 9)), ((0, 7, 0, 12), (5, 4))),      # zero-size k chunks on both
])
def test_k_chunks_that_do_not_line_up(a_chunks, b_chunks):
    rng = np.random.default_rng()
    x, y = rng.standard_normal((13, 19)), rng.standard_normal((19, 9))
    a, b = da.from_array(x, chunks=a_chunks), da.from_array(y, chunks=b_chunks)
    got = distmm.matmul(a, b)
    assert got.chunks == (a @ b).chunks
    np.testing.assert_allclose(got.compute(), x @ y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x_shape, y_shape, x_chunks, y_chunks", [
    ((17,), (17, 9), 5, (6, 4)),
    ((9, 17), (17,), (4, 6), 5),
    ((17,), (17,), 5, 6),
    ((17,), (2, 3, 17, 9), 5, (1, 2, 6, 4)),
    ((3, 1, 9, 17), (17,), (2, 1, 4, 6), 7),
    ((0,), (0, 9), 1, (1, 4)),
    ((9, 0), (0,), (4, 1), 1),
])
def test_vectors_beside_numpy_operands_as_dask(x_shape, y_shape, x_chunks, y_chunks):
    """A 1-D operand, dask or numpy, beside the other kind: shape, chunks, dtype and values
    of dask's ``a @ b``, and a lazy result."""
    rng = np.random.default_rng()
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    a, b = da.from_array(x, chunks=x_chunks), da.from_array(y, chunks=y_chunks)
    for d1, d2 in [(a, b), (x, b), (a, y)]:
        got, want = distmm.matmul(d1, d2), d1 @ d2
        assert isinstance(got, da.Array)
        assert got.shape == want.shape and got.chunks == want.chunks
        assert_eq(got, np.matmul(x, y))


def test_vector_and_stack_products_are_lazy(tmp_path):
    """Nothing of a dask operand is computed while distmm builds the graph of a product
    with a vector (dask or numpy) or of a stack, small or large elements."""
    marks = tmp_path / "computed"
    mark = marking(marks)

    rng = np.random.default_rng()

    def lazy(shape, chunks):
        return da.from_array(rng.standard_normal(shape), chunks=chunks).map_blocks(
            mark, dtype=float, meta=np.empty((0,) * len(shape)))

    v, m, s = lazy((9,), 4), lazy((9, 5), 3), lazy((3, 9, 5), (2, 4, 3))
    big = lazy((2, 411, 411), (1, 206, 206))
    pairs = [(v, m), (m.T, v), (v, v), (v, s), (s.transpose(0, 2, 1), v), (np.ones(9), s),
             (v, np.ones((9, 2))), (big, big)]
    results = [distmm.matmul(x, y) for x, y in pairs]
    assert not marks.exists()
    assert all(isinstance(r, da.Array) and r.shape == (x @ y).shape
               for r, (x, y) in zip(results, pairs))
    vv = results[2].compute(scheduler="sync")
    assert marks.exists()
    w = v.compute(scheduler="sync")
    np.testing.assert_allclose(vv, w @ w, rtol=1e-12)


@pytest.mark.parametrize("x_shape, y_shape, x_chunks, y_chunks", [
    ((4, 1, 7, 5), (3, 5, 6), (1, 1, 4, 2), (2, 3, 3)),   # batch chunks of 1 and of n
    ((1, 7, 5), (6, 5, 3), (1, 7, 5), (4, 5, 3)),          # an extent-1 batch read by all
    ((5, 7, 6), (5, 6, 3), (2, 4, 3), (3, 3, 3)),          # batch edges that do not line up
    ((2, 0, 7, 5), (1, 5, 3), (1, 1, 4, 2), (1, 2, 3)),    # an empty batch axis
])
def test_broadcast_stacks_take_dasks_chunks(x_shape, y_shape, x_chunks, y_chunks):
    rng = np.random.default_rng()
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    a, b = da.from_array(x, chunks=x_chunks), da.from_array(y, chunks=y_chunks)
    got = distmm.matmul(a, b)
    assert got.chunks == (a @ b).chunks
    assert_eq(got, np.matmul(x, y))


def test_large_element_stacks_have_a_chunk_per_element():
    """Elements above ``SMALL_FLOPS``: one output chunk per element along the batch axis
    (a documented choice, ``lazy.output_chunks``), the matrices' chunks as dask's."""
    rng = np.random.default_rng()
    m = 411
    assert 2 * m ** 3 > SMALL_FLOPS
    x, y = rng.standard_normal((3, m, m)), rng.standard_normal((1, m, m))
    a, b = da.from_array(x, chunks=(3, 206, 137)), da.from_array(y, chunks=(1, 150, 206))
    got = distmm.matmul(a, b)
    want = a @ b
    assert want.chunks[0] == (3,) and got.chunks == ((1, 1, 1),) + want.chunks[1:]
    np.testing.assert_allclose(got.compute(), x @ y, rtol=1e-10, atol=1e-10)


def _array(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == object:
        return np.array([Fraction(int(v), 3) for v in rng.integers(-5, 6, int(np.prod(shape)))],
                        dtype=object).reshape(shape)
    if dtype.kind == "b":
        return rng.random(shape) > 0.5
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -5, 6, shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


PROMOTIONS = [("i1", "u8"), ("u8", "i8"), ("?", "?"), ("?", "i1"), ("f2", "f2"), ("f2", "c8"),
              ("c8", "f8"), ("O", "O"), ("O", "f8"), ("i1", "i1")]


def _assert_numpys(got, want):
    assert isinstance(got, da.Array) and got.dtype == got._meta.dtype == want.dtype
    value = got.compute()
    assert value.dtype == want.dtype and value.shape == want.shape
    if want.dtype.kind in "biuO":
        assert (value == want).all()
    else:
        tol = 1e-2 if want.dtype in (np.float16, np.complex64) else 1e-12
        np.testing.assert_allclose(value, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dta, dtb", PROMOTIONS)
def test_dtype_promotion_and_dtype_keyword_are_numpys(dta, dtb):
    """numpy's result dtype (dask's ``a @ b`` says int64 for bool and int8), ``dtype=``
    numpy takes, and numpy's exception type for one it refuses."""
    rng = np.random.default_rng()
    x, y = _array(rng, (7, 5), dta), _array(rng, (5, 3), dtb)
    a, b = da.from_array(x, chunks=(3, 2)), da.from_array(y, chunks=(2, 2))
    _assert_numpys(distmm.matmul(a, b), np.matmul(x, y))
    for dt in ("f8", "c16", "i8", "O", "?"):
        try:
            want = np.matmul(x, y, dtype=dt)
        except Exception as exc:
            with pytest.raises(type(exc)):
                distmm.matmul(a, b, dtype=dt)
            continue
        _assert_numpys(distmm.matmul(a, b, dtype=dt), want)


def test_the_same_bits_from_every_computation_and_scheduler():
    """A product split along k (A's and B's k chunks not lined up) and a stack split along
    k: every compute, on every local scheduler, gives the same bits."""
    rng = np.random.default_rng()
    x, y = rng.standard_normal((33, 701)), rng.standard_normal((701, 17))
    s, t = rng.standard_normal((5, 9, 301)), rng.standard_normal((1, 301, 7))
    with dask.config.set({"distmm.memory-budget": "16KiB"}):
        c = distmm.matmul(da.from_array(x, chunks=(11, 97)), da.from_array(y, chunks=(130, 6)))
        d = distmm.matmul(da.from_array(s, chunks=(2, 4, 50)), da.from_array(t, chunks=(1, 77, 3)))
    assert c.dask.layers[c.name].geometry.groups > 1
    for lazy, want in ((c, x @ y), (d, s @ t)):
        runs = [lazy.compute(scheduler=sched) for sched in ("threads", "sync", "threads")]
        assert all(np.array_equal(runs[0], r) for r in runs[1:])
        np.testing.assert_allclose(runs[0], want, rtol=1e-10, atol=1e-10)


def test_names_follow_the_operands():
    """The same operands (numpy ones by value) give the same name, any different operand
    value, vector or stack a different one."""
    rng = np.random.default_rng()
    x, y = rng.standard_normal((13, 11)), rng.standard_normal((11, 7))
    a = da.from_array(x, chunks=(5, 4))
    y2 = y.copy()
    y2[3, 4] += 1.0
    assert distmm.matmul(a, y).name == distmm.matmul(a, y.copy()).name
    assert distmm.matmul(a, y).name != distmm.matmul(a, y2).name
    v = da.from_array(rng.standard_normal(13), chunks=4)
    assert distmm.matmul(v, a).name == distmm.matmul(v, a).name
    assert len({distmm.matmul(v, a).name, distmm.matmul(v + 1, a).name,
                distmm.matmul(v[None], a).name}) == 3
    s = da.from_array(rng.standard_normal((4, 5, 6)), chunks=(2, 5, 6))
    t = da.from_array(rng.standard_normal((4, 6, 3)), chunks=(2, 6, 3))
    assert distmm.matmul(s, t).name == distmm.matmul(s, t).name
    assert len({distmm.matmul(s, t).name, distmm.matmul(s, t, dtype="f4").name,
                distmm.matmul(s, t + 0).name}) == 3


def test_persist_and_pickle_without_a_client():
    rng = np.random.default_rng()
    x, y = rng.standard_normal((13, 11)), rng.standard_normal((11, 7))
    c = distmm.matmul(da.from_array(x, chunks=(5, 4)), da.from_array(y, chunks=(3, 7)))
    want = c.compute()
    np.testing.assert_allclose(want, x @ y, rtol=1e-12, atol=1e-12)
    p = c.persist(scheduler="sync")
    assert p.chunks == c.chunks and np.array_equal(p.compute(), want)
    u = pickle.loads(pickle.dumps(c))
    assert type(u) is type(c) and u.name == c.name and u.chunks == c.chunks
    assert np.array_equal(u.compute(), want)


def _pins(client, name):
    """The worker restrictions of the scheduler's tasks named ``name``."""
    def get(dask_scheduler):
        return {ts.key: sorted(ts.worker_restrictions or ()) for ts in dask_scheduler.tasks.values()
                if isinstance(ts.key, tuple) and ts.key[0] == name}

    return client.run_on_scheduler(get)


COPIES = {"pickle": lambda c: pickle.loads(pickle.dumps(c)), "copy": lambda c: c.copy(),
          "deepcopy": copy.deepcopy}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("layout", ["tiles", "blocks"])
@pytest.mark.slow
def test_a_copied_result_keeps_its_worker_pins(client, layout, how):
    """A lazy result of a cluster, pickled and loaded or copied, is still distmm's array:
    persisted, its tasks keep their workers, and its values are numpy's. It came back a
    plain ``dask.array.Array``, whose optimisation dropped every pin."""
    import distributed

    rng = np.random.default_rng()
    x, y = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    with dask.config.set({"distmm.dask-layout": layout, "distmm.dask-worker-gflops": {"cpu": 10}}):
        c = distmm.matmul(da.from_array(x, chunks=10), da.from_array(y, chunks=(10, 7)),
                          client=client)
    assert isinstance(c, PinnedArray)
    u = COPIES[how](c)
    assert u.name == c.name and u.chunks == c.chunks and u.dtype == c.dtype
    p = u.persist()  # the first of this name the scheduler sees: the copy's pins
    distributed.wait(p)
    pins = _pins(client, c.name)
    assert len(pins) == c.npartitions and all(pins.values()), pins
    assert type(u) is PinnedArray
    np.testing.assert_allclose(p.compute(), x @ y, rtol=1e-12, atol=1e-12)
    assert np.array_equal(c.compute(), p.compute())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tiles", "blocks"])
def test_promotions_and_vectors_on_a_cluster(client, layout):
    """Mixed dtypes, vectors beside numpy operands and mismatched k chunks on a cluster:
    numpy's dtype and values, dask's chunks, the same bits twice."""
    rng = np.random.default_rng()
    with dask.config.set({"distmm.dask-layout": layout, "distmm.dask-worker-gflops": {"cpu": 10}}):
        for dta, dtb in (("i1", "u8"), ("?", "?"), ("f2", "c8"), ("O", "f8")):
            x, y = _array(rng, (9, 7), dta), _array(rng, (7, 5), dtb)
            a, b = da.from_array(x, chunks=(4, 3)), da.from_array(y, chunks=(2, 5))
            got = distmm.matmul(a, b, client=client)
            assert got.chunks == (a @ b).chunks
            _assert_numpys(got, np.matmul(x, y))
        x, y = rng.standard_normal((9, 17)), rng.standard_normal(17)
        a = da.from_array(x, chunks=(4, (5, 5, 7)))
        for d1, d2 in ((a, y), (y, a.T), (a, da.from_array(y, chunks=6))):
            got = distmm.matmul(d1, d2, client=client)
            assert got.chunks == (d1 @ d2).chunks
            first = got.compute()
            np.testing.assert_allclose(first, np.matmul(np.asarray(d1), np.asarray(d2)),
                                       rtol=1e-12, atol=1e-12)
            assert np.array_equal(first, got.compute())
