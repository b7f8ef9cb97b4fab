"""nvmath-python's distributed matmul (cuBLASMp, NCCL backend): a peer of benchmark ``mpi``.

This module covers: loading nvmath-python's distributed matmul where its wheels are (a
folder put first on ``PYTHONPATH`` of the ranks that run it, ``--nvmath-site``), the rank
program run under the same ``mpiexec`` as distmm's ranks (one GPU per rank), and its
record. It does *not* cover: the driver, the other variants, the reference or the sampled
float64 check itself (``bench/mpi.py``), nor the operands (``bench/mpi_blocks.py``).

What it runs (the layout of nvmath's own example01, which cuBLASMp runs as AllGather+GEMM
on P > 1 ranks and as one local GEMM on 1 rank): rank r holds rows ``r0:r1`` of A, passed
as the transposed (column-major) view ``A[r0:r1].T`` with ``is_transpose`` set
(``Slab.Y``), columns ``c0:c1`` of B made column-major (``Slab.Y``), and gets rows
``r0:r1`` of C (``Slab.X``, column-major). ``Matmul(...)`` and ``plan()`` are not timed (as
building pylops-mpi's operator is not); one untimed, checked ``execute()``, then
``--repeat`` timed ones between barriers, the device synchronised before the closing one.

What it needs, and works around (read from nvmath-python 1.0.0's wheel and cuBLASMp's
libraries, 2026-11-25; bench/NOTES.md, MPI engine): nvmath 1.0 takes cuBLASMp >= 0.8.1,
< 0.10 and nccl4py >= 0.3.1, < 0.4; every cuBLASMp from 0.8.0 on calls NCCL functions that
NCCL 2.28 lacks (``ncclCommQueryProperties``, in the grid's constructor, so even on one
rank), so ``libnccl.so.2`` must be NCCL >= 2.29.2: an older one fails here, at load, with
the loader's words. Without NVSHMEM (its wheel does not fit the device bundle):
cuda-pathfinder lists ``nvshmem_host`` as a dependency of cuBLASMp, so ``load`` opens
``libcublasmp.so.0`` itself (its cuBLAS and NCCL found by cuda-pathfinder first); and
nvmath asks NVSHMEM whether each GPU operand lies on its symmetric heap, so, where
``libnvshmem_host.so.3`` is missing, that question is answered "no" (which is what NVSHMEM
answers when it was not initialised, as it is not with ``backends=["nccl"]``).
nvmath 0.8 with cuBLASMp 0.7 is the generation that runs on NCCL 2.28: it needs NVSHMEM
too (the GPU image has ``nvidia-nvshmem-cu13``), so ``load`` says which backends to start.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench import mpi_blocks
from bench.common.peers import SAMPLE_ROWS, check_rows, peer_import, threads_per_rank
from bench.mpi_blocks import A, B

NAME = "nvmath-python"
CUBLASMP = "nvidia/cublasmp/cu13/lib/libcublasmp.so.0"
# what libcublasmp.so.0 needs, where their wheels put them (nvidia-cublas, nvidia-nccl-cu13)
WHEEL_LIBS = (("cublasLt", "nvidia/cu13/lib/libcublasLt.so.13"),
              ("cublas", "nvidia/cu13/lib/libcublas.so.13"), ("nccl", "nvidia/nccl/lib/libnccl.so.2"))


def _on_sys_path(rel: str) -> Path | None:
    """The first ``sys.path`` entry's ``rel`` that is a file, or None."""
    return next((Path(p) / rel for p in sys.path if (Path(p) / rel).is_file()), None)


def env_with(site: str | None, env: dict) -> dict:
    """``env`` with ``site`` (the folder the nvmath wheels were installed into) first on
    ``PYTHONPATH``; unchanged when ``site`` is None."""
    if not site:
        return env
    return dict(env, PYTHONPATH=os.pathsep.join([site] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))


