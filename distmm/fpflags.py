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
Object products whose elements are numpy scalars report in the elements' own arithmetic
("overflow encountered in scalar multiply", "... in scalar add"), once per operation, in
numpy's row-major loop order: computed in another process (a Dask worker, an MPI rank)
inside ``collect``, ``object_rows`` keeps what each row of C reported as a ``Row`` (where
it is in C, in order), and ``report`` gives the rows of the whole product in numpy's order,
each report by a numpy scalar operation that makes it, then numpy's "in matmul" for the
flags numpy's loop would have found left set at its end.
The replay follows numpy 2's scalar loops; with numpy 1.x, float16 scalars' reports can
come in another order than that numpy's.
It does *not* cover: devices (cupy raises no flags) or the inputs of a reduced precision.
"""
from __future__ import annotations

import contextvars
import operator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["product_flags", "collect", "as_matmul", "report", "Row", "object_rows", "placed"]

#: for each flag, a float16 product that raises it alone: the rounding of 120000 to
#: float16 overflows, of 1e-8 underflows, and inf * 0 is invalid
_RAISES = {"overflow": (60000.0, 2.0), "underflow": (1e-4, 1e-4), "invalid": (np.inf, 0.0)}
#: numpy's error callback names "invalid" so; the other flags by their own names
_NAMES = {"invalid value": "invalid"}
#: for each report of a numpy scalar's arithmetic (numpy's kind and operation), float16
#: scalars whose operation makes it alone (an addition never underflows)
_SCALAR = {**{(kind, "scalar multiply"): _RAISES[_NAMES.get(kind, kind)]
              for kind in ("overflow", "underflow", "invalid value")},
           ("overflow", "scalar add"): (60000.0, 60000.0),
           ("invalid value", "scalar add"): (np.inf, -np.inf)}
_OPERATIONS = {"scalar multiply": operator.mul, "scalar add": operator.add}
#: the reports one ``object_rows`` call keeps in order; after them each row keeps its
#: distinct ones once (numpy reports every operation: a product of int8 scalars that wrap
#: reports most of its m * n * k multiplications)
KEPT_REPORTS = 4096
#: the set of the innermost ``collect`` of this thread, where ``object_rows`` keeps its rows
_SEEN: contextvars.ContextVar = contextvars.ContextVar("distmm_fpflags_seen", default=None)


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
    the error callback, or nothing. ``Row`` s among them (an object product's elements,
    ``object_rows``) report first, in numpy's order, as numpy scalars' arithmetic."""
    rows = [f for f in flags if isinstance(f, Row)]
    if rows:
        flags = {f for f in flags if not isinstance(f, Row)} | _give(rows)
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

    token = _SEEN.set(seen)
    try:
        with np.errstate(all="call", call=note):
            yield seen
    finally:
        _SEEN.reset(token)


@contextmanager
def as_matmul():
    """``collect``, then, leaving without an exception, ``report`` what was collected (and
    what the caller added to the yielded set) as numpy's matmul would."""
    with collect() as seen:
        yield seen
    report(seen & set(_RAISES))


@dataclass(frozen=True)
class Row:
    """What one row of an object product's block of C reported, kept in ``collect``'s set.

    ``at``: where the row's first element is in C, ``(*batch, row, column)``, which orders
    the rows as numpy's loop takes them; ``reports``: ``(kind, operation)`` as numpy names
    them ("overflow", "scalar multiply"), in order; ``left``: the flags left set at the row's
    end (a float32 scalar's overflow stays set; Python floats' flags are set and never
    reported), which numpy's loop reports "in matmul" where no later operation clears them;
    ``clears``: whether the row did numpy scalar arithmetic, which clears the flags before
    each operation."""

    at: tuple
    reports: tuple = ()
    left: frozenset = frozenset()
    clears: bool = False


class _Log:
    """numpy's "log" error handler: the reports of an object product's rows, in order."""

    def __init__(self):
        self.kept, self.reports, self.more = 0, [], {}

    def write(self, message: str) -> None:  # "Warning: overflow encountered in matmul\n"
        if self.kept < KEPT_REPORTS:
            self.kept += 1
            self.reports.append(message)
        else:
            self.more[message] = None

    def take(self):
        """The row's reports since the last ``take``, ``(kind, operation)``: numpy scalars'
        and, apart, the flags its loop left set (its own "in matmul" report)."""
        got = [tuple(m.strip().removeprefix("Warning: ").split(" encountered in ", 1))
               for m in self.reports + [m for m in self.more if m not in self.reports]]
        self.reports, self.more = [], {}
        left = frozenset(_NAMES.get(k, k) for k, op in got if op == "matmul")
        return tuple(r for r in got if r[1] != "matmul"), left


def _numpy_scalars(x) -> bool:
    """Whether an object array holds numpy scalars (whose arithmetic clears the flags)."""
    return any(isinstance(v, np.generic) for v in x.flat)


def object_rows(product, a, b, at: tuple):
    """``product(a, b)`` (numpy's matmul) of 2-D object panels whose block of C starts at
    ``at`` (``(*batch, row, column)``). Inside ``collect`` the rows are multiplied one by
    one and what each reported is kept in collect's set as a ``Row`` (rows that reported
    nothing are left out, but for the last one that clears the flags); outside, one call."""
    seen = _SEEN.get()
    m, k = a.shape
    if seen is None or not m:
        return product(a, b)
    c = np.empty((m, b.shape[1]), dtype=object)
    log = _Log()
    rows = []
    with np.errstate(all="log", call=log):
        for i in range(m):
            c[i:i + 1] = product(a[i:i + 1], b)
            reports, left = log.take()
            if reports or left:
                rows.append([i, reports, left])
    # the last row that does numpy scalar arithmetic clears what the rows before it left
    works = bool(k and b.shape[1])
    b_scalars = works and _numpy_scalars(b)

    def clears(i: int) -> bool:
        return works and (b_scalars or _numpy_scalars(a[i]))

    last = m - 1 if b_scalars else next((i for i in range(m - 1, -1, -1) if clears(i)), None)
    if last is not None and not any(i == last for i, _, _ in rows):
        rows.append([last, (), frozenset()])
    *lead, r0, c0 = at
    seen.update(Row((*lead, r0 + i, c0), reports, left, clears(i)) for i, reports, left in rows)
    return c


def placed(flags, lead: tuple) -> set:
    """``flags`` with their rows placed in the stack's element ``lead`` (a product of a
    stack computed one 2-D product at a time)."""
    return {replace(f, at=tuple(lead) + f.at) if isinstance(f, Row) else f for f in flags}


def _give(rows) -> set[str]:
    """Report the rows' numpy scalar arithmetic in numpy's order; return the flags its loop
    would find left set at its end (those of the rows after the last that clears them).
    A report no numpy scalar operation here makes is given with those flags."""
    rows = sorted(rows, key=lambda r: r.at)
    last = max((r.at for r in rows if r.clears), default=None)
    left: set[str] = set()
    for r in rows:
        for kind, operation in r.reports:
            pair = _SCALAR.get((kind, operation))
            if pair is None:
                left.add(_NAMES.get(kind, kind))
                continue
            _OPERATIONS[operation](np.float16(pair[0]), np.float16(pair[1]))
        if last is None or r.at >= last:
            left |= r.left
    return left
