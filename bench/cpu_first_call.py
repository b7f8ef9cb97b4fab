"""Benchmark ``cpu-first-call``: a user's first ``distmm.matmul`` on the CPU, and the warm ones.

For each dtype that ``backend="auto"`` hands to distmm's numba kernels on the CPU (integers,
summed in int64 or uint64, and float16, whose float32 sums they compute) and each size
(``n x n @ n x n``), two variants, each in fresh processes:

``distmm``
    ``distmm.matmul(a, b)``: backend ``auto``, local engine.
``numpy``
    ``a @ b``: numpy's own loop (no BLAS for these dtypes), the same-run reference.

Every sample is a new process (this script with ``--child``) that imports numpy and distmm
(not timed: a user has imported them), makes the operands and times the first call of the
process, then ``--warm`` calls at once (``seconds``: a user's second, third, ... call), then
calls until distmm's numba kernels are loaded (at most ``--settle`` calls) and ``--warm`` more
(``steady_seconds``). A record holds the medians over ``--repeat`` processes:
``first_seconds`` of the first calls, ``seconds`` and ``steady_seconds`` of all their warm
calls; for ``distmm``, ``kernels_after_first`` counts the processes whose first call loaded the
kernels and ``kernels_call`` is the call that loaded them (1: the first; the median, None where
none did). The first result of each process is checked against a float64 reference. numpy's
loop at n = 2048 takes 40-55 s a call on a 2-core VM: ``--numpy-max-n`` (default 1024) bounds
the sizes it is measured at.

Usage::

    flock /tmp/distmm-bench.lock python -m bench.cpu_first_call
    python -m bench.cpu_first_call --dtypes int64 --sizes 256 --repeat 5 --out-dir /tmp/r
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
_KERNELS = "distmm.kernels.numba_gemm"


def _inputs(dtype: str, n: int, seed: int):
    """Random operands: integers in [-1000, 1000) ([0, 1000) unsigned), float16 normal."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        low = 0 if dt.kind == "u" else -1000
        return (rng.integers(low, 1000, size=(n, n)).astype(dt),
                rng.integers(low, 1000, size=(n, n)).astype(dt))
    return (rng.standard_normal((n, n)).astype(dt), rng.standard_normal((n, n)).astype(dt))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child(dtype: str, n: int, variant: str, warm: int, settle: int, seed: int) -> dict:
    """One sample, in this (fresh) process: the first call, ``warm`` calls, then calls until
    the kernels are loaded (at most ``settle``) and ``warm`` more."""
    import distmm
    from bench.common import relerr

    a, b = _inputs(dtype, n, seed)
    fn = (lambda: distmm.matmul(a, b)) if variant == "distmm" else (lambda: a @ b)
    t0 = time.perf_counter()
    c = fn()
    first = time.perf_counter() - t0
    loaded_by = 1 if _KERNELS in sys.modules else None  # the call that loaded the kernels
    err = relerr(c, a.astype(np.float64) @ b.astype(np.float64))
    del c
    warm_times = []
    for call in range(2, 2 + warm):
        warm_times.append(_timed(fn))
        loaded_by = loaded_by or (call if _KERNELS in sys.modules else None)
    call = 1 + warm
    while variant == "distmm" and loaded_by is None and call < 1 + warm + settle:
        fn()
        call += 1
        loaded_by = call if _KERNELS in sys.modules else None
    # numpy's loop loads nothing: its warm calls are its steady ones
    steady = [_timed(fn) for _ in range(warm)] if variant == "distmm" else warm_times
    return {"first": first, "warm": warm_times, "steady": steady, "relerr": err,
            "kernels_call": loaded_by}


def _sample(dtype: str, n: int, variant: str, warm: int, settle: int, seed: int) -> dict:
    cmd = [sys.executable, "-m", "bench.cpu_first_call", "--child", dtype, str(n), variant,
           str(warm), str(settle), str(seed)]
    r = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{variant} {dtype} n={n}: the sample's process failed "
                         f"(status {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from bench.common import RecordWriter, cpu_model, parser

    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        dtype, n, variant, warm, settle, seed = argv[1:7]
        print(json.dumps(child(dtype, int(n), variant, int(warm), int(settle), int(seed))))
        return 0
    p = parser(__doc__, prog="python -m bench.cpu_first_call")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--dtypes", nargs="+", default=["int64", "uint64", "int32", "float16"])
    p.add_argument("--repeat", type=int, default=5, help="fresh processes per variant and case")
    p.add_argument("--warm", type=int, default=3, help="timed warm calls per process")
    p.add_argument("--settle", type=int, default=2000,
                   help="most calls a process makes for the kernels to load before the steady ones")
    p.add_argument("--numpy-max-n", type=int, default=1024,
                   help="largest n at which numpy's loop is measured")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.repeat < 5:
        p.error("--repeat: medians of at least 5 processes")
    if args.warm < 1:
        p.error("--warm must be at least 1")

    from distmm.engine.local import default_workers

    writer = RecordWriter("cpu-first-call", cpu_model(), out_dir=args.out_dir,
                          workers=default_workers(), numpy_version=np.__version__,
                          processes=args.repeat, engine="local", backend="auto")
    print(f"{'dtype':8s} {'n':>5s} {'variant':7s} {'first s':>9s} {'warm s':>9s} {'steady s':>9s}"
          f" {'kernels':>8s}", flush=True)
    for dtype in args.dtypes:
        for n in args.sizes:
            variants = ["distmm"] + (["numpy"] if n <= args.numpy_max_n else [])
            for variant in variants:
                runs = [_sample(dtype, n, variant, args.warm, args.settle, seed=1000 * n + i)
                        for i in range(args.repeat)]
                first = [r["first"] for r in runs]
                warm = [t for r in runs for t in r["warm"]]
                steady = [t for r in runs for t in r["steady"]]
                calls = [r["kernels_call"] for r in runs if r["kernels_call"] is not None]
                rec = writer.add(
                    variant, dtype, n, n, n, statistics.median(warm),
                    max(r["relerr"] for r in runs), first_seconds=statistics.median(first),
                    first_all=first, steady_seconds=statistics.median(steady),
                    warm_calls=args.warm, timer="wall", note=args.note,
                    **({"kernels_after_first": sum(r["kernels_call"] == 1 for r in runs),
                        "kernels_call": statistics.median(calls) if calls else None}
                       if variant == "distmm" else {}))
                loaded = (f"{rec['kernels_after_first']}/{args.repeat}"
                          if variant == "distmm" else "")
                print(f"{dtype:8s} {n:5d} {variant:7s} {rec['first_seconds']:9.4f} "
                      f"{rec['seconds']:9.4f} {rec['steady_seconds']:9.4f} {loaded:>8s}",
                      flush=True)
    print(f"run {writer.run}  device {writer.device}  records: {writer.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
