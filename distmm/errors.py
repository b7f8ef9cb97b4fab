"""distmm's exception types, at the bottom of the house so every layer can raise them.

This module covers: the few error types distmm adds to numpy's and Python's
(``ValueError`` for bad shapes, ``TypeError`` for bad dtypes, ``OSError``
subclasses for files). Each subclasses the built-in a caller would already
catch, so ``except ValueError`` keeps working.
``naming_target`` gives a failure to write a temporary file the name of the file asked for.
It does *not* cover: formatting errors for the command line (``distmm.cli``).
"""
from __future__ import annotations

import signal

__all__ = ["BackendUnavailable", "WorkersLost", "TileFailed", "OutputExists", "InsufficientSpace",
           "Signalled", "ConfigError", "NotPicklable", "UnreadableInput", "READING",
           "STOP_SIGNALS", "naming_target"]


class ConfigError(ValueError):
    """A distmm configuration value that does not parse. Its message gives Python's ways to
    set the key; ``cli_message`` the same with the ways open at a command line (environment
    variables, a dask YAML file), which ``distmm.cli.exits`` prints."""

    def __init__(self, message: str, *, cli_message: str | None = None):
        super().__init__(message)
        self.cli_message = cli_message or message


class BackendUnavailable(RuntimeError):
    """A backend was asked for that this machine cannot run (no GPU, no cupy)."""


class WorkersLost(RuntimeError):
    """A cluster run gave up: workers kept dying, or none came back in time.
    The message says what was lost and after how long."""


class SchedulerLost(RuntimeError):
    """A Dask engine call ended because its client's connection to the scheduler did: the
    client was closed, or distributed gave up reconnecting to a scheduler that died."""


class TileFailed(RuntimeError):
    """One tile (a block of C) could not be computed on its device: the GPU ran
    out of memory after the retries, or the device was lost. The Dask engine
    runs such a tile again on a CPU worker."""


class OutputExists(FileExistsError):
    """The output target exists and overwriting it was not asked for."""


class InsufficientSpace(OSError):
    """The output does not fit the free space of its file system."""


class UnreadableInput(ValueError):
    """An operand's file failed while it was read (a corrupt or truncated chunk, a filter
    that failed): the message names the file, then what its library said."""


#: the note a reader adds to the error of a read that failed, naming the file (the error keeps
#: its type, as numpy's own read of the array would raise it; the command line reads the note)
READING = "distmm: while reading "


class NotPicklable(TypeError):
    """Object elements that do not pickle (or unpickle) where the MPI engine moves them
    between ranks. Raised on every rank; the engine then computes a product of operands
    every rank holds on each rank."""


#: the signals that stop a run with its cleanup (a ``--resume`` run keeps its state):
#: SIGTERM (a batch system's time limit), SIGINT, SIGXCPU (a soft CPU-time limit)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGXCPU)


class Signalled(BaseException):
    """The process got SIGTERM (or another terminating signal): unwind and clean up.

    A ``BaseException``, like ``KeyboardInterrupt``, so that ``except Exception``
    in a library does not swallow it.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


def naming_target(exc: OSError, temporary, path) -> OSError:
    """``exc``, a failure to write ``temporary`` (or one naming no file: a full disk, the
    file-size limit), as the same error naming ``path``, the file asked for; any other as it
    is."""
    if exc.errno is None or exc.filename not in (None, str(temporary)):
        return exc
    return OSError(exc.errno, exc.strerror, str(path))
