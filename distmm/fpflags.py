"""numpy's floating-point reports for products that distmm computes itself.

This module covers: the floating-point flags numpy's matmul loop raises and reports under
``np.errstate`` ("invalid value encountered in matmul", "overflow ...", "underflow ..."),
for the parts of a product that are not one ``np.matmul`` call: distmm's numba kernels
(which raise none), the float16 rounding of a float32 sum (a cast, which reports "in
cast") and the sum of a tile's k partials (an add). ``product_flags`` finds what a kernel's
loop would have raised from its operands and result; ``collect`` gathers what numpy
operations inside it raise (in a worker thread); ``report`` has numpy's own matmul report a
set of flags, so that the errstate in force (ignore, warn, raise, call, print, log) decides
as for numpy; ``as_matmul`` is the two together, once per product.
It does *not* cover: devices (cupy raises no flags) or the inputs of a reduced precision.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

__all__ = ["product_flags", "collect", "as_matmul", "report"]

#: for each flag, a float16 product that raises it alone: the rounding of 120000 to
#: float16 overflows, of 1e-8 underflows, and inf * 0 is invalid
_RAISES = {"overflow": (60000.0, 2.0), "underflow": (1e-4, 1e-4), "invalid": (np.inf, 0.0)}
#: numpy's error callback names "invalid" so; the other flags by their own names
_NAMES = {"invalid value": "invalid"}


def product_flags(a, b, p) -> set[str]:
    """The flags a sequential loop computing ``p = a @ b`` raised, found from the result.

    A NaN in ``p`` whose row of ``a`` and column of ``b`` hold no NaN came from an invalid
    operation (inf * 0, inf - inf); an infinity whose row and column hold no infinity came
    from an overflow. Integers raise none. Batched operands broadcast as in matmul.
    """
    if p.dtype.kind not in "fc" or p.size == 0:
        return set()
    flags = set()
    nan = np.isnan(p)
    if nan.any():
        clean = ~np.isnan(a).any(-1)[..., :, None] & ~np.isnan(b).any(-2)[..., None, :]
        if (nan & clean).any() or _inf_times_zero(a, b, nan & ~clean):
            flags.add("invalid")
    inf = np.isinf(p)
    if inf.any():
        finite = ~np.isinf(a).any(-1)[..., :, None] & ~np.isinf(b).any(-2)[..., None, :]
        if (inf & finite).any():
            flags.add("overflow")
    return flags


def _inf_times_zero(a, b, where) -> bool:
    """Whether a term ``a[i, k] * b[k, j]`` is inf * 0 at some ``(i, j)`` of ``where``
    (elements NaN anyway, from a NaN operand: the invalid product is raised all the same;
    an inf - inf there depends on the order of the sum and is not looked for)."""
    if not where.any():
        return False
    f = np.float32  # counts of hits: a sum of ones and zeros is 0 only when none hit
    hits = (np.matmul(np.isinf(a).astype(f), (b == 0).astype(f))
            + np.matmul((a == 0).astype(f), np.isinf(b).astype(f)))
    return bool(((hits > 0) & where).any())


def report(flags) -> None:
    """Have numpy's matmul report ``flags`` (of "invalid", "overflow", "underflow") as it
    reports its own, under the errstate in force: a warning, a ``FloatingPointError``,
    the error callback, or nothing."""
    pairs = [_RAISES[f] for f in ("overflow", "underflow", "invalid") if f in flags]
    if pairs:
        a = np.diag([x for x, _ in pairs]).astype(np.float16)
        b = np.diag([y for _, y in pairs]).astype(np.float16)
        np.matmul(a, b)


@contextmanager
def collect():
    """Inside, numpy's operations report nothing; their flags gather in the set this
    yields (for a thread whose caller reports them once)."""
    seen: set[str] = set()

    def note(kind, _flag):
        seen.add(_NAMES.get(kind, kind))

    with np.errstate(all="call", call=note):
        yield seen


@contextmanager
def as_matmul():
    """``collect``, then, leaving without an exception, ``report`` what was collected (and
    what the caller added to the yielded set) as numpy's matmul would."""
    with collect() as seen:
        yield seen
    report(seen & set(_RAISES))
