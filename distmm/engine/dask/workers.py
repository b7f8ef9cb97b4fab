"""Which workers of a Dask cluster have a GPU, and how fast each worker is.

This module covers: recognising GPU workers (a ``"GPU"`` resource, as
``dask-cuda-worker --resources GPU=1`` or ``LocalCluster(resources=...)``
declare, or a probe run on the worker that finds a CUDA device: the driver
shows one, cupy imports and ``getDeviceCount() > 0``), each worker's
throughput in GFLOP/s (the ``distmm.dask-worker-gflops`` configuration by
address, then by kind, else
measured by the probe: a small float64 product timed on the worker's device, on a thread
of the worker's own after the probe has answered, so that a product's first plan takes
``ASSUMED_GPU_GFLOPS`` for GPUs not measured yet; alike workers, GPUs of one model or CPU
workers of one host with as many threads, take the median of their measurements),
which workers share one physical GPU (the probe's PCI bus id, or
``DEVICES_KEY`` for tests), and the emulated node a worker was started in
(``DISTMM_EMULATED_NODE``, ``distmm.emulate``), as one
``distmm.plan_blocks.WorkerInfo`` per worker. Probes are cached per worker
address for the life of the client process.
It does *not* cover: the units the block layout shares C between, or the layout
itself (``distmm.plan_blocks``), or the tasks (``distmm.engine.dask.tasks``).
"""
from __future__ import annotations

import functools
import logging
import statistics
import sys
import threading
import time

from distmm.engine.dask.background import BackgroundSlot
from distmm.plan_blocks import WorkerInfo

__all__ = ["worker_info", "probe", "forget", "found_devices", "DEVICES_KEY"]

log = logging.getLogger("distmm.engine.dask")

#: GFLOP/s assumed for a worker marked GPU by its resources whose probe found
#: no device (a test cluster, or a worker whose device is not visible to cupy)
ASSUMED_GPU_GFLOPS = 20000.0

#: debug configuration (outside the checked ``distmm`` section): ``{address:
#: device id}`` standing in for the probe's PCI bus id, so that tests without a
#: GPU can mark workers as sharing one device
DEVICES_KEY = "distmm-debug.worker-devices"

#: each worker's probe, by address, with the worker it came from (``_instance``): an address
#: a later worker takes again (a new cluster, a restarted worker on a fixed port) is probed anew
_CACHE: dict[str, tuple] = {}
_LOCK = threading.Lock()


def _instance(w: dict):
    """What tells one worker at an address from a later one there: its local directory
    (``dask-scratch-space/worker-<random>``, made per worker process)."""
    return w.get("local_directory")


@functools.lru_cache(maxsize=1)
def _driver_devices() -> int | None:
    """CUDA devices this process may use, found without importing cupy: 0 where
    ``CUDA_VISIBLE_DEVICES`` hides them all (empty, or a first entry of -1), where no
    driver library loads, or where the driver (``cuInit``, ``cuDeviceGetCount``) reports
    none; None where the library lacks those entry points. The environment variable is
    read first because it costs nothing: on a mixed cluster (a GPU worker beside CPU
    workers started with ``CUDA_VISIBLE_DEVICES=''``) importing cupy, or even a failing
    ``cuInit``, in every CPU worker's probe delays the first product measurably
    (``bench/NOTES.md``, the mixed cluster)."""
    import ctypes
    import os

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and (not hidden.strip() or hidden.split(",")[0].strip() == "-1"):
        return 0
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return 0
    try:
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
    except AttributeError:
        return None
    return int(count.value)


def probe(gpu_size: int = 2048, cpu_size: int = 256) -> dict:
    """Run on a worker: whether it sees a CUDA device, which one (PCI bus id, model),
    GFLOP/s of a small float64 product on the CPU and, once measured, on the GPU, and its
    emulated node (None where none).

    On a GPU worker the first probe starts ``_gpu_warmup`` on a thread of its own and
    returns without waiting for it: ``gpu_gflops`` is None and ``rate_pending`` True until
    a later probe finds the measurement done (``worker_info`` probes such a worker again,
    in the background, during the next product)."""
    import numpy as np

    from distmm.emulate import this_node

    out: dict = {"cuda": False, "device": None, "gpu_gflops": None, "cpu_gflops": None,
                 "device_memory": None, "node": this_node(), "rate_pending": False}
    rng = np.random.default_rng(0)
    a = rng.standard_normal((cpu_size, cpu_size))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    out["cpu_gflops"] = 2 * cpu_size**3 / max(best, 1e-9) / 1e9
    if _driver_devices() == 0:
        return out
    try:
        import cupy

        from distmm.executor.device import gpu_name

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return out
        dev = cupy.cuda.Device()
        out["cuda"] = True
        out["device"] = dev.pci_bus_id
        out["name"] = gpu_name(dev.id)  # the model: alike devices get one rate (worker_info)
        out["device_memory"] = int(dev.mem_info[1])  # the device's total bytes
    except Exception:  # no cupy, no driver, a device in trouble: a CPU worker
        return dict(out, cuda=False, device=None, name=None, device_memory=None)
    warm = _start_warmup(dev.id, gpu_size)
    out["gpu_gflops"] = warm.get("gflops")
    out["rate_pending"] = out["gpu_gflops"] is None and warm.get("error") is None
    return out