def _nccl_version(path: str) -> str:
    """NCCL's own version number (``ncclGetVersion``) of the library at ``path``."""
    v = ctypes.c_int()
    ctypes.CDLL(path).ncclGetVersion(ctypes.byref(v))
    major, rest = divmod(v.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def load() -> dict:
    """Import nvmath's distributed matmul and load cuBLASMp with its NCCL; the versions and
    the backends to initialise (``"backends"``). Raises, with the reason, where any of it is
    missing or does not load.

    Two generations: nvmath >= 0.9 (cuBLASMp >= 0.8, NCCL >= 2.29.2, nccl4py) runs on the NCCL
    backend alone; nvmath 0.8 (cuBLASMp 0.6/0.7, NCCL >= 2.28.3) needs NVSHMEM as well
    (its ``Matmul`` refuses a runtime without it and puts its workspace on the symmetric heap).
    """
    import nvmath
    import nvmath.distributed  # noqa: F401 -- nvmath first: its absence is the usual reason
    import cuda.core
    from cuda.pathfinder import DynamicLibNotFoundError, load_nvidia_dynamic_lib

    libs = {}
    for name, rel in WHEEL_LIBS:  # cuda-pathfinder looks in site.getsitepackages(), not in
        path = _on_sys_path(rel)  # PYTHONPATH folders: a wheel's copy there is opened first
        if path is not None:
            ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
        libs[name] = load_nvidia_dynamic_lib(name).abs_path  # the copy already open, if any
    nccl_version = _nccl_version(libs["nccl"])
    path = _on_sys_path(CUBLASMP)
    if path is None:
        raise FileNotFoundError(f"{CUBLASMP} is on no sys.path entry (nvidia-cublasmp-cu13 "
                                f"not installed where the ranks look)")
    try:
        load_nvidia_dynamic_lib("nvshmem_host")
        nvshmem = True
    except DynamicLibNotFoundError:
        nvshmem = False
    try:  # RTLD_NOW (ctypes always adds it): a missing NCCL function fails here, not mid-run
        ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
    except OSError as e:
        hint = "; cuBLASMp >= 0.8 needs NCCL >= 2.29.2" if "symbol: nccl" in str(e) else ""
        raise OSError(f"{e} (NCCL {nccl_version} at {libs['nccl']}{hint})") from None
    from nvmath.bindings import cublasMp

    major_minor = tuple(int(x) for x in nvmath.__version__.split(".")[:2])
    if major_minor < (0, 9):  # nvmath 0.8's Matmul needs both runtimes
        if not nvshmem:
            raise OSError("nvmath-python < 0.9 needs NVSHMEM (libnvshmem_host.so.3), not found")
        backends = ["nvshmem", "nccl"]
    else:
        backends = ["nccl"]
        if not nvshmem:
            from nvmath.distributed._internal import tensor_ifc

            tensor_ifc.is_nvshmem_initialized = lambda: False  # not initialised: not installed
    try:
        import nccl

        nccl4py = nccl.__version__
    except ImportError:
        nccl4py = None  # nvmath < 0.9 binds NCCL itself
    return {"nvmath_python": nvmath.__version__, "cublasmp": cublasMp.get_version(),
            "nccl": nccl_version, "nccl4py": nccl4py, "cuda_core": cuda.core.__version__,
            "nvshmem": nvshmem, "backends": backends, "libnccl": libs["nccl"],
            "libcublas": libs["cublas"]}


def check(env: dict) -> tuple[dict | None, str]:
    """(versions, "") where ``load`` works in the ranks' environment ``env``, else (None,
    why): the exception's own line. In a subprocess: loading opens CUDA libraries."""
    line, why = peer_import("import json; from bench.nvmath_peer import load; "
                            "print(json.dumps(load()))", env,
                            "nvmath-python does not load in the ranks' environment")
    return (json.loads(line), "") if line is not None else (None, why)


def slab(n: int, parts: int, i: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``i`` of ``n`` in nvmath's ``Slab``: the first ``n % parts``
    parts one longer."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (i < extra)


def worker(args) -> int:
    """Run under mpiexec, one GPU per rank: nvmath's distributed matmul on each rank's own
    blocks; rank 0 writes the result (or ``{"error": why}`` where nvmath does not load or
    initialise on some rank)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    why, versions = "", {}
    try:
        versions = load()
        import cupy
        import nvmath.distributed

        from distmm.engine.mpi.gridcomms import local_gpu

        device = local_gpu(comm)
        # nvmath 0.8 puts cuBLASMp's workspace on NVSHMEM's symmetric heap (AG+GEMM needs
        # it there); NVSHMEM's default 1 GiB is less than a gathered 32768^2 float32 panel
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "10G")
        nvmath.distributed.initialize(device, comm, backends=versions["backends"])
    except Exception as e:  # noqa: BLE001 -- reported as the peer's one line
        why = f"{type(e).__name__}: {e}".splitlines()[0]
    whys = [w for w in comm.allgather(why) if w]
    if whys:
        if comm.rank == 0:
            Path(args.result).write_text(json.dumps({"error": whys[0]}))
        return 0
    from nvmath.distributed.distribution import Slab
    from nvmath.distributed.linalg.advanced import Matmul, matrix_qualifiers_dtype

    n, dtype, p, rank = args.n, args.dtype, comm.size, comm.rank
    threads = threads_per_rank(p)
    r0, r1 = slab(n, p, rank)
    c0, c1 = slab(n, p, rank)
    a = cupy.asarray(mpi_blocks.block(A, (n, n), (r0, r1, 0, n), dtype, threads=threads)).T
    b = cupy.asfortranarray(cupy.asarray(
        mpi_blocks.block(B, (n, n), (0, n, c0, c1), dtype, threads=threads)))
    cupy.get_default_memory_pool().free_all_blocks()  # B's row-major staging copy
    qualifiers = np.zeros((3,), dtype=matrix_qualifiers_dtype)
    qualifiers[0]["is_transpose"] = True  # a is A[r0:r1].T, column-major
    mm = Matmul(a, b, distributions=[Slab.Y, Slab.Y, Slab.X], qualifiers=qualifiers)
    mm.plan()
    c = mm.execute()  # untimed; its sampled rows are checked
    cupy.cuda.Device().synchronize()
    relerr = (check_rows(comm, b, (0, n, c0, c1), c, (r0, r1, 0, n), n, dtype)
              if args.check else None)
    times = []
    for _ in range(max(args.repeat, 1)):
        c = None  # C's memory back to the pool, as distmm's C is between calls
        comm.Barrier()
        t0 = time.perf_counter()
        c = mm.execute()
        cupy.cuda.Device().synchronize()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    del c
    mm.free()
    nvmath.distributed.finalize()
    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "seconds": float(np.median(times)), "times": times, "relerr": relerr,
            "versions": versions, "threads_per_rank": threads}))
    return 0


def record(writer, res: dict, case, ref_seconds: float, ref_variant: str, rounds: int,
           repeat: int) -> None:
    """One ``nvmath-python`` record and its printed line (``case``: ranks, dtype, n, gpus)."""
    ranks, dtype, n, gpus = case
    seconds = float(np.median(res["times"]))
    extra = {"parallel_efficiency": ref_seconds / (gpus * seconds)} if gpus > 1 else {}
    v = res["versions"]
    rec = writer.add(NAME, dtype, n, n, n, seconds, res["relerr"], ranks=ranks, gpus=gpus,
                     times=res["times"], rounds=rounds, repeat=repeat, versions=v,
                     ratio_to_reference=ref_seconds / seconds,
                     backend="cublasmp-" + "+".join(v["backends"]),
                     distributions=["Slab.Y (A transposed view)", "Slab.Y", "Slab.X"], **extra,
                     note=f"nvmath-python {v['nvmath_python']} distributed Matmul, cuBLASMp "
                          f"{v['cublasmp']}, NCCL {v['nccl']}, backends="
                          f"{v['backends']} (NVSHMEM "
                          f"{'present' if v['nvshmem'] else 'absent'}); one GPU per rank; "
                          f"each rank made only its rows of A and columns of B (C stays "
                          f"distributed by rows); Matmul and plan() untimed; {repeat} timed "
                          f"execute() per launch after an untimed checked one; relerr on "
                          f"{SAMPLE_ROWS} sampled rows of C against float64")
    print(f"{NAME:12s} {dtype} n={n} ranks={ranks} gpus={gpus}: {seconds:.3f} s "
          f"{rec['tflops'] * 1e3:.1f} GFLOP/s, {ref_seconds / seconds:.2f} of {ref_variant}"
          + (f", parallel efficiency {extra['parallel_efficiency']:.2f}" if extra else "")
          + f"; relerr {res['relerr']}", flush=True)
