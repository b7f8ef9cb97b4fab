"""cuBLAS through cupy: the one wrapper every GPU path multiplies with.

This module covers: ``cublas_gemm(a, b, c, alpha, beta)``, computing
``c = alpha * a @ b + beta * c`` into a preallocated cupy array on the current
stream (``cupy.matmul`` for ``beta == 0``, ``cupy.cublas.gemm`` in place for
``beta != 0`` when the dtypes and layout allow, else a temporary), and
``CublasGemm``, the smallest executor the stream pipeline can use (its
``device_gemm`` adds a stream), ``start_cublas``, cuBLAS's start-up on a
background thread, and ``cublas_gemm_precision``, the cuBLAS path of the reduced
precision modes (``distmm.precision``: operands rounded to TF32, bfloat16 or
float16 on the device, ``cublasGemmEx`` with float32 accumulation).

It does *not* cover: distmm's own kernels (``distmm.executor.cuda_loader``),
choosing between them and cuBLAS (``distmm.executor.gpu``), or dtype promotion
(callers pass operands of ``c``'s dtype). cupy is imported on first use.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading

__all__ = ["cublas_gemm", "CublasGemm", "start_cublas", "cublas_gemm_precision", "to_input_format"]

_started: dict = {}  # (device id, dtype name) -> Future of the start-up
_started_lock = threading.Lock()


def _start_up(device_id: int, dtype) -> None:
    import cupy

    # A stream of its own that does not wait for the legacy default stream: the caller's
    # own GPU work (making its operands) may still be running there.
    with cupy.cuda.Device(device_id), cupy.cuda.Stream(non_blocking=True) as stream:
        cupy.cuda.device.get_cublas_handle()
        # empty, not ones: filling needs cupy's elementwise kernel, compiled by NVRTC on a
        # cold kernel cache; the values are never read
        x = cupy.empty((256, 256), dtype=dtype)
        c = cupy.empty_like(x)
        cublas_gemm(x, x, c, 1, 0)
        cublas_gemm(x, x, c, 1, 1)  # the in-place path of the later k-blocks
        stream.synchronize()


def start_cublas(dtype):
    """Start cuBLAS for ``dtype`` on the current device on a background thread: its
    library, handle and first kernels (most of it loading cuBLASLt's kernels).
    Returns the thread's Future: the same one on every
    call for this dtype and device (it runs once). A caller that goes on with other
    start-up work (allocating, pinning, staging the first tiles) pays only what is left
    of it at its first GEMM.
    A failure is kept in the Future; the first GEMM then raises it itself."""
    import cupy
    import numpy as np

    key = (cupy.cuda.runtime.getDevice(), np.dtype(dtype).name)
    with _started_lock:
        if key in _started:
            return _started[key]
        fut: cf.Future = cf.Future()
        _started[key] = fut

    def run():
        try:
            _start_up(key[0], key[1])
            fut.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - kept for the caller
            fut.set_exception(exc)

    threading.Thread(target=run, name="distmm-cublas-start", daemon=True).start()
    return fut


def cublas_gemm(a, b, c, alpha=1, beta=0) -> None:
    """``c = alpha * a @ b + beta * c`` on cupy's current stream; ``beta == 0``
    means ``c`` is not read."""
    import cupy

    one = alpha == 1
    if beta == 0:
        if one:
            cupy.matmul(a, b, out=c)
        else:
            cupy.multiply(cupy.matmul(a, b), c.dtype.type(alpha), out=c)
        return
    if c.dtype.kind in "fc" and c.flags.c_contiguous and a.dtype == b.dtype == c.dtype:
        # In place: no temporary and no extra passes over c (the pipeline
        # accumulates every k-block after the first with beta = 1).
        from cupy import cublas

        cublas.gemm("N", "N", a, b, out=c, alpha=alpha, beta=beta)
        return
    prod = cupy.matmul(a, b)
    if not one:
        prod *= c.dtype.type(alpha)
    c *= c.dtype.type(beta)
    c += prod


class CublasGemm:
    """cuBLAS as a ``device_gemm`` provider: ``device_gemm(a, b, c, alpha=1,
    beta=0, stream=None)`` runs ``cublas_gemm`` on ``stream`` and returns ``c``."""

    name = "cublas"

    def device_gemm(self, a, b, c, *, alpha=1.0, beta=0.0, stream=None):
        with stream if stream is not None else contextlib.nullcontext():
            cublas_gemm(a, b, c, alpha, beta)
        return c

    def close(self) -> None:
        pass


# -- reduced precision (distmm.precision's modes) ---------------------------------------

#: cudaDataType_t and cublasComputeType_t values (cublas_api.h, library_types.h)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
CUBLAS_GEMM_DEFAULT = -1

#: cvt.rna.tf32.f32's rounding of float ``{v}`` in integer arithmetic (any architecture): half
#: an ulp of TF32 added to the magnitude's bits, ties away from zero; NaN kept
_TF32_RNA = "isnan({v}) ? {v} : __uint_as_float((__float_as_uint({v}) + 0x1000u) & 0xffffe000u)"

_ROUND_KERNELS: dict = {}


def _rounding_kernel(precision: str):
    """A cupy elementwise kernel taking float32 to the bits the tensor cores are fed:
    TF32 as float32 (cvt.rna's rounding: ties away from zero), bfloat16 as uint16 (ties to even);
    NaN stays NaN. The same rounding as ``distmm.executor.reduced.round_to``."""
    kernel = _ROUND_KERNELS.get(precision)
    if kernel is None:
        import cupy

        if precision == "tf32":
            kernel = cupy.ElementwiseKernel(
                "float32 x", "float32 y",
                f"y = {_TF32_RNA.format(v='x')};",
                "distmm_round_tf32")
        else:
            kernel = cupy.ElementwiseKernel(
                "float32 x", "uint16 y",
                "unsigned b = __float_as_uint(x);"
                " y = isnan(x) ? (unsigned short)((b >> 16) | 0x40u)"
                " : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);",
                "distmm_round_bf16")
        _ROUND_KERNELS[precision] = kernel
    return kernel


_TRANSPOSE_TF32 = r"""
extern "C" __global__ void distmm_round_tf32_transposed(const float* __restrict__ x, long long ldx,
                                                        float* __restrict__ y, int rows, int cols) {
    // y (cols x rows, C-contiguous) = x (rows x cols, row stride ldx) transposed, each value
    // rounded as distmm_round_tf32; 32 x 32 tiles through shared memory, 32 x 8 threads
    __shared__ float tile[32][33];
    const int c0 = blockIdx.x * 32, tx = threadIdx.x, ty = threadIdx.y;
    for (long long r0 = (long long)blockIdx.y * 32; r0 < rows; r0 += 32LL * gridDim.y) {
        for (int j = ty; j < 32; j += 8) {
            const long long r = r0 + j;
            if (r < rows && c0 + tx < cols) tile[j][tx] = x[r * ldx + c0 + tx];
        }
        __syncthreads();
        for (int j = ty; j < 32; j += 8) {
            const long long r = r0 + tx;
            if (r < rows && c0 + j < cols) {
                const float v = tile[tx][j];
                y[(long long)(c0 + j) * rows + r] =
                    @TF32_RNA@;
            }
        }
        __syncthreads();
    }
}
""".replace("@TF32_RNA@", _TF32_RNA.format(v="v"))


def _round_tf32_transposed(x):
    """``x.T`` rounded to TF32 (``_rounding_kernel("tf32")``'s rounding) into a new
    C-contiguous float32 array, in one pass over ``x`` (a float32 matrix whose rows are
    contiguous)."""
    import cupy
    import numpy as np

    kernel = _ROUND_KERNELS.get("tf32-transposed")
    if kernel is None:
        kernel = cupy.RawKernel(_TRANSPOSE_TF32, "distmm_round_tf32_transposed")
        _ROUND_KERNELS["tf32-transposed"] = kernel
    rows, cols = x.shape
    if rows > 1 and cols > 1 and x.strides[1] != 4:  # float32 (the caller's): rows contiguous
        x = cupy.ascontiguousarray(x)
    y = cupy.empty((cols, rows), dtype=cupy.float32)
    if rows and cols:
        ldx = x.strides[0] // 4 if rows > 1 else cols
        grid = (-(-cols // 32), min(-(-rows // 32), 65535))
        kernel(grid, (32, 8), (x, np.int64(ldx), y, np.int32(rows), np.int32(cols)))
    return y


def to_input_format(x, precision: str, *, transpose: bool = False):
    """A cupy float32 matrix as the tensor cores take it in ``precision``: ``(array,
    cudaDataType)``, a new C-contiguous array: float32 rounded to TF32, bfloat16 bits
    (uint16) or float16; of ``x.T`` with ``transpose`` (TF32: rounded and transposed in one
    pass). bfloat16 bits (uint16) under ``"bf16"`` are that format already: they pass as
    they are (C-contiguous), as the stream pipeline hands bfloat16 operands."""
    import cupy

    if transpose and precision == "tf32" and x.dtype == cupy.float32:
        return _round_tf32_transposed(x), CUDA_R_32F
    if transpose:
        x = x.T
    if x.dtype == cupy.uint16:
        if precision != "bf16":
            raise TypeError(f"to_input_format: uint16 operands are bfloat16 bits, for "
                            f"precision 'bf16', not {precision!r}")
        return cupy.ascontiguousarray(x), CUDA_R_16BF
    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    if precision == "fp16":
        return x.astype(cupy.float16), CUDA_R_16F
    if precision == "bf16":
        return _rounding_kernel("bf16")(x), CUDA_R_16BF
    if precision == "tf32":
        return _rounding_kernel("tf32")(x), CUDA_R_32F
    raise ValueError(f"to_input_format: precision must be tf32, bf16 or fp16, got {precision!r}")


def _in_place(x, precision: str):
    """``(to_input_format(x, precision), leading dimension)``; bfloat16 bits (uint16) whose
    rows are contiguous but apart (a column range of a wider matrix, as the stream pipeline's
    panels of A) are read where they are, with their row pitch as the leading dimension."""
    rows, cols = x.shape
    item = x.itemsize
    if (precision == "bf16" and x.dtype.name == "uint16" and rows > 1 and x.strides[1] == item
            and x.strides[0] % item == 0 and x.strides[0] // item >= cols):
        return (x, CUDA_R_16BF), x.strides[0] // item
    return to_input_format(x, precision), cols


def cublas_gemm_precision(a, b, c, precision: str, alpha=1, beta=0) -> None:
    """``c = alpha * a @ b + beta * c`` for float32 cupy matrices in a reduced precision
    mode, on cupy's current stream, through ``cublasGemmEx``: the operands are rounded
    to the mode's format first (``to_input_format``), then ``CUBLAS_COMPUTE_32F_FAST_TF32``
    for ``"tf32"`` (float32 storage of TF32 values) or ``CUBLAS_COMPUTE_32F`` on bfloat16
    or float16 operands, with float32 accumulation and output. ``beta == 0`` means ``c``
    is not read. ``c`` may be any float32 2-D array (a strided one goes through a copy)."""
    import cupy
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        if beta == 0:
            c[...] = 0
        else:
            c *= np.float32(beta)
        return
    (a_in, a_type), lda = _in_place(a, precision)
    (b_in, b_type), ldb = _in_place(b, precision)
    direct = c.dtype == np.float32 and c.flags.c_contiguous
    target = c if direct else cupy.ascontiguousarray(c, dtype=cupy.float32)
    compute = CUBLAS_COMPUTE_32F_FAST_TF32 if precision == "tf32" else CUBLAS_COMPUTE_32F
    one = np.array(alpha, dtype=np.float32)
    zero = np.array(beta, dtype=np.float32)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        # row-major C = A @ B is column-major C^T = B^T @ A^T: no transposes, swapped operands
        cublas.gemmEx(handle, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k,
                      one.ctypes.data, b_in.data.ptr, b_type, ldb, a_in.data.ptr, a_type, lda,
                      zero.ctypes.data, target.data.ptr, CUDA_R_32F, n, compute,
                      CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    if not direct:
        c[...] = target
