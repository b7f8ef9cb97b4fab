"""Stand-ins for Slurm's and PBS's commands that run batch jobs on this machine.

This module covers: ``sbatch``, ``srun``, ``scontrol`` (``requeue``, ``show hostnames``),
``squeue``, ``scancel`` (Slurm) and ``qsub``, ``qstat``, ``qdel``, ``pbsdsh`` (PBS), as the
scripts under ``deploy/`` and dask-jobqueue call them. The executables beside this file (one
per command, all ``exec`` this module) go first on ``PATH``; a job then runs for real on
localhost, with the variables the real commands set:

- ``sbatch`` reads the ``#SBATCH`` lines and its own options, copies the script into the
  spool folder (as slurmd does, so a script cannot rely on where it was), prints ``Submitted
  batch job N`` (the number alone with ``--parsable``) and runs it detached, in its own
  session, with ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_NUM_NODES``,
  ``SLURM_NTASKS``, ``SLURM_SUBMIT_DIR``, ``SLURM_RESTART_COUNT`` (after a requeue), ...;
  ``--wait`` waits for the job and exits with its status. ``--signal=[B:]SIG@T`` is sent
  (to the batch shell with ``B:``, to the whole job otherwise) on the job's first run when
  the test says its time limit has come: when the file named by ``BATCHSIM_SIGNAL_ON``
  exists, or ``BATCHSIM_SIGNAL_AFTER`` seconds after the start. ``scontrol requeue`` ends the
  running job (SIGTERM to its session) and runs it again, as Slurm does.
- ``srun`` starts its tasks through this machine's ``mpiexec`` (so an MPI program's ranks
  share one ``MPI.COMM_WORLD``, as they do under a real ``srun``), each task with
  ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_GTIDS``; the ``SLURM_`` variables are hidden from ``mpiexec`` itself so that it
  does not take itself for a launcher inside Slurm. Every node is localhost.
- ``qsub`` reads the ``#PBS`` lines (``-l select=N:ncpus=..:mpiprocs=..:ngpus=..``, or
  Torque's ``nodes=N:ppn=P``; ``-l walltime``, ``-N``, ``-o``, ``-e``, ``-j oe``, ``-v``,
  ``-V``, ``-W block=true``), writes ``PBS_NODEFILE`` (``localhost`` once per MPI process of
  each chunk) and runs the script in the home folder with the small environment PBS gives
  (``PATH`` of the system and of these stand-ins, ``PBS_O_WORKDIR``, ``PBS_JOBID``, ...),
  the submitter's only with ``-V``. ``pbsdsh`` runs a command once per line of the node file
  (``-u``: once per host; ``-n I``: on the host of line I only) with that small environment,
  as PBS's task manager does.

It does *not* cover: resource limits, several hosts, partitions, accounts, job arrays,
dependencies, or any real scheduling (every job starts at once). The spool folder is
``BATCHSIM_SPOOL`` (one folder per job: ``state.json``, the copied script, the node file).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def spool() -> Path:
    path = Path(os.environ.get("BATCHSIM_SPOOL") or "/tmp/batchsim-spool")
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_job_id() -> int:
    for n in range(1000, 100000):
        try:
            (spool() / str(n)).mkdir()
            return n
        except FileExistsError:
            continue
    raise SystemExit("batchsim: no free job id")


def job_dir(job_id: str) -> Path:
    return spool() / str(job_id).split(".")[0]


def read_state(job_id: str) -> dict:
    try:
        return json.loads((job_dir(job_id) / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(job_id: str, **fields) -> None:
    state = {**read_state(job_id), **fields}
    tmp = job_dir(job_id) / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, job_dir(job_id) / "state.json")


def directives(script: Path, prefix: str) -> list[str]:
    """The options of the ``#SBATCH``/``#PBS`` lines before the first command."""
    found: list[str] = []
    for line in script.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith(prefix):
            found += shlex.split(stripped[len(prefix):], comments=True)
        elif stripped and not stripped.startswith("#"):
            break
    return found


def split_options(argv: list[str], takes_value: set[str]) -> tuple[dict, list[str]]:
    """``--name=value``, ``--name value`` (for names in ``takes_value``), ``-x value``,
    ``--flag``; stops at the first argument that is not an option (or after ``--``)."""
    opts: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        if "=" in arg and arg.startswith("--"):
            name, value = arg.split("=", 1)
        elif arg in takes_value:
            name, value = arg, argv[i + 1]
            i += 1
        elif len(arg) > 2 and not arg.startswith("--") and arg[:2] in takes_value:
            name, value = arg[:2], arg[2:]
        else:
            name, value = arg, True
        opts.setdefault(name, []).append(value)
        i += 1
    return opts, argv[i:]


