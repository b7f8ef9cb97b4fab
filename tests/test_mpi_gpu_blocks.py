"""DistArray with cupy blocks and the GPU binding, under ``mpiexec -n 2`` on a GPU.

``DistArray.from_local`` with cupy blocks (ragged, odd sizes) through ``distmm.matmul``
gives a DistArray whose local block is cupy and equals a float64 numpy product;
``DistArray.from_array`` of a cupy array keeps each rank's block as cupy, on the device;
mixing cupy and numpy blocks is refused on every rank. The binding: with two or more GPUs
visible the two ranks take distinct devices and nothing is printed; with one
(``CUDA_VISIBLE_DEVICES`` of one device) they share it and the job prints one warning.
Two ranks may share one GPU for the block tests.

Run on a GPU machine (the lead runs it on the device); skipped without a GPU.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent

BLOCKS_SCRIPT = r"""
import numpy as np, cupy
from mpi4py import MPI
import distmm
from distmm.engine.mpi import DistArray
from distmm.engine.mpi.gridcomms import local_gpu
from mpi_verdict import run_cases

comm = MPI.COMM_WORLD
failures = []
local_gpu(comm)  # each rank on its GPU before it makes blocks

def check(ok, what):
    if not ok:  # recorded, not raised: every rank goes on to the same collectives
        failures.append(f"rank {comm.rank}: {what}")

def from_local_blocks():
    rng = np.random.default_rng(11)  # the same on every rank: each takes its own rows
    for dt, tol in (("float64", 1e-12), ("float32", 1e-5)):
        for m, k, n in ((101, 77, 53), (33, 1000, 2), (1, 5, 7)):
            a = rng.standard_normal((m, k)).astype(dt)
            b = rng.standard_normal((k, n)).astype(dt)
            rows = np.linspace(0, m, comm.size + 1).astype(int)  # ragged when m is odd
            mine = slice(rows[comm.rank], rows[comm.rank + 1])
            da = DistArray.from_local(cupy.asarray(a[mine]), comm, grid=(comm.size, 1))
            check(isinstance(da.local, cupy.ndarray), f"from_local keeps a cupy block ({dt})")
            c = distmm.matmul(da, b)
            check(isinstance(c.local, cupy.ndarray),
                  f"{dt} {m}x{k}x{n}: result block is {type(c.local).__name__}")
            ref = a.astype(np.float64) @ b.astype(np.float64)
            r0, r1, c0, c1 = c.layout.local_bounds(comm.rank)
            got = cupy.asnumpy(c.local).astype(np.float64)
            want = ref[r0:r1, c0:c1]
            err = np.abs(got - want).max() / max(np.abs(ref).max(), 1e-300) if got.size else 0.0
            check(got.shape == want.shape and err <= tol,
                  f"{dt} {m}x{k}x{n}: block {got.shape} vs {want.shape}, relerr {err}")
            full = c.gather(root=None)
            rel = np.linalg.norm(full - ref) / np.linalg.norm(ref)
            check(isinstance(full, np.ndarray) and rel <= tol,
                  f"{dt} {m}x{k}x{n}: gathered, relerr {rel}")

def from_array_cupy():
    rng = np.random.default_rng(12)
    a = rng.standard_normal((65, 31))
    d = DistArray.from_array(cupy.asarray(a), comm)
    check(isinstance(d.local, cupy.ndarray), f"from_array block is {type(d.local).__name__}")
    check(d.local.device.id == cupy.cuda.Device().id, "from_array block on the rank's device")
    r0, r1, c0, c1 = d.layout.local_bounds(comm.rank)
    check(np.array_equal(cupy.asnumpy(d.local), a[r0:r1, c0:c1]), "from_array block values")
    b = rng.standard_normal((31, 9))
    c = distmm.matmul(d, DistArray.from_array(cupy.asarray(b), comm))
    check(isinstance(c.local, cupy.ndarray), "from_array product block is cupy")
    ref = a @ b
    rel = np.linalg.norm(c.gather(root=None) - ref) / np.linalg.norm(ref)
    check(rel <= 1e-12, f"from_array product: relerr {rel}")
    back = d.redistribute(type(d.layout).single(d.shape, 0))
    check(isinstance(back.local, cupy.ndarray), "redistribute keeps cupy blocks")
    g = d.gather(root=0)
    check(comm.rank != 0 or (isinstance(g, np.ndarray) and np.array_equal(g, a)), "gather to host")

def mixed_kinds_refused():
    block = np.ones((2, 3)) if comm.rank == 0 else cupy.ones((2, 3))
    try:
        DistArray.from_local(block, comm, grid=(comm.size, 1))
        check(False, "mixed cupy and numpy blocks accepted")
    except TypeError as exc:
        check("cupy arrays on ranks" in str(exc), f"message: {exc}")

