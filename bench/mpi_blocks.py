"""Benchmark operands made block by block, the same matrix whatever the ranks (``bench/mpi.py``).

This module covers: a deterministic matrix per ``(seed, which)`` whose element
``(i, j)`` is draw number ``i * ncols + j`` of a counter-based generator
(numpy's ``Philox`` keyed by the seed and the matrix), mapped to ``[-1, 1)``
and cast to the dtype. Because the generator's counter jumps straight to any
draw, ``block`` makes one rank's block (any rows and columns) without making
anything else, so no rank ever holds a whole matrix, and the blocks of any
layout on any number of ranks put together give the same matrix (``full``
makes it whole, for the single-process references). ``rows`` makes chosen rows
of a column range, for the sampled float64 checks.
It does *not* cover: the benchmark itself, timing or records (``bench/mpi.py``).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["block", "full", "rows", "sample_rows", "A", "B"]

A, B = 0, 1  # ``which``: the two operands of one product
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