def last(opts: dict, *names, default=None):
    for name in names:
        if name in opts:
            return opts[name][-1]
    return default


def seconds(text: str) -> float:
    """Slurm's ``[D-]HH:MM:SS``/``MM:SS``/``MM`` or PBS's ``HH:MM:SS``."""
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [float(p) for p in text.split(":")]
    if len(parts) == 1:
        parts = [0, parts[0], 0]  # Slurm: minutes
    while len(parts) < 3:
        parts.insert(0, 0)
    return days * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


# -- Slurm ---------------------------------------------------------------------------------

SBATCH_VALUES = {"-N", "--nodes", "-n", "--ntasks", "-c", "--cpus-per-task", "-t", "--time",
                 "-o", "--output", "-e", "--error", "-J", "--job-name", "-p", "--partition",
                 "-A", "--account", "-D", "--chdir", "--ntasks-per-node", "--gres", "--mem",
                 "--signal", "--export", "--open-mode", "--gpus-per-node", "-G", "--gpus",
                 "--qos", "--constraint", "-C", "--mem-per-cpu", "--gpus-per-task"}


def sbatch(argv: list[str]) -> int:
    opts, rest = split_options(argv, SBATCH_VALUES)
    if not rest:
        print("sbatch: error: no script given (this stand-in does not read standard input)",
              file=sys.stderr)
        return 1
    script, script_args = Path(rest[0]).resolve(), rest[1:]
    file_opts, _ = split_options(directives(script, "#SBATCH"), SBATCH_VALUES)
    merged = {**file_opts, **opts}
    job_id = new_job_id()
    folder = job_dir(str(job_id))
    copy = folder / "slurm_script"
    copy.write_text(script.read_text())
    copy.chmod(0o755)
    spec = {"options": merged, "args": script_args, "submit_dir": os.getcwd(),
            "script_name": script.name}
    (folder / "spec.json").write_text(json.dumps(spec))
    write_state(str(job_id), state="PENDING", restarts=0)
    subprocess.Popen([sys.executable, __file__, "_slurm_job", str(job_id)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=open(folder / "supervisor.log", "w"))
    print(job_id if "--parsable" in merged else f"Submitted batch job {job_id}", flush=True)
    if "--wait" in merged or "-W" in merged:
        return wait_for(str(job_id))
    return 0


def wait_for(job_id: str) -> int:
    while True:
        state = read_state(job_id)
        if state.get("state") in ("COMPLETED", "FAILED", "CANCELLED"):
            return int(state.get("exit_code", 1))
        time.sleep(0.05)


def _slurm_env(job_id: str, spec: dict, restarts: int) -> dict:
    o = spec["options"]
    nodes = int(str(last(o, "-N", "--nodes", default=1)).split("-")[0])
    env = dict(os.environ)
    env.update(SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME=str(
        last(o, "-J", "--job-name", default=spec["script_name"])),
        SLURM_SUBMIT_DIR=spec["submit_dir"], SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=",".join(["localhost"] * nodes),
        SLURM_NODELIST=",".join(["localhost"] * nodes), SLURMD_NODENAME="localhost",
        SLURM_CPUS_ON_NODE=str(os.cpu_count()), SLURM_LOCALID="0", SLURM_PROCID="0",
        SLURM_NODEID="0", SLURM_CLUSTER_NAME="batchsim")
    per_node = last(o, "--ntasks-per-node")
    ntasks = last(o, "-n", "--ntasks") or (int(per_node) * nodes if per_node else None)
    if ntasks:
        env["SLURM_NTASKS"] = env["SLURM_NPROCS"] = str(ntasks)
    if per_node:
        env["SLURM_NTASKS_PER_NODE"] = str(per_node)
    if last(o, "-c", "--cpus-per-task"):
        env["SLURM_CPUS_PER_TASK"] = str(last(o, "-c", "--cpus-per-task"))
    if restarts:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_GTIDS"):
        env.pop(name, None)
    return env


def _output_path(pattern: str, job_id: str, name: str, cwd: str) -> Path:
    path = pattern.replace("%j", job_id).replace("%J", job_id).replace("%x", name)
    return Path(cwd, path)


def slurm_job(job_id: str) -> int:
    """The supervisor of one Slurm job: runs the script, sends the ``--signal`` when the
    test's time limit comes, runs it again after ``scontrol requeue``."""
    folder = job_dir(job_id)
    spec = json.loads((folder / "spec.json").read_text())
    o = spec["options"]
    cwd = str(last(o, "-D", "--chdir", default=spec["submit_dir"]))
    name = str(last(o, "-J", "--job-name", default=spec["script_name"]))
    out = _output_path(str(last(o, "-o", "--output", default="slurm-%j.out")), job_id, name, cwd)
    err_pattern = last(o, "-e", "--error")
    restarts = 0
    sig_spec = last(o, "--signal")
    while True:
        env = _slurm_env(job_id, spec, restarts)
        mode = "a" if restarts or last(o, "--open-mode") == "append" else "w"
        stdout = open(out, mode)
        stderr = open(_output_path(str(err_pattern), job_id, name, cwd), mode) if err_pattern \
            else subprocess.STDOUT
        proc = subprocess.Popen([str(folder / "slurm_script"), *spec["args"]], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                start_new_session=True)
        write_state(job_id, state="RUNNING", pid=proc.pid, restarts=restarts)
        started = time.monotonic()
        signalled = restarts > 0 or not sig_spec
        ended = None  # when scancel or scontrol requeue sent SIGTERM (once, as Slurm does)
        while proc.poll() is None:
            if not signalled and _time_limit_reached(started):
                signalled = True
                _send_slurm_signal(str(sig_spec), proc.pid)
            if ended is None and ((folder / "requeue").exists() or (folder / "cancel").exists()):
                ended = time.monotonic()
                _kill_session(proc.pid, signal.SIGTERM)
            if ended is not None and time.monotonic() - ended > KILL_WAIT:
                _kill_session(proc.pid, signal.SIGKILL)
            time.sleep(0.05)
        left = _left_running(proc.pid)
        _kill_session(proc.pid, signal.SIGKILL)  # what the script left running
        stdout.close()
        if (folder / "requeue").exists():
            (folder / "requeue").unlink()
            restarts += 1
            write_state(job_id, state="PENDING", restarts=restarts)
            continue
        cancelled = (folder / "cancel").exists()
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        write_state(job_id, state="CANCELLED" if cancelled else (
            "COMPLETED" if code == 0 else "FAILED"), exit_code=code, restarts=restarts,
            left_running=left)
        return 0


#: seconds between SIGTERM and SIGKILL when a job is cancelled or requeued (Slurm's KillWait)
KILL_WAIT = 30


def _time_limit_reached(started: float) -> bool:
    trigger = os.environ.get("BATCHSIM_SIGNAL_ON")
    if trigger and Path(trigger).exists():
        return True
    after = os.environ.get("BATCHSIM_SIGNAL_AFTER")
    return bool(after) and time.monotonic() - started >= float(after)


def _signal_number(name: str) -> int:
    name = name.upper()
    if name.isdigit():
        return int(name)
    return int(getattr(signal, name if name.startswith("SIG") else "SIG" + name))


def _send_slurm_signal(spec: str, shell_pid: int) -> None:
    batch_only = spec.startswith("B:")
    signum = _signal_number(spec.removeprefix("B:").split("@")[0])
    if batch_only:
        os.kill(shell_pid, signum)
    else:  # every step: the processes of the job other than the batch shell
        for pid in _session_pids(shell_pid):
            if pid != shell_pid:
                os.kill(pid, signum)


def _session_pids(leader: int) -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == leader:
                pids.append(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def _left_running(leader: int) -> list[str]:
    """The command lines of the job's processes still running after its script ended
    (given a moment to finish exiting), for ``state.json``'s ``left_running``."""
    import psutil

    deadline = time.monotonic() + 10  # returns once none is left: a loaded machine's slack
    while True:
        left = []
        for pid in _session_pids(leader):
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(" ".join(proc.cmdline()))
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _kill_session(leader: int, signum: int) -> None:
    for pid in _session_pids(leader):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


SRUN_VALUES = {"-N", "--nodes", "-n", "--ntasks", "-c", "--cpus-per-task", "--ntasks-per-node",
               "--gres", "--gpus-per-task", "--gpus-per-node", "--export", "--mpi", "--cpu-bind",
               "--gpu-bind", "-J", "--job-name", "--mem", "-t", "--time", "-o", "--output",
               "-w", "--nodelist", "--distribution", "-m"}


def srun(argv: list[str]) -> int:
    opts, command = split_options(argv, SRUN_VALUES)
    if not command:
        print("srun: error: no command given", file=sys.stderr)
        return 1
    env = dict(os.environ)
    job_nodes = int(env.get("SLURM_JOB_NUM_NODES", "1"))
    nodes = int(str(last(opts, "-N", "--nodes", default=job_nodes)).split("-")[0])
    per_node = last(opts, "--ntasks-per-node")
    ntasks = last(opts, "-n", "--ntasks")
    if ntasks is None:
        if per_node is not None:
            ntasks = int(per_node) * nodes
        elif "-N" in opts or "--nodes" in opts or "SLURM_NTASKS" not in env:
            ntasks = nodes
        else:
            ntasks = int(env["SLURM_NTASKS"])
    ntasks = int(ntasks)
    per_node = int(per_node) if per_node else -(-ntasks // nodes)
    step = {"SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks),
            "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_ID": str(os.getpid()),
            "SLURM_STEPID": str(os.getpid()), "SLURM_TASKS_PER_NODE": str(per_node)}
    slurm = {k: v for k, v in env.items() if k.startswith("SLURM")}
    slurm.update(step)
    base = {k: v for k, v in env.items() if not k.startswith("SLURM")}
    base["BATCHSIM_TASK_ENV"] = json.dumps({"vars": slurm, "per_node": per_node})
    mpiexec = os.environ.get("BATCHSIM_MPIEXEC", "mpiexec")
    cmd = [mpiexec, "-n", str(ntasks), "--oversubscribe", sys.executable, __file__, "_task",
           *command]
    os.execvpe(cmd[0], cmd, base)


def task(command: list[str]) -> int:
    """One task of ``srun``: its Slurm variables from its rank, then the command."""
    spec = json.loads(os.environ.pop("BATCHSIM_TASK_ENV"))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or 0)
    per_node = spec["per_node"]
    node = rank // per_node
    ntasks = int(spec["vars"]["SLURM_STEP_NUM_TASKS"])
    gtids = range(node * per_node, min(ntasks, (node + 1) * per_node))
    os.environ.update(spec["vars"])
    os.environ.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
                      SLURM_NODEID=str(node), SLURM_GTIDS=",".join(map(str, gtids)))
    os.execvp(command[0], command)


def scontrol(argv: list[str]) -> int:
    if argv[:1] == ["requeue"] and len(argv) > 1:
        for job in argv[1].split(","):
            if not job_dir(job).is_dir():
                print(f"scontrol: error: Invalid job id specified for job {job}", file=sys.stderr)
                return 1
            (job_dir(job) / "requeue").touch()
        return 0
    if argv[:2] == ["show", "hostnames"]:
        names = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "localhost")
        print("\n".join(names.split(",")))
        return 0
    print(f"scontrol: this stand-in does not do {' '.join(argv)}", file=sys.stderr)
    return 1


