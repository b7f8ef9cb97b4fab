"""A Ctrl-C during an eager Dask-engine call, and whose blocks ``read_on_workers`` counts.

Covers, on a real ``LocalCluster`` of worker processes started by a child process that
sends itself SIGINT: the call raises ``KeyboardInterrupt`` at once, wherever it was (sending
the blocks of numpy operands, gathering C of numpy or ``.npy`` memmap operands into an
``out=``), and leaves the cluster as dask.array's own interrupted compute does: no task or
block of the call on the scheduler or in a worker's memory, nothing running, the client
holding no future (also while the interrupted call's traceback is kept, as an interactive
session keeps the last one); the next call on the same client is right. And
``stats["read_on_workers"]``: True for an operand only where the workers read each of its
blocks from the file, not where the client read some and sent them (a worker that joined
after the check, the workers that were asked gone).

Also, with the call held where a child's ``sitecustomize`` (``conftest.pause_at``) says: a
Ctrl-C between the send of the product's graph (or of an operand's blocks) and the engine's
taking of their futures, and while the workers compute (numpy ``out=``: each tile as it was
or finished); and ``distmm matmul ... --scheduler ADDRESS`` stopped by SIGINT or SIGTERM
while the workers compute: one line, 130 or 143, the target not created or the old one
unchanged, the cluster left clean.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import distmm  # noqa: E402
from distmm.engine.dask import eager, last_stats  # noqa: E402

#: the child scripts' cluster (``two_workers``: two single-thread worker processes, the
#: client once both are up, and what they held then) and its view of what the cluster holds
#: (``held``: scheduler tasks, keys with a holder, worker data, tasks executing), and that
#: once a task still running ended (``settled``)
_CLUSTER_STATE = r'''
import contextlib


@contextlib.contextmanager
def two_workers():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB") as cluster, \
            distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        yield client, settled(client)


def held(client):
    keys = client.run_on_scheduler(lambda dask_scheduler: sorted(map(str, dask_scheduler.tasks)))
    return {"scheduler": keys, "who_has": sorted(map(str, client.who_has())),
            "data": sum(client.run(lambda dask_worker: len(dask_worker.data)).values()),
            "running": sum(client.run(lambda dask_worker: len(dask_worker.state.executing))
                           .values())}


def settled(client):
    deadline = time.monotonic() + 20  # a task still running on a worker ends on its own
    while True:
        got = held(client)
        if not any(got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)
'''

_SCRIPT = r'''
import asyncio, json, os, signal, sys, time
import numpy as np
import distributed
import distmm
''' + _CLUSTER_STATE + r'''
sent = []

def main(case, folder):

    def interrupt(*_):
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    signal.signal(signal.SIGALRM, interrupt)

    if case == "scatter":
        # SIGINT while the scheduler (in this process) sends the blocks to the workers:
        # distributed's sync cancels the client's side of the scatter, the scheduler's goes on
        scatter = distributed.Scheduler.scatter

        async def slow(self, *args, **kw):
            await asyncio.sleep(0.6)
            return await scatter(self, *args, **kw)

        distributed.Scheduler.scatter = slow
    else:  # SIGINT while C is gathered: at the first block taken
        result = distributed.Future.result

        def taking(self, *args, **kw):
            if not sent:
                interrupt()
            return result(self, *args, **kw)

        distributed.Future.result = taking

    rng = np.random.default_rng()
    m, k, n = 301, 283, 257
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    if case == "memmap":
        np.save(os.path.join(folder, "a.npy"), a)
        np.save(os.path.join(folder, "b.npy"), b)
        A = np.load(os.path.join(folder, "a.npy"), mmap_mode="r")
        B = np.load(os.path.join(folder, "b.npy"), mmap_mode="r")
        out = np.lib.format.open_memmap(os.path.join(folder, "c.npy"), mode="w+", shape=(m, n))
    else:
        A, B, out = a, b, np.zeros((m, n))
    report = {}
    with two_workers() as (client, report["before"]):
        kept = None
        for attempt in range(3):  # a KeyboardInterrupt raised in a gc callback is ignored
            del sent[:]
            if case == "scatter":
                signal.setitimer(signal.ITIMER_REAL, 0.2)
            try:
                distmm.matmul(A, B, engine="dask", client=client, out=out, tile=64)
            except KeyboardInterrupt as exc:
                kept = exc  # as an interactive session keeps the last traceback
                report["late"] = time.monotonic() - sent[0]
                break
            settled(client)
        report["interrupted"] = kept is not None
        time.sleep(1.0)  # the scheduler's scatter, slowed to 0.6 s, has ended
        report["after"] = settled(client)
        if case != "scatter":
            distributed.Future.result = result
        got = distmm.matmul(a, b, engine="dask", client=client, tile=64)
        ref = a @ b
        report["again"] = float(np.abs(got - ref).max() / np.abs(ref).max())
        report["finally"] = settled(client)
    print("REPORT", json.dumps(report))


if __name__ == "__main__":  # the worker processes import this file too
    main(sys.argv[1], sys.argv[2])
'''


def _interrupted(tmp_path, case: str) -> dict:
    script = tmp_path / "interrupt.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, sys.path)))
    proc = subprocess.run([sys.executable, str(script), case, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


_EMPTY = {"scheduler": [], "who_has": [], "data": 0, "running": 0}


@pytest.mark.slow  # a cluster of worker processes in a child process: about 10 s
@pytest.mark.parametrize("case", ["scatter", "gather", "memmap"])
def test_ctrl_c_leaves_the_cluster_as_it_found_it(tmp_path, case):
    """``scatter``: SIGINT while the scheduler sends the blocks of numpy operands to the
    workers. distributed's blocking ``Client.scatter`` then cancels the client's side only:
    the scheduler went on and registered the blocks as the client's, for which the client
    made no future to release, so they stayed on the workers for the client's lifetime.
    ``gather``, ``memmap``: SIGINT while C is gathered into ``out=`` (numpy operands, and
    ``.npy`` memmaps the workers read, with a memmap ``out``)."""
    report = _interrupted(tmp_path, case)
    assert report["before"] == _EMPTY, report
    assert report["interrupted"], report
    assert report["late"] < 0.5, report  # scatter: well before the scheduler's 0.6 s ended
    assert report["after"] == _EMPTY, report
    assert report["again"] < 1e-12, report
    assert report["finally"] == _EMPTY, report


def _npy(tmp_path, name, x):
    np.save(tmp_path / name, x)
    return np.load(tmp_path / name, mmap_mode="r")


def test_read_on_workers_is_false_where_the_client_read_the_blocks(tmp_path, monkeypatch):
    """Both ``.npy`` operands seen by the worker that was asked, which then leaves for a
    worker that joined after the check: the client reads every block and sends it (the
    new worker reads none of the file). ``read_on_workers`` said ``[True, True]``."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((97, 61)), rng.standard_normal((61, 83))
    am, bm = _npy(tmp_path, "a.npy", a), _npy(tmp_path, "b.npy", b)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        client.wait_for_workers(1, timeout=60)
        got = distmm.matmul(am, bm, client=client, tile=32)
        assert last_stats()["read_on_workers"] == [True, True]
        np.testing.assert_allclose(got, a @ b, rtol=1e-12)

        check = eager._file_sources

        def then_replaced(*args, **kw):
            found = check(*args, **kw)
            asked = set(client.scheduler_info(n_workers=-1)["workers"])
            cluster.scale(2)
            client.wait_for_workers(2, timeout=60)
            client.retire_workers(sorted(asked))
            assert not asked & set(client.scheduler_info(n_workers=-1)["workers"])
            return found

        monkeypatch.setattr(eager, "_file_sources", then_replaced)
        client.get_task_stream()
        got = distmm.matmul(am, bm, client=client, tile=32)
        stats = last_stats()
        reads = [t for t in client.get_task_stream() if stats["token"] in str(t["key"])
                 and str(t["key"]).startswith(("('distmm-a-", "('distmm-b-"))]
        assert not reads, reads  # no block of either file read on a worker
        assert stats["read_on_workers"] == [False, False]
        np.testing.assert_allclose(got, a @ b, rtol=1e-12)


