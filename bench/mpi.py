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
``pylops-mpi``
    pylops-mpi's ``MPIMatrixMult(kind="summa")`` built as its own SUMMA example builds
    it: each rank of a square ``P' x P'`` grid holds only its ``local_block_split``
    blocks of A (in the operator) and of B (a flattened SCATTER ``DistributedArray``);
    the timed call is ``Aop @ x`` (its matvec: the SUMMA broadcasts, the block GEMMs and
    the new ``DistributedArray`` holding C's blocks, C staying distributed). Building the
    operator and ``x`` is not timed, as building the ``DistArray``s is not for distmm.
    Checked on sampled rows of each rank's C block against a float64 product. Runs only
    at square rank counts (pylops-mpi 0.8.0 refuses others) and only where
    ``import pylops_mpi`` works in the workers' environment (it is no dependency of
    distmm: put it on ``PYTHONPATH``); otherwise the run prints why and writes no record.
``heat``
    Not run, and so not recorded (the run prints why): heat 1.9 is not on this
    machine's package index (1.8.0 needs torch<2.11.1).
``cublas`` (``--gpu``)
    ``cupy.matmul`` in-core on one GPU, against ``distmm-mpi`` on 1 rank with the GPU backend.

Modes: ``--mode cpu`` (default: 2 ranks, fp64 n = 4096 and 8192, numpy on 2
threads; pylops-mpi at every square count given with ``--ranks``), ``--mode cpu16``
(the 16-core GPU machine: 1, 2, 4, 8, 16 ranks, pylops-mpi at 4 and 16, fp64
n = 16384, numpy on 16 threads), ``--mode gpu`` (1 rank, fp32/fp64 32768, against
cuBLAS in-core). Timing: ``--rounds`` rounds, each timing the reference once
and then each rank count once (a fresh ``mpiexec``, one untimed product first,
the ranks synchronised by a barrier around the timed one); records hold the
medians and every time. The first round checks the result (relerr of 64 sampled rows of C against a
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

# peer_ranks: the rank counts pylops-mpi runs at (None: every square count of the run)
MODES = {
    "cpu": {"ranks": [2], "sizes": [4096, 8192], "dtypes": ["float64"], "threads": 2,
            "peer_ranks": None},
    "cpu16": {"ranks": [1, 2, 4, 8, 16], "sizes": [16384], "dtypes": ["float64"], "threads": 16,
              "peer_ranks": [4, 16]},
    "gpu": {"ranks": [1], "sizes": [32768], "dtypes": ["float32", "float64"], "threads": 16,
            "peer_ranks": []},
}
PYLOPS_KIND = "summa"
SAMPLE_ROWS = 64  # rows of each rank's C block checked against float64 (pylops-mpi)


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
    if comm.rank == 0 and args.check:  # sampled rows against float64 (a full one takes hours)
        a, b = _operands(n, dtype)
        rows = _sample_rows(n)
        ref = a[rows].astype(np.float64) @ b.astype(np.float64)
        got = full[rows]
        got = got.get() if hasattr(got, "get") else np.asarray(got)  # C may stay on the GPU
        relerr = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
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


def pylops_worker(args) -> int:
    """Run under mpiexec: pylops-mpi's SUMMA ``MPIMatrixMult`` on each rank's own blocks."""
    from mpi4py import MPI

    import pylops_mpi
    from pylops_mpi.basicoperators.MatrixMult import (MPIMatrixMult, active_grid_comm,
                                                      local_block_split)

    n, dtype = args.n, args.dtype
    comm, rank, _, _, active = active_grid_comm(MPI.COMM_WORLD, n, n)  # as its example does
    if not active:  # only when P' > n: never at the sizes benchmarked here
        return 0
    a_full, b_full = _operands(n, dtype)  # same seed as distmm: each rank keeps only its blocks
    a_slice, b_slice = local_block_split((n, n), rank, comm), local_block_split((n, n), rank, comm)
    a_local, b_local = a_full[a_slice].copy(), b_full[b_slice].copy()
    del a_full, b_full
    aop = MPIMatrixMult(a_local, n, base_comm=comm, kind=PYLOPS_KIND, dtype=a_local.dtype)
    x = pylops_mpi.DistributedArray(global_shape=n * n,
                                    local_shapes=comm.allgather(b_local.size), base_comm=comm,
                                    partition=pylops_mpi.Partition.SCATTER, dtype=b_local.dtype)
    x[:] = b_local.ravel()
    y = aop @ x  # untimed first product
    diff2 = ref2 = 0.0
    checked = 0
    if args.check:  # sampled rows of this rank's C block against a float64 product
        a, b = _operands(n, dtype)
        rows = np.arange(a_slice[0].start, a_slice[0].stop)
        pick = np.random.default_rng(rank).choice(rows.size, min(SAMPLE_ROWS, rows.size),
                                                  replace=False)
        mine = y.local_array.reshape(rows.size, -1)[pick]
        ref = a[rows[pick]].astype(np.float64) @ b[:, b_slice[1]].astype(np.float64)
        diff2, ref2 = float(np.sum((mine - ref) ** 2)), float(np.sum(ref ** 2))
        checked = int(mine.size)
        del a, b, ref
    diff2, ref2, checked = comm.allreduce(diff2), comm.allreduce(ref2), comm.allreduce(checked)
    del y
    times = []
    for _ in range(args.repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        y = aop @ x
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        p_prime = math.isqrt(comm.size)
        Path(args.result).write_text(json.dumps({
            "seconds": float(np.median(times)), "times": times,
            "relerr": math.sqrt(diff2 / ref2) if args.check else None,
            "grid": [p_prime, p_prime], "version": pylops_mpi.__version__,
            "checked_elements": checked}))
    return 0


def _pylops_import(env) -> tuple[str | None, str]:
    """(version, "") when ``import pylops_mpi`` works in the workers' environment, else
    (None, why). Checked in a subprocess: importing it initialises MPI (mpi4py)."""
    r = subprocess.run([sys.executable, "-c", "import pylops_mpi; print(pylops_mpi.__version__)"],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        return r.stdout.strip().splitlines()[-1], ""
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    return None, f"import pylops_mpi failed in the workers' environment: {last}"


def _peer_ranks(mode: dict, ranks: list[int]) -> list[int]:
    """The rank counts pylops-mpi runs at: the mode's list, or every square count of the run."""
    if mode["peer_ranks"] is not None:
        return [r for r in ranks if r in mode["peer_ranks"]]
    return [r for r in ranks if math.isqrt(r) ** 2 == r]


def _sample_rows(n: int, count: int = 64):
    """The rows of C that are checked against a float64 product (all of them when few)."""
    if n <= count:
        return np.arange(n)
    return np.sort(np.random.default_rng(n).choice(n, count, replace=False))


def _near_square(p: int):
    from distmm.engine.mpi import square_grid

    return square_grid(p)


def _peer_not_run(name: str, ranks: int, mode: str = "cpu", pylops_why: str = "") -> str:
    """Why a peer was not measured at this rank count (checked on the CPU machine, 2026-11-24)."""
    if name == "pylops-mpi":
        if mode == "gpu":
            return "pylops-mpi is compared on the CPU modes only"
        if math.isqrt(ranks) ** 2 != ranks:
            return (f"pylops-mpi 0.8.0 MPIMatrixMult (kind 'summa' and 'block') raises 'Number of "
                    f"processes must be a square number, provided {ranks}' (tried under mpiexec "
                    f"-n 2 here); it cannot run on {ranks} ranks")
        return pylops_why or f"mode {mode} runs pylops-mpi at other rank counts only"
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
               PYTHONPATH=os.pathsep.join(
                   [str(Path(__file__).resolve().parent.parent)]
                   + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run_ranks = args.ranks or mode["ranks"]
    peer_ranks = _peer_ranks(mode, run_ranks)
    pylops_version, pylops_why = _pylops_import(env) if peer_ranks else (None, "")
    if pylops_version is None:
        peer_ranks = []

    def launch(ranks, n, dtype, check, peer=False):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "r.json"
            cmd = [mpiexec, "-n", str(ranks), "--oversubscribe", sys.executable, "-m",
                   "bench.mpi", "--worker", "--n", str(n), "--dtype", dtype,
                   "--repeat", "1", "--result", str(result)]
            cmd += ["--gpu"] if args.mode == "gpu" else []
            cmd += ["--peer", "pylops-mpi"] if peer else []
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
                rows = _sample_rows(n)
                ref_err = relerr(c[rows], a[rows].astype(np.float64) @ b.astype(np.float64))
                del c
            ref_times, dist = [], {r: {"times": []} for r in run_ranks}
            peer = {r: {"times": []} for r in peer_ranks}
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
                    if ranks in peer:  # pylops-mpi right after distmm at the same rank count
                        res = launch(ranks, n, dtype, check=args.check and rnd == 0, peer=True)
                        peer[ranks]["times"] += res["times"]
                        if rnd == 0:
                            peer[ranks].update({k: v for k, v in res.items() if k != "times"})
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
                if ranks in peer:
                    _pylops_record(writer, peer[ranks], dtype, n, ranks, ref_seconds, ref_variant,
                                   pylops_version)
                for name in ("pylops-mpi", "heat"):  # a peer not run gets no record, only a line
                    if name == "pylops-mpi" and ranks in peer:
                        continue
                    print(f"{name:12s} {dtype} n={n} ranks={ranks}: not run: "
                          f"{_peer_not_run(name, ranks, args.mode, pylops_why)}", flush=True)
    print(f"records: {writer.path}")
    return 0


def _pylops_record(writer, res: dict, dtype: str, n: int, ranks: int, ref_seconds: float,
                   ref_variant: str, version: str) -> None:
    seconds = float(np.median(res["times"]))
    rec = writer.add("pylops-mpi", dtype, n, n, n, seconds, res["relerr"], ranks=ranks,
                     grid=res["grid"], times=res["times"], kind=PYLOPS_KIND,
                     pylops_mpi_version=res["version"], checked_elements=res["checked_elements"],
                     ratio_to_reference=ref_seconds / seconds,
                     note=f"pylops-mpi {version} MPIMatrixMult kind={PYLOPS_KIND!r}, timed Aop @ x "
                          f"(C stays distributed); each rank holds only its local_block_split "
                          f"blocks; one BLAS thread per rank; relerr on {res['checked_elements']} "
                          f"elements of C (up to {SAMPLE_ROWS} rows of each rank's block); timed in rounds alternating with the reference")
    print(f"pylops-mpi   {dtype} n={n} ranks={ranks} grid={res['grid']}: {seconds:.3f} s "
          f"{rec['tflops'] * 1e3:.1f} GFLOP/s, {ref_seconds / seconds:.2f} of {ref_variant}; "
          f"relerr {res['relerr']}", flush=True)


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
    p.add_argument("--peer", default="", choices=["", "pylops-mpi"], help=argparse_hidden())
    p.add_argument("--result", default="", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.worker:
        return pylops_worker(args) if args.peer == "pylops-mpi" else worker(args)
    return driver(args)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
