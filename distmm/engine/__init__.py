"""Engines turn a ``Request`` (operands, ``Plan``, backend) into work on a
runtime: ``local`` (threads in this process), ``dask`` (a distributed
cluster), ``mpi`` (SUMMA under mpirun). Engines know nothing of
kernels: they call an executor. ``get_engine`` picks one.
"""
from __future__ import annotations

import functools
import sys

# imported by distmm.config already (no import cost); bound under another name
# because importing the subpackage distmm.engine.dask rebinds "dask" here
from dask import config as _dask_config

from distmm.engine.base import Engine, Operands, Request

__all__ = ["Engine", "Operands", "Request", "get_engine", "ENGINES"]

ENGINES = ("auto", "local", "dask", "mpi")


def _default_client():
    """The default ``distributed`` client, or None. Cheap when there is none:
    a client made default sets dask's ``scheduler`` to ``dask.distributed``."""
    if "distributed" not in sys.modules or _dask_config.get("scheduler", None) != "dask.distributed":
        return None
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None


@functools.lru_cache(maxsize=64)
def _local_engine(threads: int | None) -> Engine:
    """One shared local engine per thread count (it holds nothing but the count)."""
    from distmm.engine.local import LocalEngine

    return LocalEngine(threads=threads)


def get_engine(name: str, *, family: str = "numpy", client=None,
               threads: int | None = None, retry_timeout: float = 60.0,
               operands=None, what: str = "matmul") -> Engine:
    """The engine for ``engine=name``.

    ``"auto"``: the Dask engine for dask operands, or when ``client`` is given
    or a default ``distributed`` client exists; the local engine otherwise.
    ``retry_timeout``: seconds the Dask engine retries after losing workers.
    ``operands``: the call's ``Operands`` (the Dask engine asks where dask operands'
    chunks are in the same round trip as its worker table). ``what``: the function the user
    called (``"matmul"``, ``"gemm"``), which the Dask engine's ``SchedulerLost`` names.

    Raises
    ------
    ValueError
        An unknown name; ``"dask"`` with host operands and no client.
    """
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {name!r}")
    if name == "mpi":
        from distmm.engine.mpi import MPIEngine

        return MPIEngine()
    if family == "dask":
        name = "dask"  # lazy operands give a lazy result, built as a graph
    if name == "auto":
        if client is None and family != "dask":
            client = _default_client()
        name = "dask" if family == "dask" or client is not None else "local"
    if name == "local":
        return _local_engine(threads)
    from distmm.engine.dask import DaskEngine

    return DaskEngine(client=client, required=family != "dask", retry_timeout=retry_timeout,
                      operands=operands, what=what)
