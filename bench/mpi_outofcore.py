"""Benchmark ``mpi-outofcore``: ranks whose blocks do not fit their GPU (issue: batch jobs).

Run under ``mpiexec -n P`` with one rank per GPU::

    mpiexec -n 2 python -m bench.mpi_outofcore --n 98304 --out-dir DIR

Each rank makes its host (numpy) blocks of A and B (``distmm.cli.blocks``: the same matrices
whatever the rank count) and ``distmm.matmul`` multiplies the two ``DistArray`` objects: the MPI
engine streams a rank's product through its GPU in stripes (host blocks in, a host block of C
out) when the blocks and C's would not fit the device, which the record says
(``streamed``). The clock covers the product only, operands already in host memory, from a
barrier to a barrier; the first call and ``--repeat`` more are timed. The reference, in the
same run on rank 0's GPU: in-core cuBLAS on device-resident operands at ``--ref-n`` (the
largest size whose A, B and C fit one GPU), as a rate; ``share`` is the product's TFLOP/s over
P times that rate. C's sampled rows are checked against float64. On a GPU larger than the
blocks need, ``distmm.device-memory-limit`` (recorded) makes the ranks stream as a smaller
one would.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mpi_outofcore",
                                description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=98304)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--repeat", type=int, default=1, help="timed calls after the first")
    p.add_argument("--ref-n", type=int, default=32768, help="in-core cuBLAS reference size")
    p.add_argument("--check-rows", type=int, default=16)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from mpi4py import MPI

    import distmm
    from distmm.cli import blocks
    from distmm.engine.mpi import DistArray
    from distmm.grid import make_grid

    comm = MPI.COMM_WORLD
    n, dtype = args.n, np.dtype(args.dtype)
    from bench.common import local_gpus

    gpu = local_gpus() > 0  # none: the CPU path, for a smoke run
    if gpu:
        from distmm.engine.mpi.gridcomms import local_gpu

        local_gpu(comm)
    ref_seconds = None
    if gpu and comm.rank == 0:
        from bench.common.timing import incore_gemm_seconds

        ref_seconds = incore_gemm_seconds(args.ref_n, dtype, repeat=3)
    comm.Barrier()
    threads = max(1, (os.cpu_count() or 2) // comm.size)
    grid = make_grid(n, n, n, dtype, ranks=comm.size)
    t = time.perf_counter()
    a = blocks.block(blocks.A, (n, n), grid.a_layout.local_bounds(comm.rank), dtype, args.seed,
                     threads=threads)
    b = blocks.block(blocks.B, (n, n), grid.b_layout.local_bounds(comm.rank), dtype, args.seed,
                     threads=threads)
    made = time.perf_counter() - t
    da, db = DistArray(a, grid.a_layout, comm), DistArray(b, grid.b_layout, comm)
    del a, b

    def once():
        comm.Barrier()
        t0 = time.perf_counter()
        c = distmm.matmul(da, db, backend="cublas" if gpu else "auto")
        comm.Barrier()
        return time.perf_counter() - t0, c

    first, c = once()
    picked = blocks.sample_rows(n, args.check_rows)
    relerr = blocks.check_rows(comm, db.local, db.layout.local_bounds(comm.rank), c.local,
                               c.layout.local_bounds(comm.rank), n, n, n, dtype,
                               sampled=picked, seed=args.seed)
    stats = dict(c.stats)
    on_host = isinstance(c.local, np.ndarray)
    del c
    times = []
    for _ in range(args.repeat):
        seconds, c = once()
        del c
        times.append(seconds)
    held = comm.gather((da.local.nbytes + db.local.nbytes) / 2**30, root=0)
    # the first call's busy time per phase, the busiest rank's (where the streamed product
    # spends what it does not spend in GEMMs)
    busy = comm.gather(stats.get("phases") or {}, root=0)
    if comm.rank != 0:
        return 0
    from bench.common.records import RecordWriter
    from distmm.cli.records import cpu_model, gpu_name
    from distmm.config import get_config

    device = gpu_name() if gpu else cpu_model()
    writer = RecordWriter("mpi-outofcore", device, out_dir=args.out_dir, ranks=comm.size,
                          gpus=comm.size if gpu else 0)
    seconds = float(np.median(times or [first]))
    extra = {}
    if ref_seconds:
        ref_rate = 2.0 * args.ref_n ** 3 / ref_seconds
        writer.add("cublas-incore", dtype, args.ref_n, args.ref_n, args.ref_n, ref_seconds, None,
                   ranks=1, gpus=1, note="reference measured in the same run, one GPU, in core")
        extra["share"] = 2.0 * n ** 3 / seconds / (comm.size * ref_rate)
    rec = writer.add(f"distmm-mpi-hostblocks@{comm.size}{'gpu' if gpu else 'ranks'}", dtype,
                     n, n, n, seconds, relerr, first_seconds=first, all_seconds=times,
                     relerr_rows=int(picked.size), streamed=bool(stats.get("streamed")),
                     grid=list(stats["grid"]) if stats.get("grid") else None,
                     host_blocks_gib_per_rank=max(held), c_on_host=on_host,
                     operands_made_seconds=made, residency="host",
                     phases={k: max(b.get(k, 0.0) for b in busy) for b in busy for k in b},
                     device_memory_limit=get_config().device_memory_limit, **extra)
    print(f"n={n} {dtype}: first {first:.2f} s, median {seconds:.2f} s of {len(times)}, "
          f"{rec['tflops']:.1f} TFLOP/s, streamed {rec['streamed']}, relerr {relerr:.2e}, "
          f"{max(held):.1f} GiB of A and B blocks per rank"
          + (f"; cuBLAS in core at {args.ref_n}: {ref_seconds:.3f} s, share "
             f"{extra['share']:.3f} of {comm.size}x" if ref_seconds else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
