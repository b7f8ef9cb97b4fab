"""MPI benchmark (``mpi``): distmm's SUMMA engine under mpiexec against numpy's BLAS and cuBLAS.

Writes one record per (variant, ranks, dtype, n) to
``bench/results/mpi-<device>-<date>.jsonl``. The driver (this script without
``--worker``) times the reference in its own process and launches
``mpiexec -n P python -m bench.mpi --worker`` for distmm, so both are measured
in the same run, one after the other.

Operands come from ``bench/mpi_blocks.py``: every element is a fixed draw of a
counter-based generator, so each rank makes only its own blocks (no rank ever
holds a whole matrix, and large n fits), and the matrix is the same at every
rank count; the references make the same matrices whole.

Variants
--------
``numpy``
    ``a @ b`` in the driver with OpenBLAS on every core (its default; the cores the
    ranks share).
``distmm-mpi``
    ``distmm.matmul(A, B)`` on ``DistArray`` operands whose blocks each rank made in the
    planner's layout (C stays distributed, as pylops-mpi's and Heat's products do); each
    rank's BLAS gets the cores over the ranks (``OPENBLAS_NUM_THREADS``). The record holds
    the bytes each rank received (``bytes_measured``, max over ranks, counted by the
    broadcasters) next to the planner's estimate (``bytes_estimated``), the grid, the
    panels and the grid-communicator cache's counts (made once per communicator, reused by
    every later product).
``pylops-mpi``
    pylops-mpi's ``MPIMatrixMult(kind="summa")`` built as its own SUMMA example builds
    it: each rank of a square ``P' x P'`` grid holds only its ``local_block_split``
    blocks of A (in the operator) and of B (a flattened SCATTER ``DistributedArray``);
    the timed call is ``Aop @ x`` (its matvec: the SUMMA broadcasts, the block GEMMs and
    the new ``DistributedArray`` holding C's blocks, C staying distributed). Building the
    operator and ``x`` is not timed, as building the ``DistArray``s is not for distmm.
    Runs only at square rank counts (pylops-mpi 0.8.0 refuses others) and only where
    ``import pylops_mpi`` works in the workers' environment (it is no dependency of
    distmm: put it on ``PYTHONPATH``); otherwise the run prints why and writes no record.
``heat`` (``bench/heat_peer.py``)
    Heat 1.8.0's ``ht.matmul(A, B)`` with A and B split along rows (``split=0``, the
    layout of Heat's own matmul benchmark; C stays distributed, split 0) under the same
    ``mpiexec`` right after distmm, at every case of the run (device ``gpu`` in ``--mode
    gpu``). heat 1.8.0 (the newest on PyPI) declares ``torch<2.11.1`` while the machines
    have newer torch, so it is installed ``pip install --no-deps`` against that torch (with
    scipy and the matching torchvision, which ``import heat`` needs), in its own folder if
    need be (``--heat-site``, first on the ``PYTHONPATH`` of its ranks only). Where ``import
    heat`` fails there the run prints the exception's line and writes no record.
``nvmath-python`` (cuBLASMp, ``--mode gpu``; ``bench/nvmath_peer.py``)
    nvmath-python's distributed ``Matmul`` (cuBLASMp over NCCL) under the same ``mpiexec``
    as distmm, right after it, at the cases with one GPU per rank (NCCL allows no two ranks
    on one GPU): rank r holds rows of A and columns of B, and gets rows of C. Its wheels
    live in their own folder (``--nvmath-site``, first on the ``PYTHONPATH`` of its ranks
    only). Where it does not load or initialise (missing wheels, an NCCL older than 2.29.2)
    the run prints the exception's line and writes no record; distmm's are unaffected.
``cublas`` (``--mode gpu``)
    ``cupy.matmul`` in-core on one GPU (the driver's), against ``distmm-mpi`` with the
    GPU backend and device-resident blocks.

Modes
-----
``cpu`` (default)
    2 ranks, fp64 n = 4096 and 8192, numpy on the machine's threads; pylops-mpi at every
    square count given with ``--ranks``; heat at every count.
``cpu16``
    The 16-core GPU machine: 16, 8, 4, 2 and 1 ranks (cores / ranks BLAS threads each),
    fp64 n = 16384, numpy on 16 threads; pylops-mpi at 16 and 4 ranks; heat at every count.
``gpu``
    1 rank at fp32 and fp64 n = 32768 against in-core cuBLAS; 2 ranks sharing one GPU
    (``CUDA_VISIBLE_DEVICES`` set to one device) at fp32 16384 against cuBLAS at 16384;
    2 ranks on 2 GPUs at fp32 32768 when 2 are visible (``parallel_efficiency`` against
    twice one GPU's cuBLAS); heat (device ``gpu``) at every case.

Timing: ``--rounds`` rounds (cpu: 3, cpu16 and gpu: 1), each timing the reference and
then each rank count once (a fresh ``mpiexec``: one untimed product first, whose sampled
rows are checked, then ``--repeat`` timed ones, the ranks synchronised by a barrier
around each); records hold the medians and every time. Every record's ``relerr`` compares
64 sampled rows of C with a float64 product (for distmm, each rank multiplies the sampled
rows of A by its own block of B in float64 and the partial products are summed).
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

from bench import mpi_blocks
from bench.common.peers import (SAMPLE_ROWS, check_rows, peer_import, rows_product,
                                threads_per_rank)
from bench.mpi_blocks import A, B, sample_rows

# cases: (ranks, dtype, n, gpus) for the gpu mode (gpus: 1 = the ranks share one GPU);
# peer_ranks: the rank counts pylops-mpi runs at (None: every square count of the run)
MODES = {
    "cpu": {"ranks": [2], "sizes": [4096, 8192], "dtypes": ["float64"], "threads": 2,
            "peer_ranks": None, "rounds": 3, "repeat": 1},
    "cpu16": {"ranks": [16, 8, 4, 2, 1], "sizes": [16384], "dtypes": ["float64"], "threads": 16,
              "peer_ranks": [4, 16], "rounds": 1, "repeat": 1},
    "gpu": {"cases": [(1, "float32", 32768, 1), (1, "float64", 32768, 1),
                      (2, "float32", 16384, 1), (2, "float32", 32768, 2)],
            "threads": 16, "peer_ranks": [], "rounds": 1, "repeat": 3},
}
PEERS = {"cpu": ["pylops-mpi", "heat"], "cpu16": ["pylops-mpi", "heat"],  # --peers
         "gpu": ["nvmath-python", "heat"]}
PYLOPS_KIND = "summa"
def worker(args) -> int:
    """Run under mpiexec: each rank makes its own blocks in the planner's layout, then the
    products are checked and timed."""
    from mpi4py import MPI

    import distmm
    from distmm.engine.mpi import DistArray, cache_stats
    from distmm.grid import make_grid

    comm = MPI.COMM_WORLD
    n, dtype = args.n, args.dtype
    backend = "cublas" if args.gpu else "blas"
    threads = threads_per_rank(comm.size)
    grid = make_grid(n, n, n, dtype, ranks=comm.size)
    a_local = mpi_blocks.block(A, (n, n), grid.a_layout.local_bounds(comm.rank), dtype,
                               threads=threads)
    b_local = mpi_blocks.block(B, (n, n), grid.b_layout.local_bounds(comm.rank), dtype,
                               threads=threads)
    if args.gpu:  # device-resident blocks, as cuBLAS in-core gets them; C stays on the GPU
        import cupy

        from distmm.engine.mpi.gridcomms import local_gpu

        local_gpu(comm)
        a_local, b_local = cupy.asarray(a_local), cupy.asarray(b_local)
    da = DistArray(a_local, grid.a_layout, comm)
    db = DistArray(b_local, grid.b_layout, comm)
    del a_local, b_local
    c = distmm.matmul(da, db, backend=backend)  # untimed; its sampled rows are checked
    relerr = _check_distributed(comm, db, c, n, dtype) if args.check else None
    del c
    times = []
    for _ in range(max(args.repeat, 1)):
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
    stats = comm.gather(cache_stats(), root=0)
    if comm.rank == 0:
        Path(args.result).write_text(json.dumps({
            "seconds": float(np.median(times)), "times": times, "relerr": relerr,
            "grid": list(c.stats["grid"]), "bytes_measured": measured, "bytes_estimated": estimated,
            "panels_per_layer": c.stats["panels_per_layer"], "threads_per_rank": threads,
            "grid_comms": {k: max(s[k] for s in stats) for k in stats[0]}}))
    return 0


def _check_distributed(comm, db, c, n: int, dtype: str):
    """relerr of C's sampled rows against float64 (``check_rows`` on distmm's blocks)."""
    return check_rows(comm, db.local, db.layout.local_bounds(comm.rank), c.local,
                      c.layout.local_bounds(comm.rank), n, dtype)


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
    threads = threads_per_rank(MPI.COMM_WORLD.size)
    a_slice, b_slice = local_block_split((n, n), rank, comm), local_block_split((n, n), rank, comm)
    a_local = mpi_blocks.block(A, (n, n), _bounds(a_slice, n), dtype, threads=threads)
    b_local = mpi_blocks.block(B, (n, n), _bounds(b_slice, n), dtype, threads=threads)
    aop = MPIMatrixMult(a_local, n, base_comm=comm, kind=PYLOPS_KIND, dtype=a_local.dtype)
    x = pylops_mpi.DistributedArray(global_shape=n * n,
                                    local_shapes=comm.allgather(b_local.size), base_comm=comm,
                                    partition=pylops_mpi.Partition.SCATTER, dtype=b_local.dtype)
    x[:] = b_local.ravel()
    y = aop @ x  # untimed first product
    diff2 = ref2 = 0.0
    checked = 0
    if args.check:  # sampled rows of this rank's C block against a float64 product
        rows = np.arange(*_bounds(a_slice, n)[:2])
        pick = np.random.default_rng(rank).choice(rows.size, min(SAMPLE_ROWS, rows.size),
                                                  replace=False)
        mine = y.local_array.reshape(rows.size, -1)[pick]
        c0, c1 = _bounds(b_slice, n)[2:]
        a_rows = mpi_blocks.rows(A, (n, n), rows[pick], 0, n, dtype)
        b_cols = mpi_blocks.block(B, (n, n), (0, n, c0, c1), dtype, threads=threads)
        ref = rows_product(a_rows, b_cols)
        diff2, ref2 = float(np.sum((mine - ref) ** 2)), float(np.sum(ref ** 2))
        checked = int(mine.size)
        del b_cols, ref
    diff2, ref2, checked = comm.allreduce(diff2), comm.allreduce(ref2), comm.allreduce(checked)
    del y
    times = []
    for _ in range(max(args.repeat, 1)):
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
            "checked_elements": checked, "threads_per_rank": threads}))
    return 0


def _bounds(slices, n: int) -> tuple[int, int, int, int]:
    """``(r0, r1, c0, c1)`` of a pair of slices of an ``n x n`` matrix."""
    r, c = slices
    r0, r1, _ = r.indices(n)
    c0, c1, _ = c.indices(n)
    return r0, r1, c0, c1


def _pylops_import(env) -> tuple[str | None, str]:
    """(version, "") when ``import pylops_mpi`` works in the workers' environment, else
    (None, why)."""
    return peer_import("import pylops_mpi; print(pylops_mpi.__version__)", env,
                       "import pylops_mpi failed in the workers' environment")


def _peer_ranks(mode: dict, ranks: list[int]) -> list[int]:
    """The rank counts pylops-mpi runs at: the mode's list, or every square count of the run."""
    if mode["peer_ranks"] is not None:
        return [r for r in ranks if r in mode["peer_ranks"]]
    return [r for r in ranks if math.isqrt(r) ** 2 == r]


