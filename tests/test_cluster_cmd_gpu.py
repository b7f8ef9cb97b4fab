"""``distmm cluster`` on a GPU machine: one dask-cuda worker per GPU, each on its own
device and carrying the ``GPU`` resource; a product through it from another process, by
the command line and by Python, checked against float64 numpy; SIGTERM closes it all."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")

pytestmark = pytest.mark.gpu

from conftest import assert_all_gone, assert_matches_numpy, serve_cluster, stop_cluster  # noqa: E402


def test_one_worker_per_gpu_and_a_product_through_it(tmp_path: Path):
    from distributed import Client

    import distmm
    from distmm.cli.cluster import local_gpus
    from distmm.engine.dask.workers import worker_info

    gpus = local_gpus()
    rng = np.random.default_rng()
    a = rng.standard_normal((1031, 517)).astype(np.float32)
    b = rng.standard_normal((517, 389)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    sched = tmp_path / "sched.json"
    proc = serve_cluster(sched, timeout=300)
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
        with Client(scheduler_file=str(sched), timeout=60) as client:
            info = client.scheduler_info(n_workers=-1)["workers"]
            assert len(info) == gpus
            assert all(w["resources"].get("GPU") == 1 for w in info.values()), info
            # distmm's own probe: the workers of distmm cluster cannot import this test module
            found = worker_info(client)
            assert all(w.cuda and w.device for w in found), found
            assert len({w.device for w in found}) == gpus, found
            got = distmm.matmul(a, b, client=client, engine="dask")
        r = subprocess.run([sys.executable, "-m", "distmm", "matmul", tmp_path / "a.npy",
                            tmp_path / "b.npy", "-o", tmp_path / "c.npy", "--scheduler-file", sched],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    except BaseException:
        stop_cluster(proc, None)
        raise
    status, out, err, _ = stop_cluster(proc, lambda p: p.send_signal(signal.SIGTERM))
    assert status == 143, err
    assert f"{gpus} GPU worker" in out, out
    assert err.strip().splitlines()[-1].startswith(f"distmm cluster: stopped by SIGTERM: {gpus} "), err
    assert not sched.exists()
    assert_matches_numpy(np.asarray(got), a, b)
    assert_matches_numpy(np.load(tmp_path / "c.npy"), a, b)
    assert_all_gone(workers)