ok, fails = run_cases(comm, [from_local_blocks, from_array_cupy, mixed_kinds_refused], failures)
if comm.rank == 0:
    print("\n".join(fails or []))
    print("VERDICT", "ok" if ok else "FAIL", flush=True)
"""

BIND_SCRIPT = r"""
import json
import cupy
from mpi4py import MPI
from distmm.engine.mpi.comm import select_local_gpu, shares_gpu
comm = MPI.COMM_WORLD
device = select_local_gpu(comm)
devices = comm.allgather((device, cupy.cuda.Device().id, cupy.cuda.runtime.getDeviceCount()))
if comm.rank == 0:
    print("DEVICES", json.dumps({"devices": devices, "shared": shares_gpu(comm)}), flush=True)
else:
    shares_gpu(comm)
"""


@pytest.fixture
def run_script(mpirun, tmp_path):
    """``run_script(script, name, env=None)``: the script under ``mpiexec -n 2``, with tests/
    importable (mpi_verdict) from where it is written."""

    def run(script, name, env=None):
        path = tmp_path / name
        path.write_text(script)
        extra = {"PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        return mpirun(2, path, timeout=600, env={**extra, **(env or {})})

    return run


def test_device_blocks_through_matmul(run_script):
    r = run_script(BLOCKS_SCRIPT, "blocks.py")
    assert "VERDICT ok" in r.stdout, r.stdout[-5000:] + r.stderr[-5000:]
    assert r.returncode == 0, r.stderr[-3000:]


def _devices(stdout: str):
    """Rank 0's report: [(chosen, current, visible count)] in rank order, and shares_gpu."""
    line = next(x for x in stdout.splitlines() if x.startswith("DEVICES "))
    report = json.loads(line.split(" ", 1)[1])
    return [tuple(d) for d in report["devices"]], report["shared"]


def test_binding_distinct_devices_when_two_are_visible(run_script):
    from distmm.engine.mpi.binding import visible_device_count

    if visible_device_count() < 2:
        pytest.skip("fewer than 2 GPUs visible")
    r = run_script(BIND_SCRIPT, "bind.py")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    devices, shared = _devices(r.stdout)
    assert sorted(d for d, _, _ in devices) == [0, 1], devices  # node-local ranks 0 and 1
    assert all(chosen == current for chosen, current, _ in devices), devices  # made current
    assert not shared
    assert "share GPUs" not in r.stderr, r.stderr[-3000:]


def test_binding_shares_one_gpu_with_one_warning(run_script):
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    r = run_script(BIND_SCRIPT, "bind1.py", env={"CUDA_VISIBLE_DEVICES": first})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    devices, shared = _devices(r.stdout)
    assert devices == [(0, 0, 1), (0, 0, 1)], devices
    assert shared
    warnings = [x for x in r.stderr.splitlines() if "ranks share GPUs round-robin" in x]
    assert len(warnings) == 1 and "2 ranks on 1 GPU" in warnings[0], r.stderr[-3000:]


BLIND_SCRIPT = r"""
import json, os
if os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK")) == "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before cupy: rank 1 sees no GPU
import numpy as np
from mpi4py import MPI
import distmm
from distmm.errors import BackendUnavailable
comm = MPI.COMM_WORLD
outcomes = []
for backend in ("cublas", "raw"):
    try:
        distmm.matmul(np.ones((64, 48)), np.ones((48, 32)), engine="mpi", backend=backend)
        outcomes.append([backend, "no error", ""])
    except Exception as exc:
        outcomes.append([backend, type(exc).__name__, str(exc)])
outcomes = comm.gather(outcomes, root=0)
if comm.rank == 0:
    print("OUTCOMES", json.dumps(outcomes), flush=True)
"""


def test_a_rank_without_a_gpu_is_backend_unavailable_on_every_rank(run_script):
    """cupy imports on both ranks but rank 1 sees no GPU: a GPU backend raises
    ``BackendUnavailable`` there (it was a bare RuntimeError), and rank 0 a one-line error
    that names rank 1; neither waits for the other."""
    r = run_script(BLIND_SCRIPT, "blind.py")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("OUTCOMES "))
    per_rank = json.loads(line.split(" ", 1)[1])
    for backend, kind, why in per_rank[1]:
        assert kind == "BackendUnavailable" and "\n" not in why, (backend, kind, why)
    for backend, kind, why in per_rank[0]:
        assert kind in ("BackendUnavailable", "ValueError") and "rank 1" in why, (backend, kind, why)
        assert "\n" not in why, why
