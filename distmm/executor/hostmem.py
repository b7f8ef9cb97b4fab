"""Fresh host memory for large results: huge pages, faulted in ahead of the writers.

This module covers: ``empty_host(shape, dtype)``, an uninitialised numpy array for a
result the GPU pipeline writes. Small arrays are ``np.empty``. Large ones (at least
``HUGE_MIN_BYTES``) are an anonymous ``mmap`` advised ``MADV_HUGEPAGE`` (2 MiB pages
where the kernel's transparent huge pages allow it: one fault per 2 MiB instead of
per 4 KiB), and background threads fault them in (``MADV_POPULATE_WRITE``, which never changes contents), rows first, while the GPU computes
the first tiles, so that the copy-out threads seldom pay a first touch (which costs
seconds for a result of several GiB in 4 KiB pages). The array keeps its mapping alive; when
the caller drops it, the mapping (its pages already in) is kept for the next result of
the same size, up to ``SPARE_MAX_BYTES`` (a fresh 4 GiB result costs its first touch on
every call otherwise: the API returns a new array each time).

It does *not* cover: pinned (page-locked) memory (``distmm.executor.pinned``) or
operands (their pages are the caller's). Linux only for the advice; elsewhere the
array is plain anonymous memory.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

from distmm.direct_io import libc_function

__all__ = ["empty_host", "huge_mapping", "populate", "TouchHold", "hold_until", "HUGE_MIN_BYTES", "SPARE_MAX_BYTES", "thp_mode"]

#: results at least this large get huge-page advice and background first touch
HUGE_MIN_BYTES = 64 << 20
_PAGE = 2 << 20          # touch one byte per 2 MiB (a whole huge page, or 512 small ones)
_SLICE = 16 << 20        # bytes faulted per step of a toucher thread (the kernel's mmap
                         # lock is held for a step: short steps let CUDA's allocations in)


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or ``?``."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "?"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, contents unchanged


_madvise = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int),
                         ctypes.c_int)  # None where not Linux


_resume = threading.Event()
_resume.set()
_holds_lock = threading.Lock()
_holds = 0


class TouchHold:
    """Holds the background first-touch threads between two of their steps until
    ``release()`` (idempotent) is called for this and every other hold.

    Why: faulting pages in holds the process's memory-map lock, which
    ``cudaMalloc``, page-locking and loading cuBLAS also take, so a large device
    allocation made while a result is being faulted in waits for the faulting
    (``bench/NOTES.md``, "First call"). The
    stream pipeline holds the threads while it allocates, pins its staging ring and
    starts cuBLAS, then lets them go on while the GPU computes.
    """

    def __init__(self):
        global _holds
        self._held = True
        with _holds_lock:
            _holds += 1
            _resume.clear()

    def release(self) -> None:
        global _holds
        with _holds_lock:
            if not self._held:
                return
            self._held = False
            _holds -= 1
            if _holds == 0:
                _resume.set()


def hold_until(future) -> None:
    """Hold the first-touch threads until ``future`` is done (nothing when it already
    is): a start-up on another thread that takes the memory-map lock (cuBLAS loading
    its libraries) runs first."""
    if future is None or future.done():
        return
    hold = TouchHold()
    future.add_done_callback(lambda _fut: hold.release())


def _touch(addr: int, start: int, stop: int, step: int, keep=None) -> None:
    """Fault in ``[start, stop)`` of the mapping at ``addr`` with MADV_POPULATE_WRITE:
    it never changes contents, so it may race with the writers (a page they wrote
    first is left as it is). ctypes releases the GIL during the call; ``keep`` (the
    array) holds the mapping until the thread is done. Between steps the thread
    waits while a ``TouchHold`` is held (at most a minute: a hold never stops it)."""
    for s0 in range(start, stop, step):
        _resume.wait(60)
        if _madvise(addr + s0, min(step, stop - s0), _MADV_POPULATE_WRITE) != 0:
            return  # an older kernel (EINVAL): the writers fault the pages themselves


def populate(addr: int, nbytes: int) -> bool:
    """Fault in ``nbytes`` at ``addr`` now (``MADV_POPULATE_WRITE``, contents unchanged);
    False where the kernel cannot (the pages then fault on first use)."""
    return _madvise is not None and _madvise(addr, nbytes, _MADV_POPULATE_WRITE) == 0


def _spare_max() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        ram = 16 << 30
    return int(min(16 << 30, ram // 4))


#: the most bytes of dropped results kept mapped (already faulted in) for the next ones
SPARE_MAX_BYTES = _spare_max()
_spare_lock = threading.Lock()
_spare: list = []  # [size, mmap] of results the caller dropped, oldest first


def _recycle(mem, size: int) -> None:
    """A result's array died: keep its mapping (pages already faulted in) for the next
    result of this size, within ``SPARE_MAX_BYTES``, oldest dropped first."""
    with _spare_lock:
        _spare.append((size, mem))
        while sum(s for s, _ in _spare) > SPARE_MAX_BYTES:
            _spare.pop(0)


def _take_spare(size: int):
    with _spare_lock:
        for i, (s, mem) in enumerate(_spare):
            if s == size:
                del _spare[i]
                return mem
    return None


_ANONYMOUS: "weakref.WeakSet" = weakref.WeakSet()  # the mappings ``huge_mapping`` made


def in_process_memory(array) -> bool:
    """Whether ``array``'s memory is the process's own (numpy's allocation, or an anonymous
    mapping of ``huge_mapping``), not a file's pages (``numpy.memmap`` or another mapping)
    or a foreign buffer: only such memory is page-locked in place for copies to and from it."""
    x = array
    while True:
        if isinstance(x, np.memmap):
            return False
        base = getattr(x, "base", None)
        if base is None:
            return isinstance(x, np.ndarray) and x.flags.owndata
        if isinstance(base, memoryview):  # numpy.frombuffer's
            base = base.obj
        if isinstance(base, mmap.mmap):
            return base in _ANONYMOUS
        if not isinstance(base, np.ndarray):
            return False
        x = base


def huge_mapping(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes advised ``MADV_HUGEPAGE`` where the
    kernel knows the advice (its pages are not faulted in). Raises ``OSError`` where
    no anonymous mapping can be made."""
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _ANONYMOUS.add(mem)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mem.madvise(advice)
        except OSError:  # pragma: no cover - kernels without transparent huge pages
            pass
    return mem


