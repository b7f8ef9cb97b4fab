"""engine="mpi" gives numpy's NaN and Inf for complex products whose operands hold them.

numpy's BLAS multiplies each element's sum by ``alpha = 1 + 0j`` (gemm, gemv), so where an
Inf or NaN meets an element, both parts of numpy's element are NaN; its dot (a 1 x 1
product) makes only the real part NaN, and its own loop (k == 1) neither. SUMMA's panel
products summed on a rank, or over layers, reproduce that except where a panel is one
wide (numpy's own loop) or a rank's block of C is 1 x 1 (BLAS's dot), whose sums keep an
Inf where numpy's element is NaN unless ``distmm.nonfinite.numpys_nonfinite`` (through
``distmm.engine.tiles.finish_tile``) gives them numpy's form.
It does *not* cover: overflows of finite operands, whose Inf or NaN numpy's own BLAS
blocking decides (real dtypes too), or GPU ranks.
"""
from __future__ import annotations

import pytest

from conftest import NUMPY1_BLAS_FORMS, run_rank_script

SCRIPT = r"""
import numpy as np
from mpi4py import MPI

import distmm
from distmm.grid import make_grid

comm = MPI.COMM_WORLD
inf, nan = np.inf, np.nan


def ones(shape, dt):
    return np.full(shape, 1 + 1j, dtype=dt)


def cases():
    # (name, a, b): the same on every rank
    for dt in (np.complex128, np.complex64):
        name = np.dtype(dt).name
        a, b = ones((3, 2), dt), ones((2, 2), dt)
        a[0, 0] = inf  # (inf + 0j) * (1 + 1j): inf + infj before BLAS's alpha
        yield f"{name} inf, k = 2", a, b
        a, b = ones((2, 3), dt), ones((3, 5), dt)
        a[1, 2], b[2, 0], b[0, 4] = complex(0, -inf), 0, nan  # -inf j * 0, and a NaN
        yield f"{name} inf * 0 and NaN, k = 3", a, b
        a, b = ones((4, 4), dt), ones((4, 3), dt)
        a[0, 0], a[0, 3], a[2, 1] = inf, -inf, complex(inf, inf)  # inf + (-inf) over k
        yield f"{name} inf + (-inf) across k, k = 4", a, b
        a, b = ones((1, 2), dt), ones((2, 1), dt)
        b[1, 0] = complex(0, inf)
        yield f"{name} 1 x 1 (BLAS's dot), k = 2", a, b
        a, b = ones((1, 3), dt), ones((3, 4), dt)
        a[0, 1] = complex(-inf, 1)
        yield f"{name} one row (gemv), k = 3", a, b
        a, b = ones((5, 1), dt), ones((1, 4), dt)
        a[2, 0], b[0, 3] = complex(0, inf), nan
        yield f"{name} k = 1 (numpy's own loop)", a, b
        rng = np.random.default_rng(5)
        k = 4096
        a = (rng.standard_normal((8, k)) + 1j * rng.standard_normal((8, k))).astype(dt)
        b = (rng.standard_normal((k, 8)) + 1j * rng.standard_normal((k, 8))).astype(dt)
        a[0, 10], a[0, k - 10], a[3, 5] = inf, -inf, complex(0, inf)  # one in each half
        b[k - 1, 2], b[7, 6], a[6, 20], b[20, 1] = complex(inf, -inf), nan, inf, 0
        assert make_grid(8, 8, k, dt, ranks=comm.size).layers == comm.size  # k split
        yield f"{name} long k split over the ranks", a, b


def pattern(z):
    return [f(part) for part in (z.real, z.imag) for f in (np.isnan, np.isinf)]


lines = []
np.seterr(all="ignore")
for name, a, b in cases():
    assert np.isnan(a @ b).any()
    for how, want, got in (
            ("matmul", a @ b, distmm.matmul(a, b, engine="mpi")),
            ("stack", (np.stack([a, a]) @ b)[1],
             distmm.matmul(np.stack([a, a]), b, engine="mpi")[1]),
            ("gemm", 2.0 * (a @ b), distmm.gemm(a, b, alpha=2.0, engine="mpi"))):
        same = all(np.array_equal(x, y) for x, y in zip(pattern(want), pattern(got)))
        lines.append(f"{name}, {how}: " + ("ok" if same else
                     f"BAD numpy {want.ravel()[:4]} got {got.ravel()[:4]}"))
    reports = []  # numpy's "invalid value encountered in matmul" (Inf * 0 in BLAS's alpha)
    for product in (np.matmul, lambda x, y: distmm.matmul(x, y, engine="mpi")):
        with np.errstate(all="raise"):
            try:
                product(a, b)
                reports.append(None)
            except FloatingPointError as exc:
                reports.append(str(exc))
    lines.append(f"{name}, report: " + ("ok" if reports[0] == reports[1] else
                 f"BAD numpy {reports[0]!r} got {reports[1]!r}"))
for rank, mine in enumerate(comm.gather(lines) or []):
    print("\n".join(f"rank {rank}: {line}" for line in mine), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.slow
@NUMPY1_BLAS_FORMS
def test_complex_nan_and_inf_are_numpys(ranks, tmp_path, mpirun):
    """Each part of every element NaN, Inf or finite as in numpy's ``a @ b`` (matmul, a
    stack and gemm), and numpy's floating-point report: Inf times 0 and Inf + (-Inf) over k
    with k of 2 to 4 (panels one wide), a 1 x 1 product, a row, k == 1, and a long k split
    over the ranks' layers. Before, the short-k products held Inf where numpy's were NaN
    (``inf+infj`` for ``nan+nanj``), some without numpy's "invalid value" report."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "nonfinite.py", SCRIPT, ranks)
    assert len(lines) == ranks * 2 * 7 * 4 and not bad, "\n".join(bad) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
