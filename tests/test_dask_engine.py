"""The Dask engine on a real LocalCluster of worker processes.

Covers: numpy and dask operands against numpy (odd shapes, uneven chunks,
broadcast batches, vectors, every dtype the core supports), exact integer and
boolean results, the k-split reduction and its bitwise reproducibility,
call-time errors, pinning to the plan's owners, ``dask.annotate`` on the product's
tasks, block mode's name, progress and performance reports, a worker killed in the middle
of a product, and the k-loop inside a task.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

import distmm  # noqa: E402
from distmm.api import plan_for  # noqa: E402
from distmm.plan import make_plan  # noqa: E402
from distmm.engine.dask import placement as dask_placement  # noqa: E402
from distmm.engine.tiles import reduce_partials  # noqa: E402
from conftest import assert_close, too_big_results  # noqa: E402

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


pytestmark = pytest.mark.usefixtures("tile_mode")


def _operands(rng, shape_a, shape_b, dtype):
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape_a) < 0.3, rng.random(shape_b) < 0.3
    if dt.kind in "iu":
        # large enough that narrow integers wrap, as numpy's do
        lo, hi = (0, 200) if dt.kind == "u" else (-100, 100)
        return (rng.integers(lo, hi, shape_a).astype(dt), rng.integers(lo, hi, shape_b).astype(dt))
    a = rng.standard_normal(shape_a)
    b = rng.standard_normal(shape_b)
    if dt.kind == "c":
        a = a + 1j * rng.standard_normal(shape_a)
        b = b + 1j * rng.standard_normal(shape_b)
    return a.astype(dt), b.astype(dt)


def _check(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = {"float16": 2e-2, "float32": 1e-4, "complex64": 1e-4}.get(want.dtype.name, 1e-10)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max(initial=0))))


# m, k, n: PBLAS's 22x23x24, p*t+1 edges, a single element, long-and-thin
SHAPES = [(22, 23, 24), (1, 1, 1), (33, 17, 65), (65, 130, 1), (7, 300, 5)]


@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
@pytest.mark.slow
def test_numpy_operands_odd_shapes(client, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    a, b = _operands(rng, (m, k), (k, n), "float64")
    c = distmm.matmul(a, b, engine="dask", client=client, tile=16)
    assert isinstance(c, np.ndarray)
    _check(c, a @ b)


CHUNKS = [
    (((10, 40, 15), (23, 7, 70)), ((60, 40), (33, 1, 20))),   # uneven everywhere
    (((65,), (100,)), ((100,), (54,))),                        # one chunk each
    (((32, 33), (50, 50)), ((25, 25, 25, 25), (16, 16, 16, 6))),  # k chunks disagree
    (((1,) * 5 + (60,), (99, 1)), ((3, 97), (54,))),           # slivers
]


@pytest.mark.parametrize("a_chunks,b_chunks", CHUNKS, ids=["uneven", "single", "k-misaligned", "slivers"])
def test_dask_operands_uneven_chunks(client, a_chunks, b_chunks):
    rng = np.random.default_rng(7)
    a, b = _operands(rng, (65, 100), (100, 54), "float64")
    A, B = da.from_array(a, chunks=a_chunks), da.from_array(b, chunks=b_chunks)
    C = distmm.matmul(A, B, client=client, tile=(32, 16, 8))
    assert isinstance(C, da.Array)
    plan = plan_for(65, 54, 100, "float64", workers=2, tile=(32, 16, 8))
    assert C.chunks == (tuple(np.diff(plan.row_edges)), tuple(np.diff(plan.col_edges)))
    _check(C.compute(), a @ b)


def test_dask_chunks_become_tiles(client):
    """Regular chunks set the C tiles; no rechunk layer enters the graph."""
    rng = np.random.default_rng(3)
    a, b = _operands(rng, (300, 200), (200, 260), "float64")
    A, B = da.from_array(a, chunks=(128, 64)), da.from_array(b, chunks=(64, 100))
    C = distmm.matmul(A, B, client=client)
    assert C.chunks == ((128, 128, 44), (100, 100, 60))
    assert not any("rechunk" in name for name in C.dask.layers)
    _check(C.compute(), a @ b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_every_dtype_numpy_and_dask(client, dtype):
    rng = np.random.default_rng(11)
    a, b = _operands(rng, (37, 90), (90, 29), dtype)
    want = a @ b
    _check(distmm.matmul(a, b, client=client, tile=(16, 16, 32)), want)
    A = da.from_array(a, chunks=((20, 17), (45, 30, 15)))
    B = da.from_array(b, chunks=((40, 50), (29,)))
    C = distmm.matmul(A, B, client=client, tile=(16, 16, 32))
    assert C.dtype == want.dtype
    _check(C.compute(), want)


def test_integers_stay_exact_where_dask_array_does_not(client):
    """dask.array turns int8 into int64 and bool into counts once k has more
    than one chunk; distmm keeps numpy's dtype and wrap-around."""
    rng = np.random.default_rng(5)
    a8, b8 = _operands(rng, (20, 64), (64, 10), "int8")
    ab, bb = _operands(rng, (20, 64), (64, 10), "bool")
    for a, b in ((a8, b8), (ab, bb)):
        A, B = da.from_array(a, chunks=16), da.from_array(b, chunks=16)
        got = distmm.matmul(A, B, client=client).compute()
        assert got.dtype == (a @ b).dtype
        np.testing.assert_array_equal(got, a @ b)


