"""Where does an MPI product's time go, panel by panel? Broadcasts and GEMMs from CUDA events.

Runs ``distmm.matmul`` of two device-resident ``DistArray`` operands (each rank makes its
own blocks, as ``distmm bench`` does) ``--calls`` times under ``mpiexec``, and records on
every rank, from CUDA events: each panel broadcast (``row``: A's panels along a process
row; ``col``: B's along a process column) from when its stream reached it to its end, and
each GEMM. Rank 0 prints, per rank and call: the GEMMs' summed time, the compute stream's
idle gaps between them (what the broadcasts did not hide), each direction's broadcasts
(count, summed time, bytes, GB/s while running) and the first panels; ``--out`` writes
everything as JSON. The engine is not changed: the broadcasters and the GPU executor are
wrapped in this process only.

``--launch P`` starts the P ranks itself, ``--nodes N`` as N emulated nodes
(``distmm.cli.emulated.mpiexec_command``, the same launch as a study's ``nodes = N``);
without ``--launch``, run it under ``mpiexec`` yourself.

    python -m bench.research.summa_trace --launch 4 --nodes 2 --size 65536
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def _install(records: list) -> None:
    """Wrap the NCCL broadcaster and the GPU executor to append ``(kind, label, nbytes,
    start event, end event)`` to ``records``."""
    import cupy

    from distmm.engine.mpi import comm as mpicomm
    from distmm.engine.mpi import gridcomms
    from distmm.executor import gpu

    make = gridcomms.GridComms.__init__

    def init(self, *args, **kwargs):
        make(self, *args, **kwargs)
        for label in ("row", "col"):
            setattr(getattr(self, label), "trace_label", label)

    gridcomms.GridComms.__init__ = init
    bcast = mpicomm.NcclBroadcaster.ibcast

    def ibcast(self, buf, root):
        req = bcast(self, buf, root)
        if hasattr(req, "start"):
            records.append(("bcast", getattr(self, "trace_label", "?"), int(buf.nbytes),
                            req.start, req.done))
        return req

    mpicomm.NcclBroadcaster.ibcast = ibcast
    gemm = gpu.GPUExecutor.device_gemm

    def device_gemm(self, a, b, c, **kwargs):
        stream = kwargs.get("stream") or cupy.cuda.get_current_stream()
        e0 = stream.record()
        out = gemm(self, a, b, c, **kwargs)
        records.append(("gemm", "", int(2 * a.shape[0] * a.shape[1] * b.shape[1]), e0,
                        stream.record()))
        return out

    gpu.GPUExecutor.device_gemm = device_gemm


def summary(rows: list) -> dict:
    """One rank's call: ``rows`` of ``(kind, label, nbytes or flops, start ms, end ms)``."""
    gemms = sorted((a, b) for kind, _, _, a, b in rows if kind == "gemm")
    out = {"gemms": len(gemms), "gemm_ms": sum(b - a for a, b in gemms),
           "gap_ms": sum(max(0.0, a1 - b0) for (_, b0), (a1, _) in zip(gemms, gemms[1:])),
           "first_gemm_ms": gemms[0][0] if gemms else None,
           "last_gemm_end_ms": gemms[-1][1] if gemms else None}
    for label in ("row", "col"):
        got = [(n, a, b) for kind, lab, n, a, b in rows if kind == "bcast" and lab == label]
        ms = sum(b - a for _, a, b in got)
        nbytes = sum(n for n, _, _ in got)
        out[label] = {"count": len(got), "ms": ms, "bytes": nbytes,
                      "gbps": nbytes / ms / 1e6 if ms > 0 else None}
    return out


def _rank(args) -> int:
    import cupy
    from mpi4py import MPI

    import distmm
    from distmm.cli import blocks
    from distmm.engine.mpi import DistArray
    from distmm.engine.mpi.gridcomms import local_gpu
    from distmm.grid import make_grid

    comm = MPI.COMM_WORLD
    n, dtype = args.size, args.dtype
    grid = make_grid(n, n, n, dtype, ranks=comm.size)
    local_gpu(comm)
    a = cupy.asarray(blocks.block(blocks.A, (n, n), grid.a_layout.local_bounds(comm.rank), dtype))
    b = cupy.asarray(blocks.block(blocks.B, (n, n), grid.b_layout.local_bounds(comm.rank), dtype))
    da, db = DistArray(a, grid.a_layout, comm), DistArray(b, grid.b_layout, comm)
    del a, b
    records: list = []
    _install(records)
    calls = []
    for call in range(args.calls):
        records.clear()
        comm.Barrier()
        ref = cupy.cuda.get_current_stream().record()
        t0 = time.perf_counter()
        c = distmm.matmul(da, db)
        cupy.cuda.Device().synchronize()
        comm.Barrier()
        seconds = time.perf_counter() - t0
        ms = cupy.cuda.get_elapsed_time
        rows = [(kind, lab, nb, ms(ref, e0), ms(ref, e1)) for kind, lab, nb, e0, e1 in records]
        mine = {"rank": comm.rank, "call": call, "seconds": seconds,
                "grid": list(grid.shape), "summary": summary(rows),
                "node": os.environ.get("DISTMM_EMULATED_NODE"), "events": rows}
        calls.append(mine)
        del c
    every = comm.gather(calls, root=0)
    if comm.rank == 0:
        for call in range(args.calls):
            for per_rank in every:
                r = per_rank[call]
                s = r["summary"]
                first = s["first_gemm_ms"]
                line = (f"call {call} rank {r['rank']} (node {r['node']}): {r['seconds']:.3f} s; "
                        f"{s['gemms']} GEMMs {s['gemm_ms']:.1f} ms, gaps {s['gap_ms']:.1f} ms, "
                        f"first at {'-' if first is None else f'{first:.1f}'} ms")
                for label in ("row", "col"):
                    d = s[label]
                    if d["count"]:
                        line += (f"; {label} {d['count']} x, {d['ms']:.1f} ms, "
                                 f"{d['bytes'] / 2**30:.2f} GiB, {d['gbps']:.2f} GB/s")
                print(line, flush=True)
            detail = every[0][call]["events"][:args.detail]
            print("   rank 0's first events (kind, label, start ms, end ms): " + " ".join(
                f"[{k} {lab} {a:.1f}-{b:.1f}]" for k, lab, _, a, b in detail), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(every, f)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.summa_trace",
                                description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=32768)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--detail", type=int, default=12, help="rank 0's first events to print")
    p.add_argument("--out", help="a JSON file of every rank's events")
    p.add_argument("--launch", type=int, help="start this many ranks with mpiexec")
    p.add_argument("--nodes", default="1", help="with --launch: emulated nodes (or all-links)")
    p.add_argument("--dry-run", action="store_true", help="with --launch: print the command")
    args = p.parse_args(argv)
    if args.launch:
        from distmm.cli.emulated import mpiexec_command

        nodes = args.nodes if args.nodes == "all-links" else int(args.nodes)
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        i = rest.index("--launch")
        del rest[i:i + 2]
        if "--nodes" in rest:
            j = rest.index("--nodes")
            del rest[j:j + 2]
        rest = [a for a in rest if a != "--dry-run"]
        cmd = mpiexec_command(["mpiexec", "--oversubscribe"], args.launch, nodes,
                              [sys.executable, "-m", "mpi4py", "-m", "bench.research.summa_trace",
                               *rest])
        if args.dry_run:
            print(" ".join(cmd))
            return 0
        return subprocess.run(cmd).returncode
    return _rank(args)


if __name__ == "__main__":
    raise SystemExit(main())
