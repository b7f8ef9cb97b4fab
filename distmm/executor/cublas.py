"""cuBLAS through cupy: the one wrapper every GPU path multiplies with.

This module covers: ``cublas_gemm(a, b, c, alpha, beta)``, computing
``c = alpha * a @ b + beta * c`` into a preallocated cupy array on the current
stream (``cupy.matmul`` for ``beta == 0``, ``cupy.cublas.gemm`` in place for
``beta != 0`` when the dtypes and layout allow, else a temporary), and
``CublasGemm``, the smallest executor the stream pipeline can use (its
``device_gemm`` adds a stream), and ``start_cublas``, cuBLAS's start-up on a
background thread.

It does *not* cover: distmm's own kernels (``distmm.executor.cuda_loader``),
choosing between them and cuBLAS (``distmm.executor.gpu``), or dtype promotion
(callers pass operands of ``c``'s dtype). cupy is imported on first use.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading

__all__ = ["cublas_gemm", "CublasGemm", "start_cublas"]

_started: dict = {}  # (device id, dtype name) -> Future of the start-up
_started_lock = threading.Lock()


def _start_up(device_id: int, dtype) -> None:
    import cupy

    # A stream of its own that does not wait for the legacy default stream: the caller's
    # own GPU work (making its operands) may still be running there.
    with cupy.cuda.Device(device_id), cupy.cuda.Stream(non_blocking=True) as stream:
        cupy.cuda.device.get_cublas_handle()
        # empty, not ones: filling needs cupy's elementwise kernel, compiled by NVRTC on a
        # cold kernel cache; the values are never read
        x = cupy.empty((256, 256), dtype=dtype)
        c = cupy.empty_like(x)
        cublas_gemm(x, x, c, 1, 0)
        cublas_gemm(x, x, c, 1, 1)  # the in-place path of the later k-blocks
        stream.synchronize()


def start_cublas(dtype):
    """Start cuBLAS for ``dtype`` on the current device on a background thread: its
    library, handle and first kernels (most of it loading cuBLASLt's kernels).
    Returns the thread's Future: the same one on every
    call for this dtype and device (it runs once). A caller that goes on with other
    start-up work (allocating, pinning, staging the first tiles) pays only what is left
    of it at its first GEMM.
    A failure is kept in the Future; the first GEMM then raises it itself."""
    import cupy
    import numpy as np

    key = (cupy.cuda.runtime.getDevice(), np.dtype(dtype).name)
    with _started_lock:
        if key in _started:
            return _started[key]
        fut: cf.Future = cf.Future()
        _started[key] = fut

    def run():
        try:
            _start_up(key[0], key[1])
            fut.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - kept for the caller
            fut.set_exception(exc)

    threading.Thread(target=run, name="distmm-cublas-start", daemon=True).start()
    return fut


def cublas_gemm(a, b, c, alpha=1, beta=0) -> None:
    """``c = alpha * a @ b + beta * c`` on cupy's current stream; ``beta == 0``
    means ``c`` is not read."""
    import cupy

    one = alpha == 1
    if beta == 0:
        if one:
            cupy.matmul(a, b, out=c)
        else:
            cupy.multiply(cupy.matmul(a, b), c.dtype.type(alpha), out=c)
        return
    if c.dtype.kind in "fc" and c.flags.c_contiguous and a.dtype == b.dtype == c.dtype:
        # In place: no temporary and no extra passes over c (the pipeline
        # accumulates every k-block after the first with beta = 1).
        from cupy import cublas

        cublas.gemm("N", "N", a, b, out=c, alpha=alpha, beta=beta)
        return
    prod = cupy.matmul(a, b)
    if not one:
        prod *= c.dtype.type(alpha)
    c *= c.dtype.type(beta)
    c += prod


class CublasGemm:
    """cuBLAS as a ``device_gemm`` provider: ``device_gemm(a, b, c, alpha=1,
    beta=0, stream=None)`` runs ``cublas_gemm`` on ``stream`` and returns ``c``."""

    name = "cublas"

    def device_gemm(self, a, b, c, *, alpha=1.0, beta=0.0, stream=None):
        with stream if stream is not None else contextlib.nullcontext():
            cublas_gemm(a, b, c, alpha, beta)
        return c

    def close(self) -> None:
        pass
