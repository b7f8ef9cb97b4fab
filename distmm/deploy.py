"""Dask clusters whose workers are batch jobs: ``jobqueue_cluster`` on Slurm or PBS.

This module covers: building a ``dask_jobqueue.SLURMCluster`` or ``PBSCluster`` whose jobs
are distmm workers, with resources that follow from what one job holds: on GPU nodes one
``dask cuda worker`` process per job starting one Dask worker per GPU (each with the
``GPU=1`` resource the Dask engine recognises GPU workers by, and the preload that imports
the engine's task modules), the GPUs asked for with
``--gres=gpu:N`` (Slurm) or ``ngpus=N`` (PBS); on CPU nodes single-thread worker processes,
one per core (numba and BLAS tiles of different workers then do not compete for cores); and
scaling it to a number of jobs.

It does *not* cover: the batch scripts that start a whole cluster, or an MPI job, from inside
one allocation (``deploy/slurm/``, ``deploy/pbs/``), or running a product (``distmm.matmul``
with a ``distributed.Client`` of the cluster). dask-jobqueue is imported when the function
runs: it comes with ``pip install "distmm[deploy]"``.
"""
from __future__ import annotations

__all__ = ["jobqueue_cluster", "SYSTEMS", "MIN_WORKER_MEMORY"]

#: batch systems ``jobqueue_cluster`` knows, by the name it takes
SYSTEMS = ("slurm", "pbs")

#: the worker command of a GPU job, which dask-jobqueue runs as ``python -m dask cuda worker``:
#: dask-cuda's worker command through dask's own command line (one worker per GPU, named
#: ``NAME-0``, ``NAME-1``, ... as dask-jobqueue expects of a job of several processes)
GPU_WORKER_COMMAND = "dask cuda worker"

#: the least host memory a Dask worker process is given: one holds about 100 MB once started,
#: and a nanny restarts a worker above its limit without end
MIN_WORKER_MEMORY = 256 * 2**20

#: the preload every worker job runs (``distmm.engine.dask.preload``): the Dask engine's task
#: modules imported as the worker starts, not at the first product
TASKS_PRELOAD = "distmm.engine.dask.preload"


def _require_jobqueue():
    try:
        import dask_jobqueue
    except ImportError:
        raise ImportError('distmm.deploy.jobqueue_cluster needs dask-jobqueue: '
                          'pip install "distmm[deploy]"') from None
    return dask_jobqueue


def _count(value, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be a {'positive' if least else 'non-negative'} integer, "
                         f"got {value!r}")
    return value


def _memory(value) -> int:
    """Bytes of ``memory`` as dask parses it (``"64GiB"``, or a number of bytes)."""
    from dask.utils import parse_bytes

    want = "a positive size such as '64GiB'"
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value in ("", 0):
        raise ValueError(f"memory must be {want}, got {value!r}")
    try:
        size = parse_bytes(value)
    except (ValueError, TypeError):
        raise ValueError(f"memory must be {want}, got {value!r}") from None
    if size <= 0:
        raise ValueError(f"memory must be {want}, got {value!r}")
    return size


def _walltime(value) -> str:
    """``value`` if it is a positive ``HH:MM:SS``, the one form Slurm and PBS both read alike."""
    import re

    match = isinstance(value, str) and re.fullmatch(r"(\d+):([0-5]\d):([0-5]\d)", value)
    if not match or not any(int(part) for part in match.groups()):
        raise ValueError(f"walltime must be a positive HH:MM:SS such as '02:00:00', got {value!r}")
    return value


