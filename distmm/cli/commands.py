"""The ``distmm`` command line: parsing arguments and running the commands.

This module covers: the parser of every command (``demo``, ``plan``,
``matmul``, ``info``, ``report``, ``tune``/``trace``, which own their options; ``calibrate``,
``model``, ``bench`` and ``cluster`` register themselves from ``distmm.cli.model``,
``distmm.cli.bench`` and ``distmm.cli.serve``), and
running one: each failure ends as one line on stderr and an exit status
(``distmm.cli.exits``), with the traceback only under ``--debug``.
It does *not* cover: file formats and staged output (``distmm.cli.io``), the
demo (``distmm.cli.demo``), the MPI environment (``distmm.cli.launch``), connecting to a
scheduler (``distmm.cli.connect``) or serving a cluster (``distmm.cli.serve``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from distmm.cli.argtypes import integer_at_least, matmul_dtype, nonempty
from distmm.cli.exits import (BAD_INPUT, Signalled, one_line_warnings, raise_if_signalled,
                              report, restore_signals, terminate_on_sigterm,
                              whole_line_writes)
from distmm.executor import BACKENDS
from distmm.startup import guard, is_command, let_rank_zero_say, rank_zero

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line: ``distmm matmul: error: ... (see --help)``."""

    def error(self, message):
        # under a launcher every rank parses the same arguments: rank 0 says it once
        self.exit(BAD_INPUT, f"{self.prog}: error: {' '.join(message.split())} "
                             f"(see {self.prog} --help)\n" if rank_zero() else None)


_positive = integer_at_least(1)


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of seconds")
    return value


_count = integer_at_least(0, "must not be negative")


# ---------------------------------------------------------------- commands


def _cmd_plan(args) -> int:
    import dask

    from distmm.api import make_plan
    from distmm.plan import result_dtype

    tile = None
    if args.hosts is not None and not args.ranks:
        raise ValueError("--hosts goes with --ranks: the hosts of an mpirun -n P job")
    if args.tile:
        if len(args.tile) not in (1, 3):
            raise ValueError(f"--tile takes one size or three (tm tn tk), got {len(args.tile)}")
        tile = tuple(args.tile) if len(args.tile) == 3 else args.tile[0]
    result = result_dtype(args.dtype, args.dtype)  # float32 for bfloat16, as numpy's matmul
    # --workers W: the local engine running W threads, whose memory budget is split between them
    threads = {} if args.workers is None else {"distmm.local-threads": args.workers}
    try:
        # distmm.matmul's own planning: the configured tile, backend and memory budget
        with dask.config.set(threads):
            plan = make_plan(args.m, args.n, args.k, args.dtype, workers=args.workers,
                             tile=tile, backend=args.backend)
        grid = batch = None
        if args.ranks:
            from distmm.grid import make_grid

            batch = _batch_setup(args, result)
            grid = make_grid(args.m, args.n, args.k, result, ranks=args.ranks)
    except MemoryError as exc:
        # more tiles than a plan lists: told from the sizes alone, before any work (bad
        # arguments, status 2), as numpy's "array is too big" is a ValueError
        raise ValueError(str(exc) or f"a {args.m} x {args.n} x {args.k} product is too large "
                                     f"to plan") from None
    _note_gpu_budget(args.backend)
    if result != args.dtype:
        print(f"distmm plan: note: numpy's matmul of {args.dtype} operands gives {result}; "
              f"the plan is for a {result} result", file=sys.stderr)
    print(plan.describe())
    if batch is not None:
        print("\n".join(batch))
        print(f"in memory  distmm.matmul(engine=\"mpi\") of arrays: {grid.describe()}")
    return 0


