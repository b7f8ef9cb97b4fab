"""``precision=`` audited on the CPU, beyond tests/test_precision.py. On the local, Dask and
MPI engines a reduced mode gives, bit for bit, what "highest" gives for the operands rounded
to the mode's format: the rounding is the only change, so the engines agree where their
"highest" products do (one plan: the local engine and Dask's tile layout) and differ only
as those do (the MPI engine's SUMMA and Dask's block layout are other plans), within the
bound. Also: the bound reached at ties, numpy's dtype rules and exception types, an unknown
mode refused on every route and ``u_acc`` checked, and NaN and Inf as numpy's.

Every input is fresh (``np.random.default_rng()``), float32 unless the case is a dtype.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import distmm
from distmm.executor.reduced import round_to
from distmm.precision import UNIT_ROUNDOFF, error_bound

from conftest import run_rank_script

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
MODES = ("tf32", "bf16", "fp16")
BAD = ("bf17", 3, b"tf32", "tf32 ")


def rounded(x, mode):
    """``x`` rounded to the mode's format, in its own shape (float32)."""
    return round_to(np.asarray(x, np.float32), mode).reshape(np.shape(x))


def ratio(c, a, b, mode, *, out_dtype=None):
    """The largest ratio of ``|c - A @ B|`` (float64) to the mode's bound on it."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(np.asarray(c, np.float64) - a64 @ b64)
    scale = (np.abs(a64) @ np.abs(b64)) * error_bound(mode, a64.shape[-1], out_dtype=out_dtype)
    return float(np.max(err / np.maximum(scale, np.finfo(np.float64).tiny), initial=0.0))


def ties(rng, shape, mode):
    """float32 values 1 + 3 u_in (times a random sign and power of two): a tie every
    format rounds up in magnitude, to 1 + 4 u_in (TF32 away from zero; bfloat16 and
    float16 to even), so every product errs by nearly 2 u_in, the bound's leading term."""
    u = UNIT_ROUNDOFF[mode]
    sign = rng.choice([-1.0, 1.0], size=shape)
    return (sign * (1 + 3 * u) * 2.0 ** rng.integers(-3, 4, size=shape)).astype(np.float32)


# -- an unknown mode, on every route --------------------------------------------------------


class _Override:
    """An operand that takes numpy's call (``__array_ufunc__``), recording that it did."""
    called = False

    def __array_ufunc__(self, ufunc, method, *args, **kwargs):
        type(self).called = True
        return "override"


class _Sub(np.ndarray):
    """An ndarray subclass (the route that unwraps it and wraps the result)."""


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_unknown_precision_refused_on_every_route(bad):
    """An unknown mode is a ValueError of one line naming it, before any work, whichever
    route the call takes: numpy's own call (``signature=``, an operand overriding
    ``__array_ufunc__``, a masked ``out``) took it silently before, and handed the call on."""
    rng = np.random.default_rng()
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32)
    _Override.called = False
    calls = {
        "plain": lambda: distmm.matmul(a, b, precision=bad),
        "signature": lambda: distmm.matmul(a, b, signature="ff->f", precision=bad),
        "override": lambda: distmm.matmul(a, _Override(), precision=bad),
        "masked out": lambda: distmm.matmul(a, b, out=np.ma.zeros((5, 3), np.float32),
                                            precision=bad),
        "subclass": lambda: distmm.matmul(a.view(_Sub), b, precision=bad),
        "axes": lambda: distmm.matmul(a, b, axes=[(0, 1), (0, 1), (0, 1)], precision=bad),
        "stack": lambda: distmm.matmul(np.stack([a, a]), b, precision=bad),
        "empty": lambda: distmm.matmul(a[:0], b, precision=bad),
        "k = 0": lambda: distmm.matmul(a[:, :0], b[:0], precision=bad),
        "gemm alpha = 0": lambda: distmm.gemm(a, b, alpha=0.0, precision=bad),
    }
    for route, call in calls.items():
        try:
            call()
        except ValueError as exc:
            msg = str(exc)
        else:
            pytest.fail(f"{route}: precision={bad!r} was taken")
        assert "\n" not in msg and f"got {bad!r}" in msg and "precision" in msg, (route, msg)
    assert not _Override.called


