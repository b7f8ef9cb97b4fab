"""``precision=``: the reduced modes emulated on the CPU (local, Dask, MPI engines and the
command line), their stated error bounds, "highest" unchanged, and the refusals.

Every bound check compares against a float64 product of the operands as given, elementwise:
``|C - C_ref| <= error_bound(mode, k) * (|A| @ |B|)`` (``distmm.precision``). That the
bound is not vacuous is checked too: inputs with bits below the format's significand give
results that differ from float32's, by more than float32's own bound allows.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import distmm
from distmm.executor.reduced import round_to
from distmm.precision import UNIT_ROUNDOFF, error_bound

from conftest import run_cli

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
HERE = Path(__file__).resolve().parent
MODES = ("tf32", "bf16", "fp16")
# odd sizes, a k of one, a long k, and one that needs several tiles and a k-split
SHAPES = [(22, 23, 24), (37, 29, 53), (1, 9, 1), (5, 3, 700)]


def within_bound(c, a, b, mode, *, out_dtype=None, alpha=1.0):
    """``c`` against the float64 product of ``a`` and ``b``: the largest ratio of the
    error to ``error_bound * |alpha| |A| |B|`` (at most 1 when the bound holds)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = alpha * (a64 @ b64)
    scale = abs(alpha) * (np.abs(a64) @ np.abs(b64)) * error_bound(mode, a.shape[-1],
                                                                    out_dtype=out_dtype)
    err = np.abs(np.asarray(c, np.float64) - ref)
    tiny = np.finfo(np.float64).tiny
    return float(np.max(err / np.maximum(scale, tiny), initial=0.0))


def low_bits(rng, shape):
    """float32 values whose significands reach below TF32's and bfloat16's (1 + a random
    multiple of 2^-20, a random sign and power of two): every format rounds them."""
    frac = rng.integers(1, 2**20, size=shape) * 2.0**-20
    sign = rng.choice([-1.0, 1.0], size=shape)
    return (sign * (1 + frac) * 2.0 ** rng.integers(-3, 4, size=shape)).astype(np.float32)


# -- the rounding the executors emulate ---------------------------------------------------

def test_round_to_formats():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-6, 6, 20000)).astype(np.float32)
    for mode, dropped in (("tf32", 13), ("bf16", 16)):
        r = round_to(x, mode)
        assert r.dtype == np.float32
        assert not (r.view(np.uint32) & np.uint32((1 << dropped) - 1)).any(), mode
        assert np.max(np.abs(r - x) / np.abs(x)) <= UNIT_ROUNDOFF[mode], mode
    # bfloat16 rounds as ml_dtypes's cast (nearest, ties to even); float16 as numpy's
    np.testing.assert_array_equal(round_to(x, "bf16"), x.astype(BF16).astype(np.float32))
    y = x[np.abs(x) < 6e4]
    np.testing.assert_array_equal(round_to(y, "fp16"), y.astype(np.float16).astype(np.float32))
    # ties: TF32 away from zero (cvt.rna), bfloat16 to even
    tie_tf32 = np.array([1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11], np.float32)
    np.testing.assert_array_equal(round_to(tie_tf32, "tf32"),
                                  np.array([1 + 2**-10, -(1 + 2**-10), 1 + 2**-9], np.float32))
    tie_bf16 = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    np.testing.assert_array_equal(round_to(tie_bf16, "bf16"),
                                  np.array([1.0, 1 + 2**-6], np.float32))
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, np.finfo(np.float32).max], np.float32)
    for mode in MODES:
        r = round_to(special, mode)
        assert np.isposinf(r[0]) and np.isneginf(r[1]) and np.isnan(r[2]), mode
        assert r[3] == 0 and np.signbit(r[4]) and np.isposinf(r[5]), mode


def test_round_to_refuses_unknown_mode():
    with pytest.raises(ValueError, match="tf32, bf16, fp16"):
        round_to(np.ones(3, np.float32), "fp8")


# -- the bound, local engine --------------------------------------------------------------