def _batch_setup(args, result) -> list[str]:
    """``distmm plan --ranks P``'s lines of what ``mpirun -n P distmm matmul`` runs
    (``distmm.plan_batch.decide_batch``, as the batch path decides it): from the arguments,
    the configuration, and for what only the job knows, this machine's: the backend's choice
    of GPU or CPU ranks, its GPU's free memory (without a GPU, ``distmm.device-memory-limit``,
    else no limit) and its available memory, taken for every host's; ``--hosts`` hosts
    (default one); C a ``.npy`` or HDF5 file (with ``distmm.direct-writes``, its writer's
    aligned buffers counted)."""
    from distmm.config import get_config, host_available
    from distmm.executor import gpu_available, resolve_backend
    from distmm.plan_batch import decide_batch

    hosts = 1 if args.hosts is None else args.hosts
    if hosts > args.ranks:
        raise ValueError(f"--hosts {hosts} is more hosts than --ranks {args.ranks}")
    config = get_config()
    backend = config.backend if args.backend == "auto" else args.backend  # as the job takes it
    _, on_gpu = resolve_backend(backend, result, family="numpy",
                                flops=2 * args.m * args.n * args.k)
    memory = config.device_memory_limit if on_gpu else None
    if on_gpu and gpu_available():  # the batch path's own measure, of this GPU
        from mpi4py import MPI

        from distmm.engine.mpi.stream import device_memory

        memory = device_memory(True, MPI.COMM_SELF)
    setup = decide_batch(args.m, args.n, args.k, result, ranks=args.ranks, hosts=hosts,
                         on_gpu=on_gpu, panels=config.batch_panels, memory=memory,
                         host_memory=host_available(),
                         stripes=config.batch_stripes, budget=config.memory_budget,
                         # the run counts its direct writer's buffers for a .npy or HDF5 C
                         # (not zarr); distmm plan names no output: planned as for those
                         direct_writes=config.direct_writes)
    ranks = f"{'GPU' if on_gpu else 'CPU'} ranks"
    if on_gpu and memory is None:
        ranks += " (no GPU here: no limit on their memory assumed)"
    return [f"mpirun -n {args.ranks} distmm matmul (without --resume) on {hosts} "
            f"host{'s' if hosts != 1 else ''}, {ranks}, batch-panels {config.batch_panels}:",
            *(f"  {line}" for line in setup.describe())]


def _note_gpu_budget(backend: str) -> None:
    """A plan for a GPU backend made where there is no GPU (a login node) takes this host's
    memory budget: say so on stderr (``distmm matmul`` with that backend would refuse here)."""
    from distmm.executor import missing_gpu

    name = missing_gpu(backend)
    if name is not None:
        print(f"distmm plan: note: no CUDA GPU here; the plan for backend {name!r} takes "
              f"this host's memory budget, not a GPU's", file=sys.stderr)


