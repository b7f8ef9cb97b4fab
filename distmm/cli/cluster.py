"""Embedded Dask clusters for ``distmm demo`` and the Dask benchmarks, and operands made on them.

This module covers:

- how many GPUs this process can use (``local_gpus``: cupy imports and the driver sees them);
- starting a cluster: ``cpu_cluster`` (``distributed.LocalCluster`` of single-thread worker
  processes) and ``gpu_cluster`` (``dask_cuda.LocalCUDACluster``, one worker per GPU, or
  ``per_device`` workers sharing each GPU: ``share_workers``), every GPU worker carrying the
  resource ``GPU: 1``, its comms over UCX where ``distributed-ucxx`` is installed and TCP
  otherwise (``gpu_protocol``: ``protocol="auto"``);
- Ctrl-C and a SIGTERM or SIGHUP to the process group left to this process: the worker
  processes start with SIGINT, SIGTERM and SIGHUP blocked (and then ignore SIGINT:
  ``WORKER_SETUP``, a preload), since Ctrl-C at a terminal reaches every process of the
  foreground group, as a SIGTERM to the group (``kill -- -PGID``, ``timeout``, a batch
  system's time limit) and a terminal's hangup do, and this process closes the cluster;
- the worker processes under this process (``child_processes``; multiprocessing's resource
  tracker is not one): killed until no new one appears (``kill_until_quiet``: a cluster
  closed while its workers start, ``distmm cluster``'s stop at once), or given a grace
  period to end before the rest are killed (``reap_processes``: after a close);
- the Dask engine's task modules imported before the first product, by the workers
  (``TASKS_PRELOAD``) and by this process, which holds the scheduler;
- emulated nodes (``nodes=N`` on either): the workers split into N groups, each worker
  started with its group's environment (``distmm.emulate``: ``DISTMM_EMULATED_NODE``, which
  the Dask engine's worker probe reads) and named ``node<i>-<name>``; a GPU cluster's comms
  are then TCP (UCX would carry the traffic between emulated nodes over CUDA IPC);
- random operands made on the workers, one seeded generator per chunk, numpy or cupy chunks
  (``random_array``), so that no operand travels from the client; ``to_host`` (chunks as
  numpy) and ``sync_workers`` (wait for every worker's GPU, for timing).

It does *not* cover: running a product (``distmm.engine.dask``), what only the benchmarks
do with clusters (CPU workers beside GPU workers, timing, records: ``bench.common``), or what
the demo prints (``distmm.cli.demo``). dask, distributed, dask_cuda and
cupy are imported inside the functions that need them: importing this module needs none.

Why workers are added through ``worker_spec``: ``LocalCUDACluster`` names its workers by
device and refuses a second worker on a device (``CUDA_VISIBLE_DEVICES="0,0"`` gives "Can not
scale beyond visible devices"), so a shared GPU gets copies of that device's worker spec
(same ``CUDA_VISIBLE_DEVICES``, spilling limit and plugins) under new names; the spec dict and
``scale(n)`` are ``SpecCluster``'s public interface.
"""
from __future__ import annotations

import copy
import signal
import threading

import numpy as np

# the preload that imports the Dask engine's task modules (``distmm.engine.dask.preload``),
# run by every worker of these clusters (as by distmm.deploy's jobs) and imported by the
# process that holds their scheduler, so that a cluster's first product does not wait for them
from distmm.deploy import TASKS_PRELOAD

__all__ = ["local_gpus", "cpu_cluster", "gpu_cluster", "gpu_protocol", "ucx_available",
           "PROTOCOLS", "share_workers", "emulate_nodes", "random_array", "to_host",
           "sync_workers", "GPU_RESOURCE", "WORKER_SETUP", "TASKS_PRELOAD",
           "child_processes", "kill_until_quiet", "reap_processes", "QUIET"]