_WARM: dict = {}  # this process's GPU warm-up: "thread", then "gflops" or "error"
_WARM_LOCK = threading.Lock()


def _start_warmup(device: int, gpu_size: int) -> dict:
    """Start ``_gpu_warmup`` once per process; its state as it stands."""
    with _WARM_LOCK:
        if "thread" not in _WARM:
            _WARM["thread"] = threading.Thread(target=_gpu_warmup, args=(device, gpu_size),
                                               name="distmm-gpu-warmup", daemon=True)
            _WARM["thread"].start()
        return dict(_WARM)


#: the side of the warm-up's products in each float dtype (a few milliseconds on a GPU)
WARM_GEMM = 4096


def _gpu_warmup(device: int, gpu_size: int) -> None:
    """On a GPU worker, on a thread of its own: what the first block task would otherwise
    start inside itself (the modules block tasks run, cuBLAS's library and its small and
    large kernels for float32 and float64, cupy's copy into strided panels), then the
    GPU's GFLOP/s: a ``gpu_size`` float64 product, timed after one untimed. Runs while
    the client plans and builds the graph, not while the worker's event loop waits
    (``probe`` returns first); a failure leaves ``error`` and no rate."""
    try:
        import cupy
        import numpy as np

        import distmm.engine.dask.blocks  # noqa: F401  (and the modules it imports)
        import distmm.engine.dask.pull  # noqa: F401
        from distmm.executor.cublas import cublas_gemm, start_cublas

        with cupy.cuda.Device(device):
            for dt in (np.float32, np.float64):
                start_cublas(dt).result()
                src = cupy.empty((8, 8), dtype=dt)
                dst = cupy.empty((8, 16), dtype=dt)
                dst[:, 3:11] = src  # the copy kernel panels are assembled with
                # the large-tile kernels a block's GEMMs launch (start_cublas's 256^2 products
                # load only the small ones): beta 0 for a block's first k piece, 1 after it
                with cupy.cuda.Stream(non_blocking=True) as stream:
                    w = cupy.empty((WARM_GEMM, WARM_GEMM), dtype=dt)
                    c = cupy.empty_like(w)
                    cublas_gemm(w, w, c, 1, 0)
                    cublas_gemm(w, w, c, 1, 1)
                    stream.synchronize()
                    del w, c
            x = cupy.ones((gpu_size, gpu_size), dtype=np.float64)
            x @ x
            cupy.cuda.runtime.deviceSynchronize()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                x @ x
                cupy.cuda.runtime.deviceSynchronize()
                best = min(best, time.perf_counter() - t0)
            del x
        with _WARM_LOCK:
            _WARM["gflops"] = 2 * gpu_size**3 / max(best, 1e-9) / 1e9
    except Exception as exc:  # noqa: BLE001 -- the worker keeps the assumed rate
        with _WARM_LOCK:
            _WARM["error"] = f"{type(exc).__name__}: {exc}"


def forget(address: str | None = None) -> None:
    """Drop cached probes (one worker's, or all)."""
    with _LOCK:
        if address is None:
            _CACHE.clear()
        else:
            _CACHE.pop(address, None)


def _probes(client, addresses, info: dict | None = None) -> dict:
    """Each worker's probe: cached; asked now of a worker without one, or that is not the
    one the cached probe came from (``info``: the scheduler's table, ``_instance``); asked
    again in the background of a worker whose GPU rate was still being measured
    (``rate_pending``): this product plans with the cached answer (its model's rate or the
    assumed one, ``_alike_rates``) and a later one finds the rate (``settle`` waits)."""
    now = {a: _instance((info or {}).get(a) or {}) for a in addresses}

    def known(a):
        hit = _CACHE.get(a)
        return hit is not None and hit[0] == now[a]

    with _LOCK:
        missing = [a for a in addresses if not known(a)]
        pending = [a for a in addresses if known(a) and _CACHE[a][1].get("rate_pending")]
    if missing:
        _ask(client, missing, now)
    if pending:
        _ask_later(client, pending, now)
    with _LOCK:
        return {a: _CACHE[a][1] if known(a) else {} for a in addresses}


