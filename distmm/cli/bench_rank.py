"""The ranks' program of ``distmm bench``: the MPI configurations of one rank count, run as
``mpiexec -n P python -m mpi4py -m distmm.cli.bench_rank SPEC.json`` by the runner.

This module covers: each rank making its own blocks of A and B in the planner's layout
(``distmm.cli.blocks``: the same matrices as the runner's in-process variants, no rank
holding a whole one), on its GPU in a GPU study; the first ``distmm.matmul`` of two
``DistArray`` operands and the warm ones timed between barriers (C stays distributed), the
first one's sampled rows checked against float64 (``blocks.check_rows``); and rank 0
appending each configuration's record (``distmm.cli.records``), a status line for the
runner and a progress line, as soon as it is measured. Under ``python -m mpi4py`` an
exception on any rank aborts every rank, and the runner reports the configurations that
have no status line. A runner that is gone (killed with SIGKILL) stops the ranks before
their next configuration, and its temporary files are removed.
It does *not* cover: which configurations run (``distmm.cli.study``), launching
``mpiexec`` (``distmm.cli.bench``) or the MPI engine itself (``distmm.engine.mpi``).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

__all__ = ["config_to_dict", "main"]


def config_to_dict(config, index: int) -> dict:
    """What the ranks need of a ``distmm.cli.study.Config``, and its number in the study."""
    return {"index": index, "variant": config.variant, "backend": config.backend,
            "dtype": config.dtype, "m": config.m, "n": config.n, "k": config.k,
            "series": config.series, "describe": config.describe()}


def _run_one(comm, spec: dict, cfg: dict) -> dict | None:
    import distmm
    from distmm.cli import blocks
    from distmm.engine.mpi import DistArray
    from distmm.grid import make_grid

    m, n, k, dtype, seed = cfg["m"], cfg["n"], cfg["k"], cfg["dtype"], spec["seed"]
    gpu, threads = spec["gpu"], spec["threads"]
    grid = make_grid(m, n, k, dtype, ranks=comm.size)
    if gpu:  # first: the rank's GPU, and its CPUs (a one-CPU binding widened) for making blocks
        from distmm.engine.mpi.gridcomms import local_gpu

        local_gpu(comm)
    a_local = blocks.block(blocks.A, (m, k), grid.a_layout.local_bounds(comm.rank), dtype, seed,
                           threads=threads)
    b_local = blocks.block(blocks.B, (k, n), grid.b_layout.local_bounds(comm.rank), dtype, seed,
                           threads=threads)
    sync = None
    if gpu:  # device-resident blocks, as cuBLAS in-core gets them; C stays on the GPU
        import cupy

        a_local, b_local = cupy.asarray(a_local), cupy.asarray(b_local)
        sync = cupy.cuda.Device().synchronize
    da = DistArray(a_local, grid.a_layout, comm)
    db = DistArray(b_local, grid.b_layout, comm)
    del a_local, b_local

    def once():
        comm.Barrier()
        t0 = time.perf_counter()
        c = distmm.matmul(da, db, backend=cfg["backend"],
                          precision=spec.get("precision", "highest"))
        if sync:
            sync()
        comm.Barrier()
        return time.perf_counter() - t0, c

    first, c = once()
    picked = blocks.sample_rows(m, spec["check_rows"] or m)
    relerr = blocks.check_rows(comm, db.local, db.layout.local_bounds(comm.rank), c.local,
                               c.layout.local_bounds(comm.rank), m, n, k, dtype, sampled=picked,
                               seed=seed)
    stats = dict(c.stats)
    del c
    times = []
    for _ in range(spec["repeats"]):
        seconds, c = once()
        del c
        times.append(seconds)
    received = comm.gather(stats.get("bytes_received"), root=0)
    # the CPUs each rank ran on (after distmm.engine.mpi.cpus widened a one-CPU binding)
    cpus = comm.gather(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else None, root=0)
    if comm.rank != 0:
        return None
    bound = spec["relerr_bound"][dtype]
    ok = relerr is not None and relerr <= bound
    extra = {"first_seconds": first, "all_seconds": times, "relerr_rows": int(picked.size),
             "relerr_ok": ok, **spec["extra"][str(cfg["index"])],
             "grid": list(stats["grid"]) if stats.get("grid") else None,
             "threads_per_rank": None if gpu else threads,
             "bytes_received_max": max((r for r in received if r is not None), default=None),
             "cpus_per_rank": min((c for c in cpus if c is not None), default=None),
             "residency": "device" if gpu else "host"}
    return {"relerr": relerr, "seconds": float(np.median(times)), "ok": ok, "bound": bound,
            "extra": extra}


def main(argv=None) -> int:
    from mpi4py import MPI

    from distmm.cli.exits import whole_line_writes
    from distmm.cli.records import append_record, make_record, progress_line

    whole_line_writes()
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        spec = json.load(fh)
    comm = MPI.COMM_WORLD
    for cfg in spec["configs"]:
        # a runner killed with SIGKILL cannot stop its launch: the ranks stop at the next
        # configuration, and write no record of one that ended after it had gone
        if comm.bcast(comm.rank != 0 or _runner_alive(spec), root=0) is False:
            if comm.rank == 0:
                _orphaned(argv[0], spec)
            return 0  # no one reads the status (under mpi4py, any other would call MPI_Abort)
        result = _run_one(comm, spec, cfg)
        if result is None or not _runner_alive(spec):
            continue
        rec = make_record(**spec["record"], variant=cfg["variant"], dtype=cfg["dtype"],
                          m=cfg["m"], n=cfg["n"], k=cfg["k"], seconds=result["seconds"],
                          relerr=result["relerr"], **result["extra"])
        append_record(spec["output"], rec)
        why = "" if result["ok"] else f"relerr {result['relerr']} above {result['bound']:g}"
        append_record(spec["status"], {"index": cfg["index"], "ok": result["ok"], "why": why})
        print(progress_line(cfg["index"], spec["total"], rec), flush=True)
    return 0


def _runner_alive(spec: dict) -> bool:
    """Whether the ``distmm bench`` that launched the ranks still runs (its id and start
    time in the spec; a spec without them: assumed alive)."""
    runner = spec.get("runner")
    if not runner:
        return True
    import psutil

    try:
        proc = psutil.Process(runner[0])
        return (abs(proc.create_time() - runner[1]) < 0.01
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _orphaned(spec_path: str, spec: dict) -> None:
    """Rank 0, the runner gone: one line, and the runner's spec and status files removed."""
    print(f"distmm bench: the runner (process {spec['runner'][0]}) has gone; the ranks stop "
          f"without measuring the rest of this launch", file=sys.stderr, flush=True)
    for path in (spec_path, spec.get("status")):
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
