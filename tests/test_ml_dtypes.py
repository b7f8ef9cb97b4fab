"""ml_dtypes' narrow operands: its integers narrower than a byte (``int4``, ``uint4``,
``int2``, ``uint2``, ``int1``, ``uint1``) multiply as numpy multiplies them, bit for bit, on
the local, Dask and MPI engines; its narrow floats (``float8_*``, ``float6_*``, ``float4_*``)
are refused in one line, before any work, naming the dtype and numpy.matmul.

numpy's matmul casts a narrow integer to int8 (the first of its integer loops it casts to
safely) and sums with wrap-around: distmm sums in 64 bits and narrows once, which gives the
same bits. A narrow float it casts to float32 and multiplies with its BLAS's sgemm of the
whole operands, whose summation order depends on their shapes: no tiling of the product
reproduces its bits (as for float32 and bfloat16 operands, which distmm multiplies in float32
without promising numpy's bits).
It does *not* cover: GPU executors (cupy has no narrow dtypes), the command line.
"""
from __future__ import annotations

import numpy as np
import pytest

import distmm

ml_dtypes = pytest.importorskip("ml_dtypes")

NARROW_INTS = [pytest.param(name, marks=pytest.mark.skipif(
    not hasattr(ml_dtypes, name), reason=f"ml_dtypes {ml_dtypes.__version__} has no {name}"))
    for name in ("int4", "uint4", "int2", "uint2", "int1", "uint1")]
NARROW_FLOATS = sorted(name for name in dir(ml_dtypes)
                       if name.startswith(("float8_", "float6_", "float4_")))
# odd shapes, a k of one, a 1 x 1, and sums long enough to wrap int8 many times over
SHAPES = [(7, 199, 13), (1, 5, 1), (5, 1, 3), (200, 200, 200), (64, 1000, 3)]


def narrow(rng, shape, name):
    """Random values over the whole range of ml_dtypes' integer ``name``."""
    info = ml_dtypes.iinfo(getattr(ml_dtypes, name))
    return rng.integers(int(info.min), int(info.max) + 1, shape).astype(getattr(ml_dtypes, name))


def assert_numpys(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)


@pytest.mark.parametrize("backend", ["auto", "numba", "blas"])
@pytest.mark.parametrize("name", NARROW_INTS)
def test_narrow_integers_give_numpys_dtype_and_bits(name, backend):
    """Before, every one was refused ("matmul needs boolean or numeric operands")."""
    rng = np.random.default_rng(7)
    for m, k, n in SHAPES:
        a, b = narrow(rng, (m, k), name), narrow(rng, (k, n), name)
        want = a @ b
        assert want.dtype == np.int8
        assert_numpys(distmm.matmul(a, b, engine="local", backend=backend), want)
        # tiles and a k-split: partial sums over k, added afterwards
        assert_numpys(distmm.matmul(a, b, engine="local", backend=backend, tile=16), want)
    a, b = narrow(rng, (3, 20, 30), name), narrow(rng, (30, 9), name)
    assert_numpys(distmm.matmul(a, b, engine="local", backend=backend), a @ b)  # a stack
    assert_numpys(distmm.matmul(a[0, 0], b[:, 0], engine="local"), a[0, 0] @ b[:, 0])  # 1-D


def test_narrow_integers_with_other_operands_and_keywords_are_numpys():
    """Mixed with numpy's integers (int16 for int4 @ uint8), ``dtype=`` and ``out=`` of
    numpy's and of ml_dtypes' own type (numpy's int8 product cast to int4)."""
    rng = np.random.default_rng(8)
    a = narrow(rng, (40, 50), "int4")
    u = narrow(rng, (40, 50), "uint4")
    i8 = rng.integers(-128, 128, (50, 30)).astype(np.int8)
    u8 = rng.integers(0, 256, (50, 30)).astype(np.uint8)
    b = narrow(rng, (50, 30), "int4")
    for x, y in ((a, i8), (a, u8), (u, u8), (i8.T, a.T), (a, u8.astype(bool))):
        assert_numpys(distmm.matmul(x, y, tile=16), x @ y)
    assert_numpys(distmm.matmul(a, b, dtype=np.int32, tile=16), np.matmul(a, b, dtype=np.int32))
    for out_dtype in (np.int8, np.int64, ml_dtypes.int4):
        got, want = np.zeros((40, 30), out_dtype), np.zeros((40, 30), out_dtype)
        assert distmm.matmul(a, b, out=got, tile=16) is got
        assert_numpys(got, np.matmul(a, b, out=want))


