"""The deploy path as users meet it: ``distmm cluster``'s scheduler file and stops, and
``distmm matmul --scheduler-file`` naming what is no scheduler file."""
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

from conftest import assert_all_gone, run_cli, serve_cluster, stop_cluster


def _cluster_processes(proc) -> list:
    import psutil

    return psutil.Process(proc.pid).children(recursive=True)


def test_a_dangling_link_as_scheduler_file_is_refused_before_the_workers_start(tmp_path: Path):
    # the link's target does not exist, so the file looked free; linking the file into place
    # then failed once the workers were up ("appeared while the cluster started")
    link = tmp_path / "sched.json"
    link.symlink_to(tmp_path / "gone" / "sched.json")
    t0 = time.monotonic()
    r = run_cli("cluster", "--port", "0", "--dashboard-address", ":0", "--workers", "1",
                "--scheduler-file", link, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"distmm cluster: error: --scheduler-file {link} is a link to "), \
        r.stderr
    assert "--overwrite" in r.stderr and r.stdout == ""
    assert link.is_symlink() and not link.exists()  # left as it was
    assert [p.name for p in tmp_path.iterdir()] == ["sched.json"]
    assert time.monotonic() - t0 < 20  # no worker was waited for


@pytest.mark.slow
def test_overwrite_replaces_a_dangling_link_and_removes_the_file_at_the_stop(tmp_path: Path):
    link = tmp_path / "sched.json"
    link.symlink_to(tmp_path / "gone.json")
    proc = serve_cluster(link, "--workers", "1", "--overwrite")
    try:
        assert not link.is_symlink() and json.loads(link.read_text())["address"]
        workers = _cluster_processes(proc)
        status, _, err, _ = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    except BaseException:
        stop_cluster(proc, None)
        raise
    assert status == 143, err
    assert not (tmp_path / "gone.json").exists() and list(tmp_path.iterdir()) == []
    assert_all_gone(workers)


@pytest.mark.slow
@pytest.mark.parametrize("whom", ["process", "group"])
def test_a_hangup_closes_the_cluster_and_removes_the_scheduler_file(tmp_path: Path, whom):
    # a closed terminal (an ssh session lost) sends SIGHUP to the foreground group: the
    # command died where it was, leaving the scheduler file naming a dead scheduler (and
    # multiprocessing's "leaked semaphore objects" warning)
    sched = tmp_path / "sched.json"
    # a terminal's command starts with SIGHUP at its default; under nohup (a CI's runner may
    # be) the child would inherit the ignore, which the command keeps (the next test)
    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        proc = serve_cluster(sched, "--workers", "2")
    finally:
        signal.signal(signal.SIGHUP, hup)
    try:
        workers = _cluster_processes(proc)
        send = ((lambda p: p.send_signal(signal.SIGHUP)) if whom == "process"
                else (lambda p: os.killpg(p.pid, signal.SIGHUP)))
        status, out, err, seconds = stop_cluster(proc, send)
    except BaseException:
        stop_cluster(proc, None)
        raise
    assert status == 128 + signal.SIGHUP, (status, err)
    assert err == (f"distmm cluster: stopped by SIGHUP: 2 workers and the scheduler closed, "
                   f"{sched} removed\n"), err
    assert not sched.exists() and list(tmp_path.iterdir()) == []
    assert_all_gone(workers)
    assert seconds < 30


