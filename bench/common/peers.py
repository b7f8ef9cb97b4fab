"""What the MPI benchmark (``bench/mpi.py``) and its peers (``bench/heat_peer.py``,
``bench/nvmath_peer.py``) share: the threads each rank gets, checking C's sampled rows against
float64 with no rank holding a whole matrix, and asking whether a peer imports in the ranks'
environment.

It does not cover launching ranks or timing (``bench/mpi.py``), nor the operands
(``bench/mpi_blocks.py``). mpi4py and cupy are imported inside the functions that need them.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from bench import mpi_blocks
from bench.mpi_blocks import A, sample_rows

__all__ = ["SAMPLE_ROWS", "threads_per_rank", "check_rows", "rows_product", "peer_import"]

SAMPLE_ROWS = 64  # rows of C checked against float64


def threads_per_rank(ranks: int) -> int:
    """BLAS (and block-making) threads of each rank: this process's cores over the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // max(ranks, 1))


def check_rows(comm, b_local, b_bounds, c_local, c_bounds, n: int, dtype: str):
    """relerr of C's sampled rows against float64, with no rank holding a whole matrix:
    each rank multiplies the sampled rows of A (over its B block's k range, ``b_bounds =
    (k0, k1, c0, c1)``) by its block of B in float64, and the partial products and C's
    sampled rows (its block at ``c_bounds``) are summed on rank 0. Used by every MPI
    variant whose ranks hold blocks of B and C (distmm-mpi, nvmath-python)."""
    from mpi4py import MPI

    rows = sample_rows(n, SAMPLE_ROWS)
    ref = np.zeros((rows.size, n))
    got = np.zeros((rows.size, n))
    k0, k1, c0, c1 = b_bounds
    if k1 > k0 and c1 > c0:
        a_rows = mpi_blocks.rows(A, (n, n), rows, k0, k1, dtype)
        ref[:, c0:c1] = rows_product(a_rows, b_local)
    r0, r1, cc0, cc1 = c_bounds
    mine = (rows >= r0) & (rows < r1)
    if mine.any() and cc1 > cc0:
        idx = rows[mine] - r0
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
    return float(np.linalg.norm(total_got - total_ref) / np.linalg.norm(total_ref))


def rows_product(a_rows, b, chunk: int = 4096) -> np.ndarray:
    """``a_rows @ b`` in float64 on ``b``'s device (column chunks of b, so a float64 copy
    of a GPU block never needs more than ``k x chunk`` elements)."""
    if hasattr(b, "__cuda_array_interface__"):
        import cupy

        a64 = cupy.asarray(a_rows, dtype=np.float64)
        out = np.empty((a_rows.shape[0], b.shape[1]))
        for j in range(0, b.shape[1], chunk):
            out[:, j:j + chunk] = (a64 @ b[:, j:j + chunk].astype(np.float64)).get()
        return out
    return np.asarray(a_rows, dtype=np.float64) @ np.asarray(b, dtype=np.float64)


def peer_import(code: str, env, failed: str) -> tuple[str | None, str]:
    """Run ``python -c code`` in the ranks' environment ``env`` (a subprocess: a peer's
    import initialises MPI or opens CUDA libraries): (its last stdout line, "") when it
    works, else (None, ``failed: <the error's own line>``)."""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 0:
        return r.stdout.strip().splitlines()[-1], ""
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    return None, f"{failed}: {last}"
