"""Held-back cases of distmm.gemm where no product is made (``alpha == 0`` or ``k == 0``)
and where ``c`` is not read (``beta == 0``), on the local, Dask and MPI engines.

This module covers: reference BLAS's ``C = beta * C`` for ``alpha == 0`` or ``k == 0``,
which is numpy's ``beta * c`` exactly (signed zeros, each complex part's sign, Inf, NaN
and numpy's reports; no zero product added, which made -0.0 0.0); ``alpha == 0`` and
``beta == 0`` (zeros, +0.0); ``beta == 0`` with NaN in ``c``; empty m or n; integer,
boolean and object dtypes; values against scipy.linalg.blas's ?gemm where its BLAS and the
formula agree (finite values); and that ``alpha == 0`` reads nothing of ``a`` and ``b``:
an h5py dataset whose raw data file is gone, an array-like that records every read, and
(in a child process) a memmap whose file was truncated under it, as it is and transposed.
It does *not* cover: the product itself (tests/test_gemm_semantics.py,
tests/test_gemm_heldback.py), GPU gemm (tests/test_gpu_api.py).
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import warnings
from fractions import Fraction

import numpy as np
import pytest

import distmm
from conftest import ROOT, identical, reported, run_rank_script

OPS = {"N": lambda x: x, "T": lambda x: x.T, "C": lambda x: x.conj().T}
FLOATS = [np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128]


def _blas_rule(a, b, c, alpha, beta):
    """Reference BLAS's result where no product is made, in numpy's words: zeros of the
    result dtype where ``beta == 0`` (or no c), else numpy's ``beta * c`` with beta in the
    dtype; a and b give the dtype only."""
    dtype = np.matmul(np.empty((0, 0), a.dtype), np.empty((0, 0), b.dtype)).dtype
    if c is not None:
        dtype = np.result_type(dtype, np.asarray(c).dtype)
    be = dtype.type(beta)
    m, n = np.shape(c) if c is not None else (a.shape[0], b.shape[1])
    if c is None or be == 0:
        return np.zeros((m, n), dtype)
    return be * np.asarray(c).astype(dtype)


def _edges(dtype, shape):
    """A c of ``shape`` holding -0.0, 0.0, Inf, -Inf, NaN and ordinary values (for a complex
    dtype, each part's sign and Inf or NaN in either part)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        vals = [complex(-0.0, -0.0), complex(-0.0, 0.0), complex(0.0, -0.0), complex(0.0, 0.0),
                complex(np.inf, 0.0), complex(-0.0, np.inf), complex(np.nan, -0.0),
                complex(1.5, -0.0), complex(-2.0, 0.25), complex(np.inf, np.nan)]
    else:
        vals = [-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5, -2.0, 0.25, -0.0, 3.0]
    flat = np.resize(np.array(vals, dtype), int(np.prod(shape)))
    return flat.reshape(shape)


def _quarters(rng, shape, dtype):
    """Values in {-2, -1.75, ..., 2} (complex parts alike): every product and sum of the
    small sizes here is exact in any float dtype."""
    x = rng.integers(-8, 9, shape) / 4
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.integers(-8, 9, shape) / 4
    return x.astype(dtype)


def _betas(dtype):
    betas = [1.0, -1.0, 2.0, 0.5, -0.0, 0.0]
    return betas + [1j, -1 - 1j] if np.dtype(dtype).kind == "c" else betas


# -- beta * c exactly -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_no_product_gives_beta_times_c_exactly(dtype):
    """alpha of 0 or -0.0 (k of 4), and k of 0 with alpha 2: reference BLAS's C = beta * C,
    numpy's ``beta * c`` element for element (a -0.0 of c times 1 stays -0.0; gemm added a
    zero product, which made it 0.0), with numpy's reports; a NaN in a and b is not read.
    The result is a new plain array."""
    rng = np.random.default_rng()
    c = _edges(dtype, (3, 4))
    for k, alpha in [(4, 0.0), (4, -0.0), (0, 2.0)]:
        a = rng.standard_normal((3, k)).astype(dtype)
        b = rng.standard_normal((k, 4)).astype(dtype)
        if k:
            a[0, 0], b[1, 1] = np.nan, -np.inf
        for beta in _betas(dtype):
            want = reported(lambda: _blas_rule(a, b, c, alpha, beta))
            got = reported(lambda: distmm.gemm(a, b, c, alpha=alpha, beta=beta))
            assert identical(got[0], want[0]) and got[1:] == want[1:], (k, alpha, beta, got,
                                                                          want)
            assert not np.shares_memory(got[0], c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128],
                         ids=lambda d: np.dtype(d).name)