@pytest.mark.parametrize("name", NARROW_FLOATS)
def test_narrow_floats_are_refused_in_one_line_before_any_work(name):
    """Before, ``float8_e5m2`` (kind 'f') multiplied in float32 with bits other than numpy's,
    and the others were refused with "needs boolean or numeric operands", which is not why."""
    dt = np.dtype(getattr(ml_dtypes, name))
    x = np.ones((4, 6), dt)
    f32 = np.ones((6, 4), np.float32)
    assert (x @ x.T).dtype == np.float32  # numpy multiplies them
    for a, b, which in ((x, x.T, "a"), (f32, x.T, "b"), (f32.T, x.T, "b")):
        out = np.full((4, 4), 5.0, np.float32)
        with pytest.raises(TypeError) as err:
            distmm.matmul(a, b, out=out, engine="local")
        text = str(err.value)
        assert "\n" not in text and "numpy.matmul" in text and f"{which} has dtype {name}" in text
        assert (out == 5.0).all()  # nothing written
    with pytest.raises(TypeError, match=f"{name} operands to numpy.matmul"):
        distmm.make_plan(8, 8, 8, dt)


@pytest.mark.slow
def test_narrow_integers_on_the_dask_engine_are_numpys(client):
    """numpy and dask operands, tiles on two worker processes (the values pickled)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(9)
    a, b = narrow(rng, (130, 260), "int4"), narrow(rng, (260, 70), "uint4")
    want = a @ b
    assert_numpys(distmm.matmul(a, b, engine="dask", client=client, tile=64), want)
    got = distmm.matmul(da.from_array(a, chunks=64), da.from_array(b, chunks=64),
                        engine="dask", client=client)
    assert_numpys(got.compute(), want)
    f8 = np.ones((4, 4), ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn operands to numpy.matmul"):
        distmm.matmul(da.from_array(f8), f8, engine="dask", client=client)


MPI_SCRIPT = r"""
import numpy as np
import ml_dtypes
from mpi4py import MPI

import distmm

rng = np.random.default_rng(4)  # the same operands on every rank
lines = []
for name in ("int4", "uint4", "int2"):
    info = ml_dtypes.iinfo(getattr(ml_dtypes, name))
    for m, k, n in ((130, 260, 70), (1, 300, 1), (5, 3, 7)):
        a, b = (rng.integers(int(info.min), int(info.max) + 1, s).astype(getattr(ml_dtypes, name))
                for s in ((m, k), (k, n)))
        got, want = distmm.matmul(a, b, engine="mpi"), a @ b
        same = got.dtype == want.dtype and np.array_equal(got, want)
        lines.append(f"{name} {m}x{k}x{n}: " + ("ok" if same else f"BAD {got.dtype}"))
f8 = np.ones((4, 4), ml_dtypes.float8_e4m3fn)
try:
    distmm.matmul(f8, f8, engine="mpi")
    lines.append("float8: BAD, not refused")
except TypeError as exc:
    lines.append("float8: " + ("ok" if "to numpy.matmul" in str(exc) else f"BAD {exc}"))
for rank, mine in enumerate(MPI.COMM_WORLD.gather(lines) or []):
    print("\n".join(f"rank {rank}: {line}" for line in mine), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_narrow_integers_on_the_mpi_engine_are_numpys(tmp_path, mpirun):
    """SUMMA over two ranks (a k-split for the 1 x 1), and the refusal on every rank."""
    script = tmp_path / "narrow.py"
    script.write_text(MPI_SCRIPT)
    r = mpirun(2, script, timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("rank ")]
    bad = [line for line in lines if not line.endswith(": ok")]
    assert len(lines) == 2 * 10 and not bad, "\n".join(bad) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
