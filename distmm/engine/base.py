"""The engine contract: one request in, the product out.

This module covers: ``Request``, the frozen description of one product that
``distmm.api`` builds after validating the operands (the operands, numpy's
result dtype, the resolved ``Plan``, the resolved backend and where the result
goes), and ``Engine``, the interface every engine implements: how many workers
it plans for, and running a request; ``replace_fast`` builds a request from a
cached one without the dataclass's ``__init__`` (``distmm.api``'s call cache).
It does *not* cover: validation (``distmm.api``), tiling (``distmm.plan``),
the per-tile work (``distmm.engine.tiles``) or kernels (``distmm.executor``).

Every engine reads the same request: it never re-plans, never re-resolves the
backend and never re-reads configuration.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from distmm.plan import Plan

__all__ = ["Operands", "Request", "Engine", "replace_fast"]


@dataclass(frozen=True)
class Operands:
    """Validated operands of one product, before 1-D promotion and batching.

    ``a`` and ``b`` are arrays of ``family`` ("numpy", "cupy" or "dask"), or
    2-D arrays that read by slices (memmaps, zarr arrays, h5py datasets) for
    the "numpy" family. ``a_vector``/``b_vector``: the operand was 1-D and got
    a leading/trailing 1. ``batch`` is the broadcast shape of the leading
    dimensions; ``m``, ``n``, ``k`` the trailing product.
    """

    a: Any
    b: Any
    family: str
    dtype: np.dtype
    a_vector: bool
    b_vector: bool
    batch: tuple[int, ...]
    m: int
    n: int
    k: int

    @property
    def a2(self):
        """``a`` with a 1-D operand promoted to a row, as numpy does."""
        return self.a[None, :] if self.a_vector else self.a

    @property
    def b2(self):
        """``b`` with a 1-D operand promoted to a column, as numpy does."""
        return self.b[:, None] if self.b_vector else self.b

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape engines produce: ``batch + (m, n)`` (1-D axes not yet removed)."""
        return tuple(self.batch) + (self.m, self.n)


@dataclass(frozen=True)
class Request:
    """One product for an engine to run.

    Attributes
    ----------
    operands : Operands
    plan : Plan
        Made once, by ``distmm.api``, for ``engine.workers(...)`` workers.
    backend : str
        The resolved executor backend (``distmm.executor.resolve_backend``):
        ``"numba"``, ``"blas"``, ``"raw"``, ``"cublas"``; ``"gpu"`` for the
        GPU executor's own per-shape choice; ``"auto"`` for engines whose
        workers pick their device themselves (a Dask cluster) and for small integer
        products (the CPU executor's choice of numpy's loop or the numba kernels).
    on_gpu : bool
        Whether an in-process executor runs on the GPU.
    out : array, optional
        Where tiles are written directly (same dtype and shape as the 2-D
        result, host memory or an on-disk array); ``None``: a new array.
    progress : bool, optional
        Show a progress bar; ``None``: on a terminal for long runs.
    report : str, optional
        Write a ``distributed.performance_report`` of the run to this file
        (cluster engines).
    """

    operands: Operands
    plan: Plan
    backend: str
    on_gpu: bool = False
    out: Any = None
    progress: bool | None = None
    report: str | None = None


def replace_fast(template, **changes):
    """``dataclasses.replace(template, **changes)`` for ``Operands`` and
    ``Request`` (frozen, no ``__post_init__``, no slots) without running
    ``__init__``, whose ``object.__setattr__`` per field costs a microsecond
    or two: ``distmm.api``'s call cache builds both on every call, from
    templates whose other fields are already checked."""
    obj = object.__new__(type(template))
    state = obj.__dict__
    state.update(template.__dict__)
    state.update(changes)
    return obj


class Engine(ABC):
    """Runs a ``Request`` on one runtime (threads, a Dask cluster, MPI ranks)."""

    #: the name ``engine=`` selects
    name: str = "abstract"

    @abstractmethod
    def workers(self, operands: Operands, *, on_gpu: bool) -> int:
        """How many workers the plan should be made for."""

    def plan_hints(self, operands: Operands, workers: int) -> dict:
        """Keyword arguments for ``distmm.plan.make_plan`` that this engine's
        operands suggest (an explicit or configured tile wins over them): the
        Dask engine returns its operands' chunk tile and a ``memory_budget``
        from its workers' ``memory_limit`` (the lower budget wins)."""
        return {}

    def check_operands(self, operands: Operands) -> None:
        """Raise where this engine cannot take ``operands`` (their family), before any work
        and also where no product is made; ``run`` checks the same."""

    def replayer(self, request: Request):
        """A callable ``f(a, b)`` that runs ``request`` again on new operands of
        the same signature (types, shapes, strides, dtypes) with nothing
        resolved again, returning the result, or None where the operands no
        longer fit it (the caller then resolves the call in full); or None when
        this engine has no such path for ``request``. Only for requests whose
        result depends on nothing but the signature (``distmm.api``'s call
        cache checks the configuration and the engine around it)."""
        return None

    @abstractmethod
    def run(self, request: Request) -> Any:
        """Compute the product: an array of ``request.operands.out_shape`` and
        ``request.plan.dtype`` (numpy, cupy or lazy dask, as the operands), or
        ``request.out`` filled."""