def test_values_are_scipys_gemms_where_its_blas_follows_the_rule(dtype):
    """scipy's ?gemm with alpha = 0 and finite a, b, c: the same values (== on every
    element; a zero's sign is the BLAS build's: one that adds 0 * A @ B to beta * C makes
    -0.0 0.0),
    every letter pair, beta among 1, -1, 2, 0.5 and 0."""
    blas = pytest.importorskip("scipy.linalg.blas")
    f = {np.float32: blas.sgemm, np.float64: blas.dgemm, np.complex64: blas.cgemm,
         np.complex128: blas.zgemm}[dtype]
    rng = np.random.default_rng()
    m, n, k = 4, 5, 3
    for ta, tb in itertools.product("NTC", "NTC"):
        a = _quarters(rng, (m, k) if ta == "N" else (k, m), dtype)
        b = _quarters(rng, (k, n) if tb == "N" else (n, k), dtype)
        c = _quarters(rng, (m, n), dtype) * 3
        for beta in (1.0, -1.0, 2.0, 0.5, 0.0):
            got = distmm.gemm(a, b, c, alpha=0.0, beta=beta, trans_a=ta, trans_b=tb)
            want = f(0.0, a, b, beta=beta, c=c, trans_a="NTC".index(ta),
                     trans_b="NTC".index(tb))
            assert got.dtype == want.dtype and np.array_equal(got, want), (ta, tb, beta)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_zero_alpha_and_beta_give_positive_zeros_and_beta_zero_reads_no_c(dtype):
    """alpha and beta of 0 or -0.0 with NaN, Inf and -0.0 in a, b and c: zeros of the
    result dtype, each part +0.0, no reports; beta of 0 with alpha 1: numpy's
    ``1 * (a @ b)`` (c's NaN not read; values whose sums are exact in every dtype)."""
    rng = np.random.default_rng()
    a, b = (_quarters(rng, s, dtype) for s in ((3, 5), (5, 4)))
    c = _edges(dtype, (3, 4))
    bad_a = a.copy()
    bad_a[1] = np.nan
    for alpha, beta in itertools.product((0.0, -0.0), (0.0, -0.0)):
        got = reported(lambda: distmm.gemm(bad_a, b, c, alpha=alpha, beta=beta))
        assert identical(got[0], np.zeros((3, 4), got[0].dtype)), (alpha, beta)
        assert got[1:] == ([], None)
        assert not np.signbit(got[0].real).any() and not np.signbit(np.imag(got[0])).any()
    for beta in (0.0, -0.0):
        want = reported(lambda: dtype(1) * (a @ b))
        got = reported(lambda: distmm.gemm(a, b, np.full((3, 4), np.nan, dtype), beta=beta))
        assert identical(got[0], want[0]) and got[1:] == want[1:], beta


@pytest.mark.parametrize("mnk", [(0, 4, 3), (3, 0, 3), (0, 0, 0), (0, 4, 0), (3, 0, 0)],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float64, np.complex64, np.int16, np.bool_, object],
                         ids=lambda d: np.dtype(d).name)
def test_empty_m_or_n(mnk, dtype):
    """m or n of 0 (k 0 or not), alpha and beta of 0 and not, every letter pair: an empty
    result of the promoted dtype and shape (m, n), as the formula's."""
    m, n, k = mnk
    for ta, tb in itertools.product("NTC", "NTC"):
        a = np.ones((m, k) if ta == "N" else (k, m), dtype)
        b = np.ones((k, n) if tb == "N" else (n, k), dtype)
        c = np.ones((m, n), dtype)
        for alpha, beta in itertools.product((0, 1), (0, 1)):
            got = distmm.gemm(a, b, c, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb)
            want = np.matmul(OPS[ta](a), OPS[tb](b)) if alpha and k else _blas_rule(
                a, b, c, alpha, beta)
            assert identical(got, want), (ta, tb, alpha, beta)


