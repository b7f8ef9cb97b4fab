"""Which thread, warp and block tiles make step 10 (SIMT float64) fastest? A shape search next to cuBLAS.

What it answered (no 8 x 8 shape beat step 8; the best became the registry default) is
in bench/NOTES.md, "Step 10: SIMT float64".

For one kernel step (default ``simt_fp64``, step 10) and a list of configurations
(``--accumulators``: thread tiles with at least that many accumulators, from the step's
tuning space), in one process:

1. compile them all in parallel;
2. check each on a 4097 x 4097 x 4097 product against a float64 product (output poisoned
   with NaN first) and time it at ``--search`` (default 4096);
3. for the best ``--top``: check odd and transposed shapes (7, 33, 127, 1000 x 33 x 4097,
   all four layouts, alpha/beta) and time them at each ``--sizes`` alternating with
   cuBLAS DGEMM (``cupy.matmul``) in the same process, so both see the same clocks.

Records (benchmark ``kernels``): ``kernels-<device>-<date>.jsonl`` (variants ``cublas``, ``distmm-raw-<kernel>`` with
``params`` and ``note`` naming the search), ``tune-<kernel>`` records for the search.

    python -m bench.research.simt64_search --out-dir $OUT
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

import distmm.executor.registry as registry
from bench.common import (RecordWriter, event_seconds, gpu_name, parser, random_operands,
                          raw_runner, relerr_gpu)


def configs(spec, dtype: str, min_acc: int) -> list[dict]:
    out = [p for p in spec.candidates(dtype) if p["TM"] * p["TN"] >= min_acc]
    return out


CHECK_CASES = ((7, 7, 7), (33, 33, 33), (127, 127, 127), (1000, 33, 4097), (4097, 127, 33))


def check_shapes(spec, p, dtype="float64", *, cases=CHECK_CASES, nn_cases=(), defines=None,
                 split_tail=None) -> float:
    """Worst relative error over odd, rectangular and transposed products, alpha/beta, output
    poisoned with NaN; raises if one is wrong. ``cases`` run in all four layouts, ``nn_cases``
    only untransposed; ``defines`` and ``split_tail`` go to ``cuda_loader.launch``."""
    import cupy

    from distmm.executor import cuda_loader

    worst = 0.0
    layouts = [(ta, tb) for ta in (False, True) for tb in (False, True)]
    todo = [(c, lay) for c in cases for lay in layouts] + [(c, (False, False)) for c in nn_cases]
    for (m, n, k), (ta, tb) in todo:
        a, b = random_operands(m, n, k, dtype)
        sa = cupy.ascontiguousarray(a.T) if ta else a
        sb = cupy.ascontiguousarray(b.T) if tb else b
        c0 = cupy.asarray(np.random.default_rng().standard_normal((m, n)))
        for alpha, beta in ((1.0, 0.0), (-0.5, 2.0)):
            c = c0.copy() if beta else cupy.full((m, n), np.nan)
            cuda_loader.launch(spec.name, sa, ta, sa.shape[1], sb, tb, sb.shape[1], c, n,
                               m, n, k, alpha=alpha, beta=beta, params=p, check=True,
                               defines=defines, split_tail=split_tail)
            ref = alpha * (a @ b) + (beta * c0 if beta else 0)
            den = float(cupy.linalg.norm(ref))
            err = float(cupy.linalg.norm(c - ref)) / den
            if not err < 1e-12:
                raise AssertionError(f"{p} {defines or ''} {m}x{n}x{k} ta={ta} tb={tb} a={alpha} "
                                     f"b={beta}: relerr {err}")
            worst = max(worst, err)
    return worst


def _raw_runner(spec, p, a, b, c):
    return raw_runner(spec.name, p, a, b, c)


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m bench.research.simt64_search")
    ap.add_argument("--kernel", default="simt_fp64")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--accumulators", type=int, default=64, help="min TM*TN of the searched shapes")
    ap.add_argument("--search", type=int, default=4096)
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--also", nargs="*", default=["warptile"], help="kernels timed with their defaults")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; stops adding sizes after")
    ap.add_argument("--launch", nargs=2, metavar=("PARAMS_JSON", "N"), default=None,
                    help="only launch the kernel with these parameters twice at n (for ncu)")
    args = ap.parse_args(argv)

    import cupy

    from distmm.executor import cuda_loader

    t0 = time.perf_counter()
    spec = registry.get(args.kernel)
    dt = args.dtype
    if args.launch:
        p, n = json.loads(Path(args.launch[0]).read_text()), int(args.launch[1])
        a, b = random_operands(n, n, n, dt)
        c = cupy.empty((n, n), dtype=dt)
        for _ in range(2):
            _raw_runner(spec, p, a, b, c)()
        cupy.cuda.get_current_stream().synchronize()
        print(f"launched {spec.name} {dt} n={n} {p} twice")
        return 0
    rec = RecordWriter("kernels", gpu_name(), args.out_dir)
    cand = configs(spec, dt, args.accumulators)
    print(f"{len(cand)} {spec.name} {dt} configurations with >= {args.accumulators} accumulators", flush=True)
    items = [(spec.name, dt, p, False, False) for p in cand]
    errs = cuda_loader.warm(items)
    print(f"compiled in {time.perf_counter() - t0:.0f} s; {len(errs)} errors", flush=True)
    for e in errs:
        print("  ", e)

    # search
    n = args.search
    a, b = random_operands(n, n, n, dt)
    c = cupy.empty((n, n), dtype=dt)
    t_blas = event_seconds(lambda: cupy.matmul(a, b, out=c), repeat=5)
    print(f"cublas n={n}: {2 * n**3 / t_blas / 1e12:.2f} TFLOP/s", flush=True)
    a7, b7 = random_operands(4097, 4097, 4097, dt)
    c7 = cupy.empty((4097, 4097), dtype=dt)
    res = []
    for p in cand:
        try:
            c7.fill(np.nan)
            _raw_runner(spec, p, a7, b7, c7)()
            err = relerr_gpu(c7, a7, b7)
            if not err < 1e-12:
                print(f"  {p}: WRONG relerr {err:.2e}", flush=True)
                continue
            sec = event_seconds(_raw_runner(spec, p, a, b, c), repeat=5, warmup=1)
        except Exception as exc:  # a configuration that fails to launch is reported, not fatal
            print(f"  {p}: failed ({exc})", flush=True)
            continue
        tf = 2 * n**3 / sec / 1e12
        res.append((tf, p))
        rec.add(f"tune-{spec.name}", dt, n, n, n, sec, err, params=p)
        print(f"  {tf:6.2f} TFLOP/s ({100 * t_blas / sec:4.1f}% of cuBLAS)  {p}", flush=True)
    res.sort(key=lambda r: -r[0])
    top = [p for _, p in res[:args.top]]
    if top and args.out_dir:
        (Path(args.out_dir) / "simt64-best.json").write_text(json.dumps(top[0]))
    del a, b, c, a7, b7, c7

    for p in top:
        w = check_shapes(spec, p, dt)
        print(f"checked {p}: odd/rectangular/transposed, alpha/beta: worst relerr {w:.1e}", flush=True)

    # confirm: alternate cuBLAS and each config, per size
    others = [(registry.get(k), registry.get(k).params(dt)) for k in args.also]
    for n in args.sizes:
        if time.perf_counter() - t0 > args.budget:
            print(f"budget reached; n={n} skipped")
            continue
        a, b = random_operands(n, n, n, dt)
        c = cupy.empty((n, n), dtype=dt)
        rounds = {}
        for _ in range(2):
            for label, sp, p in [("cublas", None, None)] + [(f"distmm-raw-{spec.name}", spec, q) for q in top] \
                    + [(f"distmm-raw-{s.name}", s, q) for s, q in others]:
                fn = (lambda: cupy.matmul(a, b, out=c)) if sp is None else _raw_runner(sp, p, a, b, c)
                key = (label, str(p))
                rounds.setdefault(key, []).append(event_seconds(fn, repeat=5, warmup=1))
        blas = min(rounds[("cublas", "None")])
        rec.add("cublas", dt, n, n, n, blas, None, note="simt64 search run, best of 2 medians")
        print(f"n={n}: cublas {2 * n**3 / blas / 1e12:.2f} TFLOP/s", flush=True)
        for label, sp, p in [(f"distmm-raw-{spec.name}", spec, q) for q in top] \
                + [(f"distmm-raw-{s.name}", s, q) for s, q in others]:
            c.fill(np.nan)
            _raw_runner(sp, p, a, b, c)()
            err = relerr_gpu(c, a, b)
            sec = min(rounds[(label, str(p))])
            rec.add(label, dt, n, n, n, sec, err, params=p, note="simt64 search run, best of 2 medians")
            print(f"n={n}: {label} {2 * n**3 / sec / 1e12:6.2f} TFLOP/s = {100 * blas / sec:4.1f}% of "
                  f"cuBLAS, relerr {err:.1e}  {p}", flush=True)
        del a, b, c
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"done in {time.perf_counter() - t0:.0f} s; records {rec.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
