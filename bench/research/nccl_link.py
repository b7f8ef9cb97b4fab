"""Probe: how fast does NCCL broadcast between two ranks, as launched (emulated nodes or not)?

Two MPI ranks, one GPU each (run it under ``mpiexec -n 2``; give each rank its own
``NCCL_HOSTID`` to emulate two nodes, see ``distmm.emulate``). Prints the median seconds and GB/s of ``--repeat`` broadcasts of each
size from rank 0, and NCCL's chosen transport when ``NCCL_DEBUG=INFO`` is set.

    mpiexec -n 1 -x NCCL_HOSTID=a -x NCCL_NET=Socket ... python -m bench.research.nccl_link : \
            -n 1 -x NCCL_HOSTID=b ... python -m bench.research.nccl_link
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.nccl_link")
    p.add_argument("--mib", type=int, nargs="+", default=[4, 64, 512])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    import cupy
    from cupy.cuda import nccl
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
    uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None, root=0)
    nc = nccl.NcclCommunicator(comm.size, uid, comm.rank)
    stream = cupy.cuda.Stream(non_blocking=True)
    for mib in args.mib:
        buf = cupy.ones(mib << 20, dtype=cupy.uint8)
        times = []
        for it in range(args.repeat + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            nc.bcast(buf.data.ptr, buf.size, nccl.NCCL_UINT8, 0, stream.ptr)
            stream.synchronize()
            comm.Barrier()
            if it:
                times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        if comm.rank == 0:
            print(f"nccl_link: {mib} MiB in {sec * 1e3:.2f} ms, {(mib << 20) / sec / 1e9:.2f} GB/s",
                  flush=True)
    nc.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
