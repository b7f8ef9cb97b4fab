"""``distmm matmul`` under ``mpirun``/``srun``: one product over all ranks.

This module covers: the command when a launcher started several ranks (or
``--engine mpi``): every rank opens the operands lazily and checks them (and
rank 0 the target: ``--overwrite``, free space) before anything is computed;
the ranks agree on the outcome (an ``allgather``), so bad input ends every
rank within seconds with one message, printed by rank 0, and the same exit
status. Then each rank reads only its blocks of A and B (memmap, zarr or HDF5
slices), SUMMA runs on the planner's grid, and each rank writes its own blocks
of C into one staged output that is renamed only after every rank succeeded
(``distmm.engine.mpi.io``: ``.npy`` and HDF5 blocks written at once with
``pwrite``, HDF5 into a hidden staged file that rank 0 then copies into the
user's file, so no parallel HDF5 is needed; zarr blocks written by one rank at
a time). An exception on any rank during the product ends the job with
``MPI_Abort`` rather than leaving the others waiting in a collective; the
output is then at most a staged ``.NAME.distmm-partial-PID``, never the final
name.
It does *not* cover: the single-process command (``distmm.cli.commands``).
"""
from __future__ import annotations

import sys
import time

import numpy as np

__all__ = ["run_matmul"]


def _agree(comm, error):
    """Every rank learns the first error of any rank (rank order), or None."""
    try:
        payload = comm.allgather(error)
    except Exception:  # noqa: BLE001 - an exception that does not pickle
        payload = comm.allgather(None if error is None else RuntimeError(f"{type(error).__name__}: {error}"))
    return next((e for e in payload if e is not None), None)


def _fail(comm, error):
    """Rank 0 raises the error (one message); the others exit with its status, silently."""
    from distmm.cli.exits import exit_status

    if comm.rank == 0:
        raise error
    raise SystemExit(exit_status(error))


def run_matmul(args) -> int:
    from mpi4py import MPI

    from distmm.cli.io import check_space, check_target, open_operand, parse_target
    from distmm.executor import resolve_backend
    from distmm.plan import result_dtype

    comm = MPI.COMM_WORLD
    if args.scheduler or args.scheduler_file:
        error = ValueError("--scheduler/--scheduler-file use the Dask engine; under mpirun the "
                           "MPI engine runs the product: drop them")
        return _fail(comm, error) if _agree(comm, error) else 0
    t0 = time.perf_counter()
    a = b = None
    error = None
    try:
        target = parse_target(args.output)
        # read-only on every rank: HDF5 refuses a file open for writing in several processes
        a = open_operand(args.a)
        b = open_operand(args.b)
        dtype = result_dtype(np.dtype(a.dtype), np.dtype(b.dtype))
        if a.ndim == 0 or b.ndim == 0:
            raise ValueError(f"{args.a if a.ndim == 0 else args.b} holds a scalar; matmul needs "
                             f"arrays of at least 1 dimension")
        two_d = a.ndim == b.ndim == 2
        if two_d and a.shape[1] != b.shape[0]:
            raise ValueError(f"inner dimensions differ: {args.a} has shape {a.shape}, "
                             f"{args.b} has shape {b.shape}")
        if two_d:
            m, k, n = a.shape[0], a.shape[1], b.shape[1]
            backend, on_gpu = resolve_backend(args.backend, dtype, family="numpy", flops=2 * m * n * k)
            if comm.rank == 0:
                check_target(target, args.overwrite)
                check_space(target, m * n * dtype.itemsize)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    error = _agree(comm, error)
    if error is not None:
        return _fail(comm, error)

    if not two_d:
        return _stacked(comm, args, a, b, t0)

    from distmm.engine.mpi import DistArray, MPIEngine
    from distmm.grid import make_grid

    try:
        grid = make_grid(m, n, k, dtype, ranks=comm.size)
        da = DistArray.from_array(a, comm, grid.a_layout)  # each rank reads its own block only
        db = DistArray.from_array(b, comm, grid.b_layout)
        for x in (a, b):
            handle = getattr(x, "file", None)
            if handle is not None:
                handle.close()  # HDF5: rank 0 opens the file to write C next
        comm.Barrier()
        c = MPIEngine(comm).run_distributed(da, db, grid, backend, on_gpu=on_gpu)
    except BaseException as exc:  # noqa: BLE001 - the other ranks may wait in a collective
        _abort(comm, exc, args)
    error = None
    try:
        c.to_file(args.output, overwrite=args.overwrite)
    except Exception as exc:  # noqa: BLE001 - write_blocks raised it on every rank
        error = exc
    if error is not None:
        return _fail(comm, error)
    if comm.rank == 0:
        print(f"wrote {args.output}: shape {(m, n)}, dtype {dtype}, {comm.size} ranks, grid "
              f"{'x'.join(map(str, grid.shape))}, {time.perf_counter() - t0:.3f} s")
    return 0


def _stacked(comm, args, a, b, t0) -> int:
    """Vectors and stacks: every rank computes the product with the MPI engine,
    rank 0 writes it (staged), and all agree on the outcome."""
    import distmm
    from distmm.cli.io import staged_output

    try:
        c = np.asarray(distmm.matmul(np.asarray(a), np.asarray(b), engine="mpi", backend=args.backend))
    except BaseException as exc:  # noqa: BLE001
        _abort(comm, exc, args)
    error = None
    if comm.rank == 0:
        try:
            with staged_output(args.output, c.shape, c.dtype, overwrite=args.overwrite) as out:
                out[...] = c
        except Exception as exc:  # noqa: BLE001
            error = exc
    error = _agree(comm, error)
    if error is not None:
        return _fail(comm, error)
    if comm.rank == 0:
        print(f"wrote {args.output}: shape {c.shape}, dtype {c.dtype}, {comm.size} ranks, "
              f"{time.perf_counter() - t0:.3f} s")
    return 0


def _abort(comm, exc, args):
    """One line from the failing rank, then MPI_Abort: no rank is left waiting."""
    from distmm.cli.exits import exit_status, message

    print(f"distmm matmul: error on rank {comm.rank} of {comm.size}: {message(exc)}; aborting "
          f"the job", file=sys.stderr, flush=True)
    if getattr(args, "debug", False):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    comm.Abort(exit_status(exc) or 1)
