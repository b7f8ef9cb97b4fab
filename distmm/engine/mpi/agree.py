"""The outcome of each rank's own part of a product, agreed on by every rank.

This module covers: after the last panel exchange, what a rank's local work raised (an
object element's ``TypeError``) and the floating-point flags numpy's matmul would have
reported (overflow, invalid, underflow: collected, not raised, while the panels moved; an
object product's rows of reports, ``distmm.fpflags.Row``)
are gathered from every rank; then every rank raises the same error (the lowest failing
rank's), or every rank reports the flags of the whole product once, as ``np.matmul`` on
the full operands does under the ``np.errstate`` in force. One rank raising while the
others wait in the result's gather would hang the job. ``shared_error`` gives every rank
one rank's error (a file the output cannot be made as), by value where it pickles.
It does *not* cover: errors during the exchanges themselves (the engine ends the job) or
arguments refused before the product (``distmm.api``).
"""
from __future__ import annotations

import decimal
import fractions
import functools
import hashlib
import io
import math
import pickle

import numpy as np

from distmm.fpflags import report

__all__ = ["agree", "shared_error", "fingerprint", "differing"]


def agree(comm, error: BaseException | None, flags, *, before_raise=None, into=None,
          when: str = "during the product") -> None:
    """Raise on every rank the error of the lowest rank that had one (on that rank, its
    own exception object; on the others a copy noting ``when`` it was raised there), after
    calling ``before_raise()`` where given; with no error anywhere, report the union of
    ``flags``, or add it to the set ``into`` (for a caller that reports once for several
    products)."""
    if comm.size == 1:  # nothing to send: the error itself is raised below
        outcomes = [(None if error is None else b"", tuple(flags))]
    else:
        outcomes = comm.allgather((_payload(error), tuple(flags)))
    failed = next((r for r, (why, _) in enumerate(outcomes) if why is not None), None)
    if failed is not None:
        if before_raise is not None:
            before_raise()
        if failed == comm.rank:
            raise error
        raise _restore(outcomes[failed][0], failed, comm.size, when)
    union = {f for _, seen in outcomes for f in seen}
    if into is not None:
        into |= union
    else:
        report(union)


def shared_error(comm, error: Exception | None, root: int = 0) -> Exception | None:
    """``root``'s ``error`` on every rank (a broadcast): ``root`` gets its own exception
    object back, the others a copy, or a ``ValueError`` with its type and message where it
    does not travel (an exception whose cause does not unpickle)."""
    if comm.size == 1:
        return error
    payload = comm.bcast(_payload(error) if comm.rank == root else None, root=root)
    if comm.rank == root or payload is None:
        return error
    return _restore(payload, root, comm.size, "on its part of the call")


def _payload(error: BaseException | None):
    """``error`` as bytes another rank can raise; its type name and message where it does not
    pickle and unpickle here."""
    if error is None:
        return None
    try:
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf)
        # the exception's own reduction (type, args, attributes), not one a library
        # registered with copyreg (distributed's tblib sends the cause and traceback along,
        # and makes SystemExit without its code)
        pickler.dispatch_table = {}
        pickler.dump(error)
        payload = buf.getvalue()
        pickle.loads(payload)
        return payload
    except Exception:
        return pickle.dumps(ValueError(f"{type(error).__name__}: {error}"))


def _restore(payload: bytes, rank: int, size: int, when: str = "during the product"
             ) -> Exception:
    try:
        error = pickle.loads(payload)
    except Exception as exc:  # a type this rank cannot import
        error = ValueError(f"rank {rank} of {size} failed {when}; its error did not unpickle "
                           f"here ({type(exc).__name__}: {exc})")
    if isinstance(error, BaseException):
        error.add_note(f"raised on rank {rank} of {size} {when}")
        return error
    return ValueError(f"rank {rank} of {size} failed {when}")


#: object elements read by value (``repr``, the same in every process); others by their type
_PLAIN = (int, float, complex, bool, fractions.Fraction, decimal.Decimal)


def fingerprint(x, count: int = 1024) -> bytes:
    """A digest of up to ``count`` elements spread evenly over ``x`` (numpy or cupy), for
    telling operands apart between ranks at the cost of a gather of ``count`` elements, not a
    pass over the operand. Long doubles are read as float64 (their padding bytes are not the
    value's); object elements by value where they are Python's or numpy's numbers, by type
    otherwise (an object's bytes are its address, its pickle may hold a set's order)."""
    if x.size == 0:
        return b""
    if x.size <= count and isinstance(x, np.ndarray):
        picked = x.reshape(-1)  # every element, in the order of the sample below
    else:
        index = _sample_index(tuple(x.shape), count)
        if not isinstance(x, np.ndarray):  # a device array: its elements gathered there
            import cupy

            picked = cupy.asnumpy(x[tuple(cupy.asarray(i) for i in index)])
        else:
            picked = x[index]
    if picked.dtype.kind == "O":
        text = "\0".join(f"{type(v).__name__} {v!r}" if type(v) in _PLAIN or
                          isinstance(v, np.generic) else type(v).__qualname__ for v in picked)
        return hashlib.blake2b(text.encode(), digest_size=8).digest()
    if picked.dtype.itemsize > 8 and picked.dtype.kind in "fc":
        picked = picked.astype(np.complex128 if picked.dtype.kind == "c" else np.float64)
    return hashlib.blake2b(np.ascontiguousarray(picked).tobytes(), digest_size=8).digest()


@functools.lru_cache(maxsize=64)
def _sample_index(shape: tuple, count: int) -> tuple:
    """The indices of ``fingerprint``'s sample of an array of ``shape`` (made once per shape:
    they cost more than the gather itself, on every call of ``engine="mpi"``)."""
    size = math.prod(shape)
    index = np.unravel_index(np.unique(np.linspace(0, size - 1, min(count, size))
                                       .astype(np.int64)), shape)
    for i in index:
        i.flags.writeable = False
    return index


def differing(mine, theirs) -> str:
    """Which operands two ranks' ``fingerprint`` pairs ``(a, b)`` disagree on: "a", "b" or
    "a and b"."""
    return " and ".join(name for name, x, y in zip("ab", mine, theirs) if x != y)