def test_mixed_dtypes_and_gemm_promotion(client):
    rng = np.random.default_rng(2)
    a = rng.integers(-5, 5, (30, 40)).astype(np.int8)
    b = rng.standard_normal((40, 20)).astype(np.float32)
    _check(distmm.matmul(da.from_array(a, chunks=17), da.from_array(b, chunks=13), client=client).compute(),
           a @ b)
    c = rng.standard_normal((30, 20))
    got = distmm.gemm(b.T, a.T.astype(np.float32), c.T, alpha=2.0, beta=-1.0, engine="dask", client=client)
    want = 2.0 * (b.T.astype(np.float64) @ a.T.astype(np.float64)) - c.T
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("family", ["numpy", "dask"])
def test_batches_and_vectors(client, family):
    rng = np.random.default_rng(9)
    cases = [((2, 1, 30, 40), (3, 40, 20)), ((40,), (3, 40, 20)), ((2, 30, 40), (40,)), ((40,), (40,))]
    for sa, sb in cases:
        a, b = _operands(rng, sa, sb, "float64")
        if family == "dask":
            A = da.from_array(a, chunks=tuple(max(s // 2, 1) for s in sa))
            B = da.from_array(b, chunks=tuple(max(s // 3, 1) for s in sb))
            got = distmm.matmul(A, B, client=client, tile=16)
            assert isinstance(got, da.Array)
            got = got.compute()
        else:
            got = distmm.matmul(a, b, engine="dask", client=client, tile=16)
        want = a @ b
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert np.shape(got) == want.shape


def test_vector_by_vector_of_dask_operands_computes_as_dasks():
    """dask's matmul squeezes a 1-D operand's axis away: 1-D @ 1-D computes to a 0-d array,
    as ``x @ y`` does, not to the scalar that indexing left (a ``Fraction`` for objects)."""
    from fractions import Fraction

    objects = np.array([Fraction(1, 2), 3], dtype=object)
    for x, y in ((da.arange(3.0, chunks=2), da.ones(3, chunks=1)),
                 (da.from_array(objects, chunks=-1), objects[::-1].copy())):
        want = (x @ y).compute()
        got = distmm.matmul(x, y)
        assert got.chunks == (x @ y).chunks == ()
        got = got.compute()
        assert type(got) is type(want) is np.ndarray, type(got)
        assert got.dtype == want.dtype and got.shape == () and got[()] == want[()]


def test_empty_and_zero_k(client):
    for sa, sb in (((0, 5), (5, 3)), ((4, 0), (0, 3)), ((4, 5), (5, 0))):
        a, b = np.ones(sa), np.ones(sb)
        _check(distmm.matmul(a, b, engine="dask", client=client), a @ b)
        _check(distmm.matmul(da.from_array(a), da.from_array(b), client=client).compute(), a @ b)


def test_zero_size_chunks_along_m_and_n(client):
    """Boolean indexing then ``compute_chunk_sizes()`` leaves chunks of no rows: their
    output blocks are empty (the task indexed a list of no pieces)."""
    rng = np.random.default_rng()
    x, y = rng.standard_normal((6, 5)), rng.standard_normal((5, 8))
    a = da.from_array(x, chunks=(3, 5))
    a = a[da.from_array(np.array([False, False, False, True, True, True]), chunks=3)]
    b = da.from_array(y, chunks=(5, 4))
    b = b[:, da.from_array(np.array([False] * 4 + [True] * 4), chunks=4)]
    for operand in (a, b):
        operand.compute_chunk_sizes()
    assert 0 in a.chunks[0] and 0 in b.chunks[1]
    for left, right in ((a, y), (x, b), (a, b), (a.astype(np.int16), b.astype(np.int16))):
        want = np.asarray(left) @ np.asarray(right)
        got = distmm.matmul(left, right, client=client).compute()
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_k_split_is_reduced_along_the_fixed_tree(client):
    """(64, 200000) @ (200000, 64): one C tile, k split over the workers,
    partials summed in the plan's order: the same bits every run."""
    # made on the cluster: a 100 MB operand is not shipped inside a graph
    gen = da.random.default_rng(42)
    A = gen.standard_normal((64, 200000), chunks=(64, 50000)).persist()
    B = gen.standard_normal((200000, 64), chunks=(50000, 64)).persist()
    a, b = A.compute(), B.compute()
    plan = plan_for(64, 64, 200000, "float64", workers=2)
    assert plan.grid == (1, 1) and plan.k_splits >= 2
    c1 = distmm.matmul(a, b, client=client)
    c2 = distmm.matmul(a, b, client=client)
    assert np.array_equal(c1, c2)
    parts = [a[:, plan.k_slice(s)] @ b[plan.k_slice(s), :] for s in range(plan.k_splits)]
    assert np.array_equal(c1, reduce_partials(plan, parts))
    np.testing.assert_allclose(c1, a @ b, rtol=1e-10, atol=1e-10)
    # dask operands: the same plan, the same bits every run
    d1 = distmm.matmul(A, B, client=client).compute()
    assert np.array_equal(d1, distmm.matmul(A, B, client=client).compute())
    np.testing.assert_allclose(d1, c1, rtol=1e-10, atol=1e-10)


def test_shape_mismatch_fails_at_call_time(client):
    A = da.ones((30, 40), chunks=10)
    B = da.ones((41, 20), chunks=10)
    with pytest.raises(ValueError, match=r"inner dimensions differ.*\(30, 40\).*\(41, 20\)"):
        distmm.matmul(A, B)  # dask's own matmul raises only at compute (dask#8948)


def test_out_with_dask_operands_is_refused_before_shapes_or_axes():
    """numpy hands a call with a dask operand to dask, whose matmul refuses ``out=`` (a
    TypeError) before it looks at shapes or ``axes``: so does distmm (it raised its
    ValueError for the shapes first)."""
    out = np.empty((2, 2))
    cases = [((da.ones(5), da.ones((6, 9))), {}), ((da.ones((2, 3)), np.ones((4, 2))), {}),
             ((np.ones(()), da.ones(3)), {}),
             ((da.ones((2, 3)), da.ones((3, 2))), {"axes": [(0, 5), (0, 1), (0, 1)]})]
    for (a, b), kw in cases:
        with pytest.raises(TypeError):
            np.matmul(a, b, out=out, **kw)
        with pytest.raises(TypeError, match="out= is not supported for dask operands"):
            distmm.matmul(a, b, out=out, **kw)


def test_unknown_chunk_sizes_fail_clearly(client):
    x = da.from_array(np.arange(100.0), chunks=30)
    A = x[x > 50].reshape((-1, 1)) if False else x[x > 50][:, None]
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        distmm.matmul(A, da.ones((1, 3)))


def _restrictions(client, name):
    """The worker each task of the product ``name`` is pinned to, by tile."""
    def get(dask_scheduler):
        return {ts.key[1:]: sorted(ts.worker_restrictions or ()) for ts in dask_scheduler.tasks.values()
                if isinstance(ts.key, tuple) and ts.key[0] == name}

    return client.run_on_scheduler(get)


def test_auto_engine_uses_the_cluster_and_pins_tasks(client):
    rng = np.random.default_rng(1)
    a, b = _operands(rng, (256, 128), (128, 256), "float64")
    plan = plan_for(256, 256, 128, "float64", workers=2, tile=(64, 64, 256))
    slots = dask_placement.worker_slots(client)
    # operands not yet on the cluster: owner w is the w-th worker slot
    C = distmm.matmul(da.from_array(a, chunks=64), da.from_array(b, chunks=64)).persist()  # auto
    distributed.wait(C)
    pins = _restrictions(client, C.name)
    assert len(pins) == 16
    for (i, j), workers in pins.items():
        assert workers == [slots[plan.owner_of_tile(i, j)]]
    # loose pins: the scheduler may steal a task to balance, but most stay put
    where = client.who_has(C)
    assert sum(holders == (slots[plan.owner_of_tile(k[1], k[2])],) for k, holders in where.items()) >= 12
    assert_close(C.compute(), a @ b)
    # persisted operands: the owner order (row-major or column-major runs of
    # tiles) and the owner -> worker mapping follow where the operands lie;
    # each owner's tiles still share one worker, and both workers are used
    A, B = da.from_array(a, chunks=64).persist(), da.from_array(b, chunks=64).persist()
    C = distmm.matmul(A, B).persist()
    distributed.wait(C)
    pins = _restrictions(client, C.name)
    fits = []
    for order in ("rows", "cols"):
        p = make_plan(256, 256, 128, "float64", workers=2, tile=(64, 64, 256), owner_order=order)
        by_owner = {}
        for (i, j), workers in pins.items():
            by_owner.setdefault(p.owner_of_tile(i, j), set()).update(workers)
        fits.append(all(len(w) == 1 for w in by_owner.values())
                    and len(set().union(*by_owner.values())) == 2)
    assert any(fits)
    assert_close(C.compute(), a @ b)

    before = _prefix_count(client)
    distmm.matmul(a, b, client=client, tile=64)  # numpy operands, engine="auto"
    assert _prefix_count(client) > before


def _prefix_count(client) -> int:
    def count(dask_scheduler):
        tp = dask_scheduler.task_prefixes.get("distmm-matmul")
        return 0 if tp is None else sum(tp.state_counts.values())

    return client.run_on_scheduler(count)


def _task_states(client, prefix: str) -> dict:
    """``(retries, annotations, worker restrictions, loose)`` of each task of the keys named
    ``prefix...`` on the scheduler."""
    def get(dask_scheduler):
        return {ts.key: (ts.retries, dict(ts.annotations or {}), set(ts.worker_restrictions or ()),
                         ts.loose_restrictions) for ts in dask_scheduler.tasks.values()
                if isinstance(ts.key, tuple) and str(ts.key[0]).startswith(prefix)}

    return client.run_on_scheduler(get)


@pytest.mark.parametrize("layout", ["tiles", "blocks"])
def test_dask_annotate_reaches_the_products_tasks(client, layout):
    """``dask.annotate`` around the call annotates the product's tasks as it does those of
    dask's own ``x @ y`` (and of distmm's without a cluster), with distmm's placement kept;
    the user's ``workers=`` replaces that placement. On a cluster they were dropped: the
    placement was the only annotation of distmm's layers."""
    rng = np.random.default_rng(23)
    a, b = _operands(rng, (40, 30), (30, 20), "float64")
    x = da.from_array(a, chunks=10)
    w0 = dask_placement.worker_slots(client)[0]
    with dask.config.set({"distmm.dask-layout": layout}):
        with dask.annotate(retries=3, priority=7):
            C = distmm.matmul(x, da.from_array(b, chunks=10), client=client)
        layers = [lay for name, lay in C.dask.layers.items() if name.startswith("distmm-")]
        assert layers and all(lay.annotations["retries"] == 3 for lay in layers)
        C = C.persist()
        with dask.annotate(workers=[w0]):
            D = distmm.matmul(x, da.from_array(b, chunks=5), client=client).persist()
        distributed.wait([C, D])
        states = _task_states(client, "distmm-")
    ours = {k: v for k, v in states.items() if k in set(C.dask)}
    assert ours and all(retries == 3 and notes["priority"] == 7 and loose
                        for retries, notes, _, loose in ours.values())
    assert all(pins for _, _, pins, _ in ours.values())  # distmm's placement still
    theirs = {k: v for k, v in states.items() if k in set(D.dask)}
    assert theirs and all(pins == {w0} and not loose for _, _, pins, loose in theirs.values())
    assert set(client.who_has(D).values()) == {(w0,)}
    _check(C.compute(), a @ b)
    _check(D.compute(), a @ b)


def test_a_block_mode_name_is_its_products_own(client):
    """Block mode names the product by its tasks, not by the plan's measured memory budget:
    the same product under budgets that change no task keeps its name."""
    x, y = da.ones((40, 600), chunks=(10, 100)), da.ones((600, 20), chunks=(100, 10))
    names = set()
    for budget in ("512MiB", "1GiB", "2GiB"):
        with dask.config.set({"distmm.dask-layout": "blocks", "distmm.memory-budget": budget}):
            names.add(distmm.matmul(x, y, client=client).name)
    assert len(names) == 1


@pytest.mark.slow
def test_progress_bar_and_performance_report(client, tmp_path, capsys):
    rng = np.random.default_rng(4)
    a, b = _operands(rng, (100, 50), (50, 100), "float64")
    report = tmp_path / "report.html"
    with dask.config.set({"distmm.progress": True, "distmm.performance-report": str(report)}):
        c = distmm.matmul(a, b, client=client, tile=32)
    _check(c, a @ b)
    assert "distmm matmul" in capsys.readouterr().err
    assert report.exists() and report.stat().st_size > 1000


def _kill_one_worker_when(client, condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the product finished before a worker could be killed")
        time.sleep(0.01)
    pids = client.run(os.getpid)
    victim = sorted(pids)[0]
    os.kill(pids[victim], signal.SIGKILL)
    return victim


def _tiles_in_memory(client) -> int:
    def count(dask_scheduler):
        return sum(1 for k, ts in dask_scheduler.tasks.items()
                   if isinstance(k, tuple) and str(k[0]).startswith("distmm-matmul") and ts.state == "memory")

    return client.run_on_scheduler(count)


@pytest.mark.slow
def test_worker_killed_during_numpy_matmul(client):
    rng = np.random.default_rng(13)
    a, b = _operands(rng, (1536, 2000), (2000, 1536), "float64")
    undisturbed = distmm.matmul(a, b, client=client, tile=128)
    out = {}
    run = threading.Thread(target=lambda: out.setdefault("c", distmm.matmul(a, b, client=client, tile=128)))
    run.start()
    try:
        _kill_one_worker_when(client, lambda: _tiles_in_memory(client) >= 4 or not run.is_alive())
    finally:
        run.join()
    assert "c" in out
    assert np.array_equal(out["c"], undisturbed)
    client.wait_for_workers(2, timeout=60)


@pytest.mark.slow
def test_worker_killed_during_dask_matmul(client):
    gen = da.random.default_rng(17)
    A = gen.standard_normal((1536, 2000), chunks=(128, 500))
    B = gen.standard_normal((2000, 1536), chunks=(500, 128))
    undisturbed = distmm.matmul(A, B, client=client).compute()
    C = distmm.matmul(A + 0, B, client=client).persist()  # new keys: nothing reused
    futures = distributed.futures_of(C)
    _kill_one_worker_when(client, lambda: sum(f.status == "finished" for f in futures) >= 4)
    assert np.array_equal(C.compute(), undisturbed)
    client.wait_for_workers(2, timeout=60)


@pytest.mark.slow
def test_demo_starts_a_cluster_and_prints_the_dashboard(capsys, tmp_path):
    from distmm.cli import main

    report = tmp_path / "demo.html"
    assert main(["demo", "-n", "200", "--workers", "2", "--report", str(report), "--progress"]) == 0
    captured = capsys.readouterr()
    assert "embedded LocalCluster" in captured.out and "dashboard http" in captured.out
    assert "OK" in captured.out and "distmm matmul" in captured.err
    assert report.exists()


def test_a_closed_client_is_refused_before_any_work(cluster):
    """A client already closed: a ValueError naming it, for numpy and dask operands and
    gemm (it was an AttributeError from inside distributed)."""
    c = distributed.Client(cluster)
    c.close()
    a = np.ones((3, 3))
    for call in (lambda: distmm.matmul(a, a, engine="dask", client=c),
                 lambda: distmm.matmul(da.from_array(a), da.from_array(a), client=c),
                 lambda: distmm.gemm(a, a, engine="dask", client=c)):
        with pytest.raises(ValueError, match="distributed.Client that is closed"):
            call()


@pytest.mark.slow
def test_a_client_that_is_not_the_default(cluster, tmp_path):
    """``client=`` made with ``set_as_default=False``: the eager loop waits on that client's
    futures (``as_completed`` took the default client's loop: "No clients found") and the
    performance report is of its cluster."""
    rng = np.random.default_rng(17)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    report = tmp_path / "report.html"
    with distributed.Client(cluster, set_as_default=False) as c:
        c.wait_for_workers(2, timeout=120)
        _check(distmm.matmul(a, b, engine="dask", client=c, tile=8), a @ b)
        _check(distmm.gemm(a, b, client=c, tile=8), a @ b)
        with dask.config.set({"distmm.performance-report": str(report)}):
            _check(distmm.matmul(a, b, engine="dask", client=c, tile=8), a @ b)
    assert "distmm-matmul" in report.read_text()


def test_without_a_client():
    """Numpy operands need a cluster; dask operands give a lazy array that
    any scheduler can compute (here dask's threads), unpinned."""
    from distributed.client import _get_global_client

    if _get_global_client() is not None:
        pytest.skip("a default client is alive in this process")
    rng = np.random.default_rng(21)
    a, b = _operands(rng, (50, 70), (70, 40), "float64")
    for call in (distmm.matmul, distmm.gemm):  # the line names no call (gemm's said matmul)
        with pytest.raises(ValueError, match=r"needs a distributed.Client: pass client= or "
                           r"create one \(distributed.Client\(...\)\) first$"):
            call(a, b, engine="dask")
    C = distmm.matmul(da.from_array(a, chunks=25), da.from_array(b, chunks=(35, 20)))
    assert type(C) is da.Array
    _check(C.compute(scheduler="threads"), a @ b)


def test_k_loop_runs_inside_one_task_per_output_block(client):
    """Chunks along k: one task per output block runs the k-loop over them
    (no task per k chunk), on dask.array's output chunks."""
    rng = np.random.default_rng(21)
    a, b = _operands(rng, (384, 1024), (1024, 320), "float64")
    A = da.from_array(a, chunks=(128, 256)).persist()
    B = da.from_array(b, chunks=(256, 160)).persist()
    C = distmm.matmul(A, B, client=client)
    assert C.chunks == (A @ B).chunks == ((128,) * 3, (160, 160))
    layer = C.dask.layers[C.name]
    assert len(layer) == 3 * 2 and not layer.is_materialized()
    deps = layer.get_dependencies((C.name, 1, 1))
    assert deps == {(A.name, 1, kb) for kb in range(4)} | {(B.name, kb, 1) for kb in range(4)}
    got = C.compute()
    assert np.array_equal(got, C.compute())
    _check(got, a @ b)


def test_results_too_big_are_refused_before_planning(client):
    """numpy's ValueError past the largest array and the planner's MemoryError below it, at
    once on a cluster too (the planner listed ~10**10 tiles for minutes)."""
    for x, y, error, words in too_big_results():
        t0 = time.perf_counter()
        with pytest.raises(error, match=words):
            distmm.matmul(x, y, engine="dask", client=client)
        assert time.perf_counter() - t0 < 5


@pytest.mark.slow
def test_a_cluster_without_workers_is_named_by_the_function_called():
    """A scheduler with no worker (waited for distmm.retry-timeout): one ValueError naming
    the function the user called (gemm's said "matmul")."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
    with distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cl, \
            distributed.Client(cl) as empty, dask.config.set({"distmm.retry-timeout": "2s"}):
        with pytest.raises(ValueError, match=r"^gemm: the Dask cluster at \S+ has no workers: "
                                             r"none joined within 2 s \(distmm\.retry-timeout\)"):
            distmm.gemm(a, b, engine="dask", client=empty)


# -- settings made in the client after the cluster started ----------------------------------
# distributed does not send a client's later dask.config changes to running workers (their
# get_config() keeps the defaults): a call's settings travel with its tasks.


def _workers_see(client, key: str) -> set:
    return set(client.run(lambda: dask.config.get(f"distmm.{key}")).values())


def test_direct_writes_set_in_the_client_reach_the_workers_writes(client, tmp_path):
    """``distmm.direct-writes`` set in the client: the workers writing C into a staged
    output write it through the page cache, though their own setting stays ``true``."""
    from conftest import takes_direct
    from distmm.cli.io import staged_output
    from distmm.engine.dask import last_stats

    rng = np.random.default_rng(11)
    a, b = _operands(rng, (512, 64), (64, 2048), "float32")  # C's blocks: 2 MiB of whole rows
    want = distmm.matmul(a, b, client=client, tile=(256, 2048, 64))
    written = {}
    for direct in (True, False):
        with dask.config.set({"distmm.direct-writes": direct}):
            assert _workers_see(client, "direct-writes") == {True}
            path = tmp_path / f"c-{direct}.npy"
            with staged_output(str(path), want.shape, want.dtype) as out:
                distmm.matmul(a, b, client=client, tile=(256, 2048, 64), out=out)
        stats = last_stats()
        assert stats["written_on_workers"]
        written[direct] = stats["written_direct"]
        np.testing.assert_array_equal(np.load(path), want)
    assert written[False] == 0
    assert written[True] > 0 if takes_direct(tmp_path) else written[True] == 0


@pytest.mark.slow
def test_per_call_settings_set_in_the_client_reach_the_tasks(client):
    """``distmm.precision``, ``distmm.tile`` and ``distmm.memory-budget`` set in the client
    (the workers' own stay the defaults) decide the tasks: resolved on the client, they go
    with the plan (a guard: these already travel in the tasks' ``TaskPlan``)."""
    from distmm.engine.dask import last_stats

    rng = np.random.default_rng(12)
    a, b = _operands(rng, (128, 96), (96, 64), "float32")
    with dask.config.set({"distmm.precision": "bf16", "distmm.tile": 32}):
        assert _workers_see(client, "precision") == {"highest"}
        assert _workers_see(client, "tile") == {None}
        got = distmm.matmul(a, b, client=client)
        cells = last_stats()["cells"]
    np.testing.assert_array_equal(got, distmm.matmul(a, b, client=client, tile=32,
                                                     precision="bf16"))
    assert not np.array_equal(got, distmm.matmul(a, b, client=client, tile=32))
    assert cells == (128 // 32) * (64 // 32)
    a, b = _operands(rng, (64, 2048), (2048, 64), "float32")
    distmm.matmul(a, b, client=client, tile=64)
    tasks = last_stats()["tasks"]
    with dask.config.set({"distmm.memory-budget": "64KiB"}):  # k split further to fit
        assert _workers_see(client, "memory-budget") == {"auto"}
        got = distmm.matmul(a, b, client=client, tile=64)
        assert last_stats()["tasks"] > tasks
    _check(got, a @ b)
