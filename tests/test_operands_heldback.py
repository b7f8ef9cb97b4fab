"""Held-back cases of distmm.matmul and distmm.gemm against numpy.matmul for unusual
operands, on the local engine and on a Dask cluster: products without elements whose k
is too long to plan, array-likes (no ndarray) with their own ``__array_wrap__``, and the
wrap numpy 1.x picks (a subclass of negative ``__array_priority__`` beside a plain array).

Each case is asked of numpy itself on the same operands: the result's type, dtype, shape
and elements, the wrap's arguments, or the exception type.
It does *not* cover: ``out=`` (tests/test_matmul_out_heldback.py), ndarray subclasses
beside dask operands (the same file), numpy's own matmul tests (tests/test_numpy_suite.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import distmm
from conftest import identical

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

#: a k no plan lists in tiles (``distmm.plan.MAX_EDGES``); operands of it are broadcast views
HUGE_K = 10**12


def _huge(shape, dtype):
    """An operand of ``shape``: empty where a size is 0, else a broadcast view of one zero
    (no memory behind its HUGE_K elements)."""
    if 0 in shape:
        return np.empty(shape, dtype)
    return np.broadcast_to(np.zeros((), dtype), shape)


#: (a's shape, b's shape): products without elements, k too long to plan
EMPTY_HUGE_K = {
    "m=0": ((0, HUGE_K), (HUGE_K, 5)),
    "n=0": ((5, HUGE_K), (HUGE_K, 0)),
    "m=n=0": ((0, HUGE_K), (HUGE_K, 0)),
    "batch 0": ((0, 5, HUGE_K), (HUGE_K, 5)),
    "broadcast batch 0": ((1, 5, HUGE_K), (0, HUGE_K, 5)),
    "vector @ n=0": ((HUGE_K,), (HUGE_K, 0)),
    "m=0 @ vector": ((0, HUGE_K), (HUGE_K,)),
}


def _empty_case_checks(name, dtype, **kw):
    """distmm's product of one EMPTY_HUGE_K case (and into an out of numpy's result's shape)
    identical to numpy's: type, dtype, shape; None, or what differs."""
    sa, sb = EMPTY_HUGE_K[name]
    a, b = _huge(sa, dtype), _huge(sb, dtype)
    want = np.matmul(a, b)
    for call in ("first", "again"):  # again: the call cache's entry (the local engine's)
        got = distmm.matmul(a, b, **kw)
        if not identical(got, want):
            return f"{name} {dtype} {call}: {type(got).__name__} {getattr(got, 'shape', None)}"
    out = np.empty(want.shape, want.dtype)
    if distmm.matmul(a, b, out=out, **kw) is not out:
        return f"{name} {dtype} out=: not out"
    return None


@pytest.mark.parametrize("dtype", ["float64", "int8", "bool", "object", "complex64"])
@pytest.mark.parametrize("name", list(EMPTY_HUGE_K))
def test_a_product_without_elements_is_numpys_whatever_k(name, dtype):
    """numpy makes a product with m, n or a batch dimension 0 at once, however long k is:
    an empty array of its dtype (was: a MemoryError from the planner, k too long to plan in
    tiles)."""
    assert _empty_case_checks(name, dtype) is None


def test_a_product_without_elements_keeps_the_call_checks():
    """Only k goes unplanned: a tile or backend the planner refuses is refused as ever,
    and a product with elements and that k still is (no plan can list it)."""
    a, b = _huge((0, HUGE_K), "float64"), _huge((HUGE_K, 5), "float64")
    with pytest.raises(ValueError):
        distmm.matmul(a, b, tile=(0, 4, 4))
    with pytest.raises(ValueError):
        distmm.matmul(a, b, backend="bogus")
    with pytest.raises(MemoryError):
        distmm.matmul(_huge((2, HUGE_K), "float64"), b)


