"""The CPUs a GPU rank runs on (``distmm.engine.mpi.cpus``), on the CPU.

The pure share (a one-CPU mask widened to the node-local rank's contiguous share of the
allowed CPUs; wider masks, no spare CPUs and bad ranks left alone), the kernel's CPU-list
format, and ``widen`` on a real process whose mask was narrowed to one CPU: every thread,
one started before the call included, runs on the share afterwards, and ``keep`` leaves
the mask as it was. Under a real ``mpiexec -n 2`` with Open MPI's default binding (one
core a rank for two ranks): each rank's mask after ``widen`` is what ``share`` says for
it, and the ranks' shares do not overlap.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distmm.engine.mpi.cpus import parse_cpu_list, share

affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity calls")


@pytest.mark.parametrize("allowed, size", [(range(64), 4), (range(10), 3), (range(3, 20, 2), 2),
                                           (range(5), 4)])
def test_shares_cover_the_allowed_cpus_once(allowed, size):
    got = [share([7], allowed, r, size) for r in range(size)]
    flat = [c for g in got for c in g]
    assert sorted(flat) == sorted(allowed) and len(flat) == len(set(flat))
    assert max(map(len, got)) - min(map(len, got)) <= 1
    for g in got:  # contiguous in the allowed list
        i = sorted(allowed).index(g[0])
        assert g == sorted(allowed)[i:i + len(g)]


@pytest.mark.parametrize("current, allowed, rank, size", [
    ([0, 1], range(64), 0, 4),  # a mask of several CPUs: someone's choice
    ([3], range(4), 3, 4),      # no CPU to spare
    ([3], range(2), 0, 2),
    ([0], range(64), 4, 4),     # a rank outside the node
    ([0], range(64), 0, 0),
])
def test_share_leaves_other_masks_alone(current, allowed, rank, size):
    assert share(current, allowed, rank, size) is None


def test_parse_cpu_list():
    assert parse_cpu_list("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    assert parse_cpu_list("4") == [4]
    assert parse_cpu_list("") == []


WIDEN = r"""
import os, sys, threading
from distmm.engine.mpi.cpus import allowed_cpus, widen
first = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {first})
started = threading.Event(); stop = threading.Event(); tid = []
def spin():
    tid.append(threading.get_native_id()); started.set(); stop.wait()
t = threading.Thread(target=spin); t.start(); started.wait()
assert os.sched_getaffinity(tid[0]) == {first}
got = widen(0, 1, sys.argv[1])
print("GOT", None if got is None else sorted(got))
print("MAIN", sorted(os.sched_getaffinity(0)))
print("THREAD", sorted(os.sched_getaffinity(tid[0])))
print("ALLOWED", sorted(allowed_cpus()))
stop.set(); t.join()
"""


def _lines(out: str) -> dict:
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()
            if line.split(" ", 1)[0] in ("GOT", "MAIN", "THREAD", "ALLOWED", "RANK", "ERR")}


@affinity
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_widen_moves_every_thread_to_the_share():
    r = subprocess.run([sys.executable, "-c", WIDEN, "auto"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    got = _lines(r.stdout)
    allowed = eval(got["ALLOWED"])
    assert len(allowed) >= 2
    # one rank on the node: its share is every allowed CPU, for the thread started before too
    assert eval(got["GOT"]) == eval(got["MAIN"]) == eval(got["THREAD"]) == allowed


@affinity
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_taskset_around_the_launch_stays_in_force():
    """The launching process bound to one CPU (``taskset`` around the launcher): that CPU
    is all the job may use, so nothing is widened."""
    cpu = min(os.sched_getaffinity(0))
    r = subprocess.run(["sh", "-c", f'exec "$0" -c "$1" auto & wait', sys.executable, WIDEN],
                       capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert r.returncode == 0, r.stderr[-3000:]
    got = _lines(r.stdout)
    assert got["GOT"] == "None" and eval(got["ALLOWED"]) == [cpu]
    assert eval(got["MAIN"]) == eval(got["THREAD"]) == [cpu]


@affinity
def test_keep_leaves_the_launchers_mask():
    r = subprocess.run([sys.executable, "-c", WIDEN, "keep"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    got = _lines(r.stdout)
    assert got["GOT"] == "None"
    assert len(eval(got["MAIN"])) == 1 and got["MAIN"] == got["THREAD"]


RANKS = r"""
import os
from mpi4py import MPI
from distmm.engine.mpi.binding import bind_rank
from distmm.engine.mpi.cpus import allowed_cpus, share, widen
comm = MPI.COMM_WORLD
before = sorted(os.sched_getaffinity(0))
b = bind_rank(comm, device_count=0, warn=False)
expect = share(before, allowed_cpus(), b.local_rank, b.local_size)
got = widen(b.local_rank, b.local_size, "auto")
after = sorted(os.sched_getaffinity(0))
rows = comm.gather((comm.rank, before, expect, got, after), root=0)
if comm.rank == 0:
    for row in rows:
        print("RANK", repr(row), flush=True)
