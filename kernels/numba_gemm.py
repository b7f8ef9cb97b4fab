"""numba CPU GEMM kernels: ``c += a @ b`` on one core, deterministic.

Compiled with ``nogil=True`` so the local and Dask engines run one kernel per
thread. No fast-math that assumes finite values: NaN and Inf propagate as in
numpy.
"""
from __future__ import annotations

import numba
import numpy as np

SUPPORTED = ("float32", "float64", "int64", "uint64")


@numba.njit(nogil=True, cache=True)
def gemm_accumulate(a, b, c, tk):
    """``c += a @ b`` for 2-D arrays of one dtype, k blocked by ``tk``."""
    m, kk = a.shape
    n = b.shape[1]
    for k0 in range(0, kk, tk):
        k1 = min(kk, k0 + tk)
        for i in range(m):
            for p in range(k0, k1):
                aip = a[i, p]
                for j in range(n):
                    c[i, j] += aip * b[p, j]


def panel_product(a: np.ndarray, b: np.ndarray, tk: int = 256) -> np.ndarray:
    """Return ``a @ b`` computed by the numba kernel (dtype of ``a``)."""
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b, dtype=a.dtype)
    c = np.zeros((a.shape[0], b.shape[1]), dtype=a.dtype)
    if a.shape[1]:
        gemm_accumulate(a, b, c, max(int(tk), 1))
    return c
