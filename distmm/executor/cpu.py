"""CPU executor: numba tiled kernels and BLAS through numpy.

This module covers: multiplying host panels on the CPU. ``backend="numba"``
runs distmm's own kernels (``distmm.kernels.numba_gemm``) for float32,
float64 and 64-bit integers; every other accumulation dtype (complex,
longdouble, object) goes through ``numpy.matmul`` (BLAS for floats and complex, numpy's
exact loop for integers). ``backend="blas"`` always uses ``numpy.matmul``. The executor
``"auto"`` (what ``backend="auto"`` resolves to for integer products of at most
``AUTO_LOOP_FLOPS``, and for integer products on Dask workers) runs 64-bit integer panels on
the kernels once they are loaded, and before that the process's first ``AUTO_LOOP_FLOPS`` of
them on numpy's loop (the same bits: wrap-around sums in any order), so that numba's import is
paid only once the loop has cost about as much; other dtypes as ``"blas"``. numba is imported
only when a product runs on its kernels. A reduced precision (``"tf32"``, ``"bf16"``,
``"fp16"``) is emulated: panels rounded to the format, then a float32 product
(``distmm.executor.reduced``).
It does *not* cover: tiling or scheduling (``distmm.plan``, ``distmm.engine``).
"""
from __future__ import annotations

import threading

import numpy as np

from distmm.executor.base import Executor
from distmm.fpflags import product_flags, report

#: the dtypes numpy's matmul multiplies with its (multi-threaded) BLAS
_BLAS_DTYPES = frozenset(map(np.dtype, ("float32", "float64", "complex64", "complex128")))

__all__ = ["CPUExecutor", "NUMBA_DTYPES", "AUTO_LOOP_FLOPS", "kernels_loaded", "loop_flops"]

#: accumulation dtypes distmm's numba kernels cover (``distmm.kernels.numba_gemm.SUPPORTED``,
#: repeated here so that choosing a kernel does not import numba)
NUMBA_DTYPES = ("float32", "float64", "int64", "uint64")

#: integer flops (``2 m k n`` per panel) that ``backend="auto"`` multiplies with numpy's loop in
#: a process whose numba kernels are not loaded, before it loads them: one 512 x 512 x 512
#: product. numpy's loop takes no longer for them than loading the kernels (numba's import and
#: its cached kernels) takes, so that a process whose products stay small loses at most about
#: that much against kernels loaded from the start (bench/NOTES.md, "A first integer product
#: on the CPU").
AUTO_LOOP_FLOPS = 2**28

_kernels = None  # distmm.kernels.numba_gemm once this module has imported it
_loop_flops = 0
_loop_lock = threading.Lock()


def _numba_gemm():
    """distmm's numba kernels (``distmm.kernels.numba_gemm``), imported on first use."""
    global _kernels
    if _kernels is None:
        from distmm.kernels import numba_gemm

        _kernels = numba_gemm
    return _kernels


def kernels_loaded() -> bool:
    """Whether a product of this process has run on distmm's numba kernels (numba imported)."""
    return _kernels is not None


def loop_flops() -> int:
    """Flops of integer panels that ``backend="auto"`` has multiplied with numpy's loop in this
    process while the kernels were not loaded (at most ``AUTO_LOOP_FLOPS``)."""
    return _loop_flops


def _on_loop(a, b) -> bool:
    """Whether ``backend="auto"`` multiplies these integer panels with numpy's loop: the
    kernels are not loaded yet and the loop's flops stay within ``AUTO_LOOP_FLOPS`` with
    them (then they are counted). Panels that would pass it go to the kernels, which load."""
    global _loop_flops
    if _kernels is not None:
        return False
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    with _loop_lock:
        if _loop_flops + flops > AUTO_LOOP_FLOPS:
            return False
        _loop_flops += flops
        return True


#: largest ``b`` panel that ``_loop_product`` copies (the numba kernels' packing buffers take
#: about as much)
_LOOP_COPY_BYTES = 4 << 20