def test_integer_boolean_and_object_dtypes_are_the_formulas():
    """alpha == 0 or k == 0 on integers (beta * c wrapping as numpy's, in the dtype
    promoted with c's), booleans (beta of True: c's copy) and objects (Fractions, and a
    float -0.0 object kept as beta * c gives it)."""
    rng = np.random.default_rng()
    i8 = rng.integers(-128, 128, (3, 4)).astype(np.int8)
    cases = [(np.int8, i8, 3), (np.int8, i8, -1), (np.uint8, i8.astype(np.uint8), 7),
             (np.int8, i8.astype(np.int16), 300), (np.int64, i8.astype(np.float64), 2),
             (np.bool_, i8 > 0, True), (np.bool_, i8 > 0, 1), (np.int32, i8 > 0, 5),
             (object, np.vectorize(Fraction, otypes=[object])(i8, 3), Fraction(-1, 2)),
             (object, np.array([[-0.0, 0.5]] * 3, object), 1), (np.float32, i8 > 0, 2)]
    for ab, c, beta in cases:
        for k, alpha in [(5, 0), (0, 1)]:
            a, b = np.ones((c.shape[0], k), ab), np.ones((k, c.shape[1]), ab)
            want = reported(lambda: _blas_rule(a, b, c, alpha, beta))
            got = reported(lambda: distmm.gemm(a, b, c, alpha=alpha, beta=beta))
            assert identical(got[0], want[0]) and got[1:] == want[1:], (ab, c.dtype, beta, k)
            if want[0].dtype == object:  # each element's type and sign (-0.0) too
                assert list(map(repr, got[0].ravel())) == list(map(repr, want[0].ravel()))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.complex64])
def test_reports_of_beta_times_c_are_numpys(dtype):
    """beta * c overflowing, Inf times 0 (a complex Inf times a beta of 1), NaN: numpy's
    warnings in order and its error under 'raise', as ``beta * c`` has them."""
    big = np.finfo(dtype).max
    c = np.array([[big, -big, 1.0], [np.inf, np.nan, -0.0]], dtype)
    for alpha, k, beta in [(0.0, 3, 4.0), (0.0, 3, 1.0), (1.0, 0, -3.0), (0.0, 2, 0.5)]:
        a, b = np.ones((2, k), dtype), np.ones((k, 3), dtype)
        want = reported(lambda: _blas_rule(a, b, c, alpha, beta))
        got = reported(lambda: distmm.gemm(a, b, c, alpha=alpha, beta=beta))
        assert identical(got[0], want[0]) and got[1:] == want[1:], (alpha, beta, got, want)


# -- a and b not read -------------------------------------------------------------------------

class _Recorded:
    """A 2-D array-like that reads by slices, as an h5py dataset does, recording each
    read (``__getitem__``, ``__array__``)."""

    def __init__(self, x):
        self._x, self.reads = x, []
        self.shape, self.dtype, self.ndim = x.shape, x.dtype, x.ndim

    def __getitem__(self, key):
        self.reads.append(("getitem", key))
        return self._x[key]

    def __array__(self, dtype=None, copy=None):
        self.reads.append("__array__")
        return self._x if dtype is None else self._x.astype(dtype)


def test_an_operand_that_reads_by_slices_is_not_read():
    """alpha == 0 or k == 0 with operands that read by slices, every letter pair: no read
    (a transposed one was read whole, as ``numpy.asarray``, before even its shape was
    checked); a wrong shape is refused unread too. With alpha 1 they are read."""
    rng = np.random.default_rng()
    m, n, k = 4, 5, 3
    c = _edges(np.float64, (m, n))
    for (ta, tb), (kk, alpha) in itertools.product(itertools.product("NTC", "NTC"),
                                                    [(k, 0.0), (0, 2.0)]):
        a = _Recorded(rng.standard_normal((m, kk) if ta == "N" else (kk, m)))
        b = _Recorded(rng.standard_normal((kk, n) if tb == "N" else (n, kk)))
        got = distmm.gemm(a, b, c, alpha=alpha, beta=-1.0, trans_a=ta, trans_b=tb)
        assert identical(got, -1.0 * c), (ta, tb, kk)
        assert a.reads == [] and b.reads == [], (ta, tb, kk, a.reads, b.reads)
        wrong = _Recorded(rng.standard_normal((kk + 1, n) if tb == "N" else (n, kk + 1)))
        with pytest.raises(ValueError, match="inner dimensions differ"):
            distmm.gemm(a, wrong, c, alpha=alpha, beta=1.0, trans_a=ta, trans_b=tb)
        assert a.reads == [] and wrong.reads == [], (ta, tb, kk)
    a, b = _Recorded(rng.standard_normal((k, m))), _Recorded(rng.standard_normal((k, n)))
    distmm.gemm(a, b, c, alpha=1.0, beta=1.0, trans_a="T")
    assert a.reads and b.reads  # the recording sees reads


