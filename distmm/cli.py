"""The ``distmm`` command line: demo, plan, matmul, info (tune and trace come
from the GPU executor). Uses only the public API."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _cmd_plan(args) -> int:
    from distmm.plan import make_plan

    tile = tuple(args.tile) if args.tile and len(args.tile) == 3 else (args.tile[0] if args.tile else None)
    print(make_plan(args.m, args.n, args.k, args.dtype, workers=args.workers, tile=tile).describe())
    return 0


def _cmd_info(args) -> int:
    import platform

    import dask
    import distributed
    import numba

    import distmm
    from distmm.executor import gpu_available

    print(f"distmm      {distmm.__version__}")
    print(f"python      {platform.python_version()} on {platform.machine()}")
    print(f"numpy       {np.__version__}")
    print(f"numba       {numba.__version__}")
    print(f"dask        {dask.__version__}; distributed {distributed.__version__}")
    try:
        import mpi4py
        from mpi4py import MPI

        print(f"mpi4py      {mpi4py.__version__}; {MPI.Get_library_version().splitlines()[0]}")
    except Exception as exc:  # pragma: no cover - depends on the machine
        print(f"mpi4py      unavailable ({exc})")
    from distmm.engine.local import default_workers

    print(f"cpu         {default_workers()} usable cores; backends numba, blas")
    if gpu_available():
        import cupy

        for d in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(d)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            print(f"gpu {d}       {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB, "
                  f"sm_{props['major']}{props['minor']}; cupy {cupy.__version__}; backends raw, cublas")
    else:
        print("gpu         none (install distmm[gpu] on a CUDA machine for the raw and cublas backends)")
    return 0


def _cmd_matmul(args) -> int:
    import distmm
    from distmm.io import open_operand, staged_output
    from distmm.plan import result_dtype

    a = open_operand(args.a)
    b = open_operand(args.b)
    t0 = time.perf_counter()
    if a.ndim == b.ndim == 2:
        # Out of core: operands are read panel by panel and C is written tile by
        # tile into a staged file that is renamed into place only on success.
        if a.shape[1] != b.shape[0]:  # checked here too so that no file is staged
            raise ValueError(f"inner dimensions differ: a has shape {a.shape}, b has shape {b.shape}")
        shape = (a.shape[0], b.shape[1])
        with staged_output(args.output, shape, result_dtype(np.dtype(a.dtype), np.dtype(b.dtype))) as c:
            distmm.matmul(a, b, out=c, engine=args.engine, backend=args.backend, tile=args.tile)
            dtype = c.dtype
    else:
        from distmm.io import write_atomic

        c = distmm.matmul(np.asarray(a), np.asarray(b), engine=args.engine, backend=args.backend,
                          tile=args.tile)
        shape, dtype = np.shape(c), np.asarray(c).dtype
        write_atomic(args.output, c)
    seconds = time.perf_counter() - t0
    print(f"wrote {args.output}: shape {shape}, dtype {dtype}, {seconds:.3f} s")
    return 0


def _cmd_demo(args) -> int:
    import distmm
    from distmm.demo import run_demo

    return run_demo(n=args.n, dtype=args.dtype, engine=args.engine, workers=args.workers,
                    backend=args.backend, distmm=distmm, report=args.report,
                    progress=args.progress)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distmm", description="distributed matrix multiplication")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="multiply random matrices, check against numpy, print plan and speed")
    d.add_argument("-n", type=int, default=2048, help="matrix size (default 2048)")
    d.add_argument("--dtype", default="float64")
    d.add_argument("--engine", default="auto", choices=["auto", "local", "dask"],
                   help="auto: an embedded LocalCluster (dask engine)")
    d.add_argument("--workers", type=int, default=None, help="cluster workers (default: one per core)")
    d.add_argument("--backend", default="auto")
    d.add_argument("--report", default=None, metavar="FILE.html",
                   help="write a distributed performance_report of the product (dask engine)")
    d.add_argument("--progress", default=None, action=argparse.BooleanOptionalAction,
                   help="progress bar as C tiles arrive (default: on a terminal, for long runs)")
    d.set_defaults(func=_cmd_demo)

    pl = sub.add_parser("plan", help="print the plan for C[M,N] = A[M,K] @ B[K,N]")
    pl.add_argument("m", type=int)
    pl.add_argument("n", type=int)
    pl.add_argument("k", type=int)
    pl.add_argument("--workers", type=int, default=1)
    pl.add_argument("--dtype", default="float64")
    pl.add_argument("--tile", type=int, nargs="+", help="tile size, or tm tn tk")
    pl.set_defaults(func=_cmd_plan)

    mm = sub.add_parser("matmul", help="C = A @ B on files (.npy, .zarr, file.h5:dataset)")
    mm.add_argument("a")
    mm.add_argument("b")
    mm.add_argument("-o", "--output", required=True)
    mm.add_argument("--engine", default="auto", choices=["auto", "local", "dask"])
    mm.add_argument("--backend", default="auto")
    mm.add_argument("--tile", type=int, default=None)
    mm.set_defaults(func=_cmd_matmul)

    i = sub.add_parser("info", help="devices, backends and versions")
    i.set_defaults(func=_cmd_info)

    for name, helptext in (("tune", "autotune GPU kernel parameters (distmm tune --help)"),
                           ("trace", "copy/compute timeline PNG of a pipelined run (distmm trace --help)")):
        sub.add_parser(name, help=helptext, add_help=False)
    return p


def _lazy_command(module_name: str):
    def run(args) -> int:
        import importlib

        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            print(f"distmm: this command needs the GPU extras: pip install \"distmm[gpu]\" ({exc})",
                  file=sys.stderr)
            return 2
        return module.main(args.rest)
    return run


_PASS_THROUGH = {"tune": "distmm.tune", "trace": "distmm.trace"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASS_THROUGH:
        # These commands own their options: hand everything after the name over.
        return _lazy_command(_PASS_THROUGH[argv[0]])(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"distmm {args.command}: error: {exc}", file=sys.stderr)
        return 2
