"""MPI benchmark (``mpi``): distmm's SUMMA engine under mpiexec against numpy's BLAS.

Writes one record per (variant, ranks, dtype, n) to
``bench/results/mpi-<device>-<date>.jsonl``. The driver (this script without
``--worker``) times the reference in its own process and launches
``mpiexec -n P python -m bench.mpi --worker`` for distmm, so both are measured
in the same run, one after the other.

Variants
--------
``numpy``
    ``a @ b`` in the driver with OpenBLAS on every core (its default; the cores the
    ranks share).
``distmm-mpi``
    ``distmm.matmul(A, B)`` on ``DistArray`` operands built from each rank's own
    blocks (no operand is replicated; C stays distributed, as pylops-mpi's and
    Heat's products do); one BLAS thread per rank. The record holds the bytes
    this rank received (``bytes_measured``, max over ranks, counted by the
    broadcasters) next to the planner's estimate (``bytes_estimated``) and the grid.
``pylops-mpi``, ``heat``
    Not run, and so not recorded (the run prints why): pylops-mpi
    0.8.0's ``MPIMatrixMult`` refuses rank counts that are not square numbers, and
    heat 1.9 is not on this machine's package index (1.8.0 needs torch<2.11.1).
``cublas`` (``--gpu``)
    ``cupy.matmul`` in-core on one GPU, against ``distmm-mpi`` on 1 rank with the GPU backend.

Modes: ``--mode cpu`` (default: 2 ranks, fp64 n = 4096 and 8192, numpy on 2
threads), ``--mode cpu16`` (the 16-core GPU machine: 1, 2, 4, 8, 16 ranks, fp64
n = 16384, numpy on 16 threads), ``--mode gpu`` (1 rank, fp32/fp64 32768, against
cuBLAS in-core). Timing: ``--rounds`` rounds, each timing the reference once
and then each rank count once (a fresh ``mpiexec``, one untimed product first,
the ranks synchronised by a barrier around the timed one); records hold the
medians and every time. The first round checks the result (relerr against a
float64 product) before timing.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODES = {
    "cpu": {"ranks": [2], "sizes": [4096, 8192], "dtypes": ["float64"], "threads": 2},
    "cpu16": {"ranks": [1, 2, 4, 8, 16], "sizes": [16384], "dtypes": ["float64"], "threads": 16},
    "gpu": {"ranks": [1], "sizes": [32768], "dtypes": ["float32", "float64"], "threads": 16},
}


def _operands(n: int, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)


def worker(args) -> int:
    """Run under mpiexec: build DistArrays from each rank's blocks, time the product."""
    from mpi4py import MPI

    import distmm
    from distmm.engine.mpi import DistArray
    from distmm.grid import BlockLayout, make_grid

    comm = MPI.COMM_WORLD
    n, dtype = args.n, args.dtype
    backend = "cublas" if args.gpu else "blas"
    grid = make_grid(n, n, n, dtype, ranks=comm.size)
    a_full, b_full = _operands(n, dtype)  # same seed: each rank keeps only its block below
    da = DistArray.from_array(a_full, comm, BlockLayout.grid((n, n), *_near_square(comm.size)))
    db = DistArray.from_array(b_full, comm, BlockLayout.grid((n, n), *_near_square(comm.size)))
    del a_full, b_full
    # Blocks start in the planner's layout (the engine would redistribute otherwise).
    da, db = da.redistribute(grid.a_layout), db.redistribute(grid.b_layout)
    if args.gpu:  # device-resident blocks, as cuBLAS in-core gets them; C stays on the GPU
        import cupy

        from distmm.engine.mpi.comm import select_local_gpu

        select_local_gpu(comm)
        da = DistArray(cupy.asarray(da.local), da.layout, comm)
        db = DistArray(cupy.asarray(db.local), db.layout, comm)
    c = distmm.matmul(da, db, backend=backend)
    full = c.gather(root=0)
    relerr = None
    if comm.rank == 0 and args.check:
        a, b = _operands(n, dtype)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        relerr = float(np.linalg.norm(full - ref) / np.linalg.norm(ref))
        del a, b, ref
    del full
    times = []
    for _ in range(args.repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        c = distmm.matmul(da, db, backend=backend)
        if args.gpu:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    measured = comm.gather(c.stats["bytes_received"], root=0)
    estimated = comm.gather(c.stats["bytes_estimated"], root=0)
    if comm.rank == 0:
        Path(args.result).write_text(json.dumps({
            "seconds": float(np.median(times)), "times": times, "relerr": relerr,
            "grid": list(c.stats["grid"]), "bytes_measured": measured, "bytes_estimated": estimated,
            "panels_per_layer": [len(p) - 1 for p in grid.panel_edges]}))
    return 0


def _near_square(p: int):
    from distmm.engine.mpi import square_grid

    return square_grid(p)


def _peer_not_run(name: str, ranks: int) -> str:
    """Why a peer was not measured (checked on the CPU machine, 2026-11-24)."""
    if name == "pylops-mpi":
        if math.isqrt(ranks) ** 2 != ranks:
            return (f"pylops-mpi 0.8.0 MPIMatrixMult (kind 'summa' and 'block') raises 'Number of "
                    f"processes must be a square number, provided {ranks}' (tried under mpiexec "
                    f"-n 2 here); it cannot run on {ranks} ranks")
        return "pylops-mpi runs only on square rank counts; its timing is not implemented here yet"
    return ("heat not installed: heat 1.9 is not on this machine's package index, and heat 1.8.0 "
            "(the newest there) needs torch<2.11.1 while the machine offers torch 2.13.0 only "
            "(pip: ResolutionImpossible)")


def driver(args) -> int:
    from bench.common import RecordWriter, cpu_model, relerr

    mode = MODES[args.mode]
    threads = os.cpu_count()  # numpy's OpenBLAS default: every core of the machine
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    device = cpu_model() if args.mode != "gpu" else _gpu_name()
    writer = RecordWriter("mpi", device, out_dir=args.out_dir, threads=threads, mode=args.mode,
                          numpy_version=np.__version__)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(Path(__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH")))))
    def launch(ranks, n, dtype, check):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "r.json"
            cmd = [mpiexec, "-n", str(ranks), "--oversubscribe", sys.executable, "-m",
                   "bench.mpi", "--worker", "--n", str(n), "--dtype", dtype,
                   "--repeat", "1", "--result", str(result)]
            cmd += ["--gpu"] if args.mode == "gpu" else []
            cmd += [] if check else ["--no-check"]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if r.returncode != 0 or not result.exists():
                raise RuntimeError(f"worker failed: {r.stdout[-3000:]} {r.stderr[-3000:]}")
            return json.loads(result.read_text())

    for dtype in args.dtypes or mode["dtypes"]:
        for n in args.sizes or mode["sizes"]:
            a, b = _operands(n, dtype)
            ref_err, ref_variant = None, "cublas" if args.mode == "gpu" else "numpy"
            if args.mode != "gpu":
                c = a @ b  # numpy's BLAS on every core of this process (its default); warm-up
                ref_err = relerr(c, a.astype(np.float64) @ b.astype(np.float64))
                del c
            ref_times, dist = [], {r: {"times": []} for r in (args.ranks or mode["ranks"])}
            # Rounds alternate the reference and each rank count, so that load from other
            # processes on a shared machine hits both alike.
            for rnd in range(args.rounds):
                if args.mode == "gpu":
                    ref_times.append(_cublas(a, b, 3))
                else:
                    t0 = time.perf_counter()
                    a @ b
                    ref_times.append(time.perf_counter() - t0)
                for ranks, acc in dist.items():
                    res = launch(ranks, n, dtype, check=args.check and rnd == 0)
                    acc["times"] += res["times"]
                    if rnd == 0:
                        acc.update({k: v for k, v in res.items() if k != "times"})
            del a, b
            ref_seconds = float(np.median(ref_times))
            writer.add(ref_variant, dtype, n, n, n, ref_seconds, ref_err, ranks=1,
                       times=ref_times,
                       note=f"{threads} BLAS threads" if ref_variant == "numpy" else "in-core")
            print(f"{ref_variant:12s} {dtype} n={n}: {ref_seconds:.3f} s "
                  f"{2 * n**3 / ref_seconds / 1e9:.1f} GFLOP/s", flush=True)
            for ranks, res in dist.items():
                seconds = float(np.median(res["times"]))
                rec = writer.add("distmm-mpi", dtype, n, n, n, seconds, res["relerr"],
                                 ranks=ranks, grid=res["grid"], times=res["times"],
                                 bytes_measured=max(res["bytes_measured"]),
                                 bytes_estimated=max(res["bytes_estimated"]),
                                 bytes_measured_per_rank=res["bytes_measured"],
                                 bytes_estimated_per_rank=res["bytes_estimated"],
                                 panels_per_layer=res["panels_per_layer"],
                                 ratio_to_reference=ref_seconds / seconds,
                                 backend="cublas" if args.mode == "gpu" else "blas",
                                 note="operands start distributed in the planner's layout; C stays "
                                      "distributed; one BLAS thread per rank; timed in rounds "
                                      "alternating with the reference")
                print(f"distmm-mpi   {dtype} n={n} ranks={ranks} grid={res['grid']}: "
                      f"{seconds:.3f} s {rec['tflops'] * 1e3:.1f} GFLOP/s, "
                      f"{ref_seconds / seconds:.2f} of {ref_variant}; bytes measured "
                      f"{max(res['bytes_measured'])} estimated {max(res['bytes_estimated'])}",
                      flush=True)
                for name in ("pylops-mpi", "heat"):  # a peer not run gets no record, only a line
                    print(f"{name:12s} {dtype} n={n} ranks={ranks}: not run: "
                          f"{_peer_not_run(name, ranks)}", flush=True)
    print(f"records: {writer.path}")
    return 0


def _gpu_name() -> str:
    from bench.common import gpu_name

    return gpu_name()


def _cublas(a, b, repeat: int) -> float:
    import cupy

    from bench.common import event_seconds

    da, db = cupy.asarray(a), cupy.asarray(b)
    sec = event_seconds(lambda: cupy.matmul(da, db), repeat=repeat)
    del da, db
    cupy.get_default_memory_pool().free_all_blocks()
    return sec


def main(argv=None) -> int:
    from bench.common import parser

    p = parser(__doc__, prog="python -m bench.mpi")
    p.add_argument("--mode", choices=sorted(MODES), default="cpu")
    p.add_argument("--ranks", type=int, nargs="+", default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--dtypes", nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating rounds: the reference, then each rank count, timed once each")
    p.add_argument("--repeat", type=int, default=1, help=argparse_hidden())
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--worker", action="store_true", help=argparse_hidden())
    p.add_argument("--n", type=int, default=0, help=argparse_hidden())
    p.add_argument("--dtype", default="float64", help=argparse_hidden())
    p.add_argument("--gpu", action="store_true", help=argparse_hidden())
    p.add_argument("--result", default="", help=argparse_hidden())
    args = p.parse_args(argv)
    return worker(args) if args.worker else driver(args)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
