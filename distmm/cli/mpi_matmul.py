"""``distmm matmul`` under ``mpirun``/``srun`` (or with ``--resume``/``--profile``): one
product over all ranks.

This module covers: the command's side of a multi-rank run. Every rank opens the operands
lazily and checks them (and rank 0 the target: ``--overwrite``, free space) before anything
is computed, and a CPU rank has numpy's BLAS map its buffer (``ulimit -v`` refusing it ends
the job before any output is staged); the ranks agree on the outcome (an ``allgather``), so
bad input ends every rank within seconds with one message, printed by rank 0, and the same
exit status. Matrices then
go to the batch path (``distmm.engine.mpi.batch.run_batch``: binding, plan, streamed stripes,
staged output, resume), whose outcome this module reports: notes, the summary line, the
``--profile`` file and ``--progress`` bar of rank 0, the exit status (SIGINT and SIGTERM, once
the ranks agreed on it, ignored, and SIGXCPU). Vectors and stacks are
computed in memory by the MPI engine and written by rank 0 (``_stacked``).
It does *not* cover: the single-process command (``distmm.cli.commands``) or the product
itself (``distmm.engine.mpi``).
"""
from __future__ import annotations

import math
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

    from distmm.cli.io import (check_report, check_space, check_target, open_operand,
                               operands_dtype, check_shapes, parse_target, result_shape)
    from distmm.errors import BackendUnavailable
    from distmm.executor import gpu_available, resolve_backend
    from distmm.executor.warmup import map_blas_buffer
    from distmm.api import resolve_precision
    from distmm.config import get_config, where_set
    from distmm.stripe_writer import check_dtype

    comm = MPI.COMM_WORLD
    from distmm.phases import Phases

    comm.Barrier()  # one time axis for every rank's profile
    phases = Phases()
    epoch = time.time()  # the profile's origin on the wall clock (launch and exit costs)
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
        dtype = operands_dtype(args.a, a, args.b, b)
        precision = resolve_precision(getattr(args, "precision", None), dtype)
        check_shapes(args.a, a, args.b, b)  # numpy's shape rules, naming the files
        check_dtype(target, dtype)  # one the output's format stores
        two_d = a.ndim == b.ndim == 2
        if not two_d and (args.resume or args.profile):
            raise ValueError("--resume and --profile take 2-D operands (matrices); "
                             f"{args.a} and {args.b} have {a.ndim} and {b.ndim} dimensions")
        if args.tile is not None:
            raise ValueError("--tile sets the tiles of the local and Dask engines; the MPI "
                             "engine plans its own grid and stripes: drop --tile")
        shape = result_shape(a, b)
        m, k, n = (a.shape[0], a.shape[1], b.shape[1]) if two_d else (0, 0, 0)
        flops = 2 * math.prod(shape) * a.shape[-1]  # Python ints: np.prod wraps at 2**63
        requested = args.backend
        if requested == "auto":  # the configured distmm.backend, as distmm.matmul takes it
            requested = get_config().backend
        backend, on_gpu = resolve_backend(requested, dtype, family="numpy", flops=flops)
        if on_gpu and not gpu_available():
            where = where_set("backend") or "the configuration"
            told, hint = ((f"backend {backend!r}", "--backend auto") if args.backend != "auto"
                          else (f"distmm.backend {backend} ({where})", "--backend numba or blas"))
            raise BackendUnavailable(f"{told} needs a CUDA GPU and cupy on every rank; this "
                                     f"rank has none (use {hint})")
        if comm.rank == 0:  # before any work, stacks and vectors too
            check_target(target, args.overwrite)
            check_space(target, math.prod(shape) * dtype.itemsize)
            if args.profile:
                check_report("--profile", args.profile, (args.a, args.b, args.output))
        if not on_gpu:  # before the staged output, and before the ranks agree to start:
            # OpenBLAS's exit(1) under ulimit -v then leaves nothing, and mpirun ends the
            # others, waiting below (the batch path's GEMM thread takes this buffer)
            map_blas_buffer(backend, dtype)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    phases.add("open", t0, time.perf_counter())
    with phases.phase("wait"):
        error = _agree(comm, error)
    if error is not None:
        return _fail(comm, error)

    if not two_d:
        return _stacked(comm, args, a, b, t0, precision)

    from distmm.cli.exits import FAILED, exit_status, message
    from distmm.engine.mpi.batch import run_batch

    outcome = run_batch(args, a, b, dtype=dtype, backend=backend, on_gpu=on_gpu, comm=comm,
                        phases=phases, judge=lambda exc: (exit_status(exc), message(exc)),
                        progress=_progress_bar(args, comm, 2 * m * n * k), precision=precision)
    _ignore_signals()
    if comm.rank == 0:
        for note in outcome.notes:
            print(f"distmm matmul: {note}", file=sys.stderr, flush=True)
    grid = outcome.plan.grid if outcome.plan is not None else None
    # the profile, once C's fate is decided: rank 0 failing to write it now (a full disk) is
    # no bad input of the command (checked before any work), and is said with what became of C
    lost = None
    try:
        totals = _report_profile(comm, args, phases, t0, grid, epoch, panels=outcome.panels,
                                 written_direct=outcome.written_direct)
    except Exception as exc:  # noqa: BLE001 - said below, with what became of C
        totals, lost = "", exc
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exception(exc, file=sys.stderr)
    why = None if lost is None else f"the profile {args.profile} could not be written: " \
                                    f"{message(lost)}"
    if outcome.status:
        if comm.rank == 0:
            if getattr(args, "debug", False) and outcome.error is not None:
                import traceback

                traceback.print_exception(outcome.error, file=sys.stderr)
            print(f"distmm matmul: error: {outcome.message}" + (f"; {why}" if why else ""),
                  file=sys.stderr, flush=True)
        _end(outcome.status)
    if why is not None:
        print(f"distmm matmul: error: wrote {target}, but {why}", file=sys.stderr,
              flush=True)
        _end(FAILED)
    if comm.rank == 0:
        print(f"wrote {target}: shape {(m, n)}, dtype {dtype}, {comm.size} "
              f"rank{'s' if comm.size != 1 else ''}, grid {grid.rows}x{grid.cols}, "
              f"{time.perf_counter() - t0:.3f} s{totals}")
    _end(0)  # the output is on disk: tearing down CUDA, NCCL and pinned memory is not waited for


