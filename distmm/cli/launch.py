"""How this process was launched: the number of ranks an MPI launcher started.

This module covers: reading the environment that ``mpirun``/``mpiexec``
(Open MPI, MPICH, Intel MPI, MVAPICH) and ``srun`` give each rank, so the
command line never runs the same product once per rank; and ``rank_table``,
every rank's host, GPU and binding for ``distmm info`` under a launcher. It does
*not* cover: choosing the GPU (``distmm.engine.mpi.binding``) or running anything
under MPI (the MPI engine, ``distmm.engine``).
"""
from __future__ import annotations

import os

__all__ = ["launcher_ranks", "rank_table"]

# (variable holding the world size, variable that must be set beside it)
_SIZE_VARS = (
    ("OMPI_COMM_WORLD_SIZE", None),  # Open MPI's mpirun / mpiexec
    ("PMI_SIZE", None),  # MPICH, Intel MPI (hydra), PMI-1/2 launchers
    ("PMIX_SIZE", "PMIX_RANK"),  # PMIx launchers that export it
    ("MV2_COMM_WORLD_SIZE", None),  # MVAPICH
    # srun sets SLURM_STEP_NUM_TASKS in a job step only; SLURM_NTASKS alone is
    # also set in the batch script itself, which runs once, so it does not count.
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
)


def launcher_ranks(environ=None) -> tuple[int, str | None]:
    """The number of ranks a launcher started, and the variable that says so.

    Returns ``(1, None)`` outside a launcher or for a single rank.
    """
    env = os.environ if environ is None else environ
    best = (1, None)
    for name, companion in _SIZE_VARS:
        raw = env.get(name)
        if raw is None or (companion and companion not in env):
            continue
        try:
            size = int(str(raw).split("(")[0])
        except ValueError:
            continue
        if size > best[0]:
            best = (size, name)
    return best


def rank_table(comm) -> list[str] | None:
    """Every rank's host, GPU (or "no GPU") and binding, one line per rank in rank
    order, then the sharing warning if ranks share GPUs: on rank 0 (None on the
    others). Collective on ``comm``; no device is made current.

    Examples
    --------
    Under ``mpirun -n 2`` on a host without GPUs, rank 0 gets::

        rank 0      node1, no GPU; node-local rank 0 of 2 (OMPI_COMM_WORLD_LOCAL_RANK); CUDA
                    shows this process no device; 1 CPU
        rank 1      node1, no GPU; node-local rank 1 of 2 (OMPI_COMM_WORLD_LOCAL_RANK); CUDA
                    shows this process no device; 1 CPU

    (one line per rank, wrapped here). A GPU rank whose launcher bound it to one CPU
    adds what a product makes of it (``distmm.engine.mpi.cpus``): ``1 CPU (a product
    runs on 16)``.
    """
    import os

    from distmm.config import get_config
    from distmm.engine.mpi.binding import bind_rank, sharing_warning
    from distmm.engine.mpi.cpus import wanted

    binding = bind_rank(comm, warn=False)
    gpu = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    wider = None
    if binding.device is not None:
        wider = wanted(binding.local_rank, binding.local_size, get_config().mpi_cpus)
    if binding.device is not None:
        from distmm.executor.device import device_properties

        gpu = f"GPU {binding.device} ({device_properties(binding.device)['name']})"
    rows = comm.gather((binding, gpu, cpus, None if wider is None else len(wider)), root=0)
    if comm.rank != 0:
        return None

    def cpu_text(n, w):
        if n is None:
            return ""
        return f"; {n} CPU{'s' if n != 1 else ''}" + (f" (a product runs on {w})" if w else "")

    lines = [f"rank {r:<7d}{b.describe(g)}{cpu_text(n, w)}"
             for r, (b, g, n, w) in enumerate(rows)]
    warning = sharing_warning([row[0] for row in rows])
    return lines + ([warning] if warning else [])
