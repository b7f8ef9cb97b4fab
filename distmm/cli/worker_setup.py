"""What a worker process of ``distmm cluster`` does as it starts (a distributed preload).

This module covers:
- ignoring SIGINT in the worker process. Ctrl-C at a terminal reaches every process of the
  foreground group; ``distmm cluster`` closes its workers in order when it gets SIGINT, and
  a worker that took the same SIGINT as ``KeyboardInterrupt`` would die mid-close with a
  traceback, and its nanny would start it again;
- leaving out what a worker's own close can log: a heartbeat still waiting for the
  scheduler's answer when ``Worker.close`` closes the worker's connections logs "Failed to
  communicate with scheduler during heartbeat" with the closed stream's traceback, and a
  task still running is cancelled with a warning "Async instruction for <Task ...> ended
  with CancelledError" (a Ctrl-C mid-product closes the cluster so), and data the worker
  was still sending (to a peer, or to the scheduler gathering for a client) when the close
  cut the connection logs "failed during get data with ..." with the closed stream's
  traceback (a SIGTERM mid-product closes the cluster so). Once the worker is closing,
  those say nothing wrong; before, they are kept (a peer lost while this worker runs).

It does *not* cover: anything else about workers (``distmm.cli.serve``, ``distmm.cli.cluster``).
"""
from __future__ import annotations

import logging
import signal
import threading
import weakref

__all__ = ["dask_setup", "ClosingWorkerFilter"]

#: the start of the message distributed's ``Worker.heartbeat`` logs when its request fails
HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"
#: the start and end of the warning of a task ``Worker.close`` cancelled
CANCELLED = ("Async instruction for ", " ended with CancelledError")
#: the start of the message distributed's ``Worker.get_data`` logs when sending data fails
GET_DATA_FAILED = "failed during get data with "


class ClosingWorkerFilter(logging.Filter):
    """Drops the records of ``worker`` whose message starts with ``start`` and ends with
    ``end`` once it is closing or closed."""

    def __init__(self, worker, start: str, end: str = ""):
        super().__init__()
        self._worker = weakref.ref(worker)
        self._start, self._end = start, end

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.core import Status

        msg = str(record.msg)
        if not (msg.startswith(self._start) and msg.endswith(self._end)):
            return True
        worker = self._worker()
        return worker is not None and worker.status not in (
            Status.closing, Status.closing_gracefully, Status.closed)


def dask_setup(worker) -> None:
    """distributed's preload hook: ignore SIGINT in this worker process (its main thread
    runs the worker's event loop, so the disposition can be set here), and filter the
    closing worker's heartbeat failure, failed data transfers and cancelled tasks out of
    its log."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for start in (HEARTBEAT_FAILED, GET_DATA_FAILED):
        logging.getLogger("distributed.worker").addFilter(ClosingWorkerFilter(worker, start))
    logging.getLogger("distributed.worker.state_machine").addFilter(
        ClosingWorkerFilter(worker, *CANCELLED))
