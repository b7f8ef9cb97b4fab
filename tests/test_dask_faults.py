"""The Dask engine under repeated worker loss, on a real LocalCluster of
nanny'd worker processes killed with SIGKILL.

Covers: three of four workers killed during one product of numpy operands
(the nannies start new ones) giving a result bitwise equal to an undisturbed
run, several times over; every worker gone, where the engine waits and
finishes, bitwise equal, once a worker joins again; and every worker gone for
good, where the engine, after its retry timeout, raises ``WorkersLost`` (a
``RuntimeError``) that says what was lost.

A scheduler lost while a call sets itself up (gathering the cluster's facts, planning):
``distmm cluster`` in a process group of its own, a client process paused at one step of
the set-up (a ``sitecustomize`` wraps that function to wait for a file), the cluster killed
(SIGKILL), the client let go: ``SchedulerLost`` within the client's timeouts from Python,
and from ``distmm matmul --scheduler-file`` one line, status 1, nothing written.

One worker survives the kills: a nanny whose replacement worker fails to start
under load (seen on CI's two cores: ``Failed to restart worker after its
process exited``) would otherwise leave no worker at all, and the test would
measure the nannies rather than the engine. The empty cluster has its own test,
in which the test itself brings a worker back.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

from distmm.engine import Operands, Request, get_engine  # noqa: E402
from distmm.errors import WorkersLost  # noqa: E402
from distmm.plan import make_plan  # noqa: E402
from conftest import (_product_running, kill_workers, pause_at, serve_cluster,  # noqa: E402
                      start_call, stop_cluster)

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
    ``KeyError('workers')``, warning on every one of ~1000 attempts). Its words name the
    function the engine runs for, here ``gemm`` (they said matmul whatever was called)."""
    from distmm.engine.dask import DaskEngine

    rng = np.random.default_rng(41)
    a = rng.standard_normal((2048, 4096))
    b = rng.standard_normal((4096, 2048))
    _full_cluster(client)
    own = distributed.Client(client.cluster)
    try:
        engine = DaskEngine(own, retry_timeout=60.0, what="gemm")
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
    assert "Client closed during gemm" in str(error) and "matmul" not in str(error)
    assert elapsed < 15, elapsed


# -- a scheduler lost during the set-up ------------------------------------------------------

#: the client process of the Python cases: ``distmm.matmul`` (or CALL: ``gemm``) on the
#: cluster of the scheduler file argv[1], numpy operands or (argv[2] "dask") dask arrays
#: persisted there; prints what the call gave and when it ended, as JSON
_CALL = """
import json, os, sys, time
import numpy as np
import distributed, distmm

client = distributed.Client(scheduler_file=sys.argv[1], timeout={timeout})
a, b = np.arange(12.0).reshape(3, 4), np.ones((4, 2))
if sys.argv[2] == "dask":
    import dask.array as da
    a, b = client.persist([da.from_array(a, chunks=2), da.from_array(b, chunks=2)])
    distributed.wait([a, b])
try:
    c = distmm.{call}(a, b, client=client)
    got = {{"returned": type(c).__name__}}
except Exception as exc:
    got = {{"raised": type(exc).__name__, "message": str(exc)}}
print(json.dumps(dict(got, ended=time.time())), flush=True)
os._exit(0)  # the lost client's own teardown is distributed's, not the call's
"""

#: the client's timeout (distributed's reconnection and connections): the bound of a call
#: whose scheduler is lost
_TIMEOUT = 2
#: where the client's arguments take the cluster's scheduler file (``_lost_during``)
SCHEDULER_FILE = object()


def _lost_during(tmp_path: Path, module: str, name: str, argv, *, env=None, wait=0.0):
    """Serve ``distmm cluster`` (one worker), start ``argv`` (``SCHEDULER_FILE`` in it:
    the cluster's) with ``module.name`` paused, SIGKILL the cluster's whole group once the
    client waits there, ``wait`` seconds later let the client go on; ``(the client's exit
    status, stdout, stderr, kill time)``."""
    (tmp_path / "cluster").mkdir()
    sched = tmp_path / "cluster" / "sched.json"
    site = tmp_path / "site"
    site.mkdir()
    pause_at(site, module, name)
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    cluster = serve_cluster(sched, "--workers", 1, "--threads", 1, "--gpus", 0)
    argv = [str(sched) if x is SCHEDULER_FILE else str(x) for x in argv]
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (site / "paused").exists():
            assert client.poll() is None, client.communicate()
            assert time.monotonic() < deadline, f"the client never reached {module}.{name}"
            time.sleep(0.01)
        os.killpg(cluster.pid, signal.SIGKILL)
        cluster.communicate()
        killed = time.time()
        time.sleep(wait)
        (site / "go").touch()
        out, err = client.communicate(timeout=60)  # a hang fails here
    finally:
        if client.poll() is None:
            client.kill()
        if cluster.poll() is None:
            stop_cluster(cluster, None)
    return client.returncode, out, err, killed


