"""Every registered CUDA kernel against a float64 reference, and the GPU executor.

Fresh random inputs for every case, outputs poisoned before each launch (NaN for floats, a
fixed pattern for integers) so an unwritten element fails; sizes 1, 7, 33, 127, 1000 and
4097, rectangular and transposed cases, misaligned operands (element loads instead of
16-byte vectors), alpha/beta. Integers are compared exactly, including wrap-around. The tensor-core steps
(11-15, reduced precision) are checked against their error bounds (their own section).
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

import distmm.executor.registry as registry  # noqa: E402
from distmm.executor import cuda_loader  # noqa: E402

KERNELS = registry.steps()
DTYPES = registry.DTYPES
POISON = {"float32": np.nan, "float64": np.nan, "int32": -0x5A5A5A5A, "int64": -0x5A5A5A5A5A5A5A5A}
TOL = {"float32": 2e-6, "float64": 1e-14}

# (m, n, k, trans_a, trans_b)
CASES = [(s, s, s, False, False) for s in (1, 7, 33, 127, 1000, 4097)] + [
    (33, 127, 1000, False, False), (1000, 7, 127, False, False), (127, 1000, 33, False, False),
    (4097, 33, 1000, False, False),
    (127, 33, 1000, True, False), (127, 33, 1000, False, True), (127, 33, 1000, True, True),
    (1000, 127, 33, True, True), (7, 1000, 129, True, False), (1000, 7, 129, False, True),
]


def _case_id(c):
    m, n, k, ta, tb = c
    return f"{m}x{n}x{k}" + ("-TA" if ta else "") + ("-TB" if tb else "")


def _random(shape, dtype, rng, big=False):
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.standard_normal(shape, dtype=np.float64).astype(dt)
    if big:  # the full range (drawn on the host): exercises wrap-around
        info = np.iinfo(dt)
        host = np.random.default_rng().integers(info.min, info.max, size=shape, dtype=dt,
                                                endpoint=True)
        return cupy.asarray(host)
    # small values: every sum is exact in the float64 reference
    return cupy.random.randint(-3, 4, size=shape).astype(dt)


def _operand(rows, cols, dtype, rng, trans, misalign=False, big=False):
    """A matrix op(X) of shape (rows, cols), stored transposed when ``trans``; returns
    (stored array, its leading dimension, op(X) as a view)."""
    shape = (cols, rows) if trans else (rows, cols)
    if misalign:  # a view that starts one element in and rows of an odd length
        full = _random((shape[0], shape[1] + 1), dtype, rng, big)
        stored = full[:, 1:]
        ld = shape[1] + 1
    else:
        stored = _random(shape, dtype, rng, big)
        ld = max(shape[1], 1)
    return stored, ld, (stored.T if trans else stored)


def _run(spec, dtype, m, n, k, ta, tb, *, alpha=1, beta=0, misalign=False, params=None,
         compiler=None):
    rng = cupy.random.default_rng()
    a, lda, op_a = _operand(m, k, dtype, rng, ta, misalign)
    b, ldb, op_b = _operand(k, n, dtype, rng, tb, misalign)
    if beta != 0:
        c = _random((m, n), dtype, rng)
        c0 = c.copy()
    else:
        c = cupy.full((m, n), POISON[dtype], dtype=dtype)
        c0 = cupy.zeros((m, n), dtype=dtype)
    a_before, b_before = a.copy(), b.copy()
    cuda_loader.launch(spec.name, a, ta, lda, b, tb, ldb, c, max(n, 1), m, n, k,
                       alpha=alpha, beta=beta, params=params, compiler=compiler, check=True)
    ref = alpha * cupy.matmul(op_a.astype(np.float64), op_b.astype(np.float64)) \
        + beta * c0.astype(np.float64)
    assert bool((a == a_before).all()) and bool((b == b_before).all()), "inputs modified"
    if np.dtype(dtype).kind == "f":
        assert bool(cupy.isfinite(c).all()), "unwritten (NaN) elements in C"
        den = float(cupy.linalg.norm(ref))
        err = float(cupy.linalg.norm(c.astype(np.float64) - ref)) / (den or 1.0)
        assert err <= TOL[dtype] * max(1.0, np.sqrt(k) / 8), f"relerr {err:.3e}"
    else:
        want = cupy.rint(ref).astype(np.int64)
        got = c.astype(np.int64)
        bad = int((got != want).sum())
        assert bad == 0, f"{bad} of {m * n} elements differ"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", KERNELS, ids=lambda k: k.name)
def test_kernel_matches_float64_reference(spec, dtype, case):
    _run(spec, dtype, *case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", KERNELS, ids=lambda k: k.name)
def test_kernel_alpha_beta_misaligned(spec, dtype):
    alpha, beta = (2, -3) if np.dtype(dtype).kind == "i" else (-1.5, 0.25)
    _run(spec, dtype, 127, 65, 131, True, False, alpha=alpha, beta=beta, misalign=True)
    _run(spec, dtype, 66, 129, 35, False, True, alpha=alpha, beta=0, misalign=True)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("spec", KERNELS, ids=lambda k: k.name)
def test_integer_wraparound_matches_numpy(spec, dtype):
    rng = cupy.random.default_rng()
    a, lda, _ = _operand(33, 65, dtype, rng, False, big=True)
    b, ldb, _ = _operand(65, 17, dtype, rng, True, big=True)
    c = cupy.full((33, 17), POISON[dtype], dtype=dtype)
    cuda_loader.launch(spec.name, a, False, lda, b, True, ldb, c, 17, 33, 17, 65, check=True)
    with np.errstate(over="ignore"):
        want = np.matmul(cupy.asnumpy(a), cupy.asnumpy(b).T)
    assert want.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(cupy.asnumpy(c), want)


@pytest.mark.parametrize("spec", KERNELS, ids=lambda k: k.name)
def test_k_zero_gives_beta_c(spec):
    c = cupy.arange(12, dtype=np.float32).reshape(3, 4)
    a = cupy.empty((3, 0), np.float32)
    b = cupy.empty((0, 4), np.float32)
    cuda_loader.launch(spec.name, a, False, 1, b, False, 4, c, 4, 3, 4, 0, alpha=1.0, beta=2.0,
                       check=True)
    np.testing.assert_array_equal(cupy.asnumpy(c), 2 * np.arange(12, dtype=np.float32).reshape(3, 4))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tuning_space_samples(dtype):
    """A few non-default configurations of the tunable kernel, on ragged transposed sizes."""
    spec = registry.best_kernel()
    cands = spec.candidates(dtype)
    for p in cands[1:len(cands):max(1, len(cands) // 4)]:
        _run(spec, dtype, 257, 130, 77, False, False, params=p)
        _run(spec, dtype, 130, 257, 77, True, True, params=p)


def test_simt_fp64_tuning_space_samples():
    """Step 10's own (small) tuning space, float64, on ragged sizes in two layouts."""
    spec = registry.get("simt_fp64")
    cands = spec.candidates("float64")
    for p in cands[1:len(cands):max(1, len(cands) // 4)]:
        _run(spec, "float64", 257, 130, 77, False, False, params=p)
        _run(spec, "float64", 130, 257, 77, True, True, params=p)


def test_nvcc_cubin_path():
    """The nvcc fallback: compiled to a cubin in the cache folder and loaded by path."""
    spec = registry.best_kernel()
    _run(spec, "float32", 300, 200, 100, False, True, compiler="nvcc")
    assert any(cuda_loader.cache_dir().joinpath("cubin").glob(f"{spec.name}-*.cubin"))
    _run(spec, "float64", 300, 200, 100, True, False, compiler="nvcc")


def test_name_expressions_path_agrees(monkeypatch):
    """NVRTC's own lowering (RawModule(name_expressions=...)) finds the same kernels."""
    spec = registry.best_kernel()
    expr = spec.name_expression("float32", spec.params("float32"), False, True)
    kern = cuda_loader._kernel_by_name_expression(spec, expr)
    assert kern.kernel is not None
    cuda_loader._kernel.cache_clear()
    monkeypatch.setenv("DISTMM_NAME_EXPRESSIONS", "1")
    _run(spec, "float32", 130, 70, 90, False, True)
    _run(registry.get("smem"), "int64", 33, 40, 50, True, False)
    cuda_loader._kernel.cache_clear()


# -- tensor-core steps 11-15 (reduced precision: registry.TC_KERNELS) ---------------------
#
# Each kernel in each of its precisions against two float64 references: the product of the
# inputs as given, within the mode's bound (2 u_in + u_in^2 + k u_acc) |A||B| elementwise,
# and the product of the inputs rounded as the mode rounds them (TF32: to nearest, ties away
# from zero, cvt.rna; BF16 and FP16: to nearest even), within k u_acc |A'||B'|, which only
# holds if the kernel rounded exactly so. u_acc = 2^-23, not 2^-24: tensor cores may truncate
# inside one mma (Fasi et al., PeerJ CS 2021).

TC_MODES = [(spec, prec) for spec in registry.tc_steps() for prec in spec.precisions]
U_IN = {"tf32": 2.0**-11, "bf16": 2.0**-8, "fp16": 2.0**-11}
U_ACC = 2.0**-23
TC_CASES = [(s, s, s, False, False) for s in (1, 7, 33, 127, 1000)] + [
    (127, 33, 1000, True, False), (127, 33, 1000, False, True), (127, 33, 1000, True, True),
    (1000, 127, 33, True, True), (7, 1000, 129, True, False), (1000, 7, 129, False, True),
    (4097, 257, 300, False, False), (520, 1024, 256, False, False),
]


def _tc_id(mode):
    spec, prec = mode
    return f"{spec.name}-{prec}"


def _skip_unless_runs(spec):
    cc = cuda_loader.compute_capability()
    if not spec.runs_on(cc):
        pytest.skip(f"{spec.name} runs on compute capability {spec.min_cc}..{spec.max_cc}, "
                    f"not {cc}")


def _rounded(x, precision):
    """float64 values of float32 ``x`` rounded to the mode's input format (computed here,
    independently of the kernels and of cuda_loader.to_input_format)."""
    if precision == "fp16":
        return x.astype(cupy.float16).astype(cupy.float64)
    bits = 11 if precision == "tf32" else 8  # significant bits, the implicit one included
    mant, expo = cupy.frexp(x.astype(cupy.float64))
    scaled = cupy.ldexp(mant, bits)
    if precision == "tf32":  # ties away from zero
        scaled = cupy.sign(scaled) * cupy.floor(cupy.abs(scaled) + 0.5)
    else:  # ties to even
        scaled = cupy.rint(scaled)
    return cupy.ldexp(scaled, expo - bits)


def _tc_run(spec, precision, m, n, k, ta, tb, *, alpha=1.0, beta=0.0, misalign=False,
            params=None, preconverted=False):
    rng = cupy.random.default_rng()
    a, lda, op_a = _operand(m, k, "float32", rng, ta, misalign)
    b, ldb, op_b = _operand(k, n, "float32", rng, tb, misalign)
    if beta != 0:
        c = rng.standard_normal((m, n), dtype=np.float32)
        c0 = c.copy()
    else:
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        c0 = cupy.zeros((m, n), dtype=np.float32)
    a_in, b_in = a, b
    if preconverted and precision != "tf32":  # operands already in the input format
        fmt = spec.precisions[precision]
        a_in, b_in = cuda_loader.to_input_format(a, fmt), cuda_loader.to_input_format(b, fmt)
        lda, ldb = a_in.shape[1], b_in.shape[1]
    a_before, b_before = a.copy(), b.copy()
    ran = cuda_loader.launch_tc(spec.name, a_in, ta, lda, b_in, tb, ldb, c, max(n, 1), m, n, k,
                                precision=precision, alpha=alpha, beta=beta, params=params,
                                check=True)
    assert ran == spec.name, f"{spec.name} handed the product to {ran}"
    assert bool((a == a_before).all()) and bool((b == b_before).all()), "inputs modified"
    assert bool(cupy.isfinite(c).all()), "unwritten (NaN) elements in C"
    got = c.astype(np.float64)
    a64, b64 = op_a.astype(np.float64), op_b.astype(np.float64)
    ar, br = _rounded(op_a, precision), _rounded(op_b, precision)
    epilogue = U_ACC * (abs(alpha) * cupy.abs(ar) @ cupy.abs(br) + abs(beta) * cupy.abs(c0)) + 1e-30
    u = U_IN[precision]
    # against the inputs as given: the mode's bound
    err = cupy.abs(got - (alpha * (a64 @ b64) + beta * c0))
    bound = abs(alpha) * (2 * u + u * u + k * U_ACC) * (cupy.abs(a64) @ cupy.abs(b64)) + epilogue
    worst = float((err / bound).max()) if err.size else 0.0
    assert worst <= 1.0, f"{spec.name} {precision}: error {worst:.3g} x the bound"
    # against the inputs rounded as the mode rounds them: only the accumulation's error
    err_r = cupy.abs(got - (alpha * (ar @ br) + beta * c0))
    bound_r = abs(alpha) * k * U_ACC * (cupy.abs(ar) @ cupy.abs(br)) + epilogue
    worst_r = float((err_r / bound_r).max()) if err_r.size else 0.0
    assert worst_r <= 1.0, \
        f"{spec.name} {precision}: not rounded as {precision} rounds ({worst_r:.3g})"


@pytest.mark.parametrize("case", TC_CASES, ids=_case_id)
@pytest.mark.parametrize("mode", TC_MODES, ids=_tc_id)
def test_tensor_core_kernel_within_its_bound(mode, case):
    spec, precision = mode
    _skip_unless_runs(spec)
    _tc_run(spec, precision, *case)


@pytest.mark.parametrize("mode", TC_MODES, ids=_tc_id)
def test_tensor_core_alpha_beta_misaligned_preconverted(mode):
    spec, precision = mode
    _skip_unless_runs(spec)
    _tc_run(spec, precision, 127, 65, 131, True, False, alpha=-1.5, beta=0.25, misalign=True)
    _tc_run(spec, precision, 66, 129, 35, False, True, alpha=2.0, beta=0.0, misalign=True)
    _tc_run(spec, precision, 200, 136, 72, True, True, alpha=0.5, beta=-1.0, preconverted=True)


@pytest.mark.parametrize("mode", TC_MODES, ids=_tc_id)
def test_tensor_core_k_zero_gives_beta_c(mode):
    spec, precision = mode
    _skip_unless_runs(spec)
    c = cupy.arange(12, dtype=np.float32).reshape(3, 4)
    a, b = cupy.empty((3, 0), np.float32), cupy.empty((0, 4), np.float32)
    ran = cuda_loader.launch_tc(spec.name, a, False, 1, b, False, 4, c, 4, 3, 4, 0,
                                precision=precision, alpha=1.0, beta=2.0, check=True)
    want = 2 * np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(cupy.asnumpy(c), want)
    # k = 0 has no tensor map: step 14 hands it to step 13 (TF32: 11), step 15 to step 12
    assert ran == (cuda_loader.TMA_K_ZERO[spec.name][precision] if spec.tma else spec.name)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tma_step_copies_operands_no_tensor_map_describes(precision):
    """Step 14's tensor maps need 16-byte aligned bases and rows: operands in the input
    format whose rows are of an odd length, or whose base is 2 bytes off, are copied (the
    user's arrays untouched) and step 14 still runs; the product is the rounded inputs'
    within the accumulation's bound."""
    spec = registry.get_tc("wgmma_tma")
    _skip_unless_runs(spec)
    fmt = spec.precisions[precision]
    rng = cupy.random.default_rng()
    m, n = 300, 77
    for k in (129, 128):  # rows of 258 bytes; rows of 256 bytes, only the base off
        a32 = rng.standard_normal((m, k), dtype=np.float32)
        b32 = rng.standard_normal((k, n), dtype=np.float32)
        a_in, b_in = cuda_loader.to_input_format(a32, fmt), cuda_loader.to_input_format(b32, fmt)
        flat = cupy.empty(m * k + 1, dtype=a_in.dtype)
        a_off = flat[1:].reshape(m, k)  # starts one element (2 bytes) into an allocation
        a_off[...] = a_in
        before = a_off.copy()
        ref = _rounded(a32, precision) @ _rounded(b32, precision)
        bound = k * U_ACC * (_rounded(cupy.abs(a32), precision)
                             @ _rounded(cupy.abs(b32), precision)) + 1e-30
        for a in (a_in, a_off):
            c = cupy.full((m, n), np.nan, dtype=np.float32)
            ran = cuda_loader.launch_tc(spec.name, a, False, k, b_in, False, n, c, n, m, n, k,
                                        precision=precision, check=True)
            assert ran == "wgmma_tma"
            assert float((cupy.abs(c - ref) / bound).max()) <= 1.0
        assert bool((a_off == before).all())


@pytest.mark.parametrize("mode", TC_MODES, ids=_tc_id)
def test_tensor_core_tuning_space_samples(mode):
    spec, precision = mode
    _skip_unless_runs(spec)
    fmt = spec.precisions[precision]
    cands = spec.candidates(fmt, cuda_loader.compute_capability())
    for p in cands[1:len(cands):max(1, len(cands) // 4)]:
        _tc_run(spec, precision, 257, 130, 200, False, False, params=p)
        _tc_run(spec, precision, 130, 257, 77, True, True, params=p)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: "x".join(map(str, c[:3])) + (
    "-" + "t" * c[3] + "n" * (not c[3]) + "t" * c[4] + "n" * (not c[4])))
def test_wgmma_with_a_group_left_in_flight(precision, case):
    """Step 13 with INFLIGHT=1 (a stage handed back one k tile later): the odd sizes and
    transposes of the defaults' cases, k from one tile to many more than the stages."""
    spec = registry.get_tc("wgmma_bf16")
    _skip_unless_runs(spec)
    p = dict(spec.params(spec.precisions[precision]), INFLIGHT=1)
    _tc_run(spec, precision, *case, params=p)
    _tc_run(spec, precision, *case, params=dict(p, STAGES=3, BK=32))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: "x".join(map(str, c[:3])) + (
    "-" + "t" * c[3] + "n" * (not c[3]) + "t" * c[4] + "n" * (not c[4])))
def test_mma_tma_with_the_other_hand_back(precision, case):
    """Step 15 with each stage hand-back its defaults do not use (SYNC: the block barrier,
    the empty mbarriers, a producer warpgroup), on the defaults' cases, and with two stages
    (every stage refilled as soon as it is read)."""
    spec = registry.get_tc("mma_tma")
    _skip_unless_runs(spec)
    fmt = spec.precisions[precision]
    for sync in {0, 1, 2} - {spec.params(fmt)["SYNC"]}:
        p = _hand_back(spec, fmt, sync)
        _tc_run(spec, precision, *case, params=p)
        _tc_run(spec, precision, *case, params=dict(p, STAGES=2))


def _hand_back(spec, fmt: str, sync: int) -> dict:
    """Step 15's defaults for ``fmt`` with stages handed back by ``sync``; a producer
    warpgroup beside four computing warps needs two blocks an SM (``MINB``) for its
    registers."""
    p = dict(spec.params(fmt), SYNC=sync)
    if sync == 2 and spec.threads(p) == 256:
        p["MINB"] = 2
    assert spec.violations(fmt, p) == [], p
    return p


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_mma_tma_equals_step_12_bit_for_bit(precision):
    """Step 15 issues step 12's mma in step 12's order (TF32: step 11's), so on the same
    operands the two agree bit for bit, whatever layout the operands come in (TF32: step 15
    gets k-major copies). Large enough (thousands of blocks, two an SM, many k tiles) for a
    stage refilled before every warp has read it to show: a single fragment from the wrong k
    tile changes some element."""
    spec = registry.get_tc("mma_tma")
    ref = registry.get_tc("mma_tf32" if precision == "tf32" else "mma_bf16")
    _skip_unless_runs(spec)
    fmt = spec.precisions[precision]
    rng = cupy.random.default_rng()
    m, n, k = 4096, 2048, 8192
    for ta, tb in ((False, False), (True, True), (False, True), (True, False)):
        a = cuda_loader.to_input_format(
            rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32), fmt)
        b = cuda_loader.to_input_format(
            rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32), fmt)
        lda, ldb = a.shape[1], b.shape[1]
        want = cupy.full((m, n), np.nan, dtype=np.float32)
        cuda_loader.launch_tc(ref.name, a, ta, lda, b, tb, ldb, want, n, m, n, k,
                              precision=precision, check=True)
        for sync in (0, 1, 2):
            got = cupy.full((m, n), np.nan, dtype=np.float32)
            cuda_loader.launch_tc(spec.name, a, ta, lda, b, tb, ldb, got, n, m, n, k,
                                  precision=precision, check=True,
                                  params=_hand_back(spec, fmt, sync))
            diff = int((got != want).sum())
            assert diff == 0, f"{ta=} {tb=} SYNC={sync}: {diff} elements differ from {ref.name}"


