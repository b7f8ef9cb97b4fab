"""``distmm cluster``: a real scheduler and real worker processes served by the command,
products through it from other processes, and its stop by real signals (SIGTERM with
``kill``, SIGINT to the whole process group as a terminal's Ctrl-C sends it): the exit
status, the one line, the scheduler file removed, no worker process left (psutil)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import (_product_running, assert_all_gone, left_in_session, pause_at, run_cli,
                      serve_cluster, stop_cluster)


@pytest.mark.slow
def test_products_through_the_cluster_then_sigterm(tmp_path: Path):
    sched = tmp_path / "sched.json"
    rng = np.random.default_rng()
    a, b = rng.standard_normal((83, 61)), rng.standard_normal((61, 47))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    proc = serve_cluster(sched, "--workers", 2, "--threads", 1)
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
        address = json.loads(sched.read_text())["address"]
        from distributed import Client

        with Client(scheduler_file=str(sched), timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            # the task modules were imported as the cluster started (distmm.engine.dask.
            # preload), not left to the first product on the scheduler and each worker
            loaded = lambda: "distmm.engine.dask.tasks" in sys.modules  # noqa: E731
            assert client.run_on_scheduler(loaded)
            assert list(client.run(loaded).values()) == [True, True]
        # from another process: the command line
        r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                    "--scheduler-file", sched)
        assert r.returncode == 0, r.stderr
        # and Python: a Client of the scheduler file
        import distmm

        with Client(scheduler_file=str(sched), timeout=30) as client:
            assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2
            got = distmm.matmul(a, b, client=client, engine="dask", tile=32)
            worker_address = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
        # a worker's address is not the scheduler's: said at once, not waited for
        r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "w.npy",
                    "--scheduler", worker_address, "--connect-timeout", 10)
        assert r.returncode == 1 and "is a Dask Worker, not a Dask scheduler" in r.stderr, r.stderr
        assert not (tmp_path / "w.npy").exists()
    except BaseException:
        stop_cluster(proc, None)
        raise
    status, out, err, seconds = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    want = a @ b
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), want, rtol=1e-11,
                               atol=1e-11 * np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11 * np.abs(want).max())
    assert status == 143, err
    assert address in out and "2 CPU workers, 1 thread" in out and "dashboard" in out
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("distmm cluster: stopped by SIGTERM: 2 workers and the scheduler "
                          f"closed, {sched} removed"), err
    assert not sched.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.npy"]
    assert len(workers) >= 2
    assert_all_gone(workers)
    assert seconds < 30


@pytest.mark.slow
def test_ctrl_c_closes_the_cluster_and_keeps_a_file_it_did_not_write(tmp_path: Path):
    sched = tmp_path / "sched.json"
    sched.write_text("stale")
    proc = serve_cluster(sched, "--workers", 1, "--overwrite")
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
        info = json.loads(sched.read_text())
        assert info["type"] == "Scheduler" and len(info["workers"]) == 1
        assert len(workers) >= 1
        # another program takes the file over: the stop must not remove it
        sched.write_text('{"address": "tcp://127.0.0.1:1"}')
    except BaseException:
        stop_cluster(proc, None)
        raise
    # a terminal's Ctrl-C reaches the whole foreground process group, workers included
    status, out, err, seconds = stop_cluster(proc, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert status == 130, err
    assert info["address"] in out and "1 CPU worker" in out
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("distmm cluster: stopped by SIGINT: 1 worker and the scheduler closed, "
                          f"{sched} left as it is"), err
    assert sched.read_text() == '{"address": "tcp://127.0.0.1:1"}'
    assert [p.name for p in tmp_path.iterdir()] == ["sched.json"]  # no staged file left
    assert_all_gone(workers)
    assert seconds < 30


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("args, says", [
    (["--workers", "0"], "argument --workers: '0' must be at least 1"),
    (["--threads", "x"], "argument --threads: 'x' is not an integer"),
    (["--memory-limit", "lots"], "argument --memory-limit: 'lots' is not a memory limit"),
    (["--memory-limit=-1GiB"], "argument --memory-limit: '-1GiB' is not a memory limit"),
    (["--gpus", "1,1"], "argument --gpus: '1,1': GPU indices must be distinct"),
    (["--gpus", "99"], "--gpus 99: "),
    (["--port", "70000"], "argument --port: '70000' is not a port"),
    (["--dashboard-address", "host:http"], "not a dashboard address"),
    (["--scheduler-file", "{tmp}/exists.json"], "exists.json exists"),
    (["--scheduler-file", "{tmp}/no/such/dir/s.json"], "no such directory"),
    (["--port", "{busy}"], "in use"),
    # no upper bound: 200000 workers grew the command to gigabytes before the first started,
    # 10**23 to the whole memory; --threads 10**23 failed in msgpack with tracebacks; --gpus
    # 10**20 in an OverflowError (the busy port: unbounded, these stop there instead)
    (["--workers", "200000", "--port", "{busy}"], "argument --workers: '200000' must be at most"),
    (["--threads", str(10**23), "--port", "{busy}"], "argument --threads: '1000"),
    (["--gpus", str(10**20), "--port", "{busy}"], "argument --gpus: '1000"),
    # more workers than the memory holds at 256 MiB each
    (["--workers", "{over}", "--port", "{busy}"], "worker processes need at least"),
    # above the machine's memory every worker warned it was ignored; a fraction too small
    # for a worker to start had its nanny restart it without end
    (["--memory-limit", "1PB", "--port", "{busy}"], "'1PB' is more than this machine's memory"),
    (["--memory-limit", "1e-9", "--port", "{busy}"], "a worker needs more to start"),
    # os.access lets root write in /proc: the file failed once the workers were up, naming
    # its staged name
    (["--scheduler-file", "/proc/distmm-sched.json"],
     "--scheduler-file /proc/distmm-sched.json: cannot write in /proc"),
], ids=["workers-0", "threads-x", "memory-word", "memory-negative", "gpus-repeated",
        "gpus-too-many", "port-range", "dashboard", "file-exists", "file-dir", "port-busy",
        "workers-most", "threads-most", "gpus-most", "workers-memory", "memory-above",
        "memory-fraction-small", "file-unwritable"])
@pytest.mark.slow
def test_bad_options_fail_in_one_line_before_anything_starts(tmp_path: Path, busy_port, args, says):
    from distributed.system import MEMORY_LIMIT

    from distmm.cli.serve import MIN_WORKER_MEMORY

    (tmp_path / "exists.json").write_text("{}")
    over = MEMORY_LIMIT // MIN_WORKER_MEMORY + 1
    args = [a.format(tmp=tmp_path, busy=busy_port, over=over) for a in args]
    t0 = time.monotonic()
    r = run_cli("cluster", "--dashboard-address", ":0", *args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("distmm cluster: error: ") and says in r.stderr, r.stderr
    assert r.stdout == ""
    assert (tmp_path / "exists.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.json"]
    assert time.monotonic() - t0 < 30  # no worker was waited for


@pytest.mark.slow
def test_sigterm_while_the_workers_start_closes_them_at_once(tmp_path: Path):
    sched = tmp_path / "sched.json"
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "cluster", "--workers", "2",
                             "--port", "0", "--dashboard-address", ":0", "--scheduler-file", sched],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 60
    try:
        while not any(_is_spawned_worker(p) for p in seen.values()):  # a worker is starting
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            seen.update((p.pid, p) for p in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.01)
    except BaseException:
        stop_cluster(proc, None)
        raise
    status, out, err, seconds = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    assert status == 143, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("distmm cluster: stopped by SIGTERM while the workers started: the "
                          "cluster closed"), err
    assert not sched.exists() and list(tmp_path.iterdir()) == []
    assert_all_gone(list(seen.values()))
    assert seconds < 30


def _is_spawned_worker(p: psutil.Process) -> bool:
    try:
        return "spawn_main" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _cluster_pausing_at(tmp_path: Path, module: str, name: str, workers: int = 2):
    """``distmm cluster --workers W --scheduler-file F`` in a session of its own, with
    ``module.name`` waiting (``pause_at``) in each of its processes; ``(process, F, site)``."""
    site, sched = tmp_path / "site", tmp_path / "sched.json"
    site.mkdir()
    pause_at(site, module, name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "cluster", "--workers", str(workers),
                             "--port", "0", "--dashboard-address", ":0", "--scheduler-file",
                             str(sched)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    return proc, sched, site


def _wait_for(path: Path, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_cluster(proc, None)
            pytest.fail(f"distmm cluster never {what}")
        time.sleep(0.01)


def _distributed_before(version: str) -> bool:
    import distributed
    from packaging.version import Version

    return Version(distributed.__version__) < Version(version)


def _spawned_workers(proc: subprocess.Popen) -> list:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if _is_spawned_worker(p)]


@pytest.mark.slow
def test_sigterm_to_the_group_while_workers_start_closes_them_at_once(tmp_path: Path):
    """A SIGTERM to the whole process group (``kill -- -PGID``, ``timeout``, a batch
    system's time limit) while the workers are starting reaches this command alone: the
    worker processes start with it blocked. It ended them there: under distributed 2024.12
    their nannies restarted them and the start never ended (the command hung, printing
    "Restarting worker", its restarted workers alive), under 2026.8 the start failed. The
    command ends the start at once (the workers, still in their preload, killed): 143, the
    stop's one line, no scheduler file, no process of the session left."""
    # each worker waits in its preload, inside the start: started, not yet up
    proc, sched, site = _cluster_pausing_at(tmp_path, "distmm.cli.worker_setup", "dask_setup")
    _wait_for(site / "paused", proc, "started a worker")

    def group_sigterm_then_go(p):
        os.killpg(p.pid, signal.SIGTERM)
        time.sleep(0.5)  # a worker the signal ended would be gone by now
        (site / "go").touch()

    status, out, err, seconds = stop_cluster(proc, group_sigterm_then_go)
    assert status == 143, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err == "distmm cluster: stopped by SIGTERM while the workers started: the cluster " \
                  "closed\n", err
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # no scheduler file
    assert left_in_session(proc.pid) == []
    assert seconds < 30


@pytest.mark.slow
@pytest.mark.skipif(_distributed_before("2026.8.0"),
                    reason="distributed 2024.12 (the floor) restarts a worker killed while it "
                           "starts instead of failing the start; the restarted worker waits in "
                           "this test's paused preload (seen with 2024.12, passes with 2026.8)")
def test_a_start_failing_after_a_signal_is_the_signal_s_one_line(tmp_path: Path):
    """The start fails with a SIGTERM noted (the worker, waiting in its preload, killed by
    SIGKILL): the command ended with status 1 and "RuntimeError: Nanny failed to start.",
    dropping the signal. The signal comes in the failure's place: 143, its one line, no
    process of the session left, no scheduler file."""
    proc, sched, site = _cluster_pausing_at(tmp_path, "distmm.cli.worker_setup", "dask_setup",
                                            workers=1)
    _wait_for(site / "paused", proc, "started a worker")

    def group_sigterm_then_kill_the_worker(p):
        os.killpg(p.pid, signal.SIGTERM)
        for worker in _spawned_workers(p):
            worker.kill()

    status, out, err, seconds = stop_cluster(proc, group_sigterm_then_kill_the_worker)
    assert status == 143, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("distmm cluster: stopped by SIGTERM while the workers started"), err
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # no scheduler file
    assert left_in_session(proc.pid) == []
    assert seconds < 30


@pytest.mark.slow
def test_a_second_signal_while_the_workers_start_adds_nothing(tmp_path: Path):
    """SIGTERM and SIGINT to the group while the workers start: the first (Python runs
    pending handlers in signal-number order: either) ends the start at once, the second
    changes nothing: the first's status and one line, no scheduler file, no process of the
    session left."""
    import re

    proc, sched, site = _cluster_pausing_at(tmp_path, "distmm.cli.worker_setup", "dask_setup")
    _wait_for(site / "paused", proc, "started a worker")

    def two_signals_then_go(p):
        os.killpg(p.pid, signal.SIGTERM)
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.5)
        (site / "go").touch()

    status, out, err, seconds = stop_cluster(proc, two_signals_then_go)
    said = re.fullmatch(r"distmm cluster: stopped by (SIGINT|SIGTERM) while the workers "
                        r"started: the cluster closed\n", err)
    assert said, err
    assert status == (130 if said[1] == "SIGINT" else 143), err
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]
    assert left_in_session(proc.pid) == []
    assert seconds < 30


