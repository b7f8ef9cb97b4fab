"""Does an inner-loop variant of step 10 (SIMT float64) beat the default? An A/B of its compile-time macros.

What it answered (one pair of k per loop iteration and the split tail became the
defaults; the other variants did not pay) is in bench/NOTES.md, "Step 10: SIMT float64".

Step 10 (``kernels/cuda/10_simt_fp64.cu``) has macros that change how ptxas sees its inner
loop without changing any result: ``DISTMM_SIMT_KPAIRS`` (pairs of k per loop iteration,
default 1; 64 unrolls the whole k tile) and ``DISTMM_SIMT_ORDER`` (0 zig-zag rows, the
default; 1 zig-zag columns). For each variant given as ``NAME=KPAIRS,ORDER[:PARAM=VALUE,...]``
(template parameters replacing the registry's float64 defaults; ``NAME=1,0,0`` without the
split tail of ``cuda_loader.launch``), in one process:

1. compile it for every layout (NN, NT, TN, TT) in parallel;
2. check it on odd, rectangular and transposed products (7 .. 4097, alpha/beta, output
   poisoned with NaN) against float64 products;
3. time it at each ``--sizes`` in alternation with cuBLAS DGEMM (``cupy.matmul``) and the
   other variants (``bench.common.event_alternating``), so all see the same clocks.

Records (benchmark ``kernels``): ``kernels-<device>-<date>.jsonl``, variants ``cublas`` and ``distmm-raw-simt_fp64``
with ``params`` and a ``note`` naming the macros.

    python -m bench.research.simt64_variants --out-dir $OUT --clocks 8192 unrolled=64,0 pair=1,0 \
        pair128=1,0:BM=128,BN=128
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import distmm.executor.registry as registry
from bench.common import (RecordWriter, event_alternating, gpu_name, parser, random_operands,
                          relerr_gpu, sustained_clock)
from bench.research.simt64_search import check_shapes

#: checked in all four layouts (and 4097^3 untransposed)
CHECK_CASES = ((7, 7, 7), (33, 33, 33), (127, 1000, 33), (1000, 33, 4097))

KERNEL = "simt_fp64"


def parse_variant(text: str) -> tuple[str, dict[str, int], dict[str, int], bool]:
    """``"pair=1,0"`` -> ``("pair", {"DISTMM_SIMT_KPAIRS": 1, "DISTMM_SIMT_ORDER": 0}, {}, True)``;
    a third value 0 turns the split tail off (``cuda_loader.launch(split_tail=False)``);
    ``"p3=1,0:STAGES=3"`` adds template parameters that replace the registry's float64
    defaults."""
    name, _, rest = text.partition("=")
    macros, _, params = rest.partition(":")
    try:
        vals = [int(v) for v in macros.split(",")]
        over = {k: int(v) for k, v in (kv.split("=") for kv in params.split(",") if kv)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"variant must be NAME=KPAIRS,ORDER[,TAIL][:P=V,...], got {text!r}") from None
    if not name or len(vals) not in (2, 3) or vals[0] < 1 or vals[1] not in (0, 1) or vals[2:] not in ([], [0], [1]):
        raise argparse.ArgumentTypeError(f"KPAIRS >= 1, ORDER 0 or 1, TAIL 0 or 1; got {text!r}")
    d = {"DISTMM_SIMT_KPAIRS": vals[0], "DISTMM_SIMT_ORDER": vals[1]}
    spec = registry.get(KERNEL)
    p = dict(spec.params("float64"), **over)
    bad = spec.violations("float64", p)
    if bad or set(over) - set(p):
        raise argparse.ArgumentTypeError(f"{text!r}: {'; '.join(bad) or 'unknown parameter'}")
    return name, d, p, vals[2:] != [0]


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m bench.research.simt64_variants")
    ap.add_argument("variants", nargs="+", type=parse_variant, help="NAME=KPAIRS,ORDER[,TAIL][:P=V,...]")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clocks", type=int, default=0, metavar="N",
                    help="also run each for 2 s at N with the SM clock and power sampled")
    args = ap.parse_args(argv)

    import cupy

    from distmm.executor import cuda_loader

    t0 = time.perf_counter()
    dt = "float64"
    items = [(KERNEL, dt, p, ta, tb, d) for _, d, p, _ in args.variants for ta in (0, 1) for tb in (0, 1)]
    errs = cuda_loader.warm(items)
    print(f"compiled {len(items)} kernels in {time.perf_counter() - t0:.0f} s; {len(errs)} errors", flush=True)
    for e in errs:
        print("  ", e)
    if errs:
        return 1
    for name, d, p, tail in args.variants:
        regs = cuda_loader.get_kernel(KERNEL, dt, p, False, False, defines=d).num_regs
        w = check_shapes(registry.get(KERNEL), p, dt, cases=CHECK_CASES, nn_cases=((4097, 4097, 4097),),
                         defines=d, split_tail=tail)
        print(f"{name} {d} {p} split tail {tail}: {regs} registers (NN); odd/rectangular/transposed, alpha/beta: "
              f"worst relerr {w:.1e}", flush=True)

    rec = RecordWriter("kernels", gpu_name(), args.out_dir)
    for n in args.sizes:
        a, b = random_operands(n, n, n, dt)
        c = cupy.empty((n, n), dtype=dt)

        def runner(d, p, tail):
            return lambda: cuda_loader.launch(KERNEL, a, False, n, b, False, n, c, n, n, n, n,
                                              params=p, defines=d, split_tail=tail)

        runs = {"cublas": lambda: cupy.matmul(a, b, out=c)}
        runs.update({name: runner(d, p, t) for name, d, p, t in args.variants})
        sec = event_alternating(runs, rounds=args.rounds, repeat=5)
        tf = {k: 2 * n**3 / s / 1e12 for k, s in sec.items()}
        note = f"simt64_variants run, median of {args.rounds} alternated rounds"
        rec.add("cublas", dt, n, n, n, sec["cublas"], None, note=note)
        line = [f"n={n}: cublas {tf['cublas']:.2f}"]
        for name, d, p, tail in args.variants:
            c.fill(np.nan)
            runner(d, p, tail)()
            err = relerr_gpu(c, a, b)
            rec.add(f"distmm-raw-{KERNEL}", dt, n, n, n, sec[name], err, params=p,
                    note=f"{note}; {name}: " + ", ".join(f"{k}={v}" for k, v in d.items())
                    + f", split tail {'on' if tail else 'off'}")
            line.append(f"{name} {tf[name]:.2f} ({100 * sec['cublas'] / sec[name]:.1f}%, relerr {err:.0e})")
        print("; ".join(line), flush=True)
        del a, b, c
        cupy.get_default_memory_pool().free_all_blocks()
    if args.clocks:
        n = args.clocks
        a, b = random_operands(n, n, n, dt)
        c = cupy.empty((n, n), dtype=dt)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        runs = [("cublas", lambda: cupy.matmul(a, b, out=c))]
        runs += [(name, (lambda d=d, p=p, t=t: cuda_loader.launch(
                     KERNEL, a, False, n, b, False, n, c, n, n, n, n, params=p, defines=d, split_tail=t)))
                 for name, d, p, t in args.variants]
        # the DFMA chain probe of bench/research/dfma_probe.py (8 independent chains a thread)
        from bench.research.dfma_probe import SRC
        chain = cupy.RawModule(code=SRC, options=("-std=c++17",),
                               name_expressions=["probe_chain"]).get_function("probe_chain")
        iters, out = 1 << 16, cupy.empty(sms * 8 * 256, dtype=np.float64)
        runs.insert(0, ("dfma-chain-probe", lambda: chain((sms * 8,), (256,), (
            out, np.float64(0.999), np.float64(1e-3), np.int32(iters)))))
        flops = {"dfma-chain-probe": 2 * 8 * iters * 256 * sms * 8}
        for name, fn in runs:
            mhz, watt, rate = sustained_clock(fn)
            tf = flops.get(name, 2 * n**3) * rate / 1e12
            # FP64 SIMT peak at this clock: 64 DFMA lanes per SM (H100/H200), 2 flops each
            peak = 2 * 64 * sms * mhz * 1e6 / 1e12
            print(f"sustained n={n} {name}: {tf:.2f} TFLOP/s at {mhz:.0f} MHz, {watt:.0f} W "
                  f"(DFMA peak at that clock {peak:.1f} TFLOP/s: {100 * tf / peak:.1f}%)", flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s; records {rec.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
