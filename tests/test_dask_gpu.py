"""The Dask engine on GPU workers (dask-cuda): tasks use the GPU executor."""
from __future__ import annotations

import numpy as np
import pytest

from test_api import assert_matches_numpy, random_array

cupy = pytest.importorskip("cupy")
dask_cuda = pytest.importorskip("dask_cuda")
try:
    _HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # pragma: no cover - depends on the machine
    _HAS_GPU = False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _HAS_GPU, reason="no CUDA GPU")]

import dask.array as da  # noqa: E402
from distributed import Client  # noqa: E402

import distmm  # noqa: E402


@pytest.fixture(scope="module")
def cuda_client():
    with dask_cuda.LocalCUDACluster(n_workers=1) as cluster, Client(cluster) as client:
        yield client


def _worker_ran_on_gpu(client) -> bool:
    from distmm.engine.dask import tasks as dask_tasks

    def used_gpu():
        return any(key[2] for key in dask_tasks._EXECUTORS)

    return all(client.run(used_gpu).values())


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "bool"])
def test_numpy_operands_on_gpu_workers(cuda_client, dtype):
    rng = np.random.default_rng()
    a = random_array(rng, (1000, 333), dtype)
    b = random_array(rng, (333, 517), dtype)
    got = distmm.matmul(a, b, client=cuda_client, tile=256)
    assert isinstance(got, np.ndarray)
    with np.errstate(over="ignore"):
        assert_matches_numpy(got, a, b)
    assert _worker_ran_on_gpu(cuda_client)


def test_cupy_chunks_give_a_lazy_cupy_result(cuda_client):
    rng = np.random.default_rng()
    a = random_array(rng, (700, 4097), np.float32)
    b = random_array(rng, (4097, 300), np.float32)
    x = da.from_array(cupy.asarray(a), chunks=(350, 1024), asarray=False)
    y = da.from_array(cupy.asarray(b), chunks=(1024, 150), asarray=False)
    lazy = distmm.matmul(x, y, client=cuda_client)
    assert isinstance(lazy, da.Array)
    got = lazy.compute()
    assert isinstance(got, cupy.ndarray)
    assert_matches_numpy(cupy.asnumpy(got), a, b)