@pytest.mark.parametrize("name", ["m=0", "n=0", "m=n=0"])
def test_gemm_without_elements_is_numpys_whatever_k(name):
    """gemm of an (m, k) @ (k, n) product with m or n 0 is numpy's ``alpha * (a @ b) + beta
    * c``, an empty array, however long k is (was: the planner's MemoryError)."""
    sa, sb = EMPTY_HUGE_K[name]
    a, b = _huge(sa, "float32"), _huge(sb, "float32")
    c = np.ones((sa[0], sb[1]), "float64")
    for kw in ({}, {"c": c, "beta": 2.0}, {"c": c, "alpha": 0.0, "beta": 1.0}):
        want = np.result_type(np.float32, *(() if "c" not in kw else (np.float64,)))
        got = distmm.gemm(a, b, **kw)
        assert type(got) is np.ndarray and got.shape == (sa[0], sb[1]), kw
        assert got.dtype == want, kw
    got = distmm.gemm(_huge(sa[::-1], "int16"), b, trans_a="T")
    assert got.shape == (sa[0], sb[1]) and got.dtype == np.float32


# -- array-likes with their own __array_wrap__ ---------------------------------------------


class Wrapping:
    """An array-like with ``__array__`` and its own ``__array_wrap__`` (no ndarray): numpy
    passes the product through the wrap; it records its arguments."""

    def __init__(self, x, name="w", priority=None):
        self.x, self.name = x, name
        if priority is not None:
            self.__array_priority__ = priority

    def __array__(self, dtype=None, copy=None):
        return self.x if dtype is None else self.x.astype(dtype)

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        return Wrapped(self.name, arr, context, return_scalar)


class Interfaced:
    """An array-like by ``__array_interface__`` alone, with its own ``__array_wrap__``."""

    def __init__(self, x, name="i"):
        self.x, self.name = x, name
        self.__array_interface__ = x.__array_interface__

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        return Wrapped(self.name, arr, context, return_scalar)


class Wrapped:
    """What a wrap made of the product: who wrapped it, the array and the context."""

    def __init__(self, name, arr, context, return_scalar):
        self.name, self.arr, self.return_scalar = name, np.array(arr, copy=True), return_scalar
        self.context = None if context is None else (context[0], tuple(map(id, context[1])),
                                                     context[2])


class NegativeSub(np.ndarray):
    """A subclass of negative priority: numpy 2 prefers a plain array's result (priority 0);
    numpy 1.x passes plain arrays over and wraps with it."""

    __array_priority__ = -5.0


class MoreNegativeSub(np.ndarray):
    __array_priority__ = -7.0


def _wrap_cases():
    """name -> (a, b, keywords): fresh operands each call."""
    rng = np.random.default_rng(7)
    x, y = rng.integers(-9, 9, (3, 4)), rng.integers(-9, 9, (4, 2))
    v, w = rng.integers(-9, 9, 4), rng.integers(-9, 9, 4)
    f = rng.standard_normal((4, 4))
    return {
        "wrapper @ ndarray": (Wrapping(x), y, {}),
        "ndarray @ wrapper": (x, Wrapping(y), {}),
        "wrapper @ list": (Wrapping(x), y.tolist(), {}),
        "two wrappers, the higher priority": (Wrapping(x, "lo", 1.0), Wrapping(y, "hi", 2.0),
                                              {}),
        "two wrappers, the first of equals": (Wrapping(x, "one"), Wrapping(y, "two"), {}),
        "negative-priority wrapper @ ndarray": (Wrapping(x, priority=-3.0), y, {}),
        "wrapper @ matrix": (Wrapping(x, priority=20.0), np.matrix(y), {}),
        "matrix @ wrapper": (np.matrix(x), Wrapping(y), {}),
        "vector @ vector": (Wrapping(v), w, {}),
        "object vector @ vector": (Wrapping(v.astype(object)), w.astype(object), {}),
        "batch": (Wrapping(np.stack([x, x])), y, {}),
        "dtype=": (Wrapping(f), f, {"dtype": np.float32}),
        "axes=": (Wrapping(f), f, {"axes": [(0, 1), (0, 1), (1, 0)]}),
        "subok=False": (Wrapping(x), y, {"subok": False}),
        "interface @ ndarray": (Interfaced(x), y, {}),
        "negative subclass @ wrapper": (x.view(NegativeSub), Wrapping(y, priority=-6.0), {}),
    }


