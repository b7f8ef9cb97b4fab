"""The Dask engine's block mode on a GPU machine (one GPU is enough).

Covers: a LocalCUDACluster of one worker (its block through the GPU
executor's stream pipeline, one task), two workers sharing the one GPU
(recognised by probing: one unit for numpy operands, two where each holds
half of A's rows), float32 and float64 products
against float64 references on odd sizes, dask operands keeping their chunks,
and a mixed cluster (a GPU worker beside a CPU worker that sees no device)
where GPU cells fail (a device budget too small for any tile, and the
``distmm-debug.fail-tiles`` key) and are rerun on the CPU worker.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
distributed = pytest.importorskip("distributed")

pytestmark = pytest.mark.gpu

import dask  # noqa: E402
import dask.array as da  # noqa: E402

import distmm  # noqa: E402
from distmm.engine.dask import last_stats  # noqa: E402


def _inputs(rng, m, k, n, dtype):
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _close(got, want, dtype):
    tol = 3e-4 if np.dtype(dtype) == np.float32 else 1e-11
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _ran_on_gpu(client, workers=None) -> dict:
    def used():
        from distmm.engine.dask import tasks

        return any(key[2] for key in tasks.executors_made())

    return client.run(used, workers=workers)


@pytest.fixture(scope="module")
def one_gpu():
    dask_cuda = pytest.importorskip("dask_cuda")
    with dask_cuda.LocalCUDACluster(n_workers=1, threads_per_worker=1) as cl, \
            distributed.Client(cl) as client:
        client.wait_for_workers(1, timeout=120)
        yield client


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_one_gpu_worker_runs_its_block_in_one_task(one_gpu, dtype):
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 3001, 2049, 2999, dtype)
    got = distmm.matmul(a, b, client=one_gpu)
    _close(got, want, dtype)
    stats = last_stats()
    assert stats["mode"] == "blocks"
    assert [u["gpu"] for u in stats["units"]] == [True]
    assert stats["tasks"] == 1 and stats["moved"] == []
    assert all(_ran_on_gpu(one_gpu).values())


def test_one_gpu_worker_with_dask_operands(one_gpu):
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 2500, 1999, 1777, "float32")
    A = da.from_array(a, chunks=(1000, 1024)).persist()
    B = da.from_array(b, chunks=(1024, 700)).persist()
    C = distmm.matmul(A, B, client=one_gpu)
    assert C.chunks == (A @ B).chunks
    _close(C.compute(), want, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_device_chunks_ragged_along_k_add_into_one_block(one_gpu, dtype):
    """cupy chunks cut unevenly along k: the block's k pieces are copied on a second stream
    while the previous piece multiplies, each GEMM adding into the one block; float64-close
    on odd sizes, with a k chunk shorter than the k-block (joined to its neighbour)."""
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 2501, 2548, 1777, dtype)
    ks = (700, 513, 1024, 300, 11)
    A = da.from_array(a, chunks=((1200, 1301), ks)).map_blocks(cupy.asarray).persist()
    B = da.from_array(b, chunks=(ks, (900, 877))).map_blocks(cupy.asarray).persist()
    C = distmm.matmul(A, B, client=one_gpu)
    got = C.compute()
    assert isinstance(got, cupy.ndarray)
    _close(cupy.asnumpy(got), want, dtype)
    assert last_stats()["mode"] == "blocks"


@pytest.mark.parametrize("kind", ["cupy", "cupy-numpy", "cupy-out"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_cupy_operands_with_a_client_give_cupy(one_gpu, kind, dtype):
    """cupy arrays of this process's GPU with a client (the cluster's engine): their blocks
    go to the workers, C comes back as a cupy array (or fills a cupy out=); a numpy partner
    makes the product cupy, as on one GPU. Before: numpy's refusal of cupy's implicit
    conversion (TypeError) from the engine."""
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 301, 257, 199, "float32" if dtype == "int32" else dtype)
    if dtype == "int32":
        a, b = (rng.integers(-100, 100, x.shape).astype(np.int32) for x in (a, b))
        want = a @ b
    A = cupy.asarray(a)
    B = b if kind == "cupy-numpy" else cupy.asarray(b)
    if kind == "cupy-out":
        out = cupy.full(want.shape, -7, dtype=dtype)
        got = distmm.matmul(A, B, out=out, client=one_gpu)
        assert got is out
    else:
        got = distmm.matmul(A, B, client=one_gpu)
    assert isinstance(got, cupy.ndarray)
    if dtype == "int32":
        np.testing.assert_array_equal(cupy.asnumpy(got), want)
    else:
        _close(cupy.asnumpy(got), want, dtype)


@pytest.mark.parametrize("which", ["a", "b"])
def test_dask_operands_with_cupy_and_numpy_chunks_multiply_on_the_device(one_gpu, which):
    """One dask operand of cupy chunks, the other of numpy chunks (or a numpy or cupy
    array beside a dask one): the host chunks go to the device, the product's chunks are
    cupy. Before: cupy's error filling a cupy panel from a numpy chunk, or numpy's refusal
    of a cupy chunk."""
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 513, 700, 311, "float32")
    A = da.from_array(a, chunks=((200, 313), (300, 400)))
    B = da.from_array(b, chunks=((300, 400), (111, 200)))
    if which == "a":
        A = A.map_blocks(cupy.asarray)
    else:
        B = B.map_blocks(cupy.asarray)
    for x, y in ((A, B), (A, cupy.asarray(b)) if which == "a" else (cupy.asarray(a), B),
                 (a, B) if which == "b" else (A, b)):
        got = distmm.matmul(x, y, client=one_gpu).compute()
        assert isinstance(got, cupy.ndarray)
        _close(cupy.asnumpy(got), want, "float32")


def _sharing_cluster(form: str):
    """Two worker processes on the one GPU: dask-cuda's own form (a repeated
    device), or a LocalCluster whose workers declare GPU=1."""
    if form == "dask-cuda":
        dask_cuda = pytest.importorskip("dask_cuda")
        return dask_cuda.LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,0", threads_per_worker=1)
    return distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                    dashboard_address=":0", resources={"GPU": 1})


@pytest.mark.parametrize("form", ["resources", "dask-cuda"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_two_workers_sharing_the_gpu(dtype, form):
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 4097, 3001, 3999, dtype)
    try:
        cl = _sharing_cluster(form)
    except Exception as exc:  # dask-cuda refusing a repeated device: the other form covers it
        pytest.skip(f"{form}: two workers on device 0 refused: {exc!r}")
    with cl, distributed.Client(cl) as client:
        try:
            client.wait_for_workers(2, timeout=120)
        except TimeoutError:
            if form == "dask-cuda":
                pytest.skip("dask-cuda did not start two workers on device 0")
            raise
        got = distmm.matmul(a, b, client=client)
        stats = last_stats()
        flags = _ran_on_gpu(client)
    _close(got, want, dtype)
    assert stats["mode"] == "blocks" and stats["moved"] == []
    # numpy operands: one unit for the shared device scatters A and B once
    # (two would scatter one of them twice), so one worker runs everything
    assert stats["locality"]["colocated"]["chosen"] == "one unit per device", stats["locality"]
    assert [(u["gpu"], u["share"]) for u in stats["units"]] == [(True, 1.0)]
    assert sorted(flags.values()) == [False, True]


def test_two_workers_sharing_the_gpu_keep_the_rows_they_hold():
    """Each worker holds half of A's rows (dask operands persisted per
    worker): two units, each on its own rows, move less than one unit would;
    on the device, same bits as the tolerance allows against float64."""
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 4096, 3001, 1500, "float32")
    with _sharing_cluster("resources") as cl, distributed.Client(cl) as client:
        client.wait_for_workers(2, timeout=120)
        w0, w1 = sorted(client.scheduler_info(n_workers=-1)["workers"])
        halves = [client.persist(da.from_array(a[:2048], chunks=-1), workers=[w1]),
                  client.persist(da.from_array(a[2048:], chunks=-1), workers=[w0])]
        A = client.persist(da.concatenate(halves))
        B = client.persist(da.from_array(b, chunks=(1501, -1)))
        distributed.wait([A, B])
        C = distmm.matmul(A, B, client=client)
        stats = last_stats()
        got = C.compute()
        flags = _ran_on_gpu(client)
    _close(got, want, "float32")
    loc = stats["locality"]
    assert loc["colocated"]["chosen"] == "one unit per worker", loc
    assert loc["estimated_bytes"] <= loc["naive_bytes"]
    assert {u["address"]: u["block"][:2] for u in stats["units"]} == {w1: (0, 2048), w0: (2048, 4096)}
    assert all(flags.values()) and len(flags) == 2


def _gpu_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # pragma: no cover - depends on the machine
        return 0


@pytest.mark.skipif(_gpu_count() < 2, reason="fewer than two GPUs")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_two_gpus_each_run_their_own_block(dtype):
    """A LocalCUDACluster of one worker per GPU: numpy operands give one unit per device,
    each worker runs its block on its own GPU, the rows of C are split between them, and
    the result is float64-close."""
    dask_cuda = pytest.importorskip("dask_cuda")
    rng = np.random.default_rng()
    a, b, want = _inputs(rng, 4099, 3001, 3997, dtype)
    with dask_cuda.LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,1", threads_per_worker=1) as cl, \
            distributed.Client(cl) as client:
        client.wait_for_workers(2, timeout=120)
        got = distmm.matmul(a, b, client=client)
        stats = last_stats()
        flags = _ran_on_gpu(client)
        buses = client.run(lambda: cupy.cuda.Device().pci_bus_id)
    _close(got, want, dtype)
    assert len(set(buses.values())) == 2, buses  # each worker on a GPU of its own
    assert stats["mode"] == "blocks" and stats["moved"] == []
    units = stats["units"]
    assert len(units) == 2 and all(u["gpu"] for u in units), units
    assert {u["address"] for u in units} == set(buses), units
    assert all(flags.values()) and len(flags) == 2
    area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in (u["block"] for u in units))
    assert area == got.size and units[0]["block"] != units[1]["block"], units  # C, tiled once


def _mixed_cluster(gpu_config=None):
    """A GPU worker and a CPU worker (CUDA_VISIBLE_DEVICES empty: its probe finds no device)."""
    cl = distributed.LocalCluster(n_workers=0, threads_per_worker=1, processes=True,
                                  dashboard_address=":0")
    gpu_opts = {"nthreads": 1}
    if gpu_config:
        gpu_opts["config"] = gpu_config
    cl.worker_spec["gpu"] = {"cls": distributed.Nanny, "options": gpu_opts}
    cl.worker_spec["cpu"] = {"cls": distributed.Nanny,
                             "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": ""}}}
    cl.sync(cl._correct_state)
    return cl


def test_the_probe_of_a_worker_without_a_device_never_imports_cupy():
    """CUDA_VISIBLE_DEVICES empty: the driver shows no device, so the probe calls the
    worker a CPU worker without importing cupy (15 CPU workers importing it made a
    mixed cluster's first product about 0.15 s slower); with the GPU visible it finds it."""
    import os
    import subprocess
    import sys

    code = ("import sys; from distmm.engine.dask.workers import _driver_devices, probe; "
            "got = probe(); print(_driver_devices(), got['cuda'], got['device'] is not None, "
            "'cupy' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    hidden = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**env, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert hidden.stdout.split() == ["0", "False", "False", "False"], hidden.stderr
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    count, cuda, device, imported = seen.stdout.split()
    assert int(count) >= 1 and (cuda, device, imported) == ("True", "True", "True"), seen


def test_the_probe_answers_first_and_measures_the_gpu_on_a_thread():
    """A GPU worker's first probe returns without a GPU rate (``rate_pending``) and starts
    the warm-up on a thread: later probes in the same process give the measured rate, and
    by then the block tasks' modules are imported."""
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from distmm.engine.dask.workers import probe\n"
            "first = got = probe()\n"
            "t = time.time()\n"
            "while got['gpu_gflops'] is None and got['rate_pending'] and time.time() - t < 90:\n"
            "    time.sleep(0.05)\n"
            "    got = probe()\n"
            "print(first['cuda'], first['rate_pending'] or first['gpu_gflops'] is not None,\n"
            "      (got['gpu_gflops'] or 0) > 100, got['rate_pending'],\n"
            "      'distmm.engine.dask.blocks' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180)
    assert done.stdout.split() == ["True", "True", "True", "False", "True"], done.stderr


def _fill_device(client, address):
    """Take all but a few MiB of the worker's device (a real cudaMalloc, outside cupy's
    pool), as another process filling the GPU would. Returns the bytes taken."""

    def fill(dask_worker=None):
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        free = cupy.cuda.runtime.memGetInfo()[0]
        for leave in (4 << 20, 16 << 20, 64 << 20):
            try:
                dask_worker._distmm_test_hog = cupy.cuda.runtime.malloc(free - leave)
                return free - leave
            except cupy.cuda.runtime.CUDARuntimeError:
                continue
        return 0

    return client.run(fill, workers=[address])[address]


def _free_device(client, address):
    def free(dask_worker=None):
        import cupy

        ptr = getattr(dask_worker, "_distmm_test_hog", None)
        if ptr:
            cupy.cuda.runtime.free(ptr)
            dask_worker._distmm_test_hog = None

    client.run(free, workers=[address])


@pytest.mark.parametrize("how", ["device-budget", "fail-tiles", "device-full"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_failed_gpu_blocks_fall_back_to_the_cpu_worker(how, dtype, caplog):
    """``device-full``: the GPU worker's device really is out of memory (all but a few MiB
    taken by a cudaMalloc before the product, far less than its 3001 x 2049 x 2999 block)."""
    rng = np.random.default_rng()
    shape = (3001, 2049, 2999) if how == "device-full" else (1031, 777, 1029)
    a, b, want = _inputs(rng, *shape, dtype)
    # a device budget far below one 64 x 64 tile: the pipeline raises MemoryError
    gpu_config = {"distmm": {"device-memory-limit": 4096}} if how == "device-budget" else None
    debug = {"distmm-debug.fail-tiles": [[0, 0]]} if how == "fail-tiles" else {}
    with _mixed_cluster(gpu_config) as cl, distributed.Client(cl) as client:
        client.wait_for_workers(2, timeout=120)
        gpu_addr = next(a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
                        if w.get("name") == "gpu")
        try:
            if how == "device-full":
                assert _fill_device(client, gpu_addr) > 0
            with dask.config.set({"distmm.dask-worker-gflops": {"gpu": 1e6, "cpu": 1.0},
                                  **debug}), \
                    caplog.at_level(logging.WARNING, logger="distmm.engine.dask"):
                got = distmm.matmul(a, b, client=client)
            stats = last_stats()
        finally:
            if how == "device-full":
                _free_device(client, gpu_addr)
    _close(got, want, dtype)
    kinds = sorted(u["gpu"] for u in stats["units"])
    assert kinds == [False, True]
    assert stats["moved"], stats
    assert "moved to CPU workers" in caplog.text and "(0, 0) rows 0:" in caplog.text
