"""Precision modes of a product: which apply to which dtypes, and their error bounds.

This module covers: what the modes mean, the unit roundoffs of their input
formats, and the proven elementwise error bound of each (``error_bound``); the
names ``precision=`` takes (``PRECISIONS``) and the rule that refuses a mode the
operands' dtypes cannot take (``check_precision``) are the planner's dtype rules
(``distmm.plan``), re-exported here. Pure: numpy only, no rounding of arrays.
It does *not* cover: rounding operands to a format or multiplying
(``distmm.executor.reduced`` on the CPU, ``distmm.executor.cublas`` and the
kernel registry on the GPU), or reading the configured default
(``distmm.config``'s ``distmm.precision``).

The modes
---------
``"highest"`` (the default)
    Exact for the dtype, as numpy computes it: nothing is rounded beyond what
    the result dtype's own arithmetic rounds.
``"tf32"``, ``"bf16"``, ``"fp16"``
    What the tensor cores compute: both operands are converted to the
    accumulation dtype (float32) and then rounded to nearest (TF32 with ties
    away from zero, as PTX's ``cvt.rna.tf32.f32``; bfloat16 and float16 with
    ties to even) into the format's significand: TF32 (10 stored bits, float32's exponent),
    bfloat16 (7 bits, float32's exponent) or float16 (10 bits, 5-bit
    exponent); products of two rounded values are exact in float32 and are
    summed in float32. ``"tf32"`` is cuBLAS's ``CUBLAS_COMPUTE_32F_FAST_TF32``;
    ``"bf16"`` and ``"fp16"`` are ``CUBLAS_COMPUTE_32F`` on operands converted
    to that format (``..._FAST_16BF`` / ``..._FAST_16F``). distmm's GPU paths
    round the operands themselves before the tensor cores see them, so the
    hardware's own handling of low bits (truncation, in some generations)
    never applies.

A reduced mode applies where numpy's result dtype of the product is float32,
float16 or bfloat16 (``ml_dtypes.bfloat16``; numpy gives float32 for
bfloat16 @ bfloat16, and distmm follows it): the rounding is to a format no
wider than the result's. Integer, boolean, float64, longdouble, complex and
object results are refused with a ``TypeError`` naming the dtype and the mode,
before any work, as numpy refuses a dtype its loop does not have.

NaN and infinities in the operands propagate as in numpy's product. The
rounding can make more, as on the tensor cores: a finite operand that rounds
past the format's largest value is an infinity (a magnitude from 65520 under
``"fp16"``, from (2 - 2^-11) 2^127 under ``"tf32"``, from (2 - 2^-8) 2^127
under ``"bf16"``), and one of at most half the format's smallest subnormal
is zero, so an infinity it meets gives NaN (with numpy's "invalid value"
report of inf * 0) where numpy's float32 product is infinite.

The error bound (``error_bound``)
---------------------------------
For ``C = A @ B`` with inner dimension k, ``C_ref`` the exact product of the
operands as given (a float64 product is a sufficient stand-in in tests), u_in
the unit roundoff of the input format (2^-11 TF32, 2^-8 BF16, 2^-11 FP16),
u = 2^-24 float32's and ``gamma_j = j u / (1 - j u)``::

    |C - C_ref| <= (2 u_in + u_in^2 + gamma_{k-1} (1 + u_in)^2) |A| |B|     (elementwise)

Proof: rounding gives ``a' = a (1 + d)`` with ``|d| <= u_in``, so
``|a' b' - a b| <= (2 u_in + u_in^2) |a| |b|``; ``a' b'`` has at most 22
significant bits and is exact in float32; any float32 summation of k terms,
in any order or tree (blocked BLAS, k-split partials, FMA), errs by at most
``gamma_{k-1} sum |a' b'|`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., eq. 3.5 and Lemma 3.1); and ``|a'| <= (1 + u_in) |a|``.
A float16 or bfloat16 result is rounded once more, adding
``u_out (1 + bound)`` with u_out its unit roundoff. The bound is a
deterministic worst case; it assumes no overflow, and no underflow below the
format's normal range (float16's smallest normal is 2^-14; a smaller input
adds up to 2^-25 absolute error per operand element).

Tensor cores may add inside one MMA with truncation rather than rounding
(Fasi, Higham, Mikaitis, Pranesh, PeerJ CS 2021): for GPU results use
``u_acc=2**-23`` (``error_bound(..., u_acc=2**-23)``), which bounds both.
"""
from __future__ import annotations

