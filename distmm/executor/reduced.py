"""Reduced-precision products on the CPU: the tensor cores' arithmetic, emulated.

This module covers: rounding float32 operands to the input format of a reduced
precision mode as the tensor cores are fed them (``round_to``, by bit arithmetic:
TF32 to nearest with ties away from zero, as PTX's ``cvt.rna.tf32.f32``, the
rounding distmm's TF32 paths apply before the tensor cores; bfloat16 to nearest with ties to
even, as ``cvt.rn.bf16.f32`` and ``ml_dtypes``; float16 through numpy's own cast,
which rounds to nearest even and overflows to infinity), and ``reduced_product``, a product of rounded panels
summed in float32, which is what ``distmm.precision`` describes and bounds.
It does *not* cover: which modes apply to which dtypes or their error bounds
(``distmm.precision``), the GPU's own paths (``distmm.executor.cublas``,
``distmm.executor.gpu``), or choosing tiles.

The emulation and the GPU agree within ``distmm.precision.error_bound``; they
need not agree bit for bit (the GPU's summation order, and its adds inside an
MMA, differ from BLAS's).
"""
from __future__ import annotations

import numpy as np

from distmm.fpflags import product_flags, report

__all__ = ["round_to", "reduced_product", "DROPPED_BITS"]

#: low float32 significand bits each format drops (float32 keeps 23), and whether its
#: ties go to even (else away from zero)
DROPPED_BITS = {"tf32": 13, "bf16": 16}
TIES_TO_EVEN = {"tf32": False, "bf16": True}


def _round_bits(x: np.ndarray, dropped: int, ties_to_even: bool) -> np.ndarray:
    """float32 ``x`` with its low ``dropped`` significand bits rounded away (to nearest;
    ties to even or away from zero); the exponent is float32's, so only overflow past
    float32's largest value (to infinity) changes it. NaNs stay NaN."""
    bits = x.view(np.uint32)
    if ties_to_even:
        half = np.uint32((1 << (dropped - 1)) - 1) + ((bits >> np.uint32(dropped)) & np.uint32(1))
    else:
        half = np.uint32(1 << (dropped - 1))
    # uint32 arithmetic on the magnitude's bits (the sign bit is untouched below the
    # top): a carry out of the significand moves into the exponent, as rounding up to
    # the next binade (or to infinity) must
    rounded = (bits + half) & np.uint32(~((1 << dropped) - 1) & 0xFFFFFFFF)
    out = rounded.view(np.float32)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = x[nan]  # a NaN whose payload sits in the low bits must not become inf
    return out


def round_to(x, precision: str) -> np.ndarray:
    """``x`` (float32, any layout) rounded to the input format of ``precision``, as a new
    C-contiguous float32 array.

    Parameters
    ----------
    x : ndarray of float32
    precision : {"tf32", "bf16", "fp16"}
        TF32 rounds ties away from zero, bfloat16 and float16 to even.

    Returns
    -------
    ndarray of float32
        Every element representable in the format: TF32 (10 significand bits,
        float32's exponent range), bfloat16 (7 bits, float32's range) or float16
        (10 bits; beyond 65504 it rounds to infinity, below 2^-14 to float16's
        subnormals).

    Raises
    ------
    ValueError
        An unknown mode.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if precision == "fp16":
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(np.float16).astype(np.float32)
    try:
        dropped = DROPPED_BITS[precision]
    except KeyError:
        raise ValueError(f"round_to: precision must be one of tf32, bf16, fp16, "
                         f"got {precision!r}") from None
    return _round_bits(x, dropped, TIES_TO_EVEN[precision])


def reduced_product(a, b, precision: str, matmul=np.matmul) -> np.ndarray:
    """``a @ b`` as the tensor cores compute it in ``precision``: both operands rounded
    to the format (``round_to``), their products (exact in float32) summed in float32
    by ``matmul`` (a float32 GEMM: numpy's BLAS or distmm's numba kernel). What it reports
    is what a sequential loop over the rounded operands raises (``product_flags``: inf * 0,
    an overflow of the float32 sum), under the errstate in force; not the GEMM's own flags
    (a BLAS kernel raises "invalid" for some infinite operands that meet no zero), nor the
    rounding's (a value that rounds past the format's range becomes an infinity, as on the
    device).

    Returns a new float32 array."""
    with np.errstate(all="ignore"):
        ra, rb = round_to(a, precision), round_to(b, precision)
        p = matmul(ra, rb)
    report(product_flags(ra, rb, p))
    return p
