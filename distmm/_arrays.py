"""Array-type dispatch: which family (numpy, cupy, dask) an operand belongs to.

Keyed by type with lazy registration, as dask's ``Dispatch`` does, so that
cupy and dask are imported only when such an array shows up.
"""
from __future__ import annotations

import numpy as np
from dask.utils import Dispatch

__all__ = ["array_family", "FAMILY_ORDER"]

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
