"""A bounded pool of page-locked (pinned) host buffers for the GPU executor.

This module covers: allocating page-locked staging buffers, handing them out
and taking them back for reuse across tiles and calls, never holding more
pinned bytes than the configured limit (a caller that asks for more than is
free waits until a buffer comes back), and freeing everything on ``close()``
and at interpreter exit.

It does *not* cover: what the buffers are used for (``distmm.executor.pipeline``
stages tiles through them) or device memory.

Why a pool: pinning costs about as much as copying the bytes it pins,
and copies from pageable memory run at 7-12 GB/s against 55 GB/s from pinned
memory; so buffers are pinned once and reused, and their total is capped because
page-locked memory is taken away from the operating system.

See also: ``distmm.config`` (the ``distmm.pinned-pool`` limit).
"""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import Callable

import numpy as np

from distmm.threads import submit

__all__ = ["PinnedPool", "PinnedBuffer", "default_pinned_pool", "cupy_pinned_allocator",
           "registered_allocator"]


def cupy_pinned_allocator(nbytes: int):
    """Page-lock ``nbytes`` with ``cudaHostAlloc`` and return ``(numpy uint8 view, owner)``.

    The owner is a ``cupy.cuda.PinnedMemory``: dropping the last reference to it
    calls ``cudaFreeHost``. cupy's own pinned-memory *pool* is bypassed on purpose:
    it caches freed blocks, so memory would stay pinned after ``close()``.
    """
    import cupy

    mem = cupy.cuda.PinnedMemory(nbytes)
    ptr = cupy.cuda.PinnedMemoryPointer(mem, 0)
    return np.frombuffer(ptr, dtype=np.uint8, count=nbytes), mem


class _Registered:
    """Owner of a page-locked anonymous mapping: ``cudaHostUnregister`` runs when it
    is dropped, before the mapping can go (the finalizer holds the mapping)."""

    __slots__ = ("__weakref__",)


def _unregister(runtime, addr: int, mem) -> None:
    try:
        runtime.hostUnregister(addr)
    except Exception:  # pragma: no cover - the context is gone at interpreter exit
        pass
    del mem  # the mapping is unmapped once the array over it is gone too


_HUGE = 2 << 20
_REGISTER_FAILED: list = []  # [True] once cudaHostRegister failed in this process


