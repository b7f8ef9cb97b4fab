"""The pipeline's device pool kept between products, and freed off the caller's path.

This module covers: handing one product's device pool (a ``CupyDevice``) to the next product
on the same GPU, and freeing it in a background thread once no product has taken it for
``seconds`` (the ``device-keep`` setting; 0: at once). Freeing (``cudaFree`` of a product's
gigabytes) costs tens of milliseconds, and for ~20 ms after it the driver's work on the freed
memory halves the host-to-device copy rate (bench/research/fresh_memory.py): a product that
starts right after another frees its buffers paid both, in its first, most exposed
milliseconds. A kept pool's blocks are reused instead.

It does *not* cover: what a pool holds or how much a product may take (``CupyDevice``, the
budget in ``distmm.executor.pipeline.product``).
"""
from __future__ import annotations

import threading

__all__ = ["take", "give", "drain"]

_lock = threading.Lock()
_kept: dict = {}        # device id -> (device, timer)
_freeing: list = []     # threads freeing a pool now


def _free(device) -> None:
    device.bind_thread()
    device.release()


def _free_in_background(device) -> None:
    """Start freeing ``device``'s pool on a thread of its own; called holding ``_lock``, so
    that ``take`` never finds a pool neither kept nor being freed."""
    th = threading.Thread(target=_free, args=(device,), name="distmm-release", daemon=True)
    _freeing.append(th)
    th.start()


def _expire(device_id, device) -> None:
    with _lock:
        entry = _kept.get(device_id)
        if entry is None or entry[0] is not device:
            return  # taken by a product meanwhile
        del _kept[device_id]
        _free_in_background(device)


def take(device_id: int):
    """The pool kept for GPU ``device_id``, or None; either way no pool is still being freed
    when this returns (a budget read after it sees that memory free)."""
    with _lock:
        entry = _kept.pop(device_id, None)
        if entry is not None:
            entry[1].cancel()
    drain()
    return None if entry is None else entry[0]


def give(device, seconds: float) -> None:
    """Keep ``device``'s pool for the next product on its GPU for ``seconds``, then free it;
    freed at once (in the background) when ``seconds`` is 0 or a pool is kept already."""
    timer = threading.Timer(seconds, _expire, args=(device.device_id, device))
    timer.daemon = True
    with _lock:
        if seconds <= 0 or device.device_id in _kept:
            _free_in_background(device)
            return
        _kept[device.device_id] = (device, timer)
        timer.start()


def drain() -> None:
    """Wait until no pool is being freed."""
    with _lock:
        pending, _freeing[:] = list(_freeing), []
    for th in pending:
        th.join()
