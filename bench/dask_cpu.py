"""CPU benchmark of the Dask engine: distmm-dask against dask.array and numpy.

Writes one record per (setup, variant, dtype, size) through ``bench.common``
(benchmark ``cpu``) to ``bench/results/cpu-dask-<cpu-model>-<date>.jsonl`` and
prints GFLOP/s and the ratios measured in the same run.

The cluster: a ``distributed.LocalCluster`` of ``--workers`` single-thread
worker processes (distributed sets ``OPENBLAS_NUM_THREADS=1`` in them; checked
and recorded), against numpy's BLAS on all cores in this process.

Setups (``--setups``)
---------------------
``cluster``
    Both Dask variants start from the same dask arrays already on the cluster
    (random normal, made and persisted there before the clock starts, chunks
    ``--chunk``) and end with C persisted on the cluster (``wait``), not
    gathered. ``distmm-dask``: ``distmm.matmul(A, B).persist()`` (its C tiles
    are the chunks); ``dask.array``: ``(A @ B).persist()``. ``numpy``:
    ``a @ b`` on the same values, held in this process. Every timed repetition
    uses freshly made operands (new keys), so nothing is reused from a warm-up.
``ceiling-1thread-per-worker`` (cluster setup, a reference, not a library)
    every worker multiplies its own ``n / workers`` rows of A by all of B with
    its single-thread BLAS, all workers at once, with nothing moved: what the
    cluster could do with free communication and perfect balance.
``client``
    numpy operands in this process, numpy result back: ``distmm-dask`` is
    ``distmm.matmul(a, b, client=client)`` (scatter the blocks, compute,
    gather C); ``dask.array`` is ``da.from_array(a, chunks) @ ...`` then
    ``.compute()`` (the operands travel inside the graph, as from_array does).

Each result is checked (relative error against numpy's float64 product)
before timing; variants are timed in alternation so that load from other
processes on this shared machine hits all alike; records hold the median.
Run under the benchmark lock::

    flock /tmp/distmm-bench.lock python -m bench.dask_cpu
"""
from __future__ import annotations

import os
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait

import distmm
from bench.common import RecordWriter, cpu_model, parser, relerr, release_cluster
from distmm.api import plan_for


def _fresh(n: int, chunk: int, seed: int, dtype: str):
    gen = da.random.default_rng(seed)
    a = gen.standard_normal((n, n), chunks=chunk, dtype=dtype)
    b = gen.standard_normal((n, n), chunks=chunk, dtype=dtype)
    a, b = a.persist(), b.persist()
    wait([a, b])
    return a, b


