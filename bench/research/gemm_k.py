"""Does a block's GEMM run slower when its k is cut into pieces? A probe for a lead.

The lead (bench/NOTES.md, "Dask engine on 4 GPUs", "A block's k pieces"): a Dask GPU worker's
16384^2 block at fp32 32768 on 4 GPUs runs as one k piece of 8192 (four GEMMs, one per 8192^2
part of C) and three more pieces of 8192 added into C (beta = 1); the trace's GEMMs summed
349-352 ms a worker against 330 ms for a quarter of one cuBLAS product. This times, on one GPU
with ``distmm.executor.cublas.cublas_gemm`` (the call the block tasks make), fresh random
operands, median of ``--repeat`` CUDA-event timings after a warm-up:

- ``whole``: m x K x n in one GEMM (the reference);
- ``pieces P``: the same product as K / P GEMMs of k = P into one C (beta 0, then 1);
- ``parts P, then Q``: the first piece of k = P as one GEMM per (P x P) part of C (strided
  views of C, beta 0), then pieces of k = Q added into all of C (the current code is
  ``parts 8192, then 8192``; a later piece of 24576 is ``parts 8192, then 24576``); where k
  is four chunks, also a first piece of two chunks in parts (``parts of k 16384, then
  16384``) and one later piece of two chunks beside one of one chunk.

Prints seconds and each against ``whole``.
``python -m bench.research.gemm_k --m 16384 --k 32768 --dtypes float32 float64``
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.common.timing import event_seconds


def schedules(k: int, chunk: int) -> list[tuple[str, int | None, list[int]]]:
    """(name, first piece's part side or None, the k pieces) for a k of ``k`` in chunks."""
    out: list[tuple[str, int | None, list[int]]] = [("whole", None, [k])]
    for p in (chunk, 2 * chunk):
        if p < k and k % p == 0:
            out.append((f"pieces {p}", None, [p] * (k // p)))
    if chunk < k:
        out.append((f"parts {chunk}, then {chunk}", chunk, [chunk] * (k // chunk)))
        out.append((f"parts {chunk}, then {k - chunk}", chunk, [chunk, k - chunk]))
    if 4 * chunk == k:  # the first piece two chunks long, or a piece of two chunks between
        out.append((f"parts of k {2 * chunk}, then {2 * chunk}", chunk, [2 * chunk] * 2))
        out.append((f"parts {chunk}, then {2 * chunk}, {chunk}", chunk, [chunk, 2 * chunk, chunk]))
        out.append((f"parts {chunk}, then {chunk}, {2 * chunk}", chunk, [chunk, chunk, 2 * chunk]))
    return out


def run(m: int, k: int, n: int, chunk: int, dtype: str, repeat: int) -> list[tuple[str, float]]:
    import cupy

    from distmm.executor.cublas import cublas_gemm

    rng = cupy.random.default_rng(k + m)
    a = rng.standard_normal((m, k), dtype=np.float64).astype(dtype)
    b = rng.standard_normal((k, n), dtype=np.float64).astype(dtype)
    c = cupy.empty((m, n), dtype=dtype)
    out = []
    for name, side, pieces in schedules(k, chunk):
        # the panels as a block task holds them: each piece's A and B contiguous
        offs = np.cumsum([0] + pieces).tolist()
        panels = [(cupy.ascontiguousarray(a[:, lo:hi]), cupy.ascontiguousarray(b[lo:hi]))
                  for lo, hi in zip(offs[:-1], offs[1:])]

        def product(panels=panels, side=side):
            for g, (x, y) in enumerate(panels):
                if g == 0 and side is not None:
                    for r in range(0, m, side):
                        for s in range(0, n, side):
                            cublas_gemm(x[r:r + side], y[:, s:s + side],
                                        c[r:r + side, s:s + side], beta=0)
                    continue
                cublas_gemm(x, y, c, beta=0 if g == 0 else 1)

        c.fill(np.nan)  # poisoned: a schedule that skips a part fails the check
        product()
        for rows in (slice(0, 128), slice(m - 128, m)):  # the first and last parts' rows
            want = cupy.matmul(a[rows].astype(np.float64), b.astype(np.float64))
            err = float(cupy.abs(c[rows] - want).max() / cupy.abs(want).max())
            assert err < (1e-4 if dtype == "float32" else 1e-12), (name, err)
        sec = event_seconds(product, repeat=repeat)
        out.append((name, sec))
        del panels, want
        cupy.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.gemm_k",
                                description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=16384, help="rows of C (and columns)")
    p.add_argument("--k", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    for dtype in args.dtypes:
        rows = run(args.m, args.k, args.m, args.chunk, dtype, args.repeat)
        whole = rows[0][1]
        flops = 2.0 * args.m * args.m * args.k
        print(f"== {name} {dtype} m = n = {args.m}, k = {args.k}, chunks {args.chunk}")
        for label, sec in rows:
            print(f"  {label:28s} {sec * 1e3:8.2f} ms {flops / sec / 1e12:7.1f} TFLOP/s "
                  f"{sec / whole:6.3f}x whole")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
