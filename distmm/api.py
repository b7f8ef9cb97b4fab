"""The public API: ``matmul`` and ``gemm`` with numpy's semantics.

This module covers: validating operands with numpy's rules and exception
types before any work starts, promoting 1-D operands and broadcasting batch
dimensions, choosing the engine and backend, and returning the caller's array
type (numpy in, numpy out; cupy in, cupy out; dask in, a lazy dask array out).
It also keeps the call cache: what a call resolves (validation's shapes and
dtype, the engine, the backend and the plan) is remembered per call signature,
so a repeated small product costs little more than numpy's or cupy's own call.
It does *not* cover: tiling (``distmm.plan``), scheduling (``distmm.engine``)
or kernels (``distmm.executor``).
"""
from __future__ import annotations

import contextlib
import decimal
import math
import numbers
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from distmm._arrays import FAMILY_ORDER, array_family, unsupported
from distmm.config import get_config, memory_budget
from distmm.engine import ENGINES, Operands, Request, get_engine
from distmm.engine.base import replace_fast
from distmm.executor import BACKENDS, resolve_backend
from distmm.hdf5_filters import check_filters, dataset_name, datasets_of, is_dataset
from distmm import plan as planner
from distmm.plan import Plan, matmul_shapes, result_dtype, sums_whole_k, ufunc_dtype
from distmm.precision import check_precision
from distmm import fpflags, out_arrays, ufunc_rules

__all__ = ["matmul", "gemm", "make_plan", "plan_for", "resolve_precision", "CALLS", "CallCache"]


def _on_disk(x) -> bool:
    """A 2-D array-like that reads by slices (zarr array, h5py dataset): kept
    as it is, so the engines read only the panels a task needs."""
    return (not isinstance(x, np.ndarray) and getattr(x, "ndim", None) == 2
            and hasattr(x, "dtype") and hasattr(x, "shape") and hasattr(x, "__getitem__")
            and not hasattr(x, "__array_namespace__") and array_family(x) == "numpy")


def _as_array(x, family: str):
    if family == "numpy":
        return x if isinstance(x, np.ndarray) or _on_disk(x) else np.asarray(x)
    if family == "cupy":
        import cupy

        return cupy.asarray(x)
    if family == "dask":
        import dask.array as da

        if isinstance(x, da.Array):
            return x
        if not hasattr(x, "dtype"):
            x = np.asarray(x)
        # one chunk (the array is in memory) where dask's automatic chunks fail: object
        # arrays, and empty ones (a division by zero for shapes such as (3, 0, 357))
        one = x.dtype == object or math.prod(x.shape) == 0
        return da.asarray(x, chunks=-1) if one else da.asarray(x)
    raise AssertionError(family)


def _same_chunk_family(a, b):
    """Dask operands whose chunks live in different places (cupy and numpy chunks): the
    host one's chunks copied to the device as they are computed, so that every task
    multiplies two cupy chunks (a mix of cupy and numpy operands gives cupy, as on one GPU)."""
    from dask.array.utils import meta_from_array

    device = [not isinstance(meta_from_array(x), np.ndarray) for x in (a, b)]
    if device[0] == device[1]:
        return a, b
    import cupy

    def to_device(x):
        return x.map_blocks(cupy.asarray, dtype=x.dtype,
                            meta=cupy.empty((0,) * x.ndim, dtype=x.dtype))

    return (a if device[0] else to_device(a)), (b if device[1] else to_device(b))


def _python_scalar_keywords(a, b, out, **keywords) -> None:
    """numpy's own exception for a Python scalar operand with numpy's keywords: the scalar is
    weak under NEP 50 (numpy 2), so a strict ``casting`` can pass and the missing dimension
    is the error (a ValueError), which an int64 stand-in would turn into a cast error. A
    scalar operand always fails: numpy is asked, on empty stand-ins of the others."""
    if not any(type(x) in (bool, int, float, complex) for x in (a, b)):
        return

    def stand_in(x):
        if type(x) in (bool, int, float, complex):
            return x
        x = x if hasattr(x, "dtype") and hasattr(x, "ndim") else np.asarray(x)
        return np.empty((0,) * max(x.ndim, 1), np.dtype(x.dtype))

    # axes, axis and keepdims come only where given, None too (numpy refuses None for them)
    given = {k: v for k, v in keywords.items()
             if v is not None or k in ("axes", "axis", "keepdims")}
    if out is not None:
        given["out"] = np.empty(tuple(out.shape), np.dtype(out.dtype))
    np.matmul(stand_in(a), stand_in(b), **given)  # raises numpy's exception
    raise AssertionError("numpy accepted a scalar matmul operand")


def _refuse_unsupported(what: str, family: str, **operands) -> None:
    """One line, before any work, for an operand distmm cannot multiply as it is
    (``distmm._arrays.unsupported``), or an h5py dataset that needs an HDF5 filter this
    process lacks (``_refuse_missing_filter``)."""
    for name, x in operands.items():
        why = unsupported(x, family)
        if why is not None:
            raise why[0](f"{what}: operand {name} {why[1]}")
        _refuse_missing_filter(x, f"{what}: operand {name}")


def _refuse_missing_filter(x, what: str) -> None:
    """A ValueError, before any read or write, for an h5py dataset (an operand, ``out=``)
    stored through a filter this HDF5 cannot apply (a plugin not installed:
    ``distmm.hdf5_filters``), naming it and the filter: HDF5 itself fails only where a block
    is read or written, once the work began (on a Dask worker for a cluster's product); the
    same for each dataset a dask array reads (``datasets_of``), which fails once computed."""
    if is_dataset(x) and x.id.valid:
        check_filters(x, f"{what} (HDF5 dataset {dataset_name(x)})")
    for ds in datasets_of(x):  # a dask array that reads h5py datasets when computed
        check_filters(ds, f"{what} (dask array of HDF5 dataset {dataset_name(ds)})")


def _validate(a, b, what: str = "matmul", *, out=None, dtype=None, casting="same_kind",
              order="K") -> Operands:
    defaults = dtype is None and out is None and casting == "same_kind" and order == "K"
    if type(a) is np.ndarray and type(b) is np.ndarray:
        fam = "numpy"  # the common case, without the dispatch
    else:
        fam = max((array_family(a), array_family(b)), key=FAMILY_ORDER.index)
        _refuse_unsupported(what, fam, a=a, b=b)
        try:
            _python_scalar_keywords(a, b, out, dtype=dtype, casting=casting, order=order)
        except ValueError:
            if not defaults:
                raise
            # numpy converted the scalar and found its missing dimension: distmm's own
            # line below names the operand
        a, b = _as_array(a, fam), _as_array(b, fam)
        if fam == "dask":
            a, b = _same_chunk_family(a, b)
    # numpy resolves the loop (dtypes) and the casts into it and into out before it looks
    # at dimensions; it casts the values only after.
    cast_to = None
    if defaults:
        dtype = result_dtype(np.dtype(a.dtype), np.dtype(b.dtype))
    else:
        out_dtype = getattr(out, "dtype", None) if fam != "dask" else None
        loop = ufunc_dtype(a.dtype, b.dtype, dtype=dtype, out_dtype=out_dtype,
                           casting=casting, order=order)
        if dtype is not None:  # numpy casts both operands into the loop it names
            cast_to = loop
        dtype = loop
    for name, x in (("a", a), ("b", b)):
        if x.ndim == 0:
            raise ValueError(
                f"{what}: operand {name} is 0-dimensional (a scalar); matmul needs at "
                f"least 1 dimension: use * to multiply by a scalar"
            )
    for name, x in (("a", a), ("b", b)) if fam == "dask" else ():
        if any(s is None or (isinstance(s, float) and np.isnan(s)) for s in x.shape):
            raise ValueError(
                f"{what}: operand {name} has unknown chunk sizes (shape {x.shape}); "
                f"call {name}.compute_chunk_sizes() first"
            )
    batch, m, n, k = matmul_shapes(a.shape, b.shape, what=what)
    if (out is None and fam != "dask"
            and math.prod(batch) * m * n * np.dtype(dtype).itemsize > np.iinfo(np.intp).max):
        raise ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than "
                         "the maximum possible size.")  # numpy's words, before any planning
    ops = Operands(a, b, fam, dtype, a.ndim == 1, b.ndim == 1, batch, m, n, k)
    if out is not None:  # out's shape too is checked before any value is cast
        _check_out(out, ops)
        _refuse_missing_filter(out, f"{what}: out")
    if cast_to is not None:
        a, b = (x if np.dtype(x.dtype) == cast_to else _cast(x, cast_to) for x in (a, b))
        ops = replace(ops, a=a, b=b)
    return ops


def _cast(x, dtype):
    """An operand converted to numpy's loop dtype (``matmul(..., dtype=)``)."""
    return x.astype(dtype) if hasattr(x, "astype") else np.asarray(x).astype(dtype)


def resolve_precision(precision, dtype, *, what: str = "matmul", config=None) -> str:
    """The precision mode of a product of numpy result dtype ``dtype``: ``precision``
    checked against ``dtype`` (``distmm.precision.check_precision``: ValueError for an
    unknown name, TypeError for a reduced mode on a dtype it does not apply to); when it is
    None, the configured ``distmm.precision`` where it applies to ``dtype`` and "highest"
    where it does not (a default set for float32 work leaves float64 products exact, as
    cuBLAS's and PyTorch's TF32 settings do)."""
    if precision is None:
        configured = (config if config is not None else get_config()).precision
        try:
            return check_precision(configured, dtype, what=what)
        except TypeError:
            return "highest"
    return check_precision(precision, dtype, what=what)


