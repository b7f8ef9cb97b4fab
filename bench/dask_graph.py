"""Benchmark ``dask-graph``: building the lazy graph of a huge product, distmm against dask.array.

Each variant runs in a fresh Python process (so that peak memory is its own) and builds
``C = A @ B`` for two lazy ``da.ones((n, n), chunks=c)`` without computing it:

``distmm``
    ``distmm.matmul(A, B)`` (no client: a lazy array planned for this machine's cores).
``dask.array``
    ``A @ B``.

The record's ``seconds`` is the wall time of that call plus ``C.__dask_graph__()`` and
``len(graph)`` (what a scheduler asks first); ``peak_mib`` is the growth of the process's
peak resident memory over what it held after the imports, and ``tasks`` the graph's length.
Both variants first build a tiny product, untimed, so that neither pays for importing its
modules inside the timed call.
A corner block of C is then computed and checked (every element equals ``n``), so the
graph is a working one. Usage::

    python -m bench.dask_graph --n 1000000 --chunks 8192
"""
from __future__ import annotations

import json
import subprocess
import sys

from bench.common import RecordWriter, cpu_model, parser

_CHILD = r"""
import json, resource, sys, time
import numpy as np
import dask.array as da
import distmm
n, c, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def build(x, y):
    return distmm.matmul(x, y) if variant == "distmm" else x @ y
build(da.ones((64, 64), chunks=32), da.ones((64, 64), chunks=32))  # imports, not timed
A = da.ones((n, n), chunks=c)
B = da.ones((n, n), chunks=c)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
C = build(A, B)
graph = C.__dask_graph__()
tasks = len(graph)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
corner = C[:3, :3].compute(scheduler="threads") if n <= 65536 else None
ok = corner is None or bool(np.all(corner == n))
print(json.dumps({"seconds": seconds, "peak_mib": (peak - base) / 1024, "tasks": tasks,
                  "chunks": [len(C.chunks[0]), len(C.chunks[1])], "checked": corner is not None,
                  "ok": ok}))
"""


def main(argv=None) -> int:
    p = parser(__doc__, "python -m bench.dask_graph")
    p.add_argument("--n", type=int, nargs="+", default=[100_000, 1_000_000], help="matrix sizes")
    p.add_argument("--chunks", type=int, default=8192, help="chunk size of A and B")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per variant (median)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one build may take")
    args = p.parse_args(argv)
    writer = RecordWriter("dask-graph", cpu_model(), args.out_dir)
    print(f"{'n':>9} {'variant':>11} {'seconds':>9} {'peak MiB':>9} {'tasks':>10}")
    for n in args.n:
        for variant in ("dask.array", "distmm"):
            runs = []
            for _ in range(args.repeat):
                try:
                    res = subprocess.run([sys.executable, "-c", _CHILD, str(n), str(args.chunks), variant],
                                         capture_output=True, text=True, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    runs.append(None)
                    break
                if res.returncode != 0:
                    raise SystemExit(f"{variant} n={n} failed:\n{res.stderr[-3000:]}")
                runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
            done = [r for r in runs if r is not None]
            if not done:
                print(f"{n:>9} {variant:>11} timed out after {args.timeout} s")
                continue
            done.sort(key=lambda r: r["seconds"])
            med = done[len(done) // 2]
            if not med["ok"]:
                raise SystemExit(f"{variant} n={n}: the computed corner of C is wrong")
            writer.add(variant, "float64", n, n, n, med["seconds"], 0.0 if med["checked"] else None,
                       chunks=args.chunks, peak_mib=med["peak_mib"], tasks=med["tasks"],
                       runs=len(done), workers=0,
                       note="graph construction only; corner of C computed and checked"
                       if med["checked"] else "graph construction only; too large to check here")
            print(f"{n:>9} {variant:>11} {med['seconds']:>9.2f} {med['peak_mib']:>9.1f} {med['tasks']:>10}")
    print(f"records: {writer.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
