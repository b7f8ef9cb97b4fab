"""The command line's warnings (numpy's floating-point reports of a product: one line each,
as many as numpy gives) and ``--engine mpi``'s refusal of a Dask scheduler."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import distmm
from conftest import run_cli
from distmm.cli import main


#: one BLAS thread: flags that OpenBLAS's own threads raise are lost to the caller's (numpy's
#: complex matmul of these sizes reported none in about 1 of 10 runs with several threads)
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

_NUMPYS = ("import sys, warnings, numpy as np\n"
           "a, b = np.load(sys.argv[1]), np.load(sys.argv[2])\n"
           "with warnings.catch_warnings(record=True) as seen:\n"
           "    warnings.simplefilter('always')\n"
           "    np.matmul(a, b)\n"
           "print('\\n'.join(str(w.message) for w in seen))\n")


def numpys_warnings(folder: Path) -> list[str]:
    """The warnings numpy's matmul of ``folder``'s a.npy and b.npy gives, one per report (in a
    child with one BLAS thread, as the command is run here)."""
    r = subprocess.run([sys.executable, "-c", _NUMPYS, folder / "a.npy", folder / "b.npy"],
                       capture_output=True, text=True, env={**os.environ, **ONE_THREAD},
                       timeout=120, check=True)
    return r.stdout.split("\n")[:-1] if r.stdout.strip() else []


def operands(case: str):
    """Random operands of odd sizes with the values that make numpy warn placed at random."""
    rng = np.random.default_rng()
    m, k, n = (int(x) for x in rng.integers(21, 60, 3) | 1)
    dtype = {"float16": np.float16, "float32": np.float32,
             "complex": np.complex128}.get(case, np.float64)
    lead = (3,) if case == "stack" else ()
    a = rng.standard_normal((*lead, m, k)).astype(dtype)
    b = rng.standard_normal((*lead, k, n)).astype(dtype)
    i, j, p = rng.integers(m), rng.integers(n), rng.integers(k)
    if case in ("float16", "float32"):  # every term positive: an overflow, never inf - inf
        a[i] = np.finfo(dtype).max / 4
        b = np.abs(b)
        b[:, j] = 3
    else:  # inf * 0: an invalid value
        a[..., i, p] = np.inf
        b[..., p, j] = 0
    if case in ("tiles", "complex"):  # and an overflow of float64 elsewhere
        q = (p + 1) % k
        a[(i + 1) % m, q] = 1e300
        b[q, (j + 1) % n] = 1e300
    return a, b


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("distmm matmul: warning: ")]


@pytest.mark.parametrize("case", ["inf*0", "tiles", pytest.param("float16", marks=pytest.mark.slow),
                                  "float32", "stack", "complex"])
@pytest.mark.slow
def test_numpys_warnings_as_one_line_each(tmp_path, case):
    a, b = operands(case)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    want = numpys_warnings(tmp_path)
    assert want  # the case makes numpy warn
    extra = ["--tile", "8"] if case == "tiles" else []
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy", *extra,
                env=ONE_THREAD, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("wrote ")
    # numpy's text, as often as numpy reports it, and nothing else (no path, no source line)
    assert sorted(r.stderr.splitlines()) == sorted(f"distmm matmul: warning: {w}" for w in want)
    with np.errstate(all="ignore"):
        ref = np.matmul(a, b)
    got = np.load(tmp_path / "c.npy")
    assert got.dtype == ref.dtype
    finite = np.isfinite(ref)
    assert (np.isfinite(got) == finite).all()
    tol = 1e-2 if case == "float16" else 1e-4
    np.testing.assert_allclose(got[finite], ref[finite], rtol=tol,
                               atol=tol * float(np.abs(ref[finite]).max()))


@pytest.mark.parametrize("mode", ["ignore", "error", "debug"])
@pytest.mark.slow
def test_filters_the_user_sets_decide(tmp_path, mode):
    """``PYTHONWARNINGS`` (as ``-W``): ``ignore`` shows nothing, ``error`` makes the warning
    the command's one error line, and C is not written; ``--debug`` keeps Python's format."""
    a, b = operands("inf*0")
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    argv = ["matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy"]
    if mode == "debug":
        r = run_cli("--debug", *argv, env={"PYTHONWARNINGS": None}, timeout=120)
        assert r.returncode == 0
        assert "RuntimeWarning: invalid value encountered in matmul" in r.stderr
        assert not warning_lines(r.stderr)
        return
    r = run_cli(*argv, env={"PYTHONWARNINGS": f"{mode}::RuntimeWarning"}, timeout=120)
    if mode == "ignore":
        assert (r.returncode, r.stderr) == (0, "")
        return
    assert r.returncode == 1
    assert r.stderr.splitlines() == ["distmm matmul: error: RuntimeWarning: invalid value "
                                     "encountered in matmul"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


def test_api_warnings_unchanged_around_main(tmp_path, capsys):
    """``main()`` in a process that goes on: its warning is the one line on stderr, and after
    it the API's warning is numpy's RuntimeWarning again, caught, filtered and raised as
    numpy's."""
    a, b = operands("inf*0")
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    before = warnings.showwarning
    assert main(["matmul", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o",
                 str(tmp_path / "c.npy")]) == 0
    assert warning_lines(capsys.readouterr().err) == \
        ["distmm matmul: warning: invalid value encountered in matmul"]
    assert warnings.showwarning is before

    def product():
        return distmm.matmul(a, b, engine="local")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        product()
    assert [(w.category, str(w.message)) for w in seen] == \
        [(RuntimeWarning, "invalid value encountered in matmul")]
    with warnings.catch_warnings(record=True) as seen, np.errstate(invalid="ignore"):
        warnings.simplefilter("always")
        product()
    assert seen == []
    with np.errstate(invalid="raise"), pytest.raises(FloatingPointError):
        product()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="invalid value encountered in matmul"):
            product()
    assert capsys.readouterr().err == ""  # the API prints no line of the command's