def plan_for(m: int, n: int, k: int, dtype, *, workers: int, tile=None,
             hints: dict | None = None, config=None, on_gpu: bool = False,
             precision: str = "highest") -> Plan:
    """Make a plan with the configured tile and memory budget: the one place
    distmm plans a product. ``hints`` are an engine's ``plan_hints``; an
    explicit or configured tile wins over a hinted one, and the memory budget
    is the lower of ``distmm.config.memory_budget(on_gpu)`` and a hinted one."""
    cfg = config if config is not None else get_config()
    hints = dict(hints) if hints else {}
    tile = tile if tile is not None else cfg.tile
    if tile is None:
        tile = hints.pop("tile", None)
    hints.pop("tile", None)
    budget = memory_budget(on_gpu, config=cfg)
    hinted = hints.pop("memory_budget", None)
    if hinted is not None:
        budget = min(budget, int(hinted))
    return planner.make_plan(m, n, k, dtype, workers=workers, tile=tile, memory_budget=budget,
                             precision=precision, **hints)


def _engine_for(engine: str, family: str, client, cfg, ops: Operands | None = None,
                what: str = "matmul"):
    """The engine of one call (``get_engine``, with the configured local thread
    count and retry timeout): resolved once per call and handed to everything
    that needs it, so a Dask engine asks its scheduler for the cluster once. ``"auto"``
    is the configured ``distmm.engine``; ``what``: the function called, for its errors."""
    if engine == "auto":
        engine = cfg.engine
    return get_engine(engine, family=family, client=client, threads=cfg.local_threads,
                      retry_timeout=cfg.retry_timeout, operands=ops, what=what)


def _backend_family(ops: Operands) -> str:
    """Where the operands' elements live, as ``resolve_backend`` reads ``family``:
    ``"cupy"`` for cupy arrays and for dask arrays of cupy chunks."""
    if ops.family == "dask":
        from dask.array.utils import meta_from_array

        host = all(isinstance(meta_from_array(x), np.ndarray) for x in (ops.a, ops.b))
        return "numpy" if host else "cupy"
    return ops.family


def _resolve(eng, ops: Operands, cfg, *, tile, backend: str, out=None,
             workers: int | None = None, hints: dict | None = None,
             precision: str = "highest") -> Request:
    """The request of one call on ``eng``: the backend resolved and the plan made
    from the configuration ``cfg``, once. ``workers`` and ``hints`` (``make_plan``'s
    arguments) stand in for the engine's worker count and join its plan hints."""
    if backend == "auto" and ops.family == "numpy":
        backend = cfg.backend
    flops = 2 * ops.m * ops.n * ops.k * max(math.prod(ops.batch), 1)
    backend, on_gpu = resolve_backend(backend, ops.dtype, family=_backend_family(ops),
                                      flops=flops, workers_decide=eng.name == "dask")
    if workers is None:
        workers = eng.workers(ops, on_gpu=on_gpu)
    hints = {**eng.plan_hints(ops, workers), **(hints or {})}
    plan = plan_for(ops.m, ops.n, ops.k, ops.dtype, workers=workers, tile=tile,
                    hints=hints, config=cfg, on_gpu=on_gpu, precision=precision)
    return Request(ops, plan, backend, on_gpu=on_gpu, out=out, progress=cfg.progress,
                   report=cfg.performance_report)


def _request(ops: Operands, *, engine: str, client, tile, backend: str, out=None):
    """``(engine, request)`` of a call: the engine, the backend and the plan resolved
    once, under the configuration in force."""
    cfg = get_config()
    eng = _engine_for(engine, ops.family, client, cfg, ops)
    return eng, _resolve(eng, ops, cfg, tile=tile, backend=backend, out=out)