def jobqueue_cluster(system: str = "slurm", *, jobs: int = 0, gpus: int = 0,
                     cores: int | None = None, memory: str | None = None,
                     threads_per_worker: int = 1, walltime: str = "01:00:00",
                     env_setup: str | None = None, **kwargs):
    """A dask-jobqueue cluster of distmm workers on Slurm or PBS, scaled to ``jobs`` jobs.

    Parameters
    ----------
    system
        ``"slurm"`` (``SLURMCluster``) or ``"pbs"`` (``PBSCluster``).
    jobs
        Batch jobs to start now (``cluster.scale(jobs=jobs)``); 0 starts none.
    gpus
        GPUs of one job. More than 0: the job runs ``dask cuda worker``, one worker per GPU
        (``processes=gpus``), each marked with the ``GPU=1`` resource, and asks for the
        GPUs (Slurm ``--gres=gpu:N``, PBS ``ngpus=N`` in ``select``). 0: CPU workers.
    cores
        Cores of one job. Default: ``gpus`` for a GPU job (one thread per GPU worker);
        required for a CPU job, which runs ``cores // threads_per_worker`` worker processes.
    memory
        Host memory of one job, as dask-jobqueue takes it (``"64GiB"``, or a number of
        bytes); split evenly between its workers, at least ``MIN_WORKER_MEMORY`` (256 MiB)
        each. Required.
    threads_per_worker
        Threads of each CPU worker (default 1), at most ``cores``: a CPU job runs
        ``cores // threads_per_worker`` workers, which share all of its cores evenly (as
        dask-jobqueue splits them): ``cores=8, threads_per_worker=3`` gives 2 workers of 4
        threads.
    walltime
        The jobs' time limit, a positive ``HH:MM:SS`` string (Slurm reads a bare number as
        minutes, PBS as seconds).
    env_setup
        A file every job sources before starting its workers (modules, a venv), the
        ``DISTMM_ENV_SETUP`` of the batch scripts.
    **kwargs
        Passed to the dask-jobqueue cluster: ``queue``, ``account``, ``interface``,
        ``job_extra_directives``, ``job_script_prologue`` (after ``env_setup``),
        ``worker_extra_args``, ``log_directory``, ``python``, ... (not ``processes`` or
        ``worker_command``: the workers are made from ``gpus``, ``cores`` and
        ``threads_per_worker``).

    Returns
    -------
    dask_jobqueue.SLURMCluster or dask_jobqueue.PBSCluster
        Close it (or use it as a context manager) to cancel its jobs.

    Raises
    ------
    ImportError
        dask-jobqueue is not installed (``pip install "distmm[deploy]"``).
    ValueError
        An unknown ``system``; no ``memory``, or one that is not a positive size or gives a
        worker less than ``MIN_WORKER_MEMORY``; a CPU job without ``cores``; counts that are
        not integers (``True``, ``2.5`` and ``"2"`` are not), ``jobs`` or ``gpus`` below 0,
        ``cores`` or ``threads_per_worker`` below 1; ``threads_per_worker`` above ``cores``
        in a CPU job, or ``cores`` fewer than
        ``gpus``; a ``walltime`` that is not a positive ``HH:MM:SS``; ``processes`` or
        ``worker_command`` among ``kwargs``. Raised before
        dask-jobqueue is imported and anything is submitted.

    Examples
    --------
    Two nodes of four GPUs each, on Slurm::

        from distributed import Client

        import distmm
        from distmm.deploy import jobqueue_cluster

        with jobqueue_cluster("slurm", jobs=2, gpus=4, cores=32, memory="256GiB",
                              env_setup="/path/to/env.sh") as cluster, Client(cluster) as c:
            c.wait_for_workers(8)
            product = distmm.matmul(a, b, client=c)
    """
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    _count(jobs, "jobs")
    _count(gpus, "gpus")
    _count(threads_per_worker, "threads_per_worker", least=1)
    if memory is None:
        raise ValueError("memory= (the host memory of one job, e.g. '64GiB') is required")
    size = _memory(memory)
    _walltime(walltime)
    if cores is None:
        if not gpus:
            raise ValueError("cores= (the cores of one job) is required for CPU workers")
        cores = gpus
    _count(cores, "cores", least=1)
    if gpus and cores < gpus:
        raise ValueError(f"cores={cores} is fewer than gpus={gpus}: each GPU worker needs a core")
    if not gpus and threads_per_worker > cores:
        raise ValueError(f"threads_per_worker={threads_per_worker} is more than cores={cores}: "
                         f"a CPU job runs cores // threads_per_worker workers")
    workers = gpus or max(1, cores // threads_per_worker)
    if size // workers < MIN_WORKER_MEMORY:
        from dask.utils import format_bytes

        whom = "a job's one worker" if workers == 1 else f"each of a job's {workers} workers"
        raise ValueError(f"memory={memory!r} gives {whom} {format_bytes(size // workers)}: "
                         f"a worker needs at least {MIN_WORKER_MEMORY // 2**20} MiB to start")
    taken = sorted({"processes", "worker_command"} & set(kwargs))
    if taken:  # they would replace the workers made from gpus, cores and threads_per_worker
        raise ValueError(f"{', '.join(taken)} cannot be given: jobqueue_cluster sets them from "
                         f"gpus, cores and threads_per_worker")
    jq = _require_jobqueue()

    prologue = list(kwargs.pop("job_script_prologue", None) or [])
    if env_setup:
        import shlex

        prologue.insert(0, f"source {shlex.quote(str(env_setup))}")
    extra_args = list(kwargs.pop("worker_extra_args", None) or [])
    if TASKS_PRELOAD not in extra_args:  # the task modules imported as a worker starts
        extra_args += ["--preload", TASKS_PRELOAD]
    directives = list(kwargs.pop("job_extra_directives", None) or [])
    options = dict(cores=cores, memory=memory, walltime=walltime, job_script_prologue=prologue)
    if gpus:
        options.update(processes=gpus, worker_command=GPU_WORKER_COMMAND)
        extra_args += ["--resources", "GPU=1"]
        if system == "slurm":
            directives.append(f"--gres=gpu:{gpus}")
        elif "resource_spec" not in kwargs:
            from dask.utils import parse_bytes
            from dask_jobqueue.pbs import pbs_format_bytes_ceil

            kwargs["resource_spec"] = (f"select=1:ncpus={cores}:ngpus={gpus}:"
                                       f"mem={pbs_format_bytes_ceil(parse_bytes(memory))}")
    else:
        options.update(processes=workers)
    options.update(worker_extra_args=extra_args, job_extra_directives=directives)
    options.update(kwargs)
    cls = jq.SLURMCluster if system == "slurm" else jq.PBSCluster
    cluster = cls(**options)
    if jobs:
        cluster.scale(jobs=jobs)
    return cluster