def _negative_cases():
    """name -> (a, b, keywords): subclasses of negative priority beside plain arrays."""
    rng = np.random.default_rng(8)
    x, y = rng.integers(-9, 9, (3, 4)), rng.integers(-9, 9, (4, 2))
    v, w = rng.integers(-9, 9, 4), rng.integers(-9, 9, 4)
    return {
        "negative subclass @ ndarray": (x.view(NegativeSub), y, {}),
        "ndarray @ negative subclass": (x, y.view(NegativeSub), {}),
        "negative subclasses": (x.view(MoreNegativeSub), y.view(NegativeSub), {}),
        "negative subclass vectors": (v.view(NegativeSub), w, {}),
        "negative subclass @ list": (x.view(NegativeSub), y.tolist(), {}),
        "negative subclass with axes=": (x.view(NegativeSub), y.T.copy(),
                                          {"axes": [(0, 1), (1, 0), (0, 1)]}),
    }


def _described(r):
    """A result as comparable facts: the wrapper's name, context and flag, and the array."""
    if isinstance(r, Wrapped):
        return ("wrapped", r.name, r.context, r.return_scalar, r.arr.dtype, r.arr.tolist())
    return (type(r).__name__, np.asarray(r).dtype, np.shape(r), np.asarray(r).tolist())


def _wrap_differences(cases=_wrap_cases, **kw):
    """The names of the ``cases`` whose distmm result differs from numpy's."""
    differ = []
    for name, (a, b, keywords) in cases().items():
        want = _described(np.matmul(a, b, **keywords))
        got = _described(distmm.matmul(a, b, **keywords, **kw))
        if got != want:
            differ.append(f"{name}: numpy {want[:4]}, distmm {got[:4]}")
    return differ


def test_an_array_likes_own_wrap_gets_the_product_as_numpy_gives_it():
    """numpy passes the product through the ``__array_wrap__`` of an operand that is no
    ndarray (chosen by priority as a subclass's: context ``(matmul, operands, 0)``,
    ``return_scalar`` for vector @ vector) (was: a plain ndarray or a numpy scalar)."""
    assert _wrap_differences() == []


def test_a_negative_priority_subclass_beside_a_plain_array_wraps_as_this_numpy_does():
    """numpy 2 prefers a plain array (priority 0) to a subclass of negative priority: a plain
    result; numpy 1.x passes plain arrays over and wraps with the subclass (was: a plain
    ndarray, or a numpy scalar, under numpy 1.x)."""
    assert _wrap_differences(_negative_cases) == []


def test_an_array_likes_wrap_beside_out_is_not_applied():
    """With ``out=`` numpy returns ``out`` itself, whatever wraps the operands have."""
    a, b = Wrapping(np.ones((2, 3))), np.ones((3, 2))
    out = np.zeros((2, 2))
    assert distmm.matmul(a, b, out=out) is out
    assert identical(out, np.matmul(np.ones((2, 3)), b))


@pytest.mark.slow  # a cluster of two worker processes
def test_unusual_operands_on_a_dask_cluster_are_numpys(client):
    """The cases above on the Dask engine: products without elements whatever k is, and the
    wraps numpy applies."""
    differ = [why for name in EMPTY_HUGE_K for dtype in ("float64", "int8", "object")
              if (why := _empty_case_checks(name, dtype, engine="dask", client=client))]
    assert differ == []
    assert _wrap_differences(engine="dask", client=client) == []
    assert _wrap_differences(_negative_cases, engine="dask", client=client) == []
