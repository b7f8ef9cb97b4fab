"""Operands and error checks of the benchmarks.

This module covers: ``relerr`` (host, float64), fresh random device operands and the
float64 check on the GPU (``random_operands``, ``relerr_gpu``: ``distmm tune``'s own, the one
copy), ``raw_runner``, a call of one registered raw kernel, and ``write_operand``, a random
``.npy`` file written a row block at a time.
It does not cover the operands made on Dask workers (``bench.common.clusters``) or by MPI
ranks (``bench/mpi_blocks.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from distmm.cli.tune import random_operands, relerr_gpu

__all__ = ["relerr", "random_operands", "relerr_gpu", "raw_runner", "write_operand"]


def relerr(c, c_ref) -> float:
    """``norm(C - C_ref) / norm(C_ref)`` in float64 on the host."""
    c = np.asarray(c, dtype=np.float64)
    c_ref = np.asarray(c_ref, dtype=np.float64)
    den = np.linalg.norm(c_ref)
    return float(np.linalg.norm(c - c_ref) / den) if den else float(np.linalg.norm(c))


def raw_runner(kernel: str, params: dict | None, a, b, c, **launch) -> Callable[[], None]:
    """A call of registered kernel ``kernel`` computing ``c = a @ b`` (untransposed, dense)
    with template ``params``; ``launch`` goes to ``cuda_loader.launch`` (``defines``,
    ``split_tail``, ...)."""
    from distmm.executor import cuda_loader

    m, k = a.shape
    n = b.shape[1]

    def run():
        cuda_loader.launch(kernel, a, False, k, b, False, n, c, n, m, n, k, params=params,
                           **launch)
    return run


def write_operand(path: Path, rows: int, cols: int, dtype, seed: int, gpu: bool) -> None:
    """A ``.npy`` of standard normal values, written a row block at a time."""
    dtype = np.dtype(dtype)
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                 "shape": (rows, cols)})
        step = max(1, (256 << 20) // max(1, cols * dtype.itemsize))
        if gpu:
            import cupy

            rng = cupy.random.default_rng(seed)
            for r in range(0, rows, step):
                fh.write(rng.standard_normal((min(step, rows - r), cols), dtype=dtype).get().data)
        else:
            rng = np.random.default_rng(seed)
            for r in range(0, rows, step):
                fh.write(rng.standard_normal((min(step, rows - r), cols), dtype=dtype).data)
