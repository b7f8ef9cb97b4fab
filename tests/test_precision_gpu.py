"""``precision=`` on a GPU: cuBLAS's path for each mode, distmm's tensor-core kernels where
the registry has one for the mode, the stream pipeline (host operands), cupy operands and
``gemm`` on the device, each within ``distmm.precision.error_bound`` of a float64
reference (with u_acc = 2^-23: tensor cores may truncate inside an MMA), and each the
rounded operands' product (the rounding happened, on the device as on the CPU)."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

import distmm  # noqa: E402
from distmm.executor import registry  # noqa: E402
from distmm.executor.reduced import round_to  # noqa: E402
from distmm.precision import error_bound  # noqa: E402

MODES = ("tf32", "bf16", "fp16")
U_TC = 2.0**-23  # a truncating accumulation's unit roundoff
SHAPES = [(22, 23, 24), (129, 65, 257), (1, 300, 77), (513, 255, 1031)]


def low_bits(rng, shape):
    frac = rng.integers(1, 2**20, size=shape) * 2.0**-20
    sign = rng.choice([-1.0, 1.0], size=shape)
    return (sign * (1 + frac) * 2.0 ** rng.integers(-3, 4, size=shape)).astype(np.float32)


def check(c, a, b, mode):
    """``c`` within the mode's bound of the float64 product, and within float32-summation
    distance of the rounded operands' product (so it was rounded, as the CPU rounds)."""
    c = cupy.asnumpy(c) if isinstance(c, cupy.ndarray) else np.asarray(c)
    assert c.dtype == np.float32
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    k = a.shape[1]
    err = np.abs(c.astype(np.float64) - a64 @ b64)
    assert np.all(err <= error_bound(mode, k, u_acc=U_TC) * (np.abs(a64) @ np.abs(b64)))
    ar, br = round_to(a, mode).astype(np.float64), round_to(b, mode).astype(np.float64)
    n = max(k - 1, 0)
    gamma = n * U_TC / (1 - n * U_TC)
    assert np.all(np.abs(c.astype(np.float64) - ar @ br) <= gamma * (np.abs(ar) @ np.abs(br)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_cublas_path(mode, m, n, k):
    from distmm.executor.cublas import cublas_gemm_precision

    rng = np.random.default_rng(m + n + k)
    a, b = low_bits(rng, (m, k)), low_bits(rng, (k, n))
    c = cupy.full((m, n), np.nan, dtype=cupy.float32)
    cublas_gemm_precision(cupy.asarray(a), cupy.asarray(b), c, mode)
    check(c, a, b, mode)
    # beta = 1 accumulates; a transposed view goes through a copy
    c2 = cupy.asarray(a @ b)
    cublas_gemm_precision(cupy.asarray(np.ascontiguousarray(a.T)).T, cupy.asarray(b), c2, mode,
                          alpha=1, beta=1)
    assert np.allclose(cupy.asnumpy(c2), cupy.asnumpy(c) + a @ b, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_cublas_reads_bfloat16_bits_in_place(m, n, k):
    """bfloat16 bits (uint16) whose rows lie apart (column ranges of wider matrices, as the
    stream pipeline's GEMMs read A's panels) are read where they are, with their row pitch as
    the leading dimension: within the bound of the rounded operands' product (cuBLAS may
    choose another kernel for the pitch, so not bit for bit the contiguous copies' result),
    and the wider matrices untouched."""
    from distmm.executor.cublas import cublas_gemm_precision, to_input_format

    rng = np.random.default_rng(m * n + k)
    a, b = low_bits(rng, (m, k)), low_bits(rng, (k, n))
    a16, _ = to_input_format(cupy.asarray(a), "bf16")
    b16, _ = to_input_format(cupy.asarray(b), "bf16")
    wide_a = cupy.asarray(rng.integers(0, 2**16, (m, k + 37)).astype(np.uint16))
    wide_b = cupy.asarray(rng.integers(0, 2**16, (k, n + 70)).astype(np.uint16))
    wide_a[:, 5:5 + k], wide_b[:, 64:64 + n] = a16, b16
    before_a, before_b = wide_a.copy(), wide_b.copy()
    c = cupy.full((m, n), np.nan, dtype=cupy.float32)
    cublas_gemm_precision(wide_a[:, 5:5 + k], wide_b[:, 64:64 + n], c, "bf16")
    assert cupy.array_equal(wide_a, before_a) and cupy.array_equal(wide_b, before_b)
    check(c, a, b, "bf16")


@pytest.mark.parametrize("mode", MODES)
def test_device_rounding_matches_the_emulation(mode):
    from distmm.executor.cublas import to_input_format

    rng = np.random.default_rng(2)
    x = (rng.standard_normal(100000) * 10.0 ** rng.integers(-5, 5, 100000)).astype(np.float32)
    x[:4] = [np.inf, -np.inf, 1 + 2**-11, 1 + 2**-8]
    dev, _ = to_input_format(cupy.asarray(x), mode)
    got = cupy.asnumpy(dev)
    if mode == "bf16":  # bfloat16 bits, as uint16
        got = (got.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got.astype(np.float32), round_to(x, mode))


@pytest.mark.parametrize("shape", [(1, 1), (1, 70), (33, 1), (100, 257), (2049, 33)], ids=str)
def test_tf32_rounding_into_a_transposed_copy(shape):
    """Step 14's TF32 operands: rounded and transposed in one pass, the bits of the
    emulation's rounding of the transpose; a strided view (a column slice) read in place."""
    from distmm.executor.cublas import to_input_format

    rng = np.random.default_rng()
    wide = (rng.standard_normal((shape[0], shape[1] + 3))
            * 10.0 ** rng.integers(-5, 5, (shape[0], shape[1] + 3))).astype(np.float32)
    wide[0, 0], wide[-1, -4] = np.nan, 1 + 2**-11  # NaN kept, a tie away from zero
    x = wide[:, :shape[1]]
    for given in (cupy.asarray(np.ascontiguousarray(x)), cupy.asarray(wide)[:, :shape[1]]):
        got, _ = to_input_format(given, "tf32", transpose=True)
        assert got.flags.c_contiguous and got.shape == shape[::-1]
        np.testing.assert_array_equal(cupy.asnumpy(got), round_to(np.ascontiguousarray(x.T), "tf32"))


@pytest.mark.parametrize("backend", ["cublas", "raw", "auto"])
@pytest.mark.parametrize("mode", MODES)
def test_cupy_operands(backend, mode):
    rng = np.random.default_rng(3)
    a, b = low_bits(rng, (300, 517)), low_bits(rng, (517, 211))
    c = distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend, precision=mode)
    assert isinstance(c, cupy.ndarray)
    check(c, a, b, mode)
    # the call cache replays the same mode, and "highest" is float32's own product
    check(distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend, precision=mode),
          a, b, mode)
    exact = cupy.asnumpy(distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    fp32_bound = 517 * U_TC / (1 - 517 * U_TC) * (np.abs(a64) @ np.abs(b64))
    assert np.all(np.abs(exact - a64 @ b64) <= fp32_bound)
    assert not np.array_equal(exact, cupy.asnumpy(c))


@pytest.mark.parametrize("backend", ["cublas", "raw", "auto"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["F", "strided"])
def test_cupy_operands_of_any_layout(backend, mode, layout):
    """Column-major and strided cupy operands (handed to a kernel as transposed, or copied)
    give the same bounded product as C-ordered ones; for TF32 on distmm's kernels a
    column-major operand used to be refused as "not the stored matrix"."""
    rng = np.random.default_rng(5)
    a, b = low_bits(rng, (191, 299)), low_bits(rng, (299, 90))
    if layout == "F":
        ga, gb = cupy.asfortranarray(cupy.asarray(a)), cupy.asfortranarray(cupy.asarray(b))
    else:
        ga = cupy.zeros((191, 598), cupy.float32)[:, ::2]
        gb = cupy.zeros((299, 180), cupy.float32)[:, ::2]
        ga[...], gb[...] = cupy.asarray(a), cupy.asarray(b)
    check(distmm.matmul(ga, gb, backend=backend, precision=mode), a, b, mode)
    check(distmm.matmul(ga, cupy.asarray(b), backend=backend, precision=mode), a, b, mode)


@pytest.mark.parametrize("mode", MODES)
def test_pipeline_host_operands(mode):
    """numpy operands on a GPU backend go through the stream pipeline (device_gemm per
    k-block, beta = 1 after the first): each block rounded, sums in float32."""
    rng = np.random.default_rng(4)
    a, b = low_bits(rng, (1500, 2100)), low_bits(rng, (2100, 900))
    c = distmm.matmul(a, b, backend="cublas", tile=(512, 512, 512), precision=mode)
    assert isinstance(c, np.ndarray)
    check(c, a, b, mode)


@pytest.mark.parametrize("backend", ["cublas", "raw"])
def test_pipeline_takes_bfloat16_operands_as_their_bits(backend):
    """Host bfloat16 operands under precision="bf16" cross to the GPU as their 16-bit
    patterns (half the bytes, no conversion on the host) and give, bit for bit, what the same
    values given as float32 give (rounded to bfloat16 on the device: the same bits)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from distmm.executor.gpu import GPUExecutor
    from distmm.executor.pipeline import run_pipelined
    from distmm.plan import make_plan

    rng = np.random.default_rng(6)
    a = low_bits(rng, (1500, 2100)).astype(ml_dtypes.bfloat16)
    b = low_bits(rng, (2100, 900)).astype(ml_dtypes.bfloat16)
    ex = GPUExecutor(backend=backend, precision="bf16")
    plan = make_plan(1500, 900, 2100, np.float32)
    got, info = {}, {}
    pairs = {"bf16": (a, b), "f32": (a.astype(np.float32), b.astype(np.float32))}
    for name, (x, y) in pairs.items():
        out = np.full((1500, 900), np.nan, np.float32)
        info[name] = {}
        run_pipelined(ex, plan, x, y, out, tiles=(512, 512, 512), info=info[name])
        got[name] = out
    assert (info["bf16"]["operands_as"], info["f32"]["operands_as"]) == ("uint16", "float32")
    assert info["bf16"]["bytes_h2d"] * 2 == info["f32"]["bytes_h2d"]
    assert got["bf16"].tobytes() == got["f32"].tobytes()
    check(got["bf16"], a.astype(np.float32), b.astype(np.float32), "bf16")
    # through the API: the same product
    c = distmm.matmul(a, b, backend=backend, tile=(512, 512, 512), precision="bf16")
    check(c, a.astype(np.float32), b.astype(np.float32), "bf16")


@pytest.mark.parametrize("mode", MODES)
def test_gemm_on_device(mode):
    rng = np.random.default_rng(5)
    a, b = low_bits(rng, (200, 130)), low_bits(rng, (170, 200))
    c0 = rng.standard_normal((130, 170)).astype(np.float32)
    got = distmm.gemm(cupy.asarray(a), cupy.asarray(b), cupy.asarray(c0), alpha=2.0, beta=-1.0,
                      trans_a=True, trans_b=True, precision=mode)
    product = cupy.asnumpy(got) + c0
    check(product / 2.0, a.T.copy(), b.T.copy(), mode)


@pytest.mark.parametrize("mode", MODES)
def test_registry_kernel_for_mode(mode):
    """Where the registry has a tensor-core kernel for the mode on this GPU, the raw
    backend runs it, within the same bound; without one, ``kernel_for`` is None and the
    executor runs cuBLAS."""
    from distmm.executor.gpu import GPUExecutor

    cc = int(cupy.cuda.Device().compute_capability)
    spec = registry.kernel_for("float32", mode, cc)
    ex = GPUExecutor("raw", precision=mode)
    assert ex.precision_kernel() is spec
    assert GPUExecutor("cublas", precision=mode).precision_kernel() is None
    assert GPUExecutor("auto", precision=mode).precision_kernel() is None  # until measured
    rng = np.random.default_rng(6)
    for m, n, k in SHAPES:
        a, b = low_bits(rng, (m, k)), low_bits(rng, (k, n))
        c = cupy.empty((m, n), dtype=cupy.float32)
        ex.device_gemm(cupy.asarray(a), cupy.asarray(b), c)
        check(c, a, b, mode)