@pytest.mark.parametrize("mode", TC_MODES, ids=_tc_id)
def test_launch_dispatches_tensor_core_steps(mode):
    """``cuda_loader.launch`` on operands already in the input format gives what
    ``launch_tc`` gives, bit for bit (the executor's call)."""
    spec, precision = mode
    _skip_unless_runs(spec)
    fmt = spec.precisions[precision]
    rng = cupy.random.default_rng()
    a = cuda_loader.to_input_format(rng.standard_normal((130, 70), dtype=np.float32), fmt)
    b = cuda_loader.to_input_format(rng.standard_normal((70, 90), dtype=np.float32), fmt)
    c1 = cupy.full((130, 90), np.nan, dtype=np.float32)
    c2 = cupy.full((130, 90), np.nan, dtype=np.float32)
    cuda_loader.launch(spec.name, a, False, 70, b, False, 90, c1, 90, 130, 90, 70, check=True)
    cuda_loader.launch_tc(spec.name, a, False, 70, b, False, 90, c2, 90, 130, 90, 70,
                          precision=precision, check=True)
    assert bool(cupy.isfinite(c1).all())
    assert bool((c1 == c2).all())


def test_kernel_for_this_device_runs():
    """What ``kernel_for`` hands the precision API on this device computes each mode."""
    cc = cuda_loader.compute_capability()
    for precision in ("tf32", "bf16", "fp16"):
        spec = registry.kernel_for("float32", precision, cc)
        if spec is None:
            assert cc < 80
            continue
        _tc_run(spec, precision, 333, 222, 111, False, True, alpha=1.0, beta=0.5)