def test_an_hdf5_dataset_whose_data_is_gone_is_not_read(tmp_path):
    """h5py datasets stored in external raw files that are then removed (any read raises
    OSError): alpha == 0 or k == 0 gives beta * c, as they are and transposed ('T', 'C');
    a transposed one was read whole. alpha 1 does read (OSError)."""
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng()
    m, n, k = 4, 5, 3
    c = _edges(np.complex128, (m, n))
    with h5py.File(tmp_path / "ops.h5", "w") as f:
        for name, shape in [("a", (m, k)), ("at", (k, m)), ("b", (k, n)), ("bt", (n, k)),
                            ("a0", (m, 0)), ("at0", (0, m)), ("b0", (0, n))]:
            f.create_dataset(name, data=rng.standard_normal(shape) + 0j,
                             external=[(str(tmp_path / f"{name}.raw"), 0, h5py.h5f.UNLIMITED)])
    for raw in tmp_path.glob("*.raw"):
        raw.unlink()
    with h5py.File(tmp_path / "ops.h5", "r") as f:
        with pytest.raises(OSError):
            f["a"][...]  # the data is really gone
        cases = [("a", "b", "N", "N", 0.0), ("at", "b", "T", "N", 0.0),
                 ("at", "bt", "C", "T", 0.0), ("a", "bt", "N", "C", -0.0),
                 ("at0", "b0", "T", "N", 3.0), ("a0", "b0", "N", "N", 1.0)]
        for x, y, ta, tb, alpha in cases:
            for beta in (1.0, -2.0, 0.0):
                got = reported(lambda: distmm.gemm(f[x], f[y], c, alpha=alpha, beta=beta,
                                                   trans_a=ta, trans_b=tb))
                want = reported(lambda: _blas_rule(f["a"], f["b"], c, 0.0, beta))
                assert identical(got[0], want[0]) and got[1:] == want[1:], (x, y, beta)
        with pytest.raises(OSError):
            distmm.gemm(f["at"], f["b"], c, alpha=1.0, trans_a="T")


_MEMMAP_CHILD = """
import os, sys
import numpy as np
import distmm

folder, engine = sys.argv[1], sys.argv[2]
a = np.load(os.path.join(folder, "a.npy"), mmap_mode="r")  # (k, m): op(a) is a.T
b = np.load(os.path.join(folder, "b.npy"), mmap_mode="r")  # (k, n)
for name in ("a.npy", "b.npy"):
    os.truncate(os.path.join(folder, name), 0)  # any page of a or b read now: SIGBUS
c = np.load(os.path.join(folder, "c.npy"))
for ta, tb, alpha, x, y in [("T", "N", 0.0, a, b), ("C", "N", 0.0, a, b),
                            ("N", "N", 0.0, a.T, b), ("T", "T", 0.0, a, b.T),
                            ("T", "N", 1.0, a[:0], b[:0])]:
    got = distmm.gemm(x, y, c, alpha=alpha, beta=-2.0, trans_a=ta, trans_b=tb, engine=engine)
    want = np.float64(-2.0) * c
    ok = type(got) is np.ndarray and np.array_equal(got, want, equal_nan=True) and \\
        np.array_equal(np.signbit(got), np.signbit(want))
    print(ta, tb, "ok" if ok else "BAD", flush=True)
print("touching a", flush=True)
print(float(a.sum()), flush=True)  # the check is real: this read faults
"""


@pytest.mark.parametrize("engine", ["local", "mpi"])
def test_a_memmap_whose_file_is_truncated_is_not_read(engine, tmp_path):
    """.npy memmaps (a transposed by 'T' and 'C', b as is and transposed) whose files are
    truncated once mapped, so that reading any page of them kills the process (SIGBUS):
    alpha == 0 or k == 0 gives -2 * c in a child process, every case, and only the child's
    own read of a afterwards kills it. engine="mpi" on one rank without mpiexec."""
    rng = np.random.default_rng()
    m, n, k = 300, 200, 257
    np.save(tmp_path / "a.npy", rng.standard_normal((k, m)))
    np.save(tmp_path / "b.npy", rng.standard_normal((k, n)))
    np.save(tmp_path / "c.npy", _edges(np.float64, (m, n)))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _MEMMAP_CHILD, str(tmp_path), engine],
                       capture_output=True, text=True, timeout=120, env=env)
    lines = r.stdout.splitlines()
    assert lines[:6] == [f"{ta} {tb} ok" for ta, tb in
                         ["TN", "CN", "NN", "TT", "TN"]] + ["touching a"], r.stdout + r.stderr
    assert r.returncode in (-7, 128 + 7) or "Bus error" in r.stderr, (r.returncode, r.stderr)


