"""Array-type dispatch: which family (numpy, cupy, dask) an operand belongs to.

Keyed by type with lazy registration, as dask's ``Dispatch`` does, so that
cupy and dask are imported only when such an array shows up.
"""
from __future__ import annotations

import numpy as np
from dask.utils import Dispatch

__all__ = ["array_family", "FAMILY_ORDER", "is_sparse", "unsupported"]

array_family = Dispatch("array_family")
# When operands mix families, the later one in this order wins: numpy < cupy < dask.
FAMILY_ORDER = ("numpy", "cupy", "dask")


@array_family.register(object)
def _family_other(x) -> str:
    return "numpy"  # lists, scalars, anything numpy.asarray takes


@array_family.register_lazy("cupy")
def _register_cupy():
    import cupy

    @array_family.register(cupy.ndarray)
    def _family_cupy(x) -> str:
        return "cupy"


@array_family.register_lazy("dask")
def _register_dask():
    import dask.array as da

    @array_family.register(da.Array)
    def _family_dask(x) -> str:
        return "dask"


@array_family.register(np.ndarray)
def _family_numpy(x) -> str:
    return "numpy"


def is_sparse(x) -> bool:
    """A scipy.sparse matrix or array (told by its module: scipy is not imported)."""
    return type(x).__module__.startswith("scipy.sparse") and hasattr(x, "toarray")


def unsupported(x, family: str) -> tuple[type[Exception], str] | None:
    """Why distmm cannot multiply ``x`` as an operand of ``family``, with numpy's exception
    type, or None. A scipy.sparse matrix is no array to numpy (``np.matmul`` reads it as a
    0-d object: ValueError). A dask array's chunks must be numpy or cupy arrays: the
    engines would drop a masked chunk's mask, and take other chunk types for device arrays
    (TypeError, as for an operand type a ufunc has no loop for)."""
    if is_sparse(x):
        return ValueError, (f"is a scipy.sparse {type(x).__name__}; distmm multiplies dense "
                            f"arrays: pass .toarray()")
    if family != "dask" or array_family(x) != "dask":
        return None
    meta = getattr(x, "_meta", None)
    chunk = type(meta)
    if chunk is np.ndarray or array_family(meta) == "cupy":
        return None
    what = f"{chunk.__module__}.{chunk.__name__}"
    if issubclass(chunk, np.ma.MaskedArray):
        hint = "their masks would be lost: fill them first (dask.array.ma.filled)"
    else:
        hint = "distmm's engines multiply numpy or cupy chunks"
    return TypeError, f"is a dask array of {what} chunks; {hint}"
