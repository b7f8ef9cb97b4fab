"""deploy/'s MPI job scripts with Open MPI's ``mpirun`` as the launcher, stopped mid-product.

Covers: ``mpirun`` (prterun) that gets SIGTERM itself kills the ranks within a second and
drops their output, so the ranks' one line ("terminated by SIGTERM; N of M C stripes kept")
never reached the job's log. At the time limit (mpi.sbatch) or the walltime timer (mpi.pbs)
the script signals the ranks ``mpirun`` started instead, and the log has their line, the
status is theirs (143), and the requeued or resubmitted ``--resume`` run finishes with numpy's
result. Cancelled (SIGTERM to every process of the job, ``mpirun`` included), the script
says itself that it was terminated and that the finished stripes are kept, and ``--resume``
finishes them. The jobs run under the stand-ins of ``tests/batchsim``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, assert_close

DEPLOY = ROOT / "deploy"
KEPT = "distmm matmul: error: terminated by SIGTERM;"

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


def _operands(folder: Path, m=301, k=403, n=297):
    rng = np.random.default_rng()
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    np.save(folder / "a.npy", a)
    np.save(folder / "b.npy", b)
    return a, b


def _logged(folder: Path) -> int:
    return sum(len(p.read_text().split()) for p in folder.glob(".c.npy.distmm-partial-*.done-*"))


def _when_stripes_logged(folder: Path, stripes: int, then, timeout=120):
    deadline = time.time() + timeout
    while _logged(folder) < stripes:
        if time.time() > deadline:
            logs = [p.read_text(errors="replace") for p in folder.glob("distmm-mpi*")]
            pytest.fail(f"fewer than {stripes} stripes logged in {timeout} s: {logs}")
        time.sleep(0.01)
    then()


def _state(env, job: str) -> dict:
    return json.loads((Path(env["BATCHSIM_SPOOL"]) / job.split(".")[0] / "state.json").read_text())


def _mpirun_env(batch_env, **more) -> dict:
    """mpiexec as mpi.sbatch's launcher; the stand-ins' Slurm variables are not its
    allocation (Slurm's ras and plm components would take them for one)."""
    return {**batch_env, "DISTMM_LAUNCHER": "mpiexec -n 3", "DISTMM_BATCH_STRIPES": "24",
            "DISTMM_BATCH_STRIPE_PAUSE": "0.1", "PRTE_MCA_ras": "^slurm",
            "PRTE_MCA_plm": "^slurm", **more}


def test_slurm_time_limit_keeps_the_ranks_line_under_mpirun(tmp_path, batch_env):
    a, b = _operands(tmp_path)
    trigger = tmp_path / "time-limit"
    env = _mpirun_env(batch_env, BATCHSIM_SIGNAL_ON=str(trigger))
    job = subprocess.Popen(["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=3",
                            str(DEPLOY / "slurm" / "mpi.sbatch"), "a.npy", "b.npy", "-o",
                            "c.npy"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path)
    _when_stripes_logged(tmp_path, 4, trigger.touch)
    out, err = job.communicate(timeout=180)
    job_id = out.split()[-1]
    log = (tmp_path / f"distmm-mpi-{job_id}.out").read_text()
    assert job.returncode == 0, log + err
    first = log.split("run 2,")[0]
    assert KEPT in first and "C stripes kept in" in first, log
    assert "stopped before the time limit (status 143); requeueing to resume" in first, log
    assert _state(env, job_id)["restarts"] == 1
    assert "wrote c.npy" in log.split("run 2,")[1], log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert not list(tmp_path.glob(".c.npy.*"))


def test_slurm_cancel_says_what_became_of_the_run_under_mpirun(tmp_path, batch_env, mpirun):
    """``scancel``: SIGTERM to every process of the job, mpirun included, so the ranks' line
    may be lost; the script's own says the job was terminated and the stripes are kept."""
    a, b = _operands(tmp_path)
    env = _mpirun_env(batch_env)
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=3",
                          str(DEPLOY / "slurm" / "mpi.sbatch"), "a.npy", "b.npy", "-o", "c.npy"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.split()[-1]
    _when_stripes_logged(tmp_path, 4, lambda: subprocess.run(["scancel", job_id], env=env,
                                                             check=True))
    deadline = time.time() + 120
    while _state(env, job_id).get("state") in ("PENDING", "RUNNING"):
        assert time.time() < deadline, "the cancelled job did not end"
        time.sleep(0.1)
    log = (tmp_path / f"distmm-mpi-{job_id}.out").read_text()
    assert "mpi.sbatch: terminated by SIGTERM (status " in log, log
    assert "C stripes finished are kept in the staged output" in log, log
    assert _state(env, job_id)["left_running"] == []
    assert list(tmp_path.glob(".c.npy.distmm-partial-*"))
    r = mpirun(3, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.npy", "--resume",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert not list(tmp_path.glob(".c.npy.*"))


def test_pbs_walltime_keeps_the_ranks_line_under_mpiexec(tmp_path, batch_env):
    """mpi.pbs's own timer (DISTMM_STOP_MARGIN before the walltime) under its default
    launcher, ``mpiexec -n <lines> -machinefile $PBS_NODEFILE``."""
    a, b = _operands(tmp_path)
    env = batch_env
    script = tmp_path / "mpi.pbs"
    script.write_text((DEPLOY / "pbs" / "mpi.pbs").read_text().replace(
        "#PBS -l select=2:ncpus=16:ngpus=4:mpiprocs=4", "#PBS -l select=1:ncpus=3:mpiprocs=3"))
    variables = dict(DISTMM_ENV_SETUP=env["DISTMM_ENV_SETUP"], DISTMM_A=tmp_path / "a.npy",
                     DISTMM_B=tmp_path / "b.npy", DISTMM_C=tmp_path / "c.npy",
                     DISTMM_JOB_SCRIPT=script, DISTMM_BATCH_STRIPES=24,
                     DISTMM_BATCH_STRIPE_PAUSE=0.1)
    job = subprocess.Popen(["qsub", "-W", "block=true", "-v",
                            ",".join(f"{k}={v}" for k, v in variables.items()), str(script)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           cwd=tmp_path)
    spool = Path(env["BATCHSIM_SPOOL"])

    def walltime_timer_fires():  # what the script's own timer sends, DISTMM_STOP_MARGIN early
        first = min(spool.iterdir(), key=lambda p: int(p.name))
        os.kill(json.loads((first / "state.json").read_text())["pid"], signal.SIGUSR1)

    _when_stripes_logged(tmp_path, 4, walltime_timer_fires)
    out, err = job.communicate(timeout=180)
    first_id = out.split()[-1]
    log = (tmp_path / f"distmm-mpi.o{first_id.split('.')[0]}").read_text()
    assert KEPT in log and "C stripes kept in" in log, log + err
    assert "stopped before the walltime (status 143); resubmitting" in log, log
    second = str(int(first_id.split(".")[0]) + 1)
    deadline = time.time() + 180
    while _state(env, second).get("state") != "F":
        assert time.time() < deadline, "the resubmitted job did not finish"
        time.sleep(0.1)
    log2 = (tmp_path / f"distmm-mpi.o{second}").read_text()
    assert _state(env, second)["exit_code"] == 0 and "wrote" in log2, log2
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert not list(tmp_path.glob(".c.npy.*"))
