"""GPU executor: distmm's CUDA kernels or cuBLAS, launched through CuPy.

This module covers: multiplying device (cupy) operands with ``backend="raw"`` (the best
kernel of ``distmm.executor.registry``, with the autotuned configuration of this GPU and dtype when
``distmm tune`` has stored one), ``backend="cublas"`` (``cupy.matmul``) or ``"auto"`` (the
faster of the two as measured by ``distmm tune`` for this GPU, dtype and shape class, with
sound defaults before any tuning); numpy's dtype semantics on the device (integers wrap,
booleans stay boolean, float16 accumulates in float32); host operands through
``run_plan`` and ``matmul_to`` (the stream pipeline of ``distmm.executor.pipeline``).

It does *not* cover: tiling or scheduling (``distmm.plan``, ``distmm.engine``), compiling
kernels (``distmm.executor.cuda_loader``), or tuning (``distmm.cli.tune``).

Importing this module without cupy raises ImportError (``get_executor`` turns it into
``BackendUnavailable`` with the install hint).
"""
from __future__ import annotations

import logging
import numpy as np

import cupy

import distmm.executor.registry as registry
from distmm.executor import tuning
from distmm.executor.base import BackendUnavailable, Executor
from distmm.executor.cublas import CublasGemm, cublas_gemm, start_cublas
from distmm.executor.cuda_loader import compute_capability
from distmm.executor.device import device_count, gpu_name
from distmm.plan import np_dtype

__all__ = ["GPUExecutor", "RAW_DTYPES", "shape_class", "matmul_to", "executor_for"]

log = logging.getLogger("distmm.executor.gpu")

#: dtypes distmm's kernels compute directly
RAW_DTYPES = frozenset(registry.DTYPES)


_FLOATS = ("float32", "float64")

_executors: dict = {}


def executor_for(backend: str = "auto", precision: str = "highest") -> "GPUExecutor":
    """The GPU executor of ``backend`` (and precision mode) for the current device, made
    once per process (its kernel choice, tuned parameters and device properties are read
    once)."""
    key = (backend, cupy.cuda.runtime.getDevice()) + ((precision,) if precision != "highest" else ())
    ex = _executors.get(key)
    if ex is None:
        ex = _executors.setdefault(key, GPUExecutor(backend=backend, precision=precision))
    return ex


