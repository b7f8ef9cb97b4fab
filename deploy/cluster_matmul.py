"""Multiply two matrices from files on a Dask cluster with distmm.

    python deploy/cluster_matmul.py A.npy B.npy -o C.npy [--scheduler ADDR] [--cuda]

Without ``--scheduler`` it starts a LocalCluster (``--cuda``: a
LocalCUDACluster, one worker per GPU) and closes it afterwards.
"""
from __future__ import annotations

import argparse
import time

import dask.array as da
from distributed import Client, LocalCluster

import distmm
from distmm.cli.io import open_operand, write_atomic


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--scheduler", help="address of a running scheduler (default: start a local cluster)")
    p.add_argument("--cuda", action="store_true", help="local cluster of GPU workers (dask-cuda)")
    p.add_argument("--backend", default="auto")
    args = p.parse_args(argv)

    if args.scheduler:
        cluster = None
        client = Client(args.scheduler)
    elif args.cuda:
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster()
        client = Client(cluster)
    else:
        cluster = LocalCluster(threads_per_worker=1)
        client = Client(cluster)
    try:
        print(f"cluster: {len(client.scheduler_info()['workers'])} workers, dashboard {client.dashboard_link}")
        a = da.from_array(open_operand(args.a), chunks="auto")
        b = da.from_array(open_operand(args.b), chunks="auto")
        t0 = time.perf_counter()
        c = distmm.matmul(a, b, engine="dask", client=client, backend=args.backend).compute()
        seconds = time.perf_counter() - t0
        write_atomic(args.output, c)
        m, k = a.shape
        n = b.shape[1]
        print(f"wrote {args.output}: {c.shape} {c.dtype} in {seconds:.2f} s "
              f"({2 * m * n * k / seconds / 1e9:.1f} GFLOP/s)")
        return 0
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    raise SystemExit(main())