@pytest.mark.slow
def test_a_hangup_left_ignored_by_nohup_does_not_stop_the_cluster(tmp_path: Path):
    sched = tmp_path / "sched.json"
    proc = subprocess.Popen(["nohup", sys.executable, "-m", "distmm", "cluster", "--port", "0",
                             "--dashboard-address", ":0", "--workers", "1",
                             "--scheduler-file", str(sched)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not sched.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = _cluster_processes(proc)
        os.killpg(proc.pid, signal.SIGHUP)
        time.sleep(1.5)
        assert proc.poll() is None and sched.exists()
        status, _, err, _ = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    except BaseException:
        stop_cluster(proc, None)
        raise
    assert status == 143, err
    assert not sched.exists()
    assert_all_gone(workers)


def test_a_directory_as_scheduler_file_is_named_a_directory(tmp_path: Path):
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((7, 5)))
    np.save(tmp_path / "b.npy", rng.standard_normal((5, 3)))
    (tmp_path / "sched.json").mkdir()
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                "--scheduler-file", tmp_path / "sched.json", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "sched.json is a directory" in r.stderr and "no such file" not in r.stderr, r.stderr
    assert not (tmp_path / "c.npy").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stale_scheduler_file_fails_at_once(tmp_path: Path):
    # a cluster killed (SIGKILL) leaves its file naming a scheduler that has stopped:
    # distributed's connect retried the refused connection until the 30 s timeout
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((7, 5)))
    np.save(tmp_path / "b.npy", rng.standard_normal((5, 3)))
    address = f"tcp://127.0.0.1:{_free_port()}"
    (tmp_path / "sched.json").write_text(json.dumps({"type": "Scheduler", "address": address}))
    t0 = time.monotonic()
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                "--scheduler-file", tmp_path / "sched.json", timeout=120)
    seconds = time.monotonic() - t0
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"nothing listens at {address}" in r.stderr and "stale" in r.stderr, r.stderr
    assert not (tmp_path / "c.npy").exists()
    assert seconds < 15, seconds  # not the 30 s connect timeout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_dask_mpi_program_with_too_few_ranks_is_one_line(tmp_path: Path, mpirun, ranks):
    # dask-mpi's WorldTooSmallException was a traceback on every rank, exit status 1
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((7, 5)))
    np.save(tmp_path / "b.npy", rng.standard_normal((5, 3)))
    program = Path(__file__).resolve().parents[1] / "deploy" / "dask_mpi_matmul.py"
    r = mpirun(ranks, program, "a.npy", "b.npy", "-o", "c.npy", cwd=tmp_path,
               env={"DISTMM_GPUS_PER_NODE": "0", "DISTMM_DASHBOARD": ":0"}, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("dask_mpi_matmul.py: error")]
    assert lines == [f"dask_mpi_matmul.py: error: {ranks} MPI process(es): it needs at least "
                     f"3, the scheduler, the client and a worker"], r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


@pytest.mark.parametrize("kwargs, says", [
    (dict(cores=64, memory="1GiB"), "gives each of a job's 64 workers 16.00 MiB"),
    (dict(cores=3, memory="700MiB"), "gives each of a job's 3 workers 233.33 MiB"),
    (dict(gpus=8, memory="1GiB"), "gives each of a job's 8 workers 128.00 MiB"),
    (dict(cores=1, memory=10**6), "gives a job's one worker 0.95 MiB"),
], ids=["cpu", "cpu-odd", "gpu", "bytes"])
def test_jobqueue_memory_too_small_for_its_workers_fails_before_submitting(monkeypatch, kwargs,
                                                                          says):
    # each worker's limit is the job's memory over its workers: below what a worker holds
    # once started, its nanny restarted it without end, in every job
    from distmm.deploy import jobqueue_cluster

    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)  # importing it would fail
    with pytest.raises(ValueError, match="a worker needs at least 256 MiB to start") as info:
        jobqueue_cluster("slurm", **kwargs)
    assert says in str(info.value)


def test_jobqueue_memory_of_256_mib_per_worker_is_taken(monkeypatch):
    from distmm.deploy import jobqueue_cluster

    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)
    with pytest.raises(ImportError, match="dask-jobqueue"):  # past every check
        jobqueue_cluster("slurm", cores=4, memory="1GiB")


# -- a scheduler with no workers: waited for up to distmm.retry-timeout, then one line ----------

def _no_workers_words(address: str, waited: str) -> str:
    """The words after "FUNCTION: " (the command line's "distmm matmul: error: ")."""
    return (f"the Dask cluster at {address} has no workers: none joined within {waited} s "
            f"(distmm.retry-timeout); start workers for it (dask worker {address}), or a "
            f"cluster with its workers (distmm cluster --scheduler-file FILE)")


