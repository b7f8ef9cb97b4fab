"""deploy/: the Slurm and PBS scripts run end to end, and ``distmm.deploy.jobqueue_cluster``.

Covers: every script under ``deploy/slurm`` and ``deploy/pbs`` passes ``bash -n`` and names
no site (partition, account, queue); each is submitted for real (``sbatch``/``qsub``, the
stand-ins of ``tests/batchsim`` running the job on localhost with 2 workers or ranks) and
leaves C equal to a float64 reference, nothing of the job still running, and the command's
exit status; the Dask scripts shut the cluster down after a failing command; the MPI job stopped
by its time limit (the ``--signal`` delivered mid-product) requeues itself and finishes with
``--resume``, bitwise equal to an uninterrupted run, and the PBS one resubmits itself the
same way; every script refuses a job without operands at once (status 2); the dask-mpi
program under ``mpiexec -n 4``, its bad input, and a SIGTERM mid-product (to the launcher or
to every process) that leaves no staged output;
``jobqueue_cluster``'s job scripts (``bash -n``, the directives of GPU and CPU jobs) and a
cluster that scales to two jobs of the stand-ins whose workers run a product. Tests marked
``mpi`` start ``mpiexec`` (the ``srun`` stand-in starts its tasks through it).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, assert_close

DEPLOY = ROOT / "deploy"
#: the ranks' one line when a SIGTERM stops a batch run with stripes kept
KEPT = "distmm matmul: error: terminated by SIGTERM;"
SCRIPTS = sorted([*DEPLOY.glob("slurm/*.sbatch"), *DEPLOY.glob("pbs/*.pbs")])
PROGRAM = DEPLOY / "dask_mpi_matmul.py"


def _operands(folder: Path, m=67, k=45, n=31, seed=0):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    np.save(folder / "a.npy", a)
    np.save(folder / "b.npy", b)
    return a, b


def _state(env, job: str) -> dict:
    return json.loads((Path(env["BATCHSIM_SPOOL"]) / job.split(".")[0] / "state.json").read_text())


def _submit(env, cwd, *argv, timeout=180):
    """``sbatch --wait``/``qsub -W block=true`` ARGV; returns (status, job id, the job's log)."""
    r = subprocess.run([*argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    job = r.stdout.split()[-1]
    logs = sorted(Path(cwd).glob(f"*{job.split('.')[0]}*"))
    return r.returncode, job, "\n".join(p.read_text(errors="replace") for p in logs) + r.stderr


def _qsub(env, cwd, script, select, **variables):
    pairs = ",".join(f"{k}={v}" for k, v in variables.items())
    argv = ["qsub", "-W", "block=true", "-l", f"select={select}"]
    return _submit(env, cwd, *argv, *(["-v", pairs] if pairs else []), str(DEPLOY / "pbs" / script))


# -- every script ---------------------------------------------------------------------------


def test_every_script_is_here():
    """deploy/ sits beside tests/ (CI copies both): a missing folder fails, not skips."""
    assert [p.name for p in SCRIPTS] == ["dask-mpi.pbs", "dask.pbs", "mpi.pbs",
                                         "dask-mpi.sbatch", "dask.sbatch", "mpi.sbatch"]
    assert PROGRAM.is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_name_no_site(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith(("#SBATCH", "#PBS"))]
    assert directives
    for line in directives:  # partition, account, queue and project are the site's to add
        assert not any(opt in line.split() or line.split()[1].startswith(opt + "=")
                       for opt in ("-p", "--partition", "-A", "--account", "-q", "-P")), line
    assert "DISTMM_ENV_SETUP" in script.read_text()


# -- Slurm ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_dask_job(tmp_path, batch_env):
    a, b = _operands(tmp_path)
    env = {**batch_env, "DISTMM_A": "a.npy", "DISTMM_B": "b.npy", "DISTMM_C": "c.npy",
           "DISTMM_GPUS_PER_NODE": "0", "DISTMM_WORKERS_PER_NODE": "1"}
    status, job, log = _submit(env, tmp_path, "sbatch", "--wait", "--nodes=2",
                               str(DEPLOY / "slurm" / "dask.sbatch"))  # a worker per node
    assert status == 0, log
    assert "dask.sbatch: 2 workers ready" in log and "wrote c.npy" in log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    state = _state(env, job)
    assert state["left_running"] == [] and state["exit_code"] == 0
    assert not list(tmp_path.glob("distmm-scheduler-*"))  # the scheduler file is removed


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_dask_job_runs_a_program_and_returns_its_status(tmp_path, batch_env):
    """A failing command still shuts the cluster down; the job's status is the command's."""
    program = tmp_path / "prog.py"
    program.write_text(
        "import os, sys\nfrom distributed import Client\n"
        "with Client(scheduler_file=os.environ['DISTMM_SCHEDULER_FILE']) as c:\n"
        "    c.wait_for_workers(2, timeout=60)\n"  # a worker reconnecting under load is back
        "    n = len(c.scheduler_info(n_workers=-1)['workers'])\n"
        "print('workers seen:', n, flush=True)\nsys.exit(3)\n")
    env = {**batch_env, "DISTMM_GPUS_PER_NODE": "0", "DISTMM_WORKERS_PER_NODE": "2"}
    status, job, log = _submit(env, tmp_path, "sbatch", "--wait", "--nodes=1",
                               str(DEPLOY / "slurm" / "dask.sbatch"), sys.executable, program)
    assert status == 3, log
    seen = re.findall(r"workers seen: (\d+)", log)
    assert seen == ["2"], (seen, [ln for ln in log.splitlines() if "dask.sbatch" in ln])
    assert _state(env, job)["left_running"] == []


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_dask_job_cancelled_leaves_nothing_running(tmp_path, batch_env):
    env = {**batch_env, "DISTMM_GPUS_PER_NODE": "0", "DISTMM_WORKERS_PER_NODE": "1"}
    r = subprocess.run(["sbatch", "--nodes=1", str(DEPLOY / "slurm" / "dask.sbatch"),
                        "sleep", "600"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.split()[-1]
    log = tmp_path / f"distmm-dask-{job}.out"
    deadline = time.time() + 120
    while "workers ready" not in (log.read_text() if log.exists() else ""):
        assert time.time() < deadline, "the workers never came up"
        time.sleep(0.1)
    assert subprocess.run(["scancel", job], env=env).returncode == 0
    while _state(env, job)["state"] not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.time() < deadline + 60, "scancel did not end the job"
        time.sleep(0.1)
    state = _state(env, job)
    assert state["state"] == "CANCELLED" and state["exit_code"] == 143
    assert state["left_running"] == []
    assert not list(tmp_path.glob("distmm-scheduler-*"))


@pytest.mark.parametrize("script", ["slurm/dask.sbatch", "slurm/mpi.sbatch",
                                    "slurm/dask-mpi.sbatch", "pbs/dask.pbs", "pbs/mpi.pbs",
                                    "pbs/dask-mpi.pbs"])
def test_a_job_without_operands_is_refused_before_anything_starts(tmp_path, batch_env, script):
    """No arguments and no DISTMM_A/B/C: one line and status 2 at once. The Dask scripts
    started the scheduler and waited for every worker before bash found DISTMM_A unset
    (status 1); dask-mpi.sbatch ran its program without arguments on every task."""
    (tmp_path / "deploy").mkdir()  # the dask-mpi scripts' program, as in the checkout
    (tmp_path / "deploy" / PROGRAM.name).symlink_to(PROGRAM)
    env = {k: v for k, v in batch_env.items() if k not in ("DISTMM_A", "DISTMM_B", "DISTMM_C")}
    t0 = time.monotonic()
    if script.startswith("slurm/"):
        status, job, log = _submit(env, tmp_path, "sbatch", "--wait", "--nodes=1", "--ntasks=3",
                                   str(DEPLOY / script))
    else:
        status, job, log = _qsub(env, tmp_path, script.split("/")[1], "1:ncpus=2:mpiprocs=3",
                                 DISTMM_ENV_SETUP=env["DISTMM_ENV_SETUP"])
    assert status == 2, log
    lines = [ln for ln in log.splitlines() if ln.strip()]
    assert len(lines) == 1 and "DISTMM_A, DISTMM_B and DISTMM_C" in lines[0], log
    assert time.monotonic() - t0 < 30
    assert not list(tmp_path.glob("distmm-scheduler-*"))


@pytest.mark.mpi
def test_slurm_mpi_job(tmp_path, batch_env):
    a, b = _operands(tmp_path, seed=1)
    status, job, log = _submit(batch_env, tmp_path, "sbatch", "--wait", "--nodes=1",
                               "--ntasks-per-node=2", str(DEPLOY / "slurm" / "mpi.sbatch"),
                               "a.npy", "b.npy", "-o", "c.npy")
    assert status == 0, log
    assert "2 ranks" in log and "wrote c.npy" in log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert _state(batch_env, job)["left_running"] == []


@pytest.mark.mpi
def test_slurm_mpi_job_takes_matmul_args_with_its_operands(tmp_path, batch_env):
    """DISTMM_A/B/C with DISTMM_MATMUL_ARGS (deploy/README.md's knobs: dask and mpi): the
    options reach distmm matmul (mpi.sbatch dropped them, and --profile wrote nothing)."""
    a, b = _operands(tmp_path, seed=15)
    env = {**batch_env, "DISTMM_A": "a.npy", "DISTMM_B": "b.npy", "DISTMM_C": "c.npy",
           "DISTMM_MATMUL_ARGS": "--profile p.json"}
    status, job, log = _submit(env, tmp_path, "sbatch", "--wait", "--nodes=1",
                               "--ntasks-per-node=1", str(DEPLOY / "slurm" / "mpi.sbatch"))
    assert status == 0, log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert len(json.loads((tmp_path / "p.json").read_text())["ranks"]) == 1, log


def _logged(folder: Path) -> int:
    return sum(len(p.read_text().split()) for p in folder.glob(".c.npy.distmm-partial-*.done-*"))


def _when_stripes_logged(folder: Path, stripes: int, then, timeout=120):
    """Call ``then()`` once ``stripes`` stripes of ``folder``'s staged output are logged."""
    deadline = time.time() + timeout
    while _logged(folder) < stripes:
        if time.time() > deadline:
            pytest.fail(f"fewer than {stripes} stripes logged in {timeout} s")
        time.sleep(0.01)
    then()


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_mpi_job_that_finished_despite_the_time_limit_is_not_requeued(tmp_path, batch_env):
    """The time-limit signal came, but the run finished (status 0: here its launcher ignores
    SIGTERM, as a run past its commit does): C is in place, so the job ends with 0 and is not
    requeued (a requeued --resume would fail on the C that exists)."""
    a, b = _operands(tmp_path, 300, 700, 200, seed=13)
    launcher = tmp_path / "ignores-term"
    launcher.write_text("#!/bin/bash\ntrap '' TERM\n\"$@\" &\nwait $!\n")  # srun: TERM not passed
    launcher.chmod(0o755)
    trigger = tmp_path / "time-limit"
    env = {**batch_env, "BATCHSIM_SIGNAL_ON": str(trigger), "DISTMM_BATCH_STRIPE_PAUSE": "0.2",
           "DISTMM_LAUNCHER": f"{launcher} srun --kill-on-bad-exit=1"}
    job = subprocess.Popen(["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2",
                            str(DEPLOY / "slurm" / "mpi.sbatch"), "a.npy", "b.npy", "-o",
                            "c.npy"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path)
    _when_stripes_logged(tmp_path, 1, trigger.touch)
    out, err = job.communicate(timeout=180)
    job_id = out.split()[-1]
    log = (tmp_path / f"distmm-mpi-{job_id}.out").read_text()
    assert job.returncode == 0, log + err
    assert "finished before the time-limit signal stopped it; not requeued" in log, log
    assert "requeueing" not in log and _state(env, job_id)["restarts"] == 0
    assert_close(np.load(tmp_path / "c.npy"), a @ b)


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_mpi_job_requeues_at_its_time_limit_and_resumes(tmp_path, batch_env):
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir()
    part.mkdir()
    _operands(full, 600, 1500, 500, seed=11)
    for name in ("a.npy", "b.npy"):
        (part / name).write_bytes((full / name).read_bytes())
        st = (full / name).stat()
        os.utime(part / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    trigger = tmp_path / "time-limit"
    env = {**batch_env, "DISTMM_BATCH_STRIPES": "24", "BATCHSIM_SIGNAL_ON": str(trigger)}
    argv = ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2",
            str(DEPLOY / "slurm" / "mpi.sbatch"), "a.npy", "b.npy", "-o", "c.npy",
            "--backend", "numba"]
    status, _, log = _submit(env, full, *argv)  # uninterrupted: the trigger never appears
    assert status == 0, log
    assert "requeue" not in log
    env["DISTMM_BATCH_STRIPE_PAUSE"] = "0.1"
    job = subprocess.Popen([*argv, "--profile", "p.json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=part)
    _when_stripes_logged(part, 6, trigger.touch)
    out, err = job.communicate(timeout=180)
    job_id = out.split()[-1]
    log = (part / f"distmm-mpi-{job_id}.out").read_text()
    assert job.returncode == 0, log + err
    assert "stopped before the time limit" in log and "requeueing to resume" in log
    assert "run 2," in log
    state = _state(env, job_id)
    assert state["restarts"] == 1 and state["left_running"] == []
    # the requeued run computed only what the first had not written
    written = sum(r["bytes"].get("write", 0)
                  for r in json.loads((part / "p.json").read_text())["ranks"])
    assert 0 < written < 600 * 500 * 8
    assert np.load(part / "c.npy").tobytes() == np.load(full / "c.npy").tobytes()
    assert not list(part.glob(".c.npy.*"))


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_dask_mpi_job(tmp_path, batch_env):
    a, b = _operands(tmp_path, seed=2)
    env = {**batch_env, "DISTMM_PROGRAM": str(PROGRAM), "DISTMM_GPUS_PER_NODE": "0"}
    status, job, log = _submit(env, tmp_path, "sbatch", "--wait", "--ntasks=4",
                               str(DEPLOY / "slurm" / "dask-mpi.sbatch"), "a.npy", "b.npy",
                               "-o", "c.npy")
    assert status == 0, log
    assert "on 2 dask-mpi workers" in log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert _state(env, job)["left_running"] == []


# -- dask-mpi under mpiexec -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.mpi
def test_dask_mpi_program_under_mpiexec(tmp_path, mpirun):
    a, b = _operands(tmp_path, 53, 61, 29, seed=3)
    r = mpirun(4, PROGRAM, "a.npy", "b.npy", "-o", "c.npy", cwd=tmp_path,
               env={"DISTMM_GPUS_PER_NODE": "0", "DISTMM_DASHBOARD": ":0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote c.npy: shape (53, 29) on 2 dask-mpi workers" in r.stdout
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.npy"]


@pytest.mark.mpi
def test_dask_mpi_gpu_workers_take_one_gpu_each(tmp_path, mpirun):
    """On a node of 2 GPUs, 6 ranks: the scheduler and the client take none, the 4 workers
    GPUs 0, 1, 0, 1 as dask_cuda.CUDAWorkers (the choice alone: no worker is started)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(DEPLOY)!r})\n"
        "from mpi4py import MPI\n"
        "from dask_mpi_matmul import worker_setup\n"
        "cls, options = worker_setup(MPI.COMM_WORLD)\n"
        "row = [MPI.COMM_WORLD.rank, cls, os.environ.get('CUDA_VISIBLE_DEVICES'), options]\n"
        "rows = MPI.COMM_WORLD.gather(row)\n"
        "if MPI.COMM_WORLD.rank == 0:\n"
        "    print(json.dumps(rows))\n")
    r = mpirun(6, probe, env={"DISTMM_GPUS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    cpu = ["distributed.Worker", "", {"resources": {}}]
    gpu = lambda d: ["dask_cuda.CUDAWorker", d, {"resources": "GPU=1"}]  # noqa: E731
    assert [row[1:] for row in rows] == [cpu, cpu, gpu("0"), gpu("1"), gpu("0"), gpu("1")]


@pytest.mark.slow
@pytest.mark.mpi
def test_dask_mpi_program_bad_input_is_one_line(tmp_path, mpirun):
    _operands(tmp_path, 10, 11, 12)
    np.save(tmp_path / "b.npy", np.ones((5, 3)))
    r = mpirun(3, PROGRAM, "a.npy", "b.npy", "-o", "c.npy", cwd=tmp_path,
               env={"DISTMM_GPUS_PER_NODE": "0", "DISTMM_DASHBOARD": ":0"})
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("dask_mpi_matmul.py: error")]
    assert lines == ["dask_mpi_matmul.py: error: a.npy has shape (10, 11), b.npy has shape "
                     "(5, 3): not two matrices that multiply"], r.stderr[-3000:]
    assert not (tmp_path / "c.npy").exists()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("whom", ["launcher", "every-process"])
def test_dask_mpi_program_stopped_mid_product_leaves_no_staged_output(tmp_path, mpiexec,
                                                                      mpi_env, whom):
    """SIGTERM mid-product, to ``mpiexec`` alone (which passes it on, then kills its ranks a
    quarter of a second later) or to every process of the job (Slurm's ``scancel`` and time
    limit): the client's staged output is removed (the rank died by SIGTERM's default
    action and left it), and C is not written."""
    # a product that no machine finishes in the quarter second before the signal (15 s on
    # one worker here; 1600 x 4000 x 1600 once finished in CI first, 2400 x 6000 x 2400 took
    # 3.7 s here): sparse files of zeros, made at once (their values are not checked)
    for name, shape in (("a.npy", (3200, 12000)), ("b.npy", (12000, 3200))):
        np.lib.format.open_memmap(tmp_path / name, mode="w+", dtype="f8", shape=shape)
    proc = subprocess.Popen([mpiexec, "-n", "3", "--oversubscribe", sys.executable, str(PROGRAM),
                             "a.npy", "b.npy", "-o", "c.npy"], cwd=tmp_path,
                            env={**mpi_env, "DISTMM_GPUS_PER_NODE": "0", "DISTMM_DASHBOARD": ":0"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".c.npy.dask-mpi-partial-*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.25)  # the product runs
        assert proc.poll() is None, proc.communicate()
        if whom == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    time.sleep(1)  # a rank the launcher left behind would still be cleaning up
    assert proc.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


# -- PBS ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pbs_dask_job(tmp_path, batch_env):
    a, b = _operands(tmp_path, seed=4)
    status, job, log = _qsub(batch_env, tmp_path, "dask.pbs", "1:ncpus=2",
                             DISTMM_ENV_SETUP=batch_env["DISTMM_ENV_SETUP"],
                             DISTMM_A=tmp_path / "a.npy", DISTMM_B=tmp_path / "b.npy",
                             DISTMM_C=tmp_path / "c.npy", DISTMM_GPUS_PER_NODE=0,
                             DISTMM_WORKERS_PER_NODE=2, DISTMM_DASHBOARD=":0")
    assert status == 0, log
    assert "dask.pbs: 2 workers ready" in log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert _state(batch_env, job)["left_running"] == []
    assert not list(tmp_path.glob("distmm-scheduler-*"))  # scheduler and node script removed


@pytest.mark.mpi
def test_pbs_mpi_job(tmp_path, batch_env):
    a, b = _operands(tmp_path, seed=5)
    status, job, log = _qsub(batch_env, tmp_path, "mpi.pbs", "1:ncpus=2:mpiprocs=2",
                             DISTMM_ENV_SETUP=batch_env["DISTMM_ENV_SETUP"],
                             DISTMM_A=tmp_path / "a.npy", DISTMM_B=tmp_path / "b.npy",
                             DISTMM_C=tmp_path / "c.npy")
    assert status == 0, log
    assert "2 ranks" in log and "grid 2x1" in log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert _state(batch_env, job)["left_running"] == []


def test_pbs_mpi_job_that_finished_despite_its_walltime_timer_is_not_resubmitted(tmp_path,
                                                                               batch_env):
    """The script's walltime timer fired (SIGUSR1), but the run finished (status 0: here the
    launcher ignores the SIGTERM passed on, as a run past its commit does): C is in place, so
    the job ends with 0 and resubmits nothing (a resubmitted --resume would fail on the C
    that exists), as mpi.sbatch does not requeue."""
    a, b = _operands(tmp_path, seed=14)
    launcher = tmp_path / "timer-fires"  # the timer's SIGUSR1 to the batch shell, TERM ignored
    launcher.write_text("#!/bin/bash\ntrap '' TERM\nkill -USR1 $PPID\nsleep 0.5\n"
                        "exec \"$@\"\n")
    launcher.chmod(0o755)
    status, job, log = _qsub(batch_env, tmp_path, "mpi.pbs", "1:ncpus=1:mpiprocs=1",
                             DISTMM_ENV_SETUP=batch_env["DISTMM_ENV_SETUP"],
                             DISTMM_LAUNCHER=launcher, DISTMM_A=tmp_path / "a.npy",
                             DISTMM_B=tmp_path / "b.npy", DISTMM_C=tmp_path / "c.npy")
    assert status == 0, log
    assert "finished before the walltime timer stopped it; not resubmitted" in log, log
    assert "resubmitting" not in log
    assert len(list(Path(batch_env["BATCHSIM_SPOOL"]).iterdir())) == 1  # no second job
    assert_close(np.load(tmp_path / "c.npy"), a @ b)


@pytest.mark.slow
@pytest.mark.mpi
def test_pbs_mpi_job_resubmits_before_its_walltime_and_resumes(tmp_path, batch_env, mpirun):
    a, b = _operands(tmp_path, 600, 1500, 500, seed=12)
    env = batch_env
    # the site's copy of the script, its #PBS lines edited: 2 ranks on one node
    script = tmp_path / "mpi.pbs"
    script.write_text((DEPLOY / "pbs" / "mpi.pbs").read_text().replace(
        "#PBS -l select=2:ncpus=16:ngpus=4:mpiprocs=4", "#PBS -l select=1:ncpus=2:mpiprocs=2"))
    variables = dict(DISTMM_ENV_SETUP=env["DISTMM_ENV_SETUP"], DISTMM_A=tmp_path / "a.npy",
                     DISTMM_B=tmp_path / "b.npy", DISTMM_C=tmp_path / "c.npy",
                     DISTMM_MATMUL_ARGS="--backend numba --profile p.json",
                     DISTMM_JOB_SCRIPT=script,
                     DISTMM_BATCH_STRIPES=24, DISTMM_BATCH_STRIPE_PAUSE=0.1)
    argv = ["qsub", "-W", "block=true", "-v",
            ",".join(f"{k}={v}" for k, v in variables.items()), str(script)]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path)
    spool = Path(env["BATCHSIM_SPOOL"])

    def walltime_timer_fires():  # what the script's own timer sends, DISTMM_STOP_MARGIN early
        first = min(spool.iterdir(), key=lambda p: int(p.name))
        os.kill(json.loads((first / "state.json").read_text())["pid"], signal.SIGUSR1)

    _when_stripes_logged(tmp_path, 6, walltime_timer_fires)
    out, err = job.communicate(timeout=180)
    first_id = out.split()[-1]
    log = (tmp_path / f"distmm-mpi.o{first_id.split('.')[0]}").read_text()
    assert "resubmitting" in log, log + err
    # the ranks mpiexec started got the SIGTERM, not mpiexec: their line reached the log
    assert KEPT in log and "C stripes kept in" in log, log
    # the resubmitted job: the next id, which finishes the product
    second = str(int(first_id.split(".")[0]) + 1)
    deadline = time.time() + 180
    while _state(env, second).get("state") != "F":
        assert time.time() < deadline, "the resubmitted job did not finish"
        time.sleep(0.1)
    log2 = (tmp_path / f"distmm-mpi.o{second}").read_text()
    assert _state(env, second)["exit_code"] == 0, log2
    assert "run 2, 2 ranks" in log2 and "wrote" in log2
    assert _state(env, first_id)["left_running"] == _state(env, second)["left_running"] == []
    assert not list(tmp_path.glob(".c.npy.*"))
    written = sum(r["bytes"].get("write", 0)
                  for r in json.loads((tmp_path / "p.json").read_text())["ranks"])
    assert 0 < written < 600 * 500 * 8  # the second job computed only what was missing
    # bitwise equal to an uninterrupted run of the same ranks and stripes
    ref = mpirun(2, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "ref.npy", "--backend",
                 "numba", cwd=tmp_path, env={"DISTMM_BATCH_STRIPES": "24", "NUMBA_NUM_THREADS": "1"})
    assert ref.returncode == 0, ref.stderr
    assert np.load(tmp_path / "c.npy").tobytes() == np.load(tmp_path / "ref.npy").tobytes()
    assert_close(np.load(tmp_path / "c.npy"), a @ b)


@pytest.mark.slow
@pytest.mark.mpi
def test_pbs_dask_mpi_job(tmp_path, batch_env):
    a, b = _operands(tmp_path, seed=6)
    status, job, log = _qsub(batch_env, tmp_path, "dask-mpi.pbs", "1:ncpus=2:mpiprocs=4",
                             DISTMM_ENV_SETUP=batch_env["DISTMM_ENV_SETUP"],
                             DISTMM_PROGRAM=PROGRAM, DISTMM_A=tmp_path / "a.npy",
                             DISTMM_B=tmp_path / "b.npy", DISTMM_C=tmp_path / "c.npy",
                             DISTMM_GPUS_PER_NODE=0, DISTMM_DASHBOARD=":0")
    assert status == 0, log
    assert "on 2 dask-mpi workers" in log
    assert_close(np.load(tmp_path / "c.npy"), a @ b)
    assert _state(batch_env, job)["left_running"] == []


# -- jobqueue_cluster -----------------------------------------------------------------------

@pytest.fixture
def quiet_scheduler():
    return {"scheduler_options": {"dashboard_address": ":0"}}


@pytest.mark.parametrize("system,gpus,cores,want", [
    ("slurm", 4, 32, ["#SBATCH --gres=gpu:4", "#SBATCH --cpus-per-task=32", "#SBATCH --mem=256G",
                      "-m dask cuda worker", "--nthreads 8", "--memory-limit 64.00GiB",
                      "--resources GPU=1"]),
    ("pbs", 4, None, ["#PBS -l select=1:ncpus=4:ngpus=4:mem=256GB", "-m dask cuda worker",
                      "--nthreads 1", "--resources GPU=1"]),
    ("slurm", 0, 8, ["#SBATCH --cpus-per-task=8", "-m distributed.cli.dask_worker",
                     "--nworkers 8", "--nthreads 1", "--memory-limit 32.00GiB"]),
    ("pbs", 0, 8, ["#PBS -l select=1:ncpus=8:mem=256GB", "--nworkers 8", "--nthreads 1"]),
], ids=["slurm-gpu", "pbs-gpu", "slurm-cpu", "pbs-cpu"])
def test_job_scripts(tmp_path, quiet_scheduler, system, gpus, cores, want):
    pytest.importorskip("dask_jobqueue")
    from distmm.deploy import jobqueue_cluster

    with jobqueue_cluster(system, gpus=gpus, cores=cores, memory="256GiB", walltime="02:00:00",
                          env_setup="/opt/site/env with space.sh", **quiet_scheduler) as cl:
        script = cl.job_script()
    path = tmp_path / "job.sh"
    path.write_text(script)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # every worker imports the Dask engine's task modules as it starts
    for piece in want + ["source '/opt/site/env with space.sh'",
                         "--preload distmm.engine.dask.preload"]:
        assert piece in script, (piece, script)
    assert ("gpu" in script.lower()) == bool(gpus)
    assert ("cuda" in script) == bool(gpus)
    walltime = "#SBATCH -t 02:00:00" if system == "slurm" else "#PBS -l walltime=02:00:00"
    assert walltime in script


@pytest.mark.parametrize("kwargs,message", [
    (dict(system="lsf", cores=1, memory="1GiB"), "system must be one of"),
    (dict(cores=4), "memory="),
    (dict(memory="1GiB"), "cores= (the cores of one job) is required"),
    (dict(gpus=4, cores=2, memory="1GiB"), "fewer than gpus=4"),
    (dict(gpus=-1, memory="1GiB"), "gpus must be a non-negative integer"),
    (dict(jobs=1.5, cores=1, memory="1GiB"), "jobs must be a non-negative integer"),
])
def test_bad_arguments_fail_before_submitting(kwargs, message):
    from distmm.deploy import jobqueue_cluster

    with pytest.raises(ValueError) as info:
        jobqueue_cluster(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs,message", [
    (dict(threads_per_worker=2.5), "threads_per_worker must be a positive integer, got 2.5"),
    (dict(threads_per_worker="2"), "threads_per_worker must be a positive integer, got '2'"),
    (dict(threads_per_worker=True), "threads_per_worker must be a positive integer, got True"),
    (dict(threads_per_worker=0), "threads_per_worker must be a positive integer, got 0"),
    (dict(threads_per_worker=8), "threads_per_worker=8 is more than cores=4"),
    (dict(cores="4"), "cores must be a positive integer, got '4'"),
    (dict(memory="-5GiB"), "memory must be a positive size such as '64GiB', got '-5GiB'"),
    (dict(memory="lots"), "memory must be a positive size such as '64GiB', got 'lots'"),
    (dict(memory=""), "memory must be a positive size"),
    (dict(memory=0), "memory must be a positive size"),
    (dict(memory=[8]), "memory must be a positive size"),
    # not HH:MM:SS: `#SBATCH -t 2 hours` failed only as the jobs were submitted (dask-jobqueue
    # logs that, and the workers never come); 3600 was minutes to Slurm and seconds to PBS
    (dict(walltime="2 hours"), "walltime must be a positive HH:MM:SS such as '02:00:00', "
                               "got '2 hours'"),
    (dict(walltime=3600), "walltime must be a positive HH:MM:SS such as '02:00:00', got 3600"),
    (dict(walltime=None), "walltime must be a positive HH:MM:SS"),
    (dict(walltime="00:00:00"), "walltime must be a positive HH:MM:SS"),
    (dict(walltime="1:75:00"), "walltime must be a positive HH:MM:SS"),
    # dask-jobqueue's own keywords that replaced the workers made from gpus and cores
    (dict(gpus=2, processes=1), "processes cannot be given: jobqueue_cluster sets them"),
    (dict(worker_command="dask worker"), "worker_command cannot be given"),
], ids=["threads-float", "threads-text", "threads-bool", "threads-zero", "threads-over-cores",
        "cores-text", "memory-negative", "memory-word", "memory-empty", "memory-zero",
        "memory-list", "walltime-words", "walltime-int", "walltime-none", "walltime-zero",
        "walltime-minutes-75", "processes", "worker-command"])
def test_bad_counts_and_memory_fail_before_dask_jobqueue_is_imported(monkeypatch, kwargs,
                                                                    message):
    """The docstring's ValueError for counts that are not positive integers, a memory that
    is no size and a walltime that is not HH:MM:SS, raised before dask-jobqueue is imported
    (here it cannot be)."""
    from distmm.deploy import jobqueue_cluster

    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)  # importing it would fail
    with pytest.raises(ValueError) as info:
        jobqueue_cluster(**{"cores": 4, "memory": "8GiB", **kwargs})
    assert message in str(info.value)


def test_threads_per_worker_up_to_cores(tmp_path, quiet_scheduler):
    pytest.importorskip("dask_jobqueue")
    from distmm.deploy import jobqueue_cluster

    with jobqueue_cluster("slurm", cores=4, memory="8GiB", threads_per_worker=4,
                          **quiet_scheduler) as cl:
        script = cl.job_script()
    assert "--nthreads 4" in script and "--nworkers" not in script  # one worker of 4 threads


def test_missing_dask_jobqueue_names_the_extra(monkeypatch):
    from distmm.deploy import jobqueue_cluster

    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)  # import fails as when absent
    with pytest.raises(ImportError) as info:
        jobqueue_cluster(cores=1, memory="1GiB")
    assert str(info.value) == ('distmm.deploy.jobqueue_cluster needs dask-jobqueue: '
                               'pip install "distmm[deploy]"')


@pytest.mark.parametrize("system", ["slurm", pytest.param("pbs", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_jobqueue_cluster_scales_and_runs_a_product(tmp_path, batch_env, monkeypatch,
                                                    quiet_scheduler, system):
    pytest.importorskip("dask_jobqueue")
    import distributed

    import distmm
    from distmm.deploy import jobqueue_cluster

    for key, value in batch_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((90, 70)), rng.standard_normal((70, 55))
    with jobqueue_cluster(system, jobs=2, cores=1, memory="1GiB",
                          env_setup=batch_env["DISTMM_ENV_SETUP"], **quiet_scheduler) as cl, \
            distributed.Client(cl) as client:
        client.wait_for_workers(2, timeout=60)
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2
        jobs = sorted(p.name for p in Path(batch_env["BATCHSIM_SPOOL"]).iterdir())
        assert len(jobs) == 2  # two batch jobs, a worker each
        got = distmm.matmul(a, b, client=client, engine="dask")
    assert_close(got, a @ b)


# -- mpirun as the launcher, stopped mid-product ---------------------------------------------

def _mpirun_env(batch_env, **more) -> dict:
    """mpiexec as mpi.sbatch's launcher; the stand-ins' Slurm variables are not its
    allocation (Slurm's ras and plm components would take them for one)."""
    return {**batch_env, "DISTMM_LAUNCHER": "mpiexec -n 3", "DISTMM_BATCH_STRIPES": "24",
            "DISTMM_BATCH_STRIPE_PAUSE": "0.1", "PRTE_MCA_ras": "^slurm",
            "PRTE_MCA_plm": "^slurm", **more}


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_time_limit_keeps_the_ranks_line_under_mpirun(tmp_path, batch_env):
    """mpi.sbatch with Open MPI's mpirun as launcher: at the time limit the ranks it started get
    the SIGTERM, not mpirun (prterun, signalled itself, kills them and drops their line), so
    the log has their line and status 143, and the requeued --resume run finishes."""
    a, b = _operands(tmp_path, 301, 403, 297, seed=None)
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


@pytest.mark.slow
@pytest.mark.mpi
def test_slurm_cancel_says_what_became_of_the_run_under_mpirun(tmp_path, batch_env, mpirun):
    """``scancel``: SIGTERM to every process of the job, mpirun included, so the ranks' line
    may be lost; the script's own says the job was terminated and the stripes are kept."""
    a, b = _operands(tmp_path, 301, 403, 297, seed=None)
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