def _worker_half_setup(n: int, workers: int, dtype: str, seed: int):
    """On each worker: its own row band of A and all of B, kept in a global."""
    import builtins

    rng = np.random.default_rng(seed)
    rows = -(-n // workers)
    builtins._distmm_bench_half = (rng.standard_normal((rows, n)).astype(dtype),
                                   rng.standard_normal((n, n)).astype(dtype))


def _worker_half_gemm():
    import builtins

    a, b = builtins._distmm_bench_half
    a @ b  # single-thread BLAS in the worker (OPENBLAS_NUM_THREADS=1)


def _worker_half_clear():
    import builtins

    builtins.__dict__.pop("_distmm_bench_half", None)


def _run_cluster_variant(client, variant: str, a, b):
    t0 = time.perf_counter()
    if variant == "distmm-dask":
        c = distmm.matmul(a, b, client=client).persist()
    else:
        c = (a @ b).persist()
    wait(c)
    return time.perf_counter() - t0, c


def bench_cluster(client, writer, n: int, chunk: int, dtype: str, repeat: int, workers: int, rows):
    variants = ["numpy", "distmm-dask", "dask.array"]
    # check + warm-up on one pair of operands
    a, b = _fresh(n, chunk, 1000 + n, dtype)
    a_np, b_np = a.compute(), b.compute()
    ref = a_np.astype(np.float64) @ b_np.astype(np.float64)
    errs = {"numpy": relerr(a_np @ b_np, ref)}
    for variant in variants[1:]:
        _, c = _run_cluster_variant(client, variant, a, b)
        errs[variant] = relerr(c.compute(), ref)
        if variant == "distmm-dask":
            c_tiles = (c.chunks[0][0], c.chunks[1][0])  # the plan's C tile, as chunks
        del c
    del a, b, ref
    release_cluster(client)
    # the ceiling: every worker multiplies its own row band of A by B, at the
    # same time, with operands already in place and nothing moved
    variants.append("ceiling-1thread-per-worker")
    client.run(_worker_half_setup, n, workers, dtype, 7)
    client.run(_worker_half_gemm)
    errs["ceiling-1thread-per-worker"] = None
    times: dict = {v: [] for v in variants}
    for rep in range(repeat):
        for variant in variants:
            if variant == "ceiling-1thread-per-worker":
                t0 = time.perf_counter()
                client.run(_worker_half_gemm)
                times[variant].append(time.perf_counter() - t0)
                continue
            if variant == "numpy":
                t0 = time.perf_counter()
                a_np @ b_np
                times[variant].append(time.perf_counter() - t0)
                continue
            a, b = _fresh(n, chunk, 2000 + 10 * rep + variants.index(variant), dtype)
            seconds, c = _run_cluster_variant(client, variant, a, b)
            times[variant].append(seconds)
            del a, b, c
            release_cluster(client)
    del a_np, b_np
    client.run(_worker_half_clear)
    plan = plan_for(n, n, n, dtype, workers=workers,
                    tile=c_tiles + (plan_for(n, n, n, dtype, workers=1).tile[2],))
    _emit(writer, rows, "cluster", variants, times, errs, dtype, n, chunk, plan,
          note="operands made and persisted on the cluster before the clock starts (fresh keys "
               "each repetition); C persisted on the cluster, not gathered; numpy: in-process "
               "operands, BLAS on all cores")


def bench_client(client, writer, n: int, chunk: int, dtype: str, repeat: int, workers: int, rows):
    variants = ["numpy", "distmm-dask", "dask.array"]
    rng = np.random.default_rng(n)
    pairs = [tuple(rng.standard_normal((n, n)).astype(dtype) for _ in range(2)) for _ in range(2)]

    def run(variant, a, b):
        if variant == "numpy":
            return a @ b
        if variant == "distmm-dask":
            return distmm.matmul(a, b, client=client)
        return (da.from_array(a, chunks=chunk) @ da.from_array(b, chunks=chunk)).compute()

    a, b = pairs[0]
    ref = a.astype(np.float64) @ b.astype(np.float64)
    errs = {v: relerr(run(v, a, b), ref) for v in variants}
    del ref
    times: dict = {v: [] for v in variants}
    for rep in range(repeat):
        for variant in variants:
            a, b = pairs[(rep + 1) % 2]  # alternate the operands: no key is reused back to back
            t0 = time.perf_counter()
            run(variant, a, b)
            times[variant].append(time.perf_counter() - t0)
            release_cluster(client)
    plan = plan_for(n, n, n, dtype, workers=workers)
    _emit(writer, rows, "client", variants, times, errs, dtype, n, chunk, plan,
          note="numpy operands in the client process and a numpy result back: includes moving "
               "A and B to the workers and gathering C; dask.array via da.from_array + compute")


def _emit(writer, rows, setup, variants, times, errs, dtype, n, chunk, plan, note):
    secs = {v: float(np.median(times[v])) for v in variants}
    for v in variants:
        extra = {"setup": setup, "repeat": len(times[v]), "all_seconds": times[v],
                 "best_seconds": float(np.min(times[v])), "note": note}
        if v in ("distmm-dask", "dask.array"):
            extra["chunk"] = chunk
        if v.startswith("ceiling"):
            extra["note"] = ("reference, not a library: each worker process multiplies its own "
                             "n/workers rows of A by all of B with single-thread BLAS, all at "
                             "once, operands already in place, nothing moved or gathered; "
                             "relerr not checked (a plain BLAS call)")
        if v == "distmm-dask":
            extra.update(tile=list(plan.tile), grid=list(plan.grid), k_splits=plan.k_splits,
                         engine="dask", backend="auto")
        rows.append(writer.add(v, dtype, n, n, n, secs[v], errs[v], **extra))
    print(f"[{setup}] {dtype} n={n}: " + "  ".join(
        f"{v} {2 * n**3 / secs[v] / 1e9:6.1f} GF/s" for v in variants)
        + f"  distmm/dask.array {secs['dask.array'] / secs['distmm-dask']:.2f}"
        + f"  distmm/numpy {secs['numpy'] / secs['distmm-dask']:.2f}"
        + (f"  ceiling/numpy {secs['numpy'] / secs['ceiling-1thread-per-worker']:.2f}"
           if "ceiling-1thread-per-worker" in secs else ""), flush=True)


def main(argv=None) -> int:
    p = parser(__doc__, prog="python -m bench.dask_cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--dtype", default="float64")
    p.add_argument("--chunk", type=int, default=2048, help="dask chunk size (both variants)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--setups", nargs="+", default=["cluster"], choices=["cluster", "client"])
    args = p.parse_args(argv)

    env = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                          "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        worker_env = client.run(lambda: {k: os.environ.get(k) for k in
                                         ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                          "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")})
        worker_env = next(iter(worker_env.values()))
        writer = RecordWriter(
            "cpu", cpu_model(), out_dir=args.out_dir, file_stem="cpu-dask", workers=args.workers,
            threads_per_worker=1, cluster="LocalCluster(processes=True)",
            client_openblas_env={k: v for k, v in env.items() if v is not None},
            worker_openblas_env={k: v for k, v in worker_env.items() if v is not None},
            openblas_coretype_set=env["OPENBLAS_CORETYPE"] is not None,
            openblas_l2_size_set=env["OPENBLAS_L2_SIZE"] is not None,
            numpy_version=np.__version__,
            dask_version=__import__("dask").__version__,
            cores=len(os.sched_getaffinity(0)),
        )
        print(f"workers' env: {worker_env}", flush=True)
        rows: list = []
        for setup in args.setups:
            for n in args.sizes:
                fn = bench_cluster if setup == "cluster" else bench_client
                fn(client, writer, n, args.chunk, args.dtype, args.repeat, args.workers, rows)
    print(f"run {writer.run}; records: {writer.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
