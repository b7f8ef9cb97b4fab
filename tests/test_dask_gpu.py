"""The Dask engine on GPU workers (dask-cuda): tasks use the GPU executor."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
dask_cuda = pytest.importorskip("dask_cuda")

pytestmark = pytest.mark.gpu

import dask.array as da  # noqa: E402
import distributed  # noqa: E402
from distributed import Client  # noqa: E402

import distmm  # noqa: E402
from distmm.engine.dask import last_stats  # noqa: E402
from conftest import assert_matches_numpy, kill_workers, random_array, start_call  # noqa: E402


@pytest.fixture(scope="module")
def cuda_client():
    with dask_cuda.LocalCUDACluster(n_workers=1) as cluster, Client(cluster) as client:
        yield client


def _used_gpu() -> bool:
    from distmm.engine.dask import tasks as dask_tasks

    return any(key[2] for key in dask_tasks.executors_made())


def _worker_ran_on_gpu(client) -> bool:
    """Whether every worker has run a task on its GPU executor."""
    return all(client.run(_used_gpu).values())


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


# -- the clusters the benchmark and the demo start (distmm.cli.cluster) -----------------------
# Written for a machine with one GPU: the "shared" cluster puts two dask-cuda workers on GPU 0.


def _device_identity():
    import os

    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return os.environ.get("CUDA_VISIBLE_DEVICES"), props["pciBusID"], props["pciDeviceID"]


def test_two_workers_sharing_one_gpu_give_the_product(shared_client):
    from distmm.cli.cluster import GPU_RESOURCE, random_array as cluster_random
    from distmm.cli.cluster import to_host

    client = shared_client
    seen = client.run(_device_identity)
    assert len(seen) == 2 and len(set(seen.values())) == 1, seen  # one GPU, both workers
    assert next(iter(seen.values()))[0] == "0"
    info = client.scheduler_info(n_workers=-1)["workers"]
    assert len(info) == 2 and all(w["resources"].get(GPU_RESOURCE) == 1 for w in info.values())
    rng = np.random.default_rng()
    for dtype in ("float32", "float64"):
        a = random_array(rng, (1531, 1283), dtype)
        b = random_array(rng, (1283, 1009), dtype)
        got = distmm.matmul(a, b, client=client, tile=256)  # numpy operands: eager path
        assert isinstance(got, np.ndarray)
        assert_matches_numpy(got, a, b)
        # scattered from the client, the operands move fewest bytes to one unit for the
        # device (distmm/plan_blocks.py): one of the two workers runs it, on the GPU
        stats = last_stats()
        assert stats["locality"]["colocated"]["chosen"] == "one unit per device", stats["locality"]
        assert [u["gpu"] for u in stats["units"]] == [True]
    assert client.run(_used_gpu)[stats["units"][0]["address"]] is True
    # the benchmark's operands: made on the workers (cupy chunks), product kept lazy there
    seed = int(rng.integers(1 << 30)) * 2
    A = cluster_random((1531, 1283), 512, "float32", seed=seed, gpu=True)
    B = cluster_random((1283, 1009), 400, "float32", seed=seed + 1, gpu=True)
    A, B = client.persist([A, B])
    distributed.wait([A, B])
    holders = {w for ws in client.who_has([A, B]).values() for w in ws}
    C = distmm.matmul(A, B, client=client)
    assert isinstance(C, da.Array)
    a_h, b_h, got = client.compute([to_host(A), to_host(B), to_host(C)], sync=True)
    assert isinstance(got, np.ndarray) and got.shape == (1531, 1009)
    assert not np.array_equal(a_h[:512], a_h[512:1024])  # chunks seeded apart
    assert_matches_numpy(got, a_h, b_h)
    assert holders and holders <= set(info)  # the operands live on the workers


def test_gpu_worker_killed_mid_run_gives_the_same_bits(shared_client):
    """SIGKILL to one of the two GPU worker processes while the product runs: the nanny
    starts a new one, lost tiles are computed again, and C is bitwise the undisturbed C."""
    import time

    client = shared_client
    rng = np.random.default_rng()
    for rows in (3001, 6007, 12011):  # larger when the product ended before the kill
        client.wait_for_workers(2, timeout=120)
        time.sleep(1.0)  # a replacement worker finishes starting
        a = rng.standard_normal((rows, 4099)).astype(np.float32)
        b = rng.standard_normal((4099, 2999)).astype(np.float32)
        undisturbed = distmm.matmul(a, b, client=client, tile=256)
        assert_matches_numpy(undisturbed, a, b)
        thread, out = start_call(distmm.matmul, a, b, client=client, tile=256)
        try:
            killed = kill_workers(client, thread, kills=1, gap=0.05)
        finally:
            thread.join(300)
        assert not thread.is_alive()
        assert "error" not in out, f"the run raised instead of retrying: {out.get('error')!r}"
        if killed:
            assert np.array_equal(out["c"], undisturbed), "bits differ after the kill"
            return
    pytest.fail("every product ended before the worker was killed")


def test_demo_on_a_gpu_machine_prints_the_gpu_figure_beside_cublas():
    import os
    import re
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "distmm", "demo", "-n", "3001", "--dtype",
                        "float32"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ))
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert re.search(r"embedded LocalCUDACluster: \d+ GPU worker\(s\) on \S", out), out
    assert "embedded LocalCluster:" not in out  # no CPU run
    ours = re.search(r"distmm \(dask engine, \d+ GPU worker\(s\)\): time ([\d.e+-]+) s, "
                     r"([\d.]+) TFLOP/s", out)
    theirs = re.search(r"cuBLAS in-core \(cupy\.matmul, 1 GPU\): time ([\d.e+-]+) s, "
                       r"([\d.]+) TFLOP/s; distmm / cuBLAS ([\d.]+)", out)
    assert ours and theirs, out
    assert float(ours.group(1)) > 0 and float(ours.group(2)) > 0
    assert float(theirs.group(1)) > 0 and float(theirs.group(2)) > 0
    assert float(theirs.group(3)) > 0
    assert re.search(r"relative error vs float64 numpy \S+: OK", out), out


def test_dask_gpu_benchmark_writes_checked_records(tmp_path):
    """bench/dask_gpu.py on this GPU, small: 1gpu and shared settings, every variant
    checked and recorded (the benchmark exits 1 on a wrong or failed variant)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "dask_gpu.py").is_file():
        pytest.skip("bench/ is not beside this tests/ folder")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "bench.dask_gpu", "--settings", "1gpu", "shared",
                        "--sizes", "2049", "--chunks", "1024", "512", "--rounds", "2",
                        "--out-dir", str(tmp_path)], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (path,) = tmp_path.glob("dask-gpu-*.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    got = {(rec["setting"], rec["variant"], rec["dtype"]) for rec in recs}
    variants = ["distmm-dask", "dask.array-chunk1024", "dask.array-chunk512"]
    want = set()
    for setting, suffix in (("1gpu", ""), ("shared", "@shared")):
        for dtype in ("float32", "float64"):
            want |= {(setting, v + suffix, dtype) for v in variants} | {(setting, "cublas", dtype)}
    assert got == want
    for rec in recs:
        assert rec["benchmark"] == "dask-gpu" and rec["gpus"] == 1 and rec["gpus_visible"] >= 1
        assert rec["m"] == rec["n"] == rec["k"] == 2049 and rec["seconds"] > 0
        assert rec["relerr"] < (1e-4 if rec["dtype"] == "float32" else 1e-10)
        assert rec["checked_rows"] == 64 and rec["first_seconds"] > 0
        if rec["variant"] != "cublas":
            assert len(rec["all_seconds"]) == 2 and rec["ratio_to_cublas"] > 0
            assert rec["workers"] == rec["gpu_workers"] == (2 if rec["setting"] == "shared" else 1)


def test_a_ucx_cluster_moves_device_chunks_and_gives_the_product():
    """``gpu_cluster(protocol="ucx")`` where distributed-ucxx is installed: the workers talk
    UCX, and a product of cupy chunks persisted on two workers sharing GPU 0 gives the
    float64 reference's result, with distmm's CUDA IPC route (``auto``) and with the
    chunks moved by dask itself over UCX (``tcp``: no IPC exports), bit for bit the same."""
    pytest.importorskip("distributed_ucxx")
    import dask

    from distmm.cli.cluster import gpu_cluster, gpu_protocol, random_array as cluster_random
    from distmm.cli.cluster import to_host

    assert gpu_protocol("auto") == "ucx"
    rng = np.random.default_rng()
    with gpu_cluster("0", per_device=2, protocol="ucx") as cluster, Client(cluster) as client:
        addresses = list(client.scheduler_info(n_workers=-1)["workers"])
        assert len(addresses) == 2 and all(a.startswith("ucx://") for a in addresses), addresses
        seed = int(rng.integers(1 << 30)) * 2
        A = cluster_random((2053, 1531), 512, "float32", seed=seed, gpu=True)
        B = cluster_random((1531, 1777), 512, "float32", seed=seed + 1, gpu=True)
        A, B = client.persist([A, B])
        distributed.wait([A, B])
        a_h, b_h = client.compute([to_host(A), to_host(B)], sync=True)
        got = {}
        for mode in ("auto", "tcp"):
            with dask.config.set({"distmm.dask-device-transfer": mode}):
                C = distmm.matmul(A, B, client=client)
                got[mode] = client.compute(to_host(C), sync=True)
            stats = last_stats()
            assert stats["mode"] == "blocks"
            if mode == "tcp":
                assert stats["transfer"]["exports"] == 0
        assert_matches_numpy(got["auto"], a_h, b_h)
        assert np.array_equal(got["auto"], got["tcp"])