def empty_host(shape, dtype, *, touch_threads: int = 4) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype`` in host memory.

    At ``HUGE_MIN_BYTES`` and more it is an anonymous mapping with ``MADV_HUGEPAGE``
    whose pages ``touch_threads`` daemon threads fault in (each a band of rows, first
    rows first) with ``MADV_POPULATE_WRITE``, which leaves contents alone: the caller
    may write at once (a write to a page not yet touched faults it itself, as it would
    anyway). The threads keep the mapping alive until they finish.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in np.atleast_1d(shape)) if not isinstance(shape, int) else (shape,)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    size = -(-nbytes // _PAGE) * _PAGE
    mem = _take_spare(size)
    if mem is not None:  # a dropped result's mapping: its pages are in already
        raw = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
        weakref.finalize(raw, _recycle, mem, size)
        return raw.view(dtype).reshape(shape)
    mem = huge_mapping(size)
    raw = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    weakref.finalize(raw, _recycle, mem, size)
    if _madvise is None:
        return raw.view(dtype).reshape(shape)
    addr = raw.ctypes.data
    band = -(-nbytes // max(touch_threads, 1))
    band = -(-band // _PAGE) * _PAGE
    for t in range(max(touch_threads, 1)):
        lo, hi = t * band, min((t + 1) * band, nbytes)
        if lo < hi:
            threading.Thread(target=_touch, args=(addr, lo, hi, _SLICE, raw), daemon=True,
                             name=f"distmm-touch-{t}").start()
    return raw.view(dtype).reshape(shape)