def _progress_bar(args, comm, flops: int):
    """``--progress`` under the MPI engine: rank 0's bar over its C stripes (the ranks move
    in step: each stripe needs every rank of its row). None elsewhere or when not asked."""
    show = args.progress
    if show is None:
        show = sys.stderr.isatty() and flops / (40e12 * comm.size) > 10
    if not show or comm.rank != 0:
        return None

    def bar(count):
        from tqdm.auto import tqdm

        return tqdm(total=count, unit="stripe", desc="C stripes (rank 0)", file=sys.stderr)

    return bar


def _ignore_signals() -> None:
    """SIGINT, SIGTERM and SIGXCPU ignored from here to the end: the ranks have agreed on the outcome
    (C moved into place, kept for ``--resume`` or removed), and a signal now would end a run
    whose C is in place with 143 and no 'wrote' line, or add a second line to a failure's."""
    import signal

    from distmm.errors import STOP_SIGNALS

    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _end(status: int) -> None:
    """Leave at once with ``status``: after a stop, a GEMM thread or a broadcast it left
    behind must not hold the process; after success, the device's memory, its pinned host
    buffers and the NCCL communicators go with the process instead of one by one. MPI is
    finalized first, so the launcher sees a clean exit of every rank."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    finally:
        os._exit(status)


def _report_profile(comm, args, phases, t0, grid, epoch: float, *, panels=None,
                    written_direct: int = 0) -> str:
    """With ``--profile``: gather every rank's spans, write the file on rank 0, and return
    the totals for the summary line (``"; read 1.20, ... s"``); else ``""``. ``panels``:
    the batch path's ``read`` or ``broadcast`` decision, kept in the profile with the
    emulated nodes the job ran as (``distmm.emulate``); ``written_direct``: this rank's bytes
    of C written past the page cache, kept in its record."""
    import socket

    from distmm.emulate import record_value
    from distmm.phases import summary_line, write_profile

    if not args.profile:
        return ""
    records = comm.gather(phases.record(rank=comm.rank, host=socket.gethostname(), epoch=epoch,
                                        written_direct=written_direct), root=0)
    if comm.rank != 0:
        return ""
    if args.profile:
        write_profile(args.profile, records, {"a": args.a, "b": args.b, "output": args.output,
                                              "ranks": comm.size,
                                              "grid": None if grid is None else list(grid.shape),
                                              "batch_panels": panels,
                                              "emulated_nodes": record_value(),
                                              "wall": time.perf_counter() - t0,
                                              "written_epoch": time.time()})
    return f"; busiest rank: {summary_line(records)}"


def _stacked(comm, args, a, b, t0, precision: str = "highest") -> int:
    """Vectors and stacks: every rank computes the product with the MPI engine,
    rank 0 writes it (staged), and all agree on the outcome."""
    import distmm
    from distmm.cli.io import parse_target, staged_output
    from distmm.engine.mpi.batch import close_sources

    error = c = None
    try:  # the engine raises an error of any rank's part on every rank
        c = np.asarray(distmm.matmul(np.asarray(a), np.asarray(b), engine="mpi", backend=args.backend,
                                     precision=precision))
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    # every rank lets go of its HDF5 operands before rank 0 writes: C may go into their own
    # file, which HDF5 opens for writing only where no other process holds it
    close_sources(a, b)
    comm.Barrier()
    if comm.rank == 0 and error is None:
        try:
            with staged_output(args.output, c.shape, c.dtype, overwrite=args.overwrite,
                               checked=True) as out:
                out[...] = c
        except Exception as exc:  # noqa: BLE001
            error = exc
    error = _agree(comm, error)
    if error is not None:
        return _fail(comm, error)
    if comm.rank == 0:
        print(f"wrote {parse_target(args.output)}: shape {c.shape}, dtype {c.dtype}, "
              f"{comm.size} rank{'s' if comm.size != 1 else ''}, "
              f"{time.perf_counter() - t0:.3f} s")
    return 0

