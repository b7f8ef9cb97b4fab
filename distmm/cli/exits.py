"""How the command line ends: exit statuses, one-line messages (warnings too), and signals.

This module covers: the mapping from an exception to an exit status and a
one-line message on stderr, and turning SIGTERM (what Slurm and most batch
systems send at the time limit) into an exception so that the same cleanup
runs as for Ctrl-C or any error; SIGXCPU (the kernel's at a soft CPU-time limit,
``ulimit -t``, as some batch systems end a job) is treated as SIGTERM is; and each
warning the command shows as one line too (numpy's "invalid value encountered in matmul").

Exit statuses:

- 0: success;
- 1: the run started and failed (a full disk, a file-size limit, lost
  workers, a scheduler that cannot be reached, any unexpected error);
- 2: bad input, found before or while reading it (missing or unreadable
  files, a folder where a file was expected, ``file.h5:missing``, an
  unsupported suffix, shapes that do not multiply, a non-numeric dtype, an
  existing output without ``--overwrite``, an output folder that cannot be
  written, a backend this machine lacks, several MPI ranks), and argument
  errors;
- 130: interrupted by SIGINT; 143: terminated by SIGTERM; 152: by SIGXCPU (128 + the
  signal);
- 141: stdout's reader went away (``distmm info | head -1``), silently, as a tool that
  SIGPIPE ends.

It does *not* cover: the commands themselves (``distmm.cli.commands``).
"""
from __future__ import annotations

import logging
import os
import signal
import stat
import sys
import traceback
import warnings
from contextlib import contextmanager

from distmm.errors import (STOP_SIGNALS, BackendUnavailable, InsufficientSpace, OutputExists,
                           Signalled)
from distmm.startup import limit_note as _limit
from distmm.startup import rank_zero

__all__ = ["Signalled", "exit_status", "message", "report", "terminate_on_sigterm",
           "restore_signals", "raise_if_signalled", "whole_line_writes", "one_line_warnings",
           "OK", "FAILED", "BAD_INPUT"]

OK, FAILED, BAD_INPUT = 0, 1, 2

_BAD_INPUT = (ValueError, TypeError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
              PermissionError, OutputExists, BackendUnavailable)


def exit_status(exc: BaseException) -> int:
    """The exit status for an exception (see the module docstring)."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, Signalled):
        return 128 + exc.signum
    if isinstance(exc, InsufficientSpace):
        return FAILED
    if isinstance(exc, _BAD_INPUT):
        return BAD_INPUT
    return FAILED


def message(exc: BaseException) -> str:
    """One line that says what went wrong, naming the file where one is known."""
    if isinstance(exc, KeyboardInterrupt):
        text = "interrupted (SIGINT)"
    elif isinstance(exc, OSError) and exc.strerror and not isinstance(exc, (OutputExists, InsufficientSpace)):
        text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
        if exc.filename is None and exc.args and len(exc.args) == 1:
            text = str(exc)
    elif isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    elif getattr(exc, "cli_message", None):  # ConfigError: the advice a command line can take
        text = exc.cli_message
    else:
        text = str(exc)
        if not text:  # e.g. a bare MemoryError: its name is the whole message
            return type(exc).__name__ + _limit(exc)
        text = text.removeprefix("matmul: ")  # the API's own prefix; the line names the command
    if not isinstance(exc, (ValueError, TypeError, OSError, KeyError, Signalled, KeyboardInterrupt,
                            BackendUnavailable)):
        text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split()) + _limit(exc)


def _stdout_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a write to stdout whose pipe's reader went away."""
    if not isinstance(exc, BrokenPipeError) or exc.filename is not None:
        return False
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


def report(command: str, exc: BaseException, *, debug: bool = False, note: str = "") -> int:
    """Print the one line (and with ``debug`` the traceback) and return the exit status;
    nothing where stdout's reader went away (141, and stdout points at /dev/null from here,
    so that the interpreter's last flush does not fail again)."""
    if _stdout_gone(exc) and not debug:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"distmm {command}: error: {message(exc)}{note}", file=sys.stderr, flush=True)
    return exit_status(exc)


