"""Benchmark ``api-overhead``: what one ``distmm.matmul`` call costs over the library it calls.

Two workloads, each against its reference in the same run, timed in alternation:

``cpu``
    float64 products of n = 8, 64 and 256 with numpy operands through
    ``distmm.matmul`` (local engine) against ``a @ b``. The record keeps the
    median wall time of a batch of calls, per call; ``overhead_us`` is distmm's
    time minus numpy's. ``distmm`` is the warm call (served from the call
    cache of ``distmm.api``), ``distmm-uncached`` the same call with the cache
    emptied before each one (validation, engine, backend and plan resolved in
    full). The first call of each size in the process is recorded too
    (``call: "first"``, one call, so noisy).
``gpu``
    float32 (and float64) cupy operands at n = 512 ... 8192 through
    ``distmm.matmul(a, b)`` (``backend="auto"`` and ``"cublas"``, and
    ``distmm-auto-uncached`` with the call cache emptied before each call)
    against ``cupy.matmul``, timed twice: CUDA events around the call
    (``timer: "cuda-event"``) and the host clock with the device synchronised
    (``timer: "wall"``). The first call of each variant in the process is
    recorded too (``call: "first"``), apart from the steady state (``call:
    "steady"``, the median of the repetitions).

Every result is checked against a float64 reference before it is timed.
Usage::

    python -m bench.api_overhead cpu
    python -m bench.api_overhead cpu --cpu-sizes 8 --repeat 3     # a short run
    python -m bench.api_overhead gpu --sizes 512 1024 2048 4096 --out-dir $OUT
"""
from __future__ import annotations

import sys
import time

import numpy as np

import distmm
from bench.common import RecordWriter, cpu_model, gpu_name, parser, relerr
from distmm.api import CALLS


def _uncached(a, b, **kw):
    """``distmm.matmul`` as a first call of its signature: the call cache emptied first."""
    CALLS.clear()
    return distmm.matmul(a, b, **kw)


def _alternate(fns: dict, repeat: int, number: int, sync=None) -> dict:
    """Median seconds per call of each callable, batches of ``number`` calls
    timed in turn ``repeat`` times."""
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            if sync:
                sync()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            if sync:
                sync()
            times[name].append((time.perf_counter() - t0) / number)
    return {name: float(np.median(t)) for name, t in times.items()}


def run_cpu(args) -> None:
    writer = RecordWriter("api-overhead", cpu_model(), args.out_dir, workload="cpu")
    rng = np.random.default_rng(args.seed)
    print(f"{'n':>6} {'numpy us':>10} {'first us':>10} {'uncached us':>12} {'distmm us':>10}"
          f" {'overhead us':>12}")
    for n in args.cpu_sizes:
        a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
        ref = a.astype(np.float64) @ b.astype(np.float64)
        t0 = time.perf_counter()
        got = distmm.matmul(a, b)  # the first call of this signature in the process
        first = time.perf_counter() - t0
        err = relerr(got, ref)
        if not err < 1e-12:
            raise SystemExit(f"distmm result wrong at n={n}: relerr {err}")
        err_uncached = relerr(_uncached(a, b), ref)
        if not err_uncached < 1e-12:
            raise SystemExit(f"uncached distmm result wrong at n={n}: relerr {err_uncached}")
        writer.add("distmm", "float64", n, n, n, first, err, timer="wall", call="first",
                   calls_per_sample=1, engine="local", note="one call: noisy")
        number = max(1, int(2e-3 / max(2 * n ** 3 / 20e9, 1e-7)))
        med = _alternate({"numpy": lambda: a @ b, "distmm": lambda: distmm.matmul(a, b),
                          "distmm-uncached": lambda: _uncached(a, b)}, args.repeat, number)
        errs = {"numpy": 0.0, "distmm": err, "distmm-uncached": err_uncached}
        for variant in ("numpy", "distmm", "distmm-uncached"):
            over = (med[variant] - med["numpy"]) * 1e6 if variant != "numpy" else None
            writer.add(variant, "float64", n, n, n, med[variant], errs[variant], timer="wall",
                       call="steady", calls_per_sample=number, overhead_us=over, engine="local")
        print(f"{n:>6} {med['numpy'] * 1e6:>10.2f} {first * 1e6:>10.1f}"
              f" {med['distmm-uncached'] * 1e6:>12.2f} {med['distmm'] * 1e6:>10.2f}"
              f" {(med['distmm'] - med['numpy']) * 1e6:>12.2f}")
    print(f"records: {writer.path}")