def registered_allocator(nbytes: int):
    """Page-lock ``nbytes`` of fresh anonymous memory and return ``(numpy uint8 view,
    owner)``: an ``mmap`` advised ``MADV_HUGEPAGE``, faulted in by
    ``distmm.executor.hostmem.populate`` (no CUDA lock held meanwhile), then
    ``cudaHostRegister``. This is faster than ``cudaHostAlloc``, which also holds the
    driver's lock all along, so that cuBLAS's start-up and device allocations on
    other threads would wait for it (figures in ``bench/NOTES.md``). Where the mapping
    or the registration fails, ``cupy_pinned_allocator`` (and, after a failed
    registration, for the rest of the process: a memory-lock limit stays)."""
    import cupy

    from distmm.executor.hostmem import huge_mapping, populate

    if _REGISTER_FAILED:  # this process could not register before: do not fault pages in vain
        return cupy_pinned_allocator(nbytes)
    size = -(-int(nbytes) // _HUGE) * _HUGE
    try:
        mem = huge_mapping(size)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return cupy_pinned_allocator(nbytes)
    array = np.frombuffer(mem, dtype=np.uint8, count=int(nbytes))
    addr = int(array.ctypes.data)
    populate(addr, size)
    runtime = cupy.cuda.runtime
    try:
        runtime.hostRegister(addr, size, 0)
    except Exception:  # noqa: BLE001 - e.g. RLIMIT_MEMLOCK: the driver's own pinned memory
        _REGISTER_FAILED.append(True)
        del array
        try:
            mem.close()
        except BufferError:  # pragma: no cover - a view still exported: unmapped when freed
            pass
        return cupy_pinned_allocator(nbytes)
    owner = _Registered()
    weakref.finalize(owner, _unregister, runtime, addr, mem)
    return array, owner


class PinnedBuffer:
    """One page-locked buffer handed out by a ``PinnedPool``.

    ``view(shape, dtype)`` gives a C-contiguous numpy array over its first bytes.
    Give it back with ``pool.release(buf)`` (or use it as a context manager).
    """

    __slots__ = ("nbytes", "_array", "_owner", "_pool", "_ready", "_error", "__weakref__")

    def __init__(self, array: np.ndarray | None, owner, pool: "PinnedPool", *,
                 nbytes: int | None = None):
        self.nbytes = int(array.nbytes) if array is not None else int(nbytes)
        self._array = array
        self._owner = owner
        self._pool = pool
        self._ready = None if array is not None else threading.Event()  # being pinned
        self._error: BaseException | None = None

    def _fill(self, made) -> None:
        """The background allocation is done: ``made`` is ``(array, owner)`` or the
        exception it raised (raised again by the first ``view``)."""
        if isinstance(made, BaseException):
            self._error = made
        else:
            self._array, self._owner = made
        self._ready.set()

    def wait(self) -> None:
        """Until the memory is pinned (at once for a buffer made in place)."""
        if self._ready is not None:
            self._ready.wait()
            if self._error is not None:
                raise self._error

    @property
    def ptr(self) -> int:
        self.wait()
        return int(self._array.ctypes.data)

    def view(self, shape, dtype) -> np.ndarray:
        self.wait()
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(f"view of {shape} {dtype} needs {count * dtype.itemsize} bytes, "
                             f"buffer has {self.nbytes}")
        return self._array[: count * dtype.itemsize].view(dtype).reshape(shape)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._pool.release(self)


class PinnedPool:
    """Page-locked host buffers, at most ``limit_bytes`` of them in all.

    Parameters
    ----------
    limit_bytes : int
        The most pinned memory the pool ever holds (in use plus idle).
    allocator : callable, optional
        ``allocator(nbytes) -> (numpy uint8 array, owner)``; the memory is
        freed when ``owner`` is dropped. Default: ``registered_allocator``
        (fresh huge-page memory faulted in, then ``cudaHostRegister``). Tests
        pass a numpy allocator.

    Notes
    -----
    ``acquire(nbytes)`` returns an idle buffer of at least ``nbytes`` (the
    smallest that fits), else allocates a new one if that stays within the
    limit, else frees idle buffers that are too small to make room, else
    waits until a buffer is released. It never exceeds the limit. Thread-safe.

    Examples
    --------
    >>> pool = PinnedPool(1 << 20, allocator=lambda n: (np.empty(n, np.uint8), None))
    >>> with pool.acquire(4096) as buf:
    ...     buf.view((32, 32), "float32").shape
    (32, 32)
    >>> pool.close(); pool.held_bytes
    0
    """

    def __init__(self, limit_bytes: int, *, allocator: Callable | None = None):
        if int(limit_bytes) <= 0:
            raise ValueError(f"pinned pool limit must be positive, got {limit_bytes}")
        self.limit = int(limit_bytes)
        self._allocator = allocator or registered_allocator
        self._cond = threading.Condition()
        self._idle: list[PinnedBuffer] = []
        self._in_use: set[int] = set()  # id() of buffers handed out
        self._held = 0
        self._peak = 0
        self._closed = False
        _live_pools.add(self)

    # -- accounting ----------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Pinned bytes allocated now (in use plus idle)."""
        return self._held

    @property
    def peak_bytes(self) -> int:
        """The most pinned bytes held at once since the pool was made."""
        return self._peak

    @property
    def in_use_bytes(self) -> int:
        with self._cond:
            return self._held - sum(b.nbytes for b in self._idle)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- buffers ---------------------------------------------------------------
    def acquire(self, nbytes: int, *, timeout: float | None = None) -> PinnedBuffer:
        """Return a pinned buffer of at least ``nbytes``.

        Raises
        ------
        ValueError
            ``nbytes`` is larger than the pool's limit (it could never be met).
        TimeoutError
            ``timeout`` seconds passed with no room.
        RuntimeError
            The pool is closed.
        """
        nbytes = max(int(nbytes), 1)
        if nbytes > self.limit:
            raise ValueError(f"asked for a pinned buffer of {nbytes} bytes but the pinned pool "
                             f"is limited to {self.limit} bytes (distmm.pinned-pool)")
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the pinned pool is closed")
                fits = [b for b in self._idle if b.nbytes >= nbytes]
                if fits:
                    buf = min(fits, key=lambda b: b.nbytes)
                    self._idle.remove(buf)
                    self._in_use.add(id(buf))
                    return buf
                # Free idle buffers that are too small until the new one fits.
                while self._held + nbytes > self.limit and self._idle:
                    self._drop(self._idle.pop(0))
                if self._held + nbytes <= self.limit:
                    array, owner = self._allocator(nbytes)
                    buf = PinnedBuffer(array, owner, self)
                    self._held += buf.nbytes
                    self._peak = max(self._peak, self._held)
                    self._in_use.add(id(buf))
                    return buf
                if not self._cond.wait(timeout):
                    raise TimeoutError(f"no pinned buffer of {nbytes} bytes freed within "
                                       f"{timeout} s (limit {self.limit}, held {self._held})")

    def acquire_many(self, nbytes: int, count: int, *, timeout: float | None = None,
                     first: int | None = None) -> list[PinnedBuffer]:
        """Return ``count`` buffers of at least ``nbytes`` each, all or none.

        Taking them together means two users of one pool cannot each hold half
        of what they need and wait for the other forever.

        ``first``: of the buffers that must be newly pinned, pin only this many
        before returning and the others on a background thread; their ``view``
        and ``ptr`` wait until theirs is pinned. The list's order is reuse first,
        then the ones pinned now, then those still being pinned, so a caller that
        fills them in order starts before the whole set is pinned (the pipeline's
        ring starts copying after its first few buffers rather than after all).

        Raises
        ------
        ValueError
            ``count * nbytes`` is larger than the pool's limit.
        TimeoutError, RuntimeError
            As for ``acquire``.
        """
        nbytes, count = max(int(nbytes), 1), int(count)
        if count * nbytes > self.limit:
            raise ValueError(f"asked for {count} pinned buffers of {nbytes} bytes but the pinned "
                             f"pool is limited to {self.limit} bytes (distmm.pinned-pool)")
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the pinned pool is closed")
                fits = sorted((b for b in self._idle if b.nbytes >= nbytes), key=lambda b: b.nbytes)
                reuse = fits[:count]
                small = [b for b in self._idle if b.nbytes < nbytes]
                missing = count - len(reuse)
                room = self.limit - self._held + sum(b.nbytes for b in small)
                if missing * nbytes <= room:
                    out = []
                    for b in reuse:
                        self._idle.remove(b)
                        self._in_use.add(id(b))
                        out.append(b)
                    while self._held + missing * nbytes > self.limit:
                        victim = min((b for b in self._idle if b.nbytes < nbytes),
                                     key=lambda b: b.nbytes)
                        self._idle.remove(victim)
                        self._drop(victim)
                    now = missing if first is None else min(missing, max(int(first), 0))
                    try:
                        for array, owner in self._allocate(nbytes, now):
                            b = PinnedBuffer(array, owner, self)
                            self._held += b.nbytes
                            self._in_use.add(id(b))
                            out.append(b)
                        later = [PinnedBuffer(None, None, self, nbytes=nbytes)
                                 for _ in range(missing - now)]
                        for b in later:
                            self._held += b.nbytes
                            self._in_use.add(id(b))
                            out.append(b)
                        if later:
                            threading.Thread(target=self._pin_later, args=(later,), daemon=True,
                                             name="distmm-pin-later").start()
                    except BaseException:
                        for b in out:  # all or none: hand back what was taken
                            self._in_use.discard(id(b))
                            self._idle.append(b)
                        self._cond.notify_all()
                        raise
                    self._peak = max(self._peak, self._held)
                    return out
                if not self._cond.wait(timeout):
                    raise TimeoutError(f"{count} pinned buffers of {nbytes} bytes not free within "
                                       f"{timeout} s (limit {self.limit}, held {self._held})")

    def _allocate(self, nbytes: int, count: int) -> list:
        """``count`` new ``(array, owner)`` pairs, made on up to eight threads (faulting
        fresh pages in is CPU work that runs in parallel); every pair made is
        returned, or, when one fails, the others are dropped and the error raised."""
        if count <= 1:
            return [self._allocator(nbytes) for _ in range(count)]
        futures = self._allocate_all(nbytes, count)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]  # the pairs made are dropped with the futures
        return [f.result() for f in futures]

    def _allocate_all(self, nbytes: int, count: int) -> list:
        """``count`` allocations on up to eight threads, waited for: their futures."""
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(min(8, count), thread_name_prefix="distmm-pin") as pool:
            return [submit(pool, self._allocator, nbytes) for _ in range(count)]

    def _pin_later(self, bufs: list[PinnedBuffer]) -> None:
        """Pin ``bufs`` (handed out already, their bytes counted) on this thread."""
        for b, f in zip(bufs, self._allocate_all(bufs[0].nbytes, len(bufs))):
            b._fill(f.exception() if f.exception() is not None else f.result())

    def release(self, buf: PinnedBuffer) -> None:
        """Give a buffer back; after ``close()`` it is freed instead of kept."""
        with self._cond:
            if id(buf) not in self._in_use:
                raise ValueError("buffer was not handed out by this pool (or released twice)")
            self._in_use.discard(id(buf))
            if self._closed:
                self._drop(buf)
            else:
                self._idle.append(buf)
            self._cond.notify_all()

    def trim(self) -> None:
        """Free every idle buffer now (buffers in use are kept)."""
        with self._cond:
            while self._idle:
                self._drop(self._idle.pop())
            self._cond.notify_all()

    def _drop(self, buf: PinnedBuffer) -> None:
        if buf._ready is not None:
            buf._ready.wait()  # still being pinned: freed once it is
        self._held -= buf.nbytes
        buf._array = None
        buf._owner = None  # the last reference: cudaFreeHost runs here

    def close(self) -> None:
        """Free all idle buffers and refuse new requests; buffers still in use
        are freed when they are released. Idempotent."""
        with self._cond:
            self._closed = True
        self.trim()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"PinnedPool(limit={self.limit}, held={self._held}, "
                f"idle={len(self._idle)}, in_use={len(self._in_use)})")


_live_pools: "weakref.WeakSet[PinnedPool]" = weakref.WeakSet()
_default_lock = threading.Lock()
_default_pool: PinnedPool | None = None


def default_pinned_pool() -> PinnedPool:
    """The process-wide pool, limited by ``distmm.pinned-pool`` (made on first use).

    A pool that was closed is replaced by a fresh one on the next call.
    """
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            from distmm.config import get_config

            _default_pool = PinnedPool(get_config().pinned_pool)
        return _default_pool


@atexit.register
def _close_all_pools() -> None:  # pragma: no cover - runs at interpreter exit
    for pool in list(_live_pools):
        try:
            pool.close()
        except Exception:
            pass