def make_plan(m: int, n: int, k: int, dtype="float64", *, workers: int | None = None,
              tile=None, backend: str = "auto", k_splits: int | None = None,
              owner_order: str = "rows", precision: str | None = None) -> Plan:
    """The plan ``distmm.matmul`` makes for numpy operands of these sizes.

    The same path as the call itself: the configured backend (``distmm.backend``)
    resolved for this product, the local engine's worker count, and the tile
    and memory budget from ``distmm.config`` (``distmm.tile``,
    ``distmm.memory-budget``, through ``plan_for``). This is what
    ``distmm plan`` prints. ``distmm.plan.make_plan`` is the pure planner
    underneath: it reads no configuration and takes every input as given.

    Parameters
    ----------
    m, n, k : int
        ``C[m, n] = A[m, k] @ B[k, n]``.
    dtype : dtype
        numpy's result dtype of the product.
    workers : int, optional
        Plan for this many workers; default: what the local engine runs
        (``distmm.local-threads``, else the CPUs this process may use; 1 on a GPU).
    tile : int or (tm, tn, tk), optional
        As ``matmul``'s ``tile``: wins over ``distmm.tile``.
    backend : {"auto", "numba", "blas", "raw", "cublas"}
        As ``matmul``'s ``backend``; it decides whether the product runs on a
        GPU, and so which memory budget applies.
    k_splits, owner_order
        As ``distmm.plan.make_plan``.
    precision : {"highest", "tf32", "bf16", "fp16"}, optional
        As ``matmul``'s ``precision``; default ``distmm.precision``.

    Returns
    -------
    Plan

    Raises
    ------
    ValueError
        A negative size, a worker count below 1, an unknown backend, or a
        configuration value that does not parse.
    TypeError
        A dtype matmul does not take, or a precision it does not take.

    Examples
    --------
    >>> import distmm
    >>> p = distmm.make_plan(1000, 900, 5000, "float64", workers=2, tile=512)
    >>> p.grid, p.k_splits
    ((2, 2), 1)
    """
    dt = result_dtype(np.dtype(dtype), np.dtype(dtype))
    if workers is not None and (isinstance(workers, bool)
                                or not isinstance(workers, (int, np.integer))):
        raise TypeError(f"make_plan: workers must be an integer, got {workers!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    cfg = get_config()
    precision = resolve_precision(precision, dt, what="make_plan", config=cfg)
    ops = Operands(None, None, "numpy", dt, False, False, (), m, n, k)
    hints = {} if k_splits is None else {"k_splits": k_splits}
    if owner_order != "rows":
        hints["owner_order"] = owner_order
    return _resolve(_engine_for("local", "numpy", None, cfg), ops, cfg, tile=tile,
                    backend=backend, workers=workers, hints=hints, precision=precision).plan


# -- the call cache ---------------------------------------------------------------

@dataclass(frozen=True)
class _Resolved:
    """What one call signature resolved to: every field of ``Operands`` but the
    arrays, and the engine, backend and plan of its ``Request``, with the
    configuration they were resolved under."""

    config: Any
    engine: Any
    operands: Operands  # without its arrays (a and b are None)
    request: Request  # without its operands
    convert: Any  # cupy.asarray for cupy operands (it copies from another device), else None
    replay: Any = None  # the engine's replayer (``Engine.replayer``), else None

    @property
    def plan(self) -> Plan:
        return self.request.plan


class CallCache:
    """A bounded memo of resolved calls, keyed by call signature.

    The key is everything validation, backend resolution and planning read from
    the call: the operand types, shapes, strides (so C and F order differ),
    dtypes (with numpy's type character: ``np.longlong`` is not ``np.int64``),
    and the ``engine``, ``backend``, ``tile`` and ``precision`` arguments (a
    ``precision`` of None reads ``distmm.precision``, which the configuration
    check below covers). What lies outside the
    key is checked on every hit, so a hit is never stale:

    - the configuration: the ``Config`` object ``get_config()`` returns (a new
      one after ``dask.config.set``, a refresh or a changed environment);
    - the engine ``get_engine`` picks (a default Dask client appearing turns
      ``engine="auto"`` from local to dask);
    - the engine's worker count and plan hints, and the memory budget
      (``distmm.config.memory_budget``: configured, or measured at most once a
      second and rounded to 64 MiB when ``"auto"``), except where the engine
      replays the call itself (``Engine.replayer``: 2-D cupy products, whose
      result these cannot change; the replayer checks that the operands and
      the current device are still the entry's device).

    Only calls the local engine runs, with numpy or cupy operands taken as
    they are (no conversion), are cached; a full cache drops its oldest entry.
    """

    def __init__(self, maxsize: int = 256):
        self.maxsize = maxsize
        #: calls served from an entry
        self.hits = 0
        #: entries stored (calls resolved in full that may be replayed)
        self.misses = 0
        #: the ``_Resolved`` of the last call that went through the cache
        self.last: _Resolved | None = None
        self._entries: dict = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0
            self.last = None

    def get(self, key):
        """The entry of ``key`` or None (TypeError: an unhashable key)."""
        return self._entries.get(key)

    def put(self, key, entry: _Resolved) -> None:
        with self._lock:
            self._entries.pop(key, None)
            while len(self._entries) >= self.maxsize:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = entry
            self.misses += 1
            self.last = entry


#: the process's call cache
CALLS = CallCache()


def _lookup(a, b, engine: str, tile, backend: str, precision=None):
    """``(key, entry)``: the cache key of ``matmul(a, b, ...)`` and its cached
    entry (None on a miss); ``(None, None)`` for operands without array
    attributes (lists, scalars, on-disk arrays) or an unhashable tile."""
    try:
        key = (type(a), type(b), a.shape, b.shape, a.strides, b.strides, a.dtype, a.dtype.char,
               b.dtype, b.dtype.char, engine, backend, tile, precision)
        return key, CALLS.get(key)
    except (AttributeError, TypeError):
        return None, None


def _reuse(entry: _Resolved, a, b, eng, cfg):
    """The request of a cached call on ``eng`` (this call's engine), or the
    engine's replayer (which takes ``(a, b)``), or None when anything outside
    the key changed since it was resolved (see ``CallCache``)."""
    if cfg is not entry.config or eng is not entry.engine:
        return None
    if entry.replay is not None:
        # The engine replays the product itself: what the cache checks below cannot change
        # its result (Engine.replayer), and the replayer checks the operands' device.
        return entry.replay
    if entry.convert is not None and (entry.convert(a) is not a or entry.convert(b) is not b):
        return None
    request = entry.request
    ops = replace_fast(entry.operands, a=a, b=b)
    plan, on_gpu = request.plan, request.on_gpu
    workers = eng.workers(ops, on_gpu=on_gpu)
    if (workers != plan.workers or eng.plan_hints(ops, workers)
            or memory_budget(on_gpu, config=cfg) != plan.memory_budget):
        return None
    return replace_fast(request, operands=ops)


def _remember(key, ops: Operands, eng, request: Request, a, b, cfg) -> None:
    """Cache a resolved call when it may be replayed exactly: local engine,
    numpy or cupy operands used as given, no plan hints."""
    if eng.name != "local" or ops.a is not a or ops.b is not b:
        return
    if ops.family == "numpy":
        convert = None
    elif ops.family == "cupy":
        import cupy

        convert = cupy.asarray
    else:
        return
    if eng.plan_hints(ops, request.plan.workers) or request.out is not None:
        return
    bare = replace_fast(ops, a=None, b=None)
    CALLS.put(key, _Resolved(cfg, eng, bare, replace_fast(request, operands=bare), convert,
                             eng.replayer(request)))


def _run(eng, ops: Operands, cfg, *, tile, backend: str, out=None, precision: str = "highest"):
    return _squeeze(eng.run(_resolve(eng, ops, cfg, tile=tile, backend=backend, out=out,
                                     precision=precision)), ops)


def _squeeze(out, ops: Operands):
    if ops.family == "dask" and (ops.a_vector or ops.b_vector):
        # as dask's own matmul: squeezed, so a vector @ vector computes to a 0-d array
        return out.squeeze(axis=((-2,) if ops.a_vector else ()) + ((-1,) if ops.b_vector else ()))
    if ops.b_vector:
        out = out[..., 0]
    if ops.a_vector:
        out = out[..., 0, :] if not ops.b_vector else out[..., 0]
    if ops.family == "numpy" and isinstance(out, np.ndarray) and out.dtype.type is not ops.dtype.type:
        out = out.view(ops.dtype)  # numpy's own type (np.longlong where it gives one)
    if out.ndim == 0 and ops.family == "numpy":
        return out[()]  # numpy gives a scalar for vector @ vector
    return out


def _empty(ops: Operands) -> bool:
    """Whether the product has no element: m, n or a batch dimension is 0."""
    return ops.m == 0 or ops.n == 0 or 0 in ops.batch


def _planned(ops: Operands) -> Operands:
    """``ops`` as the planner sees them: a product without elements (``_empty``) without its
    k too, which no tile reads (numpy makes it at once; a plan of a k too long to list in
    tiles would be refused with a MemoryError)."""
    return replace(ops, k=0) if ops.k and _empty(ops) else ops


def _loop_writes_out(out, ops: Operands, operands) -> bool:
    """Whether numpy's loop writes ``out`` itself: a numpy array of the result's dtype that
    shares no memory with a numpy operand (numpy's own check, which takes a case too hard to
    decide for an overlap); otherwise it writes a buffer, copied into ``out`` only when the
    loop ends without an error."""
    if not isinstance(out, np.ndarray) or np.dtype(out.dtype) != ops.dtype:
        return False
    for x in operands:
        if isinstance(x, np.ndarray):
            try:
                if np.shares_memory(out, x, max_work=1):
                    return False
            except np.exceptions.TooHardError:
                return False
    return True


def _writes_direct(out, ops: Operands, eng) -> bool:
    """Whether engine ``eng`` can write tiles into ``out`` itself: the local or
    the Dask engine (whose workers write a staged output file themselves), same
    dtype and shape as the 2-D result, host memory or an on-disk array, and no
    overlap with an operand."""
    if (eng.name not in ("local", "dask") or ops.family != "numpy" or ops.batch
            or ops.a_vector or ops.b_vector):
        return False
    if np.dtype(out.dtype) != ops.dtype or tuple(out.shape) != (ops.m, ops.n):
        return False
    if any(out_arrays.aliases(out, x) for x in (ops.a, ops.b)):
        return False  # the same file or store: numpy's temporary
    if isinstance(out, np.ndarray):
        return not any(isinstance(x, np.ndarray) and np.may_share_memory(out, x) for x in (ops.a, ops.b))
    return _on_disk(out)


def _check_disk_out(out, ops: Operands, eng) -> None:
    """An on-disk ``out`` checked before any work (``distmm.out_arrays.check``)."""
    if out_arrays.on_disk(out):
        out_arrays.check(out, ops, eng.name, _writes_direct(out, ops, eng))


def _whole_k(ops: Operands) -> Operands:
    """Dask operands of a float16, long double or object product with k in one chunk:
    numpy sums each element over k in one ascending sum, which partial sums of k chunks
    added afterwards do not reproduce (``plan.sums_whole_k``). Other products keep their
    chunks."""
    if ops.family != "dask" or not sums_whole_k(ops.dtype):
        return ops
    a = ops.a if len(ops.a.chunks[-1]) <= 1 else ops.a.rechunk({ops.a.ndim - 1: -1})
    k_axis = 0 if ops.b_vector else ops.b.ndim - 2
    b = ops.b if len(ops.b.chunks[k_axis]) <= 1 else ops.b.rechunk({k_axis: -1})
    return ops if a is ops.a and b is ops.b else replace(ops, a=a, b=b)


def _check_out(out, ops: Operands):
    """numpy's rule for ``out``'s shape: the result broadcasts into it (core dimensions
    equal, batch dimensions broadcast). Its dtype was checked with the operands'
    (``_validate``: numpy's casting rule)."""
    shape = ops.batch + ((ops.m,) if not ops.a_vector else ()) + ((ops.n,) if not ops.b_vector else ())
    out_shape = tuple(out.shape)
    core = len(shape) - len(ops.batch)
    if len(out_shape) < len(shape):  # numpy's flexible core dimensions decide: ask it
        fits = _numpy_takes_out(tuple(ops.a.shape), tuple(ops.b.shape), out_shape)
    else:  # the result broadcasts to out's shape: each of its sizes equal, or 1 (exact
        # ints: np.broadcast_shapes refuses shapes past the largest array)
        padded = (1,) * (len(out_shape) - len(shape)) + shape
        fits = (out_shape[len(out_shape) - core:] == shape[len(shape) - core:]
                and all(s in (o, 1) for o, s in zip(out_shape, padded)))
    if not fits:
        raise ValueError(f"matmul: non-broadcastable output operand with shape {out_shape} "
                         f"doesn't match the broadcast shape {shape} of a {tuple(ops.a.shape)} @ "
                         f"b {tuple(ops.b.shape)}")


def _numpy_takes_out(a_shape: tuple, b_shape: tuple, out_shape: tuple) -> bool:
    """Whether numpy's matmul takes an ``out`` of fewer dimensions than the result (leading
    ones of size 1 left out: ``(3, 2)`` for a ``(1, 3, 2)`` result, ``(3,)`` for ``(1, 3)``),
    asked of numpy itself on tiny operands: every size above 1 mapped to a small one, distinct
    sizes kept distinct, so that its rules (equal, or 1) see what they would see."""
    sizes = sorted({d for d in (*a_shape, *b_shape, *out_shape) if d > 1})
    small = {d: i + 2 for i, d in enumerate(sizes)}
    tiny = lambda shape: np.zeros(tuple(small.get(d, d) for d in shape))  # noqa: E731
    try:
        np.matmul(tiny(a_shape), tiny(b_shape), out=tiny(out_shape))
    except ValueError:
        return False
    return True


#: numpy.matmul's defaults for the keywords distmm.matmul shares with it
_NUMPY_DEFAULTS = {"casting": "same_kind", "order": "K", "dtype": None, "subok": True}


def _is_default(name: str, value) -> bool:
    """Whether a keyword is numpy's default: the same object, or the same string (not ``==``,
    which a dtype answers True against None: ``np.dtype("float64") == None``)."""
    default = _NUMPY_DEFAULTS[name]
    return value is default or (isinstance(value, str) and value == default)


def matmul(a, b, out=None, *, casting="same_kind", order="K", dtype=None, subok=True,
           signature=None, axes=ufunc_rules.NO_VALUE, axis=ufunc_rules.NO_VALUE,
           keepdims=ufunc_rules.NO_VALUE, engine: str = "auto", client=None, tile=None,
           backend: str = "auto", precision: str | None = None):
    """Matrix product with ``numpy.matmul`` semantics, tiled and distributed.

    Parameters
    ----------
    a, b : array_like
        numpy arrays or anything ``numpy.asarray`` takes, cupy arrays, or dask
        arrays. 1-D operands are promoted as numpy does (a leading 1 for ``a``,
        a trailing 1 for ``b``, removed again from the result); operands with
        more than 2 dimensions are stacks of matrices whose leading dimensions
        broadcast.
    engine : {"auto", "local", "dask", "mpi"}
        ``"auto"`` uses a Dask cluster when ``client`` is given or a default
        client exists, otherwise the in-process engine.
    out : ndarray or tuple of one ndarray, optional
        Where to put the result, as ``numpy.matmul``'s ``out`` (also
        positional): the result must broadcast into it and numpy's
        ``casting`` rule must allow the result dtype. With 2-D operands of
        the result's dtype, the local and Dask engines write the tiles into it
        directly; on a Dask cluster the workers write a staged output file of
        ``distmm matmul`` (``.npy``, HDF5, zarr) themselves when they all see it.
        A call stopped early (Ctrl-C, an exception) on the local engine leaves each
        C tile of ``out`` as it was or finished (numpy's own call cannot be stopped).
    casting, order, dtype, subok, signature, axes, axis, keepdims
        As ``numpy.matmul``'s: ``axes`` names each operand's and the result's
        matrix axes (numpy checks them, and refuses ``axes=None``; ``axis`` and
        ``keepdims`` numpy refuses for matmul, given at all);
        ``dtype`` names the loop both operands are cast
        into under ``casting`` (default ``"same_kind"``, which also governs the
        cast into ``out``); ``order`` the result's memory layout (numpy and cupy
        results; a dask result is lazy); ``subok=False`` returns a plain ndarray
        for ndarray subclasses. Subclasses (``np.matrix``, masked arrays, your
        own) and array-likes with their own ``__array_wrap__`` come back wrapped
        by the ``__array_wrap__`` numpy would pick (numpy 1.x's choice under
        numpy 1.x), and
        operands that override ``__array_ufunc__`` take the call, as in numpy
        (beside a dask operand, a subclass's call is numpy's, which dask takes
        after distmm's checks: a lazy dask array of the subclass's chunks, or
        dask's error). numpy itself computes (with the keywords given;
        ``engine``, ``tile``, ``backend`` and ``precision`` do not apply, though values they refuse
        are refused as on every call) a call with ``signature``,
        one whose ``out`` has its own ``__array_wrap__`` (a masked array: numpy
        sets its mask) and one whose object loop takes a string, bytes or
        structured operand (paired with an object operand, or ``dtype=object``).
    client : distributed.Client, optional
        The cluster for ``engine="dask"``; default: the current client.
    tile : int or (tm, tn, tk), optional
        C tile size and k-block; ``None`` lets the planner choose.
    backend : {"auto", "numba", "blas", "raw", "cublas"}
        The executor. ``"auto"``: cuBLAS or distmm's raw kernels for cupy
        arrays (whichever measured faster), BLAS for floating numpy arrays and
        distmm's numba kernels for integer ones.
    precision : {"highest", "tf32", "bf16", "fp16"}, optional
        Default: ``distmm.precision`` (``"highest"`` unless configured).
        ``"highest"``: exact for the dtype, as numpy. ``"tf32"``, ``"bf16"``,
        ``"fp16"``: for float32, float16 and bfloat16 (``ml_dtypes``) results
        only: both operands are rounded to nearest into TF32 (10 significand
        bits), bfloat16 (7) or float16 (10, and float16's range), multiplied
        exactly and summed in float32: tensor cores on a GPU (a distmm kernel
        for the mode where the registry has one, else cuBLAS), emulated on the
        CPU. The result dtype is numpy's either way. Elementwise, with u_in
        2^-11 (TF32, FP16) or 2^-8 (BF16), u = 2^-24 and
        ``gamma_j = j u / (1 - j u)``::

            |C - A @ B| <= (2 u_in + u_in^2 + gamma_{k-1} (1 + u_in)^2) |A| |B|

        (``distmm.precision.error_bound``, which also covers a float16 result's
        last rounding and the GPU's truncating adds; no overflow or float16
        underflow assumed).

    Returns
    -------
    ndarray, cupy.ndarray, dask.array.Array or scalar
        numpy's result dtype: integers wrap as numpy's do, booleans stay
        boolean, NaN and Inf propagate. A vector-vector product of numpy
        operands is a numpy scalar, as with ``numpy.matmul``.

    Raises
    ------
    ValueError
        A 0-d operand, inner dimensions that differ, batch dimensions that do
        not broadcast, dask chunks of unknown size, or an ``out`` the result
        does not broadcast into; the message names the shapes.
        An unknown ``precision``. A scipy.sparse operand (numpy reads it as a
        0-d object).
    TypeError
        numpy's own (``UFuncTypeError`` and its subclasses) for a dtype matmul
        has no loop for (strings, ``np.void``, datetimes) and for a cast that
        ``casting`` does not allow (into ``dtype`` or into ``out``), raised
        before any shape is looked at, as numpy does; an ``out`` that is not an
        array; a dask operand whose chunks are not numpy or cupy arrays (masked,
        sparse, ``np.matrix``); or a reduced
        ``precision`` for a result that is not float32, float16 or bfloat16
        (integers, float64, complex).

    Examples
    --------
    >>> import numpy as np, distmm
    >>> a = np.arange(6.0).reshape(2, 3)
    >>> distmm.matmul(a, np.ones(3))
    array([ 3., 12.])
    >>> distmm.matmul(np.array([[1, 2]], dtype=np.int8), np.array([[100], [14]], dtype=np.int8))
    array([[-128]], dtype=int8)
    """
    if engine == "auto":
        engine = get_config().engine  # the configured engine; the argument wins
    try:
        ufunc_rules.keyword_errors(out, dtype, signature, axes, axis)  # numpy's first checks
        out = ufunc_rules.single_out(out)
        if keepdims is not ufunc_rules.NO_VALUE and keepdims is not True and keepdims is not False:
            raise TypeError("'keepdims' must be a boolean")  # numpy's, before casting and order
        if subok is not True and subok is not False:  # numpy's converter: True or False only
            # numpy reads order and casting (their ValueErrors) first: asked on empty arrays
            np.matmul(np.empty((0, 0)), np.empty((0, 0)), order=order, casting=casting)
            raise TypeError("'subok' must be a boolean")
    except Exception as exc:
        if engine == "mpi":
            _mpi_agree(exc)
        raise
    keywords = dict(casting=casting, order=order, dtype=dtype, subok=subok)
    plain = all(_is_default(k, v) for k, v in keywords.items())
    if (ufunc_rules.overrides(a, b, out) or ufunc_rules.wraps_out(out)
            or signature is not None or _object_loop(a, b, dtype)):
        # numpy's own call (it hands an override the call); only the keywords the caller
        # gave, as numpy passes them on; the values every other route refuses refused here
        # too (those routes check them where their ranks agree: DistArrays, the engines)
        try:
            if precision is not None:
                check_precision(precision)
            _check_choices(engine, tile, backend)
        except Exception as exc:
            if engine == "mpi":
                _mpi_agree(exc)
            raise
        if engine == "mpi":  # where every rank makes it: the others are in the engine
            _mpi_agree(None, route="numpy")
        given = {k: v for k, v in (("out", out), ("signature", signature)) if v is not None}
        given.update(ufunc_rules.given_keywords(axes=axes, axis=axis, keepdims=keepdims))
        given.update((k, v) for k, v in keywords.items() if not _is_default(k, v))
        return np.matmul(a, b, **given)
    a, b = _as_objects(a, b, dtype)
    if (subok is True and out is None and "dask" in (array_family(a), array_family(b))
            and any(ufunc_rules.is_subclass(x) for x in (a, b))):
        return _dask_takes_subclass(a, b, keywords, axes=axes, axis=axis, keepdims=keepdims,
                                    engine=engine, client=client, tile=tile, backend=backend,
                                    precision=precision)
    if any(ufunc_rules.is_subclass(x) for x in (a, b, out)) or (
            subok is True and out is None
            and any(ufunc_rules.wraps_like_subclass(x) for x in (a, b))
            and all(array_family(x) == "numpy" for x in (a, b))):
        # numpy wraps the whole result (its axes placed as ``axes`` says) with the operands
        # as given in the wrap's context; an array-like's own __array_wrap__ too (beside a
        # cupy or dask operand numpy hands the call to that array's library: no wrap)
        wrap = ufunc_rules.find_wrap(a, b) if subok and out is None else None
        result = matmul(ufunc_rules.base(a), ufunc_rules.base(b), ufunc_rules.base(out),
                        casting=casting, order=order, dtype=dtype, axes=axes, axis=axis,
                        keepdims=keepdims,
                        engine=engine, client=client, tile=tile, backend=backend,
                        precision=precision)
        if out is not None:
            return out
        if wrap is None:
            return result
        # one element of a vector product: the dtype it is an element of (object's too)
        loop = None if isinstance(result, np.ndarray) else ufunc_dtype(
            _dtype_of(a), _dtype_of(b), dtype=dtype, casting=casting, order=order)
        return ufunc_rules.apply_wrap(wrap, result, (a, b), dtype=loop)
    if out is not None and "dask" in (array_family(a), array_family(b)):
        # numpy hands such a call to dask, whose matmul takes no out=: its TypeError, before
        # any axes or shape is looked at
        exc = TypeError("matmul: out= is not supported for dask operands (the result is lazy)")
        if engine == "mpi":
            _mpi_agree(exc)
        raise exc
    if ufunc_rules.given_keywords(axes=axes, axis=axis, keepdims=keepdims):
        target = None
        try:
            _loop_first(a, b, out, keywords, axes=axes, axis=axis, keepdims=keepdims)
            if out_arrays.on_disk(out):  # numpy's axes: a temporary of out's shape, copied after
                size = math.prod(tuple(out.shape)) * np.dtype(out.dtype).itemsize
                out_arrays.refusals(out, engine, size)
                _refuse_missing_filter(out, "matmul: out")
                target, out = out, np.empty(tuple(out.shape), np.dtype(out.dtype))
            if isinstance(order, str) and order.upper() == "A":  # on the operands as given
                keywords["order"] = "F" if all(_given_fortran(x) for x in (a, b)) else "C"
            a, b, out, back = ufunc_rules.core_axes_last(a, b, out, axes, axis, keepdims)
        except Exception as exc:
            if engine == "mpi":  # the other ranks agree in the call below (its validation)
                _mpi_agree(exc)
            raise
        result = back(matmul(a, b, out, **keywords, engine=engine, client=client, tile=tile,
                             backend=backend, precision=precision))
        if target is not None:
            out_arrays.fill(target, result)
            return target
        return result
    cfg = get_config()
    key = eng = None
    if out is None and client is None and plain:
        key, entry = _lookup(a, b, engine, tile, backend, precision)
        if entry is not None:
            # the same key, the same operand types: the engine this call would get
            eng = _engine_for(engine, entry.operands.family, None, cfg)
            hit = _reuse(entry, a, b, eng, cfg)
            if hit is not None and engine == "mpi":
                _mpi_agree(None)  # every rank agrees once per call, hit or miss
            if hit is not None:
                if type(hit) is Request:
                    CALLS.hits += 1
                    CALLS.last = entry
                    return _k_ordered(_squeeze(eng.run(hit), hit.operands), hit.operands, a, b)
                result = hit(a, b)  # a replayer: 2-D operands, so nothing to squeeze
                if result is not None:
                    CALLS.hits += 1
                    CALLS.last = entry
                    return result
    if _is_distributed(a) or _is_distributed(b):
        if not plain:
            raise TypeError("matmul: casting=, order=, dtype= and subok= are not supported for "
                            "DistArray operands")
        return _matmul_distributed(a, b, out=out, engine=engine, tile=tile, backend=backend,
                                   precision=precision)
    request = None
    try:
        ops = _whole_k(_validate(a, b, out=out, dtype=dtype, casting=casting, order=order))
        precision = resolve_precision(precision, ops.dtype, config=cfg)
        if engine == "mpi":  # the request too, before the ranks agree: tile=, backend=
            eng = eng or _engine_for(engine, ops.family, client, cfg, ops)
            _check_disk_out(out, ops, eng)
            request = _resolve(eng, ops, cfg, tile=tile, backend=backend, precision=precision)
    except Exception as exc:
        if engine == "mpi":
            _mpi_agree(exc)
        raise
    if engine == "mpi":
        _mpi_agree(None)
    if eng is None:
        eng = _engine_for(engine, ops.family, client, cfg, ops)
        _check_disk_out(out, ops, eng)
    # numpy makes a product without elements at once, whatever k is: it is planned without
    # k (_planned); the local engine returns it before any tile, others do not run it
    empty = ops.family == "numpy" and eng.name != "mpi" and _empty(ops)
    if key is not None and (eng.name == "local" or not empty):
        if request is None:
            request = _resolve(eng, _planned(ops), cfg, tile=tile, backend=backend,
                               precision=precision)
            if request.operands is not ops:  # the operands as they are, with their k
                request = replace(request, operands=ops)
        _remember(key, ops, eng, request, a, b, cfg)
        return _k_ordered(_squeeze(eng.run(request), ops), ops, a, b)
    if empty:  # the request is resolved for its refusals only (tile=, backend=)
        _resolve(eng, _planned(ops), cfg, tile=tile, backend=backend, precision=precision)
        if out is not None:
            return out  # as empty as the result, which broadcasts into it
        return _ordered(_squeeze(np.empty(ops.out_shape, ops.dtype), ops), order, ops, (a, b))
    if out is None:
        if request is not None:
            result = _squeeze(eng.run(request), ops)
        else:
            result = _run(eng, ops, cfg, tile=tile, backend=backend, precision=precision)
        return _ordered(result, order, ops, (a, b))
    # where numpy's loop writes into out itself it reports its floating-point flags after,
    # so a FloatingPointError under errstate "raise" leaves out filled: the engine's reports
    # are held until out is; through a buffer (a cast, an overlap) out stays as it was
    # (an object product's elements report their own flags as numpy's, as they go)
    fills = _loop_writes_out(out, ops, (a, b)) and ops.dtype != object
    with fpflags.collect() if fills else contextlib.nullcontext(set()) as seen:
        if _writes_direct(out, ops, eng):
            # Tiles go straight into out (a memmap or zarr output is filled tile by tile).
            _run(eng, ops, cfg, tile=tile, backend=backend, out=out, precision=precision)
            result = None
        elif request is not None:
            result = _squeeze(eng.run(request), ops)
        else:
            result = _run(eng, ops, cfg, tile=tile, backend=backend, precision=precision)
    # cast as numpy's loop output is cast into out (casting= was checked with the operands):
    # an array, so a vector @ vector scalar is not converted through a Python number
    if result is not None:
        out_arrays.fill(out, result)
    fpflags.report(seen)
    return out


def _dask_takes_subclass(a, b, keywords, *, axes, axis, keepdims, engine: str, client, tile,
                         backend: str, precision):
    """An ndarray subclass (``np.matrix``, a masked array, a user's own) beside a dask
    operand: numpy hands the call to dask (its ``__array_ufunc__``), whose result is a lazy
    dask array of the subclass's chunks (a masked product's masks as the chunks' own wrap
    makes them), or dask's own error at the call (an ``np.matrix`` where k has several
    chunks; any keyword numpy passes on). distmm's checks of the operands and keywords,
    ``precision``, ``engine``, ``tile`` and ``backend`` come first (``engine="mpi"`` refuses
    dask operands), then numpy's own call; dask's ValueError names the subclass."""
    cfg = get_config()
    try:
        ops = _validate(ufunc_rules.base(a), ufunc_rules.base(b), dtype=keywords["dtype"],
                        casting=keywords["casting"], order=keywords["order"])
        resolve_precision(precision, ops.dtype, config=cfg)
        _check_choices(engine, tile, backend)
        _engine_for(engine, ops.family, client, cfg, ops).check_operands(ops)
    except Exception as exc:
        if engine == "mpi":
            _mpi_agree(exc)
        raise
    given = ufunc_rules.given_keywords(axes=axes, axis=axis, keepdims=keepdims)
    given.update((k, v) for k, v in keywords.items() if not _is_default(k, v))
    try:
        return np.matmul(a, b, **given)
    except ValueError as exc:
        sub = next(type(x).__name__ for x in (a, b) if ufunc_rules.is_subclass(x))
        raise ValueError(f"matmul: dask's matmul of a {sub} operand and a dask array refused "
                         f"it: {exc}") from exc


def _mpi_agree(error: BaseException | None, *, comm=None, route: str | None = None,
               key=None, values=None, what: str = "matmul") -> None:
    """For ``engine="mpi"``: every rank's validation outcome (operands, ``out=``, and the
    request: ``tile=``, ``backend=``, ``precision=``), agreed on with one small allgather
    before the engine's first collective, so that a call one rank refuses raises on every
    rank instead of leaving the others waiting in the engine; the ranks first meet in a
    watched barrier (``distmm.engine.mpi.join``: a warning, an opt-in deadline). A rank whose
    validation failed (``error``) returns and raises its own error; the others raise a
    ``ValueError`` naming the first rank that failed and its error. So too where ranks
    differ in ``route`` (``"numpy"``: a call numpy computes itself, ``signature=``, an
    object loop with strings, on that rank alone) or in ``key`` (what the engine needs the
    same everywhere: shapes, dtype, settings), or in ``values`` (``fingerprint``s of the
    operands every rank holds whole). ``comm``: default ``MPI.COMM_WORLD``; ``what``: the
    call the messages name. Nothing on one rank."""
    if comm is None:
        try:
            from distmm.engine.mpi import world

            comm = world()
        except ImportError:
            if error is not None or route is not None:
                return  # no mpi4py: this rank's own error or numpy's call, as on one rank
            raise
    if comm.size == 1:
        return
    from distmm.engine.mpi.join import join

    join(comm, "distmm.matmul or distmm.gemm with engine='mpi'")
    mine = None if error is None else " ".join(f"{type(error).__name__}: {error}".split())
    outcomes = comm.allgather((mine, route, key, values))
    if error is not None:
        return
    failed = next((r for r, (why, *_) in enumerate(outcomes) if why is not None), None)
    if failed is not None:
        raise ValueError(f"{what}: engine='mpi' needs valid, identical arguments on every rank; "
                         f"rank {failed} of {comm.size} refused its call ({outcomes[failed][0]})")
    other = next((r for r, (_, way, *_) in enumerate(outcomes) if way != route), None)
    if other is not None:
        ways = {r: way or "the MPI engine" for r, (_, way, *_) in enumerate(outcomes)}
        raise ValueError(f"{what}: engine='mpi' needs identical arguments on every rank; rank "
                         f"{comm.rank} of {comm.size} computes this call with {ways[comm.rank]}, "
                         f"rank {other} with {ways[other]} (signature= or an object loop with "
                         f"strings is numpy's own call)")
    other = next((r for r, (_, _, k, _) in enumerate(outcomes) if k != key), None)
    if other is not None:
        raise ValueError(f"{what}: engine='mpi' needs the same operands and settings on every "
                         f"rank; got {key} on rank {comm.rank} but {outcomes[other][2]} on "
                         f"rank {other}")
    for r, (*_, theirs) in enumerate(outcomes):  # None: a DistArray on that rank
        for name, x, y in zip("ab", values or (), theirs or ()):
            if (x is None) != (y is None):
                kinds = {rank: "a DistArray" if v is None else "an array every rank holds "
                         "whole" for rank, v in ((comm.rank, x), (r, y))}
                raise ValueError(f"{what}: engine='mpi' needs the same kind of operands on "
                                 f"every rank: {name} is {kinds[comm.rank]} on rank "
                                 f"{comm.rank} but {kinds[r]} on rank {r}")
    other = next((r for r, (*_, v) in enumerate(outcomes) if v != values), None)
    if other is not None:
        from distmm.engine.mpi.agree import differing

        raise ValueError(f"{what}: engine='mpi' needs the same operands on every rank: the "
                         f"values of the replicated {differing(values, outcomes[other][3])} differ between rank {comm.rank} and "
                         f"rank {other} (sampled elements)")


def _dtype_of(x) -> np.dtype:
    """An operand's dtype, without converting an array that has one."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _object_loop(a, b, dtype, families=("numpy",)) -> bool:
    """Whether numpy's object loop would take an operand distmm does not multiply (strings,
    bytes, structured): with an object operand or ``dtype=object``, numpy casts it to
    object (``"ab" * 3`` repeats the string), or refuses the cast with its own error.
    Only for operands of ``families``."""
    if (dtype is None and type(a) is np.ndarray and type(b) is np.ndarray
            and a.dtype.kind != "O" and b.dtype.kind != "O"):
        return False  # the common case: no object loop
    if not all(array_family(x) in families for x in (a, b)):
        return False
    dtypes = [_dtype_of(x) for x in (a, b)]
    try:
        loop_object = dtype is not None and np.dtype(dtype) == object
    except (TypeError, ValueError):
        return False  # numpy refuses the dtype: its error, raised in distmm's own path
    return ((loop_object or any(dt == object for dt in dtypes))
            and not all(planner.multiplies(dt) for dt in dtypes))


def _as_objects(a, b, dtype):
    """Dask operands (with numpy ones) that numpy's object loop would take: the operands
    that are not objects cast to object, lazily, as numpy casts them; the product then runs
    on object blocks (a dask operand of strings was refused)."""
    if not ((hasattr(a, "__dask_graph__") or hasattr(b, "__dask_graph__"))
            and _object_loop(a, b, dtype, families=("numpy", "dask"))):
        return a, b  # cheap where neither operand is dask: every call comes here
    return tuple(x if _dtype_of(x) == object else
                 (x.astype(object) if array_family(x) == "dask" else np.asarray(x).astype(object))
                 for x in (a, b))


def _loop_first(a, b, out, keywords, *, axes=ufunc_rules.NO_VALUE, axis=ufunc_rules.NO_VALUE,
                keepdims=ufunc_rules.NO_VALUE) -> None:
    """numpy resolves the loop and the casts into it and into ``out`` before it reads
    ``axes``, ``axis`` or ``keepdims``: its type errors (and a ValueError for an unknown
    ``casting`` or ``order``) come first, raised here from the operands' dtypes. A Python
    scalar operand always fails: numpy is asked with the scalar itself and those of
    ``axes``/``axis``/``keepdims`` given (its weak scalar's cast errors come before the
    missing dimension)."""
    if any(type(x) in (bool, int, float, complex) for x in (a, b)):
        _python_scalar_keywords(a, b, out, **keywords, **ufunc_rules.given_keywords(
            axes=axes, axis=axis, keepdims=keepdims))
    ufunc_dtype(_dtype_of(a), _dtype_of(b), dtype=keywords["dtype"],
                out_dtype=None if out is None else _dtype_of(out),
                casting=keywords["casting"], order=keywords["order"])


def _given_fortran(x) -> bool:
    """Whether numpy takes operand ``x``, as given, for Fortran-contiguous: its own flags,
    or for an array-like without them (numpy converts it to a C-ordered array) whether
    it is empty or has at most one dimension longer than 1."""
    flags = getattr(x, "flags", None)
    if flags is not None:
        return bool(flags.f_contiguous)
    shape = tuple(getattr(x, "shape", None) or np.shape(x))
    return math.prod(shape) == 0 or sum(s > 1 for s in shape) <= 1


def _ordered(result, order: str, ops: Operands, given):
    """The result in numpy's memory layout for ``order``: Fortran for ``"F"``, and for
    ``"A"`` when every operand in ``given`` (the operands as the caller passed them,
    before any cast or conversion) is Fortran-contiguous (also when it is C-contiguous
    too, as vectors and ``(n, 1)`` shapes are); for ``"K"`` the order of the operands'
    batch axes (``ufunc_rules.k_layout``); else the engines' C order."""
    order = (order or "K").upper()  # numpy's probe (_validate) checked it: K, A, C, F or None
    if order == "K" and ops.family == "numpy":
        return ufunc_rules.k_layout(result, *given)
    if order in ("K", "C") or ops.family == "dask" or getattr(result, "ndim", 0) < 2:
        return result
    fortran = order == "F" or all(_given_fortran(x) for x in given)
    return _namespace(ops.family).asfortranarray(result) if fortran else result


