"""One background thread at a time for a client-side chore, and a wait for it.

The Dask engine keeps work off a product's path on threads of their own (the worker probe's
second round for GPU rates still pending, freeing the IPC probe's exports): ``BackgroundSlot``
starts such a thread, optionally not while the previous one runs, and ``settle`` waits for the
latest (tests, and callers that must see the chore finished).
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class BackgroundSlot:
    """The latest daemon thread of one chore."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, target: Callable[..., Any], *args: Any, name: str,
              skip_if_running: bool = False) -> bool:
        """Run ``target(*args)`` on a new daemon thread; with ``skip_if_running``, not while
        the previous one is alive. Returns whether a thread was started."""
        with self._lock:
            if skip_if_running and self._thread is not None and self._thread.is_alive():
                return False
            thread = self._thread = threading.Thread(target=target, args=args, name=name,
                                                     daemon=True)
        thread.start()
        return True

    def settle(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout`` seconds) for the latest thread to end."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