@pytest.mark.slow
def test_a_second_signal_before_the_close_is_one_line(tmp_path: Path):
    """A SIGTERM starts the close; a second one (here before it has begun: ``_close``
    waits) stops at once, killing the worker processes and removing the file, in one
    line. distributed's warning about processes killed under its nannies ("exit status
    was already read") came before it."""
    proc, sched, site = _cluster_pausing_at(tmp_path, "distmm.cli.serve", "_close")
    _wait_for(sched, proc, "wrote its scheduler file", timeout=120)
    proc.send_signal(signal.SIGTERM)
    _wait_for(site / "paused", proc, "began its close")
    status, out, err, seconds = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    assert status == 143, err
    assert err.count("\n") == 1, err
    assert err.startswith("distmm cluster: stopped at once by a second SIGTERM: 2 worker "
                          f"process(es) killed, {sched} removed"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]
    assert left_in_session(proc.pid) == []


@pytest.mark.slow
def test_the_scheduler_file_is_written_through_no_link_at_its_staged_name(tmp_path: Path):
    """The check before work makes and removes the staged name; a link planted there before
    the file is written (after the workers are up) was followed: the file it pointed to got
    the scheduler's JSON and became the scheduler file. The staged file is created
    exclusively now, the link removed first (not what it points to): that file is left as it
    was, and the scheduler file is the command's own, removed at the stop."""
    victim = tmp_path / "victim"
    victim.write_text("kept")
    proc, sched, site = _cluster_pausing_at(tmp_path, "distmm.cli.serve",
                                            "_write_scheduler_file")
    try:
        _wait_for(site / "paused", proc, "came to write its scheduler file", timeout=120)
        (tmp_path / f".sched.json.distmm-partial-{proc.pid}").symlink_to(victim)
        (site / "go").touch()
        _wait_for(sched, proc, "wrote its scheduler file")
        assert victim.read_text() == "kept"
        assert not sched.is_symlink() and not sched.samefile(victim)
        assert json.loads(sched.read_text())["address"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sched.json", "site", "victim"]
    except BaseException:
        stop_cluster(proc, None)
        raise
    status, out, err, seconds = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    assert status == 143, err
    assert victim.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site", "victim"]


@pytest.mark.slow
def test_results_a_client_holds_when_the_cluster_stops_are_not_logged(tmp_path: Path):
    """A client holds results on the workers (a product still running, or persisted data)
    when SIGTERM stops the cluster: the scheduler logged "Removing worker ... caused the
    cluster to lose already computed task(s)" for each worker closed, before the stop's line.
    That line says what closed: it is the only one."""
    from distributed import Client

    sched = tmp_path / "sched.json"
    proc = serve_cluster(sched, "--workers", 2)
    try:
        client = Client(scheduler_file=str(sched), timeout=30)
        futures = client.map(bytes, range(1000, 1008))
        client.wait_for_workers(2, timeout=60)
        client.gather(futures)
    except BaseException:
        stop_cluster(proc, None)
        raise
    try:
        status, out, err, seconds = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    finally:
        client.close(timeout=5)
    assert status == 143, err
    assert err.count("\n") == 1, err
    assert err.startswith("distmm cluster: stopped by SIGTERM: 2 workers and the scheduler "
                          f"closed, {sched} removed"), err


def test_a_closing_workers_heartbeat_failure_is_left_out_of_its_log():
    """The worker preload's filter, on a real in-process scheduler and worker: the
    heartbeat failure is kept while the worker runs and dropped once it has closed; other
    records of a closed worker are kept."""
    import asyncio
    import logging

    from distributed import Scheduler, Worker

    from distmm.cli.worker_setup import CANCELLED, HEARTBEAT_FAILED, ClosingWorkerFilter

    def passes(filt, msg):
        record = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg,
                                   None, None)
        return filt.filter(record)

    cancelled = CANCELLED[0] + "<Task cancelled name='execute(x)'>" + CANCELLED[1]

    async def main():
        async with Scheduler(dashboard_address=":0") as s:
            worker = await Worker(s.address, nthreads=1)
            beat, task = ClosingWorkerFilter(worker, HEARTBEAT_FAILED), ClosingWorkerFilter(
                worker, *CANCELLED)
            running = passes(beat, HEARTBEAT_FAILED + "."), passes(task, cancelled)
            await worker.close()
            return (running, (passes(beat, HEARTBEAT_FAILED + "."), passes(task, cancelled)),
                    (passes(beat, "another error"), passes(task, CANCELLED[0] + "x ended")))

    running, closed, other = asyncio.run(main())
    assert running == (True, True) and closed == (False, False) and other == (True, True)


