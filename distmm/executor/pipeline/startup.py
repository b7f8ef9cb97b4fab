"""The warm-up a product waits for: which one is running, and waiting for it.

This module covers: the process's running GPU warm-up (``distmm.executor.warmup``
registers it here), and ``wait_running()``, which a product calls before it pins
its ring so that the two never pin twice.
It does *not* cover: what the warm-up does (``distmm.executor.warmup``).
"""
from __future__ import annotations

import threading

__all__ = ["start", "finish", "wait_running", "note_product", "product_started"]

_lock = threading.Lock()
_running = None  # the WarmUp handle in progress, or None
_products = 0    # pipelined products started in this process


def note_product() -> None:
    """A pipelined product starts (the warm-up skips what it would then only slow)."""
    global _products
    with _lock:
        _products += 1


def product_started() -> bool:
    """Whether a pipelined product has started in this process."""
    return _products > 0


def start(make):
    """Register ``make()`` as the running warm-up and return ``(handle, True)``, or
    return ``(running handle, False)`` when one already runs."""
    global _running
    with _lock:
        if _running is not None:
            return _running, False
        _running = make()
        return _running, True


def finish(handle) -> None:
    """``handle`` is done: nothing is running any more."""
    global _running
    with _lock:
        if _running is handle:
            _running = None


def wait_running(timeout: float | None = None) -> None:
    """Wait until a warm-up that is still running has pinned its staging ring (a
    no-op when none is, and on the warm-up's own thread, whose small products must
    not wait for themselves). Only the ring: a first product that waited for the
    whole warm-up, while its cuBLAS start-up still ran, was slower than one with no
    warm-up at all (bench/NOTES.md, "First call")."""
    with _lock:
        handle = _running
    if handle is not None and handle.thread_id != threading.get_ident():
        ready = getattr(handle, "ring_ready", None)
        if ready is not None:
            ready.wait(timeout)
        else:
            handle.wait(timeout)
