"""The Dask engine under repeated worker loss, on a real LocalCluster of
nanny'd worker processes killed with SIGKILL.

Covers: three of four workers killed during one product of numpy operands
(the nannies start new ones) giving a result bitwise equal to an undisturbed
run, several times over; every worker gone, where the engine waits and
finishes, bitwise equal, once a worker joins again; and every worker gone for
good, where the engine, after its retry timeout, raises ``WorkersLost`` (a
``RuntimeError``) that says what was lost.

One worker survives the kills: a nanny whose replacement worker fails to start
under load (seen on CI's two cores: ``Failed to restart worker after its
process exited``) would otherwise leave no worker at all, and the test would
measure the nannies rather than the engine. The empty cluster has its own test,
in which the test itself brings a worker back.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

from distmm.engine import Operands, Request, get_engine  # noqa: E402
from distmm.errors import WorkersLost  # noqa: E402
from distmm.plan import make_plan  # noqa: E402
from conftest import _product_running, kill_workers, start_call  # noqa: E402

pytestmark = pytest.mark.usefixtures("tile_mode")


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB") as cl, \
            distributed.Client(cl) as c:
        c.wait_for_workers(4, timeout=60)
        yield c


def _full_cluster(client, n: int = 4) -> None:
    """Wait for ``n`` workers; where a nanny failed to start its replacement,
    start the cluster's workers again (what a batch system's restart would do)."""
    try:
        client.wait_for_workers(n, timeout=20)
        return
    except TimeoutError:
        pass
    client.cluster.scale(0)
    _wait_for_no_worker(client)
    client.cluster.scale(n)
    client.wait_for_workers(n, timeout=60)


def _wait_for_no_worker(client, timeout: float = 30.0) -> None:
    """Until the scheduler lists no worker (or ``timeout`` seconds pass)."""
    deadline = time.monotonic() + timeout
    while client.scheduler_info(n_workers=-1)["workers"] and time.monotonic() < deadline:
        time.sleep(0.05)


def _start_product(engine, request):
    """``engine.run(request)`` on a thread (``start_call``)."""
    return start_call(engine.run, request)


def _request(engine, a, b, tile):
    m, k = a.shape
    n = b.shape[1]
    ops = Operands(a, b, "numpy", np.dtype("float64"), False, False, (), m, n, k)
    plan = make_plan(m, n, k, "float64", workers=engine.workers(ops, on_gpu=False), tile=tile)
    return Request(ops, plan, "blas")


@pytest.mark.slow
def test_three_workers_killed_in_one_run_give_the_same_bits(client):
    rng = np.random.default_rng(31)
    a = rng.standard_normal((2048, 4096))  # 2 to 3.5 s on 4 workers here once its tasks run,
    b = rng.standard_normal((4096, 2048))  # perhaps 4 times less on a CI machine's BLAS
    engine = get_engine("dask", client=client, retry_timeout=60.0)
    undisturbed = engine.run(_request(engine, a, b, 128))
    np.testing.assert_allclose(undisturbed, a @ b, rtol=1e-10, atol=1e-10)
    for attempt in range(3):
        _full_cluster(client)
        time.sleep(1.0)  # let the nannies finish starting their new workers
        engine = get_engine("dask", client=client, retry_timeout=60.0)
        request = _request(engine, a, b, 128)
        run, out = _start_product(engine, request)
        try:
            killed = kill_workers(client, run, kills=3, gap=0.05)  # the third 0.1 s after
            # the first, well inside the product
        finally:
            run.join(180)
        assert not run.is_alive()
        assert killed == 3, f"run {attempt}: the product ended after {killed} kill(s)"
        assert "c" in out, f"run {attempt} raised instead of retrying: {out.get('error')!r}"
        assert np.array_equal(out["c"], undisturbed), f"run {attempt}: bits differ"


@pytest.mark.slow
def test_with_no_worker_alive_the_run_waits_for_one_and_gives_the_same_bits():
    rng = np.random.default_rng(37)
    a = rng.standard_normal((700, 900))
    b = rng.standard_normal((900, 500))
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cl, distributed.Client(cl) as c:
        c.wait_for_workers(1, timeout=60)
        engine = get_engine("dask", client=c, retry_timeout=60.0)
        undisturbed = engine.run(_request(engine, a, b, 128))
        np.testing.assert_allclose(undisturbed, a @ b, rtol=1e-10, atol=1e-10)
        request = _request(engine, a, b, 128)
        cl.scale(0)
        _wait_for_no_worker(c)
        assert not c.scheduler_info(n_workers=-1)["workers"]
        run, out = _start_product(engine, request)
        time.sleep(2.0)
        assert run.is_alive(), f"the run ended with no worker alive: {out!r}"
        cl.scale(1)
        run.join(120)
        assert not run.is_alive()
    assert "c" in out, f"the run raised instead of waiting: {out.get('error')!r}"
    assert np.array_equal(out["c"], undisturbed)


@pytest.mark.slow
def test_no_worker_left_raises_workers_lost_after_the_timeout():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cl, distributed.Client(cl) as c:
        c.wait_for_workers(1, timeout=60)
        engine = get_engine("dask", client=c, retry_timeout=2.0)
        a = np.ones((512, 512))
        request = _request(engine, a, a, 64)
        cl.scale(0)  # every worker goes, and none is started again
        _wait_for_no_worker(c)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            engine.run(request)
        elapsed = time.monotonic() - t0
    assert isinstance(info.value, WorkersLost)
    message = str(info.value)
    assert "gave up after 2 s" in message and "64 output block(s) never arrived" in message
    assert "workers alive now: 0" in message
    assert 1.9 < elapsed < 15, elapsed



@pytest.mark.slow
def test_retry_timeout_comes_from_the_configuration():
    """``distmm.retry-timeout`` reaches the Dask engine that ``distmm.matmul`` builds,
    and that engine gives up after it."""
    import dask.config

    from distmm import api

    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cl, distributed.Client(cl) as c:
        c.wait_for_workers(1, timeout=60)
        a = np.ones((256, 256))
        with dask.config.set({"distmm.retry-timeout": "1.5s"}):
            engine, request = api._request(api._validate(a, a), engine="dask", client=c,
                                           tile=64, backend="auto")
        assert engine.retry_timeout == 1.5
        cl.scale(0)
        _wait_for_no_worker(c)
        t0 = time.monotonic()
        with pytest.raises(WorkersLost, match="gave up after"):
            engine.run(request)
        elapsed = time.monotonic() - t0
    assert 1.4 < elapsed < 15, elapsed


@pytest.mark.slow
def test_workers_killed_while_reading_file_operands_give_the_same_bits(client, tmp_path):
    """Operands in ``.npy`` files the workers read themselves (engine/dask/files): blocks
    being read, or held, on killed workers are read again elsewhere; same bits as the
    undisturbed product of the same arrays in memory."""
    from distmm.engine.dask import last_stats

    rng = np.random.default_rng(37)
    a = rng.standard_normal((2048, 4096))
    b = rng.standard_normal((4096, 2048))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    am, bm = (np.load(tmp_path / f"{x}.npy", mmap_mode="r") for x in "ab")
    _full_cluster(client)
    engine = get_engine("dask", client=client, retry_timeout=60.0)
    undisturbed = engine.run(_request(engine, a, b, 128))
    time.sleep(1.0)
    engine = get_engine("dask", client=client, retry_timeout=60.0)
    run, out = _start_product(engine, _request(engine, am, bm, 128))
    try:
        killed = kill_workers(client, run, kills=2, gap=0.1)
    finally:
        run.join(180)
    assert not run.is_alive()
    assert "c" in out, f"raised instead of retrying: {out.get('error')!r}"
    assert killed >= 1, "the product ended before a worker was killed"
    assert last_stats()["read_on_workers"] == [True, True]
    assert np.array_equal(out["c"], undisturbed)


@pytest.mark.slow
def test_tasks_placed_on_a_worker_that_left_are_cancelled_for_a_retry():
    """The eager loop's stall watch (``eager._StallWatch``): a task held for a worker
    that has left the cluster (a strict restriction here: what distributed 2024.12
    leaves of a loose one that went "no-worker" while every worker was paused) is
    cancelled once nothing has arrived for ``quiet`` seconds, so that the loop runs
    its block again; a task placed on a live worker is left to finish."""
    from distmm.engine.dask.eager import _StallWatch

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cl, distributed.Client(cl) as c:
        c.wait_for_workers(2, timeout=60)
        before = set(c.scheduler_info(n_workers=-1)["workers"])
        cl.scale(1)  # one worker leaves for good
        deadline = time.monotonic() + 30
        while len(c.scheduler_info(n_workers=-1)["workers"]) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = set(c.scheduler_info(n_workers=-1)["workers"])
        (gone,) = before - alive
        (live,) = alive
        stuck = c.submit(sum, [1, 2], workers=[gone], allow_other_workers=False, pure=False)
        fine = c.submit(time.sleep, 1.0, workers=[live], pure=False)
        t0 = time.monotonic()
        with _StallWatch(c, [fine], {live}, every=0.2, quiet=0.5) as ok, \
                _StallWatch(c, [stuck], {gone}, every=0.2, quiet=0.5) as watch:
            while stuck.status == "pending" and time.monotonic() - t0 < 20:
                time.sleep(0.05)
        assert stuck.status == "cancelled" and watch.gone == {gone}
        assert time.monotonic() - t0 < 10
        assert fine.result(timeout=30) is None and ok.gone == set()


@pytest.mark.slow
def test_a_client_closed_during_the_product_fails_the_call_at_once(client):
    """A client closed by its owner (another thread's ``with Client()`` ending) during an
    eager product: no worker comes back through it, so the call raises at once, saying so,
    instead of retrying for ``retry_timeout`` (it did, then raised ``WorkersLost`` with
    ``KeyError('workers')``, warning on every one of ~1000 attempts)."""
    rng = np.random.default_rng(41)
    a = rng.standard_normal((2048, 4096))
    b = rng.standard_normal((4096, 2048))
    _full_cluster(client)
    own = distributed.Client(client.cluster)
    try:
        engine = get_engine("dask", client=own, retry_timeout=60.0)
        run, out = _start_product(engine, _request(engine, a, b, 128))
        deadline = time.monotonic() + 60
        while not _product_running(own) and run.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.is_alive(), f"the product ended before the client closed: {out!r}"
        t0 = time.monotonic()
        own.close()
        run.join(60)
        elapsed = time.monotonic() - t0
    finally:
        own.close()
    assert not run.is_alive()
    error = out.get("error")
    assert isinstance(error, RuntimeError) and not isinstance(error, WorkersLost), repr(error)
    assert "Client closed during matmul" in str(error)
    assert elapsed < 15, elapsed

