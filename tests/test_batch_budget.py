"""``distmm.memory-budget`` on the CPU ranks of ``mpirun -n P distmm matmul`` (real mpiexec,
real files): a budget given as a size makes each rank hold at most that (more stripes, the
same bits), one below the least a rank holds is refused in one line before any work, and a
rank holds the two C stripes the plan counts, however slow its writer. The planner's side:
tests/test_plan_batch.py."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli, takes_direct

pytestmark = pytest.mark.mpi

#: a rank's peak resident memory (``ru_maxrss``, KiB) written to ``FOLDER/rss-RANK`` once its
#: ``python -m distmm ARGS`` has ended (run as ``python rss.py FOLDER ARGS``)
RSS_SCRIPT = r"""
import os, sys
pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "distmm", *sys.argv[2:]], os.environ)
_, status, usage = os.wait4(pid, 0)
rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
with open(os.path.join(sys.argv[1], "rss-" + rank), "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _operands(d: Path, m, k, n, seed=0):
    """Integer-valued float64 operands (every product and sum exact: C is numpy's bits)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-50, 50, size=(m, k)).astype(np.float64)
    b = rng.integers(-50, 50, size=(k, n)).astype(np.float64)
    np.save(d / "a.npy", a)
    np.save(d / "b.npy", b)
    return a, b


def _written(profile: Path) -> list[int]:
    """Each rank's C stripes, as its profile's write spans."""
    data = json.loads(profile.read_text())
    return [sum(s["phase"] == "write" for s in rec["spans"]) for rec in data["ranks"]]


def _peaks(mpirun, tmp_path: Path, tag: str, a: Path, env: dict) -> list[int]:
    """Each of two ranks' peak resident bytes running ``matmul a b.npy`` in ``tmp_path/tag``
    (with its profile, ``p.json``)."""
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    folder = tmp_path / tag
    folder.mkdir()
    # a fixed malloc mmap threshold: freed stripes go back to the system at once (glibc raises
    # its threshold as blocks are freed, and may keep them in a thread's heap), so the peak
    # is what distmm held; one rank's came out a stripe over the budget once without it
    r = mpirun(2, script, folder, "matmul", a, tmp_path / "b.npy", "-o", folder / "c.npy",
               "--profile", folder / "p.json", env={"MALLOC_MMAP_THRESHOLD_": "131072", **env})
    assert r.returncode == 0, r.stderr
    return [int((folder / f"rss-{rank}").read_text()) << 10 for rank in (0, 1)]


@pytest.mark.slow
def test_a_budget_makes_more_stripes_with_the_same_bits(tmp_path, mpirun):
    """Two ranks of 1024 rows each, two stripes asked for: 2.1 MiB a rank. A budget of
    1.5 MiB makes four stripes of 256 rows (1.1 MiB); C is numpy's, bit for bit (it ignored
    the budget and ran two stripes)."""
    a, b = _operands(tmp_path, 2048, 128, 128)
    argv = ["-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy"]
    env = {"DISTMM_BATCH_STRIPES": "2"}
    free = mpirun(2, *argv, "-o", tmp_path / "c0.npy", "--profile", tmp_path / "p0.json",
                  env=env)
    assert free.returncode == 0, free.stderr
    tight = mpirun(2, *argv, "-o", tmp_path / "c1.npy", "--profile", tmp_path / "p1.json",
                   env={**env, "DISTMM_MEMORY_BUDGET": "1.5MiB"})
    assert tight.returncode == 0, tight.stderr
    assert "grid 2x1" in tight.stdout, tight.stdout
    assert _written(tmp_path / "p0.json") == [2, 2]
    assert _written(tmp_path / "p1.json") == [4, 4]
    ref = a @ b
    for name in ("c0.npy", "c1.npy"):
        assert np.load(tmp_path / name).tobytes() == ref.tobytes()


@pytest.mark.slow
def test_a_budget_below_the_least_is_refused_in_one_line_before_any_work(tmp_path, mpirun):
    """Below what a rank holds with the narrowest stripes (256 rows: 1.12 MiB here): status 2,
    one line naming the budget and that least, no traceback, and no output, staged or not."""
    _operands(tmp_path, 2048, 128, 128)
    r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o",
               tmp_path / "c.npy",
               env={"DISTMM_BATCH_STRIPES": "2", "DISTMM_MEMORY_BUDGET": "64KiB"})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("distmm")]
    assert lines == [
        "distmm matmul: error: a 2048 x 128 x 128 float64 batch product on 2 x 1 ranks holds "
        "at least 1.12 MiB on rank 0 (B's column panel k x n/1 and stripes of A and C of 256 "
        "rows), more than its distmm.memory-budget of 64.00 KiB: set a larger budget or use "
        "more ranks"], r.stderr
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


@pytest.mark.slow
def test_a_budget_bounds_each_ranks_peak_memory(tmp_path, mpirun):
    """Each rank's peak resident memory (``ru_maxrss``) with one stripe of 64 MiB of C, with a
    budget of 24 MiB (8 stripes of 8 MiB, 16.8 MiB held), and for a product of almost nothing
    (the interpreter, numpy, MPI): with the budget a rank holds at most the budget above the
    last, and far less than without it. Direct writes off (their aligned buffers: the next
    test)."""
    _operands(tmp_path, 8192, 32, 2048)
    np.save(tmp_path / "a0.npy", np.ones((2, 32)))  # a row a rank
    env = {"DISTMM_BATCH_STRIPES": "1", "DISTMM_DIRECT_WRITES": "false"}

    def peaks(tag, a, **extra):
        return (_peaks(mpirun, tmp_path, tag, a, {**env, **extra}),
                _written(tmp_path / tag / "p.json"))

    base, _ = peaks("base", tmp_path / "a0.npy")
    free, stripes = peaks("free", tmp_path / "a.npy")
    assert stripes == [1, 1]
    budget = 24 << 20
    tight, stripes = peaks("tight", tmp_path / "a.npy", DISTMM_MEMORY_BUDGET="24MiB")
    assert stripes == [8, 8]
    for rank in (0, 1):
        assert tight[rank] - base[rank] <= budget, (base, tight)
        assert free[rank] - tight[rank] >= 32 << 20, (free, tight)  # a 64 MiB stripe vs 8


@pytest.mark.slow
def test_a_budget_counts_the_direct_writers_aligned_buffers(tmp_path, mpirun):
    """Direct writes copy each stripe of C into the writer's aligned buffers
    (``distmm.direct_io``, 16 MiB a thread, four threads), kept for the run: the plan counts
    them. 64 MiB of C a rank and a budget of 160 MiB: stripes of 32 MiB (65.5 MiB and 32 MiB
    of buffers held), and each rank's peak (``ru_maxrss``) stays within the budget above that
    of a product of almost nothing. Counted without them, stripes of 64 MiB were planned
    (130.5 MiB) and a rank held 64 MiB of buffers more (193.5 MiB above the base)."""
    if not takes_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: no aligned buffers")
    from distmm.plan_batch import decide_batch

    _operands(tmp_path, 16384, 32, 2048)
    np.save(tmp_path / "a0.npy", np.ones((2, 32)))  # a row a rank
    budget, env = 160 << 20, {"DISTMM_BATCH_STRIPES": "1", "DISTMM_DIRECT_WRITES": "true"}
    base = _peaks(mpirun, tmp_path, "base", tmp_path / "a0.npy", env)
    tight = _peaks(mpirun, tmp_path, "tight", tmp_path / "a.npy",
                   {**env, "DISTMM_MEMORY_BUDGET": "160MiB"})
    profile = json.loads((tmp_path / "tight" / "p.json").read_text())
    assert [rec["written_direct"] > 0 for rec in profile["ranks"]] == [True, True], profile
    for rank in (0, 1):
        assert tight[rank] - base[rank] <= budget, (base, tight)
    assert _written(tmp_path / "tight" / "p.json") == [4, 4]
    plan = decide_batch(16384, 2048, 32, ranks=2, stripes=1, budget=budget,
                        direct_writes=True).plan
    assert plan.stripes == 4 and max(plan.held_bytes) == (65.5 + 32) * 2**20


def _planned(out: str) -> list[int]:
    """``distmm plan --ranks``'s stripes of each rank."""
    return [int(re.search(r" in (\d+) stripe", line)[1])
            for line in out.splitlines() if re.match(r"  rank \d", line)]


