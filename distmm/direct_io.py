"""Writing large contiguous file ranges past the page cache (``O_DIRECT``), for staged outputs.

This module covers: ``SpanWriter``, which writes one contiguous byte range of a file with
``O_DIRECT`` for its block-aligned middle (several writes in flight, from a few threads) and
ordinary ``pwrite`` for the unaligned ends; ``aligned_split``, the pure arithmetic of that cut;
``npy_header``, a ``.npy`` header padded to ``ALIGN`` bytes, so that C's rows start on a block
boundary whenever a row is a multiple of it; ``preallocate``, which gives a staged file its
blocks at creation (Linux ``fallocate``: a full disk is found before any work, and direct
writes do not allocate as they go).

Why: writes through the page cache reach the disk at the rate of the kernel's writeback (one
flusher per device); direct writes were faster on the GPU hosts' disks (``bench/NOTES.md``,
"Batch jobs: ``mpirun distmm matmul`` on files"). ``distmm.direct-writes: false`` turns
it off (a file system that refuses ``O_DIRECT`` is written the ordinary way without asking).

It does *not* cover: which writes are whole rows (``distmm.staging.BlockWriter``), staging
and committing outputs (``distmm.staging``).
"""
from __future__ import annotations

import io
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from distmm.threads import submit

__all__ = ["ALIGN", "CHUNK", "THREADS", "MIN_DIRECT", "aligned_split", "as_bytes", "npy_header",
           "libc_function", "preallocate", "bounce_bytes", "SpanWriter"]

#: the alignment of a direct write's file offset, length and memory (a page: enough for the
#: logical blocks of every disk distmm meets, 512 B or 4 KiB)
ALIGN = 4096
#: bytes per direct write
CHUNK = 16 << 20
#: direct writes in flight per writer (each thread copies into its own aligned buffer when the
#: caller's memory is not aligned)
THREADS = 4
#: spans shorter than this go through the page cache (a direct write waits for the disk)
MIN_DIRECT = 1 << 20


