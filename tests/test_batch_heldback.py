"""``distmm matmul``, under ``mpirun -n P`` and in one process, on cases the batch suites do
not hold: a product whose C has 2**63 elements or more (zarr operands of that shape store only
their metadata) is refused by the free-space check in one line before any work, as a smaller
one too large for the disk is, with nothing left beside the target."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli


CASES = [
    ((2**33, 64), (64, 2**33), "c.npy"),           # C: 2**66 elements
    ((2**33, 64), (64, 2**33), "c.h5:C"),
    ((2**20, 2**22, 1), (1, 2**22), "c.zarr"),      # a stack's C: 2**64 elements
]


def _operands(tmp_path, a_shape, b_shape):
    zarr = pytest.importorskip("zarr")
    for name, shape in (("a.zarr", a_shape), ("b.zarr", b_shape)):
        zarr.open_array(str(tmp_path / name), mode="w", shape=shape, dtype="int8",
                        chunks=tuple(min(s, 2**20) for s in shape), fill_value=1)
    elements = int(np.prod([*a_shape[:-1], b_shape[-1]], dtype=object))
    assert elements >= 2**63  # numpy's int64 product of the shape wraps
    return tmp_path / "a.zarr", tmp_path / "b.zarr"


@pytest.mark.mpi
@pytest.mark.parametrize("a_shape,b_shape,out", CASES)
@pytest.mark.slow
def test_a_c_of_2_63_elements_or_more_is_refused_before_any_work(tmp_path, mpirun, a_shape,
                                                                 b_shape, out):
    """The batch path: it failed after staging with numpy's MemoryError."""
    a, b = _operands(tmp_path, a_shape, b_shape)
    r = mpirun(2, "-m", "distmm", "matmul", a, b, "-o", tmp_path / out, timeout=90)
    _refused(r, tmp_path, out)


@pytest.mark.parametrize("a_shape,b_shape,out", CASES)
@pytest.mark.slow
def test_one_process_refuses_a_c_of_2_63_elements_or_more_before_any_work(tmp_path, a_shape,
                                                                          b_shape, out):
    """One process: its space check wrapped too, and ``out=``'s shape check then said the
    shape did not match itself."""
    a, b = _operands(tmp_path, a_shape, b_shape)
    _refused(run_cli("matmul", a, b, "-o", tmp_path / out, timeout=90), tmp_path, out)


def _refused(r, tmp_path, out):
    lines = [x for x in r.stderr.splitlines() if x.startswith("distmm")]
    assert r.returncode == 1, r.stdout + r.stderr
    assert len(lines) == 1 and "needs" in lines[0] and "free" in lines[0], r.stderr
    assert out.split(":")[0] in lines[0], lines
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "b.zarr"]