@pytest.mark.parametrize("bad", ["bf17", "None", "3"])
def test_cli_refuses_unknown_precision(bad, tmp_path, capsys):
    """``--precision bf17`` (``None``, ``3``): status 2, one line naming the value, no
    output file and nothing staged beside it."""
    from distmm.cli import main

    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((5, 7)).astype(np.float32))
    np.save(tmp_path / "b.npy", rng.standard_normal((7, 3)).astype(np.float32))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["matmul", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o",
              str(tmp_path / "c.npy"), "--no-progress", "--precision", bad])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and "--precision" in err and repr(bad.lower()) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


def test_error_bound_refuses_none_and_numbers():
    for bad in (None, 3, "bf17", "highest"):
        with pytest.raises(ValueError, match="precision must be one of tf32, bf16, fp16"):
            error_bound(bad, 10)


def test_error_bound_checks_u_acc():
    """``u_acc`` is a unit roundoff in [0, 1): a negative one gave a bound smaller than the
    operands' rounding alone, NaN a NaN bound, 2.0 a message blaming k, a string or None
    Python's own TypeError; a float32 one rounded the bound to float32."""
    assert error_bound("tf32", 10, u_acc=0.0) == error_bound("tf32", 1)
    got = error_bound("tf32", 10, u_acc=np.float32(2.0**-23))
    assert type(got) is float and got == error_bound("tf32", 10, u_acc=2.0**-23)
    for bad in (-2.0**-24, float("nan"), float("inf"), 1.0, 2.0):
        with pytest.raises(ValueError, match=r"u_acc must be a unit roundoff in \[0, 1\), "
                                             f"got {bad!r}"):
            error_bound("bf16", 10, u_acc=bad)
    for bad in ("x", None, True, 1j):
        with pytest.raises(TypeError, match=f"u_acc must be a real number, got {bad!r}"):
            error_bound("fp16", 10, u_acc=bad)


# -- the same bits: "highest" on the rounded operands ---------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_local_is_highest_of_rounded_operands(mode):
    """Bit for bit, on each backend and tile: the mode rounds the operands and changes
    nothing else (summation order, k split, views, stacks, ``out=``, gemm's scaling)."""
    rng = np.random.default_rng()
    m, k, n = 37, 301, 23
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    ra, rb = rounded(a, mode), rounded(b, mode)
    for backend in ("blas", "numba"):
        for tile in (None, (16, 16, 32), (8, 8, 8)):
            got = distmm.matmul(a, b, precision=mode, backend=backend, tile=tile)
            want = distmm.matmul(ra, rb, backend=backend, tile=tile)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want, err_msg=f"{backend} {tile}")
    # a transposed and strided view of a bigger array, a Fortran-ordered one
    big = rng.standard_normal((2 * k + 1, 3 * m)).astype(np.float32)
    view = big[1::2, ::3].T
    fort = np.asfortranarray(b)
    np.testing.assert_array_equal(distmm.matmul(view, fort, precision=mode),
                                  distmm.matmul(rounded(view, mode), rb))
    # a stack with broadcast batch dimensions
    a3 = rng.standard_normal((3, 1, 13, 27)).astype(np.float32)
    b3 = rng.standard_normal((4, 27, 9)).astype(np.float32)
    got = distmm.matmul(a3, b3, precision=mode, tile=(8, 8, 8))
    assert got.shape == np.matmul(a3, b3).shape
    np.testing.assert_array_equal(got, distmm.matmul(rounded(a3, mode), rounded(b3, mode),
                                                     tile=(8, 8, 8)))
    # out=: float32, a transposed one, a float64 one (the float32 result cast)
    want = distmm.matmul(ra, rb)
    for out in (np.empty((m, n), np.float32), np.empty((n, m), np.float32).T,
                np.empty((m, n))):
        assert distmm.matmul(a, b, out=out, precision=mode) is out
        np.testing.assert_array_equal(out, want.astype(out.dtype))
    # out= the operand itself (numpy's overlap rule: as through a copy); order=
    sq = rng.standard_normal((29, 29)).astype(np.float32)
    want = distmm.matmul(rounded(sq, mode), rounded(sq.T, mode), tile=(8, 8, 8))
    distmm.matmul(sq, sq.T, out=sq, precision=mode, tile=(8, 8, 8))
    np.testing.assert_array_equal(sq, want)
    f_ordered = distmm.matmul(a, b, order="F", precision=mode)
    assert f_ordered.flags.f_contiguous
    np.testing.assert_array_equal(f_ordered, distmm.matmul(ra, rb))
    # gemm: alpha and beta scale the rounded operands' product
    c = rng.standard_normal((m, n)).astype(np.float32)
    np.testing.assert_array_equal(
        distmm.gemm(a.T, b, c, alpha=-1.5, beta=0.25, trans_a=True, precision=mode),
        distmm.gemm(ra.T, rb, c, alpha=-1.5, beta=0.25, trans_a=True))


