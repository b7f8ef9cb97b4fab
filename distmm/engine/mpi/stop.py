"""Stopping every rank of a job together, within a fraction of a second.

This module covers: ``StopWatch``, which a rank's waits poll (``check``) instead of blocking
in MPI, NCCL or CUDA: it raises when this process got SIGINT or SIGTERM (the handlers of
``distmm.cli.exits`` raise in the main thread; ``check`` also sees a flag any thread may set)
or when another rank said it stopped; ``tell`` sends that word to every other rank (one small
message each, on a communicator of its own), so a rank that failed or was signalled alone does
not leave the others waiting in a broadcast for ever. ``poll(done, watch)`` waits for a
condition with short sleeps, checking the watch between them.

It does *not* cover: what a stopped rank keeps or removes (``distmm.engine.mpi.stream`` and
the command line).
"""
from __future__ import annotations

import time

__all__ = ["StopWatch", "PeerStopped", "poll"]

_TAG = 7301


class PeerStopped(RuntimeError):
    """Another rank stopped (its reason is the message); this one stops too."""

    def __init__(self, rank: int, reason: str, status: int):
        self.rank, self.reason, self.status = rank, reason, status
        super().__init__(f"rank {rank} stopped: {reason}")


class StopWatch:
    """Raise in ``check`` once this rank or another must stop.

    Parameters
    ----------
    comm : mpi4py communicator
        Duplicated, so the stop messages never meet the job's own. Each message carries
        the watch's number (every rank makes its watches in the same order), so that a word
        sent to an earlier watch and never received there, which MPI may deliver to a later
        duplicate, is dropped rather than stopping a later product.
    """

    _made = 0  # watches made by this process

    def __init__(self, comm):
        self.comm = comm.Dup()
        self.rank = self.comm.rank
        StopWatch._made += 1
        self.number = StopWatch._made
        self._request = self.comm.irecv(source=_any_source(), tag=_TAG) if self.comm.size > 1 else None
        self._told = False
        self._sent: list = []
        self.failed: BaseException | None = None
        #: an error this rank raised only after every broadcast its peers wait for (set by
        #: ``distmm.engine.mpi.stream``): agreed on at the end, never told
        self.held: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        """Record a failure seen on another thread; the next ``check`` raises it."""
        if self.failed is None:
            self.failed = exc

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed
        while self._request is not None:
            done, message = self._request.test()
            if not done:
                return
            self._request = None
            number, *stop = message
            if number == self.number:
                raise PeerStopped(*stop)
            self._request = self.comm.irecv(source=_any_source(), tag=_TAG)  # an earlier one's

    def tell(self, reason: str, status: int) -> None:
        """Tell every other rank that this one stops (once)."""
        if self._told or self.comm.size == 1:
            return
        self._told = True
        for peer in range(self.comm.size):
            if peer != self.rank:
                self._sent.append(self.comm.isend((self.number, self.rank, reason, status),
                                                  dest=peer, tag=_TAG))

    def close(self) -> None:
        if self._request is not None:
            try:
                self._request.Cancel()
                self._request.Free()
            except Exception:  # noqa: BLE001 - a request MPI already completed
                pass
            self._request = None
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - MPI already finalized
            pass


def _any_source() -> int:
    from mpi4py import MPI

    return MPI.ANY_SOURCE


def poll(done, watch: StopWatch | None, *, max_sleep: float = 0.005) -> None:
    """Wait until ``done()`` is true, checking ``watch`` between short sleeps."""
    sleep = 0.0001
    while not done():
        if watch is not None:
            watch.check()
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep)
