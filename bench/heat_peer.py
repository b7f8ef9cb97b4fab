"""Heat's distributed matmul (``ht.matmul``): a peer of benchmark ``mpi``.

This module covers: whether ``import heat`` works in the ranks' environment (a folder
put first on ``PYTHONPATH`` of the ranks that run it, ``--heat-site``), the rank program
run under the same ``mpiexec`` as distmm's ranks, and its record. It does *not* cover: the
driver, the other variants, the reference or the sampled float64 check itself
(``bench/mpi.py``), nor the operands (``bench/mpi_blocks.py``).

What it runs: the layout of Heat's own matmul benchmark (``matmul_cpu_split_0`` in its
``benchmarks/cb/linalg.py``: A and B both ``split=0``). Rank r holds the rows Heat's own
split-0 chunking gives it (``comm.chunk``, as ``ht.random.random(..., split=0)`` would) of
A and of B, made from the shared operands and wrapped with ``ht.array(local, is_split=0,
device=...)`` (not timed, as building distmm's ``DistArray`` is not). The timed call is
``ht.matmul(A, B)``; C stays distributed (split 0, rows). Heat 1.8.0 runs split 0-0 as P
rounds: round p ``Ibcast``s rank p's rows of B to every rank while each multiplies its rows
of A (the matching k columns) by the rows received in round p-1, so every rank receives
(P-1)/P of B and does n^3/P multiply-adds in torch's matmul. ``--mode gpu``: device
``"gpu"``, which Heat maps to ``cuda:(rank % visible GPUs)``; the device is synchronised
before the closing barrier.

What it needs (2026-11-25): heat 1.8.0 (the newest on PyPI) declares ``torch<2.11.1``
while the machines have newer torch, so it is installed with ``pip install --no-deps``
against the torch that is there; ``import heat`` also needs scipy and a torchvision
matching that torch (``heat.utils`` imports ``torchvision.transforms`` at import time).
Where ``import heat`` fails the run prints the exception's line and writes no record.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np

from bench import mpi_blocks
from bench.common.peers import SAMPLE_ROWS, check_rows, peer_import, threads_per_rank
from bench.mpi_blocks import A, B

NAME = "heat"
SPLITS = {"a": 0, "b": 0}  # Heat's benchmarks/cb/linalg.py matmul_cpu_split_0


def versions() -> dict:
    """Import heat (and so torch); the versions and torch's BLAS. Raises where it does not."""
    import heat
    import torch

    blas = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return {"heat": heat.__version__, "torch": torch.__version__,
            "torch_blas": blas.group(1) if blas else None}


def check(env: dict) -> tuple[dict | None, str]:
    """(versions, "") where ``import heat`` works in the ranks' environment ``env``, else
    (None, why): the exception's own line. In a subprocess: importing heat initialises MPI."""
    line, why = peer_import("import json; from bench.heat_peer import versions; "
                            "print(json.dumps(versions()))", env,
                            "import heat failed in the workers' environment")
    return (json.loads(line), "") if line is not None else (None, why)


def _local(t, gpu: bool):
    """A rank's torch block as an array ``check_rows`` reads without a copy (cupy on GPU,
    on the tensor's device)."""
    if gpu:
        import cupy

        cupy.cuda.Device(t.device.index).use()
        return cupy.asarray(t)
    return t.numpy()


def worker(args) -> int:
    """Run under mpiexec: ``ht.matmul`` on split-0 operands whose rows each rank made."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    threads = threads_per_rank(comm.size)
    import torch

    torch.set_num_threads(threads)
    import heat as ht

    n, dtype, gpu = args.n, args.dtype, args.gpu
    device = "gpu" if gpu else "cpu"
    _, _, (rows, _) = ht.MPI_WORLD.chunk((n, n), SPLITS["a"])
    _, _, (krows, _) = ht.MPI_WORLD.chunk((n, n), SPLITS["b"])
    a_local = mpi_blocks.block(A, (n, n), (rows.start, rows.stop, 0, n), dtype, threads=threads)
    b_local = mpi_blocks.block(B, (n, n), (krows.start, krows.stop, 0, n), dtype, threads=threads)
    a = ht.array(torch.from_numpy(a_local), is_split=SPLITS["a"], device=device)
    b = ht.array(torch.from_numpy(b_local), is_split=SPLITS["b"], device=device)
    del a_local, b_local
    sync = (lambda: torch.cuda.synchronize(a.larray.device)) if gpu else (lambda: None)
    c = ht.matmul(a, b)  # untimed; its sampled rows are checked
    sync()
    relerr = None
    if args.check:
        if comm.size == 1 or c.split is None:  # one rank: Heat leaves C undistributed
            c0, rows_c = 0, n
        else:
            counts, displs = c.counts_displs()
            c0, rows_c = displs[comm.rank], counts[comm.rank]
        relerr = check_rows(comm, _local(b.larray, gpu), (krows.start, krows.stop, 0, n),
                            _local(c.larray, gpu), (c0, c0 + rows_c, 0, n), n, dtype)
    c_split = c.split
    times = []
    for _ in range(max(args.repeat, 1)):
        c = None  # C's memory freed, as distmm's C is between calls
        comm.Barrier()
        t0 = time.perf_counter()
        c = ht.matmul(a, b)
        sync()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    if comm.rank == 0:
        Path(args.result).write_text(json.dumps({
            "seconds": float(np.median(times)), "times": times, "relerr": relerr,
            "versions": versions(), "splits": {**SPLITS, "c": c_split}, "device": str(a.device),
            "threads_per_rank": torch.get_num_threads()}))
    return 0


def record(writer, res: dict, case, ref_seconds: float, ref_variant: str, rounds: int,
           repeat: int) -> None:
    """One ``heat`` record and its printed line (``case``: ranks, dtype, n, gpus)."""
    ranks, dtype, n, gpus = case
    seconds = float(np.median(res["times"]))
    v, s = res["versions"], res["splits"]
    gpu = res["device"].startswith("gpu")
    extra = {"gpus": gpus} if gpu else {}
    if gpu and gpus > 1:
        extra["parallel_efficiency"] = ref_seconds / (gpus * seconds)
    rec = writer.add(NAME, dtype, n, n, n, seconds, res["relerr"], ranks=ranks, times=res["times"],
                     rounds=rounds, repeat=repeat, versions=v, splits=s, heat_device=res["device"],
                     threads_per_rank=res["threads_per_rank"],
                     ratio_to_reference=ref_seconds / seconds, **extra,
                     note=f"heat {v['heat']} (pip --no-deps) on torch {v['torch']} (BLAS "
                          f"{v['torch_blas']}), ht.matmul(A, B) with A split={s['a']}, B "
                          f"split={s['b']} (Heat's own matmul benchmark), C split={s['c']} "
                          f"(stays distributed); each rank made only its rows of A and B; "
                          f"{res['threads_per_rank']} torch thread(s) per rank; {repeat} timed "
                          f"product(s) per launch after an untimed checked one; relerr on "
                          f"{SAMPLE_ROWS} sampled rows of C against float64")
    print(f"{NAME:12s} {dtype} n={n} ranks={ranks}" + (f" gpus={gpus}" if gpu else "")
          + f" splits={s['a']},{s['b']}->{s['c']}: {seconds:.3f} s "
          f"{rec['tflops'] * 1e3:.1f} GFLOP/s, {ref_seconds / seconds:.2f} of {ref_variant}"
          + (f", parallel efficiency {extra['parallel_efficiency']:.2f}"
             if "parallel_efficiency" in extra else "")
          + f"; relerr {res['relerr']}", flush=True)
