"""bench/mpi_blocks.py makes the same matrix whatever the ranks and layout.

The blocks of every grid the planner can pick for 1-4 ranks (ragged, odd sizes), put
together, equal the matrix made whole; chosen rows equal the whole matrix's rows; A and B
and different seeds differ; and under a real mpiexec (3 ranks) each rank's own blocks,
gathered through DistArray, equal the whole matrix made in this process.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from distmm.grid import grid_shapes, make_grid

ROOT = Path(__file__).resolve().parent.parent

# CI runs the tests from a copy of tests/ alone (against the installed package): no bench/ there
if not (ROOT / "bench" / "mpi_blocks.py").is_file():
    pytest.skip("bench/ is not beside this tests/ folder", allow_module_level=True)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import mpi_blocks  # noqa: E402
from bench.mpi_blocks import A, B  # noqa: E402


def assemble(which, layout, dtype, seed):
    out = np.full(layout.shape, np.nan, dtype=dtype)
    for rank in {r for row in layout.owners for r in row}:
        r0, r1, c0, c1 = layout.local_bounds(rank)
        out[r0:r1, c0:c1] = mpi_blocks.block(which, layout.shape, (r0, r1, c0, c1), dtype, seed,
                                             threads=2)
    return out


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_blocks_of_every_grid_make_the_same_matrix(ranks, dtype):
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh each run
    m, n, k = 97, 61, 83
    whole_a = mpi_blocks.full(A, (m, k), dtype, seed, threads=1)
    whole_b = mpi_blocks.full(B, (k, n), dtype, seed, threads=3)
    assert whole_a.dtype == dtype and np.isfinite(whole_a).all()
    assert -1 <= whole_a.min() and whole_a.max() < 1 and abs(whole_a.mean()) < 0.1
    for shape in grid_shapes(ranks):
        g = make_grid(m, n, k, dtype, ranks=ranks, grid=shape)
        assert np.array_equal(assemble(A, g.a_layout, dtype, seed), whole_a), shape
        assert np.array_equal(assemble(B, g.b_layout, dtype, seed), whole_b), shape


def test_rows_and_seeds():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    whole = mpi_blocks.full(A, (40, 4100), "float64", seed)
    rows = np.array([0, 3, 39, 17])
    assert np.array_equal(mpi_blocks.rows(A, (40, 4100), rows, 5, 4099, "float64", seed),
                          whole[rows, 5:4099])
    assert not np.array_equal(mpi_blocks.full(B, (40, 4100), "float64", seed), whole)
    assert not np.array_equal(mpi_blocks.full(A, (40, 4100), "float64", seed + 1), whole)
    assert mpi_blocks.block(A, (40, 4100), (3, 3, 0, 7), "float32").shape == (0, 7)
    with pytest.raises(ValueError):
        mpi_blocks.block(A, (40, 4100), (0, 41, 0, 1), "float64")
    assert list(mpi_blocks.sample_rows(10)) == list(range(10))
    picked = mpi_blocks.sample_rows(1000)
    assert len(set(picked)) == 64 and picked.max() < 1000


SCRIPT = r"""
import sys, numpy as np
from mpi4py import MPI
from bench import mpi_blocks
from distmm.engine.mpi import DistArray
from distmm.grid import make_grid
comm = MPI.COMM_WORLD
m, n, k, seed = (int(x) for x in sys.argv[1:5])
g = make_grid(m, n, k, "float64", ranks=comm.size)
a = DistArray(mpi_blocks.block(0, (m, k), g.a_layout.local_bounds(comm.rank), "float64", seed),
              g.a_layout, comm)
full = a.gather(root=0)
if comm.rank == 0:
    np.save(sys.argv[5], full)
"""


@pytest.mark.mpi
def test_ranks_make_only_their_blocks_of_the_same_matrix(tmp_path, mpirun):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    script = tmp_path / "blocks.py"
    script.write_text(SCRIPT)
    out = tmp_path / "a.npy"
    r = mpirun(3, script, 301, 7, 255, seed, out, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert np.array_equal(np.load(out), mpi_blocks.full(A, (301, 255), "float64", seed))
