"""What is the floor for a product split over two GPUs? Each GPU's half, alone and together.

The two-GPU targets (issues 12 and 13) compare against twice single-GPU cuBLAS: half the
time of ``cupy.matmul`` on n x n x n. This times, with ``cupy.matmul`` on fresh random
operands (C-ordered, float32 by default), median of ``--repeat`` after a warm-up:

- ``full``: n x n x n on GPU 0 (the reference);
- ``half``: n x n/2 x n (one GPU's block of C) on GPU 0 alone;
- ``half, rows``: the same block as ``--groups`` GEMMs of n/groups rows each (the Dask
  engine's row groups, ``tasks.row_groups``) into one C;
- ``both``: ``half`` on GPU 0 and GPU 1 at once, one thread per GPU, started together,
  wall time of the slower (only where two GPUs are visible).

Prints seconds and each against half of ``full``: what any two-GPU product can reach.
``python -m bench.research.two_gemms --n 32768``
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np


def _operands(cupy, device: int, m: int, n: int, k: int, dtype: str):
    with cupy.cuda.Device(device):
        rng = cupy.random.default_rng(1000 + device)
        a = rng.standard_normal((m, k), dtype=np.float32).astype(dtype)
        b = rng.standard_normal((k, n), dtype=np.float32).astype(dtype)
        return a, b, cupy.empty((m, n), dtype)


def _timed(cupy, device: int, fn, repeat: int) -> list[float]:
    with cupy.cuda.Device(device):
        fn()
        cupy.cuda.Device(device).synchronize()
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            cupy.cuda.Device(device).synchronize()
            out.append(time.perf_counter() - t0)
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.two_gemms",
                                description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--groups", type=int, default=4)
    args = p.parse_args(argv)
    import cupy

    n, half = args.n, args.n // 2
    gpus = cupy.cuda.runtime.getDeviceCount()
    a, b, c = _operands(cupy, 0, n, n, n, args.dtype)
    full = statistics.median(_timed(cupy, 0, lambda: cupy.matmul(a, b, out=c), args.repeat))
    del a, b, c
    cupy.get_default_memory_pool().free_all_blocks()
    ops = [_operands(cupy, d, n, half, n, args.dtype) for d in range(min(gpus, 2))]
    a, b, c = ops[0]
    res = {"full": full,
           "half": statistics.median(_timed(cupy, 0, lambda: cupy.matmul(a, b, out=c),
                                            args.repeat))}
    step = n // args.groups

    def rows():
        for r in range(0, n, step):
            cupy.matmul(a[r:r + step], b, out=c[r:r + step])
    res[f"half, rows x{args.groups}"] = statistics.median(_timed(cupy, 0, rows, args.repeat))
    if gpus >= 2:
        walls = []
        for _ in range(args.repeat + 1):
            start = threading.Barrier(2)
            done = [0.0, 0.0]

            def run(d):
                x, y, z = ops[d]
                with cupy.cuda.Device(d):
                    start.wait()
                    t0 = time.perf_counter()
                    cupy.matmul(x, y, out=z)
                    cupy.cuda.Device(d).synchronize()
                    done[d] = time.perf_counter() - t0
            threads = [threading.Thread(target=run, args=(d,)) for d in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            walls.append(max(done))
        res["both (slower of two)"] = statistics.median(walls[1:])
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()} {args.dtype} n={n}, "
          f"{gpus} GPU(s) visible, median of {args.repeat}")
    for name, sec in res.items():
        print(f"  {name:24s} {sec:.4f} s   {full / 2 / sec:.3f} of half 'full'")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
