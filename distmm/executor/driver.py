"""The CUDA driver library (``libcuda.so.1``) reached through ``ctypes``.

This module covers: loading the library once (``library``) and handing out its entry points
typed to return a ``CUresult`` (``entry``), for the calls cupy has no binding for, or holds
the interpreter lock through (``distmm.executor.ipc``, ``distmm.executor.tma``); ``entries``
types a caller's table of them at once.
It does *not* cover: what those calls do, or their errors (the callers').
"""
from __future__ import annotations

import ctypes

__all__ = ["library", "entry", "entries"]

_LIB: list = []  # [the loaded library, or None], loaded once


def library():
    """``libcuda.so.1``, or None where it does not load (no driver: a CPU machine)."""
    if not _LIB:
        try:
            _LIB.append(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            _LIB.append(None)
    return _LIB[0]


def entry(symbol: str, argtypes):
    """The library's ``symbol`` with ``argtypes``, returning an int (a ``CUresult``); a new
    function object per call, so two callers' typings never meet. None without the library
    or the symbol."""
    lib = library()
    if lib is None:
        return None
    try:
        fn = lib[symbol]
    except AttributeError:
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def entries(table: dict):
    """``{name: (symbol, argtypes)}`` as a namespace of typed entry points (``entry``), or
    None where the library or any of the symbols is missing."""
    import types

    typed = {name: entry(symbol, argtypes) for name, (symbol, argtypes) in table.items()}
    return None if None in typed.values() else types.SimpleNamespace(**typed)
