"""CPU benchmark: distmm's numba kernels on the local engine against numpy (OpenBLAS).

Writes one record per (variant, dtype, size) to
``bench/results/cpu-<cpu-model>-<date>.jsonl`` through ``bench.common`` and prints
a table of GFLOP/s and ratios to numpy measured in the same run.

Variants
--------
``numpy``
    ``a @ b``: OpenBLAS on every core for floats, numpy's own loop for integers.
``distmm-numba``
    ``distmm.matmul(a, b, backend="numba", engine="local")``: the planner's tiles,
    one task per C tile on a pool of one thread per core, each running
    ``kernels/numba_gemm.py`` on its tile.

Timing: inputs are random normal (integers: random in [-1000, 1000)), each result
is checked against a float64 reference before it is timed, every variant is warmed
up, then the variants are timed in alternation (numpy, distmm, numpy, ...) so
that load from other processes on this shared machine hits both alike; the
record holds the median. Run it under ``flock /tmp/distmm-bench.lock`` so that
benchmarks do not overlap::

    flock /tmp/distmm-bench.lock python -m bench.cpu
"""
from __future__ import annotations

import os
import sys

import numpy as np

import distmm
from bench.common import RecordWriter, alternating_seconds, cpu_model, parser, relerr


def _inputs(dtype: str, n: int, seed: int):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        a = rng.integers(-1000, 1000, size=(n, n)).astype(dtype)
        b = rng.integers(-1000, 1000, size=(n, n)).astype(dtype)
    else:
        a = rng.standard_normal((n, n)).astype(dtype)
        b = rng.standard_normal((n, n)).astype(dtype)
    return a, b


def main(argv=None) -> int:
    p = parser(__doc__, prog="python -m bench.cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    p.add_argument("--int-size", type=int, default=512,
                   help="n of the int64 case (numpy's integer loop is slow); 0 skips it")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--note", default="")
    args = p.parse_args(argv)

    from distmm.api import plan_for
    from distmm.engine.local import default_workers
    from distmm.kernels import numba_gemm

    env = {key: os.environ.get(key) for key in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    workers = default_workers()
    writer = RecordWriter(
        "cpu", cpu_model(), out_dir=args.out_dir, workers=workers,
        openblas_coretype_set=env["OPENBLAS_CORETYPE"] is not None,
        openblas_l2_size_set=env["OPENBLAS_L2_SIZE"] is not None,
        openblas_env={k: v for k, v in env.items() if v is not None},
        numpy_version=np.__version__,
        kernel={"MR": numba_gemm.MR, "NV": numba_gemm.NV, "MC": numba_gemm.MC,
                "NC": numba_gemm.NC},
    )
    cases = [(dt, n) for dt in args.dtypes for n in args.sizes]
    if args.int_size:
        cases.append(("int64", args.int_size))

    rows = []
    for dtype, n in cases:
        a, b = _inputs(dtype, n, seed=n)
        plan = plan_for(n, n, n, dtype, workers=workers)
        fns = {
            "numpy": lambda: a @ b,
            "distmm-numba": lambda: distmm.matmul(a, b, backend="numba", engine="local"),
        }
        ref = a.astype(np.float64) @ b.astype(np.float64)
        errs = {}
        for name, fn in fns.items():  # check, and warm up (numba compile, page faults)
            errs[name] = relerr(fn(), ref)
        repeat = args.repeat if np.dtype(dtype).kind == "f" else max(2, args.repeat // 2)
        secs = alternating_seconds(fns, repeat)
        for name in fns:
            extra = {"nr": numba_gemm.nr_for(dtype)} if name.startswith("distmm") else {}
            if name.startswith("distmm"):
                extra.update(tile=list(plan.tile), grid=list(plan.grid), backend="numba",
                             engine="local")
            rec = writer.add(name, dtype, n, n, n, secs[name], errs[name], repeat=repeat,
                             note=args.note, **extra)
            rows.append(rec)
        print(f"{dtype:8s} n={n:5d}  numpy {2 * n**3 / secs['numpy'] / 1e9:7.1f} GF/s  "
              f"distmm-numba {2 * n**3 / secs['distmm-numba'] / 1e9:7.1f} GF/s  "
              f"ratio {secs['numpy'] / secs['distmm-numba']:.2f}", flush=True)

    print(f"\nrun {writer.run}  device {writer.device}  workers {workers}  "
          f"OPENBLAS_CORETYPE set: {env['OPENBLAS_CORETYPE'] is not None}  "
          f"OPENBLAS_L2_SIZE set: {env['OPENBLAS_L2_SIZE'] is not None}")
    print(f"{'variant':14s} {'dtype':8s} {'n':>5s} {'seconds':>9s} {'GFLOP/s':>8s} "
          f"{'vs numpy':>8s} {'relerr':>9s}")
    by_key = {(r["dtype"], r["n"], r["variant"]): r for r in rows}
    for r in rows:
        base = by_key[(r["dtype"], r["n"], "numpy")]
        print(f"{r['variant']:14s} {r['dtype']:8s} {r['n']:5d} {r['seconds']:9.4f} "
              f"{r['tflops'] * 1e3:8.1f} {base['seconds'] / r['seconds']:8.2f} "
              f"{r['relerr']:9.2e}")
    print(f"records: {writer.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
