"""The executor interface: multiply tiles on one device.

This module covers: the abstract ``Executor`` every device back end implements
(CPU numba/BLAS, GPU raw kernels/cuBLAS), and the contract the engines rely on.
It does *not* cover: which tiles exist or where they run (``distmm.plan``,
``distmm.engine``). Executors know nothing of Dask or MPI.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from distmm.errors import BackendUnavailable

__all__ = ["Executor", "BackendUnavailable"]


class Executor(ABC):
    """Multiplies operand panels on one device.

    Contract
    --------
    ``panel_product(a, b, tk)`` returns ``a @ b`` for a 2-D ``a`` (``tm x kg``)
    and ``b`` (``kg x tn``) whose dtype is already the plan's accumulation
    dtype. The result is a new array of that dtype on the executor's device.
    It is deterministic: the same inputs give the same bits on every call
    (no atomics, no run-time-chosen reduction order), which is what makes a
    plan's result reproducible. Inputs are never modified. Non-contiguous and
    Fortran-ordered inputs are accepted.

    ``asarray`` moves a host tile to the device (identity on the CPU) and
    ``to_host`` moves a result back.
    """

    #: short name used by ``backend=`` and in benchmark variants
    name: str = "abstract"

    @abstractmethod
    def supports(self, dtype: np.dtype) -> bool:
        """Whether ``panel_product`` handles this accumulation dtype."""

    @abstractmethod
    def panel_product(self, a: Any, b: Any, tk: int = 256) -> Any:
        """Return ``a @ b`` (see the class docstring)."""

    def threads_inside(self, dtype: np.dtype) -> bool:
        """Whether one ``panel_product`` of this accumulation dtype keeps the device busy
        by itself (multi-threaded BLAS, a GPU), so an engine runs one task at a time."""
        return False

    def asarray(self, x: Any, dtype: np.dtype) -> Any:
        return np.ascontiguousarray(x, dtype=dtype)

    def to_host(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def begin(self, plan) -> None:
        """A product of ``plan`` over host operands is about to run on this process:
        start what it will need (a GPU library) while the engine still prepares it.
        Optional; nothing by default."""

    def close(self) -> None:
        """Release device resources (streams, pinned buffers). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
