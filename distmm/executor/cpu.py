"""CPU executor: numba tiled kernels and BLAS through numpy.

This module covers: multiplying host panels on the CPU. ``backend="numba"``
runs distmm's own kernels (``distmm.kernels.numba_gemm``) for float32,
float64 and 64-bit integers; every other accumulation dtype (complex,
longdouble, object) goes through ``numpy.matmul`` (BLAS for floats and complex, numpy's
exact loop for integers). ``backend="blas"`` always uses ``numpy.matmul``. numba is
imported only when a product runs on its kernels. A reduced precision (``"tf32"``,
``"bf16"``, ``"fp16"``) is emulated: panels rounded to the format, then a float32
product (``distmm.executor.reduced``).
It does *not* cover: tiling or scheduling (``distmm.plan``, ``distmm.engine``).
"""
from __future__ import annotations

import numpy as np

from distmm.executor.base import Executor
from distmm.fpflags import product_flags, report

#: the dtypes numpy's matmul multiplies with its (multi-threaded) BLAS
_BLAS_DTYPES = frozenset(map(np.dtype, ("float32", "float64", "complex64", "complex128")))

__all__ = ["CPUExecutor", "NUMBA_DTYPES"]

#: accumulation dtypes distmm's numba kernels cover (``distmm.kernels.numba_gemm.SUPPORTED``,
#: repeated here so that choosing a kernel does not import numba)
NUMBA_DTYPES = ("float32", "float64", "int64", "uint64")


class CPUExecutor(Executor):
    """Multiply panels on the CPU.

    Parameters
    ----------
    backend : {"numba", "blas"}
        ``"numba"``: distmm's numba kernels where they support the dtype.
        ``"blas"``: ``numpy.matmul`` (multi-threaded BLAS for floats).
    precision : {"highest", "tf32", "bf16", "fp16"}
        ``"highest"``: the dtype's own product. A reduced mode (float32 panels
        only, as ``distmm.precision.check_precision`` admits) rounds both
        panels to the format and sums in float32: the tensor cores' arithmetic,
        within ``distmm.precision.error_bound`` of theirs.
    """

    def __init__(self, backend: str = "blas", precision: str = "highest"):
        if backend not in ("numba", "blas"):
            raise ValueError(f"CPU backend must be 'numba' or 'blas', got {backend!r}")
        from distmm.precision import check_precision

        self.backend = backend
        self.name = backend
        self.precision = check_precision(precision, what="CPUExecutor")

    def threads_inside(self, dtype: np.dtype) -> bool:
        # numpy's matmul hands only these to its multi-threaded BLAS; its own loops (float16,
        # long double, integers, object) run on one thread, without a signal check, so their
        # tiles need the engine's pool (a Ctrl-C waited for the whole product); the local
        # engine runs object tiles in the caller's thread (the loop holds the GIL)
        return self.backend == "blas" and np.dtype(dtype) in _BLAS_DTYPES

    def supports(self, dtype: np.dtype) -> bool:
        return np.dtype(dtype).kind in "iufcO"

    def _uses_numba(self, dtype: np.dtype) -> bool:
        # Decided without importing numba: importing it and compiling its
        # float64 kernel took a process with distributed imported from 58 to
        # 170 MiB peak RSS here (2026-11-24), which BLAS products and dtypes
        # the kernels do not cover never need.
        return self.backend == "numba" and np.dtype(dtype).name in NUMBA_DTYPES

    def asarray(self, x, dtype):
        # The numba kernels pack their operands themselves and accept any strides:
        # a view of the caller's array is enough (no copy when the dtype matches).
        if self._uses_numba(dtype):
            return np.asarray(x, dtype=dtype)
        return super().asarray(x, dtype)

    def panel_product(self, a, b, tk: int = 256):
        if self.precision != "highest":
            return self._reduced(a, b, tk)
        if self._uses_numba(a.dtype):
            from distmm.kernels import numba_gemm

            p = numba_gemm.panel_product(a, b, tk)
            report(product_flags(a, b, p))  # numpy's loop would have raised these
            return p
        return np.matmul(a, b)

    def _reduced(self, a, b, tk: int):
        from distmm.executor.reduced import reduced_product

        if a.dtype != np.float32 or b.dtype != np.float32:
            raise TypeError(f"precision={self.precision!r} multiplies float32 panels, got "
                            f"{a.dtype} @ {b.dtype}")
        if self.backend == "numba":
            from distmm.kernels import numba_gemm

            return reduced_product(a, b, self.precision,
                                   lambda x, y: numba_gemm.panel_product(x, y, tk))
        return reduced_product(a, b, self.precision)