#: the preload every worker of these clusters runs as it starts (``distmm.cli.worker_setup``:
#: it ignores SIGINT, and leaves out what a closing worker logs about its own close)
WORKER_SETUP = "distmm.cli.worker_setup"

#: the worker resource a GPU worker carries here (``{"GPU": 1}``)
GPU_RESOURCE = "GPU"

#: ``gpu_cluster``'s ``protocol``: UCX where it is installed (``auto``), or one of them
PROTOCOLS = ("auto", "ucx", "tcp")

#: seconds without a new worker process before ``kill_until_quiet`` ends
QUIET = 0.3


def ucx_available() -> bool:
    """Whether ``distributed`` can open UCX comms here: ``distributed-ucxx`` imports."""
    try:
        import distributed_ucxx  # noqa: F401
    except Exception:  # not installed, or its UCX libraries do not load
        return False
    return True


def gpu_protocol(protocol: str = "auto") -> str:
    """The comm protocol of an embedded GPU cluster: ``"ucx"`` for ``auto`` where
    ``ucx_available()``, else ``"tcp"``. ``ValueError`` for another name,
    ``ImportError`` for ``"ucx"`` without ``distributed-ucxx``."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if protocol == "auto":
        return "ucx" if ucx_available() else "tcp"
    if protocol == "ucx" and not ucx_available():
        raise ImportError("protocol 'ucx' needs distributed-ucxx (pip install "
                          "distributed-ucxx-cu13, or -cu12 for CUDA 12), which does not import")
    return protocol


def local_gpus() -> int:
    """CUDA devices this process sees: 0 when cupy does not import or no driver answers."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def cpu_cluster(workers: int, *, threads_per_worker: int = 1, nodes: int = 1,
                timeout: float = 120, **kwargs):
    """A ``LocalCluster`` of ``workers`` worker processes (single-thread unless
    ``threads_per_worker``); ``kwargs`` go to ``LocalCluster`` (``resources={"GPU": 1}``:
    workers standing in for GPU workers). ``nodes``: the workers as that many emulated nodes
    (``emulate_nodes``; ``ValueError`` for an uneven split, before any worker starts)."""
    from distributed import LocalCluster

    from distmm.emulate import layout

    lay = layout(workers, nodes)
    kwargs.setdefault("dashboard_address", ":0")
    _with_worker_setup(kwargs)
    if "memory_limit" not in kwargs:  # LocalCluster's "auto" share, which n_workers=0 loses
        from distributed.system import MEMORY_LIMIT

        kwargs["memory_limit"] = int(MEMORY_LIMIT / workers)
    if not lay.active and not _killed_start_fails():
        return _started(lambda: LocalCluster(n_workers=workers,
                                             threads_per_worker=threads_per_worker,
                                             processes=True, **kwargs))
    # the scheduler alone inside _started; the workers start outside it, where a signal's
    # handler runs at once (``_start_workers``)
    cluster = _started(lambda: LocalCluster(n_workers=0, threads_per_worker=threads_per_worker,
                                            processes=True, **kwargs))

    def start():
        if not lay.active:
            _add_workers(cluster, workers)
            return
        specs = {f"w{i}": copy.deepcopy(cluster.new_spec) for i in range(workers)}
        _start_as_nodes(cluster, specs, lay, timeout)

    _start_workers(cluster, start)
    return cluster


def _killed_start_fails() -> bool:
    """Whether a nanny's start fails where its worker process is killed while it starts
    (distributed 2026.8); 2024.12's nanny starts it again, so that a start cut short by
    killing its workers would never end: there the workers start inside ``_started``."""
    import distributed
    from packaging.version import Version

    return Version(distributed.__version__) >= Version("2026.8.0")


def _add_workers(cluster, workers: int) -> None:
    """Start ``workers`` workers on ``cluster`` (a ``SpecCluster`` of no worker yet) as its
    constructor does, and wait for them: a worker that fails to start fails it."""
    while len(cluster.worker_spec) < workers:
        cluster.worker_spec.update(cluster.new_worker_spec())
    # what SpecCluster's constructor and scale() run to start the specs' workers, waited for
    # in this thread so that a worker's failure to start is raised, as the constructor does
    cluster.sync(cluster._correct_state)