_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    """``np.dtype(dtype).name``, remembered: numpy builds the name string on every
    access, twice per call on the cupy hot path."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = np.dtype(dtype).name
    return name


def shape_class(m: int, n: int, k: int) -> str:
    """The size class ``auto`` decides by (``tuning.SHAPE_CLASSES``): ``small`` (under
    1024^3 work), ``medium`` (under 4096^3) or ``large``; ``skinny`` when one of m, n is
    under 128."""
    if min(m, n) < 128:
        return "skinny"
    work = m * n * k
    if work < 1024**3:
        return "small"
    if work < 4096**3:
        return "medium"
    return "large"


def _operand(x):
    """``(array, ld, trans)`` describing a 2-D cupy array as a row-major matrix (``trans``
    False, row stride ``ld``) or a transposed one (column-major storage), without copying
    when the strides allow; otherwise a C-contiguous copy."""
    r, c = x.shape
    isz = x.itemsize
    s0, s1 = x.strides
    if (c <= 1 or s1 == isz) and (r <= 1 or (s0 > 0 and s0 % isz == 0 and s0 // isz >= c)):
        return x, (s0 // isz if r > 1 else max(c, 1)), False
    if (r <= 1 or s0 == isz) and (c <= 1 or (s1 > 0 and s1 % isz == 0 and s1 // isz >= r)):
        return x, (s1 // isz if c > 1 else max(r, 1)), True
    x = cupy.ascontiguousarray(x)
    return x, max(c, 1), False


class GPUExecutor(Executor):
    """Multiply on the current CUDA device.

    Parameters
    ----------
    backend : {"auto", "raw", "cublas"}
        ``"raw"``: distmm's kernels for float32, float64, int32 and int64 (other dtypes are
        computed in one of those, or by cuBLAS for complex); ``"cublas"``: ``cupy.matmul``;
        ``"auto"``: per dtype and shape class, whichever ``distmm tune`` measured faster on
        this GPU (before tuning: cuBLAS for floating point, distmm's kernels for integers,
        which cuBLAS does not cover).
    kernel : str, optional
        Registry name of the raw kernel (default: ``registry.best_kernel()``, the last
        step: ``dmma``, FP64 tensor cores for float64 and step 8's SIMT code otherwise).
    params : mapping, optional
        Template parameters for a tunable kernel (default: tuned, else the registry's).
    precision : {"highest", "tf32", "bf16", "fp16"}
        ``distmm.precision``'s mode. A reduced mode applies to float32 products
        (float16 ones are computed in float32): with ``backend="raw"`` the registry's
        kernel for the mode (``registry.kernel_for``) where one exists for this GPU, else
        cuBLAS (``cublas.cublas_gemm_precision``). ``"auto"`` takes cuBLAS for the reduced
        modes: it is as fast as distmm's fastest tensor-core kernel at large squares and
        faster at small and thin shapes (``bench/NOTES.md``, tensor-core steps).

    Raises
    ------
    ValueError
        Unknown backend.
    BackendUnavailable
        No CUDA device.
    """

    def __init__(self, backend: str = "auto", *, kernel: str | None = None, params=None,
                 precision: str = "highest"):
        if backend not in ("auto", "raw", "cublas"):
            raise ValueError(f"GPU backend must be 'auto', 'raw' or 'cublas', got {backend!r}")
        from distmm.precision import check_precision

        self.precision = check_precision(precision, what="GPUExecutor")
        self._precision_kernel: list = []  # [KernelSpec or None], looked up once
        if device_count() < 1:
            raise BackendUnavailable("no CUDA device")
        self.backend = backend
        self.name = backend
        self.kernel = registry.get(kernel) if kernel else registry.best_kernel()
        self._params = params
        self._tuning: dict | None = None
        self._entries: dict = {}  # dtype name -> its checked tuning entry (usable_entry)
        self._kparams: dict = {}  # dtype name -> the raw kernel's parameters
        self._closed = False

    def threads_inside(self, dtype) -> bool:
        return True  # one device: the engine runs its tasks one at a time

    # -- choices --------------------------------------------------------------------
    def _tuned(self) -> dict:
        """This GPU's tuned entries: the cache file is read once per process
        (``distmm.executor.tuning.tuning_for``), and once per executor from that copy."""
        if self._tuning is None:
            try:
                self._tuning = tuning.tuning_for(gpu_name())
            except Exception as exc:  # a broken cache must not stop a product
                log.warning("ignoring the tuning cache: %s", exc)
                self._tuning = {}
        return self._tuning

    def _entry(self, dtype: str) -> dict:
        """This GPU's tuning entry for ``dtype`` as ``tuning.usable_entry`` checks it against
        ``registry.best_kernel()`` (what ``distmm tune`` tunes) and this device's compute
        capability: ``{}`` where there is none, or one that does not fit (warned about once)."""
        entry = self._entries.get(dtype)
        if entry is None:
            entry = self._entries[dtype] = tuning.usable_entry(
                self._tuned(), dtype, registry.best_kernel(), compute_capability(),
                gpu=gpu_name(), path=tuning.cache_path())
        return entry

    def kernel_params(self, dtype) -> dict:
        """Template parameters the raw backend uses for ``dtype`` on this GPU."""
        dtype = _dtype_name(dtype)
        p = self._kparams.get(dtype)
        if p is not None:
            return p
        if self._params is not None:
            p = self.kernel.params(dtype, self._params)
        else:
            entry = self._entry(dtype)
            if entry.get("kernel") == self.kernel.name:
                p = registry.kernel_params(self.kernel, dtype, entry["params"],
                                           compute_capability())
            else:
                p = self.kernel.params(dtype)
        self._kparams[dtype] = p
        return p

    def choose(self, dtype, m: int, n: int, k: int) -> str:
        """``"raw"`` or ``"cublas"`` for this product."""
        dtype = _dtype_name(dtype)
        if dtype not in RAW_DTYPES:
            return "cublas"
        if self.backend != "auto":
            return self.backend
        if dtype in ("int32", "int64"):
            return "raw"
        prefer = self._entry(dtype).get("prefer", {})
        return prefer.get(shape_class(m, n, k), "cublas")

    def kernel_facts(self, dtype) -> dict:
        """What selects the kernels of this executor's ``dtype`` products besides the GPU and
        cuBLAS, which may change their bits (a ``--resume`` manifest keeps it): ``"raw"``,
        the kernel and parameters distmm's kernels run with, and for ``backend="auto"``
        ``"prefer"``, the shape classes that run them; ``{}`` where only cuBLAS runs, and
        for integers (whose sums are exact in any order)."""
        dtype = _dtype_name(dtype)
        if dtype not in _FLOATS:
            return {}
        if self.precision != "highest":
            spec = self.precision_kernel()
            if spec is None or dtype != "float32":
                return {}
            params = registry.kernel_params(spec, spec.precisions[self.precision])
            return {"raw": {"kernel": spec.name, "params": params}}
        raw = {"raw": {"kernel": self.kernel.name, "params": dict(self.kernel_params(dtype))}}
        if self.backend == "raw":
            return raw
        if self.backend == "auto":
            prefer = dict(self._entry(dtype).get("prefer", {}))
            if "raw" in prefer.values():
                return {"prefer": prefer, **raw}
        return {}

    # -- Executor interface ------------------------------------------------------------
    def supports(self, dtype) -> bool:
        return np.dtype(dtype).kind in "biufc"

    def asarray(self, x, dtype):
        return cupy.asarray(x, dtype=dtype)

    def to_host(self, x) -> np.ndarray:
        return cupy.asnumpy(x)

    def panel_product(self, a, b, tk: int = 256):
        a = cupy.asarray(a)
        b = cupy.asarray(b)
        out = cupy.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a.dtype, b.dtype))
        self.device_gemm(a, b, out)
        return out

    def close(self) -> None:
        """Nothing to free: the executor holds no device memory between calls (it is shared,
        see ``executor_for``)."""
        self._closed = True

    def empty_host(self, shape, dtype) -> np.ndarray:
        """A fresh host array for a result this executor writes (huge pages, faulted in
        by background threads while the GPU computes: ``distmm.executor.hostmem``)."""
        from distmm.executor.hostmem import empty_host

        return empty_host(shape, dtype)

    def begin(self, plan) -> None:
        """A product of ``plan`` with host operands is about to start: cuBLAS starts now on
        its thread (``start_cublas``), before the engine allocates the result and the
        pipeline its buffers, with the result's first touch held until it is up, so that
        the first GEMM of a fresh process does not wait for cuBLAS's start-up."""
        from distmm.executor.pipeline import FAST_DTYPES

        if np.dtype(plan.dtype) in FAST_DTYPES:
            from distmm.executor.hostmem import hold_until

            hold_until(start_cublas(plan.dtype))

    def start_cublas(self, dtype):
        """cuBLAS's start-up for ``dtype`` on a background thread, once per process and
        device (``distmm.executor.cublas.start_cublas``): its Future."""
        return start_cublas(dtype)

    # -- device GEMM -----------------------------------------------------------------
    def device_gemm(self, a_dev, b_dev, c_dev, *, alpha=1, beta=0, stream=None) -> None:
        """``c_dev = alpha * a_dev @ b_dev + beta * c_dev`` into the preallocated ``c_dev``,
        on ``stream`` (default: cupy's current stream), with this executor's backend.

        ``a_dev`` (m x k) and ``b_dev`` (k x n) may be any strided 2-D views (transposed
        views are passed to the kernels as flags, never copied); they are cast to
        ``c_dev``'s dtype when they differ. ``beta == 0`` means ``c_dev`` is not read.

        Raises
        ------
        ValueError
            Shapes that do not match.
        """
        m, k = a_dev.shape
        k2, n = b_dev.shape
        if k != k2 or tuple(c_dev.shape) != (m, n):
            raise ValueError(f"device_gemm: a {a_dev.shape} @ b {b_dev.shape} does not fit "
                             f"c {c_dev.shape}")
        if m == 0 or n == 0:
            return
        if stream is None:  # cupy's current stream: no context to enter (the per-call path)
            self._gemm(a_dev, b_dev, c_dev, alpha, beta, m, n, k, None)
            return
        with stream:
            self._gemm(a_dev, b_dev, c_dev, alpha, beta, m, n, k, stream)

    def _gemm(self, a_dev, b_dev, c_dev, alpha, beta, m, n, k, stream) -> None:
        dt = c_dev.dtype
        if self.precision != "highest":
            self._reduced_gemm(a_dev, b_dev, c_dev, alpha, beta, stream)
            return
        if a_dev.dtype != dt:
            a_dev = a_dev.astype(dt)
        if b_dev.dtype != dt:
            b_dev = b_dev.astype(dt)
        if self.choose(dt, m, n, k) == "raw":
            self._raw_gemm(a_dev, b_dev, c_dev, alpha, beta,
                           stream if stream is not None else cupy.cuda.get_current_stream())
        else:
            cublas_gemm(a_dev, b_dev, c_dev, alpha, beta)

    def precision_kernel(self):
        """The registry's kernel for this executor's reduced precision on this GPU
        (``registry.kernel_for``) with ``backend="raw"``, or None: cuBLAS then."""
        if not self._precision_kernel:
            spec = None
            if self.backend == "raw":
                spec = registry.kernel_for("float32", self.precision, compute_capability())
            self._precision_kernel.append(spec)
        return self._precision_kernel[0]

    def _reduced_gemm(self, a, b, c, alpha, beta, stream) -> None:
        """``c = alpha * a @ b + beta * c`` in this executor's reduced precision, float32 out."""
        from distmm.executor.cublas import cublas_gemm_precision, to_input_format

        if c.dtype != np.float32:
            raise TypeError(f"precision={self.precision!r} computes float32 products, got a "
                            f"{c.dtype} result")
        spec = self.precision_kernel()
        if spec is None:
            cublas_gemm_precision(a, b, c, self.precision, alpha, beta)
            return
        from distmm.executor import cuda_loader

        m, k = a.shape
        n = b.shape[1]
        if self.precision == "tf32":  # float32 operands; launch_tc rounds them to TF32 copies
            a, lda, ta = _operand(a.astype(np.float32, copy=False))
            b, ldb, tb = _operand(b.astype(np.float32, copy=False))
            # launch_tc checks the matrices as stored: a column-major operand is its .T
            a, b = (a.T if ta else a), (b.T if tb else b)
        else:  # 16-bit operands, rounded here (bfloat16 bits as uint16, or float16)
            (a, _), (b, _) = to_input_format(a, self.precision), to_input_format(b, self.precision)
            lda, ta, ldb, tb = k, False, n, False
        target = c if c.flags.c_contiguous else cupy.ascontiguousarray(c)
        params = registry.kernel_params(spec, spec.precisions[self.precision])
        cuda_loader.launch(spec.name, a, ta, lda, b, tb, ldb, target, n, m, n, k,
                           alpha=alpha, beta=beta, params=params,
                           stream=stream if stream is not None else cupy.cuda.get_current_stream())
        if target is not c:
            c[...] = target

    def _raw_gemm(self, a, b, c, alpha, beta, stream) -> None:
        from distmm.executor import cuda_loader

        m, k = a.shape
        n = b.shape[1]
        dtype = np.dtype(c.dtype).name
        a, lda, ta = _operand(a)
        b, ldb, tb = _operand(b)
        direct = c.ndim == 2 and (n <= 1 or c.strides[1] == c.itemsize) and (
            m <= 1 or (c.strides[0] > 0 and c.strides[0] % c.itemsize == 0
                       and c.strides[0] // c.itemsize >= n))
        target = c if direct else cupy.ascontiguousarray(c)
        ldc = target.strides[0] // target.itemsize if m > 1 else max(n, 1)
        cuda_loader.launch(self.kernel.name, a, ta, lda, b, tb, ldb, target, ldc, m, n, k,
                           alpha=alpha, beta=beta, params=self.kernel_params(dtype),
                           stream=stream)
        if not direct:
            c[...] = target

    # -- whole products ----------------------------------------------------------------
    def run_batched(self, plan, a, b):
        """``a @ b`` for cupy operands shaped ``batch + (m, k)`` and ``batch + (k, n)``
        (broadcast views allowed), with numpy's result dtype ``plan.dtype``.

        Returns
        -------
        cupy.ndarray of shape ``batch + (m, n)``.
        """
        res = np_dtype(plan.dtype)
        batch = tuple(a.shape[:-2])
        m, k, n = plan.m, plan.k, plan.n
        if not batch and k and m and n and a.dtype == b.dtype == res and _dtype_name(res) in _FLOATS:
            # The common case, one float product in its own dtype. With cuBLAS it is
            # cupy.matmul's own call (no out=, no empty()): the same GPU work as cupy's.
            if self.precision == "highest" and self.choose(res, m, n, k) == "cublas":
                return cupy.matmul(a, b)
            out = cupy.empty((m, n), dtype=res)
            self._gemm(a, b, out, 1, 0, m, n, k, None)
            return out
        out = cupy.empty(batch + (m, n), dtype=res)
        if out.size == 0:
            return out
        if k == 0:
            out[...] = 0
            return out
        compute = self._compute_dtype(res)
        for idx in np.ndindex(*batch):
            a2, b2 = a[idx], b[idx]
            if compute is None:  # complex and others: cuBLAS / cupy in the result dtype
                out[idx] = cupy.matmul(a2.astype(res, copy=False), b2.astype(res, copy=False))
                continue
            if compute == res:
                self.device_gemm(a2, b2, out[idx])
            else:
                tmp = cupy.empty((m, n), dtype=compute)
                self.device_gemm(a2.astype(compute, copy=False), b2.astype(compute, copy=False), tmp)
                out[idx] = (tmp != 0) if res.kind == "b" else tmp.astype(res)
        return out

    def replayer(self, plan, a_dtype, b_dtype):
        """``f(a, b)``: ``run_batched(plan, a, b)`` for 2-D cupy operands of
        ``a_dtype`` and ``b_dtype``, its choices (cuBLAS or the raw kernels,
        the output) made once, here; ``f`` returns None when ``a``, ``b`` or the
        current device is not this executor's device. None when the product is
        not the common case (one float product in its own dtype)."""
        res = np_dtype(plan.dtype)
        m, n, k = plan.m, plan.n, plan.k
        if self.precision != "highest":
            return None  # run_batched each time: its reduced path converts the operands
        if not (k and m and n and a_dtype == b_dtype == res and _dtype_name(res) in _FLOATS):
            return None
        get_device = cupy.cuda.runtime.getDevice
        device = get_device()  # executor_for gives each device its own executor
        if self.choose(res, m, n, k) == "cublas":
            matmul = cupy.matmul

            def replay(a, b):
                if a.data.device_id != device or b.data.device_id != device or get_device() != device:
                    return None
                return matmul(a, b)
        else:
            empty, gemm = cupy.empty, self._gemm

            def replay(a, b):
                if a.data.device_id != device or b.data.device_id != device or get_device() != device:
                    return None
                out = empty((m, n), dtype=res)
                gemm(a, b, out, 1, 0, m, n, k, None)
                return out
        return replay

    @staticmethod
    def _compute_dtype(res: np.dtype):
        """The dtype the kernels compute ``res`` in; None for cupy.matmul in ``res``."""
        if res.name in RAW_DTYPES:
            return res
        if res.kind == "b":
            return np.dtype(np.int32)  # counts; k < 2^31 so a nonzero count never wraps to 0
        if res.kind in "iu":
            return np.dtype(np.int64)  # sums mod 2^64 narrow to numpy's wrap-around result
        if res == np.float16:
            return np.dtype(np.float32)
        return None

    def run_plan(self, plan, a, b, out) -> None:
        """Compute one 2-D product of host operands into the host array ``out``
        (``plan.dtype``): the multi-stream pinned pipeline when available, else copy in,
        compute, copy out."""
        from distmm.executor.pipeline import FAST_DTYPES, run_pipelined

        if np.dtype(plan.dtype) in FAST_DTYPES:
            run_pipelined(self, plan, a, b, out)
            return
        # Other dtypes (integers, bool, float16, complex): whole operands through the device.
        a_dev = cupy.asarray(np.asarray(a[...]) if not isinstance(a, np.ndarray) else a)
        b_dev = cupy.asarray(np.asarray(b[...]) if not isinstance(b, np.ndarray) else b)
        out[...] = cupy.asnumpy(self.run_batched(plan, a_dev, b_dev))

    def __repr__(self) -> str:
        extra = "" if self.precision == "highest" else f", precision={self.precision!r}"
        return f"GPUExecutor(backend={self.backend!r}, kernel={self.kernel.name!r}{extra})"


def matmul_to(a, b, out=None, *, backend: str = "cublas", device_memory_limit=None,
              trace=None, pinned_pool=None, info: dict | None = None):
    """``out[...] = a @ b`` on the GPU for operands in host memory or on disk.

    Parameters
    ----------
    a, b : 2-D array-like
        numpy arrays, ``np.load(..., mmap_mode="r")`` memmaps, zarr arrays.
    out : writable 2-D array, optional
        numpy array, memmap or zarr array of shape ``(m, n)``; allocated as a
        numpy array of numpy's result dtype when ``None``.
    backend : {"cublas", "raw", "auto"}
        The kernels ``GPUExecutor.device_gemm`` uses.
    device_memory_limit, trace, pinned_pool, info
        As for ``distmm.executor.pipeline.run_pipelined``.

    Returns
    -------
    out

    Raises
    ------
    ValueError
        Operands that are not 2-D or whose inner dimensions differ.
    TypeError
        A result dtype other than float32 / float64.

    Examples
    --------
    >>> import numpy as np                                    # doctest: +SKIP
    >>> a = np.load("a.npy", mmap_mode="r"); b = np.load("b.npy", mmap_mode="r")  # doctest: +SKIP
    >>> c = np.lib.format.open_memmap("c.npy", "w+", a.dtype, (a.shape[0], b.shape[1]))  # doctest: +SKIP
    >>> matmul_to(a, b, c, device_memory_limit="8GB")          # doctest: +SKIP
    """
    from distmm.plan import make_plan, result_dtype

    for name, x in (("a", a), ("b", b)):
        if len(x.shape) != 2:
            raise ValueError(f"matmul_to: operand {name} must be 2-D, got shape {tuple(x.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_to: inner dimensions differ: a has shape {tuple(a.shape)}, "
                         f"b has shape {tuple(b.shape)}")
    m, k = (int(v) for v in a.shape)
    n = int(b.shape[1])
    dtype = result_dtype(np.dtype(a.dtype), np.dtype(b.dtype))
    if out is None:
        out = np.empty((m, n), dtype=dtype)
    plan = make_plan(m, n, k, dtype, workers=1, tile=(max(m, 1), max(n, 1), max(k, 1)))
    from distmm.executor.pipeline import run_pipelined

    executor = CublasGemm() if backend == "cublas" else GPUExecutor(backend=backend)
    try:
        return run_pipelined(executor, plan, a, b, out, device_memory_limit=device_memory_limit,
                             pinned_pool=pinned_pool, trace=trace, info=info)
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            close()