def _k_ordered(result, ops: Operands, a, b):
    """``order="K"``'s layout (the cached calls' order) for a numpy stack; else ``result``."""
    if ops.family != "numpy" or len(ops.batch) < 2:
        return result
    return ufunc_rules.k_layout(result, a, b)


def _check_choices(engine, tile, backend) -> None:
    """``engine=``, ``backend=`` and ``tile=`` refused as the engines and the planner refuse
    them, for a call numpy computes itself (they do not apply there, and no engine sees it)."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if tile is not None:
        planner.make_plan(0, 0, 0, workers=1, tile=tile)


def _is_distributed(x) -> bool:
    return type(x).__name__ == "DistArray" and hasattr(x, "layout") and hasattr(x, "comm")


def _matmul_distributed(a, b, *, out, engine: str, tile, backend: str, precision=None):
    """``DistArray @ DistArray`` (a replicated ndarray on either side is cut into
    blocks): SUMMA on the process grid the planner picks, a ``DistArray`` out."""
    from distmm.engine.mpi import DistArray, MPIEngine
    from distmm.engine.mpi.agree import fingerprint
    from distmm.grid import make_grid

    comm = (a if _is_distributed(a) else b).comm
    values = None  # of an operand every rank holds whole (a DistArray's blocks differ)
    try:  # refused on one rank: every rank raises (the others would wait in the engine)
        if out is not None:
            raise ValueError("matmul: out= is not supported for DistArray operands")
        if engine not in ("auto", "mpi"):
            raise ValueError(f"matmul: DistArray operands run on engine='mpi', got "
                             f"engine={engine!r}")
        if tile is not None:  # make_plan's checks of it; SUMMA's panels come from the grid
            planner.make_plan(0, 0, 0, workers=1, tile=tile)
        for name, x, shape in (("a", a, "(1, -1)"), ("b", b, "(-1, 1)")):
            _refuse_missing_filter(x, f"matmul: operand {name}")
            if not _is_distributed(x) and np.ndim(x) == 1:  # numpy's result: 1-D
                raise ValueError(f"matmul: {name} is 1-D beside a DistArray, whose product "
                                 f"numpy makes 1-D and a DistArray cannot hold: pass "
                                 f"{name}.reshape{shape}")
        if comm.size > 1:
            values = tuple(None if _is_distributed(x) else
                           fingerprint(x if array_family(x) == "cupy" else np.asarray(x))
                           for x in (a, b))
        # cut without from_array's exchange: a rank that refused above is already in
        # _mpi_agree below, which compares these operands' shapes, dtypes and values
        a = a if _is_distributed(a) else DistArray.from_agreed(a, comm)
        b = b if _is_distributed(b) else DistArray.from_agreed(b, comm)
        dtype = result_dtype(np.dtype(a.dtype), np.dtype(b.dtype))
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"matmul: inner dimensions differ: a has shape {a.shape}, b has "
                             f"shape {b.shape} ({a.shape[1]} != {b.shape[0]})")
        precision = resolve_precision(precision, dtype)
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        if backend == "auto":
            backend = get_config().backend
        family = "cupy" if "cupy" in (array_family(a.local), array_family(b.local)) else "numpy"
        backend, on_gpu = resolve_backend(backend, dtype, family=family, flops=2 * m * n * k)
    except Exception as exc:
        _mpi_agree(exc, comm=comm)
        raise
    _mpi_agree(None, comm=comm, key=(a.shape, b.shape, np.dtype(a.dtype).str,
                                     np.dtype(b.dtype).str, on_gpu, precision), values=values)
    grid = make_grid(m, n, k, dtype, ranks=comm.size)
    return MPIEngine(comm).run_distributed(a, b, grid, backend, on_gpu=on_gpu, precision=precision)


def _scalar_for(value, dtype: np.dtype, name: str):
    """Convert alpha or beta to the result dtype, refusing what is not a number (a date, a
    string, a signalling NaN) and lossy conversions: a complex value for a real result, a
    fraction for an integer one, a value out of the dtype's range (TypeError naming the
    value). A 0-d array is its element, as in numpy."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if (not isinstance(value, (numbers.Number, np.number, np.bool_))
            or isinstance(value, np.timedelta64)):  # numpy's integer subclass of durations
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, decimal.Decimal) and value.is_snan():
        raise TypeError(f"{name}={value!r} is a signalling NaN, which no product takes")
    if dtype.kind == "O":
        return value  # Python objects multiply as they are
    if isinstance(value, (complex, np.complexfloating)) and dtype.kind != "c":
        if value.imag != 0:
            raise TypeError(f"{name}={value!r} is complex but the result dtype is {dtype}")
        value = value.real
    if dtype.kind in "biu":
        if not (isinstance(value, (numbers.Integral, np.integer, np.bool_))
                or (isinstance(value, numbers.Real) and float(value).is_integer())
                or (isinstance(value, decimal.Decimal) and value.is_finite()
                    and value == value.to_integral_value())):
            raise TypeError(f"{name}={value!r} cannot scale a {dtype} result without rounding")
        exact = int(value)
        low, high = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        if not low <= exact <= high:
            raise TypeError(f"{name}={value!r} is out of range for a {dtype} result "
                            f"({low} to {high})")
        return dtype.type(exact)
    try:
        with np.errstate(over="raise"):
            scalar = dtype.type(value)
    except (OverflowError, FloatingPointError):
        scalar = None
    if scalar is None or (_finite(value) and not np.isfinite(scalar)):
        raise TypeError(f"{name}={value!r} is out of range for a {dtype} result")
    return scalar