def run_gpu(args) -> None:
    import cupy

    writer = RecordWriter("api-overhead", gpu_name(), args.out_dir, workload="gpu")
    rng = np.random.default_rng(args.seed)
    sync = cupy.cuda.Device().synchronize
    rows = []
    for dtype in args.dtypes:
        for n in args.sizes:
            a_h = rng.standard_normal((n, n)).astype(dtype)
            b_h = rng.standard_normal((n, n)).astype(dtype)
            a, b = cupy.asarray(a_h), cupy.asarray(b_h)
            variants = {
                "cupy": lambda: cupy.matmul(a, b),
                "distmm-auto": lambda: distmm.matmul(a, b),
                "distmm-cublas": lambda: distmm.matmul(a, b, backend="cublas"),
                "distmm-auto-uncached": lambda: _uncached(a, b),
            }
            first = {}
            for name, fn in variants.items():  # first call of each, then the check
                sync()
                t0 = time.perf_counter()
                out = fn()
                sync()
                first[name] = time.perf_counter() - t0
                ref = a_h.astype(np.float64) @ b_h.astype(np.float64) if n <= 4096 else None
                err = relerr(cupy.asnumpy(out), ref) if ref is not None else None
                tol = 1e-5 if dtype == "float32" else 1e-12
                if err is not None and not err < tol:
                    raise SystemExit(f"{name} wrong at {dtype} n={n}: relerr {err}")
                writer.add(name, dtype, n, n, n, first[name], err, timer="wall", call="first")
            number = max(1, int(5e-3 / max(2 * n ** 3 / 50e12, 1e-6)))
            wall = _alternate(variants, args.repeat, number, sync=sync)
            events = {name: [] for name in variants}
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            for _ in range(args.repeat):
                for name, fn in variants.items():
                    start.record()
                    for _ in range(number):
                        fn()
                    stop.record()
                    stop.synchronize()
                    events[name].append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / number)
            event = {name: float(np.median(t)) for name, t in events.items()}
            for name in variants:
                writer.add(name, dtype, n, n, n, wall[name], None, timer="wall", call="steady",
                           calls_per_sample=number, note="checked on the first call")
                writer.add(name, dtype, n, n, n, event[name], None, timer="cuda-event",
                           call="steady", calls_per_sample=number, note="checked on the first call")
            rows.append((dtype, n, wall, event))
    print(f"{'dtype':>8} {'n':>6} {'cupy ms':>9} {'auto/cupy wall':>15} {'auto/cupy event':>16}"
          f" {'cublas/cupy wall':>17}")
    for dtype, n, wall, event in rows:
        print(f"{dtype:>8} {n:>6} {wall['cupy'] * 1e3:>9.3f} {wall['cupy'] / wall['distmm-auto']:>15.3f}"
              f" {event['cupy'] / event['distmm-auto']:>16.3f}"
              f" {wall['cupy'] / wall['distmm-cublas']:>17.3f}")
    print(f"records: {writer.path}")


def main(argv=None) -> int:
    p = parser(__doc__, "python -m bench.api_overhead")
    p.add_argument("workload", choices=["cpu", "gpu"], help="which calls to time")
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192],
                   help="gpu: matrix sizes n (n x n x n)")
    p.add_argument("--cpu-sizes", type=int, nargs="+", default=[8, 64, 256],
                   help="cpu: matrix sizes n")
    p.add_argument("--dtypes", nargs="+", default=["float32"], help="gpu: dtypes")
    p.add_argument("--repeat", type=int, default=7, help="timed samples per variant (median)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    args = p.parse_args(argv)
    (run_cpu if args.workload == "cpu" else run_gpu)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
