"""How the ``distmm`` command starts: a signal or an error while its modules import.

This module covers: telling whether this process is the ``distmm`` command (its console
script, or ``python -m distmm``; under ``mpirun`` and ``srun`` too), and ``guard``, which ends
such a process on SIGINT or SIGTERM during the imports of ``distmm`` and of its command line
with the command line's one line and status (130, 143), as later in the run, and on an error
there (memory the address-space limit refuses, a shared library that cannot be mapped) with
one line and status 1, instead of a traceback; ``limit_note``, the process limit behind an
error, named in that line and in every later one (``distmm.cli.exits``); and
``let_rank_zero_say``, which makes a signal's line one for all the ranks of a launcher. A
library import is left as it is: no handler is installed.
It does *not* cover: signals and errors once a command runs (``distmm.cli.exits``).
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time

from distmm.errors import Signalled

try:  # imported here, before memory can run out (``limit_note``)
    import resource
except ImportError:  # not a POSIX system: no process limits to name
    resource = None

__all__ = ["guard", "is_command", "let_rank_zero_say", "limit_note", "rank_zero", "size_text"]

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


#: the process limit behind an error: (errno or exception type, resource name, ulimit option,
#: what it limits); the limit in force is named where it is set
_LIMITS = ((errno.EFBIG, "RLIMIT_FSIZE", "-f", "file-size"),
           (errno.EMFILE, "RLIMIT_NOFILE", "-n", "open-file"),
           (errno.ENOMEM, "RLIMIT_AS", "-v", "address-space"),
           (MemoryError, "RLIMIT_AS", "-v", "address-space"))


def limit_note(exc: BaseException) -> str:
    """``" (the file-size limit, ulimit -f, is 64.0 KiB)"`` where ``exc`` is what a process
    limit in force causes (a write past the file-size limit, too many open files, memory the
    address-space limit refuses; SIGXCPU); else ``""``."""
    if isinstance(exc, Signalled) and exc.signum == signal.SIGXCPU:
        return " (the CPU-time limit, ulimit -t, was reached)"
    for cause, name, option, what in _LIMITS if resource is not None else ():
        if not (isinstance(exc, OSError) and exc.errno == cause if isinstance(cause, int)
                else isinstance(exc, cause)):
            continue
        soft = resource.getrlimit(getattr(resource, name))[0]
        if soft == resource.RLIM_INFINITY:
            return ""
        size = str(soft) if name == "RLIMIT_NOFILE" else size_text(soft)
        return f" (the {what} limit, ulimit {option}, is {size})"
    return ""


def size_text(nbytes: int, decimals: int = 1, up: bool = False) -> str:
    """``nbytes`` in GiB, MiB or KiB (``decimals`` decimals; ``up``: rounded up, so that a
    limit of that size holds ``nbytes``), or bytes: for the lines that name a size, this
    module's limits and ``distmm.plan_batch``'s refusals (two decimals). Here, not beside
    ``distmm.config``'s parsing of sizes: this module imports nothing that may fail."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift:
            scale = 10 ** decimals
            value = (-(-nbytes * scale // (1 << shift)) / scale if up
                     else nbytes / (1 << shift))
            return f"{value:.{decimals}f} {unit}"
    return f"{nbytes} bytes"


def _malformed_config(exc: BaseException) -> bool:
    """Whether ``exc`` is dask's refusal, as it imports, of a configuration file it cannot
    read (a YAML syntax error, not UTF-8, not a mapping: "A dask config file at PATH is
    malformed"): the user's file, which the command's status 2 names, not the install."""
    return isinstance(exc, ValueError) and str(exc).startswith("A dask config file at")


def _import_error_line(exc: BaseException) -> str:
    """The one line of an error raised while the command's modules import: its type and
    text (an ``ImportError``'s first cause's: numpy wraps the loader's in pages of advice),
    with the process limit behind it. The loader's "failed to map segment from shared
    object" is a mapping the address-space limit refused, named as a ``MemoryError`` is."""
    root = exc
    while isinstance(root, ImportError) and isinstance(root.__cause__ or root.__context__,
                                                       ImportError):
        root = root.__cause__ or root.__context__
    text = " ".join(str(root).split())
    if isinstance(root, OSError) and root.strerror:  # as distmm.cli.exits says an OSError
        line = root.strerror + (f": {root.filename}" if root.filename else "")
    else:
        line = f"{type(root).__name__}: {text}" if text else type(root).__name__
    mapped = isinstance(root, ImportError) and "failed to map segment" in text
    return line + limit_note(MemoryError() if mapped else root)


def _command() -> str:
    """The command's name (its first argument that is no option), or ""."""
    for arg in sys.argv[1:]:  # a loop, not a generator: nothing left to finalise
        if not arg.startswith("-"):
            return arg
    return ""


def _ignore(unraisable) -> None:
    """An unraisable error's hook that says nothing (the command's own line follows)."""


@contextlib.contextmanager
def guard():
    """Around the command's imports: SIGINT or SIGTERM ends the process with the command
    line's one line and 130 / 143, an error (a ``MemoryError`` under ``ulimit -v``) with one
    line and 1, the status of a run that failed (nothing else has started, so nothing is left
    behind); a dask configuration file dask cannot read, one line and 2 (bad input). A
    module that is missing (``ModuleNotFoundError``: the install's) is left to the
    caller, which may name what to install. Outside the command, or off the main thread, it
    does nothing."""
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
        command = _command()
        what = "interrupted (SIGINT)" if interrupted else str(exc)
        print(f"distmm{' ' + command if command else ''}: error: {what}", file=sys.stderr,
              flush=True)
        os._exit(128 + (signal.SIGINT if interrupted else exc.signum))
    except ModuleNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - the command prints no traceback
        status = 1
        try:
            # nothing but this line: an object freed meanwhile whose finaliser fails for want
            # of memory (a generator's) would print "Exception ignored in" and its traceback
            sys.unraisablehook = _ignore
            command = _command()
            said = _import_error_line(exc)
            if _malformed_config(exc):  # the user's file, not the install: bad input
                said, status = " ".join(str(exc).split()), 2
            line = f"distmm{' ' + command if command else ''}: error: {said}"
        except BaseException:  # noqa: BLE001 - no memory left even for the line's text
            line = f"distmm: error: {type(exc).__name__}"
        try:
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001 - stdout's error is not the one to say
            pass
        os.write(2, (line + "\n").encode(errors="replace"))
        os._exit(status)
