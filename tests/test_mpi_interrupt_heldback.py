"""The MPI engine's Python API when one rank is interrupted or fails alone (real mpiexec, CPU).

A Ctrl-C (SIGINT) at one rank while the others wait for it in a collective call of
``distmm.matmul(..., engine="mpi")`` or of a ``DistArray`` ends every rank within seconds,
with one line naming the rank and status 130, not a traceback and a job that waits for ever
(the interrupted rank's ``MPI_Finalize`` waits for the others, which wait for it). A
``MemoryError`` on one rank alone where the result is made is raised on every rank, and the
process goes on: a later product in it matches numpy, as after a ``ValueError`` that one
rank's input caused. Every launch has a hard timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ended, pause_at, run_rank_script

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

#: ``distmm.matmul`` on operands every rank holds; the product's result is checked
_MATMUL = """
import numpy as np, distmm
from mpi4py import MPI
rng = np.random.default_rng(5)
a, b = rng.standard_normal((120, 90)), rng.standard_normal((90, 70))
c = distmm.matmul(a, b, engine="mpi")
print("rank", MPI.COMM_WORLD.rank, "finished", np.allclose(c, a @ b), flush=True)
"""

#: ``DistArray`` products, gathered onto rank 0; the last rank waits for ``go`` before its
#: gather (the others wait for it there), after rank 0 has said it is about to gather
_DISTARRAY = """
import os, sys, time, numpy as np, distmm
from mpi4py import MPI
comm, folder = MPI.COMM_WORLD, sys.argv[1]
rng = np.random.default_rng(6)
a, b = rng.standard_normal((120, 90)), rng.standard_normal((90, 70))
c = distmm.matmul(distmm.DistArray.from_array(a), distmm.DistArray.from_array(b))
if comm.rank == 0:
    open(os.path.join(folder, "gathering"), "w").close()
if comm.rank == comm.size - 1:
    open(os.path.join(folder, "paused"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.01)
full = c.gather(root=0)
print("rank", comm.rank, "finished", flush=True)
"""


def _launch(mpiexec, mpi_env, ranks: int, script: Path, *args, pythonpath=None):
    env = dict(mpi_env, OMPI_MCA_btl=os.environ.get("OMPI_MCA_btl", "^ofi"))
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath) + os.pathsep + env["PYTHONPATH"]
    return subprocess.Popen([mpiexec, "-n", str(ranks), "--oversubscribe", sys.executable,
                             str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _rank(proc, rank: int):
    import psutil

    deadline = time.time() + 30
    while time.time() < deadline:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if p.environ().get("OMPI_COMM_WORLD_RANK") == str(rank):
                    return p
            except psutil.Error:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank}")


def _wait_for(proc, *paths: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.time() > deadline:
            _finish(proc, 1)
            raise AssertionError(f"{paths} never made")
        time.sleep(0.02)


def _finish(proc, timeout: float):
    """``(status, stderr, seconds)``; a job still running after ``timeout`` s is killed and
    fails the test (a hang)."""
    start = time.time()
    _, err = ended(proc, timeout)
    return proc.returncode, err, time.time() - start


def _interrupt_rank_0(proc, folder) -> tuple[int, str]:
    """SIGINT at rank 0 half a second after the held rank paused, then that rank let go
    (``folder / "go"``); the job's status and stderr, once every rank ended (within seconds,
    not at the timeout)."""
    time.sleep(0.5)
    _rank(proc, 0).send_signal(signal.SIGINT)
    time.sleep(0.5)
    (folder / "go").touch()
    status, err, took = _finish(proc, 30)
    assert took < 10, (took, err)
    return status, err


def _assert_interrupted(status: int, err: str, rank: int, ranks: int, where: tuple) -> None:
    assert status == 130, err
    assert "Traceback" not in err, err
    # Open MPI's own notes about MPI_Abort come around it, through the launcher
    lines = [line[line.index("distmm:"):] for line in err.splitlines() if "distmm:" in line]
    assert lines in ([f"distmm: rank {rank} of {ranks} interrupted {w}; calling MPI_Abort"]
                     for w in where), err


@pytest.mark.parametrize("ranks", [2, 3])
def test_sigint_while_the_others_wait_in_the_gather_ends_the_job(tmp_path, mpiexec, mpi_env,
                                                                 ranks):
    """Rank 0 waits in the result's gather for the last rank (held before it): SIGINT at
    rank 0 ends every rank with one line and 130, once the held rank is let go."""
    script = tmp_path / "matmul.py"
    script.write_text(_MATMUL)
    folder = tmp_path / "pause"
    folder.mkdir()
    # join's calls on a rank: distmm.matmul's agreement (1), then the gather's (2)
    pause_at(folder, "distmm.engine.mpi.join", "join", rank=ranks - 1, call=2)
    proc = _launch(mpiexec, mpi_env, ranks, script, pythonpath=folder)
    _wait_for(proc, folder / "paused")
    status, err = _interrupt_rank_0(proc, folder)  # rank 0 has reached the gather's barrier
    # in the gather's barrier; "during the product" where the signal came before it (a slow
    # machine), which the engine's guard ends alike
    _assert_interrupted(status, err, 0, ranks, ("in DistArray.gather", "during the product"))


#: where the last rank is held while rank 0 waits for it in a blocking MPI call: after
#: SUMMA (rank 0 in the agreement that follows), before the comparison of the operands
HELD = [("distmm.engine.mpi.summa", "summa", True), ("distmm.engine.mpi", "_same_on_every_rank",
                                                     False)]


@pytest.mark.parametrize("ranks,held", [pytest.param(r, h, id=f"{r}-{h[1]}")
                                         for h in HELD for r in (2, 3)])
def test_sigint_held_in_a_blocking_exchange_ends_the_job(tmp_path, mpiexec, mpi_env, ranks,
                                                         held):
    """Rank 0 gets SIGINT while blocked in MPI, waiting for the last rank: Python raises it
    only once that call returns, between collectives; it still ends the job with one line
    and 130, rather than leaving the others waiting in the next collective."""
    script = tmp_path / "matmul.py"
    script.write_text(_MATMUL)
    folder = tmp_path / "pause"
    folder.mkdir()
    module, name, after = held
    pause_at(folder, module, name, after=after, rank=ranks - 1)
    proc = _launch(mpiexec, mpi_env, ranks, script, pythonpath=folder)
    _wait_for(proc, folder / "paused")
    status, err = _interrupt_rank_0(proc, folder)
    _assert_interrupted(status, err, 0, ranks, ("during the product",))


@pytest.mark.parametrize("ranks", [2, 3])
def test_sigint_in_a_distarray_gather_ends_the_job(tmp_path, mpiexec, mpi_env, ranks):
    script = tmp_path / "dist.py"
    script.write_text(_DISTARRAY)
    proc = _launch(mpiexec, mpi_env, ranks, script, tmp_path)
    _wait_for(proc, tmp_path / "paused", tmp_path / "gathering")
    status, err = _interrupt_rank_0(proc, tmp_path)
    _assert_interrupted(status, err, 0, ranks, ("in DistArray.gather",))


#: each case on every rank; rank 0 prints every rank's lines. ``short`` makes numpy.empty
#: refuse the whole result's shape on the last rank only (a MemoryError there alone).
_SURVIVES = """
import numpy, distmm
from mpi4py import MPI
import distmm.engine.mpi as engine
import distmm.engine.mpi.distarray as distarray
from distmm.engine.mpi import DistArray, cache_stats
comm = MPI.COMM_WORLD
last = comm.rank == comm.size - 1
rng = numpy.random.default_rng(7)
a, b = rng.standard_normal((64, 48)), rng.standard_normal((48, 40))
lines = []