# -- a Ctrl-C where the child's sitecustomize holds the call (conftest's pause_at) -----------

_PAUSED_SCRIPT = r'''
import json, os, signal, sys, threading, time
import numpy as np
import distributed
import distmm

''' + _CLUSTER_STATE + r'''

def main(case, pause, tile):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sent = []

    def interrupt_once_paused():  # the SIGINT once the call (or a worker's task) waits
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(pause, "paused")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    rng = np.random.default_rng()
    m, k, n = 301, 283, 257
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    out = np.full((m, n), 7.0) if case.endswith("-out") else None
    report = {}
    with two_workers() as (client, report["before"]):
        threading.Thread(target=interrupt_once_paused, daemon=True).start()
        kept = None
        try:
            distmm.matmul(a, b, engine="dask", client=client, out=out, tile=tile)
        except KeyboardInterrupt as exc:
            kept = exc  # as an interactive session keeps the last traceback
            report["late"] = time.monotonic() - sent[0]
        finally:
            open(os.path.join(pause, "go"), "w").close()  # what waited goes on
        report["interrupted"] = kept is not None
        report["after"] = settled(client)
        want = a @ b
        if out is not None:  # each tile of out= as it was or finished, none in between
            tiles = []
            for i in range(0, m, tile):
                for j in range(0, n, tile):
                    o, w = out[i:i + tile, j:j + tile], want[i:i + tile, j:j + tile]
                    tiles.append("kept" if (o == 7).all() else
                                 "done" if np.allclose(o, w, rtol=1e-12, atol=0) else "torn")
            report["tiles"] = {x: tiles.count(x) for x in sorted(set(tiles))}
        got = distmm.matmul(a, b, engine="dask", client=client, tile=tile)
        report["again"] = float(np.abs(got - want).max() / np.abs(want).max())
        report["finally"] = settled(client)
    print("REPORT", json.dumps(report))


if __name__ == "__main__":  # the worker processes import this file too
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
'''

