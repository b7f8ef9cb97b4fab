"""How the ``distmm`` command starts: a signal that arrives while its modules import.

This module covers: telling whether this process is the ``distmm`` command (its console
script, or ``python -m distmm``; under ``mpirun`` and ``srun`` too), and ``guard``, which ends
such a process on SIGINT or SIGTERM during the imports of ``distmm`` and of its command line
with the command line's one line and status (130, 143), as later in the run; and
``let_rank_zero_say``, which makes that line one for all the ranks of a launcher. A library
import is left as it is: no handler is installed.
It does *not* cover: signals once a command runs (``distmm.cli.exits``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from distmm.errors import Signalled

__all__ = ["guard", "is_command", "let_rank_zero_say", "rank_zero"]

# the rank variables of mpirun/mpiexec (Open MPI, MPICH, Intel MPI, MVAPICH), PMIx and srun
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
              "SLURM_PROCID")


def is_command() -> bool:
    """Whether this process runs the ``distmm`` command (not a program importing distmm,
    nor a process the command started through multiprocessing's spawn: a Dask worker of
    ``distmm cluster`` inherits the command's ``sys.argv``)."""
    if "--multiprocessing-fork" in getattr(sys, "orig_argv", ()):
        return False
    if os.path.basename(sys.argv[0] if sys.argv else "") == "distmm":  # the console script
        return True
    orig = list(getattr(sys, "orig_argv", ()))
    return "-mdistmm" in orig or any(a == "-m" and b == "distmm" for a, b in zip(orig, orig[1:]))


#: how long a rank other than 0 waits before its own line for a signal
PEER_GRACE_S = 1.0


def rank_zero() -> bool:
    """Whether this process is rank 0 of its launcher, or runs outside one (the launcher's
    variables: nothing of MPI is started)."""
    return all(os.environ.get(v, "0") == "0" for v in _RANK_VARS)


def let_rank_zero_say() -> None:
    """Before a signal's line on a launcher's rank other than 0: wait ``PEER_GRACE_S``. A
    signal from a scheduler reaches every rank; rank 0 prints its line and exits, and the
    launcher then ends this rank, so one line is printed. A rank still running after the wait
    was the only one signalled and prints its own."""
    if not rank_zero():
        time.sleep(PEER_GRACE_S)


def _raise_signalled(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # once: the exit below is on its way
    raise Signalled(signum)


@contextlib.contextmanager
def guard():
    """Around the command's imports: SIGINT or SIGTERM ends the process with the command
    line's one line and 130 / 143 (nothing else has started, so nothing is left behind).
    Outside the command, or off the main thread, it does nothing."""
    if not is_command():
        yield
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _raise_signalled)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    except (KeyboardInterrupt, Signalled) as exc:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second one (a launcher ending the
            signal.signal(signum, signal.SIG_IGN)  # rank) raised in here: a traceback
        interrupted = isinstance(exc, KeyboardInterrupt)
        let_rank_zero_say()
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        what = "interrupted (SIGINT)" if interrupted else str(exc)
        print(f"distmm{' ' + command if command else ''}: error: {what}", file=sys.stderr,
              flush=True)
        os._exit(128 + (signal.SIGINT if interrupted else exc.signum))