def _start_workers(cluster, start) -> None:
    """``start()``, starting ``cluster``'s workers and waiting for them in this thread.

    The worker processes are spawned by the cluster's event-loop thread, which ``_started``
    made with SIGINT, SIGTERM and SIGHUP blocked, so they inherit the mask; this thread waits
    with the handlers in force, so that one that raises (the command line's on SIGTERM or
    Ctrl-C) ends the wait at once rather than once every worker is up. On any error the
    cluster is closed at once (``_close_starting``): its worker processes killed, none
    restarted."""
    before = {p.pid for p in child_processes()}
    try:
        start()
    except BaseException:
        if _killed_start_fails():
            _close_starting(cluster, before)
        else:
            cluster.close()
        raise


def _close_starting(cluster, before: set, most: float = 5.0) -> None:
    """Close ``cluster`` whose workers may still be starting: every process under this one
    that was not there before the start (``before``: their PIDs) is killed until none has
    appeared for ``QUIET`` seconds (``kill_until_quiet``), so that each nanny's start fails
    at once instead of waiting for its worker to come up, then the cluster closes. A further
    signal meanwhile is the handler's to take."""
    kill_until_quiet(before, most=most)
    cluster.close()


def child_processes() -> list:
    """Every process under this one (``psutil.Process``, children's children included); none
    where they cannot be listed."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _is_worker(proc) -> bool:
    """``proc`` still runs (not a zombie, not gone) and is not multiprocessing's resource
    tracker, which ends with this process."""
    import psutil

    try:
        return (proc.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(proc.cmdline()))
    except psutil.Error:
        return False


def kill_until_quiet(spared=(), *, most: float = 5.0, reap: bool = False) -> int:
    """Kill every worker process under this one (``_is_worker``) but ``spared`` (PIDs), and
    again until none has appeared for ``QUIET`` seconds, ``most`` seconds at most; returns
    how many were killed. Each round waits for its processes to end: with ``reap``, their
    exit statuses are read (5 s at most); without, it waits until each is a zombie or gone
    (1 s at most) and reads none, for multiprocessing reads its children's exit statuses
    itself and warns where one was already read."""
    import time

    import psutil

    spared = set(spared)
    killed = 0
    deadline = quiet_from = time.monotonic()
    deadline += most
    while time.monotonic() < deadline:
        procs = [p for p in child_processes() if p.pid not in spared and _is_worker(p)]
        spared.update(p.pid for p in procs)
        _kill(procs)
        if procs:
            if reap:
                psutil.wait_procs(procs, timeout=5)
            else:
                _wait_ended(procs, 1.0)
            killed += len(procs)
            quiet_from = time.monotonic()
        elif time.monotonic() - quiet_from >= QUIET:
            break
        time.sleep(0.02)
    return killed


def reap_processes(grace: float) -> int:
    """Wait ``grace`` seconds for the worker processes under this one (``_is_worker``) to
    end, kill the rest, reading every exit status; returns how many had to be killed."""
    import psutil

    left = [p for p in child_processes() if _is_worker(p)]
    _, alive = psutil.wait_procs(left, timeout=grace)
    _kill(alive)
    psutil.wait_procs(alive, timeout=5)
    return len(alive)


def _kill(procs: list) -> None:
    """Send SIGKILL to each of ``procs``, passing over those already gone."""
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _wait_ended(procs: list, most: float) -> None:
    """Wait until each of ``procs`` is a zombie or gone, ``most`` seconds at most, reaping
    none."""
    import time

    import psutil

    deadline = time.monotonic() + most
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            time.sleep(0.01)


def _node_specs(specs: dict, lay) -> dict:
    """``specs`` (name -> worker spec, in member order) renamed ``node<i>-<name>``, each
    with its node's environment added to the worker's ``env``."""
    out = {}
    for member, (name, spec) in enumerate(specs.items()):
        node = lay.node_of(member)
        spec = copy.deepcopy(spec)
        options = spec.setdefault("options", {})
        options["env"] = {**(options.get("env") or {}), **lay.environment(node)}
        out[f"node{node}-{name}"] = spec
    return out


def _start_as_nodes(cluster, specs: dict, lay, timeout: float) -> None:
    """Replace ``cluster``'s workers by ``specs`` started as ``lay``'s emulated nodes, and
    wait until exactly those run."""
    import time

    wanted = _node_specs(specs, lay)
    cluster.worker_spec.clear()
    cluster.worker_spec.update(wanted)
    cluster.scale(len(wanted))  # closes workers no longer in the spec, starts the new ones
    deadline = time.monotonic() + timeout
    while True:
        names = {w.get("name") for w in cluster.scheduler_info.get("workers", {}).values()}
        if names == set(wanted):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the emulated nodes' workers did not start within {timeout} s "
                               f"(running: {sorted(map(str, names))})")
        time.sleep(0.05)


def emulate_nodes(cluster, nodes: int, *, timeout: float = 120) -> None:
    """Restart ``cluster``'s workers (a ``SpecCluster``: ``LocalCluster``,
    ``LocalCUDACluster``) as ``nodes`` emulated nodes: worker ``i`` in name order (for
    ``LocalCUDACluster`` that is device order) joins node ``i // (workers / nodes)``.
    ``ValueError`` for an uneven split."""
    from distmm.emulate import layout

    specs = dict(sorted(cluster.worker_spec.items(), key=lambda kv: _name_key(kv[0])))
    lay = layout(len(specs), nodes)
    if lay.active:
        _start_as_nodes(cluster, specs, lay, timeout)


def _name_key(name):
    text = str(name)
    return (0, int(text), "") if text.isdigit() else (1, 0, text)


def gpu_cluster(devices: str | None = None, *, per_device: int = 1,
                device_memory_limit: float = 0.8, timeout: float = 120,
                protocol: str = "auto", threads_per_worker: int = 1, nodes: int = 1,
                **kwargs):
    """A ``dask_cuda.LocalCUDACluster`` on ``devices`` (``"0,1"``; default every visible GPU)
    with ``per_device`` workers on each GPU (single-thread unless ``threads_per_worker``),
    each carrying ``GPU: 1``.

    Workers sharing a GPU split ``device_memory_limit`` (a fraction of the device's memory,
    where dask_cuda starts spilling to the host) between them. ``protocol``
    (``gpu_protocol``): ``"auto"`` takes UCX where ``distributed-ucxx`` is installed, so
    that device buffers move between workers without host copies (NVLink where there
    is one), and falls back to TCP, with a warning, when a UCX cluster does not start.
    ``nodes``: the GPUs' workers as that many emulated nodes (``emulate_nodes``, one worker
    per GPU); the comms are then TCP whatever ``protocol`` says (``"ucx"`` is refused), so
    that only distmm's CUDA IPC inside a node, and its NCCL between nodes (on loopback
    sockets), move device buffers directly.
    Raises ``ImportError`` when dask_cuda is not installed.
    """
    import logging

    from dask_cuda import LocalCUDACluster

    if per_device < 1:
        raise ValueError(f"per_device must be at least 1, got {per_device}")
    if nodes != 1:
        if devices is not None:
            from distmm.emulate import layout

            layout(len([d for d in devices.split(",") if d.strip()]), nodes)  # before starting
        if per_device != 1:
            raise ValueError(f"emulated nodes take one worker per GPU, got per_device="
                             f"{per_device}")
        if protocol == "ucx":
            raise ValueError("emulated nodes run over TCP: UCX would move device buffers "
                             "between emulated nodes through CUDA IPC")
        protocol = "tcp"
    chosen = gpu_protocol(protocol)
    kwargs.setdefault("dashboard_address", ":0")
    kwargs.setdefault("resources", {GPU_RESOURCE: 1})
    _with_worker_setup(kwargs)

    def start(proto):
        return _started(lambda: LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=devices, threads_per_worker=threads_per_worker,
            device_memory_limit=device_memory_limit / per_device, protocol=proto, **kwargs))

    try:
        cluster = start(chosen)
    except Exception as exc:
        if protocol != "auto" or chosen == "tcp":
            raise
        logging.getLogger("distmm").warning(
            "distmm: a UCX cluster did not start (%s: %s); using TCP", type(exc).__name__, exc)
        cluster = start("tcp")
    try:
        if per_device > 1:
            share_workers(cluster, per_device, timeout=timeout)
        _wait_for(cluster, len(cluster.worker_spec), timeout)
        if nodes != 1:
            emulate_nodes(cluster, nodes, timeout=timeout)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _with_worker_setup(kwargs: dict) -> None:
    """``WORKER_SETUP`` and ``TASKS_PRELOAD`` added to the cluster's ``preload`` (kept where
    the caller named them), and ``TASKS_PRELOAD`` imported here, where the scheduler runs."""
    import importlib

    importlib.import_module(TASKS_PRELOAD)
    preload = kwargs.get("preload") or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    kwargs["preload"] = [*preload, *(p for p in (WORKER_SETUP, TASKS_PRELOAD)
                                     if p not in preload)]


#: the signals a cluster's start holds back, and its worker processes keep blocked
_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _started(make):
    """``make()``, a cluster's start, leaving Ctrl-C and a SIGTERM or SIGHUP to the process
    group to this process.

    Ctrl-C at a terminal reaches every process of the foreground group, and a worker process
    still importing took it as a ``KeyboardInterrupt`` traceback (its preload, which ignores
    SIGINT, runs only once it has started). A SIGTERM to the group (``kill -- -PGID``, a
    batch system's time limit) ended the worker processes, and distributed 2024.12's nanny
    restarts a worker ended while it starts, a start that then never ends. While the cluster
    starts, this thread blocks SIGINT, SIGTERM and SIGHUP (a terminal's hangup reaches the
    foreground group too): the event-loop and executor threads distributed starts now, and
    the worker processes they start, inherit the mask (through fork and exec), so that this
    process alone acts on them and closes the workers (distributed's nanny kills a worker
    that its close does not end). One of them that comes meanwhile is noted, not raised
    inside the start (which would lose the cluster and leave its workers' semaphores to
    multiprocessing's warning at exit): once the start returns, each is raised again for
    the handlers in force, and where one raises, the cluster is closed first. Where the
    start fails instead, each is raised again before the failure, which a handler that
    raises replaces. multiprocessing's resource tracker is started first, since starting it
    unblocks SIGINT and SIGTERM in the thread that does (and with SIGHUP blocked, which it
    would die of: it ignores only SIGINT and SIGTERM).
    Outside the main thread, only ``make()``."""
    if threading.current_thread() is not threading.main_thread():
        return make()
    from multiprocessing import resource_tracker

    # the tracker ignores SIGINT and SIGTERM itself; a SIGHUP it inherits blocked
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    got = []
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum))
              for s in _HELD
              if signal.getsignal(s) is not None}  # None: not set from Python, left alone
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(_HELD))
        try:
            cluster = make()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one pending is noted here
    except BaseException:
        # the start failed with a signal noted: the signal comes in the failure's place, for
        # the handlers in force (one that raises replaces the failure)
        _restore_handlers(before)
        for signum in got:
            signal.raise_signal(signum)
        raise
    _restore_handlers(before)
    try:
        for signum in got:  # as the handlers in force would have taken them
            signal.raise_signal(signum)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _restore_handlers(before: dict) -> None:
    for signum, handler in before.items():
        signal.signal(signum, handler)


def share_workers(cluster, per_worker: int, *, timeout: float = 120) -> list[str]:
    """Start ``per_worker - 1`` copies of every worker spec of ``cluster`` (same options:
    environment, device, plugins, resources), under new names; returns the new names."""
    names = []
    for name, spec in list(cluster.worker_spec.items()):
        for i in range(1, per_worker):
            names.append(f"{name}-shared{i}")
            cluster.worker_spec[names[-1]] = copy.deepcopy(spec)
    cluster.scale(len(cluster.worker_spec))  # starts the new specs, removes none
    _wait_for(cluster, len(cluster.worker_spec), timeout)
    return names


def _wait_for(cluster, n: int, timeout: float) -> None:
    cluster.wait_for_workers(n, timeout=timeout)


# -- operands made on the workers -----------------------------------------------------------

def _random_chunk(seed: int, dtype: str, gpu: bool, block_info=None):
    """One chunk of a random operand, seeded by ``(seed, chunk location)``: normal floats,
    small signed integers, booleans; on the worker's GPU when ``gpu``."""
    info = block_info[None]
    shape, loc = tuple(info["chunk-shape"]), tuple(info["chunk-location"])
    dt = np.dtype(dtype)
    entropy = [int(seed), *map(int, loc)]
    if gpu and dt in (np.float32, np.float64):
        import cupy

        state = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 1
        return cupy.random.default_rng(state).standard_normal(shape, dtype=dt)
    rng = np.random.default_rng(entropy)
    if dt.kind == "f":
        out = rng.standard_normal(shape).astype(dt)
    elif dt.kind == "c":
        out = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    elif dt.kind == "b":
        out = rng.integers(0, 2, size=shape).astype(dt)
    else:
        low = 0 if dt.kind == "u" else -8
        out = rng.integers(low, 9, size=shape).astype(dt)
    if gpu:
        import cupy

        return cupy.asarray(out)
    return out


def random_array(shape, chunks, dtype, *, seed: int, gpu: bool):
    """A lazy dask array of random values made chunk by chunk on the workers (cupy chunks when
    ``gpu``, numpy otherwise); the same ``(seed, chunks)`` gives the same values and keys."""
    import dask.array as da
    from dask.array.core import normalize_chunks
    from dask.base import tokenize

    dt = np.dtype(dtype)
    chunks = normalize_chunks(chunks, tuple(shape), dtype=dt)
    if gpu:
        import cupy

        meta = cupy.empty((0,) * len(shape), dtype=dt)
    else:
        meta = np.empty((0,) * len(shape), dtype=dt)
    # the whole key, made here: dask 2024.12 takes name= as a prefix (and deprecates token=,
    # with a FutureWarning on stderr), later versions as the key itself
    name = f"distmm-random-{tokenize(int(seed), dt.str, bool(gpu), chunks)}"
    return da.map_blocks(_random_chunk, int(seed), dt.str, bool(gpu), chunks=chunks, dtype=dt,
                         meta=meta, name=name)


def _host_chunk(block):
    return block if isinstance(block, np.ndarray) else block.get()


def to_host(x):
    """``x`` with every chunk as a numpy array (cupy chunks copied to the host on their worker)."""
    return x.map_blocks(_host_chunk, dtype=x.dtype, meta=np.empty((0,) * x.ndim, dtype=x.dtype))


def _sync_device() -> None:
    import sys

    cupy = sys.modules.get("cupy")
    if cupy is None:
        return
    try:
        cupy.cuda.Device().synchronize()
    except Exception:  # a worker that sees no GPU
        pass


def sync_workers(client, workers=None) -> None:
    """Wait until the GPU of every worker that has used cupy is idle (``workers``: only
    those, e.g. the GPU workers of a mixed cluster: a CPU worker has no GPU to wait for,
    and asking fifteen of them cost a round trip each inside the benchmark's clock)."""
    client.run(_sync_device, workers=list(workers) if workers else None)
