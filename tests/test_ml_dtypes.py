"""ml_dtypes' narrow operands: its integers narrower than a byte (``int4``, ``uint4``,
``int2``, ``uint2``, ``int1``, ``uint1``) multiply as numpy multiplies them, bit for bit, on
the local, Dask and MPI engines; its narrow floats (``float8_*``, ``float6_*``, ``float4_*``)
multiply as bfloat16 operands do: numpy's result dtype (float32 with one another), panels
cast to float32 and summed in float32, within float32's bound of numpy's values, with numpy's
NaN and Inf elements; but ``float8_e5m2`` (kind 'f', which Dask cannot send) is refused in one
line before any work.

numpy's matmul casts a narrow integer to int8 (the first of its integer loops it casts to
safely) and sums with wrap-around: distmm sums in 64 bits and narrows once, which gives the
same bits. A narrow float it casts to float32 and multiplies with its BLAS's sgemm of the
whole operands, whose summation order depends on their shapes: no tiling of the product
reproduces its bits (as for float32 and bfloat16 operands, which distmm multiplies in float32
without promising numpy's bits).
It does *not* cover: GPU executors (cupy has no narrow dtypes), the command line (``.npy``
and HDF5 store these dtypes as raw bytes, which it refuses).
"""
from __future__ import annotations

import numpy as np
import pytest

import distmm
from conftest import run_rank_script

ml_dtypes = pytest.importorskip("ml_dtypes")

NARROW_INTS = [pytest.param(name, marks=pytest.mark.skipif(
    not hasattr(ml_dtypes, name), reason=f"ml_dtypes {ml_dtypes.__version__} has no {name}"))
    for name in ("int4", "uint4", "int2", "uint2", "int1", "uint1")]
NARROW_FLOATS = sorted(name for name in dir(ml_dtypes)
                       if name.startswith(("float8_", "float6_", "float4_"))
                       and name != "float8_e5m2")  # refused: see its test
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


def narrow_float(rng, shape, name, specials=False):
    """Random values of ml_dtypes' float ``name`` (magnitudes about 2**-8 to 2**4, none
    negative for its unsigned types), with NaN and +-Inf scattered in where ``specials``
    and the type has them (``float8_e4m3``, ``e3m4``: Inf; most: NaN)."""
    dt = np.dtype(getattr(ml_dtypes, name))
    x = rng.standard_normal(shape) * 3
    if float(ml_dtypes.finfo(dt).min) >= 0:
        x = np.abs(x)
    if specials:
        for value in (np.nan, np.inf, -np.inf):
            if not np.isfinite(np.array(value).astype(dt).astype(np.float32)) and x.size > 4:
                x.flat[rng.choice(x.size, 2, replace=False)] = value
    return x.astype(dt)