def _peer_not_run(name: str, ranks: int, mode: str = "cpu", why: str = "") -> str:
    """Why a peer was not measured at this rank count (checked on the CPU machine, 2026-11-24);
    ``why``: the reason found in this run (an import that failed, ...), where there is one."""
    if name == "pylops-mpi":
        if mode == "gpu":
            return "pylops-mpi is compared on the CPU modes only"
        if math.isqrt(ranks) ** 2 != ranks:
            return (f"pylops-mpi 0.8.0 MPIMatrixMult (kind 'summa' and 'block') raises 'Number of "
                    f"processes must be a square number, provided {ranks}' (tried under mpiexec "
                    f"-n 2 here); it cannot run on {ranks} ranks")
        return why or f"mode {mode} runs pylops-mpi at other rank counts only"
    if name == "nvmath-python":
        return why or "not asked for (--peers)"
    # heat: the import that failed in this run (heat 1.8.0, the newest on PyPI, declares
    # torch<2.11.1: it is installed --no-deps beside a newer torch; see bench/heat_peer.py)
    return why or "not asked for (--peers)"


def _cases(args, mode: dict) -> list[tuple[int, str, int, int]]:
    """``(ranks, dtype, n, gpus)`` to run, in order (``gpus`` matters in the gpu mode only)."""
    if "cases" in mode and not (args.ranks or args.sizes or args.dtypes):
        return list(mode["cases"])
    ranks = args.ranks or mode.get("ranks", [1])
    dtypes = args.dtypes or mode.get("dtypes", ["float32", "float64"])
    return [(r, d, n, min(args.gpus, r)) for d in dtypes
            for n in args.sizes or mode.get("sizes", [32768]) for r in ranks]


