"""Operands and error checks of the benchmarks.

This module covers: ``relerr`` (host, float64), fresh random device operands and the
float64 check on the GPU (``random_operands``, ``relerr_gpu``: ``distmm tune``'s own, the one
copy), and ``raw_runner``, a call of one registered raw kernel.
It does not cover the operands made on Dask workers (``bench.common.clusters``) or by MPI
ranks (``bench/mpi_blocks.py``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from distmm.cli.tune import random_operands, relerr_gpu

__all__ = ["relerr", "random_operands", "relerr_gpu", "raw_runner"]


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