@pytest.mark.slow
def test_dask_is_highest_of_rounded_operands(client):
    """The Dask engine: its product of the rounded operands under "highest", bit for bit,
    in tile and block layouts and for dask-array operands; in tile layout, the local
    engine's bits for the same tile and backend (one plan); numpy's NaN and Inf, 0-size
    dimensions, and the refusal of a float64 product."""
    import dask.array as da
    import dask.config

    rng = np.random.default_rng()
    a = rng.standard_normal((45, 83)).astype(np.float32)
    b = rng.standard_normal((83, 37)).astype(np.float32)
    for mode in MODES:
        ra, rb = rounded(a, mode), rounded(b, mode)
        for layout in ("tiles", "blocks"):
            with dask.config.set({"distmm.dask-layout": layout}):
                for backend in ("blas", "numba"):
                    kw = dict(engine="dask", client=client, backend=backend, tile=(16, 16, 16))
                    got = distmm.matmul(a, b, precision=mode, **kw)
                    np.testing.assert_array_equal(got, distmm.matmul(ra, rb, **kw))
                    if layout == "tiles":
                        np.testing.assert_array_equal(got, distmm.matmul(
                            a, b, precision=mode, backend=backend, tile=(16, 16, 16)))
                out = np.empty((45, 37), np.float32)
                distmm.matmul(a, b, out=out, engine="dask", client=client, precision=mode)
                np.testing.assert_array_equal(out, distmm.matmul(ra, rb, engine="dask",
                                                                 client=client))
        lazy = distmm.matmul(da.from_array(a, chunks=(20, 30)), da.from_array(b, chunks=(30, 19)),
                             client=client, precision=mode)
        plain = distmm.matmul(da.from_array(ra, chunks=(20, 30)),
                              da.from_array(rb, chunks=(30, 19)), client=client)
        assert lazy.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(lazy.compute()), np.asarray(plain.compute()))
        a3 = rng.standard_normal((4, 11, 17)).astype(np.float32)
        got = distmm.matmul(a3, b[:17], engine="dask", client=client, precision=mode)
        np.testing.assert_array_equal(got, distmm.matmul(rounded(a3, mode), rb[:17],
                                                         engine="dask", client=client))
        x, y = a.copy(), b.copy()
        x[0, 0], x[3, 7], y[7, 2], y[0, :] = np.inf, np.nan, -np.inf, 0
        with np.errstate(all="ignore"):
            got = distmm.matmul(x, y, engine="dask", client=client, precision=mode)
            want = np.matmul(x, y)
        for f in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(f(got), f(want))
        empty = distmm.matmul(a[:, :0], b[:0], engine="dask", client=client, precision=mode)
        assert empty.dtype == np.float32 and empty.shape == (45, 37) and not empty.any()
        with pytest.raises(TypeError, match=f"precision='{mode}' needs a float32"):
            distmm.matmul(a.astype(np.float64), b, engine="dask", client=client, precision=mode)


