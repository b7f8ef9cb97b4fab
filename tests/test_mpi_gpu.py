"""The MPI engine on a GPU: repeated products on 1 rank and on 2 ranks sharing one GPU
reuse the grid communicators the first made (tests/mpi_reuse_cases.py with ``gpu``: no NCCL
communicator at all on one rank) and give float64-close results; and 2 ranks (sharing
one GPU on a one-GPU machine), panels
through the automatic choice, NCCL (only when the ranks have GPUs of their own: NCCL
refuses two ranks on one device), pinned host staging and (where the MPI reports it)
CUDA-aware MPI; checked against a float64 product.

Run on a GPU machine (the lead runs it on the device); skipped without a GPU.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import sys, numpy as np, cupy
from mpi4py import MPI
import distmm
from distmm.engine.mpi import DistArray, MPIEngine
from distmm.grid import make_grid
comm = MPI.COMM_WORLD
fails = []
rng = np.random.default_rng(5)
from distmm.engine.mpi.comm import mpi_cuda_aware, select_local_gpu, shares_gpu
select_local_gpu(comm)
shared = shares_gpu(comm)
if comm.rank == 0:
    print("ranks share a GPU:", shared, "; CUDA-aware MPI:", mpi_cuda_aware())
for prefer in ("auto", "nccl", "staged", "cuda-aware"):
    if prefer == "cuda-aware" and not mpi_cuda_aware():
        continue
    if prefer == "nccl" and shared:
        continue  # NCCL refuses two ranks on one device; "auto" falls back (checked above)
    for dt in ("float32", "float64"):
        for m, n, k in ((1000, 777, 1301), (33, 2, 5000), (4096, 4096, 4096)):
            a = rng.standard_normal((m, k)).astype(dt); b = rng.standard_normal((k, n)).astype(dt)
            for grid in (None, (2, 1, 1)):
                g = make_grid(m, n, k, dt, ranks=comm.size, grid=grid if comm.size == 2 else None)
                c = MPIEngine(comm, comm_backend=prefer).run_distributed(
                    DistArray.from_array(a, comm), DistArray.from_array(b, comm), g, "cublas",
                    on_gpu=True)
                full = c.gather(root=None)
                ref = a.astype(np.float64) @ b.astype(np.float64)
                err = np.linalg.norm(full - ref) / np.linalg.norm(ref)
                if err > (1e-5 if dt == "float32" else 1e-12):
                    fails.append(f"{prefer} {dt} {m}x{n}x{k} grid {g.shape}: relerr {err}")
                if c.stats["bytes_received"] != c.stats["bytes_estimated"]:
                    fails.append(f"{prefer} bytes {c.stats}")
# cupy operands through the API
x = cupy.asarray(rng.standard_normal((300, 200))); y = cupy.asarray(rng.standard_normal((200, 100)))
z = distmm.matmul(x, y, engine="mpi")
if not isinstance(z, cupy.ndarray) or float(abs(z - x @ y).max()) > 1e-9:
    fails.append("cupy operands")
ok = comm.allreduce(0 if fails else 1, op=MPI.MIN) == 1
if comm.rank == 0:
    print("\n".join(fails)); print("VERDICT", "ok" if ok else "FAIL")
"""


def test_two_ranks_share_one_gpu(tmp_path, mpirun):
    script = tmp_path / "gpu_case.py"
    script.write_text(SCRIPT)
    r = mpirun(2, script, timeout=600)
    assert "VERDICT ok" in r.stdout, r.stdout[-5000:] + r.stderr[-5000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_repeated_products_reuse_the_grid_communicators(ranks, mpirun):
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    # one GPU: two ranks share it, as on a one-GPU machine
    r = mpirun(ranks, HERE / "mpi_reuse_cases.py", "gpu", timeout=300,
               env={"CUDA_VISIBLE_DEVICES": first})
    assert "VERDICT ok" in r.stdout, r.stdout[-5000:] + r.stderr[-5000:]
    assert "EXITED live=0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


def test_fingerprint_of_a_device_operand_is_its_host_copys():
    """The ranks compare operands by a sample of their elements (``agree.fingerprint``): a
    cupy operand's, gathered on its device, equals its numpy copy's, in any layout."""
    import cupy
    import numpy as np

    from distmm.engine.mpi.agree import fingerprint

    rng = np.random.default_rng()
    for shape, dt in [((300, 200), np.float32), ((3, 70, 50), np.float64),
                      ((5000, 3), np.complex64), ((7, 9), np.int8), ((40, 40), np.bool_)]:
        x = (rng.standard_normal(shape) * 10).astype(dt)
        g = cupy.asarray(x)
        for view in (lambda v: v, lambda v: v[..., ::2], lambda v: v.T):
            assert fingerprint(view(g)) == fingerprint(view(x))