def squeue(argv: list[str]) -> int:
    opts, _ = split_options(argv, {"-j", "--jobs", "-o", "--format", "-u", "--user", "-O"})
    wanted = str(last(opts, "-j", "--jobs", default="")).split(",")
    if "-h" not in opts and "--noheader" not in opts:
        print("JOBID STATE")
    for folder in sorted(spool().iterdir(), key=lambda p: p.name):
        state = read_state(folder.name)
        if state.get("state") in ("PENDING", "RUNNING") and (wanted == [""] or folder.name in wanted):
            print(f"{folder.name} {state['state']}")
    return 0


def scancel(argv: list[str]) -> int:
    opts, jobs = split_options(argv, {"-s", "--signal", "-u", "--user"})
    sig = last(opts, "-s", "--signal")
    for job in jobs:
        state = read_state(job)
        if sig is not None:
            if state.get("pid"):
                _kill_session(state["pid"], _signal_number(str(sig)))
            continue
        if job_dir(job).is_dir():
            (job_dir(job) / "cancel").touch()
            (job_dir(job) / "requeue").unlink(missing_ok=True)
    return 0


# -- PBS -----------------------------------------------------------------------------------

QSUB_VALUES = {"-N", "-l", "-o", "-e", "-j", "-v", "-W", "-q", "-A", "-r", "-m", "-M", "-S",
               "-P", "-J"}
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def _chunks(resources: list[str]) -> list[tuple[int, int]]:
    """(chunks, MPI processes per chunk) from ``select=`` or Torque's ``nodes=``."""
    for item in resources:
        for part in item.split(","):
            if part.startswith("select="):
                chunks = []
                for spec in part.removeprefix("select=").split("+"):
                    count, _, rest = spec.partition(":")
                    fields = dict(f.split("=", 1) for f in rest.split(":") if "=" in f)
                    chunks.append((int(count), int(fields.get("mpiprocs", 1))))
                return chunks
            if part.startswith("nodes="):
                count, _, rest = part.removeprefix("nodes=").partition(":")
                fields = dict(f.split("=", 1) for f in rest.split(":") if "=" in f)
                return [(int(count), int(fields.get("ppn", 1)))]
    return [(1, 1)]