# -- the bound: reached, never passed -------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_bound_is_reached_at_ties(mode):
    """Operands on ties (``ties``): every engine's error is within the bound and within
    3 % of it, so its leading ``2 u_in`` is the format's unit roundoff, not a looser one;
    k of 1 (no sum), odd, and split into k groups."""
    rng = np.random.default_rng()
    for m, k, n in ((3, 1, 5), (9, 37, 7), (5, 129, 3)):
        a, b = ties(rng, (m, k), mode), ties(rng, (k, n), mode)
        a[:, :] = np.abs(a) * np.sign(a[:, :1])  # one sign per row: no cancellation
        b[:, :] = np.abs(b) * np.sign(b[:1, :])
        for backend in ("blas", "numba"):
            c = distmm.matmul(a, b, precision=mode, backend=backend, tile=(8, 8, 32))
            assert 0.97 < ratio(c, a, b, mode) <= 1, (m, k, n, backend)


# -- dtypes: numpy's result dtype, its exception types --------------------------------------


@pytest.mark.parametrize("pair", [("int8", "bfloat16"), ("bool", "bfloat16"),
                                  ("float16", "bfloat16"), ("bool", "float16"),
                                  ("uint8", "float16"), ("int16", "float16"),
                                  ("int16", "float32"), ("float16", "float32")], ids=str)
def test_mixed_dtypes_take_numpys_result_dtype(pair):
    """Mixed operands whose numpy result is float32 or float16: that dtype, within the
    bound (float16's last rounding included)."""
    rng = np.random.default_rng()
    dts = [BF16 if name == "bfloat16" else np.dtype(name) for name in pair]
    a = (rng.standard_normal((7, 19)) * 4).astype(dts[0])
    b = (rng.standard_normal((19, 5)) * 4).astype(dts[1])
    want = np.matmul(a, b).dtype
    for mode in MODES:
        got = distmm.matmul(a, b, precision=mode)
        assert got.dtype == want and got.shape == (7, 5)
        out = np.float16 if want == np.float16 else None
        assert ratio(got, a, b, mode, out_dtype=out) <= 1


@pytest.mark.parametrize("pair", [("float16", "float64"), ("bfloat16", "complex64"),
                                  ("int32", "int32"), ("bool", "bool"), ("int8", "uint8"),
                                  ("complex128", "complex128"), ("object", "object"),
                                  ("float32", "int64")], ids=str)