# -- the executor --------------------------------------------------------------------------

from distmm.executor.gpu import GPUExecutor  # noqa: E402
from distmm.plan import make_plan  # noqa: E402


@pytest.mark.parametrize("backend", ["raw", "cublas", "auto"])
def test_device_gemm_on_a_stream(backend):
    ex = GPUExecutor(backend=backend)
    rng = cupy.random.default_rng()
    a = rng.standard_normal((300, 200), dtype=np.float64)
    b = rng.standard_normal((100, 200), dtype=np.float64).T  # a transposed view
    c = rng.standard_normal((300, 100), dtype=np.float64)
    c0 = c.copy()
    cupy.cuda.Device().synchronize()  # the inputs were made on the null stream
    s = cupy.cuda.Stream(non_blocking=True)
    ex.device_gemm(a, b, c, alpha=0.5, beta=-2.0, stream=s)
    s.synchronize()
    want = 0.5 * (cupy.asnumpy(a) @ cupy.asnumpy(b)) - 2.0 * cupy.asnumpy(c0)
    np.testing.assert_allclose(cupy.asnumpy(c), want, rtol=1e-12, atol=1e-11)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "int8", "uint16",
                                   "bool", "float16", "complex64"])
def test_run_batched_numpy_semantics(dtype):
    ex = GPUExecutor(backend="raw")
    rng = np.random.default_rng()
    dt = np.dtype(dtype)
    if dt.kind == "b":
        a, b = rng.random((2, 1, 33, 70)) < 0.05, rng.random((3, 70, 9)) < 0.05
    elif dt.kind in "iu":
        a = rng.integers(0, 100, (2, 1, 33, 70)).astype(dt)
        b = rng.integers(0, 100, (3, 70, 9)).astype(dt)
    else:
        a = rng.standard_normal((2, 1, 33, 70)).astype(dt)
        b = rng.standard_normal((3, 70, 9)).astype(dt)
        if dt.kind == "c":
            a = a + 1j * rng.standard_normal(a.shape).astype(dt)
    with np.errstate(over="ignore"):
        want = np.matmul(a, b)
    plan = make_plan(33, 9, 70, want.dtype)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    ga = cupy.broadcast_to(cupy.asarray(a), batch + a.shape[-2:])
    gb = cupy.broadcast_to(cupy.asarray(b), batch + b.shape[-2:])
    got = ex.run_batched(plan, ga, gb)
    assert isinstance(got, cupy.ndarray) and got.dtype == want.dtype and got.shape == want.shape
    if dt.kind in "biu":
        np.testing.assert_array_equal(cupy.asnumpy(got), want)
    else:
        tol = {"float16": 1e-2, "float32": 1e-5, "complex64": 1e-5}.get(dtype, 1e-12)
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=tol, atol=tol * 10)


