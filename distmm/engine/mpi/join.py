"""Waiting, with a watch, for every rank to reach a collective call of the Python API.

This module covers: the first collective of a call that every rank must make
(``distmm.matmul(..., engine="mpi")``, ``DistArray.from_local``). A rank that takes
another path (another engine, an exception of its own before the call) would leave the
others waiting in that collective for ever, with nothing said. ``join`` first waits in a
non-blocking collective (an ``Iallgather`` of one byte, "here"), testing it; after
``mpi-join-warning`` (default 60 s) it logs one warning naming the call, and after
``mpi-join-timeout`` (default none: it waits for ever, as MPI does; a rank may legitimately
reach the call minutes after the others) it prints one line and ends the job with
``MPI_Abort``, since a collective that never completes cannot be withdrawn and the
communicator would be unusable after a raised error.

A rank that leaves its program instead (an uncaught exception, ``sys.exit``, the end of the
script), in a process that imported distmm, makes the same collective at exit with the
byte "left", on ``COMM_WORLD`` and on every communicator it joined on before (``_leave``,
an ``atexit`` hook, which runs before mpi4py's ``MPI_Finalize``). As collectives are matched
in order on each communicator, that meets the join the other ranks make next there: once
every rank has either called the join or left, the lowest rank that called it prints one
line naming the ranks that left and the call (``distmm: rank 1 of 2 ended before calling
DistArray.from_local, which rank 0 waits in: ending the job``) and ends the job with
``MPI_Abort(1)``; the others wait to be ended with it. A leaving rank's own traceback is
printed as Python prints it, before. When every rank ends, these collectives meet each
other and say nothing; a leaving rank waits at most ``LINGER`` for them, then finalizes
(Open MPI completes them inside ``MPI_Finalize``, which waits for every rank), so a rank
that never imports distmm or calls ``MPI.Finalize`` itself delays the others' exit by that
at most. These collectives use MPI's collective context, never a tag that a user's
``recv(ANY_SOURCE, ANY_TAG)`` could take.

It does *not* cover: MPI libraries other than Open MPI (no "left" is sent, as whether
``MPI_Finalize`` completes the open collective is not known there: the others wait, as
above); collectives inside the engine, which follow an agreed start; a rank
that leaves before it first joins on a communicator other than ``COMM_WORLD`` while the
others join on that one (they wait, as above); a process that ends without running
``atexit`` hooks (``os._exit``, a signal; ``python -m mpi4py`` itself aborts the job on an
uncaught exception).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import time

from distmm.config import get_config

__all__ = ["join"]

log = logging.getLogger("distmm.engine.mpi")

SPIN = 1e-3  # seconds of testing without sleeping: ranks that arrive together pay no sleep
LONGEST_SLEEP = 5e-3  # the most added to a late rank's arrival, once the others wait
LINGER = 1.0  # seconds a leaving rank waits for its "left" collectives before MPI_Finalize
GRACE = 10.0  # seconds a waiting rank other than the lowest waits for it to end the job

_HERE, _LEFT = b"\x01", b"\x00"

#: communicators (not COMM_WORLD) this process joined on, by the number of their attribute;
#: MPI's delete callback removes one that is freed, whichever handle frees it
_JOINED: dict[int, object] = {}
_NUMBERS = itertools.count()
_KEYVAL = None
_PID = os.getpid()  # a forked child's exit says nothing
_KEPT: list = []  # collectives still open at exit: kept past the interpreter's teardown


def join(comm, what: str) -> None:
    """Return once every rank of ``comm`` has called ``join``; ``what`` names the call in
    the warning and in the lines that end the job (the timeout's, a rank that left's).
    Nothing on one rank."""
    if comm.size == 1:
        return
    cfg = get_config()
    flags = None
    if comm.Is_inter():  # no "left" on an intercommunicator: a barrier of both groups
        request = comm.Ibarrier()
    else:
        _remember(comm)
        flags = bytearray(comm.size)
        request = comm.Iallgather(bytearray(_HERE), flags)
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
    if flags is not None and _LEFT[0] in flags:
        _end(comm, flags, what)


def _end(comm, flags: bytearray, what: str) -> None:
    """One line naming the ranks that left, from the lowest rank that called the join, and
    ``MPI_Abort(1)``; the other ranks that called it wait ``GRACE`` for that first."""
    left = [r for r, f in enumerate(flags) if f == _LEFT[0]]
    here = [r for r, f in enumerate(flags) if f != _LEFT[0]]
    if comm.rank != here[0]:
        time.sleep(GRACE)
    who = f"rank {left[0]}" if len(left) == 1 else "ranks " + ", ".join(map(str, left))
    sys.stderr.write(f"distmm: {who} of {comm.size} ended before calling {what}, which rank "
                     f"{comm.rank} waits in: ending the job\n")
    sys.stderr.flush()
    comm.Abort(1)


def _remember(comm) -> None:
    """Record ``comm`` (once) for ``_leave``, with an attribute whose delete callback
    forgets it when it is freed."""
    global _KEYVAL
    from mpi4py import MPI

    if comm == MPI.COMM_WORLD:  # always told at exit
        return
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_forget)
    if comm.Get_attr(_KEYVAL) is None:
        number = next(_NUMBERS)
        comm.Set_attr(_KEYVAL, number)
        _JOINED[number] = comm


def _forget(comm, keyval, number) -> None:
    _JOINED.pop(number, None)


@atexit.register
def _leave() -> None:
    """At exit: "left" on ``COMM_WORLD`` and on every communicator joined on, so that ranks
    waiting in a join for this one end the job; waits at most ``LINGER`` for them."""
    MPI = sys.modules.get("mpi4py.MPI")  # never imported here: a process without MPI
    if MPI is None or os.getpid() != _PID:
        return
    open_: list = []
    try:
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return
        if not MPI.Get_library_version().startswith("Open MPI"):
            return  # finalizing with the collective still open: known to work on Open MPI
        open_ = []
        for comm in [MPI.COMM_WORLD, *_JOINED.values()]:
            if comm == MPI.COMM_NULL or comm.size == 1:
                continue
            flags = bytearray(comm.size)
            mine = bytearray(_LEFT)
            open_.append((comm.Iallgather(mine, flags), mine, flags))
        deadline = time.monotonic() + LINGER
        while open_ and time.monotonic() < deadline:
            open_ = [o for o in open_ if not o[0].Test()]
            if open_:
                time.sleep(LONGEST_SLEEP)
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - leaving: MPI_Finalize next
        pass
    if open_:  # MPI may write into these until MPI_Finalize, after Python freed its objects
        _KEPT.extend(open_)
        try:
            import ctypes

            for kept in open_:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
        except Exception:  # noqa: BLE001 - no CPython API here: kept in _KEPT only
            pass
