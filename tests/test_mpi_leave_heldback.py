"""A rank that leaves its script while the others go on into a collective call (real mpiexec).

One rank raises an error of its own, calls ``sys.exit`` or reaches the end of its script
before ``distmm.matmul(..., engine="mpi")`` or ``DistArray.from_local``, which the others
call: they end the job with one line naming the rank that left and the call, and a
nonzero status, within seconds and without ``mpi-join-timeout`` (before, they waited for
ever). The leaving rank's traceback is printed as usual. Scripts whose ranks all end
normally, several calls made, some ranks ending later or one never importing distmm, end
with 0 and print nothing more. Every launch has a hard timeout, after which the whole job
is killed and the test fails.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import LAUNCH_ATTEMPTS, ended, launcher_failed

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

#: seconds within which a job must end (the ranks left waiting would wait for ever)
BOUND = 30

#: the leaving rank (argv[1]) leaves (argv[2]: "raise" or "exit") before ``call``
#: (argv[3]); ``after`` (argv[4] == "after"): once every rank made a first product;
#: ``late`` (argv[4] == "late"): the others reach the call 5 s later, the leaver in
#: MPI_Finalize by then
_LEAVES = r'''
import sys, time, numpy as np, distmm
from mpi4py import MPI
comm = MPI.COMM_WORLD
leaver, how, call, when = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
a = np.arange(12.0).reshape(3, 4)
if when == "after":
    distmm.matmul(a, a.T, engine="mpi")
if comm.rank == leaver:
    if how == "raise":
        raise RuntimeError(f"rank {comm.rank}'s own error")
    sys.exit(0)
if when == "late":
    time.sleep(5)
if call == "matmul":
    distmm.matmul(a, a.T, engine="mpi")
else:
    distmm.DistArray.from_local(a)
print(f"rank {comm.rank} WENT ON", flush=True)
'''

#: several calls of each kind, then rank 0 ends 1.5 s after the others (argv[1] "late") or
#: the last rank never imports distmm and rank 0 multiplies alone (argv[1] "without");
#: each rank prints its check and the time it reached its script's end
_NORMAL = r'''
import sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
if sys.argv[1] == "without" and comm.rank == comm.size - 1:
    print(f"rank {comm.rank}: ok {time.time()}", flush=True)
    sys.exit(0)
import numpy as np, distmm
a = np.arange(12.0).reshape(3, 4)
if sys.argv[1] == "without":
    ok = np.allclose(distmm.matmul(a, a.T, engine="local"), a @ a.T) if comm.rank == 0 \
        else True
else:
    ok = True
    for _ in range(3):
        ok &= np.allclose(distmm.matmul(a, a.T, engine="mpi"), a @ a.T)
        d = distmm.DistArray.from_local(a)
        full = d.gather(root=None)
        ok &= full.size == a.size * comm.size and set(np.unique(full)) == set(a.ravel())
    if comm.rank == 0:
        time.sleep(1.5)
print(f"rank {comm.rank}: {'ok' if ok else 'BAD'} {time.time()}", flush=True)
'''

#: a sub-communicator per parity of the rank; the last rank of the even one leaves after a
#: first DistArray there, and rank 0 waits for it in a second one
_SUB = r'''
import sys, numpy as np, distmm
from mpi4py import MPI
comm = MPI.COMM_WORLD
half = comm.Split(comm.rank % 2, comm.rank)
a = np.arange(12.0).reshape(3, 4)
distmm.DistArray.from_local(a, half)
if comm.rank == 2:
    sys.exit(0)
if comm.rank == 0:
    distmm.DistArray.from_local(a, half)
print(f"rank {comm.rank} WENT ON", flush=True)
'''


def _job(mpiexec, mpi_env, ranks: int, script, *args, timeout: float = BOUND):
    """``(status, stdout, stderr, seconds, end)`` of ``mpiexec -n ranks python script
    args`` (``end``: ``time.time()`` when it ended); a job still running after ``timeout``
    s is killed, its whole session, and fails the test."""
    env = {k: v for k, v in mpi_env.items()
           if k not in ("DISTMM_MPI_JOIN_TIMEOUT", "DASK_DISTMM__MPI_JOIN_TIMEOUT")}
    env["OMPI_MCA_btl"] = os.environ.get("OMPI_MCA_btl", "^ofi")
    for _ in range(LAUNCH_ATTEMPTS):
        start = time.time()
        proc = subprocess.Popen([mpiexec, "-n", str(ranks), "--oversubscribe", sys.executable,
                                 str(script), *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        out, err = ended(proc, timeout)
        end = time.time()
        if not launcher_failed(subprocess.CompletedProcess(proc.args, proc.returncode, out,
                                                           err)):
            break
    return proc.returncode, out, err, end - start, end


def _distmm_lines(err: str) -> list[str]:
    """distmm's lines on stderr (Open MPI's notes about MPI_Abort come around them)."""
    return [line[line.index("distmm:"):] for line in err.splitlines() if "distmm:" in line]


def _assert_ended(status, out, err, took, *, left: int, ranks: int, call: str, waits: int):
    assert status != 0, (status, out, err[-3000:])
    assert took < BOUND, took
    assert "WENT ON" not in out, out
    assert _distmm_lines(err) == [f"distmm: rank {left} of {ranks} ended before calling "
                                  f"{call}, which rank {waits} waits in: ending the job"], \
        err[-3000:]


_MATMUL = "distmm.matmul or distmm.gemm with engine='mpi'"


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_raises_before_matmul_ends_the_job(tmp_path, mpiexec, mpi_env, ranks):
    """Rank 1 raises its own error before the first product; the others call matmul and
    end the job with one line (rank 0's) and status 1; rank 1's traceback is printed."""
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    status, out, err, took, _ = _job(mpiexec, mpi_env, ranks, script, 1, "raise", "matmul",
                                     "first")
    _assert_ended(status, out, err, took, left=1, ranks=ranks, call=_MATMUL, waits=0)
    assert "Traceback (most recent call last)" in err, err[-3000:]
    assert "RuntimeError: rank 1's own error" in err, err[-3000:]


@pytest.mark.parametrize("ranks,leaver", [(2, 1), (3, 0)])
def test_a_rank_that_exits_before_from_local_ends_the_job(tmp_path, mpiexec, mpi_env, ranks,
                                                          leaver):
    """A rank calls ``sys.exit(0)`` before ``DistArray.from_local``; the lowest rank that
    called it ends the job with one line, no traceback."""
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    status, out, err, took, _ = _job(mpiexec, mpi_env, ranks, script, leaver, "exit",
                                     "from_local", "first")
    _assert_ended(status, out, err, took, left=leaver, ranks=ranks,
                  call="DistArray.from_local", waits=1 if leaver == 0 else 0)
    assert "Traceback" not in err, err[-3000:]


def test_a_rank_that_leaves_after_a_first_product_ends_the_next(tmp_path, mpiexec, mpi_env):
    """Every rank of three makes a product; rank 2 then raises, and the others' next
    product ends the job (rank 0's line)."""
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    status, out, err, took, _ = _job(mpiexec, mpi_env, 3, script, 2, "raise", "matmul",
                                     "after")
    _assert_ended(status, out, err, took, left=2, ranks=3, call=_MATMUL, waits=0)
    assert "RuntimeError: rank 2's own error" in err, err[-3000:]


def test_a_rank_in_mpi_finalize_ends_the_job_the_others_call_later(tmp_path, mpiexec,
                                                                   mpi_env):
    """Rank 1 raises at once; rank 0 calls matmul 5 s later, long after rank 1's wait for
    its "left" collective (``join.LINGER``) ended and it went into ``MPI_Finalize``: the
    collective still meets rank 0's join there, which ends the job."""
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    status, out, err, took, _ = _job(mpiexec, mpi_env, 2, script, 1, "raise", "matmul",
                                     "late")
    _assert_ended(status, out, err, took, left=1, ranks=2, call=_MATMUL, waits=0)


def test_a_rank_that_leaves_a_sub_communicator_ends_the_job(tmp_path, mpiexec, mpi_env):
    """Four ranks in two halves (``Split``): rank 2 (rank 1 of the even half) leaves after
    a first DistArray on its half; rank 0 ends the job in the second one, naming the ranks
    of that communicator."""
    script = tmp_path / "sub.py"
    script.write_text(_SUB)
    status, out, err, took, _ = _job(mpiexec, mpi_env, 4, script)
    assert status != 0 and took < BOUND, (status, took, err[-3000:])
    assert "rank 0 WENT ON" not in out, out
    assert _distmm_lines(err) == ["distmm: rank 1 of 2 ended before calling "
                                  "DistArray.from_local, which rank 0 waits in: ending the "
                                  "job"], err[-3000:]


@pytest.mark.parametrize("how", ["late", "without"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_that_all_end_normally_end_with_0_at_once(tmp_path, mpiexec, mpi_env, ranks,
                                                        how):
    """Several products, DistArrays and gathers on every rank, rank 0 ending 1.5 s after
    the others (``late``), or the last rank never importing distmm (``without``): status
    0, nothing on stderr, and the job ends within seconds of its last rank's end."""
    script = tmp_path / "normal.py"
    script.write_text(_NORMAL)
    status, out, err, took, end = _job(mpiexec, mpi_env, ranks, script, how)
    assert status == 0, (status, out, err[-3000:])
    assert err == "", err[-3000:]
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert [line.rsplit(" ", 1)[0] for line in lines] == \
        [f"rank {r}: ok" for r in range(ranks)], out
    last = max(float(line.rsplit(" ", 1)[1]) for line in lines)
    assert end - last < 5, (end - last, out)