def test_run_plan_host_operands():
    ex = GPUExecutor(backend="raw")
    rng = np.random.default_rng()
    a = rng.standard_normal((513, 300)).astype(np.float32)
    b = rng.standard_normal((300, 257)).astype(np.float32)
    out = np.full((513, 257), np.nan, np.float32)
    ex.run_plan(make_plan(513, 257, 300, np.float32), a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)


def test_panel_product_and_copies():
    ex = GPUExecutor(backend="auto")
    rng = np.random.default_rng()
    a = rng.integers(-50, 50, (64, 40)).astype(np.int64)
    b = rng.integers(-50, 50, (40, 80)).astype(np.int64)
    got = ex.to_host(ex.panel_product(ex.asarray(a, np.int64), ex.asarray(b, np.int64)))
    np.testing.assert_array_equal(got, a @ b)
    assert ex.choose(np.int64, 64, 80, 40) == "raw"


def test_cupy_tf32_is_off_for_the_reference():
    import os

    assert os.environ.get("CUPY_TF32", "0") == "0"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_simt_split_tail(dtype):
    """Step 10's split tail (the last, partly filled wave of tiles split along k, then a
    fix-up): ragged sizes whose last wave holds 3 tiles, alpha/beta, NaN-poisoned output;
    the same bits on every run, and close to the unsplit kernel and the reference."""
    spec = registry.get("simt_fp64")
    p = spec.params(dtype)
    bm, bn = spec.tile(p)
    kern = cuda_loader.get_kernel(spec.name, dtype, p, False, False)
    slots = cuda_loader._slots(kern, spec.threads(p), spec.smem_bytes(dtype, p, False, False))
    gn = 3
    gm = -(-(slots * 2 + 3) // gn)
    m, n, k = gm * bm - 5, gn * bn - 7, 64 * p["BK"] + 7
    tiles = -(-m // bm) * -(-n // bn)
    r, s = cuda_loader.split_tail_plan(tiles, slots, -(-k // p["BK"]))
    assert r == tiles % slots and s >= 2, (tiles, slots, r, s)
    rng = cupy.random.default_rng()
    a = rng.standard_normal((m, k), dtype=np.float64).astype(dtype)
    b = rng.standard_normal((k, n), dtype=np.float64).astype(dtype)
    ref = cupy.matmul(a.astype(np.float64), b.astype(np.float64))
    outs = []
    for split, alpha, beta in ((True, 1.0, 0.0), (True, 1.0, 0.0), (False, 1.0, 0.0), (True, -0.5, 2.0)):
        c0 = rng.standard_normal((m, n), dtype=np.float64).astype(dtype)
        c = c0.copy() if beta else cupy.full((m, n), np.nan, dtype=dtype)
        cuda_loader.launch(spec.name, a, False, k, b, False, n, c, n, m, n, k, alpha=alpha,
                           beta=beta, params=p, check=True, split_tail=split)
        want = alpha * ref + beta * c0.astype(np.float64)
        assert bool(cupy.isfinite(c).all()), "unwritten (NaN) elements in C"
        err = float(cupy.linalg.norm(c.astype(np.float64) - want)) / float(cupy.linalg.norm(want))
        assert err <= TOL[dtype] * max(1.0, np.sqrt(k) / 8), f"split={split}: relerr {err:.3e}"
        outs.append(c)
    assert bool((outs[0] == outs[1]).all()), "the split tail is not reproducible"
    # the tail tiles' k order differs from the unsplit kernel's: equal to rounding only
    tol = 1e-3 if dtype == "float32" else 1e-10
    assert float(cupy.abs(outs[0] - outs[2]).max()) <= tol
