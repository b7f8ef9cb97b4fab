"""numpy's ufunc protocol around ``matmul``, for operands that are not plain arrays.

This module covers what ``numpy.matmul`` does before and after its loop: the errors of
its keywords alone, raised before it reads an operand (``keyword_errors``), keywords whose
default is no value (``NO_VALUE``: numpy refuses ``axes=None``), an ``out``
given as a one-element tuple, ``axes`` naming where the matrices lie, operands that
override ``__array_ufunc__`` (they decide the call: numpy hands it to them), an ``out``
with its own ``__array_wrap__`` (numpy passes the product through it), ndarray
subclasses (``np.matrix``, masked arrays, a user's own) and array-likes with their own
``__array_wrap__``, whose result is wrapped by the ``__array_wrap__`` numpy picks, and
the memory layout ``order="K"`` gives a stack's result (``k_layout``). It does *not* cover
the product itself (``distmm.api``).
"""
from __future__ import annotations

import numbers

import numpy as np

from distmm._arrays import array_family, is_sparse

__all__ = ["NO_VALUE", "given_keywords", "keyword_errors", "single_out", "overrides", "wraps_out",
           "find_wrap", "apply_wrap", "is_subclass", "wraps_like_subclass", "base",
           "core_axes_last", "k_layout"]

_NDARRAY_UFUNC = np.ndarray.__array_ufunc__
_SCALAR_PRIORITY = -1000000.0  # numpy's NPY_SCALAR_PRIORITY


class _NoValue:
    """The default of ``axes``, ``axis`` and ``keepdims`` (numpy's ``<no value>``): a keyword
    not given, told from one given as None, which numpy refuses for them (TypeError)."""

    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE = _NoValue()


def given_keywords(**keywords) -> dict:
    """The keywords among ``axes``, ``axis`` and ``keepdims`` that were given (None too)."""
    return {k: v for k, v in keywords.items() if v is not NO_VALUE}


class _Unconverted(Exception):
    """Raised by ``_Unconvertible.__array__``: numpy has parsed its keywords."""


class _Unconvertible:
    """An operand that stops numpy where it first converts its operands."""

    def __array__(self, *args, **kwargs):
        raise _Unconverted


def keyword_errors(out, dtype, signature, axes, axis) -> None:
    """numpy's errors from its keywords alone, raised before it reads any operand or
    ``out``'s array (a read-only ``out``, a cast, a shape): ``axis`` with ``axes``, an ``out``
    tuple of another length, ``dtype`` with ``signature``, a ``dtype`` or ``signature`` it
    does not parse. numpy itself is asked, in its own order, with operands that stop it at
    their conversion (and ``out`` as a tuple of as many Nones); ``axes`` and ``axis`` are
    passed on where given (``NO_VALUE``: not given), None too."""
    named = {k: v for k, v in (("dtype", dtype), ("signature", signature)) if v is not None}
    named.update(given_keywords(axes=axes, axis=axis))
    if isinstance(out, tuple) and len(out) != 1:
        named["out"] = (None,) * len(out)
    if not named:
        return  # numpy's defaults: nothing to parse
    try:
        np.matmul(_Unconvertible(), _Unconvertible(), **named)
    except _Unconverted:
        pass


def single_out(out):
    """``out`` as one array or None: numpy also takes a tuple of one (``(arr,)``,
    ``(None,)``) and refuses any other length with this ValueError, and a read-only
    array before it looks at anything else."""
    if isinstance(out, tuple):
        if len(out) != 1:
            raise ValueError("The 'out' tuple must have exactly one entry per ufunc output")
        out = out[0]
    if out is not None and (not hasattr(out, "shape") or not hasattr(out, "dtype")
                            or isinstance(out, np.generic)  # a numpy scalar: not an array
                            or is_sparse(out)):  # numpy: "return arrays must be of ArrayType"
        raise TypeError(f"matmul: out must be a dense array, got {type(out).__name__}")
    if out is not None and array_family(out) == "dask":  # numpy hands it to dask: no out=
        raise TypeError("matmul: out cannot be a dask array (dask arrays are immutable; "
                        "the result of dask operands is a lazy dask array)")
    if getattr(getattr(out, "flags", None), "writeable", True) is False or _read_only_file(out):
        raise ValueError("matmul: output array is read-only")  # numpy's first check of out
    return out


def _read_only_file(out) -> bool:
    """A zarr array opened read-only, or an h5py dataset of a file opened read-only:
    refused as numpy refuses a read-only array, before any work."""
    module = type(out).__module__ or ""
    if module.startswith("zarr"):
        return getattr(out, "read_only", False) is True
    if module.startswith("h5py") and hasattr(out, "file"):
        return out.file.mode == "r"
    return False


def _host(x) -> bool:
    """An object numpy itself would take (not a cupy or dask array, which distmm runs in
    their own families, nor distmm's DistArray)."""
    return array_family(x) == "numpy" and type(x).__name__ != "DistArray"


