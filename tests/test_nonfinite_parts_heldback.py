"""Complex products summed from k parts one of which is one wide in k give numpy's Inf and
NaN, as numpy's ``a @ b`` of the whole arrays does.

numpy's BLAS multiplies each element's sum by ``alpha = 1 + 0j`` (gemm and gemv: both
parts; dot: the real part), so a sum ``inf + xj`` (x finite: its terms overflowed in the
real part) comes out ``inf+nanj``; numpy's own loop (a call one wide in k) does not
multiply by alpha. distmm sums C from k parts (the local engine's k groups, SUMMA's panels,
the batch path's panels); where one was one wide, ``distmm.nonfinite.numpys_nonfinite``
could not tell numpy's ``inf+nanj`` from a one-wide part's ``inf * 0`` and made it
``nan+nanj``. The engines now give a one-wide part's product the form of the other parts'
calls (``distmm.nonfinite.as_whole_call``).
The operands make every term of the overflowing elements overflow by itself (row 1 of A
in the real part, row 3 in the imaginary part), so numpy's result does not depend on its
BLAS's order of the sum; other rows hold Inf and NaN operands (Inf times 0, Inf + (-Inf)
over k), which numpy turns ``nan+nanj``.
Covers: the local engine (k groups one wide: k of 3, 7 and 9; several rows and columns,
one row: gemv), ``distmm.gemm``, ``engine="mpi"`` on 2 ranks (a SUMMA panel one wide; a
stack) and ``mpirun distmm matmul`` on 2 ranks (the batch path's broadcast panels),
complex64 and complex128, both parts.
It does *not* cover: a block of C that is 1 x 1 in a larger product (BLAS's dot spreads
otherwise than the whole product's call: see ``distmm.nonfinite``), sums that overflow only
in some orders, GPU results.
"""
from __future__ import annotations

import inspect

import dask
import numpy as np
import pytest

import distmm
from conftest import recorded, run_rank_script

inf, nan = np.inf, np.nan

#: a memory budget so small that the planner splits k into as many groups as it has k-blocks
#: (``make_plan``: a k group's panels must fit half the budget)
SPLIT_ALL = {"distmm.memory-budget": 32, "distmm.local-threads": 1}


def operands(rng, m, n, k, dtype):
    """Random operands: row 1 of A (where m > 1) overflows every term's real part, row 3
    (where m > 3) every term's imaginary part, and row 0 does both where m is 1 (row 0's
    columns in two halves); rows 2 and 4 hold Inf and NaN operands. B's imaginary parts are
    small, so the other part stays finite."""
    big = np.finfo(dtype).max / 2
    a = 1 + rng.standard_normal((m, k)) + 1j * rng.standard_normal((m, k))
    b = (2 + rng.random((k, n))) + 1e-3j * rng.uniform(-1, 1, (k, n))
    if m == 1:
        a[0] = big * (1 + rng.random(k))
    if m > 1:
        a[1] = big * (1 + rng.random(k))           # real * real: each term inf
    if m > 3:
        a[3] = 1j * big * (1 + rng.random(k))      # imag * real: each term inf
        a[2, 0], a[2, k - 1] = inf, -inf          # inf + (-inf) over k
        a[4, k - 1] = complex(0, inf)
        b[k - 1, 0] = 0                           # inf * 0
    return a.astype(dtype), b.astype(dtype)


def assert_numpys(want, got):
    """NaN and Inf (with its sign) where numpy's are, part by part; the finite values as
    close as a sum in another order."""
    assert got.dtype == want.dtype and got.shape == want.shape
    for part in ("real", "imag"):
        w, g = getattr(want, part), getattr(got, part)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=part)
        np.testing.assert_array_equal(np.where(np.isinf(g), g, 0), np.where(np.isinf(w), w, 0),
                                      err_msg=part)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=part)


#: (m, n, k, tile): k groups of (4, 4, 1), (2, 1), (2, 2, 2, 1); one row of C (gemv)
LOCAL_CASES = [(5, 4, 9, (5, 4, 4)), (5, 5, 3, (5, 5, 2)), (6, 2, 7, (3, 2, 2)),
               (1, 5, 3, (1, 5, 2))]


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("m,n,k,tile", LOCAL_CASES, ids=["k9", "k3", "k7-tiles", "gemv"])
def test_local_k_group_one_wide_is_numpys(dtype, m, n, k, tile):
    """numpy's ``inf+nanj`` / ``nan+infj`` and numpy's warnings, matmul and gemm, where a
    k group is one wide (``nan+nanj`` before)."""
    rng = np.random.default_rng()
    a, b = operands(rng, m, n, k, dtype)
    want, warned = recorded(np.matmul, a, b)
    overflowed = np.isinf(want) & np.isnan(want)  # one part Inf, the other NaN
    if m == 1 and not overflowed.any():  # numpy 1.26's OpenBLAS gemv: alpha not on the sum
        pytest.skip("this numpy's gemv leaves an overflowed sum without alpha's NaN: "
                    "not the case at hand")
    assert overflowed.any()  # the case at hand
    with dask.config.set(SPLIT_ALL):
        plan = distmm.make_plan(m, n, k, dtype, tile=tile, workers=1)
        assert 1 in np.diff(plan.k_edges) and plan.k_splits > 1, plan.k_edges
        got, got_warned = recorded(lambda x, y: distmm.matmul(x, y, engine="local", tile=tile),
                                   a, b)
        assert_numpys(want, got)
        assert got_warned == warned
        with np.errstate(all="ignore"):
            assert_numpys(2.0 * want, distmm.gemm(a, b, alpha=2.0, engine="local", tile=tile))


