"""``distmm matmul`` in one process (local and Dask engines), on cases the CLI suites do not
hold: an empty path for A, B or ``-o`` is refused by the parser in one line naming the
argument, before any file is opened, as ``--profile ''`` is."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli


@pytest.mark.parametrize("which", ["a", "b", "-o", "--output="])
def test_an_empty_operand_or_output_path_is_refused_naming_its_argument(tmp_path, which):
    """It was refused only by the suffix check, as ``unsupported file type '(no suffix)'
    for : use ...``: the line named neither the argument nor a file."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((5, 3)))
    np.save(tmp_path / "b.npy", rng.standard_normal((3, 4)))
    argv = {"a": ["", "b.npy", "-o", "c.npy"], "b": ["a.npy", "", "-o", "c.npy"],
            "-o": ["a.npy", "b.npy", "-o", ""], "--output=": ["a.npy", "b.npy", "--output="]}
    r = run_cli("matmul", *argv[which], cwd=tmp_path, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    name = {"a": "argument a:", "b": "argument b:"}.get(which, "argument -o/--output:")
    assert lines[0] == f"distmm matmul: error: {name} an empty path (see distmm matmul --help)", \
        lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]