def test_a_transfer_cut_while_the_worker_closes_is_left_out_of_its_log():
    """A worker sending data when its close cuts the connection (the scheduler gathering a
    product's results as ``distmm cluster`` closes on SIGTERM) logged "failed during get data
    with ..." and the closed stream's traceback. With the preload (``dask_setup``) on a real
    in-process worker: a transfer cut while the worker runs is logged, one cut while it
    closes (held there by a plugin's teardown) is not."""
    import asyncio
    import logging

    from distributed import Scheduler, Worker, WorkerPlugin
    from distributed.comm import connect

    from distmm.cli.worker_setup import dask_setup

    class Kept(logging.Handler):  # on the logger: sees the records its filters let through
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    class HoldClose(WorkerPlugin):
        def __init__(self):
            self.closing, self.go = asyncio.Event(), asyncio.Event()

        async def teardown(self, worker):
            self.closing.set()
            await self.go.wait()

    async def cut_transfer(worker):
        comm = await connect(worker.address)
        await comm.write({"op": "get_data", "keys": ["x"], "who": None})
        assert (await comm.read())["status"] == "OK"  # the data; the worker waits for "OK"
        comm.abort()
        while worker.transfer_outgoing_count:  # the worker's failure handled, and logged
            await asyncio.sleep(0.01)

    async def main(kept):
        async with Scheduler(dashboard_address=":0") as s:
            worker = await Worker(s.address, nthreads=1)
            dask_setup(worker)
            worker.update_data({"x": b"0" * 1000})
            hold = HoldClose()
            await worker.plugin_add(hold, name="hold-close")
            await cut_transfer(worker)
            running = [m for m in kept.messages if "failed during get data" in m]
            closing = asyncio.create_task(worker.close())
            await hold.closing.wait()
            await cut_transfer(worker)
            hold.go.set()
            await closing
            return running, [m for m in kept.messages if "failed during get data" in m]

    log = logging.getLogger("distributed.worker")
    kept, filters = Kept(), list(log.filters)
    sigint = signal.getsignal(signal.SIGINT)  # dask_setup ignores SIGINT in this process
    log.addHandler(kept)
    try:
        running, after = asyncio.run(main(kept))
    finally:
        log.removeHandler(kept)
        log.filters[:] = filters
        signal.signal(signal.SIGINT, sigint)
    assert len(running) == 1 and running[0].startswith("failed during get data with "), running
    assert after == running  # nothing added while closing


