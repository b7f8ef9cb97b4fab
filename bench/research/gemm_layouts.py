"""Does cuBLAS's speed on one GPU depend on the operands' memory order? A probe for a lead.

The lead (bench/NOTES.md, "MPI engine"): nvmath-python's one-rank matmul (cuBLASMp ->
cuBLASLt, A passed transposed, column-major operands) beat ``cupy.matmul`` on row-major
operands at float64. Every float64 path of distmm multiplies row-major blocks with
``cupy.matmul``, so a faster order would lift them all.

This times ``cupy.matmul(a, b)`` with A and B each C- or F-ordered (four orders; the
conversion is not timed), and ``cupy.cublas.gemm`` on the same buffers with the
transposes that describe them, median of ``--repeat`` CUDA-event timings after a warm-up,
fresh random operands per dtype and size, checked against the C-order product.
Prints seconds, TFLOP/s and the ratio to C-order x C-order.
``python -m bench.research.gemm_layouts --sizes 16384 32768 --dtypes float64 float32``
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.common import event_seconds


def layouts(n: int, dtype: str, repeat: int) -> list[tuple[str, float, float]]:
    """(name, seconds, max abs difference to the C x C product) per order."""
    import cupy

    rng = cupy.random.default_rng(n)
    a = rng.standard_normal((n, n), dtype=np.float64).astype(dtype)
    b = rng.standard_normal((n, n), dtype=np.float64).astype(dtype)
    want = cupy.matmul(a, b)
    out = []
    for an in "CF":
        for bn in "CF":
            x = a if an == "C" else cupy.asfortranarray(a)
            y = b if bn == "C" else cupy.asfortranarray(b)
            got = cupy.matmul(x, y)
            diff = float(cupy.abs(got - want).max())
            del got
            sec = event_seconds(lambda x=x, y=y: cupy.matmul(x, y), repeat=repeat)
            out.append((f"matmul A:{an} B:{bn}", sec, diff))
            del x, y
            cupy.get_default_memory_pool().free_all_blocks()
    try:
        from cupy import cublas
    except ImportError:  # pragma: no cover - cupy without the cublas module
        return out
    # cuBLAS's own calls, C = op(x) op(y) column-major; a C-ordered array's .T is a
    # column-major view of it, so 'T' on that view reads the row-major operand as it is
    at = cupy.asfortranarray(a)  # A column-major
    bt = b.T  # B^T, column-major view of a C-ordered B: op 'T' gives B
    for name, ta, tb, x, y in (("gemm N,N (A, B column-major)", "N", "N", at,
                                cupy.asfortranarray(b)),
                               ("gemm T,N (A^T col-major = A row-major)", "T", "N", a.T,
                                cupy.asfortranarray(b)),
                               ("gemm N,T (B row-major)", "N", "T", at, bt)):
        try:
            got = cublas.gemm(ta, tb, x, y)
        except Exception as exc:  # noqa: BLE001 -- a transpose cupy refuses: say so
            print(f"  {name}: not run ({type(exc).__name__}: {exc})")
            continue
        diff = float(cupy.abs(got - want).max())
        del got
        sec = event_seconds(lambda ta=ta, tb=tb, x=x, y=y: cublas.gemm(ta, tb, x, y),
                            repeat=repeat)
        out.append((name, sec, diff))
    del at, want
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.gemm_layouts",
                                description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    import cupy

    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for dtype in args.dtypes:
        for n in args.sizes:
            rows = layouts(n, dtype, args.repeat)
            base = rows[0][1]
            print(f"{dtype} n={n}")
            for name, sec, diff in rows:
                print(f"  {name:42s} {sec:.4f} s {2 * n**3 / sec / 1e12:7.2f} TFLOP/s "
                      f"{base / sec:.3f}x C,C  max|diff| {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
