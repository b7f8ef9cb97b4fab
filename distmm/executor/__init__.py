"""Executors multiply tiles on one device; ``get_executor`` picks one.

Backends: ``numba`` and ``blas`` on the CPU (``distmm.executor.cpu``); ``raw``
(distmm's CUDA kernels) and ``cublas`` on the GPU (``distmm.executor.gpu``,
needs ``pip install "distmm[gpu]"``).
"""
from __future__ import annotations

import functools

import numpy as np

from distmm.executor.base import BackendUnavailable, Executor
from distmm.executor.cpu import AUTO_LOOP_FLOPS

__all__ = ["Executor", "BackendUnavailable", "get_executor", "resolve_backend", "CPU_BACKENDS",
           "GPU_BACKENDS", "BACKENDS", "gpu_available", "missing_gpu", "AUTO_GPU_MIN_FLOPS",
           "AUTO_LOOP_FLOPS"]

CPU_BACKENDS = ("numba", "blas")
GPU_BACKENDS = ("raw", "cublas")
BACKENDS = ("auto",) + CPU_BACKENDS + GPU_BACKENDS


#: smallest product (flops) that ``backend="auto"`` sends from host memory to a GPU
AUTO_GPU_MIN_FLOPS = 2 * 1024**3


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """Whether cupy imports and sees at least one CUDA device (asked once per process)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def missing_gpu(backend: str) -> str | None:
    """The GPU backend asked for (``"auto"``: the configured one) where this machine has no
    GPU, else None: what a command refuses, or notes, before any work."""
    if backend == "auto":
        from distmm.config import get_config

        backend = get_config().backend
    return backend if backend in GPU_BACKENDS and not gpu_available() else None


def resolve_backend(backend: str, dtype: np.dtype, *, family: str, flops: int,
                    workers_decide: bool = False) -> tuple[str, bool]:
    """Resolve a requested backend once, for a whole product.

    Parameters
    ----------
    backend : str
        One of ``BACKENDS`` (configuration already applied by the caller).
    dtype : dtype
        numpy's result dtype of the product.
    family : {"numpy", "cupy", "dask"}
        Where the operands live.
    flops : int
        ``2 m n k`` times the batch size.
    workers_decide : bool
        The engine's workers pick their own device (a Dask cluster): ``"auto"``
        stays ``"auto"`` for them to resolve against the device they have.

    Returns
    -------
    (backend, on_gpu)
        ``backend`` is ``"numba"``, ``"blas"``, ``"raw"``, ``"cublas"`` or, with
        ``on_gpu``, ``"auto"`` (the GPU executor's per-shape choice); ``"auto"``
        without ``on_gpu`` when ``workers_decide``, and for an integer (or boolean)
        product of at most ``AUTO_LOOP_FLOPS``: the CPU executor's choice between
        numpy's loop and the numba kernels, whose bits are the same
        (``distmm.executor.cpu``); larger ones are ``"numba"``. Host operands go to
        the GPU for large float32/float64 products when a GPU is present.
        ``"auto"`` for a float16 product of host operands is ``"numba"``, also
        where workers decide: its sums give numpy's bits, BLAS's do not.

    Raises
    ------
    ValueError
        An unknown backend, or a CPU backend for cupy operands.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    dtype = np.dtype(dtype)
    if backend in GPU_BACKENDS:
        return backend, not workers_decide
    if family == "cupy":
        if backend in CPU_BACKENDS and not workers_decide:
            raise ValueError(f"backend {backend!r} runs on the CPU; cupy operands need 'raw', "
                             f"'cublas' or 'auto'")
        return backend, not workers_decide
    if backend == "auto" and dtype == np.float16:
        # numpy's half loop: each element one ascending float32 sum over k (products of
        # halves are exact in float32). distmm's numba kernels sum in that order with one
        # FMA per term, so they give numpy's bits; BLAS's blocked sums differ by 1 ulp in
        # a few elements of a thousand, by more where a sum cancels.
        return "numba", False
    if backend in CPU_BACKENDS or workers_decide:
        return backend, False
    if dtype in (np.float32, np.float64) and flops >= AUTO_GPU_MIN_FLOPS and gpu_available():
        return "auto", True
    if dtype.kind in "biu":
        # resolved once per call signature (the call cache keeps it), so a small product is
        # left to the executor, which moves to the kernels once they are loaded
        return ("auto" if flops <= AUTO_LOOP_FLOPS else "numba"), False
    return "blas", False


def get_executor(backend: str, acc_dtype: np.dtype, *, on_gpu: bool = False,
                 precision: str = "highest") -> Executor:
    """Return an executor for ``backend``.

    ``precision`` (``distmm.precision``'s modes) is applied by the executor to
    every panel it multiplies: emulated on the CPU (``distmm.executor.reduced``),
    on the tensor cores on the GPU (a registry kernel for the mode, else cuBLAS).

    ``backend="auto"`` picks the GPU executor (its own auto choice between
    ``raw`` and ``cublas``) when ``on_gpu``; on the CPU it picks BLAS for
    floating and complex dtypes, where OpenBLAS is fastest, and for integers,
    where numpy has no BLAS and its loop is slow, the CPU executor ``"auto"``:
    the numba kernels, or numpy's loop while loading them would cost more
    (``distmm.executor.cpu.AUTO_LOOP_FLOPS``).

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
        return _gpu_executor(backend, precision)
    if backend == "auto":
        backend = "auto" if np.dtype(acc_dtype).kind in "iu" else "blas"
    return _cpu_executor(backend, precision)


_executor_for = None


def _gpu_executor(backend: str, precision: str = "highest") -> Executor:
    """The shared GPU executor of ``backend`` on the current device
    (``distmm.executor.gpu.executor_for``, imported on first use); without
    cupy, ``BackendUnavailable`` naming ``backend``."""
    global _executor_for
    if _executor_for is None:
        try:
            from distmm.executor.gpu import executor_for
        except ImportError as exc:
            raise BackendUnavailable(
                f"backend {backend!r} needs cupy and a CUDA GPU: pip install \"distmm[gpu]\" ({exc})"
            ) from exc
        _executor_for = executor_for
    return _executor_for(backend) if precision == "highest" else _executor_for(backend, precision)


@functools.lru_cache(maxsize=None)
def _cpu_executor(backend: str, precision: str = "highest") -> Executor:
    """One shared CPU executor per backend and precision: it holds no state between
    products (its ``close`` frees nothing), so every product and thread may use it."""
    from distmm.executor.cpu import CPUExecutor

    return CPUExecutor(backend=backend, precision=precision)
