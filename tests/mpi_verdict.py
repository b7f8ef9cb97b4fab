"""The collective verdict of the scripts ``mpiexec`` runs in the MPI tests
(``mpi_cases.py``, ``mpi_reuse_cases.py``): every case runs on every rank, its
exception is recorded, and all ranks agree on the verdict with an allreduce, so
that a failing rank cannot leave the others waiting in a collective."""
from __future__ import annotations

import traceback


def run_cases(comm, cases, failures: list) -> tuple[bool, list]:
    """Run ``cases`` (callables) on this rank, recording each exception in
    ``failures``; return ``(ok, every rank's failures)``: ``ok`` the same on
    every rank, the failures gathered on rank 0 (None on the others)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    for case in cases:
        try:
            case()
        except Exception:  # noqa: BLE001 - recorded, the verdict below is collective
            failures.append(f"rank {rank}: {case.__name__} raised\n{traceback.format_exc()}")
    all_failures = comm.gather(failures, root=0)
    ok = comm.allreduce(0 if failures else 1, op=MPI.MIN) == 1
    return ok, ([f for fs in all_failures for f in fs] if rank == 0 else None)
