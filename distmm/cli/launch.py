"""How this process was launched: the number of ranks an MPI launcher started.

This module covers: reading the environment that ``mpirun``/``mpiexec``
(Open MPI, MPICH, Intel MPI, MVAPICH) and ``srun`` give each rank, so the
command line never runs the same product once per rank. It does *not* cover:
running anything under MPI (the MPI engine, ``distmm.engine``).
"""
from __future__ import annotations

import os

__all__ = ["launcher_ranks"]

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
