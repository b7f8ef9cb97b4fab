"""``distmm demo``: multiply random matrices, check against numpy, report speed.

With ``engine="auto"`` (or ``"dask"``) it starts an embedded cluster and runs the Dask engine
on it:

- on a machine with a GPU (cupy imports and sees a device) and dask_cuda installed, a
  ``dask_cuda.LocalCUDACluster`` (one worker per GPU, ``--workers`` caps how many GPUs) for
  float32 and float64: the operands are made on the GPU workers, the timed product stays
  there (persisted, every worker's GPU synchronised), and cuBLAS in-core on one GPU
  (``cupy.matmul`` in this process, same operands) is printed beside it;
- otherwise (no GPU, no dask_cuda, or another dtype) a ``distributed.LocalCluster`` of one
  single-thread worker process per core, with numpy operands sent from this process.

``engine="local"`` runs the in-process engine. (The demo's ``auto`` is its own: ``distmm.matmul``'s
``engine="auto"`` still picks the local engine unless a Dask client exists.) It does *not*
cover starting clusters or making operands on them (``distmm.cli.cluster``).
"""
from __future__ import annotations

import importlib.util
import math
import os
import time

import numpy as np

from distmm.cli.outputs import check_writable

#: dtypes the GPU demo runs (the ones cuBLAS is compared on); others use CPU workers
GPU_DEMO_DTYPES = ("float32", "float64")


def _dask_engine_ready() -> bool:
    return importlib.util.find_spec("distmm.engine.dask") is not None


def _check_backend(backend: str) -> None:
    """Refuse a GPU backend where this machine has no GPU, as ``distmm matmul`` does."""
    from distmm.errors import BackendUnavailable
    from distmm.executor import missing_gpu

    name = missing_gpu(backend)
    if name is None:
        return
    if backend == "auto":  # the configured distmm.backend: --backend auto is what gave it
        from distmm.config import where_set

        where = where_set("backend")
        raise BackendUnavailable(f"backend {name!r}, the configured distmm.backend"
                                 f"{f' ({where})' if where else ''}, needs a CUDA GPU and "
                                 f"cupy; this machine has none (use --backend blas or numba)")
    raise BackendUnavailable(f"backend {name!r} needs a CUDA GPU and cupy; this machine "
                             f"has none (use --backend auto)")


def run_demo(*, n: int, dtype: str, engine: str, workers: int | None, backend: str, distmm,
             report: str | None = None, progress: bool | None = None) -> int:
    from distmm.config import get_config
    from distmm.engine.local import default_workers
    from distmm.plan import result_dtype

    rng = np.random.default_rng()
    dt = np.dtype(dtype)
    res = result_dtype(dt, dt)  # TypeError for non-numeric dtypes before any work
    use_cluster = engine == "dask" or (engine == "auto" and _dask_engine_ready())
    _check_report(report, use_cluster)
    precision = distmm.api.resolve_precision(None, res)  # distmm.precision, as matmul reads it
    if use_cluster and dt.name in GPU_DEMO_DTYPES:
        gpus = _gpu_cluster_available()
        if gpus:
            return run_gpu_demo(n=n, dtype=dt.name, gpus=min(gpus, workers or gpus),
                                backend=backend, distmm=distmm, report=report,
                                precision=precision)
    _check_fits(n, dt, res)
    _check_backend(backend)  # before a cluster starts
    if not use_cluster:  # the local engine runs distmm.local-threads threads: --workers sets it
        workers = workers or get_config().local_threads
    else:
        _check_cluster_workers(workers, default_workers())
    workers = workers or default_workers()
    a, b = _operand(rng, n, dt), _operand(rng, n, dt)
    cluster = client = None
    try:
        if use_cluster:
            from distributed import Client

            from distmm.cli.cluster import cpu_cluster

            cluster = cpu_cluster(workers)
            client = Client(cluster)
            print(f"embedded LocalCluster: {workers} worker process(es); dashboard {client.dashboard_link}")
        else:
            print(f"in-process engine: {workers} thread(s)")
        eng = "dask" if use_cluster else "local"
        import dask

        threads = {} if use_cluster else {"distmm.local-threads": workers}
        with dask.config.set(threads):
            print(_run_plan(distmm, n, res, workers, backend, client).describe())
            # Warm-up at full size on other data (kernel compilation, GPU context, pinned
            # buffers, numba's cache), so the timed run measures the product alone.
            distmm.matmul(a[::-1], b, engine=eng, client=client, backend=backend)
        # the engines read these: a tqdm bar as C tiles arrive, an HTML performance report
        options = {**threads, "distmm.progress": progress}
        if report and use_cluster:
            options["distmm.performance-report"] = report
        with dask.config.set(options):
            t0 = time.perf_counter()
            c = distmm.matmul(a, b, engine=eng, client=client, backend=backend)
            seconds = time.perf_counter() - t0
        if report and use_cluster:
            print(f"performance report: {report}")
        ok, check = _check(c, a, b, res, precision)
        flops = (8 if dt.kind == "c" else 2) * n**3
        print(f"time {seconds:.3f} s, {flops / seconds / 1e9:.1f} GFLOP/s; "
              f"{check}: {'OK' if ok else 'WRONG'}")
        return 0 if ok else 1
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()


