"""``distmm demo``: multiply random matrices, check against numpy, report speed.

With ``engine="auto"`` it starts an embedded ``distributed.LocalCluster``
(one single-thread worker process per core) and runs the Dask engine on it;
``engine="local"`` runs the in-process engine.
"""
from __future__ import annotations

import importlib.util
import time

import numpy as np


def _dask_engine_ready() -> bool:
    return importlib.util.find_spec("distmm.engine.dask") is not None


def run_demo(*, n: int, dtype: str, engine: str, workers: int | None, backend: str, distmm,
             report: str | None = None, progress: bool | None = None) -> int:
    from distmm.engine.local import default_workers
    from distmm.plan import result_dtype

    rng = np.random.default_rng()
    dt = np.dtype(dtype)
    result_dtype(dt, dt)  # TypeError for non-numeric dtypes before any work
    if dt.kind in "iu":
        a = rng.integers(-100, 100, size=(n, n)).astype(dt)
        b = rng.integers(-100, 100, size=(n, n)).astype(dt)
    else:
        a = rng.standard_normal((n, n)).astype(dt)
        b = rng.standard_normal((n, n)).astype(dt)
    workers = workers or default_workers()
    use_cluster = engine == "dask" or (engine == "auto" and _dask_engine_ready())
    cluster = client = None
    try:
        if use_cluster:
            from distributed import Client, LocalCluster

            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                   dashboard_address=":0")
            client = Client(cluster)
            print(f"embedded LocalCluster: {workers} worker process(es); dashboard {client.dashboard_link}")
        else:
            print(f"in-process engine: {workers} thread(s)")
        eng = "dask" if use_cluster else "local"
        plan = distmm.api.plan_for(n, n, n, result_dtype(dt, dt), workers=workers)
        print(plan.describe())
        # Warm-up at full size on other data (kernel compilation, GPU context, pinned
        # buffers, numba's cache), so the timed run measures the product alone.
        distmm.matmul(a[::-1], b, engine=eng, client=client, backend=backend)
        import dask

        # the Dask engine reads these: a tqdm bar as C tiles arrive, an HTML performance report
        options = {"distmm.progress": progress}
        if report and use_cluster:
            options["distmm.performance-report"] = report
        with dask.config.set(options):
            t0 = time.perf_counter()
            c = distmm.matmul(a, b, engine=eng, client=client, backend=backend)
            seconds = time.perf_counter() - t0
        if report and use_cluster:
            print(f"performance report: {report}")
        ref = a.astype(np.float64) @ b.astype(np.float64)
        err = float(np.linalg.norm(np.asarray(c, dtype=np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))
        tol = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2}.get(dt, 1e-12)
        ok = err <= tol if dt.kind in "fc" else np.array_equal(c, a @ b)
        print(f"time {seconds:.3f} s, {2 * n**3 / seconds / 1e9:.1f} GFLOP/s; "
              f"relative error vs float64 numpy {err:.2e}: {'OK' if ok else 'WRONG'}")
        return 0 if ok else 1
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