@pytest.mark.parametrize("backend", ["blas", "numba"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=lambda v: str(v))
def test_local_within_bound(mode, backend, m, n, k):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    # a small tile: several C tiles and k groups, summed along the plan's tree
    c = distmm.matmul(a, b, engine="local", backend=backend, tile=(8, 8, 16), precision=mode)
    assert c.dtype == np.float32 and c.shape == (m, n)
    assert within_bound(c, a, b, mode) <= 1


@pytest.mark.parametrize("mode", MODES)
def test_emulation_is_rounded_inputs_summed_in_float32(mode):
    """The emulated product is the float64 product of the rounded operands, up to float32
    summation alone (gamma_{k-1}): the rounding is the format's, nothing else is lost."""
    rng = np.random.default_rng(7)
    a, b = low_bits(rng, (31, 77)), low_bits(rng, (77, 19))
    c = distmm.matmul(a, b, precision=mode).astype(np.float64)
    ar, br = round_to(a, mode).astype(np.float64), round_to(b, mode).astype(np.float64)
    u = 2.0**-24
    gamma = 76 * u / (1 - 76 * u)
    assert np.all(np.abs(c - ar @ br) <= gamma * (np.abs(ar) @ np.abs(br)))


@pytest.mark.parametrize("mode", MODES)
def test_bound_is_not_vacuous(mode):
    """Bits below the format's significand: the reduced result differs from float32's,
    by more than float32's own bound (gamma_k |A||B|), and stays within the mode's."""
    rng = np.random.default_rng(3)
    a, b = low_bits(rng, (17, 45)), low_bits(rng, (45, 13))
    c32 = distmm.matmul(a, b)
    c = distmm.matmul(a, b, precision=mode)
    assert not np.array_equal(c, c32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    err = np.abs(c.astype(np.float64) - a64 @ b64)
    fp32_bound = 45 * 2.0**-24 / (1 - 45 * 2.0**-24) * (np.abs(a64) @ np.abs(b64))
    assert np.any(err > fp32_bound)
    assert within_bound(c, a, b, mode) <= 1
    # and the constant case of the TF32 docs: 1 + 2^-15 is 1 in every format
    ones = np.full((4, 64), 1 + 2**-15, np.float32)
    np.testing.assert_array_equal(distmm.matmul(ones, ones.T, precision=mode),
                                  np.full((4, 4), 64.0, np.float32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, "T"),
                                             ("C", True)])
def test_gemm_transposes_within_bound(mode, trans_a, trans_b):
    rng = np.random.default_rng(11)
    m, n, k = 13, 21, 34
    a = rng.standard_normal((k, m) if trans_a not in (False, "N") else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b not in (False, "N") else (k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    got = distmm.gemm(a, b, c0, alpha=-1.5, beta=0.0, trans_a=trans_a, trans_b=trans_b,
                      tile=(8, 8, 8), precision=mode)
    op_a = a.T if trans_a not in (False, "N") else a
    op_b = b.T if trans_b not in (False, "N") else b
    assert got.dtype == np.float32
    # alpha scales in float32 after the product: one more rounding of |C|
    assert within_bound(got, op_a, op_b, mode, alpha=-1.5) <= 1 + 2.0**-23 / error_bound(mode, k)
    with_c = distmm.gemm(a, b, c0, alpha=1.0, beta=2.0, trans_a=trans_a, trans_b=trans_b,
                         precision=mode)
    product = distmm.gemm(a, b, trans_a=trans_a, trans_b=trans_b, precision=mode)
    np.testing.assert_array_equal(with_c, product + 2.0 * c0)


# -- dtypes: numpy's result dtype kept ----------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_float16_operands_keep_float16(mode):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((19, 40)).astype(np.float16)
    b = rng.standard_normal((40, 23)).astype(np.float16)
    c = distmm.matmul(a, b, precision=mode)
    assert c.dtype == np.matmul(a, b).dtype == np.float16
    assert within_bound(c, a, b, mode, out_dtype=np.float16) <= 1
    if mode in ("tf32", "fp16"):
        # float16 values are TF32 and float16 values: the same as "highest"'s float32 sums,
        # up to the summation order
        assert within_bound(c, a, b, "fp16", out_dtype=np.float16) <= 1


@pytest.mark.parametrize("mode", ("highest",) + MODES)
def test_bfloat16_operands(mode):
    """numpy with ml_dtypes gives float32 for bfloat16 @ bfloat16 (and for bfloat16 with
    float32): distmm follows it in every mode."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal((21, 33)).astype(BF16)
    b = rng.standard_normal((33, 17)).astype(BF16)
    want = np.matmul(a, b)
    c = distmm.matmul(a, b, precision=mode)
    assert c.dtype == want.dtype
    if mode in ("highest", "tf32", "bf16"):
        # bfloat16 values are exact in TF32 and bfloat16: only float32's summation differs
        np.testing.assert_allclose(c, want, rtol=0, atol=33 * 2.0**-23 * np.abs(want).max())
    assert within_bound(c, a, b, "fp16" if mode == "fp16" else "bf16") <= 1
    mixed = distmm.matmul(a, b.astype(np.float32), precision=mode)
    assert mixed.dtype == np.matmul(a, b.astype(np.float32)).dtype


def test_highest_unchanged():
    """"highest" is the default and gives the same bits as before precision= existed
    (the executors' own products, which tests/test_api.py checks against numpy)."""
    rng = np.random.default_rng(8)
    for dt in (np.float32, np.float64, np.float16, np.int32, np.complex64):
        a = (rng.standard_normal((23, 41)) * 50).astype(dt)
        b = (rng.standard_normal((41, 18)) * 50).astype(dt)
        default = distmm.matmul(a, b, tile=(8, 8, 8))
        highest = distmm.matmul(a, b, tile=(8, 8, 8), precision="highest")
        assert default.dtype == highest.dtype == np.matmul(a, b).dtype
        np.testing.assert_array_equal(default, highest)
        if np.dtype(dt).kind in "iu" or dt == np.float16:
            np.testing.assert_array_equal(default, np.matmul(a, b))
    plan = distmm.make_plan(100, 100, 100, "float32")
    assert plan.precision == "highest"
    assert distmm.make_plan(100, 100, 100, "float32", precision="bf16").precision == "bf16"


# -- refusals -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "int32", "int8", "bool", "complex64", "object",
                                   "longdouble"])
def test_reduced_mode_refused_for_other_dtypes(dtype):
    a = np.ones((3, 4), dtype=dtype)
    b = np.ones((4, 2), dtype=dtype)
    with pytest.raises(TypeError) as info:
        distmm.matmul(a, b, precision="tf32")
    msg = str(info.value)
    assert "\n" not in msg and "tf32" in msg and str(np.matmul(a, b).dtype) in msg
    np.testing.assert_array_equal(distmm.matmul(a, b, precision="highest"), np.matmul(a, b))


def test_refusals_name_what_was_wrong():
    a = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="precision must be one of highest, tf32, bf16, fp16, "
                                         "got 'fp8'"):
        distmm.matmul(a, a.T, precision="fp8")
    # mixed float32 @ float64 is a float64 product
    with pytest.raises(TypeError, match="result dtype is float64"):
        distmm.matmul(a, a.T.astype(np.float64), precision="bf16")
    # gemm: a float64 c promotes the product to float64
    with pytest.raises(TypeError, match="gemm: precision='fp16'.*float64"):
        distmm.gemm(a, a.T, np.zeros((3, 3)), beta=1.0, precision="fp16")
    with pytest.raises(TypeError, match="make_plan"):
        distmm.make_plan(10, 10, 10, "int64", precision="tf32")
    # any case is accepted, as other names of the API are not: the mode is a name
    assert distmm.matmul(a, a.T, precision="TF32").dtype == np.float32


def test_config_key_sets_the_default():
    import dask.config

    rng = np.random.default_rng(9)
    a, b = low_bits(rng, (9, 30)), low_bits(rng, (30, 7))
    highest = distmm.matmul(a, b)
    with dask.config.set({"distmm.precision": "bf16"}):
        configured = distmm.matmul(a, b)  # the call cache must not give highest's entry
        explicit = distmm.matmul(a, b, precision="highest")
    np.testing.assert_array_equal(configured, distmm.matmul(a, b, precision="bf16"))
    np.testing.assert_array_equal(explicit, highest)
    assert not np.array_equal(configured, highest)
    np.testing.assert_array_equal(distmm.matmul(a, b), highest)
    with dask.config.set({"distmm.precision": "half"}):
        with pytest.raises(ValueError, match="distmm.precision = 'half' is not valid"):
            distmm.matmul(a, b)


def test_configured_default_leaves_other_dtypes_exact(tmp_path, monkeypatch):
    """A configured reduced default applies to float32, float16 and bfloat16 products and
    leaves the others at "highest" (it refused every float64, integer and object product,
    on the command line too); an explicit precision= still refuses them."""
    import dask.config

    rng = np.random.default_rng()
    a, b = rng.standard_normal((9, 30)), rng.standard_normal((30, 7))
    with dask.config.set({"distmm.precision": "bf16"}):
        np.testing.assert_array_equal(distmm.matmul(a, b), np.matmul(a, b))
        i = np.arange(12).reshape(3, 4)
        np.testing.assert_array_equal(distmm.matmul(i, i.T), i @ i.T)
        np.testing.assert_allclose(distmm.gemm(a, b), np.matmul(a, b), rtol=1e-13)
        f = a.astype(np.float32), b.astype(np.float32)
        np.testing.assert_array_equal(distmm.matmul(*f), distmm.matmul(*f, precision="bf16"))
        with pytest.raises(TypeError, match="precision='bf16' needs a float32"):
            distmm.matmul(a, b, precision="bf16")
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    monkeypatch.setenv("DISTMM_PRECISION", "tf32")
    from distmm.cli import main

    assert main(["matmul", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"),
                 "-o", str(tmp_path / "c.npy"), "--no-progress"]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), np.matmul(a, b))
    assert main(["matmul", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o",
                 str(tmp_path / "d.npy"), "--no-progress", "--precision", "TF32"]) == 2
    np.save(tmp_path / "a32.npy", a.astype(np.float32))
    np.save(tmp_path / "b32.npy", b.astype(np.float32))
    assert main(["matmul", str(tmp_path / "a32.npy"), str(tmp_path / "b32.npy"), "-o",
                 str(tmp_path / "e.npy"), "--no-progress", "--precision", "BF16"]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), distmm.matmul(
        a.astype(np.float32), b.astype(np.float32), precision="bf16"))