def _call(tmp_path: Path, module: str, name: str, family: str, env=None, *,
          call: str = "matmul", wait: float = 0.0) -> dict:
    """What ``distmm.matmul`` (or ``call``) gave (``_CALL``) in a client whose scheduler was
    lost while it waited at ``module.name`` (``wait`` seconds more), and how long after the
    kill it ended (``after``)."""
    script = tmp_path / "call.py"
    script.write_text(_CALL.format(timeout=_TIMEOUT, call=call))
    status, out, err, killed = _lost_during(tmp_path, module, name,
                                            [sys.executable, script, SCHEDULER_FILE, family],
                                            env=env, wait=wait)
    assert status == 0 and out, err
    got = json.loads(out.splitlines()[-1])
    got["after"] = got.pop("ended") - killed
    return got


def _assert_lost(got: dict) -> None:
    assert got.get("raised") == "SchedulerLost", got
    assert "was lost" in got["message"] and "while matmul set up its run" in got["message"], got
    assert "\n" not in got["message"] and "KeyError" not in got["message"], got
    assert got["after"] < 10 * _TIMEOUT, got  # the client's timeouts bound it, not a hang


@pytest.mark.slow  # ~2-3.5 s: the fast run keeps under 5 minutes on 2 cores
def test_a_scheduler_lost_before_the_worker_table_is_scheduler_lost(tmp_path):
    """Killed while the engine is about to ask for the worker table (``cluster_state``):
    ``SchedulerLost`` naming the scheduler, within the client's timeout (it was the raw
    ``OSError: Timed out trying to connect``, ``CommClosedError: ConnectionPool closing`` or
    ``AttributeError: 'NoneType' object has no attribute 'identity'``, by the timing)."""
    got = _call(tmp_path, "distmm.engine.dask.placement", "cluster_state", "numpy")
    _assert_lost(got)
    assert "tcp://127.0.0.1:" in got["message"], got


@pytest.mark.slow
@pytest.mark.parametrize("module, name, family, layout", [
    ("distmm.engine.dask.placement", "cluster_state", "dask", "auto"),
    # the workers' probe takes a failed request for a worker leaving and goes on: numpy
    # operands then failed in the scatter (SchedulerLost, "output block(s) never arrived"),
    # dask operands returned a lazy result over chunks gone with the scheduler
    ("distmm.engine.dask.workers", "_ask", "numpy", "auto"),
    ("distmm.engine.dask.workers", "_ask", "dask", "auto"),
    # the last fact of block mode, and the plans after the facts: a lazy result before
    ("distmm.engine.dask.nccl_route", "pairs", "dask", "blocks"),
    ("distmm.engine.dask", "slots_by_locality", "dask", "tiles"),
    ("distmm.engine.dask", "plan_blocks", "dask", "blocks"),
])
def test_a_scheduler_lost_during_the_set_up_is_scheduler_lost(tmp_path, module, name, family,
                                                              layout):
    got = _call(tmp_path, module, name, family, env={"DASK_DISTMM__DASK_LAYOUT": layout})
    _assert_lost(got)


@pytest.mark.slow
@pytest.mark.parametrize("module, name, wait, words", [
    ("distmm.engine.dask.placement", "cluster_state", 0.0, "while gemm set up its run"),
    pytest.param("distmm.engine.dask", "_resolve_client", 2 * _TIMEOUT + 1.0,
                 "lost its scheduler before gemm began", marks=pytest.mark.slow),
])
def test_a_scheduler_lost_while_gemm_sets_up_names_gemm(tmp_path, module, name, wait, words):
    """``distmm.gemm`` on the Dask engine, its scheduler lost in the set-up: the
    ``SchedulerLost`` names gemm (it said "while matmul set up its run")."""
    got = _call(tmp_path, module, name, "numpy", call="gemm", wait=wait)
    assert got.get("raised") == "SchedulerLost", got
    assert words in got["message"] and "matmul" not in got["message"], got


@pytest.mark.slow
@pytest.mark.parametrize("module, name, wait", [
    ("distmm.engine.dask.placement", "cluster_state", 0.0),
    ("distmm.engine.dask.workers", "_ask", 0.0),
    # the client closed by distributed (its reconnection given up) before the engine starts:
    # it was "got a distributed.Client that is closed: pass an open client", status 2
    ("distmm.engine.dask", "_resolve_client", 2 * _TIMEOUT + 1.0),
])
def test_a_scheduler_lost_during_the_set_up_fails_the_command_in_one_line(tmp_path, module,
                                                                          name, wait):
    np.save(tmp_path / "a.npy", np.ones((30, 20)))
    np.save(tmp_path / "b.npy", np.ones((20, 10)))
    argv = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.npy",
            "--no-progress", "--connect-timeout", _TIMEOUT, "--scheduler-file", SCHEDULER_FILE]
    status, out, err, killed = _lost_during(tmp_path, module, name, argv, wait=wait)
    assert status == 1, err
    lines = [line for line in err.splitlines() if line.startswith("distmm matmul: error:")]
    assert len(lines) == 1 and lines[0].startswith("distmm matmul: error: SchedulerLost: "), err
    assert "was lost" in lines[0] or "lost its scheduler" in lines[0], err
    assert "KeyError" not in lines[0], err  # a closed client's empty worker table: it said so
    # only that line: distributed's client logged its failed reconnect, and with the floor's
    # distributed its close's traceback, before it
    assert err.splitlines() == lines and out == "", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "cluster", "site"]
    assert time.time() - killed < 10 * _TIMEOUT + wait