def _finite(value) -> bool:
    """Whether a number is finite: numpy's test, or the number's own where numpy has no
    loop for its type (a Fraction is always finite, a Decimal says)."""
    if isinstance(value, numbers.Rational):
        return True
    if isinstance(value, decimal.Decimal):
        return value.is_finite()
    return bool(np.isfinite(value))


def gemm(a, b, c=None, *, alpha=1.0, beta=0.0, trans_a: bool | str = False,
         trans_b: bool | str = False, engine: str = "auto", client=None, tile=None,
         backend: str = "auto", precision: str | None = None):
    """BLAS-style ``alpha * op(A) @ op(B) + beta * C``, returned as a new array.

    Parameters
    ----------
    a, b : 2-D array_like
        The operands; ``op(X)`` is ``X``, ``X.T`` (a view, never a copy) or
        ``X.conj().T`` as ``trans_x`` says. A subclass counts as its data (no
        mask), as for ``c``. An h5py dataset or zarr array is read by slices
        as it is, and read whole where it is transposed; where no product is
        made (``alpha == 0``, ``k == 0``) nothing of it is read.
    c : 2-D array_like, optional
        Of shape ``(m, n)``; never modified. A subclass counts as its data
        (no mask); an h5py dataset or zarr array is read whole where it is read.
    alpha, beta : number
        Scalars, converted to the result dtype. As in reference BLAS,
        ``beta == 0`` means ``c`` is not read (NaN in ``c`` does not
        propagate) and ``alpha == 0`` means ``A`` and ``B`` are not read (only
        their shapes and dtypes are looked at). ``alpha == 0`` or ``k == 0``
        gives numpy's ``beta * c`` exactly, its signed zeros, Inf, NaN and
        reports as that product has them (a complex ``c`` is multiplied by a
        beta of 1 too, as below; no zero product is added, which would make
        -0.0 0.0), or zeros (0.0) where ``beta == 0`` or ``c`` is None.
        Otherwise numpy's ``alpha * (op(A) @ op(B)) + beta * c`` in the dtype
        promoted with ``c``'s (int8 operands with a float64 ``c`` multiply in
        float64, without int8's wrap), its Inf, NaN and
        floating-point reports too: a complex result is multiplied by an alpha
        or beta of 1 as well (numpy's ``1 * (inf + 0j)`` is ``inf + nanj``, an
        "invalid value").
    trans_a, trans_b : bool, {'N', 'T', 'C'} or {0, 1, 2}
        BLAS's TRANSA / TRANSB: ``False``, ``'N'`` or 0 (as is), ``True``, ``'T'``
        or 1 (transposed), ``'C'`` or 2 (conjugate transposed, object elements by
        their ``conjugate()``; the same as ``'T'`` for real dtypes). Lower case
        is accepted; the numbers are scipy's ``?gemm`` codes.
    engine, client, tile, backend, precision
        As for ``matmul``, and checked where no product is made (``alpha == 0``,
        ``k == 0``) too; ``precision`` applies to ``op(A) @ op(B)`` (its error
        bound is ``matmul``'s, for ``alpha * op(A) @ op(B)`` times ``|alpha|``),
        and is checked against the dtype the product is computed in (promoted
        with ``c``'s: a float64 ``c`` makes a float64 product, which takes
        ``"highest"`` only).

    Returns
    -------
    array of the operands' family (numpy, cupy or dask; a subclass such as
    ``np.matrix`` or a masked array comes back as a plain ndarray, with no
    mask) and shape ``(m, n)``; its dtype is numpy's matmul dtype of ``a``
    and ``b``, promoted with ``c``'s.

    Raises
    ------
    ValueError
        Operands that are not 2-D, inner dimensions that differ, ``c`` of
        the wrong shape (one numpy would broadcast too) or of unknown dask
        chunk sizes, a ``trans_a``/``trans_b`` that is none of the above,
        or an unknown ``precision``, ``engine``, ``backend`` or ``tile``. With
        ``engine="mpi"``, on every rank: a call another rank refuses, or
        shapes, letters, ``alpha``, ``beta`` or a read ``c`` (its sampled
        values) that differ between ranks.
    TypeError
        Non-numeric dtypes (``c``'s named), an ``alpha``/``beta`` that is not
        a number (a date, a string) or that the result dtype
        cannot hold exactly (``alpha=0.5`` for integers, ``alpha=2`` for
        booleans, which take 0 and 1 only), or a reduced
        ``precision`` for a product that is not float32, float16 or bfloat16.
        A ``DistArray`` as ``a``, ``b`` or ``c``, at once (``matmul`` multiplies them).

    Examples
    --------
    >>> import numpy as np, distmm
    >>> distmm.gemm(np.eye(2), np.ones((2, 2)), np.ones((2, 2)), alpha=2.0, beta=-1.0)
    array([[1., 1.],
           [1., 1.]])
    """
    given = [name for name, x in (("a", a), ("b", b), ("c", c)) if _is_distributed(x)]
    if given:  # on every rank of its communicator alike: nothing to agree on
        raise TypeError(f"gemm takes arrays, not DistArrays ({' and '.join(given)}): for "
                        f"DistArrays, r = distmm.matmul(a, b), then each rank's alpha * "
                        f"r.local + beta * c.redistribute(r.layout).local; or gemm the arrays "
                        f"their gather(None) gives")
    if engine == "auto":
        engine = get_config().engine  # the configured engine; the argument wins
    try:  # refused on one rank under engine="mpi": every rank raises (see _mpi_agree)
        flag_a, flag_b = _trans_flag(trans_a, "trans_a"), _trans_flag(trans_b, "trans_b")
        fam = max((array_family(x) for x in (a, b) + ((c,) if c is not None else ())),
                  key=FAMILY_ORDER.index)
        _refuse_unsupported("gemm", fam, a=a, b=b, **({} if c is None else {"c": c}))
        # a subclass's data, as for c (with a dask partner, its chunks would be the subclass)
        a, b = (_as_array(ufunc_rules.base(x), fam) for x in (a, b))
        for name, x in (("a", a), ("b", b)):
            if x.ndim != 2:
                raise ValueError(f"gemm: operand {name} must be 2-D, got shape {x.shape}")
        # an on-disk operand op() transposes is read only once a product is to be made
        op_a, op_b = _op(a, flag_a, read=False), _op(b, flag_b, read=False)
        ops = _validate(op_a, op_b, "gemm")
        dtype = ops.dtype
        if c is not None:
            c = _as_array(ufunc_rules.base(c), fam)  # a subclass's data: a plain result
            if any(s is None or (isinstance(s, float) and math.isnan(s)) for s in c.shape):
                raise ValueError(f"gemm: c has unknown chunk sizes (shape {tuple(c.shape)}); "
                                 f"call c.compute_chunk_sizes() first")
            if tuple(c.shape) != (ops.m, ops.n):
                raise ValueError(
                    f"gemm: c has shape {tuple(c.shape)} but op(a) @ op(b) has shape "
                    f"{(ops.m, ops.n)} (a {tuple(a.shape)}, b {tuple(b.shape)})"
                )
            dtype = np.result_type(dtype, _c_dtype(c))
        alpha_t = _scalar_for(alpha, dtype, "alpha")
        beta_t = _scalar_for(beta, dtype, "beta")
        precision = resolve_precision(precision, dtype, what="gemm")
        if (alpha_t != 0 and ops.k != 0 and not _empty(ops)
                and (_stands_in(a, flag_a) or _stands_in(b, flag_b))):
            # a product is made: an on-disk operand that op() transposes is read now (the
            # numpy family: the others' operands are in memory or dask arrays)
            ops = replace(ops, a=_op(a, flag_a), b=_op(b, flag_b))
        if c is not None and beta_t != 0 and _on_disk(c):
            c = np.asarray(c)  # an h5py dataset or zarr array: read (it has no astype)
        on_device = fam == "cupy" and dtype in (np.float32, np.float64)
        if not on_device:
            if dtype != ops.dtype:
                # Compute in the promoted dtype (c's precision), as a typed BLAS call would;
                # the engines cast tile by tile, so no operand is copied whole.
                ops = replace(ops, dtype=dtype)
            ops = _whole_k(ops)  # numpy's one sum over k for float16, long double, object
            # the engine and the request (engine=, client=, backend=, tile=) are checked
            # even where no product is made (alpha == 0, k == 0)
            cfg = get_config()
            eng = _engine_for(engine, ops.family, client, cfg, ops, what="gemm")
            eng.check_operands(ops)  # (its run checks them too, but alpha == 0 or k == 0 skips it)
            request = _resolve(eng, _planned(ops), cfg, tile=tile, backend=backend,
                               precision=precision)
        if engine == "mpi":
            key = _gemm_key(ops, flag_a, flag_b, alpha_t, beta_t, c)
    except Exception as exc:
        if engine == "mpi":
            _mpi_agree(exc, what="gemm")
        raise
    if engine == "mpi":
        _mpi_agree(None, key=key, what="gemm")

    xp = _namespace(fam)
    if on_device:
        return _gemm_on_device(op_a, op_b, c, dtype, alpha_t, beta_t, backend, precision)
    if alpha_t == 0 or ops.k == 0 or _empty(ops):
        # the product's chunks (op(a)'s rows, op(b)'s columns), as the engine's would be
        chunks = {"chunks": (op_a.chunks[0], op_b.chunks[1])} if fam == "dask" else {}
        product = xp.zeros((ops.m, ops.n), dtype=dtype, **chunks)
    else:
        product = _squeeze(eng.run(request), ops)
        if _scales(alpha_t, dtype):
            product = alpha_t * product
    if c is None or beta_t == 0:
        return product.astype(dtype, copy=False)
    c = c.astype(dtype, copy=not _scales(beta_t, dtype))
    scaled = beta_t * c if _scales(beta_t, dtype) else c
    if alpha_t == 0 or ops.k == 0:
        # BLAS's C = beta * C, no zero product added to it (0.0 + -0.0 is 0.0)
        return _as_sum(scaled, product).astype(dtype, copy=False)
    return (product + scaled).astype(dtype, copy=False)