@pytest.mark.parametrize("given", [["--scheduler-file", "sched.json"],
                                   ["--scheduler", "tcp://127.0.0.1:1"]],
                         ids=["scheduler-file", "scheduler"])
def test_engine_mpi_refuses_a_scheduler_in_one_process(tmp_path, given):
    """Before any file is read (A does not exist): one line saying what to do, status 2."""
    (tmp_path / "sched.json").write_text('{"address": "tcp://127.0.0.1:1"}')
    r = run_cli("matmul", "missing.npy", "missing.npy", "-o", "c.npy", "--engine", "mpi", *given,
                cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    flag = given[0]
    assert r.stderr.splitlines() == [
        f"distmm matmul: error: --engine mpi runs the product in this one process (under "
        f"mpirun, on its ranks), not on the Dask cluster that {flag} names: drop {flag}, or "
        f"use --engine dask to run on that cluster"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sched.json"]


def test_engine_mpi_runs_in_one_process(tmp_path):
    """``--engine mpi`` without a launcher: the MPI engine on one rank, numpy's result."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((23, 17)), rng.standard_normal((17, 29))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                "--engine", "mpi", timeout=120)
    assert (r.returncode, r.stderr) == (0, "")
    assert ", 1 rank, grid 1x1," in r.stdout
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)


# -- under mpirun ----------------------------------------------------------------------------


def _mpi_matmul(mpirun, tmp_path, a, b, *extra):
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o",
                  tmp_path / "c.npy", *extra, timeout=120)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("case", ["stack", "every-rank", "last-rank"])
def test_one_line_per_warning_under_mpirun(mpirun, tmp_path, case):
    """Every rank's product reports numpy's warnings; the job prints each once (rank 0), in
    one line, as numpy gives them for the whole product."""
    if case == "stack":  # computed whole by every rank
        a, b = operands("stack")
    else:  # matrices: the batch path's stripes, C's last element on the last rank
        rng = np.random.default_rng()
        m, k, n = 41, 31, 23
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        p = int(rng.integers(k))
        a[m - 1, p], b[p, n - 1] = np.inf, 0
        if case == "every-rank":
            a[0, p], b[p, 0] = np.inf, 0
    r = _mpi_matmul(mpirun, tmp_path, a, b)  # one BLAS thread a rank (mpi_env)
    want = numpys_warnings(tmp_path)
    assert want
    assert r.returncode == 0, r.stderr
    assert sorted(r.stderr.splitlines()) == sorted(f"distmm matmul: warning: {w}" for w in want)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_warning_made_an_error_fails_every_rank_under_mpirun(mpirun, tmp_path):
    """``python -W error::RuntimeWarning`` on every rank, the invalid value only in the last
    rank's stripes: every rank fails alike (status 1, one line), C is not written and no
    staged file is left."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((41, 31)), rng.standard_normal((31, 23))
    p = int(rng.integers(31))
    a[40, p], b[p, 22] = np.inf, 0
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    r = mpirun(2, "-W", "error::RuntimeWarning", "-m", "distmm", "matmul", tmp_path / "a.npy",
               tmp_path / "b.npy", "-o", tmp_path / "c.npy", timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("distmm")]
    assert lines == ["distmm matmul: error: RuntimeWarning: invalid value encountered in "
                     "matmul"], r.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.npy", "b.npy"]


@pytest.mark.mpi
@pytest.mark.slow
def test_engine_mpi_refuses_a_scheduler_under_mpirun(mpirun, tmp_path):
    rng = np.random.default_rng()
    (tmp_path / "sched.json").write_text('{"address": "tcp://127.0.0.1:1"}')
    r = _mpi_matmul(mpirun, tmp_path, rng.standard_normal((5, 3)), rng.standard_normal((3, 7)),
                    "--engine", "mpi", "--scheduler-file", tmp_path / "sched.json")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.startswith("distmm")]
    assert lines == ["distmm matmul: error: --engine mpi runs the product on this job's 2 MPI "
                     "ranks, not on the Dask cluster that --scheduler-file names: drop "
                     "--scheduler-file"]
    assert not (tmp_path / "c.npy").exists()
