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

from distmm.startup import guard as _guard  # noqa: E402

with _guard():  # the distmm command ends a Ctrl-C or SIGTERM here with its one line
    from distmm.api import gemm, make_plan, matmul  # noqa: E402
    from distmm.engine.mpi.distarray import DistArray  # noqa: E402
    from distmm.executor.warmup import warmup  # noqa: E402
    from distmm.plan import Plan  # noqa: E402

__all__ = ["matmul", "gemm", "make_plan", "Plan", "DistArray", "warmup", "__version__"]
