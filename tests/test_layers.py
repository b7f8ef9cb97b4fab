"""The layers flow one way: api -> engine -> executor -> kernels, with the
planner a pure leaf; and kernels ship inside the installed package."""
from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest

import distmm

PKG = Path(distmm.__file__).resolve().parent

# A module may import only modules of its own level or lower.
LEVELS = {
    "distmm.kernels": 0,
    "distmm.plan": 0,
    "distmm.grid": 0,
    "distmm._arrays": 0,
    "distmm.registry": 0,
    "distmm.config": 0,
    "distmm.errors": 0,
    "distmm.executor": 1,
    "distmm.engine": 2,
    "distmm.engine.mpi": 2,
    "distmm.api": 3,
    "distmm": 3,
    "distmm.tune": 4,
    "distmm.trace": 4,
    "distmm.cli": 5,
    "distmm.__main__": 5,
}


def level(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LEVELS and (n > 1 or module == "distmm"):
            return LEVELS[name]
    raise KeyError(module)


def all_modules():
    yield "distmm", PKG / "__init__.py"
    for info in pkgutil.walk_packages([str(PKG)], prefix="distmm."):
        spec = info.module_finder.find_spec(info.name)
        if spec and spec.origin and spec.origin.endswith(".py"):
            yield info.name, Path(spec.origin)
    kernels = Path(__import__("distmm.kernels", fromlist=["x"]).__file__).parent
    for py in kernels.glob("*.py"):
        name = "distmm.kernels" + ("" if py.stem == "__init__" else "." + py.stem)
        yield name, py


def imported_distmm_modules(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("distmm"):
                    yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distmm"):
            yield node.module


def test_no_lower_layer_imports_a_higher_one():
    bad = []
    seen = 0
    for name, path in all_modules():
        seen += 1
        for target in imported_distmm_modules(path):
            if level(target) > level(name):
                bad.append(f"{name} (level {level(name)}) imports {target} (level {level(target)})")
    assert seen >= 10
    assert not bad, "\n".join(bad)


def test_planner_imports_no_runtime():
    src = (PKG / "plan.py").read_text()
    tree = ast.parse(src)
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"dask", "distributed", "cupy", "mpi4py", "numba", "distmm"}
    assert "open(" not in src


def test_kernels_ship_with_the_package():
    import distmm.kernels as k

    assert (Path(k.__file__).parent / "numba_gemm.py").exists()
    cu = sorted(k.CUDA_DIR.glob("*.cu"))
    if not cu:
        pytest.skip("no CUDA sources yet")
    assert all(p.stat().st_size > 0 for p in cu)
