"""Cases run under ``mpiexec -n P`` by tests/test_precision.py (not collected by pytest):
``precision=`` on the MPI engine (``engine="mpi"`` and ``DistArray`` products), within the
stated bound of a float64 reference, on odd sizes; the verdict agreed by every rank.
Usage: mpiexec -n P python tests/mpi_precision_cases.py TMPDIR
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import distmm
from distmm.engine.mpi import DistArray
from distmm.executor.reduced import round_to
from distmm.precision import error_bound
from mpi_verdict import run_cases

comm = MPI.COMM_WORLD
P, rank = comm.size, comm.rank
failures: list[str] = []
rng = np.random.default_rng(4321)  # the same operands on every rank
MODES = ("tf32", "bf16", "fp16")
SHAPES = [(22, 23, 24), (P * 3 + 1, 2 * P + 1, 5 * P + 3), (1, 9, 7), (41, 3, 200)]


def check(name, cond, detail=""):
    if not cond:
        failures.append(f"rank {rank}: {name} {detail}")


def operands(m, k, n):
    """float32 values with bits below TF32's and bfloat16's significands."""
    def one(shape):
        frac = rng.integers(1, 2**20, size=shape) * 2.0**-20
        return (rng.choice([-1.0, 1.0], size=shape) * (1 + frac)).astype(np.float32)
    return one((m, k)), one((k, n))


def bounded(c, a, b, mode, what):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    err = np.abs(np.asarray(c, np.float64) - a64 @ b64)
    bound = error_bound(mode, a.shape[1]) * (np.abs(a64) @ np.abs(b64))
    check(what + " dtype", c.dtype == np.float32, str(c.dtype))
    check(what + " bound", bool(np.all(err <= bound)), f"worst {np.max(err / bound, initial=0)}")
    # the rounded operands' exact product, up to float32 sums: the rounding happened
    ar, br = round_to(a, mode).astype(np.float64), round_to(b, mode).astype(np.float64)
    k = a.shape[1]
    gamma = max(k - 1, 0) * 2.0**-24 / (1 - max(k - 1, 0) * 2.0**-24)
    check(what + " rounded", bool(np.all(np.abs(np.asarray(c, np.float64) - ar @ br)
                                         <= gamma * (np.abs(ar) @ np.abs(br)))))


def case_engine():
    for m, n, k in SHAPES:
        a, b = operands(m, k, n)
        for mode in MODES:
            bounded(distmm.matmul(a, b, engine="mpi", precision=mode), a, b, mode,
                    f"engine {mode} {m}x{n}x{k}")
        check(f"highest {m}x{n}x{k}", np.allclose(distmm.matmul(a, b, engine="mpi"), a @ b,
                                                  rtol=1e-5, atol=1e-5))


def case_gemm_transposed():
    a, b = operands(19, 31, 27)
    c = distmm.gemm(np.ascontiguousarray(a.T), b, trans_a=True, engine="mpi", precision="bf16")
    bounded(c, a, b, "bf16", "gemm trans_a")


def case_distarray():
    a, b = operands(2 * P + 3, 3 * P + 1, 17)
    da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
    for mode in MODES:
        c = distmm.matmul(da, db, precision=mode).gather(root=None)
        bounded(c, a, b, mode, f"DistArray {mode}")
    try:
        distmm.matmul(DistArray.from_array(a.astype(np.float64), comm), db, precision="tf32")
        failures.append(f"rank {rank}: a float64 DistArray product took precision='tf32'")
    except TypeError:
        pass


def case_dtypes_and_specials():
    """float16 operands keep float16 (within the bound with its last rounding) and bfloat16
    ones give float32, as numpy; NaN, infinities, float16's range (65520 rounds to inf
    under fp16) and signed zeros come out as on the local engine."""
    import ml_dtypes

    for dt in (np.float16, np.dtype(ml_dtypes.bfloat16)):
        a = rng.standard_normal((2 * P + 5, 37)).astype(dt)
        b = rng.standard_normal((37, P + 4)).astype(dt)
        want = np.matmul(a, b).dtype
        for mode in MODES:
            c = distmm.matmul(a, b, engine="mpi", precision=mode)
            what = f"{np.dtype(dt).name} {mode}"
            check(what + " dtype", c.dtype == want, f"{c.dtype} != {want}")
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            out = np.float16 if dt == np.float16 else None
            bound = error_bound(mode, 37, out_dtype=out) * (np.abs(a64) @ np.abs(b64))
            check(what + " bound", bool(np.all(np.abs(c.astype(np.float64) - a64 @ b64) <= bound)))
    a = np.array([[np.inf, 1, 0], [np.nan, 1, 1], [-0.0, -0.0, -0.0], [65504, 65520, 1e-8],
                  [-1e-30, 2, 3]], np.float32)
    b = np.array([[0, 1], [1, 1], [1, 7e4]], np.float32)
    for mode in MODES:
        with np.errstate(all="ignore"):
            got = distmm.matmul(a, b, engine="mpi", precision=mode)
            local = distmm.matmul(a, b, engine="local", precision=mode)
        num = ~np.isnan(local)  # a NaN's sign bit means nothing
        check(f"specials {mode}", np.array_equal(got, local, equal_nan=True)
              and np.array_equal(np.signbit(got)[num], np.signbit(local)[num]),
              f"{got} != {local}")


ok, all_failures = run_cases(comm, (case_engine, case_gemm_transposed, case_distarray,
                                    case_dtypes_and_specials), failures)
if rank == 0:
    if not ok:
        for f in all_failures[:30]:
            print(f)
    print("VERDICT", "ok" if ok else "FAIL", flush=True)