def test_error_bound_values():
    u = 2.0**-24
    assert error_bound("tf32", 1) == pytest.approx(2 * 2.0**-11 + 2.0**-22)
    k = 1000
    want = 2 * 2.0**-8 + 2.0**-16 + (k - 1) * u / (1 - (k - 1) * u) * (1 + 2.0**-8) ** 2
    assert error_bound("bf16", k) == pytest.approx(want, rel=1e-12)
    assert error_bound("fp16", k, out_dtype=np.float16) > error_bound("fp16", k)
    assert error_bound("tf32", k, u_acc=2.0**-23) > error_bound("tf32", k)
    with pytest.raises(ValueError, match="highest"):
        error_bound("highest", 3)


def test_error_bound_takes_what_matmul_takes():
    """The mode in any case, as ``matmul(precision=)`` takes it (a user's "TF32" got a
    ValueError here while matmul accepted it); k an integer of at least 0: a negative k
    was taken as 1 and a fractional one truncated, each a smaller bound than asked for."""
    a = np.ones((3, 40), np.float32)
    assert distmm.matmul(a, a.T, precision="TF32").dtype == np.float32
    assert error_bound("TF32", 40) == error_bound("tf32", 40)
    assert error_bound("Bf16", np.int64(40), out_dtype=np.float16) == \
        error_bound("bf16", 40, out_dtype=np.float16)
    assert error_bound("fp16", 0) == error_bound("fp16", 1)  # k = 0: an exact zero
    with pytest.raises(ValueError, match="k must be at least 0, got -5"):
        error_bound("tf32", -5)
    with pytest.raises(TypeError, match="k must be an integer, got 10.7"):
        error_bound("tf32", 10.7)
    with pytest.raises(ValueError, match="got 'HIGHEST'"):
        error_bound("HIGHEST", 3)