@pytest.mark.slow
def test_dashboard_none_serves_no_dashboard(tmp_path: Path):
    """``--dashboard-address none``: the scheduler's HTTP server (health, metrics) has no
    dashboard pages and does not take 8787 (distributed's None served the dashboard there)."""
    import urllib.error
    import urllib.request

    from distributed import Client

    sched = tmp_path / "sched.json"
    proc = serve_cluster(sched, "--workers", 1, "--dashboard-address", "none")
    try:
        served = psutil.Process(proc.pid)
        connections = getattr(served, "net_connections", None) or served.connections  # psutil<6
        listening = {c.laddr.port for c in connections("tcp") if c.status == psutil.CONN_LISTEN}
        with Client(scheduler_file=str(sched), timeout=30) as client:
            http = client.scheduler_info()["services"]["dashboard"]  # the HTTP server's port
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10) as page:
            assert page.status == 200
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=10)
    finally:
        status, out, err, _ = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    assert http != 8787 and 8787 not in listening, listening
    assert "dashboard       none" in out, out
    assert status == 143, err


@pytest.mark.slow
def test_sigterm_to_the_console_scripts_group_closes_without_tracebacks(tmp_path: Path):
    """``distmm cluster`` as users start it (the console script, whose worker processes
    inherit its ``sys.argv``), stopped by a SIGTERM to its whole process group, as
    ``kill -- -PGID``, ``timeout``, Slurm's ``scancel`` and systemd send it: the workers
    end without a traceback (they raised the command's ``Signalled`` in their event loop)."""
    script = Path(sys.executable).with_name("distmm")
    if not script.is_file():
        pytest.skip("no distmm console script beside this interpreter")
    sched = tmp_path / "sched.json"
    proc = subprocess.Popen([str(script), "cluster", "--workers", "2", "--port", "0",
                             "--dashboard-address", ":0", "--scheduler-file", str(sched)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not sched.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    status, out, err, seconds = stop_cluster(proc, lambda p: os.killpg(p.pid, signal.SIGTERM))
    assert status == 143, err
    assert "Traceback" not in err and "Signalled" not in err, err
    assert err.count("\n") == 1 and err.startswith("distmm cluster: stopped by SIGTERM: 2 "
                                                   "workers and the scheduler closed"), err
    assert not sched.exists() and list(tmp_path.iterdir()) == []
    assert_all_gone(workers)
    assert seconds < 30


@pytest.mark.slow
def test_a_cluster_killed_mid_product_fails_the_command_in_one_line(tmp_path: Path):
    """The whole cluster killed (SIGKILL to its group) while ``distmm matmul --scheduler-file``
    runs on it: the command ends with status 1 once distributed gives up reconnecting, its
    line says the scheduler may be lost (it said 'workers', a KeyError, or 'AttributeError:
    NoneType ... identity', or 'ConnectionPool is closed'), nothing is staged."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((4000, 4000)))
    np.save(tmp_path / "b.npy", rng.standard_normal((4000, 4000)))
    sched = tmp_path / "sched.json"
    proc = serve_cluster(sched, "--workers", 2, "--threads", 1)
    run = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", str(tmp_path / "a.npy"),
                            str(tmp_path / "b.npy"), "-o", str(tmp_path / "c.npy"),
                            "--scheduler-file", str(sched), "--tile", "250", "--no-progress",
                            "--connect-timeout", "5"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        from distributed import Client

        # the product's tasks running, as the scheduler says (a scheduler lost during the
        # engine's set-up before them: tests/test_dask_faults.py); a fixed 1.5 s after the
        # staged file was that on this machine (0.2 s of set-up, then 14 s of tasks), not on
        # every one
        deadline = time.monotonic() + 60
        with Client(scheduler_file=str(sched), timeout=30) as watcher:
            while not _product_running(watcher):
                assert run.poll() is None, run.communicate()
                assert time.monotonic() < deadline, "no task of the product ever ran"
                time.sleep(0.05)
        assert run.poll() is None, run.communicate()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        out, err = run.communicate(timeout=90)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, err
    lines = [line for line in err.splitlines() if line.startswith("distmm matmul: error:")]
    assert len(lines) == 1 and "SchedulerLost" in lines[0] and "was lost" in lines[0], err
    assert "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "sched.json"]