@pytest.fixture
def empty_cluster():
    """A real scheduler (TCP, in this process) that no worker ever joins."""
    import distributed

    with distributed.LocalCluster(n_workers=0, processes=False, protocol="tcp://",
                                  dashboard_address=":0") as cl:
        yield cl


@pytest.mark.slow
def test_matmul_on_a_scheduler_without_workers_says_how_long_it_waited(tmp_path: Path,
                                                                        empty_cluster):
    # it waited 30 s whatever the settings, then said only "the Dask cluster has no workers"
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((7, 5)))
    np.save(tmp_path / "b.npy", rng.standard_normal((5, 3)))
    address = empty_cluster.scheduler_address
    t0 = time.monotonic()
    r = run_cli("matmul", "a.npy", "b.npy", "-o", "c.npy", "--scheduler", address, cwd=tmp_path,
                env={"DISTMM_RETRY_TIMEOUT": "1s", "DASK_DISTMM__RETRY_TIMEOUT": "1s"},
                timeout=120)  # both: this process's may have been fed from its DISTMM_ one
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr == f"distmm matmul: error: {_no_workers_words(address, '1')}\n", r.stderr
    assert r.stdout == ""
    assert 1 <= elapsed < 20, elapsed  # the configured wait, not 30 s
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]  # no output
    assert not empty_cluster.scheduler.tasks  # nothing scattered or submitted


def test_the_api_on_a_scheduler_without_workers_waits_the_retry_timeout(empty_cluster):
    import dask
    import distributed

    import distmm

    rng = np.random.default_rng()
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
    with distributed.Client(empty_cluster) as empty, \
            dask.config.set({"distmm.retry-timeout": "0.5s"}):
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            distmm.gemm(a, b, engine="dask", client=empty)
        elapsed = time.monotonic() - t0
    address = empty_cluster.scheduler_address
    assert str(info.value) == f"gemm: {_no_workers_words(address, '0.5')}"
    assert 0.5 <= elapsed < 10, elapsed
    assert not empty_cluster.scheduler.tasks


# -- a scheduler file whose path goes through a regular file -----------------------------------

@pytest.mark.parametrize("under", ["x.json", "d/x.json"], ids=["in-file", "below-file"])
def test_a_scheduler_file_through_a_file_is_not_a_directory(tmp_path: Path, under: str):
    # it said "no such directory: .../f", where .../f is a file
    (tmp_path / "f").write_text("a file\n")
    path = tmp_path / "f" / under
    r = run_cli("cluster", "--port", "0", "--dashboard-address", ":0", "--workers", "1",
                "--scheduler-file", path, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr == (f"distmm cluster: error: --scheduler-file {path}: {tmp_path / 'f'} "
                        f"is not a directory\n"), r.stderr
    assert r.stdout == "" and [p.name for p in tmp_path.iterdir()] == ["f"]
    assert (tmp_path / "f").read_text() == "a file\n"


def test_matmul_scheduler_file_through_a_file_is_not_a_directory(tmp_path: Path):
    # it said "no such file: .../f/x.json"
    (tmp_path / "f").write_text("a file\n")
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((3, 4)))
    np.save(tmp_path / "b.npy", rng.standard_normal((4, 5)))
    path = tmp_path / "f" / "x.json"
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                "--scheduler-file", path, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr == (f"distmm matmul: error: --scheduler-file {path}: {tmp_path / 'f'} "
                        f"is not a directory\n"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "f"]


def test_a_scheduler_file_in_a_missing_folder_is_still_no_such_directory(tmp_path: Path):
    path = tmp_path / "gone" / "x.json"
    r = run_cli("cluster", "--port", "0", "--dashboard-address", ":0", "--workers", "1",
                "--scheduler-file", path, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr == (f"distmm cluster: error: --scheduler-file {path}: no such directory: "
                        f"{tmp_path / 'gone'}\n"), r.stderr
    assert list(tmp_path.iterdir()) == []