def _cmd_info(args) -> int:
    import platform

    import dask
    import distributed
    import numba
    import numpy as np

    import distmm
    from distmm.cli.launch import launcher_ranks, rank_table
    from distmm.executor import gpu_available

    ranks, var = launcher_ranks()
    table = None
    if ranks > 1:  # every rank reports its binding; rank 0 prints everything once
        from mpi4py import MPI

        table = rank_table(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.rank != 0:
            return 0
    config = _config_lines()  # before the first line: a bad setting is the command's one line
    print(f"distmm      {distmm.__version__}")
    print(f"python      {platform.python_version()} on {platform.machine()}")
    print(f"numpy       {np.__version__}")
    print(f"numba       {numba.__version__}")
    print(f"dask        {dask.__version__}; distributed {distributed.__version__}")
    try:
        import mpi4py
        from mpi4py import MPI

        # the C string's terminating NUL comes with it (grep then calls the output binary)
        library = MPI.Get_library_version().rstrip("\x00").strip().splitlines()[0].strip()
        print(f"mpi4py      {mpi4py.__version__}; {library}")
    except Exception as exc:  # pragma: no cover - depends on the machine
        print(f"mpi4py      unavailable ({exc})")
    from distmm.engine.local import default_workers

    print(f"cpu         {default_workers()} usable cores; backends numba, blas")
    if gpu_available():
        import cupy

        from distmm.executor.device import device_count, device_properties

        for d in range(device_count()):
            props = device_properties(d)
            print(f"gpu {d}       {props['name']}, {props['totalGlobalMem'] / 2**30:.0f} GiB, "
                  f"sm_{props['major']}{props['minor']}; cupy {cupy.__version__}; backends raw, cublas")
    else:
        print("gpu         none (install distmm[gpu] on a CUDA machine for the raw and cublas backends)")
    if table is not None:
        print(f"ranks       {ranks} ({var}); the GPU each uses:")
        print("\n".join(table))
    print("\n".join(config))
    return 0


def _config_lines() -> list[str]:
    """``distmm info``'s lines of the configuration in force: each key whose value differs
    from ``distmm.yaml``'s, as set, with where it was set where that can be told (a
    ``DISTMM_``/``DASK_DISTMM__`` variable, which wins, else the last YAML file of dask's
    config paths that sets it); ``config      defaults`` where none differs."""
    import json
    from pathlib import Path

    import dask.config
    import yaml

    import distmm.config
    from distmm.config import KEYS, fallback, get_config, where_set

    now = get_config()  # a bad value or an unknown key: its one line
    shipped = Path(distmm.config.__file__).with_name("distmm.yaml")
    with dask.config.set({"distmm": yaml.safe_load(shipped.read_text())["distmm"]}):
        default = get_config()
    section = dask.config.global_config.get("distmm", {})
    files = list(dask.config.collect_yaml(dask.config.paths, return_paths=True))
    lines = []
    for key in KEYS:
        spellings = (key, key.replace("-", "_"))
        if getattr(now, spellings[1]) == getattr(default, spellings[1]):
            continue
        value = next((section[k] for k in spellings if k in section), None)
        if isinstance(value, str) and not value.strip():  # an empty setting is none
            value = fallback(key)
        where = where_set(key, files)
        lines.append(f"{key} = {value if isinstance(value, str) else json.dumps(value)}"
                     + (f" ({where})" if where else ""))
    return [f"{'' if i else 'config':12}{line}" for i, line in enumerate(lines or ["defaults"])]


def _matmul_engine(args) -> str:
    """The engine ``distmm matmul`` runs when no launcher's ranks, ``--resume`` or
    ``--profile`` decide it: ``--engine``; with ``--engine auto`` and neither
    ``--scheduler`` nor ``--scheduler-file`` (which take the Dask engine), the configured
    ``distmm.engine`` (``DISTMM_ENGINE``, a dask YAML file), as ``distmm.matmul`` takes it."""
    if args.engine != "auto" or args.scheduler or args.scheduler_file:
        return args.engine
    from distmm.config import get_config

    return get_config().engine


def _mpi_run(args) -> bool:
    """Whether this command runs on the MPI engine: ``--engine mpi``, several ranks started
    by a launcher with ``--engine auto``, ``--resume``/``--profile`` (the MPI engine's
    striped product keeps what ``--resume`` needs and records the phases, in one process
    too), or a configured ``distmm.engine`` of ``mpi`` (``_matmul_engine``). ``--engine mpi``
    with ``--scheduler``/``--scheduler-file`` is refused (they name a Dask cluster)."""
    from distmm.cli.launch import launcher_ranks

    ranks, var = launcher_ranks()
    if args.engine == "mpi":
        if args.scheduler or args.scheduler_file:
            given = "--scheduler" if args.scheduler else "--scheduler-file"
            where = f"on this job's {ranks} MPI ranks" if ranks > 1 else \
                "in this one process (under mpirun, on its ranks)"
            raise ValueError(f"--engine mpi runs the product {where}, not on the Dask cluster "
                             f"that {given} names: drop {given}" + ("" if ranks > 1 else
                                                                   ", or use --engine dask "
                                                                   "to run on that cluster"))
        return True
    if ranks > 1 and args.engine != "auto":
        raise ValueError(f"running as one of {ranks} MPI ranks ({var}={ranks}): --engine "
                         f"{args.engine} would run the same product on every rank; drop --engine "
                         f"(the MPI engine runs under mpirun) or run distmm matmul once")
    wants = [flag for flag, on in (("--resume", args.resume), ("--profile", args.profile)) if on]
    if wants and ranks == 1 and (args.engine != "auto" or args.scheduler or args.scheduler_file):
        raise ValueError(f"{' and '.join(wants)} {'runs' if len(wants) == 1 else 'run'} the "
                         f"MPI engine's file-to-file product (in one process or under mpirun): "
                         f"drop --engine, --scheduler and --scheduler-file")
    return ranks > 1 or bool(wants) or _matmul_engine(args) == "mpi"


def _every_rank_refuses(check, args):
    """``check(args)``, whose ValueError every rank of a launcher raises alike (it reads
    only the arguments and the launcher's variables): said once, by rank 0; the other
    ranks exit with the same status, silently, after rank 0's grace (exiting first, they
    made the launcher end rank 0 before its line)."""
    try:
        return check(args)
    except ValueError:
        if not rank_zero():
            let_rank_zero_say()
            raise SystemExit(BAD_INPUT) from None
        raise


def _connect(args, engine: str):
    """A client of the cluster named by --scheduler or --scheduler-file, or None
    (``distmm.cli.connect``: the whole connection bounded by --connect-timeout); ``engine``:
    ``_matmul_engine``'s."""
    if not (args.scheduler or args.scheduler_file):
        if engine == "dask":
            from distmm.config import where_set

            where = where_set("engine") if args.engine == "auto" else None
            told = "--engine dask" if args.engine == "dask" else \
                f"distmm.engine dask ({where or 'the configuration'})"
            raise ValueError(f"{told} runs on a Dask cluster: pass --scheduler ADDRESS or "
                             f"--scheduler-file FILE (start one with distmm cluster "
                             f"--scheduler-file FILE)"
                             + ("" if args.engine == "dask" else ", or --engine local"))
        return None
    if args.engine == "local":
        raise ValueError("--engine local runs in this process: drop --scheduler/--scheduler-file "
                         "or use --engine dask")
    from distmm.cli.connect import connect_client

    return connect_client(scheduler=args.scheduler, scheduler_file=args.scheduler_file,
                          timeout=args.connect_timeout)


def _maybe_warm_gpu(args, engine, a, b, dtype) -> None:
    """Start the GPU warm-up (context, cuBLAS, staging ring) on a thread while the
    operands are read, when this product will run on the local GPU."""
    import importlib.util

    import numpy as np

    from distmm.executor import AUTO_GPU_MIN_FLOPS, GPU_BACKENDS

    if engine not in (None, "auto", "local") or not os.path.exists("/dev/nvidiactl"):
        return
    if a.ndim != 2 or b.ndim != 2 or importlib.util.find_spec("cupy") is None:
        return
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    big_float = dtype in (np.float32, np.float64) and flops >= AUTO_GPU_MIN_FLOPS
    if args.backend in GPU_BACKENDS or (args.backend in (None, "auto") and big_float):
        from distmm.executor.warmup import warmup

        warmup()


def _map_blas_buffer(args, engine, dtype) -> None:
    """Have numpy's BLAS map its buffer before the output is staged
    (``distmm.executor.warmup.map_blas_buffer``: OpenBLAS's ``exit(1)`` under ``ulimit -v``
    then leaves nothing), when this process multiplies the product on its CPU: the tiles of
    the ``blas`` backend run in this thread; those of ``--backend numba`` on complex
    operands run on the local engine's threads, which take this buffer and map more where
    several multiply at once."""
    from distmm.executor.warmup import map_blas_buffer

    if engine in (None, "auto", "local"):
        map_blas_buffer(args.backend, dtype)


def _cmd_matmul(args) -> int:
    import dask
    import numpy as np

    import distmm
    from distmm.api import resolve_precision
    from distmm.cli.io import (check_shapes, check_target, open_operand, operands_dtype,
                               parse_target, result_shape, same_file, staged_output,
                               unreadable)
    from distmm.engine.mpi.resume import inputs_now
    from distmm.stripe_writer import check_dtype

    if _every_rank_refuses(_mpi_run, args):
        from distmm.cli.mpi_matmul import run_matmul

        return run_matmul(args)
    target = parse_target(args.output)  # an unsupported suffix fails before anything is read
    a = open_operand(args.a, writable=same_file(args.a, args.output))
    b = open_operand(args.b, writable=same_file(args.b, args.output))
    dtype = operands_dtype(args.a, a, args.b, b)
    check_shapes(args.a, a, args.b, b)  # numpy's shape rules, naming the files
    check_dtype(target, dtype)  # one the output's format stores
    precision = resolve_precision(args.precision, dtype)  # refused before any work
    check_target(target, args.overwrite)  # before the leftovers go
    engine = _matmul_engine(args)
    client = _connect(args, engine)
    engine = "dask" if client is not None else engine
    options = {} if args.progress is None else {"distmm.progress": args.progress}
    shape = result_shape(a, b)
    # what identifies the inputs, compared again before C is moved into place (not where C
    # goes into an input's own HDF5 file: that file is open for writing)
    inputs = None if same_file(args.a, args.output) or same_file(args.b, args.output) else \
        inputs_now(args.a, a, args.b, b)
    t0 = time.perf_counter()
    try:
        # bad input was refused above: a killed run's staged files (those --resume would
        # use too) go only now
        _remove_leftovers(args.output)
        _maybe_warm_gpu(args, engine, a, b, dtype)
        _map_blas_buffer(args, engine, dtype)
        with dask.config.set(options):
            # The staged output is made (the target and its free space checked) before any
            # work; it appears at the target only when the product is complete.
            with staged_output(args.output, shape, dtype, overwrite=args.overwrite,
                               checked=True) as c:
                if a.ndim == b.ndim == 2:
                    # Tiles go straight into it (local engine; on a Dask cluster the
                    # workers write theirs when they all see the file).
                    distmm.matmul(a, b, out=c, engine=engine, client=client,
                                  backend=args.backend, tile=args.tile, precision=precision)
                else:  # stacks and vectors: computed in memory, then written
                    c[...] = np.asarray(distmm.matmul(
                        np.asarray(a), np.asarray(b), engine=engine, client=client,
                        backend=args.backend, tile=args.tile, precision=precision))
                _check_unchanged(inputs, args, a, b)
    except Exception as exc:
        # a read's error, with its file; not one of a process limit (too many open files, no
        # memory left), which is no fault of the file
        named = None if _limited(exc) else unreadable(exc, {args.a: a, args.b: b})
        if named is None:
            raise
        raise named from exc
    finally:
        if client is not None:
            client.close()
    seconds = time.perf_counter() - t0
    print(f"wrote {target}: shape {shape}, dtype {dtype}, {seconds:.3f} s")
    return 0


def _limited(exc: BaseException) -> bool:
    """Whether ``exc`` is an ``OSError`` of a process limit: too many open files (``ulimit
    -n``), memory the address-space limit (``ulimit -v``) refuses."""
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def _check_unchanged(before, args, a, b) -> None:
    """Refuse to move C into place where an input was rewritten while the product ran."""
    from distmm.engine.mpi.resume import inputs_now, mismatch

    why = None if before is None else mismatch(before, inputs_now(args.a, a, args.b, b))
    if why:
        raise ValueError(f"{why} while the product ran; {args.output} was not written")


def _remove_leftovers(output: str) -> None:
    """Name and remove the staged outputs that killed runs (``kill -9``) left beside the
    target; those of a distmm process still running on this host, or of another dataset of
    the same HDF5 file, stay."""
    from distmm.cli.io import parse_target
    from distmm.staging import leftovers, remove_if_left

    target = parse_target(output)
    for staged in leftovers(target.path, target.dataset):
        if remove_if_left(staged):
            print(f"distmm matmul: removed {staged.name}, left beside {output} by a run that was "
                  f"killed", file=sys.stderr, flush=True)


def _demo_in_one_process(args) -> None:
    """ValueError under a launcher's ranks: each would run the whole demo, clusters and all."""
    from distmm.cli.launch import launcher_ranks

    ranks, var = launcher_ranks()
    if ranks > 1:
        raise ValueError(f"running as one of {ranks} MPI ranks ({var}={ranks}): distmm demo "
                         f"would run the same demo on every rank; run it once, without mpirun "
                         f"(mpirun -n P distmm matmul runs the MPI engine)")


def _cmd_demo(args) -> int:
    import distmm
    from distmm.cli.demo import run_demo

    _every_rank_refuses(_demo_in_one_process, args)
    return run_demo(n=args.n, dtype=str(args.dtype), engine=args.engine, workers=args.workers,
                    backend=args.backend, distmm=distmm, report=args.report,
                    progress=args.progress)


def _cmd_report(args) -> int:
    from distmm.cli.report import run_report

    return run_report(args.records, args.output, overwrite=args.overwrite, only=args.only,
                      html=not args.no_html)


# ---------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (``tune`` and ``trace`` parse their own options)."""
    from distmm import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of a failure, not only its one-line message")

    p = _Parser(prog="distmm", description="distributed matrix multiplication",
                epilog="exit status: 0 success, 1 a failed run, 2 bad input or arguments, "
                       "130 SIGINT, 143 SIGTERM, 152 SIGXCPU")
    p.add_argument("--version", action="version", version=f"distmm {__version__}",
                   help="print distmm's version and exit")
    p.add_argument("--debug", action="store_true", default=False,
                   help="print the traceback of a failure, not only its one-line message")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=_Parser)
    p.commands = sub.choices  # each command's parser, by name

    d = sub.add_parser("demo", parents=[common],
                       help="multiply random matrices, check against numpy, print plan and speed",
                       description="multiply random n x n matrices, check against numpy, "
                                   "print the plan and the speed")
    d.add_argument("-n", "--n", dest="n", type=_positive, default=2048,
                   help="matrix size (default 2048; --n as distmm trace spells it)")
    d.add_argument("--dtype", type=matmul_dtype, default="float64",
                   help="element type, as numpy names it (default float64)")
    d.add_argument("--engine", default="auto", choices=["auto", "local", "dask"],
                   help="auto: an embedded cluster, the dask engine (a LocalCUDACluster of the GPUs "
                        "for float32/float64 where cupy, a GPU and dask_cuda are present, else a "
                        "LocalCluster); local: threads in this process")
    from distmm.plan import MAX_WORKERS

    # bounded here, before a cluster of that many worker processes is started
    d.add_argument("--workers", type=integer_at_least(1, most=MAX_WORKERS), default=None,
                   help="cluster workers (at most 4 per usable core) or local threads "
                        "(default: one per core, or distmm.local-threads for local threads; "
                        "on GPUs, how many GPUs, default all)")
    d.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="tile executor (default auto: BLAS/numba on the CPU, cuBLAS/raw on a GPU)")
    d.add_argument("--report", default=None, metavar="FILE.html", type=nonempty(),
                   help="write a distributed performance_report of the product (dask engine)")
    d.add_argument("--progress", default=None, action=argparse.BooleanOptionalAction,
                   help="progress bar as C tiles arrive (default: on a terminal, for long runs)")
    d.set_defaults(func=_cmd_demo)

    pl = sub.add_parser("plan", parents=[common], help="print the plan for C[M,N] = A[M,K] @ B[K,N]",
                        description="print the tiling plan distmm.matmul makes for "
                                    "C[M,N] = A[M,K] @ B[K,N] of numpy arrays in this process: "
                                    "the tile, backend and memory budget come from distmm's "
                                    "configuration (DISTMM_MEMORY_BUDGET, DISTMM_TILE, ...) as "
                                    "for the product itself")
    pl.add_argument("m", type=_count, help="rows of A and C")
    pl.add_argument("n", type=_count, help="columns of B and C")
    pl.add_argument("k", type=_count, help="columns of A, rows of B")
    pl.add_argument("--workers", type=integer_at_least(1, most=MAX_WORKERS), default=None,
                    help="workers to plan for: the local engine's threads, each with its "
                         "share of the memory budget (default: the threads the local engine "
                         "runs, distmm.local-threads or the usable cores; 1 on a GPU)")
    pl.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="tile executor, as for distmm matmul (default auto); it decides "
                         "whether the product runs on a GPU and so its memory budget")
    pl.add_argument("--dtype", type=matmul_dtype, default="float64",
                    help="element type of A and B, checked as distmm.matmul does; the plan is for "
                         "numpy's result of their product (float32 for bfloat16, which needs "
                         "ml_dtypes) (default float64)")
    pl.add_argument("--tile", type=_positive, nargs="+", metavar="SIZE",
                    help="C tile size, or three sizes tm tn tk (default: the planner chooses)")
    pl.add_argument("--ranks", type=_positive, default=None,
                    help="also print what mpirun -n RANKS distmm matmul runs (its grid, the "
                         "stripes and what each rank reads, as the batch path decides them "
                         "from the configuration and this machine's backend and memory), and "
                         "the MPI engine's process grid for arrays in memory")
    pl.add_argument("--hosts", type=_positive, default=None,
                    help="with --ranks: the hosts the ranks run on (an emulated node counts as "
                         "one; default 1): across hosts the ranks broadcast their panels "
                         "(batch-panels auto)")
    pl.set_defaults(func=_cmd_plan)

    mm = sub.add_parser("matmul", parents=[common],
                        help="C = A @ B on files (.npy, .zarr, file.h5:dataset)",
                        description="C = A @ B on files. The output is staged beside its target "
                                    "(.NAME.distmm-partial-PID) and moved into place only when "
                                    "complete; a failure or a signal leaves the target as it was.")
    mm.add_argument("a", type=nonempty(),
                    help="A: a .npy file, a zarr array (x.zarr, group.zarr/array) or "
                         "file.h5:dataset (file.h5 alone: dataset 'data')")
    mm.add_argument("b", type=nonempty(), help="B: as A")
    mm.add_argument("-o", "--output", required=True, type=nonempty(),
                    help="where C goes: out.npy, out.zarr, group.zarr/C or file.h5:C (other "
                         "datasets of the file are kept; file.h5 alone is file.h5:data)")
    mm.add_argument("--overwrite", action="store_true",
                    help="replace an existing output (never a folder, a zarr group or an HDF5 group)")
    mm.add_argument("--engine", default="auto", choices=["auto", "local", "dask", "mpi"],
                    help="auto: mpi under mpirun/srun with several ranks, dask with "
                         "--scheduler/--scheduler-file, else the configured distmm.engine "
                         "(DISTMM_ENGINE; by default local threads); mpi: SUMMA over the "
                         "MPI ranks")
    conn = mm.add_mutually_exclusive_group()
    conn.add_argument("--scheduler", metavar="ADDRESS", default=None, type=nonempty("address"),
                      help="run on an existing Dask cluster, e.g. tcp://host:8786")
    conn.add_argument("--scheduler-file", metavar="FILE", default=None, type=nonempty(),
                      help="run on the Dask cluster described by this scheduler file "
                           "(dask scheduler --scheduler-file)")
    mm.add_argument("--connect-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                    help="how long to wait for a Dask scheduler to answer at --scheduler or "
                         "--scheduler-file, whatever listens there (default 30)")
    mm.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="tile executor (default auto); raw and cublas need a GPU")
    mm.add_argument("--tile", type=_positive, default=None,
                    help="C tile size of the local and Dask engines (default: the planner "
                         "chooses; the MPI engine plans its own grid and stripes and refuses it)")
    from distmm.plan import PRECISIONS

    mm.add_argument("--precision", default=None, choices=PRECISIONS, type=str.lower,
                    help="highest: exact for the dtype; tf32, bf16, fp16: float32/float16/bfloat16 "
                         "operands rounded to that format, summed in float32 (tensor cores; "
                         "emulated on the CPU) (default: distmm.precision, else highest)")
    mm.add_argument("--progress", default=None, action=argparse.BooleanOptionalAction,
                    help="progress bar over C tiles, for every engine (default: on a terminal, "
                         "for long runs)")
    mm.add_argument("--resume", action="store_true",
                    help="keep a stopped run's staged output and finished stripes (SIGTERM, "
                         "SIGINT, a failure), and finish such a run instead of starting over; "
                         "the inputs, arguments and rank count must be the same")
    mm.add_argument("--profile", metavar="FILE.json", default=None, type=nonempty(),
                    help="write where the time went, per rank (open, read, h2d, gemm, comm, d2h, "
                         "write, sync, wait, commit), as JSON; the summary line shows the totals")
    mm.set_defaults(func=_cmd_matmul)

    from distmm.cli.serve import add_parser as add_cluster_parser

    add_cluster_parser(sub, common)  # distmm cluster: distmm.cli.serve

    i = sub.add_parser("info", parents=[common], help="devices, backends, versions, settings",
                       description="print devices, backends and versions, and the distmm "
                                   "settings that differ from the defaults, with where each "
                                   "was set")
    i.set_defaults(func=_cmd_info)

    r = sub.add_parser("report", parents=[common],
                       help="plots and tables from benchmark records (needs distmm[bench])",
                       description="write TFLOP/s, scaling, timeline, roofline and "
                                   "predicted-against-measured PNGs, report.md and index.html "
                                   "into a new folder, from benchmark records (JSON lines) and "
                                   "distmm-profile-1 profiles (.json)")
    r.add_argument("records", nargs="+", metavar="RECORDS",
                   help="record files (.jsonl), profiles (.json, e.g. mpi-batch-profiles-*.json) "
                        "and SUMMA traces (summa-trace-*.json, read by distmm model only)")
    r.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the folder to write (created; an existing non-empty one needs --overwrite)")
    r.add_argument("--overwrite", action="store_true",
                   help="replace an existing report's DIR (report.md, index.html, PNGs only)")
    from distmm.cli.report import add_options as add_report_options

    add_report_options(r)  # --only, --no-html
    r.set_defaults(func=_cmd_report)

    from distmm.cli.model import add_parsers as add_model_parsers

    add_model_parsers(sub, common, matmul_dtype, _count)  # distmm calibrate, distmm model

    from distmm.cli.bench import add_parser as add_bench  # distmm bench STUDY.toml

    add_bench(sub, common)

    for name, helptext in (("tune", "autotune GPU kernel parameters (distmm tune --help)"),
                           ("trace", "copy/compute timeline PNG of a pipelined run (distmm trace --help)")):
        sub.add_parser(name, help=helptext, add_help=False)
    return p