def _run_plan(distmm, n: int, res: np.dtype, workers: int, backend: str, client):
    """The plan the demo's product runs, as ``distmm.matmul`` makes it: in this process
    ``distmm.make_plan``'s (the configured tile, backend, precision, threads and memory
    budget); on a cluster, for its ``workers``, with the budget its workers' ``memory_limit``
    allows where that is lower (the Dask engine's plan hint)."""
    if client is None:
        return distmm.make_plan(n, n, n, res, backend=backend)
    from distmm.engine.dask import memory_budget

    budget = memory_budget(client)
    return distmm.api.plan_for(n, n, n, res, workers=workers,
                               hints={"memory_budget": budget} if budget else None,
                               precision=distmm.api.resolve_precision(None, res))


def _check(c, a, b, res: np.dtype, precision: str = "highest") -> tuple[bool, str]:
    """Whether ``c`` is right for ``a @ b``, and the words that say how it was judged.

    Against a float64 (complex128) product of the same operands: within the result dtype's
    tolerance of it (float32's for bfloat16 operands, whose product numpy gives in float32),
    or, for a reduced ``precision`` (``distmm.precision``: tf32, bf16, fp16), within that
    mode's elementwise bound ``error_bound(mode, k) * |A| @ |B|`` (``distmm.precision``).
    Integers wrap around as numpy's do: they are compared with numpy's product."""
    if res.kind not in "fc":
        ok = bool(np.array_equal(c, a @ b))
        return ok, "equal to numpy's product" if ok else "differs from numpy's product"
    wide = np.dtype(np.complex128 if res.kind == "c" else np.float64)
    a64, b64 = a.astype(wide), b.astype(wide)
    ref = a64 @ b64
    diff = np.asarray(c, dtype=wide) - ref
    err = float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-300))
    check = f"relative error vs {wide.name} numpy {err:.2e}"
    if precision == "highest":
        tol = {"float32": 1e-5, "complex64": 1e-5, "float16": 1e-2}.get(res.name, 1e-12)
        return err <= tol, check
    from distmm.precision import error_bound

    del ref
    scale = np.abs(a64, out=a64) @ np.abs(b64, out=b64)  # reduced modes: real dtypes only
    ok = bool(np.all(np.abs(diff) <= error_bound(precision, a.shape[1], out_dtype=res) * scale))
    return ok, f"{check}, {'within' if ok else 'beyond'} the {precision} error bound"


def _check_report(report: str | None, use_cluster: bool) -> None:
    """Refuse ``--report`` where it would be ignored (the local engine) or could not be
    written (a folder, a missing folder: ``check_writable``), before the product rather
    than after it."""
    if not report:
        return
    if not use_cluster:
        raise ValueError("--report writes the Dask engine's performance report: add "
                         "--engine dask")
    if os.path.isdir(report):
        raise IsADirectoryError(21, "a folder, not a file (--report)", report)
    check_writable(report, makes_folders=False)


def _operand(rng, n: int, dt: np.dtype) -> np.ndarray:
    """A random ``n`` x ``n`` operand: small integers, or normal values (complex for a
    complex dtype, so the check covers the imaginary parts)."""
    if dt.kind in "iub":
        return rng.integers(-100, 100, size=(n, n)).astype(dt)
    x = rng.standard_normal((n, n))
    if dt.kind == "c":
        x = x + 1j * rng.standard_normal((n, n))
    return x.astype(dt)


def _check_fits(n: int, dt: np.dtype, res: np.dtype) -> None:
    """ValueError, with the sizes, when the operands (``dt``), the result (``res``) and the
    float64 check cannot fit this machine's available memory (numpy's own refusal names
    neither -n nor the demo; beyond what is available the machine swaps or kills): told from
    -n before any work, a bad argument, as numpy's "array is too big"."""
    from distmm.config import host_available

    wide = 16 if res.kind == "c" else 8
    need = n * n * (2 * dt.itemsize + res.itemsize) + 3 * n * n * wide
    have = host_available()
    if need > have:
        raise ValueError(f"-n {n} {dt.name}: the operands, result and float64 check need "
                         f"{need / 2**30:.3g} GiB; this machine has {have / 2**30:.3g} GiB "
                         f"available")


