"""distmm: distributed matrix multiplication.

A planner splits large matrices into tiles (``distmm.plan``); an engine runs
them in-process, on a Dask cluster or under mpirun (``distmm.engine``); an
executor multiplies tiles with distmm's numba or CUDA kernels, BLAS or cuBLAS
(``distmm.executor``). ``matmul`` and ``gemm`` follow numpy's and BLAS's
semantics.
"""
from __future__ import annotations

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"


def _alias_source_kernels() -> None:
    # An install maps the top-level kernels/ folder to distmm.kernels; in a bare
    # source checkout (PYTHONPATH=repo) the same folder is loaded under that name.
    if _ilu.find_spec("distmm.kernels") is not None:
        return
    src = _Path(__file__).resolve().parent.parent / "kernels"
    spec = _ilu.spec_from_file_location("distmm.kernels", src / "__init__.py",
                                        submodule_search_locations=[str(src)])
    if spec is None:  # pragma: no cover - broken checkout
        return
    module = _ilu.module_from_spec(spec)
    _sys.modules["distmm.kernels"] = module
    spec.loader.exec_module(module)


_alias_source_kernels()

# The public names load on first use (PEP 562), so that ``import distmm`` is cheap and the
# command line can take a Ctrl-C during its imports with its one line (``distmm.cli.main``).
_PUBLIC = {"matmul": "distmm.api", "gemm": "distmm.api", "make_plan": "distmm.api",
           "Plan": "distmm.plan", "DistArray": "distmm.engine.mpi.distarray",
           "warmup": "distmm.executor.warmup"}

__all__ = ["matmul", "gemm", "make_plan", "Plan", "DistArray", "warmup", "__version__"]


def __getattr__(name: str):
    import importlib

    if name in _PUBLIC:
        for public, module in _PUBLIC.items():  # all at once, as an eager import did
            globals()[public] = getattr(importlib.import_module(module), public)
        return globals()[name]
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:  # a submodule not imported yet: ``import distmm; distmm.executor``
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
