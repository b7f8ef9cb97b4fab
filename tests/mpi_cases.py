"""Cases run under ``mpiexec -n P`` by tests/test_mpi.py (not collected by pytest).

Every rank runs every case; each records failures; at the end all ranks agree
on the verdict with an allreduce, so a failing rank cannot leave the others
waiting, and rank 0 prints ``VERDICT ok`` or ``VERDICT FAIL`` with the reasons.
Usage: mpiexec -n P python tests/mpi_cases.py TMPDIR [CASE ...] (default: every case)
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import distmm
from distmm.engine.mpi import DistArray, MPIEngine
from distmm.grid import BlockLayout, grid_shapes, make_grid
from mpi_verdict import run_cases

comm = MPI.COMM_WORLD
P, rank = comm.size, comm.rank
tmp = sys.argv[1]
failures: list[str] = []
rng = np.random.default_rng(1234)  # same seed on every rank: the same operands everywhere

DTYPES = ["float64", "float32", "float16", "complex128", "complex64", "int64", "int32", "int8",
          "uint8", "uint64", "bool", "longdouble", "object"]
SHAPES = [(22, 23, 24), (P * 3 + 1, 2 * P + 1, 5 * P + 3), (1, 9, 7), (41, 1, 6), (3, 4, 0),
          (0, 5, 3), (200, 3, 2), (2, 3, 900)]


def check(name, cond, detail=""):
    if not cond:
        failures.append(f"rank {rank}: {name} {detail}")


def operands(dt, m, k, n):
    if dt == "object":
        return (rng.integers(-9, 9, (m, k)).astype(object), rng.integers(-9, 9, (k, n)).astype(object))
    if dt == "bool":
        return rng.random((m, k)) < 0.3, rng.random((k, n)) < 0.3
    if np.dtype(dt).kind in "iu":
        info = np.iinfo(dt)
        return (rng.integers(info.min, info.max, (m, k), dtype=dt, endpoint=True),
                rng.integers(info.min, info.max, (k, n), dtype=dt, endpoint=True))
    a = rng.standard_normal((m, k)) + (1j * rng.standard_normal((m, k)) if np.dtype(dt).kind == "c" else 0)
    b = rng.standard_normal((k, n)) + (1j * rng.standard_normal((k, n)) if np.dtype(dt).kind == "c" else 0)
    return a.astype(dt), b.astype(dt)


def same(c, a, b, what):
    ref = np.matmul(a, b)
    check(what + " dtype", c.dtype == ref.dtype, f"{c.dtype} != {ref.dtype}")
    check(what + " shape", c.shape == ref.shape, f"{c.shape} != {ref.shape}")
    if c.shape != ref.shape:
        return
    kind = ref.dtype.kind
    if kind in "biuO":
        check(what + " exact", np.array_equal(c, ref))
    else:
        ref64 = np.matmul(a.astype(np.complex128), b.astype(np.complex128))
        tol = {2: 3e-3, 4: 1e-5, 8: 1e-5}.get(np.dtype(ref.dtype).itemsize if kind == "f" else
                                              np.dtype(ref.dtype).itemsize // 2, 1e-12)
        scale = max(np.abs(ref64).max(initial=0), 1)
        check(what + " close", np.abs(c.astype(np.complex128) - ref64).max(initial=0) <= tol * scale * 10,
              f"err {np.abs(c.astype(np.complex128) - ref64).max(initial=0)}")


def case_api_dtypes():
    for dt in DTYPES:
        for m, n, k in SHAPES:
            a, b = operands(dt, m, k, n)
            same(distmm.matmul(a, b, engine="mpi"), a, b, f"api {dt} {m}x{n}x{k}")


def case_api_semantics():
    a, b = operands("float64", 7, 5, 3)
    v = rng.standard_normal(5)
    same(distmm.matmul(a, v, engine="mpi"), a, v, "matrix-vector")
    same(distmm.matmul(v, b, engine="mpi"), v, b, "vector-matrix")
    x = distmm.matmul(v, v, engine="mpi")
    check("vector-vector", np.isscalar(x) and np.isclose(x, v @ v))
    s = rng.standard_normal((3, 7, 5))
    same(distmm.matmul(s, b, engine="mpi"), s, b, "batched")
    out = np.empty((7, 3))
    r = distmm.matmul(a, b, out=out, engine="mpi")
    check("out", r is out and np.allclose(out, a @ b))
    for bad, exc in (((a, a), ValueError), ((a, np.array(["x"] * 15).reshape(5, 3)), TypeError),
                     ((np.float64(1.0), a), ValueError)):
        try:
            distmm.matmul(*bad, engine="mpi")
            failures.append(f"rank {rank}: {exc.__name__} not raised")
        except exc:
            pass
    # operands that differ between ranks: a ValueError on every rank, no hang
    if P > 1:
        try:
            distmm.matmul(np.ones((3 + rank, 4)), np.ones((4, 2)), engine="mpi")
            failures.append(f"rank {rank}: different operands per rank did not raise")
        except ValueError:
            pass
    # the same plan gives the same bits (fixed reduction order), k split included
    a, b = operands("float64", 9, 4000, 7)
    c1 = distmm.matmul(a, b, engine="mpi")
    c2 = distmm.matmul(a, b, engine="mpi")
    check("reproducible", np.array_equal(c1, c2))


def case_every_grid():
    engine = MPIEngine(comm)
    for layers, rows, cols in grid_shapes(P):
        for dt in ("float64", "int64", "int8", "float32"):
            for m, n, k in ((22, 23, 24), (5, 3, 1000), (1, 1, 1)):
                a, b = operands(dt, m, k, n)
                grid = make_grid(m, n, k, np.matmul(a[:0], b[:, :0]).dtype, ranks=P,
                                 grid=(layers, rows, cols))
                da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
                backend = "numba" if np.dtype(dt).kind in "iu" else "blas"
                c = engine.run_distributed(da, db, grid, backend)
                what = f"grid {layers}x{rows}x{cols} {dt} {m}x{n}x{k}"
                same(c.gather(root=None), a, b, what)
                check(what + " bytes", c.stats["bytes_received"] == c.stats["bytes_estimated"],
                      str(c.stats))
                g0 = c.gather(root=0)
                check(what + " gather root", (g0 is None) == (rank != 0))


def case_distarray():
    a, b = operands("float64", 31, 17, 13)
    # from local blocks on a row-major grid, ragged
    rows, cols = (1, P) if P < 4 else (2, P // 2)
    layout = BlockLayout.grid(a.shape, rows, cols)
    r0, r1, c0, c1 = layout.local_bounds(rank)
    da = DistArray.from_local(a[r0:r1, c0:c1].copy(), comm, grid=(rows, cols))
    check("from_local layout", da.layout == layout, f"{da.layout} != {layout}")
    db = DistArray.from_array(b, comm)
    c = distmm.matmul(da, db)
    check("DistArray result", isinstance(c, DistArray))
    same(c.gather(root=None), a, b, "DistArray @ DistArray")
    same(distmm.matmul(da, b).gather(root=None), a, b, "DistArray @ ndarray")
    # files: each rank reads its part; to_file writes each rank's block
    if rank == 0:
        np.save(f"{tmp}/a.npy", a)
        import h5py

        with h5py.File(f"{tmp}/a.h5", "w") as fh:
            fh["A"] = a
    comm.Barrier()
    for spec in (f"{tmp}/a.npy", f"{tmp}/a.h5:A"):
        df = DistArray.from_file(spec, comm)
        check("from_file " + spec, np.array_equal(df.gather(root=None), a))
    for spec in (f"{tmp}/c.npy", f"{tmp}/c.zarr", f"{tmp}/c.h5:C"):
        c.to_file(spec)
        comm.Barrier()
        back = DistArray.from_file(spec, comm).gather(root=None)
        check("to_file " + spec, np.allclose(back, a @ b))
    try:
        c.to_file(f"{tmp}/c.npy")
        failures.append(f"rank {rank}: to_file over an existing file did not raise")
    except FileExistsError:
        pass
    try:
        distmm.matmul(da, DistArray.from_array(a, comm))
        failures.append(f"rank {rank}: shape mismatch did not raise")
    except ValueError:
        pass


def exact(c, ref, what):
    """Bitwise equal to numpy's result (float16: numpy's single float32 sum over k; object
    floats: Python's own sum in k order, compared as float64 bits; long doubles by value,
    their padding bytes being undefined)."""
    check(what + " dtype", c.dtype == ref.dtype, f"{c.dtype} != {ref.dtype}")
    check(what + " shape", c.shape == ref.shape, f"{c.shape} != {ref.shape}")
    if c.dtype == ref.dtype and c.shape == ref.shape and c.dtype.char in "gG":
        differ = int(np.count_nonzero(c != ref))
        check(what + " values", differ == 0, f"{differ} of {ref.size} elements differ from numpy")
    elif c.dtype == ref.dtype and c.shape == ref.shape:
        if c.dtype.kind == "O":
            c, ref = c.astype(np.float64), ref.astype(np.float64)
        differ = int(np.count_nonzero((c.view(np.uint8).reshape(-1, c.itemsize)
                                       != ref.view(np.uint8).reshape(-1, ref.itemsize)).any(1)))
        check(what + " bits", differ == 0, f"{differ} of {ref.size} elements differ from numpy")


def case_one_sum_bits():
    """float16, long double and object-float results are numpy's bits on any number of
    ranks: one sum over k (float32 for float16, numpy's loop without BLAS for long doubles,
    Python's additions in k order for objects), not partial sums of panels or layers added
    afterwards (fresh operands each run, the same on every rank; long odd k)."""
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if rank == 0 else None)
    r = np.random.default_rng(seed)
    for dt in ("float16", "object", "longdouble", "clongdouble"):
        def rand(*shape):
            x = r.standard_normal(shape)
            return (x + 1j * r.standard_normal(shape) if dt == "clongdouble" else x).astype(dt)

        tag = f"{dt} (seed {seed})"
        for m, k, n in ((63, 613, 65), (33, 1031, 17), (5, 257, 301), (1, 777, 1)):
            a, b = rand(m, k), rand(k, n)
            exact(distmm.matmul(a, b, engine="mpi"), np.matmul(a, b), f"{m}x{k}x{n} {tag}")
        s, b = rand(3, 21, 515), rand(515, 19)
        exact(distmm.matmul(s, b, engine="mpi"), np.matmul(s, b), f"stack 3x21x515 {tag}")
        a, b = rand(61, 1001), rand(1001, 67)
        ref = np.matmul(a, b)
        da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
        exact(distmm.matmul(da, db).gather(root=None), ref, f"DistArray {tag}")
        engine = MPIEngine(comm)
        for shape in grid_shapes(P):  # k split into layers too; in core and in broadcast stripes
            grid = make_grid(61, 67, 1001, dt, ranks=P, grid=shape)
            for streamed in (False, True):
                c = engine.run_distributed(da, db, grid, "numba", streamed=streamed)
                exact(c.gather(root=None), ref, f"grid {shape} streamed={streamed} {tag}")


def case_one_rank_refuses():
    """Operands that only the last rank's validation refuses: numpy's error there, a
    ValueError naming that rank on the others, and no rank left waiting in the engine."""
    if P == 1:
        return
    a, b = operands("float64", 7, 5, 3)
    ok_axes = dict(axes=[(-2, -1), (-2, -1), (-2, -1)])
    refused = {
        "inner dimensions": (a, b[:-1], {}),
        "0-d operand": (np.float64(2.0), b, {}),
        "string operand": (a.astype(str), b, {}),
        "out= numpy refuses to cast into": (a, b, dict(out=np.empty((7, 3), dtype=np.int64))),
        "out= of the wrong shape": (a, b, dict(out=np.empty((7, 4)))),
        "axes=": (a, b, dict(axes=[(0, 1), (0, 1), (0,)])),
        "out= a tuple of two": (a, b, dict(out=(np.empty((7, 3)), np.empty((7, 3))))),
        "out= read-only": (a, b, dict(out=np.empty((7, 3)))),
        "out= a list": (a, b, dict(out=[[0.0] * 3] * 7)),
    }
    refused["out= read-only"][2]["out"].flags.writeable = False
    for what, (x, y, kw) in refused.items():
        if rank != P - 1:
            x, y, kw = a, b, (ok_axes if "axes" in kw else {})
        try:
            np.matmul(x, y, **kw)
            expect = None
        except Exception as exc:  # noqa: BLE001 - numpy's error, compared below
            expect = TypeError if isinstance(exc, TypeError) else ValueError
        try:
            distmm.matmul(x, y, engine="mpi", **kw)
            failures.append(f"rank {rank}: {what} on rank {P - 1} only: no error here")
        except Exception as exc:  # noqa: BLE001 - checked below
            if rank == P - 1:
                check(f"{what}: numpy's error type", expect is not None and isinstance(exc, expect),
                      f"{type(exc).__name__}: {exc}")
            else:
                check(f"{what}: ValueError naming rank {P - 1}",
                      type(exc) is ValueError and f"rank {P - 1} of {P}" in str(exc)
                      and "\n" not in str(exc), f"{type(exc).__name__}: {exc}")
    # arguments only the last rank refuses (they hung the others in the engine), then
    # valid settings that differ between ranks (the last rank alone on its own precision)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    for what, kw, expect in (("tile=", dict(tile=(0, 5, 5)), ValueError),
                             ("backend=", dict(backend="gpu"), ValueError),
                             ("precision= that differs", dict(precision="bf16"), None)):
        try:
            distmm.matmul(a32, b32, engine="mpi", **(kw if rank == P - 1 else {}))
            failures.append(f"rank {rank}: {what} on rank {P - 1} only: no error here")
        except Exception as exc:  # noqa: BLE001 - checked below
            named = f"rank {P - 1} of {P}" if expect is not None else f"on rank {P - 1}"
            check(f"{what} on rank {P - 1} only: a ValueError", type(exc) is ValueError
                  and (rank == P - 1 and expect is not None or named in str(exc))
                  and "\n" not in str(exc), f"{type(exc).__name__}: {exc}")
    # calls numpy computes itself on the last rank alone: a ValueError on every rank
    for what, (x, y, kw) in {"signature=": (a, b, dict(signature="dd->d")),
                             "object @ str": (a.astype(object), b.astype(str), {})}.items():
        if rank != P - 1:
            x, y, kw = a, b, {}
        try:
            distmm.matmul(x, y, engine="mpi", **kw)
            failures.append(f"rank {rank}: {what} on rank {P - 1} only: no error here")
        except Exception as exc:  # noqa: BLE001 - checked below
            check(f"{what} on rank {P - 1} only: a ValueError on every rank",
                  type(exc) is ValueError and "numpy" in str(exc) and "\n" not in str(exc),
                  f"{type(exc).__name__}: {exc}")
    # b of another dtype on the last rank alone (the same result dtype): the settings' line,
    # naming the dtypes, not "the values of b differ"
    try:
        distmm.matmul(a, b.astype(np.float32) if rank == P - 1 else b, engine="mpi")
        failures.append(f"rank {rank}: b float32 on rank {P - 1} only: no error here")
    except Exception as exc:  # noqa: BLE001 - checked below
        check(f"b float32 on rank {P - 1} only: a ValueError naming the dtypes",
              type(exc) is ValueError and "b dtype" in str(exc) and "'<f4'" in str(exc)
              and "\n" not in str(exc), f"{type(exc).__name__}: {exc}")
    # the same shapes and dtype, other values on the last rank (an unseeded generator, say):
    # a ValueError on every rank naming the operand, not a product mixing the ranks' blocks
    stack = np.stack([a, a])
    for what, (x, y) in (("a", (a + 1, b)), ("b", (a, b * 2)), ("a and b", (a + 1, b * 2)),
                         ("a", (np.stack([a, a + 1]), b)),
                         ("b", (a.astype(np.longdouble), b.astype(np.longdouble) * 2)),
                         ("a", ((a + 1).astype(object), b.astype(object)))):
        if rank != P - 1:
            x, y = (stack if x.ndim == 3 else a).astype(x.dtype), b.astype(y.dtype)
        try:
            distmm.matmul(x, y, engine="mpi")
            failures.append(f"rank {rank}: other values of {what} on rank {P - 1}: no error")
        except Exception as exc:  # noqa: BLE001 - checked below
            check(f"other values of {what} ({x.ndim}-d, {x.dtype}) on rank {P - 1}: a "
                  f"ValueError naming them on every rank", type(exc) is ValueError
                  and f"values of {what} differ" in str(exc) and "\n" not in str(exc),
                  f"{type(exc).__name__}: {exc}")
    # DistArray operands: what one rank refuses or sets differently raises on every rank
    da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
    for what, kw, bb in (("out=", dict(out=np.empty((7, 3))), b),
                         ("precision= a float64 refuses", dict(precision="tf32"), b),
                         ("a replicated operand of another k", {}, b[:-1]),
                         # the same result dtype, blocks of another: MPI_ERR_TRUNCATE, a hang
                         ("a replicated operand of another dtype", {}, b.astype(np.float32)),
                         # the same shape and dtype, other values: a product mixing them
                         ("a replicated operand of other values", {}, b * 2)):
        mine = (kw, bb) if rank == P - 1 else ({}, b)
        try:
            distmm.matmul(da, mine[1], **mine[0]) if "replicated" in what else \
                distmm.matmul(da, db, **mine[0])
            failures.append(f"rank {rank}: DistArray {what} on rank {P - 1} only: no error")
        except Exception as exc:  # noqa: BLE001 - checked below
            check(f"DistArray {what} on rank {P - 1} only: one line on every rank",
                  isinstance(exc, (ValueError, TypeError)) and "\n" not in str(exc)
                  and ("values" not in what or "values of the replicated b differ" in str(exc)),
                  f"{type(exc).__name__}: {exc}")
    same(distmm.matmul(da, db).gather(root=None), a, b, "a DistArray product after them")
    same(distmm.matmul(a, b, engine="mpi"), a, b, "a product after the refusals")


class Refused(Exception):
    """An object element's own error (not a numpy type)."""


class Refuses:
    def __mul__(self, other):
        raise Refused("this element refuses to multiply")

    __rmul__ = __mul__


def case_product_errors_agree():
    """An error in one rank's own part of the product (an object element numpy cannot
    multiply, a floating-point flag under ``np.errstate(...="raise")``) raises numpy's
    error on every rank, as ``np.matmul`` of the whole operands does; under "warn" every
    rank warns as numpy does, once. No rank aborts or waits; the next product works."""
    import warnings

    def outcome(call):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - compared below
                return type(exc), sorted(str(w.message) for w in seen)
        return None, sorted(str(w.message) for w in seen)

    engine = MPIEngine(comm)
    m, k, n = 4 * P + 3, 7, 3
    for bad, what in ((None, "None"), ("x", "a str"), (Refuses(), "an element whose * raises")):
        a, b = operands("object", m, k, n)
        a[m - 1, 3] = bad  # in the last row block: on the last ranks' part of the product
        want = outcome(lambda: np.matmul(a, b))
        check(f"object with {what}: numpy raises", want[0] is not None, str(want))
        check(f"object with {what}: every rank raises numpy's error",
              outcome(lambda: distmm.matmul(a, b, engine="mpi")) == want)
        da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
        for shape in grid_shapes(P):
            grid = make_grid(m, n, k, "object", ranks=P, grid=shape)
            got = outcome(lambda: engine.run_distributed(da, db, grid, "numba"))
            check(f"object with {what}, grid {shape}: numpy's error", got == want, str(got))
    class Exits:
        def __mul__(self, other):
            raise SystemExit(3)

        __rmul__ = __mul__

    a, b = operands("object", m, k, n)
    a[m - 1, 3] = Exits()
    for call in (lambda: np.matmul(a, b), lambda: distmm.matmul(a, b, engine="mpi")):
        try:
            call()
            check("an element raising SystemExit: SystemExit", False, "no exception")
        except SystemExit as exc:
            check("an element raising SystemExit: its code on every rank", exc.code == 3)
    # a stack reports its flags once, as numpy's loop does (errstate "call" counts them)
    s, t = np.full((3, 2, 4), 1e200), np.full((4, 2), 1e200)
    for run in (np.matmul, lambda x, y: distmm.matmul(x, y, engine="mpi")):
        calls = []
        with np.errstate(all="call", call=lambda kind, flag: calls.append(kind)):
            run(s, t)
        if run is np.matmul:
            want_calls = calls
        else:
            check("a stack's flags reported once", calls == want_calls, f"{calls} {want_calls}")
    a, b = operands("float64", m, k, n)
    a[0, 1], b[1, 0] = np.inf, 0.0  # one element of C is invalid (inf * 0)
    # one overflows: in the product, or (float16) only when its float32 sum is rounded
    big = {"float64": 1e200, "float32": 1e30, "float16": 300.0}
    for state in ("raise", "warn", "ignore"):
        for dt, backend in (("float64", "auto"), ("float64", "numba"), ("float32", "auto"),
                            ("float16", "auto")):
            x, y = a.copy(), b.copy()
            x[m - 1, 2] = y[2, n - 1] = big[dt]
            x, y = x.astype(dt), y.astype(dt)
            with np.errstate(all=state):
                want = outcome(lambda: np.matmul(x, y))
                got = outcome(lambda: distmm.matmul(x, y, engine="mpi", backend=backend))
            check(f"{dt} {backend} under errstate {state}: numpy's flags on every rank",
                  got == want, f"{got} != numpy's {want}")
            if dt == "float16":  # numpy fills out=, then reports
                o_np, o_mpi = np.full((m, n), -7, dt), np.full((m, n), -7, dt)
                with np.errstate(all=state):
                    want_o = outcome(lambda: np.matmul(x, y, out=o_np))
                    got_o = outcome(lambda: distmm.matmul(x, y, engine="mpi", out=o_mpi))
                check(f"float16 out= under errstate {state}: filled, then numpy's flags",
                      got_o == want_o and np.array_equal(o_mpi, o_np, equal_nan=True),
                      f"{got_o} {want_o}")
            if dt == "float64" and backend == "numba":  # in broadcast stripes (threads)
                dx, dy = DistArray.from_array(x, comm), DistArray.from_array(y, comm)
                grid = make_grid(m, n, k, dt, ranks=P)
                with np.errstate(all=state):
                    got = outcome(lambda: engine.run_distributed(dx, dy, grid, backend,
                                                                 streamed=True))
                check(f"stripes under errstate {state}: numpy's flags on every rank",
                      got == want, f"{got} != numpy's {want}")
    # in stripes an element's error is numpy's on every rank, wherever it is: in the first,
    # a middle or the last stripe of a rank's rows, while the ranks of other grid rows still
    # broadcast theirs (held to the end, not told: told, it stopped those ranks at different
    # broadcasts and four ranks hung); nothing stops a later product
    tall = 90
    for row in (0, tall // 3, tall - 1):
        a, b = operands("object", tall, k, n)
        a[row, 3] = None
        want = outcome(lambda: np.matmul(a, b))
        da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
        for shape in grid_shapes(P):
            grid = make_grid(tall, n, k, "object", ranks=P, grid=shape)
            got = outcome(lambda: engine.run_distributed(da, db, grid, "numba", streamed=True))
            check(f"object in stripes, None in row {row}, grid {shape}: numpy's error on "
                  f"every rank", got == want, f"{got} != numpy's {want}")
    a, b = operands("float64", m, k, n)
    da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
    for _ in range(2):
        c = engine.run_distributed(da, db, make_grid(m, n, k, "float64", ranks=P), "numba",
                                   streamed=True)
        same(c.gather(root=None), a, b, "stripes after a stopped product")
    same(distmm.matmul(a, b, engine="mpi"), a, b, "a product after the errors")


class Held:
    """An object element that multiplies and adds as its value but does not pickle (one
    holding a lock or an open file, say)."""

    def __init__(self, v):
        self.v = v

    def __mul__(self, other):
        return Held(self.v * getattr(other, "v", other))

    def __add__(self, other):
        return Held(self.v + getattr(other, "v", other))

    __rmul__, __radd__ = __mul__, __add__

    def __eq__(self, other):
        return self.v == getattr(other, "v", other)

    def __reduce__(self):
        raise TypeError("a Held element does not pickle")


class Makes(Held):
    """Pickles, but its products are ``Held``."""

    def __reduce__(self):
        return Makes, (self.v,)


class Lost(Held):
    """Pickles, but does not unpickle on the receiving rank."""

    def __reduce__(self):
        return _refuse, (self.v,)


def _refuse(v):
    raise ValueError("a Lost element does not unpickle")


def case_objects_that_do_not_pickle():
    """Object elements that cannot move between ranks (no pickle, products that do not
    pickle, no unpickle): numpy's result on every rank for operands every rank holds
    (computed by each), one NotPicklable on every rank for DistArrays, in blocks and in
    stripes; no rank aborts or waits, and the next product works."""
    from distmm.errors import NotPicklable

    m, k, n = 4 * P + 3, 7, 3
    engine = MPIEngine(comm)
    for kind in (Held, Makes, Lost):
        a, b = operands("object", m, k, n)
        a[m - 1, 3] = kind(2)
        want = np.matmul(a, b)
        got = distmm.matmul(a, b, engine="mpi")
        check(f"{kind.__name__} elements: numpy's result on every rank",
              got.shape == want.shape and bool(np.all(got == want)))
        if P == 1:
            continue
        da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
        for streamed in (False, True):
            for shape in grid_shapes(P):
                grid = make_grid(m, n, k, "object", ranks=P, grid=shape)
                try:
                    engine.run_distributed(da, db, grid, "numba",
                                           streamed=streamed).gather(root=None)
                    check(f"{kind.__name__} DistArray product, grid {shape}, streamed "
                          f"{streamed}: NotPicklable", False, "no error")
                except NotPicklable as exc:
                    check(f"{kind.__name__} DistArray: one line", "\n" not in str(exc), str(exc))
    a, b = operands("object", m, k, n)
    same(distmm.matmul(a, b, engine="mpi"), a, b, "an object product after them")


def case_distarray_refusals_agree():
    """DistArray arguments that only one rank gets wrong (a 1-D block, another grid, another
    file name for ``to_file``, a suffix only that rank refuses), and a ``to_file`` path through
    a file: one error on every rank and nothing left in the folder, where the other ranks
    waited for it in a collective before (the timeout)."""
    if P == 1:
        return
    last = rank == P - 1
    good = np.ones((2, 3))
    attempts = {
        "from_local 1-D block": lambda: DistArray.from_local(np.ones(3) if last else good,
                                                             grid=(P, 1)),
        "from_local another grid": lambda: DistArray.from_local(
            good, grid=(1, P) if last else (P, 1)),
        "from_local a grid of three": lambda: DistArray.from_local(
            good, grid=(P, 1, 1) if last else (P, 1)),
    }
    d = DistArray.from_local(good, grid=(P, 1))
    folder = f"{tmp}/refusals"
    if rank == 0:
        import os

        os.makedirs(folder, exist_ok=True)
    comm.Barrier()
    attempts["to_file another name"] = lambda: d.to_file(f"{folder}/c{int(last)}.npy")
    attempts["to_file a suffix one rank refuses"] = lambda: d.to_file(
        f"{folder}/c.txt" if last else f"{folder}/c.npy")
    attempts["to_file another overwrite"] = lambda: d.to_file(f"{folder}/c.npy", overwrite=last)
    for what, attempt in attempts.items():
        try:
            attempt()
            check(what, False, "no error")
        except (ValueError, TypeError) as exc:
            message = comm.allgather(str(exc).splitlines()[0])
            check(what + ": one message on every rank", len(set(message)) == 1, str(message))
    import os

    if rank == 0:
        open(f"{folder}/f", "w").close()
    comm.Barrier()
    for target in (f"{folder}/f/d/c.npy", f"{folder}/f/c.npy"):  # a path through a file
        try:
            d.to_file(target)
            check(f"to_file {target}", False, "no error")
        except NotADirectoryError as exc:  # on 2+ ranks rank 0 left the others waiting
            message = comm.allgather(str(exc).splitlines()[0])
            check(f"to_file {target}: one message naming the file on every rank",
                  len(set(message)) == 1 and f"{folder}/f is not a folder" in message[0],
                  str(message))
    comm.Barrier()
    if rank == 0:
        os.remove(f"{folder}/f")
    comm.Barrier()
    left = sorted(os.listdir(folder))
    check("refused writes leave nothing", left == [], str(left))
    same(DistArray.from_local(good, grid=(P, 1)).gather(root=None), np.ones((2 * P, 3)),
         np.eye(3), "from_local after the refusals")


def case_distarray_arguments_agree():
    """DistArray calls whose arguments are wrong on every rank or only on the last one (a
    grid of negative sizes or floats, blocks of another dtype, a gather root that is no rank
    or another rank's, from_array or from_file given another array, a file missing on one
    rank, a layout for ranks that do not exist or another layout on one rank): one error
    of the expected type on every rank, the same line everywhere, naming what was wrong.
    Before: an IndexError or a bare TypeError, None from gather on every rank, a matrix
    mixing the ranks' arrays or holding uninitialised memory, MPI_ERR_TRUNCATE on one rank,
    a block lost, or a hang (the timeout)."""
    if P == 1:
        return
    last = rank == P - 1
    good = np.arange(6.0).reshape(2, 3) + rank
    full = np.concatenate([np.arange(6.0).reshape(2, 3) + r for r in range(P)])
    d = DistArray.from_local(good, grid=(P, 1))
    x = np.arange(20.0).reshape(4, 5)
    if rank == 0:
        np.save(f"{tmp}/agree_x.npy", x)
        np.save(f"{tmp}/agree_y.npy", x[:3])
    comm.Barrier()
    tall, wide = BlockLayout.grid(d.shape, P, 1), BlockLayout.grid(d.shape, 1, P)
    attempts = {
        "from_local float32 blocks on the last rank": (
            lambda: DistArray.from_local(good.astype(np.float32) if last else good, grid=(P, 1)),
            TypeError, f"float64 on rank 0, float32 on rank {P - 1}"),
        "from_local structured blocks of another dtype of the same size on the last rank": (
            lambda: DistArray.from_local(np.zeros((2, 3), [("b", "<i8")] if last else
                                                  [("a", "<f8")]), grid=(P, 1)),
            TypeError, f"on rank {P - 1}"),
        "from_local a grid of negative sizes": (
            lambda: DistArray.from_local(good, grid=(-1, -P)), ValueError, f"grid -1 x -{P}"),
        "from_local a grid of floats": (
            lambda: DistArray.from_local(good, grid=(float(P), 1.0)), TypeError,
            "grid must be two ints"),
        "gather to a root past the last rank": (
            lambda: d.gather(P), ValueError, f"root {P} is not one of the {P} ranks"),
        "gather to root -1": (lambda: d.gather(-1), ValueError, "root -1 is not one of"),
        "gather to a float root": (lambda: d.gather(1.0), TypeError, "root must be a rank"),
        "gather to another root on the last rank": (
            lambda: d.gather(P - 1 if last else 0), ValueError,
            f"root=0 on rank 0, root={P - 1} on rank {P - 1}"),
        "from_array another shape on the last rank": (
            lambda: DistArray.from_array(x[:3] if last else x).gather(0), ValueError,
            f"(3, 5) float64 on rank {P - 1}"),
        "from_array another dtype on the last rank": (
            lambda: DistArray.from_array(x.astype(np.float32) if last else x).gather(None),
            ValueError, f"(4, 5) float32 on rank {P - 1}"),
        "from_array other values on the last rank, written": (
            lambda: DistArray.from_array(x + last).to_file(f"{tmp}/agree_never.npy"),
            ValueError, f"values differ between rank 0 and rank {P - 1}"),
        "from_array other values on the last rank, multiplied": (
            lambda: distmm.matmul(DistArray.from_array(x + last), DistArray.from_array(x.T)),
            ValueError, f"values differ between rank 0 and rank {P - 1}"),
        "from_file a file missing on the last rank": (
            lambda: DistArray.from_file(f"{tmp}/agree_{'none' if last else 'x'}.npy"),
            FileNotFoundError, "agree_none.npy"),
        "from_file another shape on the last rank": (
            lambda: DistArray.from_file(f"{tmp}/agree_{'y' if last else 'x'}.npy"), ValueError,
            f"(3, 5) float64 in {tmp}/agree_y.npy on rank {P - 1}"),
        "redistribute to owners past the last rank": (
            lambda: d.redistribute(BlockLayout.grid(d.shape, 1, P + 1)), ValueError,
            f"are not a 1 x {P + 1} grid of the ranks 0 to {P - 1}"),
        "redistribute to another layout on the last rank": (
            lambda: d.redistribute(wide if last else tall), ValueError,
            f"rank 0's and rank {P - 1}'s differ"),
    }
    for what, (attempt, expect, words) in attempts.items():
        try:
            attempt()
            check(what, False, "no error")
        except Exception as exc:  # noqa: BLE001 - checked below
            message = comm.allgather(str(exc))
            check(what + f": {expect.__name__} naming it", type(exc) is expect and
                  words in str(exc) and "\n" not in str(exc), f"{type(exc).__name__}: {exc}")
            check(what + ": one message on every rank", len(set(message)) == 1, str(message))
    import os

    check("a refused to_file writes nothing", not os.path.exists(f"{tmp}/agree_never.npy"))
    check("gather after the refusals", np.array_equal(d.gather(None), full))
    check("redistribute after the refusals",
          np.array_equal(d.redistribute(wide).gather(P - 1), full if last else None))


CASES = (case_api_dtypes, case_api_semantics, case_every_grid, case_distarray,
         case_one_sum_bits, case_one_rank_refuses, case_product_errors_agree,
         case_objects_that_do_not_pickle, case_distarray_refusals_agree,
         case_distarray_arguments_agree)
chosen = [c for c in CASES if c.__name__ in sys.argv[2:]] if sys.argv[2:] else CASES
ok, all_failures = run_cases(comm, chosen, failures)
if rank == 0:
    if not ok:
        for f in all_failures[:30]:
            print(f)
    print("VERDICT", "ok" if ok else "FAIL", flush=True)