@pytest.mark.slow
def test_plan_ranks_shows_the_budgets_stripes(tmp_path, mpirun):
    """``distmm plan M N K --ranks P`` under a budget prints the stripes the run records."""
    _operands(tmp_path, 2048, 128, 128)
    env = {"DISTMM_BATCH_STRIPES": "2", "DISTMM_MEMORY_BUDGET": "1.5MiB"}
    plan = run_cli("plan", 2048, 128, 128, "--ranks", 2, env=env)
    assert plan.returncode == 0, plan.stderr
    r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o",
               tmp_path / "c.npy", "--profile", tmp_path / "p.json", env=env)
    assert r.returncode == 0, r.stderr
    assert _planned(plan.stdout) == _written(tmp_path / "p.json") == [4, 4], plan.stdout
    small = run_cli("plan", 2048, 128, 128, "--ranks", 2,
                    env={**env, "DISTMM_MEMORY_BUDGET": "64KiB"})
    assert small.returncode == 2 and small.stdout == "", small.stdout
    assert small.stderr.count("\n") == 1 and "more than its distmm.memory-budget of 64.00 KiB" \
        in small.stderr, small.stderr


def test_a_cpu_rank_holds_two_c_stripes_however_slow_its_writer():
    """A CPU rank computes the next stripe while its writer writes the last, and no further:
    the writer queued two more stripes and the loop a fourth (four C stripes alive where the
    plan counts two). A slow sink: by the end of each stripe's write at most the next has
    been started, and it has been computed (compute and writes still overlap)."""
    from mpi4py import MPI

    from distmm.engine.mpi.stop import StopWatch
    from distmm.engine.mpi.stream import PanelSource, run_stripes
    from distmm.executor import get_executor
    from distmm.phases import Phases
    from distmm.plan_batch import plan_batch

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((800, 40)), rng.standard_normal((40, 30))
    plan = plan_batch(800, 30, 40, "float64", ranks=1, stripes=8, whole_rows=True)
    todo = list(range(plan.stripe_count(0)))
    assert len(todo) == 8

    class Sink:
        def write(self, r0, r1, c0, c1, data):
            time.sleep(0.1)  # a slow disk
            np.testing.assert_allclose(data, a[r0:r1] @ b[:, c0:c1], rtol=1e-12, atol=1e-12)

        def finish(self):
            pass

    phases = Phases()
    watch = StopWatch(MPI.COMM_SELF)
    try:
        with get_executor("blas", np.dtype("float64"), on_gpu=False) as executor:
            run_stripes(plan, 0, PanelSource(a), PanelSource(b), Sink(), executor, None, watch,
                        phases, on_gpu=False, todo=todo)
    finally:
        watch.close()
    gemms = sorted((s, e) for p, s, e, _, _ in phases.spans if p == "gemm")
    writes = sorted(e for p, s, e, _, _ in phases.spans if p == "write")
    assert len(gemms) == len(writes) == 8
    started = [sum(s < end for s, _ in gemms) for end in writes]
    assert max(n - t for t, n in enumerate(started)) <= 2, started  # stripes t and t + 1
    assert all(gemms[t + 1][1] < writes[t] for t in range(7)), (gemms, writes)
