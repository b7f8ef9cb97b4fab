"""Is cuBLAS DGEMM in pedantic math mode a SIMT (no tensor core) reference for step 10?

What it answered (no: pedantic DGEMM still uses the FP64 tensor cores) is in
bench/NOTES.md, "Step 10: SIMT float64".

The SIMT float64 target is a share of default cuBLAS DGEMM, which runs on the FP64 tensor
cores (DMMA). cuBLAS can be asked not to use them (``CUBLAS_PEDANTIC_MATH``); if it then
runs at no more than the DFMA peak, that is NVIDIA's own SIMT DGEMM, the best available
reference for what the SIMT units give. Times default DGEMM (``cublas``), pedantic DGEMM
(``cublas-pedantic``) and step 10 (``distmm-raw-simt_fp64``) in alternation at each size;
writes records (benchmark ``kernels``) and prints TFLOP/s and ratios.
``python -m bench.research.simt_reference --out-dir DIR``
"""
from __future__ import annotations

import sys

import numpy as np

from bench.common import RecordWriter, event_alternating, gpu_name, parser, random_operands

CUBLAS_DEFAULT_MATH, CUBLAS_PEDANTIC_MATH = 0, 2


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m bench.research.simt_reference")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    import cupy
    from cupy_backends.cuda.libs import cublas

    import distmm.executor.registry as registry
    from distmm.executor import cuda_loader

    handle = cupy.cuda.device.get_cublas_handle()
    spec = registry.get("simt_fp64")
    params = spec.params("float64")
    rec = RecordWriter("kernels", gpu_name(), args.out_dir, gpus=1)
    print(f"{gpu_name()}: records -> {rec.path}")
    for n in args.sizes:
        a, b = random_operands(n, n, n, "float64")
        ref = cupy.matmul(a, b)  # default mode, for the error check only
        c = cupy.empty((n, n), dtype=np.float64)

        def blas(mode):
            def run():
                cublas.setMathMode(handle, mode)
                try:
                    cupy.matmul(a, b, out=c)
                finally:
                    cublas.setMathMode(handle, CUBLAS_DEFAULT_MATH)
            return run

        runs = {
            "cublas": blas(CUBLAS_DEFAULT_MATH),
            "cublas-pedantic": blas(CUBLAS_PEDANTIC_MATH),
            "distmm-raw-simt_fp64": lambda: cuda_loader.launch(
                spec.name, a, False, n, b, False, n, c, n, n, n, n, params=params),
        }
        errs = {}
        for name, run in runs.items():
            c.fill(np.nan)
            run()
            cupy.cuda.get_current_stream().synchronize()
            errs[name] = float(cupy.linalg.norm(c - ref) / cupy.linalg.norm(ref))
        repeat = 10 if n <= 4096 else (5 if n <= 8192 else 3)
        secs = event_alternating(runs, rounds=args.rounds, repeat=repeat)
        extras = {
            "cublas": {"step": 0},
            "cublas-pedantic": {"step": 0, "note": "cublasSetMathMode(CUBLAS_PEDANTIC_MATH)"},
            "distmm-raw-simt_fp64": {"kernel": "simt_fp64", "params": params, "backend": "raw",
                                     "step": spec.step},
        }
        tf = {}
        for name, sec in secs.items():
            tf[name] = 2.0 * n**3 / sec / 1e12
            rec.add(name, "float64", n, n, n, sec, errs[name], rounds=args.rounds, **extras[name])
        print(f"float64 n={n}: cublas {tf['cublas']:.2f}, cublas-pedantic {tf['cublas-pedantic']:.2f} "
              f"({100 * tf['cublas-pedantic'] / tf['cublas']:.1f}% of cublas), simt_fp64 "
              f"{tf['distmm-raw-simt_fp64']:.2f} ({100 * tf['distmm-raw-simt_fp64'] / tf['cublas']:.1f}% "
              f"of cublas, {100 * tf['distmm-raw-simt_fp64'] / tf['cublas-pedantic']:.1f}% of pedantic); "
              f"relerr vs default {errs['cublas-pedantic']:.1e} / {errs['distmm-raw-simt_fp64']:.1e}",
              flush=True)
        del a, b, ref, c
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