def test_kernel_for_falls_back_to_cublas():
    """The registry hook: None (cuBLAS) for "highest", dtypes other than float32, and a
    device older than every tensor-core kernel; a listed name not in the registry is
    skipped rather than failing."""
    from distmm.executor import registry

    assert registry.kernel_for("float32", "highest", 90) is None
    assert registry.kernel_for("float64", "tf32", 90) is None
    for mode in MODES:
        assert registry.kernel_for("float32", mode, 10) is None
        spec = registry.kernel_for("float32", mode, 90)
        assert spec is None or (spec.name in registry.PRECISION_KERNELS[mode]
                                and spec.min_cc <= 90)


# -- Dask engine (a real LocalCluster) ----------------------------------------------------

@pytest.mark.parametrize("layout", ["tiles", "blocks"])
@pytest.mark.slow
def test_dask_within_bound(client, layout):
    import dask.array as da
    import dask.config

    rng = np.random.default_rng(12)
    a, b = low_bits(rng, (45, 61)), low_bits(rng, (61, 38))
    with dask.config.set({"distmm.dask-layout": layout}):
        for mode in MODES:
            c = distmm.matmul(a, b, engine="dask", client=client, tile=(16, 16, 16),
                              precision=mode)
            assert c.dtype == np.float32
            assert within_bound(c, a, b, mode) <= 1, mode
            assert not np.array_equal(c, a @ b)
        lazy = distmm.matmul(da.from_array(a, chunks=(20, 30)), da.from_array(b, chunks=(30, 19)),
                             client=client, precision="bf16")
        assert within_bound(lazy.compute(), a, b, "bf16") <= 1
        g = distmm.gemm(a.T, b, trans_a=True, engine="dask", client=client, tile=16,
                        precision="tf32")
        assert within_bound(g, a, b, "tf32") <= 1