def _as_sum(x, product):
    """``x`` (``beta * c``, a new array) of the type and chunks ``product + x`` has: a
    plain ndarray for a numpy subclass (a memmap's ``astype`` is a memmap), a dask ``x`` in
    the chunks dask's elementwise operations align their operands to (``unify_chunks``)."""
    if array_family(x) == "numpy":
        return np.asarray(x)
    if array_family(x) != "dask":
        return x
    from dask.array.core import unify_chunks

    return unify_chunks(product, "ij", x, "ij")[1][1]


def _scales(scalar, dtype: np.dtype) -> bool:
    """Whether gemm multiplies by ``alpha`` or ``beta`` as numpy's ``alpha * (a @ b) + beta
    * c`` does, scalar on the left (numpy's complex loops report an Inf times 0 in one order
    and not the other): always for complex results, where ``1 * (inf + 0j)`` is
    ``inf + nanj`` with numpy's "invalid value" (BLAS's zgemm multiplies by ``alpha = 1``
    too), else where the scalar is not 1."""
    return scalar != 1 or dtype.kind == "c"


def _c_dtype(c) -> np.dtype:
    """gemm's ``c``'s dtype as a product of its kind (booleans stay boolean), or a
    TypeError naming ``c`` for one no product has (strings, dates, structured types)."""
    try:
        return result_dtype(c.dtype, c.dtype)
    except TypeError:
        raise TypeError(f"gemm: c must be boolean or numeric, got dtype {np.dtype(c.dtype)}") \
            from None