# -- the Dask and MPI engines ---------------------------------------------------------------

@pytest.mark.slow  # a cluster of two worker processes
def test_on_a_dask_cluster_no_product_is_beta_times_c(client):
    """engine="dask" with numpy operands, and dask operands and c (a lazy result): alpha ==
    0 or k == 0 gives beta * c exactly (-0.0 kept, complex parts' signs), in the chunks
    ``zeros + beta * c`` had (op(a)'s rows, op(b)'s columns, unified with c's)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    m, n = 7, 6
    for dtype, (k, alpha), beta in itertools.product(
            [np.float64, np.complex128, np.float32], [(5, 0.0), (0, 2.0)], [1.0, -1.0, 2.0]):
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        c = _edges(dtype, (m, n))
        want = reported(lambda: _blas_rule(a, b, c, alpha, beta))
        got = reported(lambda: distmm.gemm(a, b, c, alpha=alpha, beta=beta, engine="dask",
                                           client=client))
        assert identical(got[0], want[0]) and got[1:] == want[1:], (dtype, k, beta)
        x, y = da.from_array(a, chunks=(3, 2)), da.from_array(b, chunks=(2, 4))
        z = da.from_array(c, chunks=(4, 5))
        lazy = distmm.gemm(x, y, z, alpha=alpha, beta=beta, engine="dask", client=client)
        assert lazy.chunks == (da.zeros((m, n), chunks=((3, 3, 1), (4, 2))) + z).chunks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # beta * c's reports are the workers'
            assert identical(lazy.compute(), want[0]), (dtype, k, beta)


_MPI_SCRIPT = '''
import sys
import numpy as np
from mpi4py import MPI
import distmm

comm = MPI.COMM_WORLD
rank = comm.rank
lines = []


class Recorded:
    def __init__(self, x):
        self._x, self.reads = x, []
        self.shape, self.dtype, self.ndim = x.shape, x.dtype, x.ndim

    def __getitem__(self, key):
        self.reads.append("getitem")
        return self._x[key]

    def __array__(self, dtype=None, copy=None):
        self.reads.append("__array__")
        return self._x


def same(got, want):
    if type(got) is not np.ndarray or got.dtype != want.dtype or got.shape != want.shape:
        return False
    parts = [np.stack([z.real, z.imag]) for z in (got, want)]
    return (np.array_equal(parts[0], parts[1], equal_nan=True)
            and np.array_equal(np.signbit(parts[0]), np.signbit(parts[1])))


m, n = 4, 5
for dtype in (np.float64, np.complex64):
    vals = [-0.0, 0.0, np.inf, np.nan, 1.5] if dtype == np.float64 else [
        complex(-0.0, -0.0), complex(0.0, -0.0), complex(np.inf, 0.0), complex(-0.0, 2.0)]
    c = np.resize(np.array(vals, dtype), m * n).reshape(m, n)
    for k, alpha, ta in [(3, 0.0, "T"), (3, -0.0, "C"), (0, 2.0, "N")]:
        a = Recorded(np.ones((m, k) if ta == "N" else (k, m), dtype))
        b = Recorded(np.ones((k, n), dtype))
        for beta in (1.0, -1.0, 2.0):
            with np.errstate(all="ignore"):
                want = dtype(beta) * c
                got = distmm.gemm(a, b, c, alpha=alpha, beta=beta, trans_a=ta, engine="mpi")
            ok = same(got, want) and not a.reads and not b.reads
            lines.append(f"rank {rank}: {np.dtype(dtype).name} k={k} {ta} beta={beta}: "
                         + ("ok" if ok else f"BAD {got.ravel()[:4]} {a.reads} {b.reads}"))
for mine in comm.gather(lines) or []:
    print("\\n".join(mine), flush=True)
'''


@pytest.mark.mpi
@pytest.mark.slow  # one mpiexec launch each
@pytest.mark.parametrize("ranks", [1, 2])
def test_under_mpiexec_no_product_is_beta_times_c_and_reads_nothing(ranks, tmp_path, mpirun):
    """engine="mpi" on 1 and 2 ranks: alpha == 0 or k == 0 gives beta * c exactly (-0.0
    and complex parts' signs kept) on every rank, and an operand that reads by slices,
    transposed or not, is not read."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "gemm_zero.py", _MPI_SCRIPT, ranks)
    assert len(lines) == 18 * ranks and not bad, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
