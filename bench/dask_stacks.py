"""Stacks of matrices on the Dask engine: distmm.matmul of dask operands against dask.array.

Writes one record per (scheduler, shape, variant) through ``bench.common`` (benchmark
``dask-stacks``) to ``bench/results/dask-stacks-<cpu-model>-<date>.jsonl`` and prints the
times and the ratios measured in the same run.

Operands: ``batch`` stacked ``m x k`` and ``k x n`` float64 matrices, random normal, in
dask arrays (``da.from_array``) of the shape's number of chunks along the batch axis, each
matrix whole in its chunk (``--shapes whole``) or cut into chunks of ``cm x ck`` and
``ck x cn`` (``--shapes spanning``; the plan splits the 3000-long k in two k groups).
Variants, timed in alternation (build the graph, then ``compute``, the result gathered as
numpy):

``dask.array``
    ``da.matmul(a, b)``, the reference.
``distmm-stack``
    ``distmm.matmul(a, b)`` with one task per batch chunk and output block
    (``distmm.engine.dask.stacks``), forced whatever the element's size (by default it
    takes elements of at most ``stacks.SMALL_FLOPS``).
``distmm-per-element``
    ``distmm.matmul(a, b)`` with one task per stack element (the path before the stack
    path existed, and still the one for elements above ``stacks.SMALL_FLOPS``).

``first_seconds``: the first call of a variant for that shape in this process;
``seconds``: the median of ``--repeat`` warm calls. Schedulers (``--schedulers``): dask's
threaded scheduler in this process, and a ``distributed.LocalCluster`` of two
single-thread worker processes, the operands persisted there first. ``m``, ``n``, ``k``
are one element's: ``tflops`` counts one element, ``stack_tflops`` the whole stack.

    python -m bench.dask_stacks
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import dask.array as da
import numpy as np

import distmm
from bench.common import RecordWriter, cpu_model, parser, relerr
from distmm.engine.dask import stacks

#: (batch, m, k, n, batch chunks): each matrix whole in its chunk
SHAPES = [(2000, 4, 5, 3, 2), (200, 32, 32, 32, 2), (64, 128, 128, 128, 2),
          (16, 256, 256, 256, 2), (4, 512, 512, 512, 1), (4, 512, 512, 512, 4)]
#: (batch, m, k, n, batch chunks, (cm, ck, cn)): matrices spanning chunks of ``cm x ck`` and
#: ``ck x cn``
SPANNING = [(2000, 4, 6, 3, 2, (2, 3, 3)), (600, 90, 70, 50, 6, (45, 35, 25)),
            (200, 64, 64, 64, 2, (32, 32, 32)), (40, 20, 3000, 20, 2, (20, 500, 20))]
VARIANTS = ("dask.array", "distmm-stack", "distmm-per-element")


def _call(variant: str, a, b, scheduler, client):
    t0 = time.perf_counter()
    if variant == "dask.array":
        c = da.matmul(a, b)
    else:
        saved = stacks.SMALL_FLOPS
        stacks.SMALL_FLOPS = 2 ** 62 if variant == "distmm-stack" else -1
        try:
            c = distmm.matmul(a, b, **({"client": client} if client is not None else {}))
        finally:
            stacks.SMALL_FLOPS = saved
    tasks = len(c.__dask_graph__())
    out = c.compute(scheduler=scheduler) if client is None else c.compute()
    return time.perf_counter() - t0, out, tasks


def bench(writer, shape, repeat: int, scheduler_name: str, client, load: str):
    batch, m, k, n, parts = shape[:5]
    cm, ck, cn = shape[5] if len(shape) > 5 else (m, k, n)
    rng = np.random.default_rng()
    x, y = rng.standard_normal((batch, m, k)), rng.standard_normal((batch, k, n))
    step = -(-batch // parts)
    a = da.from_array(x, chunks=(step, cm, ck))
    b = da.from_array(y, chunks=(step, ck, cn))
    if client is not None:  # on the workers before the clock starts, not inside each graph
        from distributed import wait

        a, b = client.persist(a), client.persist(b)
        wait([a, b])
    ref = np.matmul(x, y)
    scheduler = "threads" if client is None else None
    first, times, errs, tasks = {}, {v: [] for v in VARIANTS}, {}, {}
    for v in VARIANTS:
        first[v], out, tasks[v] = _call(v, a, b, scheduler, client)
        errs[v] = relerr(out, ref)
    for _ in range(repeat):
        for v in VARIANTS:
            times[v].append(_call(v, a, b, scheduler, client)[0])
    same = bool(np.array_equal(_call("distmm-stack", a, b, scheduler, client)[1],
                               _call("distmm-per-element", a, b, scheduler, client)[1]))
    secs = {v: statistics.median(times[v]) for v in VARIANTS}
    for v in VARIANTS:
        writer.add(v, "float64", m, n, k, secs[v], errs[v], batch=batch, batch_chunks=parts,
                   matrix_chunks=[cm, ck, cn],
                   scheduler=scheduler_name, tasks=tasks[v], first_seconds=first[v],
                   all_seconds=times[v], repeat=repeat,
                   stack_tflops=2.0 * batch * m * n * k / secs[v] / 1e12,
                   stack_equals_per_element=same,
                   note=f"2-core VM shared with other test runs; load average at start {load}; "
                        "wall time of graph build + compute (result gathered); relerr "
                        "against numpy's float64 matmul; tflops counts one element")
    print(f"[{scheduler_name}] {batch} x {m}x{k}@{k}x{n} in {parts} chunk(s) of "
          f"{cm}x{ck}@{ck}x{cn}: " + "  ".join(
        f"{v} {secs[v] * 1e3:8.2f} ms (first {first[v] * 1e3:8.2f}, {tasks[v]} keys)"
        for v in VARIANTS) + f"  bitwise stack==per-element {same}", flush=True)


def main(argv=None) -> int:
    p = parser(__doc__, prog="python -m bench.dask_stacks")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--schedulers", nargs="+", default=["threads", "cluster"],
                   choices=["threads", "cluster"])
    p.add_argument("--shapes", nargs="+", default=["whole", "spanning"],
                   choices=["whole", "spanning"])
    args = p.parse_args(argv)
    shapes = (SHAPES if "whole" in args.shapes else []) + (
        SPANNING if "spanning" in args.shapes else [])
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    writer = RecordWriter("dask-stacks", cpu_model(), out_dir=args.out_dir,
                          cores=len(os.sched_getaffinity(0)), machine="2-core VM",
                          numpy_version=np.__version__,
                          dask_version=__import__("dask").__version__)
    for name in args.schedulers:
        if name == "threads":
            for shape in shapes:
                bench(writer, shape, args.repeat, name, None, load)
            continue
        from distributed import Client, LocalCluster

        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            for shape in shapes:
                bench(writer, shape, args.repeat, "LocalCluster(2 x 1 thread)", client, load)
    print(f"run {writer.run}; records: {writer.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