def _gemm_key(ops: Operands, flag_a: str, flag_b: str, alpha, beta, c) -> str:
    """What every rank of a gemm with ``engine="mpi"`` must have alike beyond the operands
    the engine compares itself: the shapes, the dtype, the letters, alpha, beta, and c's
    shape, dtype and sampled values where it is read."""
    from distmm.engine.mpi.agree import fingerprint

    if c is None or beta == 0:
        seen = "not read"
    else:
        host = c if array_family(c) != "dask" else None  # dask: the engine refuses it
        sample = "" if host is None else " sampled " + fingerprint(host).hex()
        seen = f"{tuple(c.shape)} {np.dtype(c.dtype)}{sample}"
    return (f"op(a) @ op(b) of {ops.m}x{ops.k} @ {ops.k}x{ops.n} in {ops.dtype}, "
            f"trans_a={flag_a!r}, trans_b={flag_b!r}, alpha={alpha!r}, beta={beta!r}, c {seen}")


def _trans_flag(value, name: str) -> str:
    """BLAS's transpose argument: a bool, one of 'N', 'T', 'C' (any case) or scipy's ``?gemm``
    codes 0, 1, 2 -> 'N'/'T'/'C'."""
    if isinstance(value, (bool, np.bool_)):
        return "T" if value else "N"
    if isinstance(value, str) and value.upper() in ("N", "T", "C"):
        return value.upper()
    if isinstance(value, (int, np.integer)) and value in (0, 1, 2):
        return "NTC"[value]
    raise ValueError(f"gemm: {name} must be a bool, one of 'N', 'T', 'C' or 0, 1, 2, "
                     f"got {value!r}")


