"""What a worker process of ``distmm cluster`` does as it starts (a distributed preload).

This module covers: ignoring SIGINT in the worker process. Ctrl-C at a terminal reaches
every process of the foreground group; ``distmm cluster`` closes its workers in order when
it gets SIGINT, and a worker that took the same SIGINT as ``KeyboardInterrupt`` would die
mid-close with a traceback, and its nanny would start it again.

It does *not* cover: anything else about workers (``distmm.cli.serve``, ``distmm.cli.cluster``).
"""
from __future__ import annotations

import signal
import threading

__all__ = ["dask_setup"]


def dask_setup(worker) -> None:
    """distributed's preload hook: ignore SIGINT in this worker process (its main thread
    runs the worker's event loop, so the disposition can be set here)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
