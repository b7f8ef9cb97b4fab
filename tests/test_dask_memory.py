"""The Dask engine on workers with memory limits that dask.array's ``A @ B``
survives, on real LocalClusters of worker processes.

Covers: the memory budget the engine gives the planner from the workers'
``memory_limit``; a float64 product that leaves numba unimported on the
workers (importing numba and compiling one kernel took a process from 58 to
170 MiB peak RSS); 1 GiB workers with dask operands; 256 MiB workers with two
162 MiB zarr operands, read eagerly and as a lazy product written to zarr, as
dask.array's ``(A @ B).to_zarr`` is; 600 MiB workers reading a 320 MB ``.npy`` operand.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

import distmm  # noqa: E402
from distmm.engine import get_engine  # noqa: E402
from distmm.engine.dask import MEMORY_FRACTION  # noqa: E402
from distmm.api import _validate  # noqa: E402


pytestmark = pytest.mark.usefixtures("tile_mode")


def _cluster(limit: str):
    return distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                    dashboard_address=":0", memory_limit=limit)


def _numba_on_workers(client) -> bool:
    return any(client.run(lambda: "numba" in sys.modules).values())


@pytest.mark.slow
def test_one_gib_workers(tmp_path):
    rng = np.random.default_rng(8)
    a = rng.standard_normal((4096, 4096))
    b = rng.standard_normal((4096, 4096))
    want = a @ b
    with _cluster("1GiB") as cl, distributed.Client(cl) as client:
        engine = get_engine("dask", client=client)
        hints = engine.plan_hints(_validate(a, b), 2)
        assert hints["memory_budget"] == int(2**30 * MEMORY_FRACTION)
        A = da.from_array(a, chunks=1024)
        B = da.from_array(b, chunks=1024)
        np.testing.assert_allclose((A @ B).compute(), want, rtol=1e-10, atol=1e-9)
        np.testing.assert_allclose(distmm.matmul(A, B, client=client).compute(), want,
                                   rtol=1e-10, atol=1e-9)
        assert not _numba_on_workers(client)


@pytest.mark.slow
def test_256_mib_workers_with_zarr_operands(tmp_path):
    n = 4608  # 162 MiB per operand, more than half of what a worker may hold
    rng = np.random.default_rng(9)
    a = rng.standard_normal((n, n))
    b = rng.standard_normal((n, n))
    za = zarr.open_array(str(tmp_path / "a.zarr"), mode="w", shape=(n, n), chunks=(1024, 1024), dtype="f8")
    zb = zarr.open_array(str(tmp_path / "b.zarr"), mode="w", shape=(n, n), chunks=(1024, 1024), dtype="f8")
    za[:], zb[:] = a, b
    want = a @ b
    with _cluster("256MiB") as cl, distributed.Client(cl) as client:
        A, B = da.from_zarr(str(tmp_path / "a.zarr")), da.from_zarr(str(tmp_path / "b.zarr"))
        (A @ B).to_zarr(str(tmp_path / "ref.zarr"))  # dask.array survives this
        distmm.matmul(A, B, client=client).to_zarr(str(tmp_path / "c.zarr"))
        got = zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[:]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-9)
        np.testing.assert_allclose(distmm.matmul(za, zb, client=client), want, rtol=1e-10, atol=1e-9)
        assert not _numba_on_workers(client)


@pytest.mark.slow
def test_600_mib_workers_reading_a_320_mb_npy_operand(tmp_path):
    """The workers read a .npy operand of more than half their memory each: its pages must
    not stay in their RSS (they did, through a map kept open: both workers paused at 80% of
    their memory_limit and the product waited for ever)."""
    import threading

    m, k = 4000, 10000  # 320 MB
    a = np.lib.format.open_memmap(tmp_path / "a.npy", mode="w+", dtype="f8", shape=(m, k))
    for r in range(0, m, 500):
        a[r:r + 500] = np.random.default_rng(r).standard_normal((500, k))
    a.flush()
    b = np.random.default_rng(1).standard_normal((k, 8))
    got = []
    with _cluster("600MiB") as cl, distributed.Client(cl) as client:
        am = np.load(tmp_path / "a.npy", mmap_mode="r")
        run = threading.Thread(target=lambda: got.append(distmm.matmul(am, b, client=client)),
                               daemon=True)
        run.start()
        run.join(120)
        assert got, "the product did not finish in 120 s"
        np.testing.assert_allclose(got[0], np.asarray(am) @ b, rtol=1e-10, atol=1e-9)

def test_float64_products_leave_numba_unimported():
    """BLAS products never import numba: in a fresh process, only the
    integer product (numba's kernels: 700^3 is past AUTO_LOOP_FLOPS) does."""
    import subprocess

    code = ("import sys, numpy as np, distmm\n"
            "distmm.matmul(np.ones((300, 300)), np.ones((300, 300)), engine='local', tile=100)\n"
            "print('numba' in sys.modules)\n"
            "distmm.matmul(np.ones((700, 700), np.int64), np.ones((700, 700), np.int64), engine='local')\n"
            "print('numba' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(distmm.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.split() == ["False", "True"]


def test_numba_dtypes_match_the_kernels():
    from distmm.executor.cpu import NUMBA_DTYPES
    from distmm.kernels import numba_gemm

    assert NUMBA_DTYPES == numba_gemm.SUPPORTED
