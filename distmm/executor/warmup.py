"""Start-up work done ahead of the first product: the GPU's, on a background thread, and
numpy's BLAS buffer, in the calling thread.

This module covers: ``warmup()``, which pays once, off the caller's path, what a
fresh process otherwise pays inside its first GPU product: CUDA's context on the
device, cuBLAS's handle and its first kernels (one small GEMM per float dtype),
a first device allocation, and the stream pipeline's page-locked staging ring,
pinned into the process-wide pool that the pipeline takes its ring from. The
product that starts while a warm-up still runs waits for its ring (pinned first,
``wait_running``), so the two never pin twice, and shares its cuBLAS start-up
(``distmm.executor.cublas.start_cublas`` runs once per dtype and device); the rest
of the warm-up goes on beside the product (``distmm.executor.pipeline.startup``); and
``map_blas_buffer()``, which has numpy's BLAS map its buffer before a command stages its
output, so that an address-space limit that refuses it ends the command before anything
is written.
It does *not* cover: the pipeline itself (``distmm.executor.pipeline``), the pool
(``distmm.executor.pinned``), or choosing a backend.

Why: in a fresh process the context, cuBLAS's set-up and the staging ring are a
large part of the first GPU product's time (``bench/NOTES.md``, "First call"). A
program that starts the warm-up before it loads its operands (the ``distmm
matmul`` command does, while it reads the input files) hides them.

A CUDA context is made in the calling process: call it where the process will
use the GPU anyway (never before forking workers that use CUDA themselves).
"""
from __future__ import annotations

import threading
import time

__all__ = ["warmup", "WarmUp", "map_blas_buffer", "RING_BUFFERS", "RING_BUFFER_BYTES"]

#: staging buffers the warm-up pins: the pipeline's ring (16 in, 6 out) ...
RING_BUFFERS = 22
#: ... of its 16 MiB chunks, plus slack for chunks rounded up to a whole row
RING_BUFFER_BYTES = (16 << 20) + (1 << 20)

class WarmUp:
    """A warm-up in progress or done: ``wait()`` returns its phases in seconds.

    ``phases`` holds ``context_s``, ``cublas_s``, ``device_alloc_s``,
    ``pinned_ring_s``, ``pipeline_s`` (a small host-resident product per float
    dtype through the pipeline) and ``total_s`` once done; ``error`` the text of an
    exception that stopped it (a warm-up that fails costs the product nothing:
    the product does the same work itself and reports its own errors).
    """

    def __init__(self):
        self.thread_id: int | None = None
        self.phases: dict = {}
        self.error: str | None = None
        #: set once the staging ring is pinned (or the warm-up stopped): what a product
        #: that starts meanwhile waits for (``startup.wait_running``)
        self.ring_ready = threading.Event()
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> dict:
        self._done.wait(timeout)
        return dict(self.phases)