def _ask(client, addresses, now: dict) -> None:
    """Probe ``addresses`` and cache each answer with its worker's instance (``now``)."""
    try:
        got = client.run(probe, workers=list(addresses), on_error="return")
    except Exception as exc:  # a worker leaving mid-call, a closing client: CPU workers
        log.debug("distmm: worker probe failed: %r", exc)
        got = {}
    with _LOCK:
        for addr, res in got.items():
            if isinstance(res, dict):
                _CACHE[addr] = (now.get(addr), res)


_LATER = BackgroundSlot()  # the background probe of workers whose GPU rate was pending


def _ask_later(client, addresses, now: dict) -> None:
    """``_ask`` on a thread of its own, one at a time: the product does not wait for it."""
    _LATER.start(_ask, client, list(addresses), dict(now), name="distmm-probe-rates",
                 skip_if_running=True)


def settle(timeout: float | None = None) -> None:
    """Wait for a background probe of pending GPU rates (``_probes``) to end."""
    _LATER.settle(timeout)


def found_devices(addresses, info: dict) -> dict[str, bool]:
    """Whether the probe of each of ``addresses`` found a CUDA device (cupy imports and
    shows one), read from the probes ``worker_info`` cached, asking nothing; a worker
    without an answer from its current instance (its probe failed: a worker leaving, a
    closing client) is left out. ``info``: the scheduler's ``workers`` table."""
    with _LOCK:
        hits = {a: _CACHE.get(a) for a in addresses}
    return {a: bool(hit[1].get("cuda")) for a, hit in hits.items()
            if hit is not None and hit[0] == _instance(info.get(a) or {})}


def _configured(gflops_cfg, address: str, kind: str):
    table = dict(gflops_cfg or ())
    if address in table:
        return table[address]
    return table.get(kind)


def _marked_gpu(w: dict) -> bool:
    """Whether the scheduler's entry ``w`` for a worker declares a ``GPU`` resource."""
    return float((w.get("resources") or {}).get("GPU", 0) or 0) > 0


def _alike_rates(info: dict, found: dict) -> dict:
    """Each probed worker's measured GFLOP/s, one value for workers that are alike: the
    median over the GPU workers whose devices are of one model, and over the CPU workers of
    one host with as many threads. A probe times a few small products, so alike workers
    measure a few percent apart; block shares that followed those differences would be
    uneven for no reason, and unequal shares make the placement search weigh every order of
    the workers (several times as long: the layouts no longer coincide). A GPU whose rate is
    still being measured (``probe``) takes its model's; a model none of whose GPUs has a
    rate yet is left out (``ASSUMED_GPU_GFLOPS``)."""
    from distmm.engine.dask.transfer import host_of

    groups: dict = {}
    for addr, res in found.items():
        w = info.get(addr) or {}
        marked = _marked_gpu(w)
        if res.get("cuda") and (res.get("gpu_gflops") or res.get("name")):
            # a GPU whose rate is still being measured takes its model's
            key = ("gpu", res.get("name") or res.get("device"))
            rate = float(res["gpu_gflops"]) if res.get("gpu_gflops") else None
        elif not res.get("cuda") and not marked and res.get("cpu_gflops"):
            threads = max(int(w.get("nthreads", 1)), 1)
            key = ("cpu", host_of(addr), threads)
            rate = float(res["cpu_gflops"]) * threads
        else:
            continue
        groups.setdefault(key, []).append((addr, rate))
    out = {}
    for members in groups.values():
        rates = [r for _, r in members if r is not None]
        if rates:
            rate = statistics.median(rates)
            out.update((addr, rate) for addr, _ in members)
    return out


def worker_info(client, gflops_cfg=None, info: dict | None = None) -> list[WorkerInfo]:
    """Every worker of the cluster, sorted by address (probing those not seen before);
    ``info``: the scheduler's ``workers`` table when the caller has it already."""
    if info is None:
        info = client.scheduler_info(n_workers=-1)["workers"]
    addresses = sorted(info)
    found = _probes(client, addresses, info)
    import dask.config

    devices = dict(dask.config.get(DEVICES_KEY, None) or {})
    alike = _alike_rates(info, found)
    out = []
    for addr in addresses:
        w = info[addr]
        res = found.get(addr, {})
        marked = _marked_gpu(w)
        cuda = bool(res.get("cuda"))
        gpu = marked or cuda
        kind = "gpu" if gpu else "cpu"
        nthreads = max(int(w.get("nthreads", 1)), 1)
        rate = _configured(gflops_cfg, addr, kind)
        if rate is None:
            rate = alike.get(addr)
        if rate is None:
            rate = ASSUMED_GPU_GFLOPS if gpu else (res.get("cpu_gflops") or 1.0) * nthreads
        device = devices.get(addr, res.get("device"))
        mem = res.get("device_memory") if cuda else None
        out.append(WorkerInfo(addr, nthreads, gpu, None if device is None else str(device),
                              float(rate), cuda, None if mem is None else int(mem),
                              res.get("node")))
    return out