def whole_line_writes() -> None:
    """Make every line printed to stdout and stderr reach the file descriptor in one write.

    Unbuffered (``PYTHONUNBUFFERED``, ``python -u``, and stderr always) ``print`` writes a
    line's text and its newline apart, and ``mpirun`` interleaves what its ranks write at
    that grain: one rank's line then ran into another's and broke in two (seen with Open MPI
    5 in 1 run of 3 at 4 ranks). Line buffering without write-through keeps a line's parts
    together until its newline (or an explicit flush: progress bars flush their own)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True, write_through=False)
            except (ValueError, OSError):  # a closed or detached stream: nothing to keep whole
                pass


@contextmanager
def one_line_warnings(command: str, *, debug: bool = False):
    """Inside, each ``RuntimeWarning`` that the filters in force show (Python's defaults,
    ``-W``, ``PYTHONWARNINGS``; numpy's under its errstate) is one line on stderr, ``distmm
    COMMAND: warning: TEXT`` (its text as numpy gives it, ``invalid value encountered in
    matmul``), each once, as numpy reports a flag once per product; under a launcher, by
    rank 0 only. Other categories (a library's deprecation) are shown as before. With
    ``debug``, Python's own format (the place that warned). A filter's ``error`` still makes
    the warning the command's error."""
    if debug:
        yield
        return
    previous = warnings.showwarning
    shown: set[str] = set()

    def show(text, category, filename, lineno, file=None, line=None):
        if file is not None or not issubclass(category, RuntimeWarning):
            # written to a file of the caller's, or a library's warning: as it asked
            previous(text, category, filename, lineno, file, line)
            return
        text = " ".join(str(text).split())
        if text in shown or not rank_zero():
            return
        shown.add(text)
        print(f"distmm {command}: warning: {text}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


#: the signals the command got (SIGINT, SIGTERM, SIGXCPU), recorded by its handlers before
#: they raise
_received: list[int] = []



def _signal_error(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Signalled(signum)


def terminate_on_sigterm():
    """Raise ``Signalled`` in the main thread on SIGTERM and SIGXCPU (once: a second
    signal, any, during cleanup is ignored), and ``KeyboardInterrupt`` on SIGINT, each
    recorded first (``raise_if_signalled``). Where such an exception is raised
    inside code whose errors Python only prints ("Exception ignored in": a
    garbage-collection callback, a finaliser, as while a Dask cluster starts or
    closes), it is not printed, nor is any such error or log record after a signal, and the
    command ends at its next ``raise_if_signalled``. Returns what ``restore_signals`` takes."""

    def handler(signum, frame):
        for each in STOP_SIGNALS:  # once, any: another arriving during the cleanup would
            signal.signal(each, signal.SIG_IGN)  # escape it (SIGXCPU comes every second)
        _received.append(signum)
        # the command ends with the signal's one line: what libraries log about the work it
        # stops (distributed: "Couldn't gather 1 keys, rescheduling") is not printed
        logging.disable(logging.CRITICAL)
        raise _signal_error(signum)

    def unraisable(info):
        # after a signal, what it left broken is not printed either (distributed's gc
        # callback, interrupted mid-way, asserts at the next collection): the command is
        # ending with the signal's one line
        if not _received and not isinstance(info.exc_value, (Signalled, KeyboardInterrupt)):
            previous_hook(info)

    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    return (previous_hook, {s: signal.signal(s, handler) for s in STOP_SIGNALS})


def restore_signals(previous) -> None:
    """Undo ``terminate_on_sigterm`` (``main()`` called in a process that goes on)."""
    hook, handlers = previous
    sys.unraisablehook = hook
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    if _received:
        logging.disable(logging.NOTSET)
    _received.clear()


def raise_if_signalled() -> None:
    """Raise the first signal the command got, if any: before a command writes its output,
    and when it returns, so that a signal whose exception was swallowed still ends the run
    with 130 / 143 / 152 and nothing written."""
    if _received:
        raise _signal_error(_received[0])