def _run(handle: WarmUp, device_id: int | None, pinned: bool, device_bytes: int) -> None:
    handle.thread_id = threading.get_ident()
    t0 = time.perf_counter()
    try:
        import cupy

        rt = cupy.cuda.runtime
        if device_id is not None:
            rt.setDevice(device_id)
        rt.getDeviceCount()
        rt.memGetInfo()  # makes the context
        t1 = time.perf_counter()
        handle.phases["context_s"] = t1 - t0
        # The ring first: it is what a product that starts meanwhile waits for.
        if pinned:
            from distmm.executor.pinned import default_pinned_pool

            pool = default_pinned_pool()
            count = min(RING_BUFFERS, pool.limit // RING_BUFFER_BYTES)
            if count > 0:
                bufs = pool.acquire_many(RING_BUFFER_BYTES, count, timeout=60)
                for buf in bufs:
                    pool.release(buf)
        handle.ring_ready.set()
        t2 = time.perf_counter()
        handle.phases["pinned_ring_s"] = t2 - t1
        from distmm.executor.cublas import start_cublas

        # on a stream of their own: the program's GPU work meanwhile is not waited for;
        # a product that starts meanwhile shares these start-ups (start_cublas runs each once)
        for fut in [start_cublas(dt) for dt in ("float32", "float64")]:
            fut.result()
        t3 = time.perf_counter()
        handle.phases["cublas_s"] = t3 - t2
        if device_bytes > 0:
            free, _total = rt.memGetInfo()
            nbytes = min(int(device_bytes), int(free) // 2)
            if nbytes > 0:
                rt.free(rt.malloc(nbytes))
        t4 = time.perf_counter()
        handle.phases["device_alloc_s"] = t4 - t3
        from distmm.executor.pipeline import startup

        # Small products set up what a first product would; once a product has started
        # (the program did not wait for the warm-up) they would only compete with it.
        if pinned and not startup.product_started():
            _small_products()
        handle.phases["pipeline_s"] = time.perf_counter() - t4
    except BaseException as exc:  # noqa: BLE001 - reported on the handle, never raised
        handle.error = f"{type(exc).__name__}: {exc}"
    finally:
        handle.ring_ready.set()
        handle.phases["total_s"] = time.perf_counter() - t0
        from distmm.executor.pipeline import startup

        startup.finish(handle)
        handle._done.set()


def _small_products() -> None:
    """One small host-resident product per float dtype through the GPU executor's
    pipeline, the path of a first large host-resident product: its modules, thread
    pools, streams, events, pool and kernels are then set up."""
    import numpy as np

    from distmm.executor.gpu import executor_for
    from distmm.plan import make_plan

    n = 1024
    for dt in (np.float32, np.float64):
        a = np.ones((n, n), dtype=dt)
        out = np.empty((n, n), dtype=dt)
        plan = make_plan(n, n, n, dt, workers=1, tile=(n, n, n))
        executor_for("auto").run_plan(plan, a, a, out)
        if out[0, 0] != n or out[-1, -1] != n:
            raise RuntimeError(f"warm-up product of ones gave {out[0, 0]}, expected {n}")


def warmup(*, device: int | None = None, background: bool = True, pinned: bool = True,
           device_bytes: int = 1 << 30) -> WarmUp:
    """Initialise the GPU path now so that the first product does not pay for it.

    Parameters
    ----------
    device : int, optional
        The CUDA device (default: device 0, a thread's default; a program that
        selects another device passes it).
    background : bool
        Run on a daemon thread and return at once (default); ``False`` waits.
    pinned : bool
        Pin the stream pipeline's staging ring (22 x 17 MiB) into the
        process-wide pinned pool, where the first host-resident product finds it.
    device_bytes : int
        Allocate and free this many device bytes (at most half the free memory).

    Returns
    -------
    WarmUp
        ``wait()`` for the phases. A second call while one runs returns that one.

    Raises
    ------
    ImportError
        cupy is not installed.
    """
    import importlib.util

    if importlib.util.find_spec("cupy") is None:  # cupy itself is imported on the thread
        raise ImportError("distmm.warmup needs cupy (pip install \"distmm[gpu]\")")
    from distmm.executor.pipeline import startup  # (imported here: ``import distmm`` stays lean)

    handle, new = startup.start(WarmUp)
    if not new:
        return handle
    if background:
        threading.Thread(target=_run, args=(handle, device, pinned, device_bytes),
                         name="distmm-warmup", daemon=True).start()
    else:
        _run(handle, device, pinned, device_bytes)
    return handle


#: the accumulation dtypes numpy's matmul hands to its BLAS
_BLAS_DTYPES = ("float32", "float64", "complex64", "complex128")


def map_blas_buffer(backend: str | None, dtype) -> bool:
    """Have numpy's BLAS map its buffer now, from the calling thread, where a CPU product of
    ``dtype`` with ``backend`` (``"blas"``, ``"numba"``, ``"auto"`` or None: the CPU's
    choice) goes through it; call it before the output is staged. Returns whether it did.

    OpenBLAS maps a buffer (32 MiB or more) at the first product above its small-matrix
    size (its own threads' at import) and keeps it for the process: a later caller, on any
    thread, takes a free one (the batch path's GEMM thread, one product at a time, takes
    this one). Where the address-space limit (``ulimit -v``) refuses that mapping, OpenBLAS
    ends the process from C (``exit(1)``: "OpenBLAS error: Memory allocation still failed
    after 10 retries"), without the cleanup that removes a staged output; called first, it
    ends the command before anything is written, and what the product allocates later is
    Python's, refused as a ``MemoryError`` and cleaned up. A GPU backend, dtypes numpy
    multiplies in its own loops (integers, float16 on ``auto``'s numba kernels, long double,
    object) and distmm's numba kernels multiply nothing through BLAS: nothing is mapped."""
    import numpy as np

    from distmm.executor import GPU_BACKENDS
    from distmm.plan import accumulate_dtype

    acc = accumulate_dtype(dtype)
    numba = backend == "numba" or (backend in (None, "auto") and np.dtype(dtype) == np.float16)
    if backend in GPU_BACKENDS or acc.name not in _BLAS_DTYPES or (numba and acc.kind == "f"):
        return False
    x = np.ones((256, 256))  # above every OpenBLAS small-matrix size (no buffer below it)
    x @ x
    return True