import numbers
import operator

import numpy as np

# the dtype rules live with the planner's (distmm.plan imports nothing of distmm)
from distmm.plan import PRECISIONS, check_precision, is_bfloat16, reduced_applies

__all__ = ["PRECISIONS", "REDUCED", "UNIT_ROUNDOFF", "check_precision", "error_bound",
           "is_bfloat16", "reduced_applies"]

#: the reduced modes (tensor-core formats)
REDUCED = ("tf32", "bf16", "fp16")

#: unit roundoff of each input format (half a unit in the last place of 1)
UNIT_ROUNDOFF = {"tf32": 2.0**-11, "bf16": 2.0**-8, "fp16": 2.0**-11}

#: float32, the accumulation format of every reduced mode
U_FP32 = 2.0**-24


def error_bound(precision: str, k: int, *, out_dtype=None, u_acc: float = U_FP32) -> float:
    """The coefficient ``c`` of the elementwise bound ``|C - C_ref| <= c |A| |B|``.

    Parameters
    ----------
    precision : {"tf32", "bf16", "fp16"}
        Any case, as ``matmul``'s ``precision=`` takes it.
    k : int
        The inner dimension (an integer, at least 0).
    out_dtype : dtype, optional
        The result dtype; float16 or bfloat16 adds its final rounding.
    u_acc : float
        Unit roundoff of the accumulation: float32's 2^-24 for round to
        nearest (the CPU emulation, cuBLAS's fp32 adds); 2^-23 covers
        tensor cores that truncate inside an MMA.

    Returns
    -------
    float
        ``2 u_in + u_in^2 + gamma_{k-1} (1 + u_in)^2``, plus
        ``u_out (1 + that)`` for a float16 or bfloat16 result (see the module
        docstring for the proof and its assumptions).

    Raises
    ------
    ValueError
        ``"highest"`` (its bound is the dtype's own) or an unknown mode, a
        negative ``k``, a ``u_acc`` outside ``[0, 1)`` (negative or NaN would
        make the bound smaller than the rounding's own, or NaN), or ``k`` so
        large that ``(k - 1) u_acc >= 1``.
    TypeError
        A ``k`` that is not an integer (a float is not truncated), or a
        ``u_acc`` that is not a real number.
    """
    mode = precision.lower() if isinstance(precision, str) else precision
    if mode not in REDUCED:
        raise ValueError(f"error_bound: precision must be one of {', '.join(REDUCED)}, "
                         f"got {precision!r}")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"error_bound: k must be an integer, got {k!r}") from None
    if k < 0:
        raise ValueError(f"error_bound: k must be at least 0, got {k}")
    if isinstance(u_acc, bool) or not isinstance(u_acc, numbers.Real):
        raise TypeError(f"error_bound: u_acc must be a real number, got {u_acc!r}")
    if not 0 <= u_acc < 1:
        raise ValueError(f"error_bound: u_acc must be a unit roundoff in [0, 1), got {u_acc!r}")
    u_acc = float(u_acc)  # a float32 one would round the bound in float32
    u_in = UNIT_ROUNDOFF[mode]
    n = max(k - 1, 0)
    if n * u_acc >= 1:
        raise ValueError(f"error_bound: k={k} is too large for a bound with u_acc={u_acc}")
    gamma = n * u_acc / (1 - n * u_acc)
    bound = 2 * u_in + u_in * u_in + gamma * (1 + u_in) ** 2
    if out_dtype is not None:
        dt = np.dtype(out_dtype)
        if dt == np.float16:
            bound += 2.0**-11 * (1 + bound)
        elif is_bfloat16(dt):
            bound += 2.0**-8 * (1 + bound)
    return bound