# -- MPI engine (real mpiexec, 2 ranks) ---------------------------------------------------

@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_within_bound(mpirun, tmp_path):
    r = mpirun(2, HERE / "mpi_precision_cases.py", tmp_path, timeout=240)
    assert "VERDICT ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_mpirun_cli_precision(mpirun, tmp_path):
    """``mpirun -n 2 distmm matmul --precision tf32``: the batch path's executors round."""
    rng = np.random.default_rng(13)
    a, b = low_bits(rng, (53, 71)), low_bits(rng, (71, 45))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    for mode in MODES:
        out = tmp_path / f"c_{mode}.npy"
        r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy",
                   "-o", out, "--precision", mode, timeout=120)
        assert r.returncode == 0, r.stderr
        c = np.load(out)
        assert within_bound(c, a, b, mode) <= 1, mode
        assert not np.array_equal(c, a @ b)
    bad = tmp_path / "bad.npy"
    np.save(tmp_path / "a64.npy", a.astype(np.float64))
    r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a64.npy", tmp_path / "b.npy", "-o", bad,
               "--precision", "bf16", timeout=60)
    assert r.returncode == 2, r.stderr
    assert "precision='bf16' needs a float32" in r.stderr and "Traceback" not in r.stderr
    assert not bad.exists()


def test_resume_refuses_another_precision():
    """A stopped ``mpirun distmm matmul --resume`` run is finished only in its own mode:
    the manifest keeps the precision (one written before it existed was "highest")."""
    from distmm.engine.mpi import resume as rs

    facts = dict(a={"spec": "a.npy"}, b={"spec": "b.npy"}, output="c.npy", dtype="float32",
                 backend="blas", ranks=2, grid=(1, 2, 1), stripe_edges=[[0, 5]], panels=[1],
                 pid=0, header=None)
    tf32 = rs.Manifest.make(**facts, precision="tf32")
    assert rs.mismatch(tf32, rs.Manifest.make(**facts, precision="tf32")) is None
    assert "precision changed (tf32 then, bf16 now)" in rs.mismatch(
        tf32, rs.Manifest.make(**facts, precision="bf16"))
    older = dict(rs.Manifest.make(**facts))
    older.pop("precision")
    assert rs.mismatch(older, rs.Manifest.make(**facts)) is None
    assert "precision changed" in rs.mismatch(older, tf32)


# -- the command line ---------------------------------------------------------------------


