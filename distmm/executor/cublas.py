"""cuBLAS through cupy: the one wrapper every GPU path multiplies with.

This module covers: ``cublas_gemm(a, b, c, alpha, beta)``, computing
``c = alpha * a @ b + beta * c`` into a preallocated cupy array on the current
stream (``cupy.matmul`` for ``beta == 0``, ``cupy.cublas.gemm`` in place for
``beta != 0`` when the dtypes and layout allow, else a temporary), and
``CublasGemm``, the smallest executor the stream pipeline can use (its
``device_gemm`` adds a stream).

It does *not* cover: distmm's own kernels (``distmm.executor.cuda_loader``),
choosing between them and cuBLAS (``distmm.executor.gpu``), or dtype promotion
(callers pass operands of ``c``'s dtype). cupy is imported on first use.
"""
from __future__ import annotations

import contextlib

__all__ = ["cublas_gemm", "CublasGemm"]


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