def assert_float32_close(got, want, a, b):
    """numpy's dtype and shape, numpy's NaN and +-Inf elements, and every finite element
    within float32's bound of numpy's: each of the two sums is within ``gamma_k |A| |B|``
    of the exact one (a narrow float's products are exact in float32)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    for part in ((np.real, np.imag) if want.dtype.kind == "c" else (np.asarray,)):
        for test in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(test(part(got)), test(part(want)))
    finite = np.isfinite(want)
    k = a.shape[-1]
    a64, b64 = (np.nan_to_num(np.abs(x.astype(np.complex128 if x.dtype.kind == "c" else
                                              np.float64)), posinf=0.0) for x in (a, b))
    eps = np.finfo(np.result_type(want.dtype, np.float32)).eps
    bound = 2 * k * eps * (a64 @ b64)
    assert (np.abs(got.astype(np.complex128) - want)[finite] <= bound[finite]).all()


@pytest.mark.parametrize("backend", ["auto", "numba", "blas"])
@pytest.mark.parametrize("name", NARROW_FLOATS)
def test_narrow_floats_multiply_in_float32_as_numpy_does(name, backend):
    """Before, every one was refused ("distmm leaves a product of ... to numpy.matmul").
    Odd shapes, ragged tiles and a k-split, NaN and Inf where the type has them."""
    rng = np.random.default_rng(10)
    for m, k, n in ((7, 199, 13), (1, 5, 1), (5, 1, 3), (67, 130, 45)):
        for specials in (False, True):
            a = narrow_float(rng, (m, k), name, specials)
            b = narrow_float(rng, (k, n), name, specials)
            with np.errstate(invalid="ignore"):  # Inf times 0: numpy's NaN
                want = a @ b
                assert want.dtype == np.float32
                for tile in (None, 16):
                    got = distmm.matmul(a, b, engine="local", backend=backend, tile=tile)
                    assert_float32_close(got, want, a, b)
    a, b = narrow_float(rng, (3, 20, 30), name), narrow_float(rng, (30, 9), name)
    assert_float32_close(distmm.matmul(a, b, backend=backend, tile=8), a @ b, a, b)  # a stack
    got = distmm.matmul(a[0, 0], b[:, 0], engine="local")  # 1-D: a 0-d result
    assert_float32_close(got, a[0, 0] @ b[:, 0], a[0, 0], b[:, 0])


def test_narrow_floats_with_other_operands_keywords_and_precision():
    """Mixed with numpy's and ml_dtypes' other types (numpy's result dtype: float64 for
    int64, complex64 for complex64), ``dtype=``, ``out=`` of a narrow float (distmm's float32
    result cast to it, as numpy casts its own), and the precision modes as bfloat16 operands
    take them: float32 results only, refused in one line before any work otherwise."""
    rng = np.random.default_rng(11)
    a = narrow_float(rng, (40, 50), "float8_e4m3fn")
    e5 = narrow_float(rng, (50, 30), "float8_e5m2fnuz")
    others = [e5, rng.standard_normal((50, 30)), rng.integers(-9, 9, (50, 30)).astype(np.int8),
              rng.integers(-9, 9, (50, 30)), (rng.standard_normal((50, 30)) * 1j).astype(np.complex64),
              rng.standard_normal((50, 30)).astype(ml_dtypes.bfloat16),
              narrow(rng, (50, 30), "int4"), np.ones((50, 30), bool)]
    for y in others:
        assert_float32_close(distmm.matmul(a, y, tile=16), a @ y, a, y)
        assert_float32_close(distmm.matmul(y.T, a.T, tile=16), y.T @ a.T, y.T, a.T)
    got = distmm.matmul(a, e5, dtype=np.float64, tile=16)
    assert_float32_close(got, np.matmul(a, e5, dtype=np.float64), a, e5)
    for out_dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16, np.float16, np.float64):
        got = np.full((40, 30), 7, out_dtype)
        assert distmm.matmul(a, e5, out=got, tile=16) is got
        np.matmul(a, e5, out=np.empty((40, 30), out_dtype))  # numpy takes it
        assert np.array_equal(got, distmm.matmul(a, e5, tile=16).astype(out_dtype))
    k = a.shape[1]
    a64, b64 = np.abs(a.astype(np.float64)), np.abs(e5.astype(np.float64))
    for mode in ("tf32", "bf16", "fp16"):
        # e4m3fn and e5m2fnuz values are exact in each format: the modes sum them in float32
        got = distmm.matmul(a, e5, precision=mode, tile=16)
        assert got.dtype == np.float32
        bound = (distmm.precision.error_bound(mode, k) + k * 2.0**-23) * (a64 @ b64)
        assert (np.abs(got - (a @ e5)) <= bound).all()
    out = np.full((40, 30), 7.0)
    with pytest.raises(TypeError) as err:
        distmm.matmul(a, others[1], precision="bf16", out=out)
    assert "\n" not in str(err.value) and "float64" in str(err.value)
    assert (out == 7.0).all()
    assert distmm.make_plan(8, 8, 8, ml_dtypes.float8_e4m3fn).acc_dtype == "float32"


def test_float8_e5m2_is_refused_in_one_line_before_any_work():
    """Its kind is 'f': distributed's serializer sends its dtype as '<f1', which numpy does not
    read back, and a Dask product of its blocks hung (seen with ``da.from_array`` operands)."""
    x = np.ones((4, 6), ml_dtypes.float8_e5m2)
    out = np.full((4, 4), 5.0, np.float32)
    for a, b, which in ((x, x.T, "a"), (np.ones((4, 6), np.float32), x.T, "b")):
        with pytest.raises(TypeError) as err:
            distmm.matmul(a, b, out=out, engine="local")
        text = str(err.value)
        assert "\n" not in text and f"{which} has dtype float8_e5m2" in text and "float32" in text
        assert (out == 5.0).all()  # nothing written


@pytest.mark.slow
def test_narrow_operands_on_the_dask_engine(client):
    """numpy and dask operands, tiles on two worker processes (the values pickled)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(9)
    a, b = narrow(rng, (130, 260), "int4"), narrow(rng, (260, 70), "uint4")
    want = a @ b
    assert_numpys(distmm.matmul(a, b, engine="dask", client=client, tile=64), want)
    got = distmm.matmul(da.from_array(a, chunks=64), da.from_array(b, chunks=64),
                        engine="dask", client=client)
    assert_numpys(got.compute(), want)
    # float8 operands: panels cast to float32 on the workers
    f8 = narrow_float(rng, (130, 260), "float8_e4m3fn")
    b8 = narrow_float(rng, (260, 70), "float8_e4m3b11fnuz")
    want = f8 @ b8
    assert_float32_close(distmm.matmul(f8, b8, engine="dask", client=client, tile=64), want, f8, b8)
    got = distmm.matmul(da.from_array(f8, chunks=64), da.from_array(b8, chunks=64),
                        engine="dask", client=client)
    assert_float32_close(got.compute(), want, f8, b8)


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
for m, k, n in ((130, 260, 70), (1, 300, 1)):  # float32 sums of the float8 values
    a = (rng.standard_normal((m, k)) * 3).astype(ml_dtypes.float8_e4m3fn)
    b = (rng.standard_normal((k, n)) * 3).astype(ml_dtypes.float8_e5m2fnuz)
    got, want = distmm.matmul(a, b, engine="mpi"), a @ b
    bound = 2 * k * 2.0**-23 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    same = got.dtype == want.dtype and (np.abs(got - want) <= bound).all()
    lines.append(f"float8 {m}x{k}x{n}: " + ("ok" if same else f"BAD {got.dtype}"))
for rank, mine in enumerate(MPI.COMM_WORLD.gather(lines) or []):
    print("\n".join(f"rank {rank}: {line}" for line in mine), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_narrow_operands_on_the_mpi_engine(tmp_path, mpirun):
    """SUMMA over two ranks (a k-split for the 1 x 1), integers and float8, on every rank."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "narrow.py", MPI_SCRIPT, 2)
    assert len(lines) == 2 * 11 and not bad, "\n".join(bad) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