def test_cli_precision(tmp_path):
    rng = np.random.default_rng(14)
    a, b = low_bits(rng, (40, 27)), low_bits(rng, (27, 33))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    c = np.load(tmp_path / "c.npy")
    np.testing.assert_array_equal(c, distmm.matmul(a, b, precision="bf16"))
    assert within_bound(c, a, b, "bf16") <= 1 and not np.array_equal(c, a @ b)
    # stacks and vectors take the same path
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "d.npy",
                "--precision", "tf32", "--engine", "local")
    assert r.returncode == 0, r.stderr
    assert within_bound(np.load(tmp_path / "d.npy"), a, b, "tf32") <= 1


def test_cli_refuses_bad_precision(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((3, 4)))
    np.save(tmp_path / "b.npy", np.ones((4, 2)))
    out = tmp_path / "c.npy"
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", out, "--precision", "tf32")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "precision='tf32' needs a float32, float16 or bfloat16 product" in r.stderr
    assert "float64" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]  # nothing staged
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", out, "--precision", "fp8")
    assert r.returncode == 2 and "--precision" in r.stderr and "fp8" in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_operands_give_no_warning(mode):
    """numpy's matmul of float16 operands holding NaN, and an infinity that meets no
    other (no inf - inf in any sum), warns of nothing; nor does the emulation (its
    rounding, and its float32 product)."""
    rng = np.random.default_rng()
    a = rng.standard_normal((9, 31)).astype(np.float16)
    b = rng.standard_normal((31, 7)).astype(np.float16)
    a[rng.integers(9), rng.integers(31)] = np.nan
    a[rng.integers(9), rng.integers(31)] = rng.choice([np.inf, -np.inf])
    b[rng.integers(31), rng.integers(7)] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = np.matmul(a, b)
        got = distmm.matmul(a, b, precision=mode, backend="blas")
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))


def test_float32_beyond_float16_range_gives_no_warning_under_fp16():
    """A finite float32 operand that rounds past float16's range becomes infinity in the
    emulation, without a warning (numpy's float32 product of it has none)."""
    rng = np.random.default_rng()
    a = rng.standard_normal((9, 31)).astype(np.float32)
    b = rng.standard_normal((31, 7)).astype(np.float32)
    a[rng.integers(9), rng.integers(31)] = 7e4
    b[rng.integers(31), rng.integers(7)] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = np.matmul(a, b)
        got = distmm.matmul(a, b, precision="fp16", backend="blas")
    assert (got.dtype, got.shape) == (want.dtype, want.shape)


@pytest.mark.parametrize("backend", ["blas", "numba"])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16"])
def test_reduced_products_report_numpys_flags(mode, backend):
    """inf * 0 and a float32 sum past float32's range report numpy's "invalid" and
    "overflow" under a reduced precision too, as under "highest" (they reported nothing);
    a NaN operand reports nothing (a value the rounding takes past the format's range:
    test_float32_beyond_float16_range_gives_no_warning_under_fp16)."""
    inf0 = (np.array([[np.inf, 1]], np.float32), np.array([[0], [1]], np.float32))
    over = (np.array([[3e38, 3e38]], np.float32), np.ones((2, 1), np.float32))
    # (under fp16, 3e38 rounds to inf itself, and float16's products cannot overflow a sum)
    cases = [(inf0, "invalid value")] + ([(over, "overflow")] if mode != "fp16" else [])
    for (a, b), flag in cases:
        with np.errstate(all="raise"), pytest.raises(FloatingPointError, match=flag):
            np.matmul(a, b)
        with np.errstate(all="raise"), pytest.raises(FloatingPointError, match=flag):
            distmm.matmul(a, b, precision=mode, backend=backend)
        with np.errstate(all="ignore"):
            got = distmm.matmul(a, b, precision=mode, backend=backend)
        assert np.isnan(got[0, 0]) if flag == "invalid value" else np.isposinf(got[0, 0])
    quiet = (np.array([[np.nan, 1], [1, 2]], np.float32), np.array([[0, 1], [1, 1]], np.float32))
    with np.errstate(all="raise"):
        got = distmm.matmul(*quiet, precision=mode, backend=backend)
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()
