"""Dask clusters of the benchmarks: what ``distmm demo`` starts (``distmm.cli.cluster``),
plus what only the benchmarks do with them.

This module covers: the embedded clusters and the operands made on their workers, taken from
``distmm.cli.cluster`` (``cpu_cluster``, ``gpu_cluster``, ``share_workers``, ``random_array``,
``to_host``, ``sync_workers``, ``local_gpus``, ``GPU_RESOURCE``: the benchmarks import them from
here only); adding single-thread CPU workers that see no GPU to a running cluster (a mixed
cluster: ``add_cpu_workers``); the addresses of the GPU workers (``gpu_workers``); and a cluster
emptied between measurements (``release_cluster``).
It does not cover running a product (``distmm.engine.dask``) or timing
(``bench.common.timing``). dask and distributed are imported inside the functions.
"""
from __future__ import annotations

import copy
import time

from bench.common.timing import free_gpu
from distmm.cli.cluster import (GPU_RESOURCE, cpu_cluster, gpu_cluster, local_gpus, random_array,
                                share_workers, sync_workers, to_host)

__all__ = ["GPU_RESOURCE", "cpu_cluster", "gpu_cluster", "local_gpus", "random_array",
           "share_workers", "sync_workers", "to_host", "add_cpu_workers", "gpu_workers",
           "release_cluster"]


def add_cpu_workers(cluster, count: int, *, memory_limit: int | str | None = None,
                    timeout: float = 120) -> list[str]:
    """Add ``count`` single-thread worker processes that see no GPU
    (``CUDA_VISIBLE_DEVICES=""``) to ``cluster``; returns their names. ``memory_limit``: each
    worker's (default: the host's memory shared by every worker of the cluster)."""
    from distributed import Nanny
    from distributed.system import MEMORY_LIMIT

    base = cluster.new_spec["options"]
    keep = ("host", "protocol", "security", "interface", "dashboard_address", "dashboard",
            "silence_logs", "services")
    options = {key: base[key] for key in keep if key in base}
    total = len(cluster.worker_spec) + count
    options.update(nthreads=1, env={"CUDA_VISIBLE_DEVICES": ""},
                   memory_limit=memory_limit if memory_limit is not None else MEMORY_LIMIT // total)
    names = [f"cpu-{i}" for i in range(count)]
    for name in names:
        cluster.worker_spec[name] = {"cls": Nanny, "options": copy.deepcopy(options)}
    cluster.scale(len(cluster.worker_spec))
    cluster.wait_for_workers(len(cluster.worker_spec), timeout=timeout)
    return names


def gpu_workers(client) -> list[str]:
    """Addresses of the workers carrying the ``GPU`` resource, sorted."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(addr for addr, w in info.items() if w.get("resources", {}).get(GPU_RESOURCE))


def _free_gpu_if_used() -> None:
    import sys

    if sys.modules.get("cupy") is not None:
        try:
            free_gpu()
        except Exception:  # a worker that sees no GPU
            pass


def release_cluster(client, timeout: float = 30, keep=()) -> None:
    """Wait until the scheduler of ``client`` holds no result in memory but the keys of the
    collections in ``keep`` (what the caller dropped is forgotten), then return cupy's pooled
    memory on every worker that used it (workers sharing a GPU cannot use each other's cached
    blocks)."""
    import gc

    from distributed import futures_of

    held = sum(len(futures_of(x)) for x in keep)
    gc.collect()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = client.run_on_scheduler(lambda dask_scheduler: sum(
            ts.state == "memory" for ts in dask_scheduler.tasks.values()))
        if n <= held:
            break
        time.sleep(0.05)
    client.run(_free_gpu_if_used)