def _op(x, flag: str, *, read: bool = True):
    """op(X) for a BLAS transpose flag: X, X.T (a view), or X.conj().T for complex X and
    for object X (each element's ``conjugate()``, as numpy's ``conj``). An on-disk X (h5py,
    zarr), which has no ``.T``, is read whole first, as ``numpy.asarray`` reads it; with
    ``read=False`` it is not read at all: a read-only stand-in of op(X)'s shape and dtype
    (one element, broadcast) takes its place (``_stands_in``)."""
    if flag == "N":
        return x
    if _on_disk(x):
        if not read:
            rows, cols = x.shape
            return np.broadcast_to(np.zeros((), np.dtype(x.dtype)), (cols, rows))
        x = np.asarray(x)
    if flag == "C" and np.dtype(x.dtype).kind in "cO":
        return x.conj().T
    return x.T


def _stands_in(x, flag: str) -> bool:
    """Whether ``_op(x, flag, read=False)`` gave a stand-in for op(X), not op(X) itself."""
    return flag != "N" and _on_disk(x)


def _gemm_on_device(op_a, op_b, c, dtype, alpha, beta, backend: str,
                    precision: str = "highest"):
    """float32/float64 gemm of cupy operands with alpha and beta applied inside the
    GEMM (distmm's kernel epilogue or cuBLAS), as BLAS does: no extra passes over C,
    and no cupy elementwise kernels, which flush float32 subnormals."""
    import cupy

    from distmm.executor import get_executor

    resolved, _ = resolve_backend(backend, dtype, family="cupy", flops=0)
    executor = get_executor(resolved, dtype, on_gpu=True, precision=precision)
    m, n = op_a.shape[0], op_b.shape[1]
    read_c = c is not None and beta != 0
    out = c.astype(dtype, copy=True) if read_c else cupy.empty((m, n), dtype=dtype)
    if alpha == 0 or op_a.shape[1] == 0:
        # BLAS: A and B are not read; C = beta * C by cuBLAS's scal (no GEMM: cuBLAS refuses
        # the leading dimensions of some empty operands, CUBLAS_STATUS_INVALID_VALUE)
        if not read_c:
            out.fill(0)
        elif beta != 1 and out.size:
            from cupy import cublas

            cublas.scal(beta, out.ravel())
        return out
    executor.device_gemm(op_a, op_b, out, alpha=alpha, beta=beta if read_c else dtype.type(0))
    return out


def _namespace(family: str):
    if family == "cupy":
        import cupy

        return cupy
    if family == "dask":
        import dask.array as da

        return da
    return np