def test_local_sweep_of_short_k_is_numpys():
    """Random short products (m, n of 1, 2 and 5, k of 2 to 9) with Inf and NaN operands
    and overflowing rows, tiles and k groups one wide among others: numpy's Inf and NaN
    wherever no block of C is 1 x 1 in a larger product."""
    rng = np.random.default_rng()
    checked = 0
    with np.errstate(all="ignore"), dask.config.set(SPLIT_ALL):
        for dtype in (np.complex128, np.complex64):
            for m in (1, 2, 5):
                for n in (1, 2, 5):
                    for k, tk in ((2, 1), (3, 2), (7, 2), (9, 4)):
                        tile = (m, n, tk)
                        assert 1 in np.diff(distmm.make_plan(m, n, k, dtype, tile=tile,
                                                             workers=1).k_edges)
                        a, b = operands(rng, m, n, k, dtype)
                        a[rng.integers(m), rng.integers(k)] = (inf, -inf, nan)[rng.integers(3)]
                        want = a @ b
                        got = distmm.matmul(a, b, engine="local", tile=tile)
                        assert_numpys(want, got)
                        checked += 1
    assert checked == 2 * 3 * 3 * 4


SCRIPT = r"""
import numpy as np
from mpi4py import MPI

import distmm
from distmm.grid import make_grid

inf, nan = np.inf, np.nan
comm = MPI.COMM_WORLD
rng = np.random.default_rng(comm.bcast(int(np.random.SeedSequence().entropy % 2**32)))


def pattern(z):
    return [f(part) for part in (z.real, z.imag) for f in (np.isnan, np.isinf)]


lines = []
np.seterr(all="ignore")
for dt in (np.complex128, np.complex64):
    for m, n, k in ((5, 5, 3), (6, 4, 3), (2, 5, 3)):
        a, b = operands(rng, m, n, k, dt)
        grid = make_grid(m, n, k, dt, ranks=comm.size)
        assert any(1 in np.diff(pe) for pe in grid.panel_edges), grid.panel_edges
        want = a @ b
        assert (np.isinf(want) & np.isnan(want)).any()
        for how, w, got in (
                ("matmul", want, distmm.matmul(a, b, engine="mpi")),
                ("stack", (np.stack([a, a]) @ b)[1],
                 distmm.matmul(np.stack([a, a]), b, engine="mpi")[1]),
                ("gemm", 2.0 * want, distmm.gemm(a, b, alpha=2.0, engine="mpi"))):
            same = all(np.array_equal(x, y) for x, y in zip(pattern(w), pattern(got)))
            signs = all(np.array_equal(np.where(np.isinf(x), x, 0), np.where(np.isinf(y), y, 0))
                        for x, y in ((w.real, got.real), (w.imag, got.imag)))
            lines.append(f"{np.dtype(dt).name} {(m, n, k)} {how}: " + (
                "ok" if same and signs else f"BAD numpy {w[1]} got {got[1]}"))
for rank, mine in enumerate(comm.gather(lines) or []):
    print("\n".join(f"rank {rank}: {line}" for line in mine), flush=True)
"""
#: the ranks make their operands as the tests here do
SCRIPT = SCRIPT.replace("comm = MPI.COMM_WORLD",
                        inspect.getsource(operands) + "\n\ncomm = MPI.COMM_WORLD")


@pytest.mark.mpi
def test_mpi_engine_panel_one_wide_is_numpys(tmp_path, mpirun):
    """``engine="mpi"`` on 2 ranks, a SUMMA panel one wide: numpy's ``inf+nanj`` /
    ``nan+infj`` (matmul, a stack, gemm); ``nan+nanj`` before."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "panels.py", SCRIPT, 2)
    assert len(lines) == 2 * 2 * 3 * 3 and not bad, "\n".join(bad) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow  # distmm subprocesses, ~1 s each
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
def test_batch_command_panel_one_wide_is_numpys(tmp_path, mpirun, dtype):
    """``mpirun -n 2 python -m distmm matmul`` with broadcast panels (a 5 x 5 x 3 product:
    panels of 2 and 1 in k): numpy's ``inf+nanj`` / ``nan+infj`` in the file written
    (``nan+nanj`` before)."""
    rng = np.random.default_rng()
    a, b = operands(rng, 5, 5, 3, dtype)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    with np.errstate(all="ignore"):
        want = a @ b
    assert (np.isinf(want) & np.isnan(want)).any()
    out = tmp_path / "c.npy"
    r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", out,
               "--engine", "mpi", env={"DISTMM_BATCH_PANELS": "broadcast"}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_numpys(want, np.load(out))
