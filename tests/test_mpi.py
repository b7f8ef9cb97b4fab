"""The MPI engine under a real ``mpiexec`` (CPU), P = 1, 2, 3, 4.

Each launch runs tests/mpi_cases.py on every rank (all dtypes, odd and
ragged shapes, tall-skinny and long-k products, every grid of P ranks with
the bytes each rank received checked against the planner's estimate, the
DistArray constructors and files); the ranks agree on one verdict, and a
subprocess timeout bounds a hang. The command line under mpirun is tested in
tests/test_mpi_cli.py. The grid planner itself is tested here without MPI.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distmm.grid import BlockLayout, even_edges, make_grid

HERE = Path(__file__).resolve().parent


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_mpi_engine_cases(ranks, tmp_path, mpirun):
    r = mpirun(ranks, HERE / "mpi_cases.py", tmp_path, timeout=240)
    assert "VERDICT ok" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["case_one_sum_bits", "case_one_rank_refuses",
                                  "case_product_errors_agree", "case_objects_that_do_not_pickle"])
@pytest.mark.slow
def test_mpi_two_ranks(case, tmp_path, mpirun):
    """float16, long double and object-float products on 2 ranks are numpy's bits (in core,
    k split, broadcast stripes); operands only rank 1 refuses raise on both ranks (they hung
    rank 0: the timeout); an error in one rank's part of the product (an object element, a
    floating-point flag numpy raises) is numpy's on both (it called MPI_Abort); object
    elements that do not pickle give numpy's result, or one NotPicklable on both for
    DistArrays (it called MPI_Abort, or hung in stripes)."""
    r = mpirun(2, HERE / "mpi_cases.py", tmp_path, case, timeout=120)
    assert "VERDICT ok" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0


@pytest.mark.mpi
@pytest.mark.slow
def test_distarray_refusals_on_one_rank_reach_every_rank(tmp_path, mpirun):
    """from_local and to_file arguments only the last of 3 ranks gets wrong (a 1-D block,
    another grid, another file name or suffix): one error on every rank, nothing written
    (the other ranks waited for it in a collective: the timeout, and a staged file left)."""
    r = mpirun(3, HERE / "mpi_cases.py", tmp_path, "case_distarray_refusals_agree", timeout=90)
    assert "VERDICT ok" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0


@pytest.mark.mpi
def test_distarray_arguments_are_refused_on_every_rank(tmp_path, mpirun):
    """Wrong DistArray arguments, on every rank or on the last of 3 only (a grid of negative
    sizes or floats, blocks of another dtype, a gather root that is no rank or differs,
    from_array or from_file given other arrays, a file missing on one rank, a layout for
    ranks that do not exist or differing): the same one-line error on every rank. They gave
    an IndexError, None from gather, mixed or uninitialised matrices, a lost block,
    MPI_ERR_TRUNCATE on one rank, or hung (the timeout)."""
    r = mpirun(3, HERE / "mpi_cases.py", tmp_path, "case_distarray_arguments_agree", timeout=60)
    assert "VERDICT ok" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (100000, 50, 50), (50, 100000, 50),
                                   (64, 64, 10**6), (22, 23, 24), (3, 1, 0)])
def test_grid_plan(ranks, shape):
    m, n, k = shape
    g = make_grid(m, n, k, "float64", ranks=ranks)
    assert g.layers * g.rows * g.cols == ranks
    # the chosen grid is no worse, by the planner's own model, than every other
    from distmm.grid import grid_shapes
    cost = lambda p: max(p.flops(r) / 40e9 + p.bytes_received(r) / 4e9 for r in range(ranks))
    assert all(cost(g) <= cost(make_grid(m, n, k, ranks=ranks, grid=c)) * (1 + 1e-9)
               for c in grid_shapes(ranks))
    for layout in (g.a_layout, g.b_layout, g.c_layout):  # every block once, owners distinct
        area = sum((layout.bounds(i, j)[1] - layout.bounds(i, j)[0])
                   * (layout.bounds(i, j)[3] - layout.bounds(i, j)[2])
                   for i in range(layout.blocks[0]) for j in range(layout.blocks[1]))
        assert area == layout.shape[0] * layout.shape[1]
    for pe in g.panel_edges:
        assert list(pe) == sorted(pe)


@pytest.mark.parametrize("dtype", ["float64", "float32", "complex128", "int8"])
def test_slowest_rank_is_found_from_the_block_sizes(dtype):
    """``slowest_seconds`` (the grid search's score, from the few distinct block sizes) is
    the maximum over every rank of its flops and bytes received, on random grids and sizes."""
    from distmm.grid import grid_shapes

    rng = np.random.default_rng()
    for _ in range(40):
        m, n, k = (int(x) for x in rng.integers(0, 400, 3))
        ranks = int(rng.integers(1, 49))
        rate, link = float(10 ** rng.uniform(9, 13)), float(10 ** rng.uniform(8, 12))
        for shape in grid_shapes(ranks):
            g = make_grid(m, n, k, dtype, ranks=ranks, grid=shape)
            every = max(g.flops(r) / rate + g.bytes_received(r) / link for r in range(ranks))
            assert g.slowest_seconds(rate, link) == pytest.approx(every, rel=1e-12, abs=0)


def test_ranks_and_workers_beyond_the_most_are_refused():
    """``distmm plan --ranks 10**9`` ran for minutes, ``--workers 10**9`` took 14 GB."""
    import distmm
    from distmm.plan import MAX_WORKERS

    with pytest.raises(ValueError, match=f"ranks must be at most {MAX_WORKERS}"):
        make_grid(100, 100, 100, ranks=MAX_WORKERS + 1)
    with pytest.raises(ValueError, match=f"workers must be at most {MAX_WORKERS}"):
        distmm.make_plan(100, 100, 100, workers=10**9)


def test_grid_shapes_follow_the_problem():
    assert make_grid(100000, 50, 50, ranks=4).shape == (1, 4, 1)  # tall-skinny: nothing of A moves
    # long k splits into layers, except where numpy sums over k in one pass (float16, ...)
    assert make_grid(64, 64, 10**6, "float32", ranks=4).layers == 4
    assert make_grid(64, 64, 10**6, "float16", ranks=4).layers == 1
    assert make_grid(64, 64, 10**6, "object", ranks=4).layers == 1
    assert make_grid(64, 64, 10**6, "longdouble", ranks=4).layers == 1
    assert make_grid(50, 100000, 50, ranks=4).shape == (1, 1, 4)
    assert make_grid(64, 64, 10**6, ranks=4).shape == (4, 1, 1)  # long k: split k
    assert make_grid(4096, 4096, 4096, ranks=4).shape == (1, 2, 2)
    g = make_grid(4096, 4096, 4096, ranks=2)
    assert max(g.bytes_per_rank) == 4096 * 2048 * 8  # half of A (or B) arrives at each rank
    assert even_edges(10, 3) == (0, 4, 7, 10)
    with pytest.raises(ValueError):
        make_grid(4, 4, 4, ranks=4, grid=(1, 2, 3))
    with pytest.raises(ValueError):
        BlockLayout((4, 4), (0, 4), (0, 4), ((0, 0),))


ABORT_SCRIPT = r"""
import numpy as np
from mpi4py import MPI
import distmm

from distmm.executor.cpu import CPUExecutor

comm = MPI.COMM_WORLD
if comm.rank == 1:  # rank 1's panel products fail while the panels are still moving
    def boom(self, a, b, tk=256):
        raise ArithmeticError("boom")
    CPUExecutor.panel_product = boom
a = np.ones((40, 3000))
c = distmm.matmul(distmm.DistArray.from_array(a, comm), np.ones((3000, 20)), tile=(40, 20, 256))
c.gather(root=None)  # rank 0 waits in a broadcast for rank 1, which never comes: the abort
print("NOT ABORTED", comm.rank, flush=True)
"""


@pytest.mark.mpi
def test_a_failure_on_one_rank_aborts_the_job(tmp_path, mpirun):
    script = tmp_path / "abort.py"
    script.write_text(ABORT_SCRIPT)
    r = mpirun(2, script, timeout=60)
    assert r.returncode != 0
    assert "calling MPI_Abort" in r.stderr and "ArithmeticError: boom" in r.stderr, r.stderr[-3000:]
    assert "NOT ABORTED" not in r.stdout


INTERRUPT_SCRIPT = ABORT_SCRIPT.replace('''    def boom(self, a, b, tk=256):
        raise ArithmeticError("boom")''', '''    def boom(self, a, b, tk=256):
        import os, signal, time
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C reaching this rank mid-product
        time.sleep(30)''')


JOIN_SCRIPT = """
import logging, os, sys, time
import numpy as np
from mpi4py import MPI
import distmm

comm = MPI.COMM_WORLD
flag = sys.argv[1]
a = np.arange(64.0).reshape(8, 8)


class Flag(logging.StreamHandler):  # rank 0's warning on stderr, and seen by rank 1 as a file
    def emit(self, record):
        super().emit(record)
        open(flag, "w").close()


logging.getLogger("distmm.engine.mpi").addHandler(Flag())
if comm.rank == 1:
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    if sys.argv[2] == "never":
        distmm.matmul(a, a, engine="local")
        time.sleep(120)  # never joins: only rank 0's deadline ends the job
c = distmm.matmul(a, a, engine="mpi")
oks = comm.gather(f"rank {comm.rank} ok {np.array_equal(c, a @ a)}")  # one writer: the
if comm.rank == 0:  # launcher may forward two ranks' lines interleaved mid-line
    print("\\n".join(oks), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("rank1", ["late", pytest.param("never", marks=pytest.mark.slow)])
def test_a_rank_that_is_late_to_an_mpi_call_is_warned_about(rank1, tmp_path, mpirun):
    """Rank 0 waits in matmul(engine='mpi') for rank 1: after mpi-join-warning it logs one
    warning naming the call; a late rank then joins and both compute the product, while a
    rank that never joins (it took engine='local') makes rank 0 end the job at
    mpi-join-timeout with one line, instead of waiting for ever."""
    script = tmp_path / "join.py"
    script.write_text(JOIN_SCRIPT)
    flag = tmp_path / "warned"
    env = {"DISTMM_MPI_JOIN_WARNING": "0.5s", "DISTMM_MPI_JOIN_TIMEOUT": "100s"}
    if rank1 == "never":
        env["DISTMM_MPI_JOIN_TIMEOUT"] = "2s"
    r = mpirun(2, script, flag, rank1, timeout=90, env=env)
    waited = ("rank 0 of 2 has waited 0.5 s for every rank to call distmm.matmul or distmm.gemm "
              "with engine='mpi'")
    assert r.stderr.count(waited) == 1, r.stderr[-3000:]
    assert "rank 1 of 2 has waited" not in r.stderr
    if rank1 == "late":
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.splitlines() == ["rank 0 ok True", "rank 1 ok True"], r.stdout
    else:
        assert r.returncode != 0
        assert ("distmm: rank 0 of 2 waited 2 s for every rank to call distmm.matmul or "
                "distmm.gemm with engine='mpi' (mpi-join-timeout): ending the job"
                in r.stderr), r.stderr[-3000:]
        assert "ok" not in r.stdout


@pytest.mark.mpi
def test_a_ctrl_c_on_one_rank_ends_the_job_with_130(tmp_path, mpirun):
    """A KeyboardInterrupt on a rank of a user's script mid-product ends every rank, with
    the status a shell gives a Ctrl-C, and says so in one line (it aborted with 1)."""
    assert "os.kill" in INTERRUPT_SCRIPT
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT_SCRIPT)
    r = mpirun(2, script, timeout=60)
    assert r.returncode == 130, (r.returncode, r.stderr[-3000:])
    assert "rank 1 of 2 interrupted during the product" in r.stderr, r.stderr[-3000:]
    assert "NOT ABORTED" not in r.stdout


def test_plan_command_prints_the_process_grid(capsys):
    from distmm.cli import main

    assert main(["plan", "64", "64", "1000000", "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "process grid 4 x 1 x 1 (layers x rows x cols) for 4 ranks" in out
    assert main(["plan", "100000", "50", "50", "--ranks", "4"]) == 0
    assert "process grid 1 x 4 x 1" in capsys.readouterr().out


def test_fingerprint_tells_values_apart_not_layouts():
    """What the ranks compare of the operands they were given (``agree.fingerprint``): equal
    for the same values in any layout (a copy, Fortran order), different where values differ
    (one sampled element, another generator's draw), long doubles read without their padding,
    objects by value where they are numbers."""
    from distmm.engine.mpi.agree import fingerprint

    rng = np.random.default_rng()
    for shape in [(300, 200), (3, 70, 50), (1, 1), (5000, 3)]:
        x = rng.standard_normal(shape)
        assert fingerprint(x) == fingerprint(x.copy()) == fingerprint(np.asfortranarray(x))
        assert fingerprint(x) != fingerprint(rng.standard_normal(shape))
        y = x.copy()
        y.reshape(-1)[0] += 1  # the first element is always sampled
        assert fingerprint(x) != fingerprint(y)
    x = rng.standard_normal((40, 30)).astype(np.longdouble)
    if np.finfo(np.longdouble).nmant == 63 and x.itemsize == 16:  # x87's 80 bits in 16 bytes
        y = x.copy()
        y.view(np.uint8).reshape(-1, 16)[:, 10:] = 0xAB  # padding that differs from x's
        assert (y == x).all() and y.tobytes() != x.tobytes()
        assert fingerprint(x) == fingerprint(y)
    # objects: numbers by value, other elements by type (two plain objects look the same)
    f = rng.integers(-9, 9, (30, 20)).astype(object)
    assert fingerprint(f) == fingerprint(f.copy()) != fingerprint(f + 1)
    assert fingerprint(f / 3) != fingerprint(f / 4)
    assert fingerprint(np.array([[object()]])) == fingerprint(np.array([[object()]]))
    assert fingerprint(np.array([[object()]])) != fingerprint(np.array([[None]]))


def test_block_layout_takes_whole_numbers_only():
    """A float edge or owner is refused where the layout is made (it failed in
    ``redistribute`` on the ranks whose blocks it bounds only); numpy ints, arrays and lists
    make the same layout as Python ints (they compared unequal, or raised in ``==``)."""
    with pytest.raises(TypeError, match=r"row edges must be integers, got \(0, 3.0, 7\)"):
        BlockLayout((7, 5), (0, 3.0, 7), (0, 5), ((0,), (1,)))
    with pytest.raises(TypeError, match="owners must be integers"):
        BlockLayout((7, 5), (0, 7), (0, 5), ((True,),))
    with pytest.raises(TypeError, match="owners must be integers"):
        BlockLayout((7, 5), (0, 7), (0, 5), ((0.0,),))
    with pytest.raises(TypeError, match="shape must be integers"):
        BlockLayout((7.0, 5), (0, 7), (0, 5), ((0,),))
    with pytest.raises(ValueError, match="shape has two sizes"):
        BlockLayout((7, 5, 1), (0, 7), (0, 5), ((0,),))
    with pytest.raises(ValueError, match=r"row edges \(\) do not cover 7 rows"):
        BlockLayout((7, 5), (), (0, 5), ((0,),))  # was an IndexError
    plain = BlockLayout((7, 5), (0, 4, 7), (0, 5), ((1,), (0,)))
    given = BlockLayout(np.array([7, 5]), np.array([0, 4, 7]), [np.int64(0), 5],
                        [[np.int32(1)], [0]])
    assert given == plain and hash(given) == hash(plain)
    assert all(type(v) is int for v in given.shape + given.row_edges + given.col_edges)
    assert given.local_shape(1) == (4, 5)
