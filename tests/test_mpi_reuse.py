"""The MPI engine makes its grid communicators once and reuses them (real mpiexec, CPU).

Each launch runs tests/mpi_reuse_cases.py on every rank (P = 1..4, fresh random
operands): repeated products add reuses and no creations to
``distmm.engine.mpi.cache_stats()`` and give equal bits and float64-close values; every
grid of P ranks is made once on a duplicated communicator, whose ``Free`` releases them
all; ``release`` closes them and the next product makes them again; what is left goes
at interpreter exit, or inside an explicit ``MPI.Finalize()``. The verdict is agreed by
all ranks; a subprocess timeout bounds a hang.
"""
from __future__ import annotations

from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parent / "mpi_reuse_cases.py"

pytestmark = pytest.mark.mpi


# 2 and 3 ranks (the smallest grid of several ranks, and an odd one) by default; 1 and 4
# under ``pytest -m slow``
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow), 3,
                                   pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_grid_communicators_are_reused_and_released_at_exit(ranks, mpirun):
    r = mpirun(ranks, CASES)
    assert "VERDICT ok" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    assert "EXITED live=0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_grid_communicators_are_released_in_finalize(mpirun):
    r = mpirun(2, CASES, "finalize")
    assert "VERDICT ok" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    assert "FINALIZED live=0 " in r.stdout and ": all" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