def _loop_product(a, b):
    """``a @ b`` of integer panels on numpy's loop, which reads ``b`` down its columns: a
    column-major copy of ``b`` (up to ``_LOOP_COPY_BYTES``) makes those reads contiguous,
    where a row-major ``b`` whose rows lie a multiple of 4 KiB apart maps a column onto a few
    cache sets. Wrapping integer sums give the same bits in any layout."""
    if b.nbytes <= _LOOP_COPY_BYTES:
        b = np.asfortranarray(b)
    return np.matmul(a, b)


class CPUExecutor(Executor):
    """Multiply panels on the CPU.

    Parameters
    ----------
    backend : {"numba", "blas", "auto"}
        ``"numba"``: distmm's numba kernels where they support the dtype.
        ``"blas"``: ``numpy.matmul`` (multi-threaded BLAS for floats).
        ``"auto"``: the kernels for 64-bit integers, numpy's loop for them before the
        kernels are loaded (see ``AUTO_LOOP_FLOPS``); ``"blas"`` for other dtypes.
    precision : {"highest", "tf32", "bf16", "fp16"}
        ``"highest"``: the dtype's own product. A reduced mode (float32 panels
        only, as ``distmm.precision.check_precision`` admits) rounds both
        panels to the format and sums in float32: the tensor cores' arithmetic,
        within ``distmm.precision.error_bound`` of theirs.
    """

    def __init__(self, backend: str = "blas", precision: str = "highest"):
        if backend not in ("numba", "blas", "auto"):
            raise ValueError(f"CPU backend must be 'numba', 'blas' or 'auto', got {backend!r}")
        from distmm.precision import check_precision

        self.backend = backend
        self.name = backend
        self.precision = check_precision(precision, what="CPUExecutor")

    def threads_inside(self, dtype: np.dtype) -> bool:
        # numpy's matmul hands only these to its multi-threaded BLAS; its own loops (float16,
        # long double, integers, object) run on one thread, without a signal check, so their
        # tiles need the engine's pool (a Ctrl-C waited for the whole product); the local
        # engine runs object tiles in the caller's thread (the loop holds the GIL)
        return self.backend != "numba" and np.dtype(dtype) in _BLAS_DTYPES

    def strip_rows(self, dtype: np.dtype) -> int | None:
        """The fewest rows of one call where a panel product is computed a strip of rows at
        a time, or ``None`` where its rows may depend on its other rows (BLAS, whose
        blocking may follow the shape; numpy's object loop, whose elements report as they
        go). distmm's kernels give the same bits for any rows (each element summed over k in
        ascending order) and pack all of ``b`` on each call: 512 rows keep that a few
        percent of the call. numpy's own loops cost nothing per call."""
        dtype = np.dtype(dtype)
        if self.precision != "highest":
            return 512 if self.backend == "numba" else None
        if self._uses_numba(dtype):
            return 512
        return None if dtype in _BLAS_DTYPES or dtype == object else 8

    def supports(self, dtype: np.dtype) -> bool:
        return np.dtype(dtype).kind in "iufcO"

    def _uses_numba(self, dtype: np.dtype) -> bool:
        # Decided without importing numba: importing it and compiling its
        # float64 kernel took a process with distributed imported from 58 to
        # 170 MiB peak RSS here (2026-11-24), which BLAS products and dtypes
        # the kernels do not cover never need.
        name = np.dtype(dtype).name
        if self.backend == "auto":
            return name in ("int64", "uint64")
        return self.backend == "numba" and name in NUMBA_DTYPES

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
            if self.backend == "auto" and _on_loop(a, b):
                return _loop_product(a, b)
            p = _numba_gemm().panel_product(a, b, tk)
            report(product_flags(a, b, p))  # numpy's loop would have raised these
            return p
        return np.matmul(a, b)

    def _reduced(self, a, b, tk: int):
        from distmm.executor.reduced import reduced_product

        if a.dtype != np.float32 or b.dtype != np.float32:
            raise TypeError(f"precision={self.precision!r} multiplies float32 panels, got "
                            f"{a.dtype} @ {b.dtype}")
        if self.backend == "numba":
            return reduced_product(a, b, self.precision,
                                   lambda x, y: _numba_gemm().panel_product(x, y, tk))
        return reduced_product(a, b, self.precision)