def overrides(*objs) -> bool:
    """Whether numpy would hand ``matmul`` over to an operand's own ``__array_ufunc__``
    (or refuse it, for ``__array_ufunc__ = None``)."""
    for x in objs:
        if x is None or type(x) is np.ndarray or not _host(x):
            continue
        cls_ufunc = getattr(type(x), "__array_ufunc__", _NDARRAY_UFUNC)
        if cls_ufunc is not _NDARRAY_UFUNC and not isinstance(x, (numbers.Number, np.generic)):
            return True
    return False


def wraps_out(out) -> bool:
    """Whether numpy hands the product to ``out``'s own ``__array_wrap__``: an ndarray
    subclass that defines one (a masked array, which sets ``out.mask`` from the operands'
    masks, or raises where they do not broadcast). ``np.memmap``'s returns ``out`` itself."""
    return is_subclass(out) and type(out).__array_wrap__ is not np.ndarray.__array_wrap__


def is_subclass(x) -> bool:
    """An ndarray whose type is a subclass (``np.matrix``, masked, a user's own) other than
    ``np.memmap``: the engines read a memmap's file themselves, and numpy's wrap of a
    product of memmaps is a plain array, as the engines return."""
    return isinstance(x, np.ndarray) and type(x) is not np.ndarray and not isinstance(x, np.memmap)


def wraps_like_subclass(x) -> bool:
    """An array-like that is no ndarray (an object with ``__array__``,
    ``__array_interface__`` or a buffer) but has its own ``__array_wrap__``: numpy converts
    it and passes the product through that wrap, chosen among the operands' as a subclass's
    is (``find_wrap``). Not scalars (numpy passes a numpy scalar's wrap over), cupy or dask
    arrays, or distmm's DistArray."""
    return (x is not None and not isinstance(x, (np.ndarray, np.generic, numbers.Number, str,
                                                 bytes))
            and _host(x) and callable(getattr(x, "__array_wrap__", None)))


def base(x):
    """A subclass's data as a plain ndarray view (no copy), an array-like with its own
    ``__array_wrap__`` (``wraps_like_subclass``) as numpy converts it; anything else as it
    is."""
    return np.asarray(x) if is_subclass(x) or wraps_like_subclass(x) else x


def find_wrap(*inputs):
    """The ``__array_wrap__`` numpy applies to the result of these inputs, or None for a
    plain ndarray: the first input of the highest ``__array_priority__``, a subclass
    preferred over a plain array at the same priority 0, scalars lowest (numpy's
    ``npy_find_array_wrap``). numpy 1.x passes plain arrays and scalars over: the first
    other input of the highest priority that has a wrap, a negative priority too."""
    if _NUMPY_1:
        return _find_wrap_numpy_1(inputs)
    wrap, priority, seen = None, 0.0, False
    for x in inputs:
        if type(x) is np.ndarray:
            if not seen or priority < 0.0:
                wrap, priority, seen = None, 0.0, True
        elif isinstance(x, (numbers.Number, np.generic, str, bytes)):
            if not seen or priority < _SCALAR_PRIORITY:
                wrap, priority, seen = None, _SCALAR_PRIORITY, True
        else:
            new = getattr(x, "__array_wrap__", None)
            if new is None:
                continue
            current = float(getattr(x, "__array_priority__", 0.0))
            if not seen or priority < current or (current == 0.0 and wrap is None):
                wrap, priority, seen = new, current, True
    return wrap


def _find_wrap_numpy_1(inputs):
    """numpy 1.x's choice (``_find_array_method``): exact ndarrays and scalars are passed
    over; of the other inputs with a callable ``__array_wrap__``, the first of the highest
    ``__array_priority__`` (0 where none is set); None where no input has one."""
    wrap, priority = None, 0.0
    for x in inputs:
        if type(x) is np.ndarray or isinstance(x, (numbers.Number, np.generic, str, bytes)):
            continue
        new = getattr(x, "__array_wrap__", None)
        if not callable(new):
            continue
        current = float(getattr(x, "__array_priority__", 0.0))
        if wrap is None or current > priority:
            wrap, priority = new, current
    return wrap


_NUMPY_1 = np.lib.NumpyVersion(np.__version__) < "2.0.0"


def apply_wrap(wrap, result, inputs, dtype=None):
    """``result`` (an array, or the scalar of a vector-vector product) wrapped as numpy
    wraps a ufunc's result: ``wrap(array, (np.matmul, inputs, 0), return_scalar)``.
    ``dtype``: the product's, for a scalar ``result``: an object product's element (a
    Python float, a Fraction) is wrapped as the 0-d object array numpy's loop made."""
    if dtype is not None and np.dtype(dtype) == object and not isinstance(result, np.ndarray):
        arr = np.empty((), object)
        arr[()] = result
    else:
        arr = np.asarray(result)
    context = (np.matmul, tuple(inputs), 0)
    if _NUMPY_1:  # numpy 1.x calls __array_wrap__(array, context): no return_scalar
        return wrap(arr, context)
    return wrap(arr, context, arr.ndim == 0)


