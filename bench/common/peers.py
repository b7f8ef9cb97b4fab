"""What the MPI benchmark (``bench/mpi.py``) and its peers (``bench/heat_peer.py``,
``bench/nvmath_peer.py``) share: the threads each rank gets, checking C's sampled rows against
float64 with no rank holding a whole matrix (``distmm.cli.blocks``'s, for square products),
and asking whether a peer imports in the ranks' environment.

It does not cover launching ranks or timing (``bench/mpi.py``), nor the operands
(``bench/mpi_blocks.py``). mpi4py and cupy are imported inside the functions that need them.
"""
from __future__ import annotations

import os
import subprocess
import sys

from distmm.cli import blocks
from distmm.cli.blocks import SAMPLE_ROWS, rows_product

__all__ = ["SAMPLE_ROWS", "threads_per_rank", "check_rows", "rows_product", "peer_import"]


def threads_per_rank(ranks: int) -> int:
    """BLAS (and block-making) threads of each rank: this process's cores over the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // max(ranks, 1))


def check_rows(comm, b_local, b_bounds, c_local, c_bounds, n: int, dtype: str):
    """relerr of C's sampled rows against float64, with no rank holding a whole matrix
    (``distmm.cli.blocks.check_rows`` for a square ``n``). Used by every MPI variant whose
    ranks hold blocks of B and C (distmm-mpi, nvmath-python)."""
    return blocks.check_rows(comm, b_local, b_bounds, c_local, c_bounds, n, n, n, dtype)


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