def _visible_gpus() -> list[str]:
    """Ids of the GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` would name them."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    named = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named[:count] if named else [str(i) for i in range(count)]


def driver(args) -> int:
    from bench import heat_peer, nvmath_peer
    from bench.common import RecordWriter, cpu_model, relerr

    mode = MODES[args.mode]
    gpu = args.mode == "gpu"
    rounds = args.rounds or mode["rounds"]
    repeat = args.repeat or mode["repeat"]
    threads = os.cpu_count()  # numpy's OpenBLAS default: every core of the machine
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    device = cpu_model() if not gpu else _gpu_name()
    writer = RecordWriter("mpi", device, out_dir=args.out_dir, threads=threads, mode=args.mode,
                          numpy_version=np.__version__)
    base_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    PYTHONPATH=os.pathsep.join(
                        [str(Path(__file__).resolve().parent.parent)]
                        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cases = _cases(args, mode)
    gpus_visible = _visible_gpus() if gpu else []
    for case in [c for c in cases if c[3] > len(gpus_visible) and gpu]:
        print(f"distmm-mpi   {case[1]} n={case[2]} ranks={case[0]} on {case[3]} GPUs: not run: "
              f"{len(gpus_visible)} GPU(s) visible", flush=True)
    cases = [c for c in cases if not gpu or c[3] <= len(gpus_visible)]
    peers = PEERS[args.mode] if args.peers is None else args.peers
    peer_ranks = (_peer_ranks(mode, sorted({c[0] for c in cases}))
                  if not gpu and "pylops-mpi" in peers else [])
    pylops_version, pylops_why = _pylops_import(base_env) if peer_ranks else (None, "")
    if pylops_version is None:
        peer_ranks = []
    pylops_why = pylops_why if "pylops-mpi" in peers else "not asked for (--peers)"
    nvmath_env = nvmath_peer.env_with(args.nvmath_site, base_env)
    nvmath_versions, nvmath_why = (nvmath_peer.check(nvmath_env) if "nvmath-python" in peers
                                   else (None, "not asked for (--peers)"))
    if nvmath_versions is not None and not gpu:
        nvmath_versions, nvmath_why = None, "nvmath-python runs in --mode gpu only (cuBLASMp)"
    heat_env = nvmath_peer.env_with(args.heat_site, base_env)
    heat_versions, heat_why = (heat_peer.check(heat_env) if "heat" in peers
                               else (None, "not asked for (--peers)"))

    def env_for(ranks: int, gpus: int, peer: str = "") -> dict:
        per = str(threads_per_rank(ranks))
        env = dict({nvmath_peer.NAME: nvmath_env, heat_peer.NAME: heat_env}.get(peer, base_env),
                   OMP_NUM_THREADS=per, OPENBLAS_NUM_THREADS=per, MKL_NUM_THREADS=per)
        if gpu and gpus == 1 and ranks > 1:  # the ranks share one GPU, even where more exist
            env["CUDA_VISIBLE_DEVICES"] = gpus_visible[0]
        return env

    def launch(ranks, gpus, n, dtype, check, peer=""):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "r.json"
            cmd = [mpiexec, "-n", str(ranks), "--oversubscribe", "--bind-to", "none",
                   sys.executable, "-m", "bench.mpi", "--worker", "--n", str(n), "--dtype", dtype,
                   "--repeat", str(repeat), "--result", str(result)]
            cmd += ["--gpu"] if gpu else []
            cmd += ["--peer", peer] if peer else []
            cmd += [] if check else ["--no-check"]
            r = subprocess.run(cmd, env=env_for(ranks, gpus, peer), capture_output=True,
                               text=True, timeout=3600)
            if r.returncode != 0 or not result.exists():
                raise RuntimeError(f"worker failed: {r.stdout[-3000:]} {r.stderr[-3000:]}")
            return json.loads(result.read_text())

    groups: dict[tuple[str, int], list] = {}
    for case in cases:
        groups.setdefault((case[1], case[2]), []).append(case)
    ref_variant = "cublas" if gpu else "numpy"
    for (dtype, n), group in groups.items():
        a = mpi_blocks.full(A, (n, n), dtype)
        b = mpi_blocks.full(B, (n, n), dtype)
        rows = sample_rows(n, SAMPLE_ROWS)
        ref_err = None
        if not gpu:
            c = a @ b  # numpy's BLAS on every core of this process (its default); warm-up
            ref_err = relerr(c[rows], a[rows].astype(np.float64) @ b.astype(np.float64))
            del c
        ref_times = []
        dist = {case: {"times": []} for case in group}
        peer = {case: {"times": []} for case in group if case[0] in peer_ranks}
        nvm = {case: {"times": []} for case in group
               if nvmath_versions is not None and case[0] == case[3]}  # one GPU per rank
        hts = {case: {"times": []} for case in group if heat_versions is not None}
        # Rounds alternate the reference and each rank count, so that load from other
        # processes on a shared machine hits both alike.
        for rnd in range(rounds):
            if gpu:
                sec, err = _cublas(a, b, 3, rows if args.check and rnd == 0 else None)
                ref_times.append(sec)
                ref_err = err if rnd == 0 else ref_err
            else:
                t0 = time.perf_counter()
                a @ b
                ref_times.append(time.perf_counter() - t0)
            for case, acc in dist.items():
                ranks, _, _, gpus = case
                res = launch(ranks, gpus, n, dtype, check=args.check and rnd == 0)
                acc["times"] += res["times"]
                if rnd == 0:
                    acc.update({k: v for k, v in res.items() if k != "times"})
                if case in peer:  # pylops-mpi right after distmm at the same rank count
                    res = launch(ranks, gpus, n, dtype, check=args.check and rnd == 0,
                                 peer="pylops-mpi")
                    peer[case]["times"] += res["times"]
                    if rnd == 0:
                        peer[case].update({k: v for k, v in res.items() if k != "times"})
                for name, runs in ((nvmath_peer.NAME, nvm), (heat_peer.NAME, hts)):
                    if case in runs and "error" not in runs[case]:  # likewise, each peer
                        try:
                            res = launch(ranks, gpus, n, dtype, check=args.check and rnd == 0,
                                         peer=name)
                        except RuntimeError as e:  # its ranks died: never the distmm part
                            res = {"error": (str(e).strip().splitlines() or ["?"])[-1]}
                        runs[case]["times"] += res.get("times", [])
                        if rnd == 0 or "error" in res:
                            runs[case].update({k: v for k, v in res.items() if k != "times"})
        del a, b
        ref_seconds = float(np.median(ref_times))
        writer.add(ref_variant, dtype, n, n, n, ref_seconds, ref_err, ranks=1, gpus=int(gpu),
                   times=ref_times, rounds=rounds,
                   note=(f"{threads} BLAS threads" if not gpu else "in-core, one GPU")
                   + f"; relerr on {rows.size} sampled rows of C against float64")
        print(f"{ref_variant:12s} {dtype} n={n}: {ref_seconds:.3f} s "
              f"{2 * n**3 / ref_seconds / 1e9:.1f} GFLOP/s", flush=True)
        for case, res in dist.items():
            ranks, _, _, gpus = case
            seconds = float(np.median(res["times"]))
            extra = {}
            if gpu:
                extra["gpus"] = gpus
                if gpus > 1:
                    extra["parallel_efficiency"] = ref_seconds / (gpus * seconds)
            note = ("each rank made only its own blocks, in the planner's layout; C stays "
                    f"distributed; {res['threads_per_rank']} BLAS thread(s) per rank; "
                    f"{repeat} timed product(s) per launch after an untimed checked one; "
                    f"relerr on {rows.size} sampled rows of C against float64")
            if gpu and gpus == 1 and ranks > 1:
                note += (f"; the {ranks} ranks share ONE GPU (correctness and the overhead of "
                         f"the MPI path, not scaling)")
            rec = writer.add("distmm-mpi", dtype, n, n, n, seconds, res["relerr"],
                             ranks=ranks, grid=res["grid"], times=res["times"], rounds=rounds,
                             repeat=repeat, bytes_measured=max(res["bytes_measured"]),
                             bytes_estimated=max(res["bytes_estimated"]),
                             bytes_measured_per_rank=res["bytes_measured"],
                             bytes_estimated_per_rank=res["bytes_estimated"],
                             panels_per_layer=res["panels_per_layer"],
                             threads_per_rank=res["threads_per_rank"],
                             grid_comms=res["grid_comms"],
                             ratio_to_reference=ref_seconds / seconds,
                             backend="cublas" if gpu else "blas", note=note, **extra)
            print(f"distmm-mpi   {dtype} n={n} ranks={ranks}" + (f" gpus={gpus}" if gpu else "")
                  + f" grid={res['grid']}: {seconds:.3f} s {rec['tflops'] * 1e3:.1f} GFLOP/s, "
                  f"{ref_seconds / seconds:.2f} of {ref_variant}"
                  + (f", parallel efficiency {extra['parallel_efficiency']:.2f}"
                     if "parallel_efficiency" in extra else "")
                  + f"; relerr {res['relerr']}; bytes measured {max(res['bytes_measured'])} "
                  f"estimated {max(res['bytes_estimated'])}", flush=True)
            if case in peer:
                _pylops_record(writer, peer[case], dtype, n, ranks, ref_seconds, ref_variant,
                               pylops_version)
            if case in nvm and "error" not in nvm[case]:
                nvmath_peer.record(writer, nvm[case], case, ref_seconds, ref_variant, rounds,
                                   repeat)
            if case in hts and "error" not in hts[case]:
                heat_peer.record(writer, hts[case], case, ref_seconds, ref_variant, rounds, repeat)
            names = ("pylops-mpi", "heat") + (("nvmath-python",) if gpu or "nvmath-python"
                                              in peers else ())
            for name in names:  # a peer not run gets no record, only a line
                why = pylops_why
                if name == "pylops-mpi" and case in peer:
                    continue
                if name == "heat":
                    if case in hts and "error" not in hts[case]:
                        continue
                    why = hts[case]["error"] if case in hts else heat_why
                if name == "nvmath-python":
                    if case in nvm and "error" not in nvm[case]:
                        continue
                    why = (nvm[case]["error"] if case in nvm else nvmath_why
                           if nvmath_versions is None else
                           f"NCCL allows one rank per GPU; these {ranks} ranks share {gpus}")
                print(f"{name:12s} {dtype} n={n} ranks={ranks}: not run: "
                      f"{_peer_not_run(name, ranks, args.mode, why)}", flush=True)
    print(f"records: {writer.path}")
    return 0


def _pylops_record(writer, res: dict, dtype: str, n: int, ranks: int, ref_seconds: float,
                   ref_variant: str, version: str) -> None:
    seconds = float(np.median(res["times"]))
    rec = writer.add("pylops-mpi", dtype, n, n, n, seconds, res["relerr"], ranks=ranks,
                     grid=res["grid"], times=res["times"], kind=PYLOPS_KIND,
                     pylops_mpi_version=res["version"], checked_elements=res["checked_elements"],
                     threads_per_rank=res["threads_per_rank"],
                     ratio_to_reference=ref_seconds / seconds,
                     note=f"pylops-mpi {version} MPIMatrixMult kind={PYLOPS_KIND!r}, timed Aop @ x "
                          f"(C stays distributed); each rank holds only its local_block_split "
                          f"blocks; {res['threads_per_rank']} BLAS thread(s) per rank; relerr on {res['checked_elements']} "
                          f"elements of C (up to {SAMPLE_ROWS} rows of each rank's block); timed in rounds alternating with the reference")
    print(f"pylops-mpi   {dtype} n={n} ranks={ranks} grid={res['grid']}: {seconds:.3f} s "
          f"{rec['tflops'] * 1e3:.1f} GFLOP/s, {ref_seconds / seconds:.2f} of {ref_variant}; "
          f"relerr {res['relerr']}", flush=True)


def _gpu_name() -> str:
    from bench.common import gpu_name

    return gpu_name()


def _cublas(a, b, repeat: int, rows=None) -> tuple[float, float | None]:
    """In-core ``cupy.matmul`` on one GPU: event-timed median, and the relerr of ``rows``
    of C against a float64 product (None when ``rows`` is None)."""
    import cupy

    from bench.common import event_seconds

    da, db = cupy.asarray(a), cupy.asarray(b)
    err = None
    if rows is not None:
        got = cupy.matmul(da, db)[cupy.asarray(rows)].get().astype(np.float64)
        ref = rows_product(a[rows], db)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    sec = event_seconds(lambda: cupy.matmul(da, db), repeat=repeat)
    del da, db
    cupy.get_default_memory_pool().free_all_blocks()
    return sec, err


def main(argv=None) -> int:
    from bench.common import parser

    p = parser(__doc__, prog="python -m bench.mpi")
    p.add_argument("--mode", choices=sorted(MODES), default="cpu")
    p.add_argument("--ranks", type=int, nargs="+", default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--dtypes", nargs="+", default=None)
    p.add_argument("--gpus", type=int, default=1,
                   help="--mode gpu with --ranks: GPUs the ranks spread over (1: they share "
                        "one; a count above the ranks is cut to the ranks)")
    p.add_argument("--rounds", type=int, default=0,
                   help="alternating rounds: the reference, then each rank count, timed once "
                        "each (default: the mode's)")
    p.add_argument("--repeat", type=int, default=0,
                   help="timed products per launch (default: the mode's)")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--peers", nargs="*", default=None,
                   choices=["pylops-mpi", "nvmath-python", "heat"],
                   help="peers to run where they can (default: the mode's: pylops-mpi on the "
                        "CPU modes, nvmath-python on gpu, heat on all)")
    p.add_argument("--nvmath-site", default=os.environ.get("DISTMM_NVMATH_SITE"),
                   help="folder holding nvmath-python's wheels installed (pip --target), put "
                        "first on PYTHONPATH of its ranks only (default $DISTMM_NVMATH_SITE)")
    p.add_argument("--heat-site", default=os.environ.get("DISTMM_HEAT_SITE"),
                   help="folder holding heat and its torch installed (pip --target), put first "
                        "on PYTHONPATH of its ranks only (default $DISTMM_HEAT_SITE)")
    p.add_argument("--worker", action="store_true", help=argparse_hidden())
    p.add_argument("--n", type=int, default=0, help=argparse_hidden())
    p.add_argument("--dtype", default="float64", help=argparse_hidden())
    p.add_argument("--gpu", action="store_true", help=argparse_hidden())
    p.add_argument("--peer", default="", choices=["", "pylops-mpi", "nvmath-python", "heat"],
                   help=argparse_hidden())
    p.add_argument("--result", default="", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.worker and args.peer == "nvmath-python":
        from bench import nvmath_peer

        return nvmath_peer.worker(args)
    if args.worker and args.peer == "heat":
        from bench import heat_peer

        return heat_peer.worker(args)
    if args.worker:
        return pylops_worker(args) if args.peer == "pylops-mpi" else worker(args)
    return driver(args)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
