"""Executors multiply tiles on one device; ``get_executor`` picks one.

Backends: ``numba`` and ``blas`` on the CPU (``distmm.executor.cpu``); ``raw``
(distmm's CUDA kernels) and ``cublas`` on the GPU (``distmm.executor.gpu``,
needs ``pip install "distmm[gpu]"``).
"""
from __future__ import annotations

import numpy as np

from distmm.executor.base import BackendUnavailable, Executor

__all__ = ["Executor", "BackendUnavailable", "get_executor", "CPU_BACKENDS", "GPU_BACKENDS",
           "gpu_available"]

CPU_BACKENDS = ("numba", "blas")
GPU_BACKENDS = ("raw", "cublas")
BACKENDS = ("auto",) + CPU_BACKENDS + GPU_BACKENDS


def gpu_available() -> bool:
    """Whether cupy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get_executor(backend: str, acc_dtype: np.dtype, *, on_gpu: bool = False) -> Executor:
    """Return an executor for ``backend``.

    ``backend="auto"`` picks the GPU executor (its own auto choice between
    ``raw`` and ``cublas``) when ``on_gpu``; on the CPU it picks BLAS for
    floating and complex dtypes, where OpenBLAS is fastest, and the numba
    kernels for integers, where numpy has no BLAS and its loop is slow.

    Raises
    ------
    ValueError
        Unknown backend name.
    BackendUnavailable
        A GPU backend without cupy or without a GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in GPU_BACKENDS or (backend == "auto" and on_gpu):
        try:
            from distmm.executor.gpu import GPUExecutor
        except ImportError as exc:
            raise BackendUnavailable(
                f"backend {backend!r} needs cupy and a CUDA GPU: pip install \"distmm[gpu]\" ({exc})"
            ) from exc
        return GPUExecutor(backend=backend)
    from distmm.executor.cpu import CPUExecutor

    if backend == "auto":
        backend = "numba" if np.dtype(acc_dtype).kind in "iu" else "blas"
    return CPUExecutor(backend=backend)