class Short:
    def __getattr__(self, name):
        return getattr(numpy, name)

    def empty(self, shape, *args, **kwargs):
        if tuple(numpy.atleast_1d(shape)) == (64, 40):
            raise MemoryError("no memory for the result (test)")
        return numpy.empty(shape, *args, **kwargs)


def check(what, raises, fn):
    try:
        fn()
        lines.append(f"rank {comm.rank}: {what}: BAD nothing raised")
    except raises as exc:
        lines.append(f"rank {comm.rank}: {what}: ok")
    except BaseException as exc:
        lines.append(f"rank {comm.rank}: {what}: BAD {type(exc).__name__}: {exc}")


def works(what):
    c = distmm.matmul(a, b, engine="mpi")
    ok = numpy.allclose(c, a @ b, rtol=1e-12, atol=1e-12)
    lines.append(f"rank {comm.rank}: {what}: " + ("ok" if ok else "BAD values"))


works("first product")
made = cache_stats()["creations"]
check("one rank's bad operand", ValueError,
      lambda: distmm.matmul(a[:, :47] if last else a, b, engine="mpi"))
works("product after one rank's ValueError")
engine.np = Short() if last else numpy
check("MemoryError making the result on one rank", MemoryError,
      lambda: distmm.matmul(a, b, engine="mpi"))
engine.np = numpy
works("product after one rank's MemoryError")
distarray.np = Short() if last else numpy
check("MemoryError in the product's gather on one rank", MemoryError,
      lambda: distmm.matmul(a, b, engine="mpi"))
distarray.np = numpy
c = distmm.matmul(DistArray.from_array(a), DistArray.from_array(b))
distarray.np = Short() if last else numpy
check("MemoryError on gather's root", MemoryError, lambda: c.gather(root=comm.size - 1))
check("MemoryError in gather to all", MemoryError, lambda: c.gather(root=None))
distarray.np = numpy
full = c.gather(root=None)
lines.append(f"rank {comm.rank}: gather after MemoryError: "
             + ("ok" if numpy.allclose(full, a @ b, rtol=1e-12, atol=1e-12) else "BAD values"))
lines.append(f"rank {comm.rank}: grid communicators reused: "
             + ("ok" if cache_stats()["creations"] == made else f"BAD {cache_stats()}"))
everyone = comm.gather(lines, root=0)
if comm.rank == 0:
    for mine in everyone:
        print("\\n".join(mine), flush=True)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_one_rank_alone_failing_leaves_a_working_process(tmp_path, mpirun, ranks):
    r, lines, bad = run_rank_script(mpirun, tmp_path / "survives.py", _SURVIVES, ranks,
                                    timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(lines) == 10 * ranks and not bad, r.stdout + r.stderr[-3000:]
