"""C = A @ B of ``.npy`` files on a Dask cluster that dask-mpi starts inside one MPI job.

Run it under the MPI launcher with at least 3 ranks (fewer are refused in one line, 2)::

    srun python deploy/dask_mpi_matmul.py A.npy B.npy -o C.npy            # Slurm
    mpiexec -n 4 python deploy/dask_mpi_matmul.py A.npy B.npy -o C.npy    # anywhere

``dask_mpi.initialize()`` makes rank 0 the scheduler, rank 1 this program's client and every
other rank a worker: a ``dask_cuda.CUDAWorker`` on one GPU (chosen by the worker's place
among its node's workers) where the node has GPUs, a single-thread ``distributed.Worker``
where it has none. The client opens the operands memory-mapped (the workers read the blocks
they need from the files themselves when they see the same filesystem), runs
``distmm.matmul(..., engine="dask")`` into a staged ``.NAME.dask-mpi-partial-PID.npy``
beside the target and moves it into place only when complete; SIGTERM or SIGINT (scancel,
the time limit, Ctrl-C, a signal to the launcher) removes it at once and ends the client with
one line and 143 / 130. When the client returns, dask-mpi closes the scheduler and the
workers; the job's exit status is the client's.

This is a program and not ``distmm matmul`` because dask-mpi runs the client code inside
rank 1 of the MPI job, where ``distmm matmul`` takes itself for one of several MPI ranks and
would use the MPI engine; and because it is the shape of a user's own dask-mpi program (the
public API on a cluster that lives as long as the job). It covers ``.npy`` files only: for
zarr or HDF5 operands and outputs, use ``deploy/slurm/dask.sbatch`` (``distmm matmul
--scheduler-file``) or the MPI engine. Environment: ``DISTMM_GPUS_PER_NODE`` (0 for CPU
workers; default: what ``nvidia-smi -L`` lists), ``DISTMM_THREADS_PER_WORKER`` (CPU
workers, default 1), ``DISTMM_INTERFACE`` (the network interface, e.g. ``ib0``),
``DISTMM_WORKER_TIMEOUT`` (seconds the client waits for every worker rank to join, default 300).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile


def gpus_on_node() -> int:
    """GPUs of this node: ``DISTMM_GPUS_PER_NODE``, else the lines ``nvidia-smi -L`` prints."""
    if os.environ.get("DISTMM_GPUS_PER_NODE"):
        return int(os.environ["DISTMM_GPUS_PER_NODE"])
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU") for line in out.splitlines())


def worker_setup(comm) -> tuple[str, dict]:
    """The worker class and its options for this rank (collective over ``comm``): on a GPU
    node, each worker rank sees one GPU, its place among the node's worker ranks modulo the
    node's GPUs (ranks 0 and 1, the scheduler and the client, take none)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    workers_before = sum(node.allgather(comm.rank >= 2)[:node.rank])
    node.Free()
    gpus = gpus_on_node()
    if gpus == 0 or comm.rank < 2:
        return "distributed.Worker", {"resources": {}}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(d) for d in range(gpus)]
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[workers_before % len(devices)]
    return "dask_cuda.CUDAWorker", {"resources": "GPU=1"}


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def parse(argv):
    p = argparse.ArgumentParser(prog="dask_mpi_matmul.py", description=__doc__.splitlines()[0])
    p.add_argument("a", help="A: a .npy file")
    p.add_argument("b", help="B: a .npy file")
    p.add_argument("-o", "--output", required=True, help="C: a .npy file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p.parse_args(argv)


def client_main(args, workers_expected: int = 1) -> int:
    """Rank 1: the product on the cluster, C staged and moved into place, once every worker
    of the job (``workers_expected``: the ranks after the scheduler and the client) has
    joined, within ``DISTMM_WORKER_TIMEOUT`` seconds (default 300)."""
    import numpy as np
    from distributed import Client

    import distmm

    try:
        if not args.output.endswith(".npy"):
            raise ValueError(f"{args.output}: this program writes .npy files only")
        if os.path.exists(args.output) and not args.overwrite:
            raise FileExistsError(f"{args.output} exists (use --overwrite)")
        a = np.load(args.a, mmap_mode="r")
        b = np.load(args.b, mmap_mode="r")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"{args.a} has shape {a.shape}, {args.b} has shape {b.shape}: "
                             f"not two matrices that multiply")
    except (OSError, ValueError) as exc:
        print(f"dask_mpi_matmul.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    from distmm.cli.exits import Signalled, raise_if_signalled, terminate_on_sigterm

    folder, name = os.path.split(os.path.abspath(args.output))
    staged = os.path.join(folder, f".{name}.dask-mpi-partial-{os.getpid()}.npy")
    # SIGTERM (scancel, the time limit, mpiexec passing on a kill) and SIGINT unwind through
    # the cleanup below, as exceptions (by default SIGTERM ended this rank and left the staged
    # output behind); the staged output goes at once, in the handler: a launcher that was
    # signalled itself kills its ranks a quarter of a second after passing the signal on
    terminate_on_sigterm()
    raise_signal = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        _remove(staged)
        raise_signal(signum, frame)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    try:
        with Client() as client:  # the scheduler dask_mpi.initialize() put in the config
            # the workers start beside this rank and join when they are ready: the product
            # would otherwise run on those that happened to be there (seen: 1 of 2)
            client.wait_for_workers(workers_expected,
                                    timeout=float(os.environ.get("DISTMM_WORKER_TIMEOUT", 300)))
            workers = len(client.scheduler_info(n_workers=-1)["workers"])
            out = np.lib.format.open_memmap(staged, mode="w+", shape=(a.shape[0], b.shape[1]),
                                            dtype=np.result_type(a.dtype, b.dtype))
            distmm.matmul(a, b, out=out, engine="dask", client=client)
            out.flush()
            del out
        raise_if_signalled()  # one that a library swallowed
        for signum in (signal.SIGTERM, signal.SIGINT):  # C is whole: it takes its name
            signal.signal(signum, signal.SIG_IGN)
        os.replace(staged, args.output)
    except BaseException as exc:
        _remove(staged)
        if isinstance(exc, (KeyboardInterrupt, Signalled)):
            import dask

            # the scheduler (rank 0) took the same signal: dask-mpi's closing call at exit
            # would wait dask's 30 s connect timeout for it
            dask.config.set({"distributed.comm.timeouts.connect": "2s"})
            sigint = isinstance(exc, KeyboardInterrupt)
            print(f"dask_mpi_matmul.py: error: {'interrupted (SIGINT)' if sigint else exc}; "
                  f"{args.output} not written", file=sys.stderr, flush=True)
            return 130 if sigint else 128 + exc.signum
        print(f"dask_mpi_matmul.py: error: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        return 1
    print(f"wrote {args.output}: shape {(a.shape[0], b.shape[1])} on {workers} dask-mpi "
          f"workers", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from distmm.cli.exits import whole_line_writes

    whole_line_writes()  # each line in one write: mpiexec interleaves the ranks' writes
    import dask
    import dask_mpi
    from mpi4py import MPI

    if MPI.COMM_WORLD.size < 3:  # dask-mpi's refusal is a traceback on every rank
        if MPI.COMM_WORLD.rank == 0:
            print(f"dask_mpi_matmul.py: error: {MPI.COMM_WORLD.size} MPI process(es): it needs "
                  f"at least 3, the scheduler, the client and a worker", file=sys.stderr,
                  flush=True)
        return 2
    worker_class, options = worker_setup(MPI.COMM_WORLD)
    interface = os.environ.get("DISTMM_INTERFACE") or None
    # the workers' scratch space: dask's temporary-directory, else the node's temporary
    # folder (older dask-mpi would put it in the working directory, beside the output)
    scratch = dask.config.get("temporary-directory", None) or tempfile.gettempdir()
    # the scheduler's and the workers' ranks import the Dask engine's task modules before they
    # serve, not at the first product (distmm.engine.dask.preload)
    import distmm.engine.dask.preload  # noqa: F401
    # every rank but the client stays inside initialize() until the client ends, then exits
    dask_mpi.initialize(interface=interface, worker_class=worker_class, worker_options=options,
                        nthreads=int(os.environ.get("DISTMM_THREADS_PER_WORKER", "1")),
                        local_directory=scratch,
                        dashboard_address=os.environ.get("DISTMM_DASHBOARD", ":8787"))
    return client_main(args, workers_expected=MPI.COMM_WORLD.size - 2)


if __name__ == "__main__":
    sys.exit(main())