def aligned_split(offset: int, nbytes: int, align: int = ALIGN) -> tuple[int, int]:
    """``(head, body)``: the first ``head`` bytes of the span ``[offset, offset + nbytes)``
    end at an ``align`` boundary, the next ``body`` bytes are a multiple of ``align``; the
    rest (``nbytes - head - body``) is the unaligned tail. ``body`` is 0 when the span holds
    no aligned block."""
    start = -(-offset // align) * align
    end = (offset + nbytes) // align * align
    if end <= start:
        return 0, 0
    return start - offset, end - start


def bounce_bytes(span: int) -> int:
    """The most bytes of aligned buffers a ``SpanWriter`` holds when it writes spans of at
    most ``span`` bytes from unaligned memory (numpy's arrays, as a rule): a buffer per thread
    that writes a chunk, kept until ``close``, filled up to the largest chunk it copied (at
    most ``THREADS`` of ``CHUNK`` bytes); none for spans under ``MIN_DIRECT``.

    >>> bounce_bytes(8 << 20) >> 20, bounce_bytes(40 << 20) >> 20, bounce_bytes(1 << 30) >> 20
    (8, 48, 64)
    """
    if span < MIN_DIRECT:
        return 0
    return min(THREADS, -(-span // CHUNK)) * min(CHUNK, span)


def npy_header(shape, dtype) -> bytes:
    """numpy's ``.npy`` header (format 1.0, or 2.0 when the dictionary needs it) for a
    C-ordered array, padded with spaces to ``ALIGN`` bytes when it is shorter, so the data
    starts on a block boundary (``numpy.load`` reads any padding)."""
    fmt = np.lib.format
    d = {"descr": fmt.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
         "shape": tuple(int(s) for s in shape)}
    buf = io.BytesIO()
    try:
        fmt.write_array_header_1_0(buf, d)
        size_bytes = 2
    except ValueError:  # the dictionary does not fit format 1.0's 16-bit length
        buf = io.BytesIO()
        fmt.write_array_header_2_0(buf, d)
        size_bytes = 4
    raw = buf.getvalue()
    if len(raw) >= ALIGN:
        return raw
    prefix = 8 + size_bytes  # magic string, version, header length
    text = raw[prefix:].rstrip(b"\n").rstrip(b" ")
    text = text + b" " * (ALIGN - prefix - len(text) - 1) + b"\n"
    return raw[:8] + (ALIGN - prefix).to_bytes(size_bytes, "little") + text


_LIBC: dict = {}


def libc_function(name: str, argtypes, restype):
    """The C library's function ``name`` (ctypes, errno kept), looked up once per process;
    None where the library has no such function (not Linux)."""
    if name not in _LIBC:
        import ctypes

        try:
            fn = getattr(ctypes.CDLL(None, use_errno=True), name)
            fn.argtypes, fn.restype = argtypes, restype
        except (OSError, AttributeError):
            fn = None
        _LIBC[name] = fn
    return _LIBC[name]


def preallocate(fd: int, offset: int, nbytes: int) -> bool:
    """Allocate a file's blocks for ``[offset, offset + nbytes)`` (Linux ``fallocate``, mode 0,
    the size unchanged where the file is already longer). False where the call or the file
    system does not offer it (nothing is written then: glibc's ``posix_fallocate`` would write
    zeros instead). Raises ``OSError`` for a full disk or a file-size limit."""
    if nbytes <= 0:
        return True
    import ctypes
    import errno

    fn = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
                       ctypes.c_int)
    if fn is None:
        return False

    if fn(fd, 0, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        raise OSError(err, os.strerror(err))
    return False  # EOPNOTSUPP, ENOSYS, EINVAL: the file system does not preallocate


def as_bytes(data) -> memoryview:
    """``data`` (a C-contiguous buffer) as a flat memoryview of bytes: numpy arrays through
    numpy, which also takes an empty block of a 3-D array and dtypes the buffer protocol
    does not (datetime64), where ``memoryview(data).cast("B")`` refuses."""
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return memoryview(data).cast("B")


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0


class SpanWriter:
    """Writes contiguous byte spans of ``path`` with ``O_DIRECT`` where it can.

    ``write(data, offset)``: the span's aligned middle in ``CHUNK`` writes, ``THREADS`` at
    once, straight from ``data`` where its memory is aligned, else through each thread's
    aligned buffer; the ends (and spans under ``MIN_DIRECT``) through ``fd``, the caller's
    ordinary descriptor. ``direct`` is False when the file system refused ``O_DIRECT`` (then
    every write is an ordinary one). ``written_direct``: bytes written past the page cache.
    """

    def __init__(self, path, fd: int):
        self.fd = fd
        self.written_direct = 0
        self._dfd = None
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._lock = threading.Lock()  # writers may call from several threads (tiles of C)
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                self._dfd = os.open(path, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # tmpfs and some network file systems refuse O_DIRECT
                self._dfd = None

    @property
    def direct(self) -> bool:
        return self._dfd is not None

    def write(self, data, offset: int, pwrite_all) -> None:
        """Write all of ``data`` (a buffer) at ``offset``; ``pwrite_all(fd, data, offset)`` is
        the ordinary write."""
        view = as_bytes(data)
        head, body = aligned_split(offset, view.nbytes) if self._dfd is not None else (0, 0)
        if body < MIN_DIRECT:
            pwrite_all(self.fd, view, offset)
            return
        if head:
            pwrite_all(self.fd, view[:head], offset)
        self._direct(view[head:head + body], offset + head, pwrite_all)
        if head + body < view.nbytes:
            pwrite_all(self.fd, view[head + body:], offset + head + body)

    def _direct(self, view: memoryview, offset: int, pwrite_all) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="distmm-direct")
            pool = self._pool
        aligned = _address(view) % ALIGN == 0
        # a pool that takes no new work (the interpreter shutting down while the caller's
        # thread still runs) leaves the chunks to the caller's thread
        futures = [submit(pool, self._chunk, view[s:s + CHUNK], offset + s, aligned, pwrite_all)
                   for s in range(0, view.nbytes, CHUNK)]
        error, done = None, 0
        for f in futures:  # every chunk ends before the caller may reuse its memory
            try:
                done += f.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised
                error = error or exc
        with self._lock:
            self.written_direct += done
        if error is not None:
            raise error

    def _chunk(self, view: memoryview, offset: int, aligned: bool, pwrite_all) -> int:
        """Write one chunk; return the bytes that went past the page cache."""
        if not aligned:
            bounce = getattr(self._local, "buffer", None)
            if bounce is None:
                bounce = self._local.buffer = mmap.mmap(-1, CHUNK)  # page aligned
            out = memoryview(bounce)[:view.nbytes]
            np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(view, np.uint8))
            view = out
        done = 0
        while done < view.nbytes:
            try:
                n = os.pwrite(self._dfd, view[done:], offset + done)
            except OSError as exc:
                import errno

                if exc.errno != errno.EINVAL:
                    raise
                n = 0  # this file system wants another alignment: the rest the ordinary way
            if n <= 0 or n % ALIGN:
                rest = done + max(n, 0)
                pwrite_all(self.fd, view[rest:], offset + rest)
                return rest
            done += n
        return done

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
