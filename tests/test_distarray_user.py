"""DistArray as a user's script under real ``mpiexec`` meets it: one rank that leaves the
script (an uncaught exception of its own, ``sys.exit``) between two collective calls, while
the others go on into ``gather``, ``to_file``, ``from_file`` or ``redistribute``.

With ``mpi-join-timeout`` set, the ranks left waiting end the job with one line naming the
call, as they do in ``distmm.matmul`` and ``DistArray.from_array``; the timeout of the
``mpirun`` fixture bounds a hang.
"""
from __future__ import annotations

import pytest

LEAVES = r'''
import sys
import numpy as np
from mpi4py import MPI
from distmm import DistArray
from distmm.grid import BlockLayout

comm = MPI.COMM_WORLD
call, tmp = sys.argv[1], sys.argv[2]
x = np.arange(12.0).reshape(3, 4)
if comm.rank == 0:
    np.save(f"{tmp}/x.npy", x)
d = DistArray.from_array(x)
comm.Barrier()
if comm.rank == comm.size - 1:
    raise RuntimeError("the user's own error on the last rank")
{"gather": lambda: d.gather(0),
 "to_file": lambda: d.to_file(f"{tmp}/out.npy"),
 "from_file": lambda: DistArray.from_file(f"{tmp}/x.npy"),
 "redistribute": lambda: d.redistribute(BlockLayout.single(x.shape, 0))}[call]()
print(f"rank {comm.rank} WENT ON", flush=True)
'''


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("call", ["gather", "to_file", "from_file", "redistribute"])
def test_a_rank_that_left_ends_the_job(call, tmp_path, mpirun):
    """The last rank raises its own error after from_array; the other two, waiting for it in
    ``call``, end the job at once with one line naming the rank and the call, without
    mpi-join-timeout (they waited for ever: only matmul, from_array and from_local were
    watched, then only until the timeout)."""
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    r = mpirun(3, script, call, tmp_path, timeout=60)
    assert r.returncode != 0 and "WENT ON" not in r.stdout, r.stdout + r.stderr[-3000:]
    assert (f"distmm: rank 2 of 3 ended before calling DistArray.{call}, which rank 0 waits "
            f"in: ending the job") in r.stderr, r.stderr[-3000:]
    assert "the user's own error on the last rank" in r.stderr
    assert not (tmp_path / "out.npy").exists()


REWRITTEN = r'''
import sys
import numpy as np
from mpi4py import MPI
from distmm import DistArray
from distmm.grid import BlockLayout

comm = MPI.COMM_WORLD
tmp = sys.argv[1]
x = np.arange(800.0 * comm.size).reshape(2 * comm.size, 400)
if comm.rank == 0:
    np.save(f"{tmp}/x.npy", x)
comm.Barrier()
d = DistArray.from_file(f"{tmp}/x.npy", layout=BlockLayout.grid(x.shape, comm.size, 1))
comm.Barrier()
if comm.rank == 0:  # the user's own file, written again once every rank has read it
    np.save(f"{tmp}/x.npy", np.zeros((1, 1)))
comm.Barrier()
d.local[0, 0] += 0.0  # the block is the rank's own memory
full = d.gather(0)
if comm.rank == 0:
    print("read then:", np.array_equal(full, x), flush=True)
'''


@pytest.mark.mpi
@pytest.mark.slow
def test_from_file_npy_blocks_are_read_not_mapped(tmp_path, mpirun):
    """Rows of a .npy file are read into each rank's memory by from_file: the file written
    again afterwards changes nothing (each block of whole rows was a view of the file's
    read-only memmap: the rewrite ended the ranks with SIGBUS, and the block could not be
    written to)."""
    script = tmp_path / "rewritten.py"
    script.write_text(REWRITTEN)
    r = mpirun(2, script, tmp_path, timeout=60)
    assert "read then: True" in r.stdout and r.returncode == 0, r.stdout + r.stderr[-3000:]