#: worker processes per usable core the embedded CPU cluster may start
WORKERS_PER_CORE = 4


def _check_cluster_workers(workers: int | None, cores: int) -> None:
    """ValueError for more ``--workers`` than ``WORKERS_PER_CORE`` per usable core: the
    embedded cluster starts a worker process each, on this machine, before any product."""
    most = WORKERS_PER_CORE * cores
    if workers is not None and workers > most:
        raise ValueError(f"--workers {workers}: the embedded LocalCluster starts a worker "
                         f"process each on this machine, at most {most} here ({WORKERS_PER_CORE} "
                         f"per usable core; --engine local runs threads)")


def _gpu_cluster_available() -> int:
    """GPUs a LocalCUDACluster can use here: 0 without cupy, a device or dask_cuda."""
    from distmm.cli.cluster import local_gpus

    gpus = local_gpus()
    if gpus and importlib.util.find_spec("dask_cuda") is None:
        print(f"{gpus} GPU(s) but dask_cuda is not installed: CPU workers "
              f"(pip install dask-cuda for the GPU demo)")
        return 0
    return gpus


def _cublas_seconds(a, b, repeat: int = 3) -> float:
    """Median seconds of ``cupy.matmul`` on device copies of ``a``, ``b`` (after one call)."""
    import cupy

    x, y = cupy.asarray(a), cupy.asarray(b)
    cupy.matmul(x, y)
    times = []
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        cupy.matmul(x, y)
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    del x, y
    cupy.get_default_memory_pool().free_all_blocks()
    return float(np.median(times))


def run_gpu_demo(*, n: int, dtype: str, gpus: int, backend: str, distmm,
                 report: str | None = None, precision: str = "highest") -> int:
    """The demo on a LocalCUDACluster of ``gpus`` workers: distmm's GPU figure beside cuBLAS.
    ``precision``: ``distmm.precision``'s mode for the product, which the check allows for."""
    from contextlib import nullcontext

    from distributed import Client, performance_report, wait

    from distmm.cli.cluster import gpu_cluster, random_array, sync_workers, to_host
    from distmm.executor.device import gpu_name

    dt = np.dtype(dtype)
    chunk = max(1, math.ceil(n / max(2, math.ceil(math.sqrt(gpus)))))  # >= 2 x 2 C blocks
    devices = ",".join(str(i) for i in range(gpus))
    with gpu_cluster(devices) as cluster, Client(cluster) as client:
        comms = client.scheduler.address.split("://", 1)[0]
        print(f"embedded LocalCUDACluster: {gpus} GPU worker(s) on {gpu_name(0)}, {comms} "
              f"comms; dashboard {client.dashboard_link}")
        tk = distmm.api.plan_for(n, n, n, dt, workers=1, on_gpu=True).tile[2]
        print(distmm.api.plan_for(n, n, n, dt, workers=gpus, tile=(chunk, chunk, tk),
                                  on_gpu=True, precision=precision).describe())

        def operands(seed):
            a = random_array((n, n), chunk, dt, seed=seed, gpu=True)
            b = random_array((n, n), chunk, dt, seed=seed + 1, gpu=True)
            a, b = client.persist([a, b])
            wait([a, b])
            return a, b

        def product(a, b):
            c = distmm.matmul(a, b, client=client, backend=backend).persist()
            wait(c)
            sync_workers(client)
            return c

        warm = product(*operands(11))  # imports, executors, cuBLAS handles: not timed
        del warm
        a, b = operands(int(np.random.default_rng().integers(1 << 30)) * 2)
        print(f"operands made on the GPU workers: {n} x {n} {dt.name}, chunks {chunk} x {chunk}")
        with performance_report(filename=report) if report else nullcontext():
            t0 = time.perf_counter()
            c = product(a, b)
            seconds = time.perf_counter() - t0
        if report:
            print(f"performance report: {report}")
        a_h, b_h, c_h = client.compute([to_host(a), to_host(b), to_host(c)], sync=True)
        del a, b, c
    flops = 2 * n**3
    print(f"distmm (dask engine, {gpus} GPU worker(s)): time {seconds:.4g} s, "
          f"{flops / seconds / 1e12:.2f} TFLOP/s")
    ref_seconds = _cublas_seconds(a_h, b_h)
    print(f"cuBLAS in-core (cupy.matmul, 1 GPU): time {ref_seconds:.4g} s, "
          f"{flops / ref_seconds / 1e12:.2f} TFLOP/s; distmm / cuBLAS {ref_seconds / seconds:.2f}")
    ok, check = _check(c_h, a_h, b_h, dt, precision)
    print(f"{check}: {'OK' if ok else 'WRONG'}")
    return 0 if ok else 1