"""


@affinity
@pytest.mark.mpi
def test_ranks_under_mpiexec_take_disjoint_shares(tmp_path, mpiexec, mpi_env):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {k: v for k, v in mpi_env.items() if k != "OMPI_MCA_rmaps_base_oversubscribe"}
    # Open MPI's own binding for two ranks: one core each (where the machine has two)
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True,
                       text=True, timeout=120, env=env)
    if r.returncode != 0 and "not enough slots" in (r.stdout + r.stderr).lower():
        pytest.skip("fewer than 2 slots for mpiexec -n 2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [eval(line.split(" ", 1)[1]) for line in r.stdout.splitlines()
            if line.startswith("RANK ")]
    assert [row[0] for row in rows] == [0, 1], r.stdout
    for rank, before, expect, got, after in rows:
        assert got == expect
        assert after == (sorted(expect) if expect is not None else before)
    widened = [set(row[4]) for row in rows if row[3] is not None]
    if len(widened) == 2:
        assert not widened[0] & widened[1]


GPU_RANKS = r"""
import os, sys
from mpi4py import MPI
import numpy as np
import distmm
from distmm.engine.mpi import DistArray
from distmm.engine.mpi.binding import bind_rank
from distmm.engine.mpi.cpus import allowed_cpus, share
from distmm.grid import make_grid
comm = MPI.COMM_WORLD
before = sorted(os.sched_getaffinity(0))
b = bind_rank(comm, warn=False)
expect = share(before, allowed_cpus(), b.local_rank, b.local_size)
import cupy
grid = make_grid(300, 200, 250, np.float64, ranks=comm.size)
rng = np.random.default_rng(3)
A, B = rng.standard_normal((300, 250)), rng.standard_normal((250, 200))
a = DistArray.from_array(cupy.asarray(A), comm, grid.a_layout)
bb = DistArray.from_array(cupy.asarray(B), comm, grid.b_layout)
c = distmm.matmul(a, bb)  # the MPI engine picks each rank's GPU, and its CPUs with it
full = c.gather(root=0)
after = sorted(os.sched_getaffinity(0))
rows = comm.gather((comm.rank, before, expect, after), root=0)
if comm.rank == 0:
    err = float(np.abs(cupy.asnumpy(full) - A @ B).max())
    print("ERR", err)
    for row in rows:
        print("RANK", repr(row), flush=True)
"""


@affinity
@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("setting", ["auto", "keep"])
def test_gpu_ranks_bound_to_one_core_take_their_share(tmp_path, mpiexec, mpi_env, setting):
    """Two GPU ranks under Open MPI's own binding (one core each): a product widens each
    to its share of the CPUs (``auto``), or leaves the core (``keep``); the result is right
    either way."""
    script = tmp_path / "gpu_ranks.py"
    script.write_text(GPU_RANKS)
    env = {k: v for k, v in mpi_env.items() if k != "OMPI_MCA_rmaps_base_oversubscribe"}
    env["DISTMM_MPI_CPUS"] = setting
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert float(_lines(r.stdout)["ERR"]) < 1e-9, r.stdout
    rows = [eval(line.split(" ", 1)[1]) for line in r.stdout.splitlines()
            if line.startswith("RANK ")]
    assert [row[0] for row in rows] == [0, 1], r.stdout
    for rank, before, expect, after in rows:
        if setting == "auto" and expect is not None:
            assert after == sorted(expect) and len(after) > 1, (rank, before, after)
        else:
            assert after == before, (rank, before, after)
    if setting == "auto" and all(row[2] is not None for row in rows):
        assert not set(rows[0][3]) & set(rows[1][3])