#: where each case holds the call (``pause_at``'s module, name and keywords)
_PAUSES = {
    # after the product's graph was sent, before its futures were the engine's
    "submitted": ("distmm.engine.dask.eager", "_submit", {"after": True}),
    # after A's blocks reached the workers, before the engine kept their futures
    "sent": ("distmm.engine.dask.eager", "_uninterrupted", {"after": True}),
    # while the product runs: each worker's third tile task waits, tiles have arrived
    "computing": ("distmm.engine.dask.tasks", "partial_block", {"call": 3}),
    "computing-out": ("distmm.engine.dask.tasks", "partial_block", {"call": 3}),
}


def _paused_run(tmp_path, case: str, tile: int = 64) -> dict:
    from conftest import pause_at

    pause = tmp_path / "pause"
    pause.mkdir()
    module, name, kw = _PAUSES[case]
    pause_at(pause, module, name, **kw)  # this child's and its workers' sitecustomize
    script = tmp_path / "paused.py"
    script.write_text(_PAUSED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pause), *filter(None, sys.path)]))
    proc = subprocess.run([sys.executable, str(script), case, str(pause), str(tile)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.slow  # a cluster of worker processes in a child process: 2 to 6 s
@pytest.mark.parametrize("case", list(_PAUSES))
def test_ctrl_c_after_the_graph_is_sent(tmp_path, case):
    """SIGINT to ``distmm.matmul(a, b, client=...)`` (numpy operands; ``-out``: into a numpy
    ``out=``) once its work is on the cluster, the caller keeping the ``KeyboardInterrupt``
    (as an interactive session keeps the last traceback): it is raised at once, the
    cluster then holds no task or block of the call, ``out=``'s tiles are each as they
    were or finished, and the next call on the client is right.

    ``submitted``, ``sent``: the signal between the graph's (the blocks') send and the
    engine's taking of their futures: those futures were held only by the traceback's
    frames, and the cluster computed the whole product and held it, or A's blocks, in the
    workers' memory for as long as the traceback was kept. ``computing``: guards."""
    report = _paused_run(tmp_path, case)
    assert report["before"] == _EMPTY, report
    assert report["interrupted"], report
    assert report["late"] < 0.5, report
    assert report["after"] == _EMPTY, report
    if case.endswith("-out"):
        assert set(report["tiles"]) <= {"kept", "done"}, report  # none torn
        assert report["tiles"].get("kept"), report  # stopped mid-product indeed
    assert report["again"] < 1e-12, report
    assert report["finally"] == _EMPTY, report


# -- the command line on a cluster of its own: --scheduler ADDRESS ----------------------------


def _cluster_state(client) -> dict:
    keys = client.run_on_scheduler(lambda dask_scheduler: sorted(map(str, dask_scheduler.tasks)))
    return {"scheduler": keys, "who_has": sorted(map(str, client.who_has())),
            "data": sum(client.run(lambda dask_worker: len(dask_worker.data)).values()),
            "running": sum(client.run(lambda dask_worker: len(dask_worker.state.executing))
                           .values())}


def _settled(client, seconds: float = 20) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        got = _cluster_state(client)
        if not any(got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.mark.slow  # a cluster of worker processes and a command: 2 to 6 s
@pytest.mark.parametrize("signum, target, old", [
    (signal.SIGINT, "c.npy", True),
    (signal.SIGTERM, "c.npy", False),
    (signal.SIGINT, "c.zarr", False),
    (signal.SIGTERM, "c.h5:C", True),
], ids=["int-npy-overwrite", "term-npy", "int-zarr", "term-h5-overwrite"])
def test_the_command_stopped_mid_product(tmp_path, monkeypatch, signum, target, old):
    """``distmm matmul a.npy b.npy -o TARGET --scheduler ADDRESS`` gets SIGINT or SIGTERM
    while the workers compute C (the workers read the operands and write C into the staged
    output; each worker's third tile task waits): one line on stderr, no traceback, status
    130 or 143 (``distmm.cli.exits``), at once; the target not created, or (``--overwrite``)
    the old one unchanged; nothing staged beside it, also once the waiting tasks have ended;
    the cluster holds no task or block of the run, and a product on it is right."""
    from conftest import pause_at

    pause = tmp_path / "pause"
    pause.mkdir()
    pause_at(pause, "distmm.engine.dask.tasks", "partial_block", call=3)
    # the workers start with the pause as their sitecustomize
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pause), *filter(None, sys.path)]))
    work = tmp_path / "work"
    work.mkdir()
    rng = np.random.default_rng()
    a, b = rng.standard_normal((301, 283)), rng.standard_normal((283, 257))
    np.save(work / "a.npy", a)
    np.save(work / "b.npy", b)
    path = work / target.split(":")[0]
    extra = []
    if old:
        extra = ["--overwrite"]
        if path.suffix == ".npy":
            np.save(path, np.ones((3, 3)))
        else:
            import h5py

            with h5py.File(path, "w") as f:
                f["C"] = np.ones((3, 3))
                f["other"] = np.arange(4.0)
    before = {p.name: p.read_bytes() if p.is_file() else "a folder" for p in work.iterdir()}
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB") as cluster, \
            distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy",
                                 "-o", target, "--scheduler", cluster.scheduler_address,
                                 "--tile", "64", *extra], cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not (pause / "paused").exists():
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline
                time.sleep(0.01)
            sent = time.monotonic()
            proc.send_signal(signum)
            out, err = proc.communicate(timeout=60)
            took = time.monotonic() - sent
        finally:
            (pause / "go").touch()  # the waiting tasks go on
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        said = "interrupted (SIGINT)" if signum == signal.SIGINT else "terminated by SIGTERM"
        assert proc.returncode == 128 + signum, err
        assert err.splitlines() == [f"distmm matmul: error: {said}"] and out == "", err
        assert took < 10, took
        assert _settled(client) == _EMPTY
        got, want = distmm.matmul(a, b, client=client, tile=64), a @ b
        assert np.abs(got - want).max() < 1e-12 * np.abs(want).max()
        assert _settled(client) == _EMPTY
    after = {p.name: p.read_bytes() if p.is_file() else "a folder" for p in work.iterdir()}
    assert after == before  # nothing staged beside the target, the old one unchanged