# ---------------------------------------------------------------- dispatch

_PASS_THROUGH = {"tune": ("distmm.cli.tune",),
                 "trace": ("distmm.cli.trace",)}


def _import_first(names):
    """Import the first module of ``names`` that exists (the commands' new home, then the old)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but lacks a dependency
                raise
    raise ModuleNotFoundError(f"none of {', '.join(names)}", name=names[0])


def _pass_through(command: str, argv: list[str], *, debug: bool = False) -> int:
    """Run a command that parses its own options; ``--debug`` (before the command's name, or
    among its options before a ``--``) is distmm's and is not passed on."""
    end = argv.index("--") if "--" in argv else len(argv)
    debug = debug or "--debug" in argv[:end]
    argv = [a for a in argv[:end] if a != "--debug"] + argv[end:]
    try:
        with guard():  # a signal while the command's modules import: the one line
            module = _import_first(_PASS_THROUGH[command])
    except ImportError as exc:
        return report(command, exc, debug=debug,
                      note=' (this command needs the GPU extras: pip install "distmm[gpu]")')
    previous = terminate_on_sigterm()
    try:
        with one_line_warnings(command, debug=debug):
            status = module.main(argv)
            raise_if_signalled()
        return status
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure ends as one line
        return report(command, exc, debug=debug)
    finally:
        restore_signals(previous)


