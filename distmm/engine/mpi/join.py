"""Waiting, with a watch, for every rank to reach a collective call of the Python API.

This module covers: the first collective of a call that every rank must make
(``distmm.matmul(..., engine="mpi")``, ``DistArray.from_local``). A rank that takes
another path (another engine, an exception of its own before the call) would leave the
others waiting in that collective for ever, with nothing said. ``join`` first waits in a
non-blocking barrier, testing it; after ``mpi-join-warning`` (default 60 s) it logs one
warning naming the call, and after ``mpi-join-timeout`` (default none: it waits for ever,
as MPI does; a rank may legitimately reach the call minutes after the others) it prints
one line and ends the job with ``MPI_Abort``, since a barrier that never completes cannot
be withdrawn and the communicator would be unusable after a raised error.
It does *not* cover: collectives inside the engine, which follow an agreed start.
"""
from __future__ import annotations

import logging
import sys
import time

from distmm.config import get_config

__all__ = ["join"]

log = logging.getLogger("distmm.engine.mpi")

SPIN = 1e-3  # seconds of testing without sleeping: ranks that arrive together pay no sleep
LONGEST_SLEEP = 5e-3  # the most added to a late rank's arrival, once the others wait


def join(comm, what: str) -> None:
    """Return once every rank of ``comm`` has called ``join`` (a barrier); ``what`` names
    the call in the warning and the timeout's line. Nothing on one rank."""
    if comm.size == 1:
        return
    cfg = get_config()
    request = comm.Ibarrier()
    start = time.monotonic()
    warned = False
    pause = 0.0
    while not request.Test():
        waited = time.monotonic() - start
        if not warned and waited >= cfg.mpi_join_warning:
            warned = True
            log.warning("rank %d of %d has waited %g s for every rank to call %s; each rank "
                        "must make the same distmm calls in the same order (mpi-join-timeout "
                        "ends the job after a deadline)", comm.rank, comm.size,
                        cfg.mpi_join_warning, what)
        if cfg.mpi_join_timeout is not None and waited >= cfg.mpi_join_timeout:
            sys.stderr.write(f"distmm: rank {comm.rank} of {comm.size} waited "
                             f"{cfg.mpi_join_timeout:g} s for every rank to call {what} "
                             f"(mpi-join-timeout): ending the job\n")
            sys.stderr.flush()
            comm.Abort(1)
        if waited >= SPIN:
            pause = min(LONGEST_SLEEP, max(2 * pause, 5e-5))
            time.sleep(pause)
