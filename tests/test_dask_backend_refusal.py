"""A GPU backend (``raw``, ``cublas``) on a Dask cluster whose workers have no GPU is refused
before any work: ``BackendUnavailable`` (as the local and MPI engines refuse one), one line
naming the backend, and no task, scatter or transition on the scheduler or a worker. It
was refused only by the first task that failed on a worker, after the graph was sent."""
from __future__ import annotations

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import dask.array as da  # noqa: E402
import dask.config  # noqa: E402

import distmm  # noqa: E402
from distmm.errors import BackendUnavailable  # noqa: E402
from conftest import run_cli  # noqa: E402


@pytest.fixture(autouse=True)
def _no_gpu_workers(client):
    """The module's cluster is CPU workers: skip where one of them sees a GPU."""
    from distmm.executor import gpu_available

    if any(client.run(gpu_available).values()):
        pytest.skip("a worker of this cluster has a GPU")


def _transitions(client) -> tuple:
    """The scheduler's task transitions so far and each worker's: any task made, scattered,
    run or released moves one of them."""
    sched = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter)
    workers = client.run(lambda dask_worker: dask_worker.state.transition_counter)
    return sched, tuple(sorted(workers.items()))


def _operands(kind: str, rng):
    """Odd-sized float64 operands: numpy, dask (lazy), or a numpy stack (tile mode)."""
    if kind == "stack":
        return rng.standard_normal((3, 37, 29)), rng.standard_normal((3, 29, 41))
    a, b = rng.standard_normal((37, 29)), rng.standard_normal((29, 41))
    if kind == "dask":
        return da.from_array(a, chunks=(19, 15)), da.from_array(b, chunks=(15, 21))
    return a, b


@pytest.mark.parametrize("layout", ["auto", "tiles", "blocks"])
@pytest.mark.parametrize("kind", ["numpy", "dask", "stack"])
@pytest.mark.parametrize("backend", ["raw", "cublas"])
@pytest.mark.slow
def test_gpu_backend_on_cpu_workers_is_refused_before_any_work(client, backend, kind, layout):
    a, b = _operands(kind, np.random.default_rng())
    before = _transitions(client)
    with dask.config.set({"distmm.dask-layout": layout}), \
            pytest.raises(BackendUnavailable) as err:
        distmm.matmul(a, b, engine="dask", client=client, backend=backend)
    assert _transitions(client) == before  # nothing was sent, so no task ran
    line = str(err.value)
    assert "\n" not in line and f"backend {backend!r}" in line, line
    assert "none of the Dask cluster's 2 workers has one" in line, line


def test_configured_gpu_backend_is_refused_too(client):
    """``distmm.backend: raw`` stands for ``backend='auto'`` with host operands."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((23, 17)), rng.standard_normal((17, 9))
    before = _transitions(client)
    with dask.config.set({"distmm.backend": "raw"}), \
            pytest.raises(BackendUnavailable, match="backend 'raw' needs cupy"):
        distmm.matmul(a, b, engine="dask", client=client)
    assert _transitions(client) == before


@pytest.mark.parametrize("layout", ["auto", "tiles"])
@pytest.mark.parametrize("kind", ["numpy", "dask", "stack"])
@pytest.mark.parametrize("backend", ["auto", "numba", "blas"])
@pytest.mark.slow
def test_cpu_and_auto_backends_still_run(client, backend, kind, layout):
    rng = np.random.default_rng()
    a, b = _operands(kind, rng)
    with dask.config.set({"distmm.dask-layout": layout}):
        got = distmm.matmul(a, b, engine="dask", client=client, backend=backend)
        got = got.compute() if kind == "dask" else got
    want = np.matmul(np.asarray(a), np.asarray(b))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_cpu_backend_asks_the_workers_nothing_in_tile_mode(client, monkeypatch):
    """Only a GPU backend probes the workers where tile mode would not: no round trip."""
    from distmm.engine.dask import workers

    def refuse(*args, **kwargs):
        raise AssertionError("the workers were probed")

    monkeypatch.setattr(workers, "worker_info", refuse)
    rng = np.random.default_rng()
    a, b = rng.standard_normal((21, 13)), rng.standard_normal((13, 11))
    with dask.config.set({"distmm.dask-layout": "tiles"}):
        got = distmm.matmul(a, b, engine="dask", client=client, backend="auto")
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


def test_a_mixed_cluster_is_refused_in_tile_mode_and_runs_in_block_mode(client, monkeypatch):
    """One worker with a device (as its probe would say), one without: tile mode sends tiles
    to both, so the GPU backend is refused naming the one without; block mode gives the CPU
    worker CPU blocks, so the product runs."""
    from distmm.engine.dask import workers

    gpu, cpu = sorted(client.scheduler_info(n_workers=-1)["workers"])
    monkeypatch.setattr(workers, "found_devices", lambda addresses, info: {gpu: True, cpu: False})
    rng = np.random.default_rng()
    a, b = rng.standard_normal((31, 19)), rng.standard_normal((19, 27))
    before = _transitions(client)
    with dask.config.set({"distmm.dask-layout": "tiles"}), \
            pytest.raises(BackendUnavailable) as err:
        distmm.matmul(a, b, engine="dask", client=client, backend="raw")
    assert f"1 of the cluster's 2 workers have none ({cpu})" in str(err.value)
    assert _transitions(client) == before
    with dask.config.set({"distmm.dask-layout": "blocks"}):
        got = distmm.matmul(a, b, engine="dask", client=client, backend="raw")
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_command_line_refuses_before_any_work(client, tmp_path):
    """``distmm matmul --scheduler ADDRESS --backend raw``: one line, status 2, no output and
    nothing staged beside it, and no task on the cluster."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((37, 29)))
    np.save(tmp_path / "b.npy", rng.standard_normal((29, 41)))
    before = _transitions(client)
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                "--engine", "dask", "--scheduler", client.scheduler.address, "--backend", "raw",
                timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert _transitions(client) == before
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("distmm matmul: error: backend 'raw' needs cupy"), r.stderr
    assert "none of the Dask cluster's 2 workers has one" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]