def main(argv=None) -> int:
    """Run ``distmm`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    whole_line_writes()
    lead = 1 if argv[:1] == ["--debug"] else 0  # distmm's own option before the command
    if len(argv) > lead and argv[lead] in _PASS_THROUGH:
        # These commands own their options: hand everything after the name over.
        return _pass_through(argv[lead], argv[lead + 1:], debug=bool(lead))
    with guard():  # a signal while the parser's modules import: the one line, 130 / 143
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command they were given to, as its own errors are
        parser.commands.get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    debug = bool(getattr(args, "debug", False))
    previous = terminate_on_sigterm()
    try:
        with one_line_warnings(args.command, debug=debug):  # numpy's: one line each
            status = args.func(args)
            raise_if_signalled()  # a signal whose exception a library swallowed
        return status
    except BaseException as exc:  # noqa: BLE001 - every failure ends as one line
        if isinstance(exc, SystemExit):
            raise
        if isinstance(exc, (KeyboardInterrupt, Signalled)):
            let_rank_zero_say()  # one line for a signal every rank got
        status = report(args.command, exc, debug=debug)
        staging = sys.modules.get("distmm.staging")
        if isinstance(exc, (KeyboardInterrupt, Signalled)):
            # a signal: the staged output is gone already; tiles still running on pool threads
            # are not waited for (the interpreter would join them at exit)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        if (staging is not None and staging.HDF5_UNCLOSED) or ("zarr" in sys.modules
                                                                 and is_command()):
            # HDF5 would retry the failed close at exit and crash; zarr's reads still queued
            # beside a failed one would each print a traceback as its event loop closes (the
            # command only: main() called in a process that goes on returns): the staged
            # output is gone already, so end here.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    finally:
        restore_signals(previous)