def core_axes_last(a, b, out, axes, axis, keepdims=NO_VALUE):
    """``matmul(..., axes=)`` as a product of operands whose matrix axes are their last:
    ``(a, b, out, back)``, each operand (and ``out``) with its core axes moved to the end
    (views), and ``back(result)`` moving the result's core axes to where ``axes`` puts
    them (``out`` itself when one was given). The result's entry of ``axes`` counts in
    ``out``'s own dimensions where there is one (numpy broadcasts a result into an ``out``
    of more). numpy checks ``axes``, ``axis`` and ``keepdims`` first (``NO_VALUE``: not
    given), on one-element stand-ins of the operands' (and ``out``'s) dimensions, and raises
    its own errors: always for ``axis`` and ``keepdims``, and for ``axes=None``."""
    nd_a, nd_b = np.ndim(a), np.ndim(b)
    kw = given_keywords(axes=axes, axis=axis, keepdims=keepdims)
    if out is not None:
        kw["out"] = np.zeros((1,) * np.ndim(out))
    probe = np.matmul(np.zeros((1,) * nd_a), np.zeros((1,) * nd_b), **kw)
    n_out = int(nd_a >= 2) + int(nd_b >= 2)
    entries = list(axes)

    def core(entry, ndim):
        t = (entry,) if isinstance(entry, numbers.Integral) else tuple(entry)
        return tuple(int(x) % ndim for x in t) if ndim else ()

    def to_end(x, axes_):
        return np.moveaxis(x, axes_, tuple(range(-len(axes_), 0))) if axes_ else x

    a_core, b_core = core(entries[0], nd_a), core(entries[1], nd_b)
    nd_out = np.ndim(probe)  # out's own when given: the probe wrote into its stand-in
    o_core = (core(entries[2], nd_out) if len(entries) > 2
              else tuple(range(nd_out - n_out, nd_out)))
    a, b = to_end(a, a_core), to_end(b, b_core)
    if out is not None:
        original = out

        def back(result):
            return original

        return a, b, to_end(out, o_core), back

    def back(result):
        if not o_core or np.ndim(result) == 0:
            return result
        return np.moveaxis(result, tuple(range(-len(o_core), 0)), o_core)

    return a, b, None, back


def k_layout(result, a, b):
    """``result`` (C-ordered, numpy's values of ``a @ b``) in the memory layout numpy's
    ``order="K"`` gives it: the batch axes in the order of the operands' strides (a stack
    of transposed or permuted batches keeps that order), the matrices C-ordered innermost.
    numpy's iterator decides, asked on tiny operands whose batch axes have the same shapes
    and the same order of strides (broadcast and reversed axes too) as ``a`` and ``b``;
    ``result`` itself where that is C order (one batch axis, C-ordered operands)."""
    core = sum(np.ndim(x) >= 2 for x in (a, b))  # a vector operand's axis is not C's
    if not isinstance(result, np.ndarray) or result.ndim - core < 2:
        return result
    operands = [x for x in (a, b) if isinstance(x, np.ndarray) and x.ndim >= 3]
    if all(x.flags.c_contiguous for x in operands):
        return result
    probe = np.matmul(*(_batch_probe(x) for x in (a, b)))
    batch = probe.ndim - core
    if probe.ndim != result.ndim or probe.flags.c_contiguous:
        return result
    order = sorted(range(batch), key=lambda i: (-abs(probe.strides[i]), i))
    order += list(range(batch, probe.ndim))
    laid = np.empty([result.shape[i] for i in order], result.dtype).transpose(np.argsort(order))
    laid[...] = result
    return laid


def _batch_probe(x):
    """A ``batch + (1, 1)`` float array whose batch axes have ``x``'s shape, and strides in
    the order of ``x``'s (zero where ``x`` broadcasts, negative where it runs backwards);
    ``x``'s own number of axes, each of size one, for an operand without batch axes. An
    operand that is not an ndarray (a list, an on-disk array) is numpy's C-ordered copy."""
    shape = tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)
    if len(shape) < 3:
        return np.zeros((1,) * len(shape))
    if not isinstance(x, np.ndarray):
        return np.zeros(shape[:-2] + (1, 1))
    shape, strides = shape[:-2], x.strides[:-2]
    real = [i for i in range(len(shape)) if shape[i] > 1 and strides[i] != 0]
    outer = sorted(real, key=lambda i: (-abs(strides[i]), i))
    probe = np.zeros([shape[i] for i in outer] + [1, 1])
    probe = probe.transpose([outer.index(i) for i in real] + [len(real), len(real) + 1])
    for i in range(len(shape)):  # the axes of size 1 and the broadcast ones, as size 1
        if i not in real:
            probe = np.expand_dims(probe, i)
    probe = np.broadcast_to(probe, shape + (1, 1))
    flips = tuple(i for i in real if strides[i] < 0)
    return np.flip(probe, flips) if flips else probe
