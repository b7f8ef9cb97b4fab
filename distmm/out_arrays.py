"""An ``out=`` of ``distmm.matmul`` that lives on disk: a zarr array or an h5py dataset.

This module covers: telling whether such an ``out`` is an operand's own array (``aliases``:
the same file, dataset or zarr array through another handle, as numpy computes an
overlapping ``out`` into a temporary), the refusals of such an ``out`` before any work
(``check``, ``refusals``: the MPI engine, no ``__setitem__``, a temporary larger than the
host's memory left), and writing the product into an ``out`` as numpy's loop output is cast
into it (``fill``). It does *not* cover numpy's own rules for ``out`` (its keywords, a
read-only ``out``: ``distmm.ufunc_rules``) or the engines writing tiles into ``out``
themselves (``distmm.api``'s ``_writes_direct``).
"""
from __future__ import annotations

import math
import os

import numpy as np

from distmm._arrays import array_family
from distmm.config import host_available
from distmm.startup import size_text

__all__ = ["aliases", "on_disk", "check", "refusals", "fill"]


def _file_key(path) -> tuple:
    """A file or folder as the file system knows it (device and inode: a symlink or a
    hard link is the same file), or its resolved path where it cannot be asked."""
    try:
        st = os.stat(path)
    except (OSError, TypeError, ValueError):
        return (os.path.realpath(str(path)),)
    return (st.st_dev, st.st_ino)


def _storage(x):
    """Where an array's elements live when another handle can reach them too: a memmap's
    file (a view of one too), an h5py dataset's file and name, a zarr array's store and
    path; None for anything else (memory is compared by address)."""
    while isinstance(x, np.ndarray):
        if isinstance(x, np.memmap) and getattr(x, "filename", None):
            return ("file",) + _file_key(x.filename)
        x = x.base
    module = type(x).__module__ or ""
    if module.startswith("h5py") and hasattr(x, "file") and hasattr(x, "name"):
        return ("hdf5",) + _file_key(x.file.filename) + (x.name,)
    if module.startswith("zarr") and hasattr(x, "store") and hasattr(x, "path"):
        root = getattr(x.store, "root", None)
        where = _file_key(root) if root is not None else (str(x.store),)
        return ("zarr",) + where + (str(x.path).strip("/"),)
    return None


def aliases(out, x) -> bool:
    """Whether ``x`` is ``out``'s own array on disk (the same object, or another handle on
    the same file, dataset or zarr array), which the engines would read while they write."""
    if x is out:
        return True
    key = _storage(out)
    return key is not None and key == _storage(x)


def _out_name(out) -> str:
    """``out`` as a refusal names it: its file and dataset, its zarr store and path."""
    module = type(out).__module__ or ""
    if module.startswith("h5py") and hasattr(out, "file"):
        return f"h5py dataset {out.file.filename}:{out.name}"
    if module.startswith("zarr") and hasattr(out, "store"):
        path = str(getattr(out, "path", "")).strip("/")
        return f"zarr array {out.store}" + (f" (path {path!r})" if path else "")
    return f"{type(out).__module__}.{type(out).__name__}"


def on_disk(out) -> bool:
    """An ``out`` that is no array in memory: a zarr array, an h5py dataset."""
    return out is not None and not isinstance(out, np.ndarray) and array_family(out) == "numpy"


def check(out, ops, engine: str, direct: bool) -> None:
    """An on-disk ``out`` (``on_disk``) of the product of ``ops`` (``distmm.engine.Operands``)
    on ``engine``, checked before any work. It is written with ``out[...] = product``, the
    product cast to its dtype (numpy's ``casting`` rule was checked with the operands) and
    broadcast to its shape, after the engine computed it into a temporary, unless the engine
    writes its tiles into ``out`` itself (``direct``; never where ``out`` is an operand's file
    too, as numpy computes an overlapping ``out`` into a temporary)."""
    size, why = 0, ""
    if engine == "mpi" or not direct:
        size = max(math.prod(ops.batch), 1) * ops.m * ops.n * ops.dtype.itemsize
        if np.dtype(out.dtype) != ops.dtype:  # and its copy cast to out's dtype
            size += math.prod(tuple(out.shape)) * np.dtype(out.dtype).itemsize
        alias = [n for n, x in (("a", ops.a), ("b", ops.b)) if aliases(out, x)]
        why = f" (it is also operand {alias[0]})" if alias else ""
    refusals(out, engine, size, why)


def refusals(out, engine: str, size: int, why: str = "") -> None:
    """The refusals of an on-disk ``out``: on the MPI engine (each rank gets the whole
    product, and would write the same file), one that cannot be assigned to, and a
    temporary of ``size`` bytes larger than the memory this host has left (refused rather
    than run out of memory after the work)."""
    name = _out_name(out)
    if engine == "mpi":
        raise TypeError(f"matmul: out= {name} is not supported on the MPI engine (every rank "
                        f"gets the whole product): pass out=None and write it from one rank")
    if not hasattr(type(out), "__setitem__"):
        raise TypeError(f"matmul: out= {name} cannot be written (it has no __setitem__)")
    if size and size > (available := host_available()):
        raise MemoryError(f"matmul: the product is computed into a temporary of "
                          f"{size_text(size)} before out= {name} is written{why}, more than "
                          f"this host's {size_text(available)} available")


def fill(out, result) -> None:
    """The product into ``out`` as numpy's loop output is cast into it (``casting=`` was
    checked with the operands): a numpy or cupy array by ``copyto``, an on-disk array by
    one assignment of the product cast to its dtype and broadcast to its shape."""
    if array_family(out) == "cupy":
        import cupy

        cupy.copyto(out, cupy.asarray(result), casting="unsafe")
    elif isinstance(out, np.ndarray):
        np.copyto(out, np.asarray(result), casting="unsafe")
    else:
        value = np.asarray(result).astype(np.dtype(out.dtype), copy=False)
        out[...] = np.broadcast_to(value, tuple(out.shape))
