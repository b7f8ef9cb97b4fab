"""Run on every rank under mpiexec by tests/test_mpi_reuse.py (CPU) and tests/test_mpi_gpu.py
(``gpu``): repeated products reuse the grid communicators made by the first, give the
same bits (CPU) and the right values, and the communicators go when their communicator
is freed, when ``release`` is called, and in ``MPI.Finalize`` (``finalize``) or at exit.

Arguments: ``[gpu] [finalize]``. Rank 0 prints ``VERDICT ok`` or ``VERDICT FAIL`` (agreed
by all ranks); with ``finalize``, ``FINALIZED live=<n> released_in_finalize=<n> of <n>:
all`` after ``MPI.Finalize()``, and without it ``EXITED live=<n>`` at interpreter exit, after distmm's
exit hook ran.
"""
import atexit
import sys

import numpy as np
from mpi4py import MPI

import distmm
from distmm.engine.mpi import DistArray, MPIEngine, cache_stats
from distmm.engine.mpi.gridcomms import release
from distmm.grid import grid_shapes, make_grid
from mpi_verdict import run_cases

gpu = "gpu" in sys.argv[1:]
finalize = "finalize" in sys.argv[1:]
comm = MPI.COMM_WORLD
rank, P = comm.rank, comm.size
failures = []
seed = comm.bcast(np.random.SeedSequence().entropy if rank == 0 else None)
rng = np.random.default_rng(seed)  # fresh inputs each run, the same on every rank
if not finalize and rank == 0:
    # registered before distmm's own exit hook, so it runs after it (atexit is last in, first out)
    atexit.register(lambda: print(f"EXITED live={cache_stats()['live']}", flush=True))
backend = "cublas" if gpu else "blas"


def check(what, ok, detail=""):
    if not ok:
        failures.append(f"rank {rank}: {what} {detail}")


def delta(before, after):
    return {k: after[k] - before[k] for k in ("creations", "reuses", "releases")}


def close_to_float64(c, a, b, what):
    ref = a.astype(np.float64) @ b.astype(np.float64)
    got = c.get() if hasattr(c, "get") else np.asarray(c)
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)
    check(what + " relerr", err < (1e-5 if a.dtype == np.float32 else 1e-12), f"{err}")


def case_api_repeats():
    """Three products of one shape and one of another shape with the same grid: one
    creation, three reuses, equal bits, right values."""
    for dt in ("float64", "float32"):
        m, k, n = 37 + int(rng.integers(0, 20)), 53, 41
        a = rng.standard_normal((m, k)).astype(dt)
        b = rng.standard_normal((k, n)).astype(dt)
        x, y = a, b
        if gpu:
            import cupy

            x, y = cupy.asarray(a), cupy.asarray(b)
        before = cache_stats()
        cs = [distmm.matmul(x, y, engine="mpi", backend=backend) for _ in range(3)]
        a2, b2 = a[:, :-2].copy(), b[:-2, :].copy()  # another k
        if gpu:
            c4 = distmm.matmul(cupy.asarray(a2), cupy.asarray(b2), engine="mpi", backend=backend)
        else:
            c4 = distmm.matmul(a2, b2, engine="mpi", backend=backend)
        d = delta(before, cache_stats())
        want = expect([make_grid(m, n, k, dt, ranks=P).shape] * 3
                      + [make_grid(m, n, k - 2, dt, ranks=P).shape])
        check(f"{dt} cache counts", d == want, f"{d} != {want}")
        for c in cs + [c4]:
            check(f"{dt} result type", type(c) is type(x), str(type(c)))
        close_to_float64(cs[0], a, b, f"{dt} first product")
        close_to_float64(c4, a2, b2, f"{dt} other k")
        if not gpu:
            check(f"{dt} repeated products give equal bits",
                  all(np.array_equal(cs[0], c) for c in cs[1:]))


made_on_world = set()  # grid shapes whose communicators COMM_WORLD holds


def expect(shapes):
    """Cache counts that products on COMM_WORLD's grids ``shapes`` should add."""
    want = {"creations": 0, "reuses": 0, "releases": 0}
    for shape in shapes:
        want["reuses" if shape in made_on_world else "creations"] += 1
        made_on_world.add(shape)
    return want


def case_every_grid_on_a_dup():
    """Every grid of P ranks on a duplicate of COMM_WORLD: each grid shape's communicators
    are made once and reused; Free releases all of them; a new communicator makes its own."""
    sub = comm.Dup()
    engine = MPIEngine(sub)
    grids = grid_shapes(P)
    before = cache_stats()
    m, n, k = 22, 23, 24 + int(rng.integers(0, 9))
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n))
    if gpu:
        a, b = a.astype(np.float32), b.astype(np.float32)
    first = {}
    for rep in range(2):
        for shape in grids:
            g = make_grid(m, n, k, a.dtype, ranks=P, grid=shape)
            c = engine.run_distributed(DistArray.from_array(a, sub), DistArray.from_array(b, sub),
                                       g, backend, on_gpu=gpu)
            full = c.gather(root=None)
            check(f"grid {shape} bytes", c.stats["bytes_received"] == c.stats["bytes_estimated"],
                  str(c.stats))
            if rep == 0:
                first[shape] = full
                close_to_float64(full, a, b, f"grid {shape}")
            elif not gpu:
                check(f"grid {shape} repeated product gives equal bits",
                      np.array_equal(first[shape], full))
    mid = cache_stats()
    d = delta(before, mid)
    want = {"creations": len(grids), "reuses": len(grids), "releases": 0}
    check("every grid made once", d == want, f"{d} != {want}")
    if gpu and P == 1:
        check("one rank makes no NCCL communicator", mid["nccl_communicators"] == 0, str(mid))
    sub.Free()
    after = cache_stats()
    check("Free releases the communicator's grids",
          after["releases"] - mid["releases"] == len(grids) and
          after["live"] == mid["live"] - len(grids), f"{mid} -> {after}")
    other = comm.Dup()
    g = make_grid(m, n, k, a.dtype, ranks=P)
    MPIEngine(other).run_distributed(DistArray.from_array(a, other), DistArray.from_array(b, other),
                                     g, backend, on_gpu=gpu)
    check("a new communicator makes its own", cache_stats()["creations"] == after["creations"] + 1)
    release(other)
    check("release closes them", cache_stats()["live"] == after["live"], str(cache_stats()))
    MPIEngine(other).run_distributed(DistArray.from_array(a, other), DistArray.from_array(b, other),
                                     g, backend, on_gpu=gpu)
    check("made again after release", cache_stats()["creations"] == after["creations"] + 2)
    other.Free()


ok, all_failures = run_cases(comm, (case_api_repeats, case_every_grid_on_a_dup), failures)
if rank == 0:
    for f in all_failures[:30]:
        print(f)
    print("STATS", cache_stats())
    print("VERDICT", "ok" if ok else "FAIL", flush=True)
if finalize:
    live, releases = cache_stats()["live"], cache_stats()["releases"]
    MPI.Finalize()
    after = cache_stats()
    if rank == 0:
        released = after["releases"] - releases
        print(f"FINALIZED live={after['live']} released_in_finalize={released} "
              f"of {live}: {'all' if live > 0 and released == live else 'NOT all'}", flush=True)
