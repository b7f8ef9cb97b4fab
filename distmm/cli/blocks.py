"""Benchmark operands made block by block, the same matrix whatever the ranks (``distmm
bench``, ``bench/mpi.py``), and the float64 check of sampled rows of C.

This module covers: a deterministic matrix per ``(seed, which)`` whose element
``(i, j)`` is draw number ``i * ncols + j`` of a counter-based generator
(numpy's ``Philox`` keyed by the seed and the matrix), mapped to ``[-1, 1)``
and cast to the dtype. Because the generator's counter jumps straight to any
draw, ``block`` makes one rank's block (any rows and columns) without making
anything else, so no rank ever holds a whole matrix, and the blocks of any
layout on any number of ranks put together give the same matrix (``full``
makes it whole, for the single-process references). ``rows`` makes chosen rows
of a column range, for the sampled float64 checks: ``rows_product`` (sampled rows of A
times B in float64 on B's device) and ``check_rows`` (the same over the ranks of an MPI
product, with no rank holding a whole matrix).
It does *not* cover: the benchmarks themselves, timing or records (``distmm.cli.bench``,
``bench/mpi.py``). mpi4py and cupy are imported inside the functions that need them.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["block", "full", "rows", "sample_rows", "rows_product", "check_rows",
           "SAMPLE_ROWS", "A", "B"]

A, B = 0, 1  # ``which``: the two operands of one product
SAMPLE_ROWS = 64  # rows of C checked against float64
_SCALE = 2.0 ** -52  # (raw >> 11) * 2**-53 * 2 - 1: uniform on [-1, 1)


def _draws(key: int, start: int, count: int) -> np.ndarray:
    """Draws ``start .. start + count`` of the stream ``key`` as float64 on [-1, 1)."""
    if count <= 0:
        return np.empty(0)
    lane = start % 4  # Philox makes 4 draws per counter step
    raw = np.random.Philox(key=key, counter=start // 4).random_raw(count + lane)[lane:]
    return (raw >> np.uint64(11)).astype(np.float64) * _SCALE - 1.0


def _key(seed: int, which: int) -> int:
    return (int(seed) << 1) | int(which)


def rows(which: int, shape, row_indices, c0: int, c1: int, dtype, seed: int = 0) -> np.ndarray:
    """Rows ``row_indices`` and columns ``c0:c1`` of the matrix, as ``dtype``."""
    key, ncols = _key(seed, which), int(shape[1])
    out = np.empty((len(row_indices), c1 - c0), dtype=dtype)
    for r, i in enumerate(row_indices):
        out[r] = _draws(key, int(i) * ncols + c0, c1 - c0)
    return out


def block(which: int, shape, bounds, dtype, seed: int = 0, threads: int | None = None) -> np.ndarray:
    """The block ``rows r0:r1, columns c0:c1`` (``bounds = (r0, r1, c0, c1)``) of the matrix
    ``which`` of ``shape``, as a new C-contiguous ``dtype`` array, made by ``threads``
    threads (default: the cores this process may use)."""
    r0, r1, c0, c1 = (int(x) for x in bounds)
    nrows, ncols = int(shape[0]), int(shape[1])
    if not (0 <= r0 <= r1 <= nrows and 0 <= c0 <= c1 <= ncols):
        raise ValueError(f"bounds {bounds} outside a {tuple(shape)} matrix")
    out = np.empty((r1 - r0, c1 - c0), dtype=dtype)
    if out.size == 0:
        return out
    key = _key(seed, which)
    whole_rows = c0 == 0 and c1 == ncols  # one contiguous stretch of the stream
    step = max(1, (1 << 22) // max(c1 - c0, 1))  # about 4M draws per piece

    def fill(lo: int) -> None:
        hi = min(lo + step, r1)
        if whole_rows:
            out[lo - r0:hi - r0] = _draws(key, lo * ncols, (hi - lo) * ncols).reshape(hi - lo, ncols)
        else:
            for i in range(lo, hi):
                out[i - r0] = _draws(key, i * ncols + c0, c1 - c0)

    starts = range(r0, r1, step)
    threads = threads or len(os.sched_getaffinity(0))
    if threads <= 1 or len(starts) == 1:
        for lo in starts:
            fill(lo)
    else:
        with ThreadPoolExecutor(min(threads, len(starts))) as pool:
            list(pool.map(fill, starts))
    return out


def full(which: int, shape, dtype, seed: int = 0, threads: int | None = None) -> np.ndarray:
    """The whole matrix (for single-process references)."""
    return block(which, shape, (0, shape[0], 0, shape[1]), dtype, seed, threads)


def sample_rows(n: int, count: int = 64) -> np.ndarray:
    """The rows of C that the benchmark checks against a float64 product (all when few)."""
    if n <= count:
        return np.arange(n)
    return np.sort(np.random.default_rng(n).choice(n, count, replace=False))


def rows_product(a_rows, b, chunk: int = 4096) -> np.ndarray:
    """``a_rows @ b`` in float64 on ``b``'s device (column chunks of b, so a float64 copy
    of b never needs more than ``k x chunk`` elements)."""
    if hasattr(b, "__cuda_array_interface__"):
        import cupy

        a64 = cupy.asarray(a_rows, dtype=np.float64)
        out = np.empty((a_rows.shape[0], b.shape[1]))
        for j in range(0, b.shape[1], chunk):
            out[:, j:j + chunk] = (a64 @ b[:, j:j + chunk].astype(np.float64)).get()
        return out
    a64 = np.asarray(a_rows, dtype=np.float64)
    out = np.empty((a64.shape[0], b.shape[1]))
    for j in range(0, b.shape[1], chunk):
        out[:, j:j + chunk] = a64 @ np.asarray(b[:, j:j + chunk], dtype=np.float64)
    return out


def check_rows(comm, b_local, b_bounds, c_local, c_bounds, m: int, n: int, k: int, dtype,
               sampled=None, seed: int = 0):
    """relerr of C's sampled rows (``sampled``, default ``sample_rows(m)``) against float64,
    for ``C[m, n] = A[m, k] @ B[k, n]`` with A this module's matrix ``A`` of ``seed``, with no
    rank holding a whole matrix: each rank multiplies the sampled rows of A (over its B
    block's k range, ``b_bounds = (k0, k1, c0, c1)``) by its block of B in float64, and the
    partial products and C's sampled rows (its block at ``c_bounds``) are summed on rank 0.
    Returns the relerr on rank 0, None on the others."""
    from mpi4py import MPI

    picked = sample_rows(m, SAMPLE_ROWS) if sampled is None else np.asarray(sampled)
    ref = np.zeros((picked.size, n))
    got = np.zeros((picked.size, n))
    k0, k1, c0, c1 = b_bounds
    if k1 > k0 and c1 > c0:
        a_rows = rows(A, (m, k), picked, k0, k1, dtype, seed)
        ref[:, c0:c1] = rows_product(a_rows, b_local)
    r0, r1, cc0, cc1 = c_bounds
    mine = (picked >= r0) & (picked < r1)
    if mine.any() and cc1 > cc0:
        idx = picked[mine] - r0
        if hasattr(c_local, "__cuda_array_interface__"):  # C stayed on the GPU
            import cupy

            got[mine, cc0:cc1] = c_local[cupy.asarray(idx)].get()
        else:
            got[mine, cc0:cc1] = c_local[idx]
    total_ref = np.zeros_like(ref) if comm.rank == 0 else None
    total_got = np.zeros_like(got) if comm.rank == 0 else None
    comm.Reduce(ref, total_ref, op=MPI.SUM, root=0)
    comm.Reduce(got, total_got, op=MPI.SUM, root=0)
    if comm.rank != 0:
        return None
    den = np.linalg.norm(total_ref)
    return float(np.linalg.norm(total_got - total_ref) / den) if den else float(np.linalg.norm(total_got))