def test_other_result_dtypes_refused(pair):
    """A result that is not float32, float16 or bfloat16 (numpy's, mixed operands too):
    a TypeError of one line naming it, on matmul and gemm; "highest" gives numpy's."""
    dts = [BF16 if name == "bfloat16" else np.dtype(name) for name in pair]
    a, b = np.ones((3, 4), dts[0]), np.ones((4, 2), dts[1])
    want = np.matmul(a, b)
    for call in (distmm.matmul, distmm.gemm):
        with pytest.raises(TypeError) as info:
            call(a, b, precision="bf16")
        msg = str(info.value)
        assert "\n" not in msg and f"result dtype is {want.dtype}" in msg, msg
    got = distmm.matmul(a, b, precision="highest")
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_loop_dtype_and_out_dtype():
    """``dtype=`` names the product's dtype (float64 operands in a float32 loop take a
    mode; float32 ones in a float64 loop do not); ``out=`` casts the result as numpy's
    does, and refuses with numpy's exception type where ``casting`` does not allow it."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((6, 11)), rng.standard_normal((11, 4))
    got = distmm.matmul(a, b, dtype=np.float32, casting="same_kind", precision="tf32")
    assert got.dtype == np.matmul(a, b, dtype=np.float32, casting="same_kind").dtype
    np.testing.assert_array_equal(got, distmm.matmul(rounded(a, "tf32"), rounded(b, "tf32")))
    with pytest.raises(TypeError, match="result dtype is float64"):
        distmm.matmul(a.astype(np.float32), b.astype(np.float32), dtype=np.float64,
                      precision="tf32")
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    for bad_out in (np.empty((6, 4), np.int32), np.empty((6, 4), bool)):
        with pytest.raises(TypeError) as numpys:
            np.matmul(a32, b32, out=bad_out)
        with pytest.raises(type(numpys.value)):
            distmm.matmul(a32, b32, out=bad_out, precision="fp16")
    half = np.empty((6, 4), np.float16)
    distmm.matmul(a32, b32, out=half, precision="fp16")
    np.testing.assert_array_equal(half, distmm.matmul(a32, b32, precision="fp16")
                                  .astype(np.float16))
    # a vector product is numpy's scalar type
    v = a32[0]
    s = distmm.matmul(v, v, precision="bf16")
    assert type(s) is type(np.matmul(v, v)) and s == distmm.matmul(v[None], v[:, None],
                                                                   precision="bf16")[0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_zero_size_dimensions(mode):
    rng = np.random.default_rng()
    for sa, sb in (((0, 4), (4, 3)), ((3, 0), (0, 2)), ((3, 4), (4, 0)), ((2, 0, 4), (4, 3)),
                   ((0, 3, 5), (5, 2))):
        a = rng.standard_normal(sa).astype(np.float32)
        b = rng.standard_normal(sb).astype(np.float32)
        want = np.matmul(a, b)
        got = distmm.matmul(a, b, precision=mode)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    c = rng.standard_normal((3, 2)).astype(np.float32)
    got = distmm.gemm(np.ones((3, 0), np.float32), np.ones((0, 2), np.float32), c, beta=-2.0,
                      precision=mode)
    np.testing.assert_array_equal(got, -2.0 * c)


# -- NaN and Inf ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nan_and_inf_as_numpy(dtype):
    """Operands with NaN, infinities and signed zeros scattered: NaN, +Inf, -Inf and the
    sign of zero where numpy's are, in every mode and on each backend (values the
    formats hold: standard normal, ±0, ±Inf, NaN)."""
    rng = np.random.default_rng()
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])
    for _ in range(40):
        m, k, n = rng.integers(1, 9, size=3)
        a = rng.standard_normal((m, k))
        b = rng.standard_normal((k, n))
        for x in (a, b):
            hit = rng.random(x.shape) < 0.2
            x[hit] = rng.choice(specials, size=int(hit.sum()))
        a, b = a.astype(dt), b.astype(dt)
        with np.errstate(all="ignore"):
            want = np.matmul(a, b)
            for mode in MODES:
                for backend in ("blas", "numba"):
                    got = distmm.matmul(a, b, precision=mode, backend=backend)
                    assert got.dtype == want.dtype
                    for f in (np.isnan, np.isposinf, np.isneginf):
                        np.testing.assert_array_equal(f(got), f(want), err_msg=f"{mode} {f}")
                    zero = (got == 0) & (want == 0)
                    np.testing.assert_array_equal(np.signbit(got)[zero], np.signbit(want)[zero])


def test_rounding_makes_infinities_and_zeros():
    """Where numpy differs, the operands' rounding decides (as on the tensor cores): a
    finite value past the format's range is an infinity (float16's under "fp16", float32's
    largest rounded up under "tf32" and "bf16"), without a warning; one below the format's
    smallest subnormal is zero, so an infinity meeting it is NaN, with numpy's "invalid
    value" report of inf * 0."""
    big = np.array([[7e4, 1.0]], np.float32), np.array([[1e-3], [1.0]], np.float32)
    top = np.array([[np.finfo(np.float32).max]], np.float32), np.array([[0.5]], np.float32)
    tiny = np.array([[np.inf, 1.0]], np.float32), np.array([[1e-10], [1.0]], np.float32)
    least = np.array([[np.inf, 1.0]], np.float32), np.array([[1e-45], [1.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isfinite(np.matmul(*big)).all() and np.isfinite(np.matmul(*top)).all()
        assert np.isposinf(np.matmul(*tiny)).all() and np.isposinf(np.matmul(*least)).all()
        assert np.isposinf(distmm.matmul(*big, precision="fp16")).all()
        for mode in ("tf32", "bf16"):
            assert np.isfinite(distmm.matmul(*big, precision=mode)).all()
            assert np.isposinf(distmm.matmul(*tiny, precision=mode)).all()
        for mode in MODES:
            assert np.isposinf(distmm.matmul(*top, precision=mode)).all()
    for mode, (a, b) in [(mode, least) for mode in MODES] + [("fp16", tiny)]:
        with pytest.warns(RuntimeWarning, match="invalid value"):
            assert np.isnan(distmm.matmul(a, b, precision=mode)).all()


# -- MPI engine (real mpiexec, 2 ranks) -----------------------------------------------------

MPI_SCRIPT = r"""
import sys

import numpy as np
from mpi4py import MPI

import distmm
from distmm.executor.reduced import round_to
from distmm.precision import error_bound

comm = MPI.COMM_WORLD
P = comm.size
rng = np.random.default_rng(int(sys.argv[1]))  # a fresh seed, the same on every rank
lines = []


def rounded(x, mode):
    return round_to(np.asarray(x, np.float32), mode).reshape(np.shape(x))


def same(name, got, want):
    ok = (got.dtype == want.dtype and got.shape == want.shape
          and np.array_equal(got, want, equal_nan=True))
    lines.append(f"{name}: " + ("ok" if ok else f"BAD {got.dtype}{got.shape} "
                                f"{np.ravel(got)[:3]} != {want.dtype}{want.shape} "
                                f"{np.ravel(want)[:3]}"))


def refused(name, call, kind, text):
    try:
        call()
        lines.append(f"{name}: BAD not refused")
    except kind as exc:
        lines.append(f"{name}: " + ("ok" if text in str(exc) and "\n" not in str(exc)
                                    else f"BAD {exc!r}"))


for mode in ("tf32", "bf16", "fp16"):
    for m, k, n in ((2 * P + 3, 5 * P + 1, 3 * P + 2), (1, 9, 1), (37, 301, 23)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        ra, rb = rounded(a, mode), rounded(b, mode)
        for backend in ("blas", "numba"):
            kw = dict(engine="mpi", backend=backend)
            same(f"{mode} {m}x{k}x{n} {backend}", distmm.matmul(a, b, precision=mode, **kw),
                 distmm.matmul(ra, rb, **kw))
        c = rng.standard_normal((m, n)).astype(np.float32)
        same(f"{mode} {m}x{k}x{n} gemm",
             distmm.gemm(np.ascontiguousarray(a.T), b, c, alpha=-1.5, beta=0.5, trans_a=True,
                         engine="mpi", precision=mode),
             distmm.gemm(ra, rb, c, alpha=-1.5, beta=0.5, engine="mpi"))
        out = np.empty((n, m), np.float32).T
        distmm.matmul(a, b, out=out, engine="mpi", precision=mode)
        same(f"{mode} {m}x{k}x{n} out", out, distmm.matmul(ra, rb, engine="mpi"))
    a3 = rng.standard_normal((3, 1, 7, 13)).astype(np.float32)
    b3 = rng.standard_normal((2, 13, 5)).astype(np.float32)
    same(f"{mode} stack", distmm.matmul(a3, b3, engine="mpi", precision=mode),
         distmm.matmul(rounded(a3, mode), rounded(b3, mode), engine="mpi"))
    big = rng.standard_normal((61, 40)).astype(np.float32)
    view = big[1::2, ::3].T  # 14 x 30, strided and transposed
    same(f"{mode} view", distmm.matmul(view, big[:30, :9], engine="mpi", precision=mode),
         distmm.matmul(rounded(view, mode), rounded(big[:30, :9], mode), engine="mpi"))
    for sa, sb in (((3, 0), (0, 4)), ((0, 5), (5, 2)), ((2, 0, 3), (3, 4))):
        a, b = np.ones(sa, np.float32), np.ones(sb, np.float32)
        same(f"{mode} empty {sa}", distmm.matmul(a, b, engine="mpi", precision=mode),
             np.matmul(a, b))
    h = rng.standard_normal((2 * P + 1, 401)).astype(np.float16)
    g = rng.standard_normal((401, P + 2)).astype(np.float16)
    c = distmm.matmul(h, g, engine="mpi", precision=mode)
    h64, g64 = h.astype(np.float64), g.astype(np.float64)
    bound = error_bound(mode, 401, out_dtype=np.float16) * (np.abs(h64) @ np.abs(g64))
    ok = c.dtype == np.float16 and np.all(np.abs(c.astype(np.float64) - h64 @ g64) <= bound)
    lines.append(f"{mode} float16 bound: " + ("ok" if ok else "BAD"))
    x = np.array([[np.inf, 1, 0], [np.nan, 1, 1], [-0.0, -0.0, 2], [1, 2, 3]], np.float32)
    y = np.array([[0, 1], [1, -np.inf], [1, 2]], np.float32)
    with np.errstate(all="ignore"):
        got, want = distmm.matmul(x, y, engine="mpi", precision=mode), np.matmul(x, y)
    lines.append(f"{mode} nonfinite: " + ("ok" if all(
        np.array_equal(f(got), f(want)) for f in (np.isnan, np.isposinf, np.isneginf))
        else f"BAD {got.ravel()} != {want.ravel()}"))
a = rng.standard_normal((5, 7)).astype(np.float32)
for bad in ("bf17", 3):
    refused(f"{bad!r}", lambda: distmm.matmul(a, a.T, engine="mpi", precision=bad),
            ValueError, f"got {bad!r}")
    refused(f"{bad!r} signature", lambda: distmm.matmul(a, a.T, engine="mpi", signature="ff->f",
                                                        precision=bad), ValueError, f"got {bad!r}")
    refused(f"{bad!r} gemm", lambda: distmm.gemm(a, a.T, engine="mpi", precision=bad),
            ValueError, f"got {bad!r}")
refused("float64", lambda: distmm.matmul(a.astype(float), a.T, engine="mpi", precision="tf32"),
        TypeError, "result dtype is float64")
same("after the refusals", distmm.matmul(a, a.T, engine="mpi", precision="bf16"),
     distmm.matmul(rounded(a, "bf16"), rounded(a.T, "bf16"), engine="mpi"))
for rank, mine in enumerate(comm.gather(lines) or []):
    print("\n".join(f"rank {rank}: {line}" for line in mine), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_is_highest_of_rounded_operands(mpirun, tmp_path):
    """engine="mpi" on 2 ranks: "highest" on the rounded operands bit for bit (SUMMA's
    plan, each backend, gemm, a transposed ``out``, stacks, strided views), 0-size
    dimensions, a float16 result within its bound, numpy's NaN and Inf, and an unknown
    mode refused on every rank (``signature=`` too) without leaving one waiting."""
    seed = int(np.random.default_rng().integers(2**31))
    r, lines, bad = run_rank_script(mpirun, tmp_path / "precision.py", MPI_SCRIPT, 2, seed,
                                    timeout=240)
    assert len(lines) == 2 * (3 * (3 * 4 + 1 + 1 + 3 + 2) + 2 * 3 + 2), r.stdout + r.stderr[-3000:]
    assert not bad, "\n".join(bad) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
