"""The layers flow one way: cli -> api -> engine -> executor -> kernels, with the
planner a pure leaf; no import cycles (function-level imports included); and kernels
ship inside the installed package."""
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
    "distmm.plan_pipeline": 0,
    "distmm.plan_blocks": 0,
    "distmm.plan_batch": 0,
    "distmm.plan_model": 0,
    "distmm.phases": 0,
    "distmm._arrays": 0,
    "distmm.config": 0,
    "distmm.errors": 0,
    "distmm.staging": 0,
    "distmm.direct_io": 0,
    "distmm.stripe_writer": 0,
    "distmm.threads": 0,
    "distmm.emulate": 0,
    "distmm.precision": 0,
    "distmm.startup": 0,
    "distmm.fpflags": 0,
    "distmm.nonfinite": 0,
    "distmm.jsonfile": 0,
    "distmm.hdf5_filters": 0,
    "distmm.executor": 1,
    "distmm.executor.registry": 1,
    "distmm.executor.tuning": 1,
    "distmm.executor.device": 1,
    "distmm.executor.cublas": 1,
    "distmm.executor.pipeline": 1,
    "distmm.engine": 2,
    "distmm.engine.mpi": 2,
    "distmm.api": 3,
    "distmm.ufunc_rules": 3,
    "distmm.out_arrays": 3,
    "distmm.deploy": 3,
    "distmm": 3,
    "distmm.cli": 4,
    "distmm.__main__": 4,
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


def imported_distmm_modules(path: Path, modules=frozenset()):
    """Every distmm module ``path`` imports, at any depth of the file (function bodies too).
    ``from pkg import name`` imports ``pkg.name`` when that is one of ``modules``, else
    ``pkg`` (the package's ``__init__``)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "distmm":
                    yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "distmm":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield sub if sub in modules else node.module


def import_graph() -> dict[str, set[str]]:
    """module -> the distmm modules it imports."""
    files = dict(all_modules())
    graph = {}
    for name, path in files.items():
        graph[name] = {t for t in imported_distmm_modules(path, frozenset(files))
                       if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_lower_layer_imports_a_higher_one():
    bad = []
    seen = 0
    for name, targets in import_graph().items():
        seen += 1
        for target in sorted(targets):
            if level(target) > level(name):
                bad.append(f"{name} (level {level(name)}) imports {target} (level {level(target)})")
    assert seen >= 10
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) >= 20 and graph["distmm.executor.gpu"]  # the graph is really read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a cycle through a function-level import is found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    src = "def f():\n    from distmm.executor import gpu\n"
    tmp = Path(__file__).with_name("_cycle_probe.py")
    try:
        tmp.write_text(src)
        assert "distmm.executor.gpu" in set(imported_distmm_modules(tmp, {"distmm.executor.gpu"}))
    finally:
        tmp.unlink()


@pytest.mark.parametrize("module", ["plan.py", "plan_pipeline.py"])
def test_planner_imports_no_runtime(module):
    src = (PKG / module).read_text()
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