def qsub(argv: list[str]) -> int:
    opts, rest = split_options(argv, QSUB_VALUES)
    if not rest:
        print("qsub: this stand-in needs a script file", file=sys.stderr)
        return 1
    script = Path(rest[0]).resolve()
    file_opts, _ = split_options(directives(script, "#PBS"), QSUB_VALUES)
    merged = {**file_opts, **opts}
    limits: dict = {}  # a resource given on the command line replaces the script's
    for item in file_opts.get("-l", []) + opts.get("-l", []):
        for part in str(item).split(","):
            key, _, value = part.partition("=")
            limits[key] = value
    merged["-l"] = [f"{k}={v}" for k, v in limits.items()]
    merged["-v"] = file_opts.get("-v", []) + opts.get("-v", [])
    job_id = new_job_id()
    folder = job_dir(str(job_id))
    copy = folder / "job.sh"
    copy.write_text(script.read_text())
    copy.chmod(0o755)
    resources = [str(x) for x in merged.get("-l", [])]
    nodefile = folder / "nodefile"
    lines = []
    for count, procs in _chunks(resources):
        lines += ["localhost"] * (count * procs)
    nodefile.write_text("\n".join(lines) + "\n")
    full_id = f"{job_id}.batchsim"
    name = str(last(merged, "-N", default=script.name))
    env = {"HOME": os.environ.get("HOME", "/root"), "USER": os.environ.get("USER", "root"),
           "PATH": f"{HERE}:{SYSTEM_PATH}", "SHELL": "/bin/bash", "LANG": "C.UTF-8",
           "PBS_JOBID": full_id, "PBS_JOBNAME": name, "PBS_NODEFILE": str(nodefile),
           "PBS_O_WORKDIR": os.getcwd(), "PBS_O_HOME": os.environ.get("HOME", "/root"),
           "PBS_O_PATH": os.environ.get("PATH", ""), "PBS_O_HOST": "localhost",
           "PBS_ENVIRONMENT": "PBS_BATCH", "PBS_QUEUE": str(last(merged, "-q", default="workq")),
           "NCPUS": str(os.cpu_count()), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    env.update({k: v for k, v in os.environ.items() if k.startswith("BATCHSIM_")})
    if "-V" in merged:
        env = {**os.environ, **env}
    for item in merged.get("-v", []):
        for pair in str(item).split(","):
            key, _, value = pair.partition("=")
            env[key] = value if _ else os.environ.get(key, "")
    walltime = None
    for item in resources:
        for part in item.split(","):
            if part.startswith("walltime="):
                walltime = part.removeprefix("walltime=")
    join = str(last(merged, "-j", default="n"))
    wd = os.getcwd()
    spec = {"env": env, "out": str(Path(wd, str(last(merged, "-o", default=f"{name}.o{job_id}")))),
            "err": None if join == "oe" else str(Path(wd, str(last(merged, "-e",
                                                                  default=f"{name}.e{job_id}")))),
            "walltime": walltime, "name": name}
    (folder / "spec.json").write_text(json.dumps(spec))
    write_state(str(job_id), state="Q")
    subprocess.Popen([sys.executable, __file__, "_pbs_job", str(job_id)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=open(folder / "supervisor.log", "w"))
    print(full_id, flush=True)
    if any(str(w) == "block=true" for w in merged.get("-W", [])):
        while read_state(str(job_id)).get("state") != "F":
            time.sleep(0.05)
        return int(read_state(str(job_id)).get("exit_code", 1))
    return 0


def pbs_job(job_id: str) -> int:
    """The supervisor of one PBS job: runs the script in the home folder, SIGTERM to the
    job at its walltime (then SIGKILL 10 s later) or on ``qdel``."""
    folder = job_dir(job_id)
    spec = json.loads((folder / "spec.json").read_text())
    stdout = open(spec["out"], "w")
    stderr = open(spec["err"], "w") if spec["err"] else subprocess.STDOUT
    proc = subprocess.Popen(["/bin/bash", str(folder / "job.sh")], cwd=spec["env"]["HOME"],
                            env=spec["env"], stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=stderr, start_new_session=True)
    write_state(job_id, state="R", pid=proc.pid)
    started = time.monotonic()
    limit = seconds(spec["walltime"]) if spec["walltime"] else None
    termed = None
    while proc.poll() is None:
        over = limit is not None and time.monotonic() - started >= limit
        if termed is None and (over or (folder / "cancel").exists()):
            termed = time.monotonic()
            _kill_session(proc.pid, signal.SIGTERM)
        if termed is not None and time.monotonic() - termed > 10:
            _kill_session(proc.pid, signal.SIGKILL)
        time.sleep(0.05)
    left = _left_running(proc.pid)
    _kill_session(proc.pid, signal.SIGKILL)
    code = proc.returncode if proc.returncode >= 0 else 256 - proc.returncode
    write_state(job_id, state="F", exit_code=code, left_running=left)
    return 0


def qstat(argv: list[str]) -> int:
    opts, jobs = split_options(argv, {"-u"})
    if "-f" in opts:
        for job in jobs:
            state = read_state(job)
            if not state:
                print(f"qstat: Unknown Job Id {job}", file=sys.stderr)
                return 153
            spec = json.loads((job_dir(job) / "spec.json").read_text())
            print(f"Job Id: {job}\n    Job_Name = {spec['name']}\n    job_state = "
                  f"{state['state']}")
            if spec["walltime"]:
                print(f"    Resource_List.walltime = {spec['walltime']}")
            if "exit_code" in state:
                print(f"    Exit_status = {state['exit_code']}")
        return 0
    print("Job id            Name             User              Time Use S Queue")
    for folder in sorted(spool().iterdir(), key=lambda p: p.name):
        state = read_state(folder.name)
        if state.get("state") in ("Q", "R") and (not jobs or folder.name in
                                                 [j.split(".")[0] for j in jobs]):
            print(f"{folder.name}.batchsim  job  user  0 {state['state']} workq")
    return 0


def qdel(argv: list[str]) -> int:
    for job in argv:
        if job.startswith("-"):
            continue
        if job_dir(job).is_dir():
            (job_dir(job) / "cancel").touch()
    return 0


def pbsdsh(argv: list[str]) -> int:
    opts, command = split_options(argv, {"-c", "-n"})
    nodefile = os.environ.get("PBS_NODEFILE")
    if not nodefile or not command:
        print("pbsdsh: not in a PBS job, or no command", file=sys.stderr)
        return 1
    lines = Path(nodefile).read_text().split()
    nodes = list(enumerate(lines))  # (index in the node file, host)
    if "-u" in opts:  # Torque: once per host
        nodes = [(i, h) for i, h in nodes if lines.index(h) == i]
    index = last(opts, "-n")
    if index is not None:  # the node of that line of the node file only
        if not 0 <= int(index) < len(lines):
            print(f"pbsdsh: no node {index}", file=sys.stderr)
            return 1
        nodes = [(int(index), lines[int(index)])]
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("PBS_", "BATCHSIM_")) or k in ("HOME", "USER", "LANG", "TMPDIR")}
    env["PATH"] = f"{HERE}:{SYSTEM_PATH}"
    procs = []
    for task, (i, _) in enumerate(nodes):
        procs.append(subprocess.Popen(command, env={**env, "PBS_TASKNUM": str(task),
                                                    "PBS_NODENUM": str(i), "PBS_VNODENUM": str(i)}))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0) and 1


COMMANDS = {"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "squeue": squeue,
            "scancel": scancel, "qsub": qsub, "qstat": qstat, "qdel": qdel, "pbsdsh": pbsdsh,
            "_task": task, "_slurm_job": lambda a: slurm_job(a[0]),
            "_pbs_job": lambda a: pbs_job(a[0])}

if __name__ == "__main__":
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
