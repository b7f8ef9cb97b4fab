"""A signal while an embedded or served cluster's workers start: ``distmm demo --engine
dask`` and ``distmm cluster`` end at once (a batch system's SIGKILL follows its SIGTERM
within seconds), with 143 after SIGTERM and 130 after SIGINT, one line, no process of the
command's session left and nothing written that the command was asked to write. Real
processes and real signals; the workers wait in their preload (``pause_at``), so that they
are started and never up, and only the signal can end the start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import pause_at

#: seconds within which the command must end after the signal; the workers waiting in their
#: preload never come up, so a command that acts on the signal only once they are up never
#: ends (killed after ``HUNG``)
PROMPT, HUNG = 5.0, 30.0

WORKERS = 8


def _distributed_before(version: str) -> bool:
    import distributed
    from packaging.version import Version

    return Version(distributed.__version__) < Version(version)


#: distributed 2024.12 (the floor) restarts a worker killed while it starts, so there the
#: workers start with the signals held back and a signal is acted on once they are up
pytestmark = pytest.mark.skipif(_distributed_before("2026.8.0"),
                                reason="a start cut short needs distributed 2026.8's nanny")

SENDS = {
    "SIGTERM-to-the-command": (signal.SIGTERM, lambda p: p.send_signal(signal.SIGTERM)),
    "SIGTERM-to-the-group": (signal.SIGTERM, lambda p: os.killpg(p.pid, signal.SIGTERM)),
    "ctrl-c": (signal.SIGINT, lambda p: os.killpg(p.pid, signal.SIGINT)),
}


def _start_paused(tmp_path: Path, *argv) -> tuple[subprocess.Popen, Path]:
    """``python -m distmm ARGV`` in a session of its own, each worker process waiting in its
    preload (``distmm.cli.worker_setup.dask_setup``) for ``site/go``, which never comes;
    returned once a worker waits there."""
    site = tmp_path / "site"
    site.mkdir()
    pause_at(site, "distmm.cli.worker_setup", "dask_setup")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "distmm", *map(str, argv)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    deadline = time.monotonic() + 120
    while not (site / "paused").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_session(proc)
            pytest.fail(f"no worker started: {proc.communicate()}")
        time.sleep(0.01)
    return proc, site


def _session(sid: int) -> list:
    """The processes of session ``sid`` that are running (not zombies)."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def _kill_session(proc: subprocess.Popen) -> None:
    for p in _session(proc.pid):
        try:
            p.kill()
        except psutil.Error:
            pass


def _stop(proc: subprocess.Popen, send) -> tuple[int, str, str, float]:
    """``send(proc)``; ``(exit status, stdout, stderr, seconds to the exit)``, failing the
    test (and killing the session) where the command has not ended within ``HUNG`` s."""
    t0 = time.monotonic()
    send(proc)
    try:
        out, err = proc.communicate(timeout=HUNG)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        proc.communicate()
        pytest.fail(f"still running {HUNG} s after the signal")
    return proc.returncode, out, err, time.monotonic() - t0


def _left_in_session(sid: int) -> list:
    """What is still running in session ``sid``, 5 s at most after its leader ended."""
    deadline = time.monotonic() + 5
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [(p.pid, " ".join(p.cmdline())) for p in left]


def _workers(proc: subprocess.Popen) -> int:
    return sum("spawn_main" in " ".join(p.cmdline()) for p in _session(proc.pid)
               if p.pid != proc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("how", list(SENDS))
def test_a_signal_while_the_demo_s_workers_start_ends_it_at_once(tmp_path: Path, how):
    signum, send = SENDS[how]
    report = tmp_path / "report.html"
    proc, site = _start_paused(tmp_path, "demo", "--engine", "dask", "-n", 97, "--workers",
                               WORKERS, "--report", report)
    assert _workers(proc) >= 1
    status, out, err, seconds = _stop(proc, send)
    words = "interrupted (SIGINT)" if signum == signal.SIGINT else "terminated by SIGTERM"
    assert (status, err) == (128 + signum, f"distmm demo: error: {words}\n"), err
    assert out == ""
    assert seconds < PROMPT, seconds
    assert _left_in_session(proc.pid) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # no report


@pytest.mark.slow
@pytest.mark.parametrize("how", list(SENDS))
def test_a_signal_while_distmm_cluster_s_workers_start_ends_it_at_once(tmp_path: Path, how):
    signum, send = SENDS[how]
    sched = tmp_path / "sched.json"
    proc, site = _start_paused(tmp_path, "cluster", "--gpus", 0, "--workers", WORKERS,
                               "--port", 0, "--dashboard-address", ":0", "--scheduler-file",
                               sched)
    assert _workers(proc) >= 1
    status, out, err, seconds = _stop(proc, send)
    name = signal.Signals(signum).name
    assert (status, err) == (128 + signum, f"distmm cluster: stopped by {name} while the "
                                           f"workers started: the cluster closed\n"), err
    assert out == ""
    assert seconds < PROMPT, seconds
    assert _left_in_session(proc.pid) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # no scheduler file
