"""The GPU stream pipeline: products of host-resident operands at in-core speed.

This module covers: multiplying operands that live in host memory (numpy
arrays, memory-mapped ``.npy`` files, zarr arrays or anything whose 2-D slices
are numpy arrays) on one GPU, with the result written to a host array, a
memmap or a zarr array; choosing the pipeline's own tiles from a device memory
budget; copying tiles in and out on their own CUDA streams through a bounded
pool of pinned staging buffers while the compute stream multiplies, ordered by
CUDA events; keeping operand blocks resident on the device and reusing them
across the C tiles that need them; shrinking the tiles and starting over when
the device runs out of memory; and recording a timeline of every copy and
kernel.

It does *not* cover: operands already on the GPU (``GPUExecutor`` multiplies
those directly), choosing kernels (the executor's ``device_gemm`` does), Dask
or MPI, or rendering timelines (``distmm.trace``).

How it works
------------
C is cut into *units* (row ranges times column ranges). When all of B fits in
the budget, units span the full width of C, B's k-blocks are loaded once
(during the first unit) and stay resident, and the last rows are cut into
units of halving height so that little output is left to copy out after the
last kernel. Otherwise units are square tiles, swept row by row in serpentine
order, and a cache of A and B blocks with Belady's eviction (the schedule is
known in advance, so the block used furthest in the future is evicted) keeps
the A row panel resident across a sweep of B column panels. Three streams:

- ``h2d``: host staging buffer -> device block slot. Before a slot is reloaded
  the stream waits for the event recorded after the last kernel that read it.
- ``compute``: ``C_unit (+)= A_block @ B_block`` through the executor's
  ``device_gemm``, waiting for the loads of its two blocks.
- ``d2h``: finished C unit -> host staging buffer, waiting for the unit's last
  kernel; a C buffer is reused only after its copy-out is done.

Host threads copy operand tiles into pinned staging buffers (numpy releases
the GIL while copying, so several run at once) ahead of the ``h2d`` stream,
and copy results out of them into ``out``; a staging buffer is refilled only
after the event of its previous copy has completed.

Numerics: ``float32`` and ``float64`` results (numpy's result dtype of the two
operands; operands are cast while they are staged). Each C element is a sum
over k-blocks in a fixed order for a given tiling; the tiling depends on the
memory budget, so results may differ in the last bits between budgets. Other
result dtypes raise ``TypeError``: the GPU executor's tile path handles them.

See also: ``distmm.executor.pinned`` (the staging buffers), ``distmm.trace``
(renders the timeline), ``distmm.executor.gpu`` (calls ``run_pipelined``).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import gc
import json
import logging
import math
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "run_pipelined",
    "matmul_to",
    "choose_tiling",
    "plan_block_loads",
    "PipelineTiling",
    "Timeline",
    "CublasGemm",
    "FAST_DTYPES",
]

log = logging.getLogger("distmm.executor.pipeline")

FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

MiB = 1 << 20
_TILE_CANDIDATES = (16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64)
_TK_CANDIDATES = (2048, 1024, 512, 256, 128, 64)
_BUDGET_FRACTION = 0.92    # of the device budget for our buffers; the rest for cuBLAS workspace
_TAIL_BYTES = 64 * MiB     # full-width mode: last unit's output at most this (short tail)
_MAX_CHUNK = 32 * MiB      # staging copy granularity


# ---------------------------------------------------------------------------
# Tiling: pure arithmetic, testable without a GPU
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineTiling:
    """The pipeline's own tiling of ``C[m, n] = A[m, k] @ B[k, n]``.

    Attributes
    ----------
    row_edges, col_edges, k_edges : tuple of int
        Boundaries of units along m and n, and of k-blocks.
    a_slots, b_slots : int
        Device slots for A blocks (``tm_max x tk_max``) and B blocks
        (``tk_max x tn_max``).
    c_buffers : int
        Device buffers for C units (``tm_max x tn_max``).
    itemsize : int
    mode : str
        ``"full-width"`` (B resident, units span all columns) or ``"tiles"``.
    """

    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    k_edges: tuple[int, ...]
    a_slots: int
    b_slots: int
    c_buffers: int
    itemsize: int
    mode: str = "tiles"

    @staticmethod
    def _widest(edges) -> int:
        return max((edges[i + 1] - edges[i] for i in range(len(edges) - 1)), default=0)

    @property
    def tm_max(self) -> int:
        return self._widest(self.row_edges)

    @property
    def tn_max(self) -> int:
        return self._widest(self.col_edges)

    @property
    def tk_max(self) -> int:
        return self._widest(self.k_edges)

    @property
    def a_slot_bytes(self) -> int:
        return self.tm_max * self.tk_max * self.itemsize

    @property
    def b_slot_bytes(self) -> int:
        return self.tk_max * self.tn_max * self.itemsize

    @property
    def c_buffer_bytes(self) -> int:
        return self.tm_max * self.tn_max * self.itemsize

    @property
    def b_resident(self) -> bool:
        """All of B lives in one device buffer (full-width mode); block ``kb`` is
        its rows ``k_edges[kb]:k_edges[kb+1]``, so short k-blocks waste nothing."""
        return self.mode == "full-width"

    @property
    def b_bytes(self) -> int:
        if self.b_resident:
            return self.k_edges[-1] * self.tn_max * self.itemsize
        return self.b_slots * self.b_slot_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory the pipeline's buffers take."""
        return self.a_slots * self.a_slot_bytes + self.b_bytes + self.c_buffers * self.c_buffer_bytes

    def describe(self) -> dict:
        d = asdict(self)
        d.update(tm_max=self.tm_max, tn_max=self.tn_max, tk_max=self.tk_max,
                 device_bytes=self.device_bytes)
        for key in ("row_edges", "col_edges", "k_edges"):
            edges = d.pop(key)
            d[key.split("_")[0] + "_sizes"] = [edges[i + 1] - edges[i] for i in range(len(edges) - 1)]
        return d


def _edges(length: int, tile: int) -> tuple[int, ...]:
    return tuple(range(0, length, tile)) + (length,) if length else (0,)


def _k_edges(k: int, tk: int) -> tuple[int, ...]:
    """k-blocks of ``tk``, after a ramp of ``tk/8, tk/4, tk/2``: the first kernel
    starts after an eighth of a full block's bytes have crossed, and each later
    block's copy hides behind the kernel before it (the pipeline's start-up)."""
    edges, size = [0], max(64, tk // 8)
    while size < tk and edges[-1] + size < k:
        edges.append(edges[-1] + size)
        size *= 2
    edges.extend(range(edges[-1] + tk, k, tk))
    edges.append(k)
    return tuple(edges)


def _ramp_edges(length: int, tile: int, tail: int) -> tuple[int, ...]:
    """Units of ``tile`` rows, then halving ones down to at most ``tail`` rows,
    so that the output left to copy after the last kernel is small."""
    sizes, rest = [], length
    while rest > tile:
        sizes.append(tile)
        rest -= tile
    tail = max(tail, 64)
    while rest > tail:
        take = rest - (rest // 2) // 64 * 64
        if take >= rest:
            break
        sizes.append(take)
        rest -= take
    if rest:
        sizes.append(rest)
    edges = [0]
    for s in sizes:
        edges.append(edges[-1] + s)
    return tuple(edges)


def choose_tiling(m: int, n: int, k: int, itemsize: int, budget: int, *,
                  tiles: tuple[int, int, int] | None = None) -> PipelineTiling:
    """Choose the pipeline's units, k-blocks and slot counts for a device budget.

    Parameters
    ----------
    m, n, k : int
        The problem (all positive).
    itemsize : int
        Bytes per element of the compute dtype.
    budget : int
        Device bytes the pipeline may use; about 92% of it goes to buffers.
    tiles : (tm, tn, tk), optional
        Force square-tile mode with these sizes (slot counts still follow the
        budget, but at least two of each); used to test the out-of-memory retry.

    Returns
    -------
    PipelineTiling

    Raises
    ------
    MemoryError
        Not even 64 x 64 tiles fit the budget.

    Examples
    --------
    >>> t = choose_tiling(32768, 32768, 32768, 4, 70 * 2**30)
    >>> t.mode, t.tm_max, t.tk_max, t.b_slots, t.k_edges[:3]
    ('full-width', 16384, 2048, 19, (0, 256, 768))
    >>> choose_tiling(4096, 4096, 4096, 4, 16 * 2**20).mode
    'tiles'
    """
    s = int(itemsize)
    usable = int(budget * _BUDGET_FRACTION)
    if tiles is not None:
        tm, tn, tk = (max(1, min(int(t), d)) for t, d in zip(tiles, (m, n, k)))
        return _fill_slots(m, n, k, s, usable, tm, tn, tk, minimum=2)

    # Full-width units with all of B resident: B is read from the host once.
    for tk in _TK_CANDIDATES:
        tk = min(tk, k)
        k_edges = _k_edges(k, tk)
        kb = len(k_edges) - 1
        b_bytes = k * n * s
        if b_bytes > 0.75 * usable:
            continue
        for tm in _TILE_CANDIDATES:
            tm = min(tm, m)
            for c_buffers, a_slots in ((3, 4), (2, 3), (2, 2)):
                need = b_bytes + c_buffers * tm * n * s + a_slots * tm * tk * s
                if need <= usable and (tm >= min(m, 1024) or tm * n * s >= 64 * MiB):
                    tail = max(64, _TAIL_BYTES // max(n * s, 1) // 64 * 64)
                    spare = usable - need
                    a_slots += min(4, spare // max(tm * tk * s, 1))
                    return PipelineTiling(_ramp_edges(m, tm, tail), (0, n), k_edges,
                                          int(a_slots), kb, c_buffers, s, "full-width")
            if tm == m and tm < 1024:
                break

    # Square tiles; the cache keeps an A row panel and as many B blocks as fit.
    for tile in _TILE_CANDIDATES:
        tm, tn = min(tile, m), min(tile, n)
        for tk in _TK_CANDIDATES:
            tk = min(tk, k)
            if 2 * tm * tn * s + 2 * tm * tk * s + 2 * tk * tn * s <= usable:
                return _fill_slots(m, n, k, s, usable, tm, tn, tk, minimum=2)
    raise MemoryError(f"device memory budget of {budget} bytes is too small for even 64 x 64 "
                      f"tiles of {s}-byte elements (distmm.device-memory-limit)")


def _fill_slots(m, n, k, s, usable, tm, tn, tk, *, minimum) -> PipelineTiling:
    kb = math.ceil(k / tk)
    gn = math.ceil(n / tn)
    c_bytes, a_bytes, b_bytes = tm * tn * s, tm * tk * s, tk * tn * s
    spare = usable - 2 * c_bytes - minimum * (a_bytes + b_bytes)
    a_slots = minimum + max(0, min(kb, spare // a_bytes if spare > 0 else 0))
    spare -= (a_slots - minimum) * a_bytes
    b_slots = minimum + max(0, min(kb * gn, spare // b_bytes if spare > 0 else 0))
    return PipelineTiling(_edges(m, tm), _edges(n, tn), _edges(k, tk),
                          int(a_slots), int(b_slots), 2, s, "tiles")


def unit_order(tiling: PipelineTiling) -> list[tuple[int, int]]:
    """C units in the order they are computed: rows outer, columns serpentine
    (a sweep ends on the B panel the next one starts with)."""
    gm, gn = len(tiling.row_edges) - 1, len(tiling.col_edges) - 1
    order = []
    for i in range(gm):
        cols = range(gn) if i % 2 == 0 else range(gn - 1, -1, -1)
        order.extend((i, j) for j in cols)
    return order


@dataclass(frozen=True)
class Step:
    """One kernel: ``C_unit (+)= A[i, kb] @ B[kb, j]`` and the loads before it."""

    unit: int
    i: int
    j: int
    kb: int
    first: bool  # first k-block of its unit: beta = 0
    last: bool   # last k-block: the unit is finished after it
    a_slot: int
    b_slot: int
    load_a: bool
    load_b: bool


def plan_block_loads(tiling: PipelineTiling) -> list[Step]:
    """The whole schedule: kernels in order, with the block loads each needs.

    Blocks are cached in ``a_slots`` / ``b_slots`` device slots; on a miss the
    resident block whose next use is furthest away is evicted (Belady's rule,
    optimal because the schedule is known in advance). The k-blocks of
    consecutive units run in alternating directions so that the blocks used
    last are reused first.
    """
    gk = len(tiling.k_edges) - 1
    keys = []
    for u, (i, j) in enumerate(unit_order(tiling)):
        kbs = range(gk) if u % 2 == 0 else range(gk - 1, -1, -1)
        for idx, kb in enumerate(kbs):
            keys.append((u, i, j, kb, idx == 0, idx == gk - 1))

    def assign(block_keys, slots):
        nxt = [math.inf] * len(block_keys)
        seen: dict = {}
        for s in range(len(block_keys) - 1, -1, -1):
            nxt[s] = seen.get(block_keys[s], math.inf)
            seen[block_keys[s]] = s
        resident: dict = {}     # block -> slot
        next_use: dict = {}     # block -> next step using it
        # Free slots are reused oldest-freed first: a load then waits for a kernel
        # long finished, not the one just issued (LIFO reuse serialised copies and
        # kernels: measured 8 ms gaps between 43 ms kernels, run 20261122T0237).
        free = collections.deque(range(slots))
        out = []
        for s, key in enumerate(block_keys):
            if key in resident:
                out.append((resident[key], False))
            else:
                if free:
                    slot = free.popleft()
                else:
                    victim = max(resident, key=lambda b: next_use[b])
                    slot = resident.pop(victim)
                    del next_use[victim]
                resident[key] = slot
                out.append((slot, True))
            next_use[key] = nxt[s]
            if nxt[s] == math.inf:  # never used again: free its slot now
                free.append(resident.pop(key))
                del next_use[key]
        return out

    a_plan = assign([(i, kb) for (_, i, _, kb, _, _) in keys], tiling.a_slots)
    b_plan = assign([(kb, j) for (_, _, j, kb, _, _) in keys], tiling.b_slots)
    return [Step(u, i, j, kb, first, last, a[0], b[0], a[1], b[1])
            for (u, i, j, kb, first, last), a, b in zip(keys, a_plan, b_plan)]


# ---------------------------------------------------------------------------
# Timeline
# ---------------------------------------------------------------------------

@dataclass
class Timeline:
    """When each copy and kernel of a pipelined run started and ended.

    ``ops`` holds dicts ``{"lane", "name", "start_ms", "end_ms"}``; GPU lanes
    (``h2d``, ``compute``, ``d2h``) come from CUDA events, host lanes
    (``host-stage``, ``host-unstage``) from the host clock aligned to the
    first event. ``meta`` holds the problem, tiling, device and totals.
    """

    ops: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def add(self, lane: str, name: str, start_ms: float, end_ms: float) -> None:
        self.ops.append({"lane": lane, "name": name, "start_ms": float(start_ms),
                         "end_ms": float(end_ms)})

    def to_json(self, path) -> None:
        with open(path, "w") as fh:
            json.dump({"meta": self.meta, "ops": self.ops}, fh)

    @classmethod
    def from_json(cls, path) -> "Timeline":
        with open(path) as fh:
            d = json.load(fh)
        return cls(ops=list(d.get("ops", [])), meta=dict(d.get("meta", {})))

    def busy_ms(self, lane: str) -> float:
        """Total time ``lane`` was busy (overlapping ops merged)."""
        spans = sorted((o["start_ms"], o["end_ms"]) for o in self.ops if o["lane"] == lane)
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total


# ---------------------------------------------------------------------------
# Device glue (cupy). Tests substitute a simulated device with the same methods.
# ---------------------------------------------------------------------------

class _CupyDevice:
    """Streams, events, copies and a memory pool limited to the budget."""

    def __init__(self, limit_bytes: int):
        import cupy

        self.cp = cupy
        self.device_id = cupy.cuda.Device().id
        self.pool = cupy.cuda.MemoryPool()
        self.pool.set_limit(size=int(limit_bytes))
        self.oom_errors = (cupy.cuda.memory.OutOfMemoryError,)
        self._rt = cupy.cuda.runtime

    @property
    def name(self) -> str:
        props = self._rt.getDeviceProperties(self.device_id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def bind_thread(self) -> None:
        self._rt.setDevice(self.device_id)

    def alloc(self, nbytes: int):
        return self.pool.malloc(int(nbytes))

    def array(self, mem, shape, dtype):
        return self.cp.ndarray(shape, dtype, memptr=mem)

    def stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def event(self, timing: bool = False):
        # Blocking sync: host threads that wait on events sleep instead of spinning,
        # leaving the cores to the staging copies.
        return self.cp.cuda.Event(block=True, disable_timing=not timing)

    def record(self, ev, stream) -> None:
        ev.record(stream)

    def wait(self, stream, ev) -> None:
        stream.wait_event(ev)

    def sync_event(self, ev) -> None:
        ev.synchronize()

    def elapsed_ms(self, start, end) -> float:
        return self.cp.cuda.get_elapsed_time(start, end)

    def h2d(self, dst, src: np.ndarray, stream) -> None:
        self._rt.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                             self._rt.memcpyHostToDevice, stream.ptr)

    def d2h(self, dst: np.ndarray, src, stream) -> None:
        self._rt.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes,
                             self._rt.memcpyDeviceToHost, stream.ptr)

    def synchronize(self) -> None:
        self.cp.cuda.Device(self.device_id).synchronize()

    def available_bytes(self) -> int:
        free, _total = self._rt.memGetInfo()
        return int(free + self.cp.get_default_memory_pool().free_bytes())

    def release(self) -> None:
        self.pool.free_all_blocks()


class CublasGemm:
    """The smallest executor the pipeline can use: cuBLAS through cupy.

    ``device_gemm(a, b, c, alpha=1, beta=0, stream=None)`` computes
    ``c = alpha * a @ b + beta * c`` into the preallocated, C-contiguous
    ``c`` on ``stream`` (``cupy.cublas.gemm``; with ``beta == 0`` it is
    ``cupy.matmul(a, b, out=c)``).
    """

    name = "cublas"

    def __init__(self):
        try:
            from cupy import cublas as _cublas

            self._gemm = _cublas.gemm
        except (ImportError, AttributeError):  # pragma: no cover - older/newer cupy
            self._gemm = None

    def device_gemm(self, a, b, c, *, alpha=1.0, beta=0.0, stream=None):
        import contextlib

        import cupy

        with stream if stream is not None else contextlib.nullcontext():
            if beta == 0 and alpha == 1:
                cupy.matmul(a, b, out=c)
            elif self._gemm is not None:
                self._gemm("N", "N", a, b, out=c, alpha=alpha, beta=beta)
            else:  # pragma: no cover - a temporary and two extra passes over c
                prod = cupy.matmul(a, b)
                if alpha != 1:
                    prod *= c.dtype.type(alpha)
                if beta != 1:
                    c *= c.dtype.type(beta)
                c += prod
        return c

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

_pools_lock = threading.Lock()
_pools: dict = {}


def _thread_pool(role: str, threads: int) -> cf.ThreadPoolExecutor:
    """Host copy threads, started once per process and kept (plan once, run many):
    starting them inside a run delayed the first copies."""
    with _pools_lock:
        pool = _pools.get(role)
        if pool is None or pool._max_workers < threads:
            pool = cf.ThreadPoolExecutor(threads, f"distmm-{role}")
            barrier = threading.Barrier(threads)
            list(pool.map(lambda _: barrier.wait(timeout=10), range(threads)))  # start them all
            old = _pools.get(role)
            _pools[role] = pool
            if old is not None:
                old.shutdown(wait=False)
        return pool


def _host_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cpus = os.cpu_count() or 2
    return max(2, min(12, cpus - 2))


@dataclass
class _Chunk:
    """A row band of one block load: ``src[r0:r1, c0:c1]`` -> slot rows ``d0:d0+(r1-r0)``."""

    step: int
    which: str          # "A" or "B"
    slot: int
    r0: int
    r1: int
    c0: int
    c1: int
    d0: int             # first row inside the device block
    block_rows: int
    first: bool         # first chunk of its block
    last: bool          # last chunk of its block
    label: str


class _Cancelled(Exception):
    pass


class _PipelineRun:
    """One attempt at the whole product with one tiling. Raises the device's
    out-of-memory errors unchanged so that the caller can retry smaller."""

    def __init__(self, device, gemm, tiling: PipelineTiling, a, b, out, dtype, pool,
                 timeline: Timeline | None, host_threads: int):
        self.dev = device
        self.gemm = gemm
        self.t = tiling
        self.a, self.b, self.out = a, b, out
        self.dtype = np.dtype(dtype)
        self.pool = pool
        self.timeline = timeline
        self.host_threads = host_threads
        self._gpu_ops: list = []        # (lane, name, ev_start, ev_end) when tracing
        self._host_ops: list = []       # (lane, name, t_start, t_end) when tracing
        self._host_lock = threading.Lock()
        self._out_lock = None if isinstance(out, np.ndarray) else threading.Lock()
        self._cancel = threading.Event()
        self.bytes_h2d = 0
        self.bytes_d2h = 0

    # -- sizes -----------------------------------------------------------------
    def _chunk_bytes(self) -> tuple[int, int, int]:
        """Staging chunk size and ring lengths from the pinned pool's limit."""
        s = self.dtype.itemsize
        row = max(self.t.tk_max, self.t.tn_max) * s
        limit = self.pool.limit
        chunk = max(row, min(_MAX_CHUNK, limit // 32))
        chunk = -(-chunk // row) * row
        n_in = int(min(24, max(2, (limit * 3 // 4) // chunk)))
        n_out = int(min(8, max(2, (limit - n_in * chunk) // chunk)))
        if (n_in + n_out) * chunk > limit:
            raise ValueError(f"the pinned pool ({limit} bytes, distmm.pinned-pool) cannot hold "
                             f"4 staging buffers of {chunk} bytes; raise it")
        return chunk, n_in, n_out

    def _chunks(self, steps: list[Step], chunk_bytes: int) -> list[_Chunk]:
        t, s = self.t, self.dtype.itemsize
        out = []
        for idx, st in enumerate(steps):
            k0, k1 = t.k_edges[st.kb], t.k_edges[st.kb + 1]
            loads = []
            if st.load_a:
                loads.append(("A", st.a_slot, t.row_edges[st.i], t.row_edges[st.i + 1], k0, k1,
                              f"A[{st.i},{st.kb}]"))
            if st.load_b:
                loads.append(("B", st.b_slot, k0, k1, t.col_edges[st.j], t.col_edges[st.j + 1],
                              f"B[{st.kb},{st.j}]"))
            for which, slot, r0, r1, c0, c1, label in loads:
                rows = max(1, chunk_bytes // ((c1 - c0) * s))
                starts = list(range(r0, r1, rows))
                for n_, q0 in enumerate(starts):
                    q1 = min(q0 + rows, r1)
                    out.append(_Chunk(idx, which, slot, q0, q1, c0, c1, q0 - r0, r1 - r0,
                                      n_ == 0, n_ == len(starts) - 1, label))
        return out

    # -- host copies (pool threads) -------------------------------------------------
    def _now(self) -> float:
        return time.perf_counter()

    def _stage(self, chunk: _Chunk, buf, wait_ev):
        if self._cancel.is_set():
            raise _Cancelled()
        self.dev.bind_thread()
        if wait_ev is not None:
            self.dev.sync_event(wait_ev)
        t0 = self._now()
        src = self.a if chunk.which == "A" else self.b
        view = buf.view((chunk.r1 - chunk.r0, chunk.c1 - chunk.c0), self.dtype)
        np.copyto(view, src[chunk.r0:chunk.r1, chunk.c0:chunk.c1], casting="unsafe")
        if self.timeline is not None:
            with self._host_lock:
                self._host_ops.append(("host-stage", chunk.label, t0, self._now()))
        return view

    def _unstage(self, ev, view, r0, r1, c0, c1, label):
        self.dev.bind_thread()
        self.dev.sync_event(ev)
        t0 = self._now()
        if self._out_lock is None:
            np.copyto(self.out[r0:r1, c0:c1], view, casting="unsafe")
        else:
            with self._out_lock:
                self.out[r0:r1, c0:c1] = view
        if self.timeline is not None:
            with self._host_lock:
                self._host_ops.append(("host-unstage", label, t0, self._now()))

    # -- GPU ops with optional timing ------------------------------------------------
    def _timed(self, lane, name, stream, fn):
        if self.timeline is None:
            fn()
            return
        e0, e1 = self.dev.event(True), self.dev.event(True)
        self.dev.record(e0, stream)
        fn()
        self.dev.record(e1, stream)
        self._gpu_ops.append((lane, name, e0, e1))

    # -- the run --------------------------------------------------------------------
    def execute(self) -> None:
        dev, t = self.dev, self.t
        dtype = self.dtype
        steps = plan_block_loads(t)
        chunk_bytes, n_in, n_out = self._chunk_bytes()
        chunks = self._chunks(steps, chunk_bytes)

        # Device buffers first: an out-of-memory error here costs nothing.
        a_mem = [dev.alloc(t.a_slot_bytes) for _ in range(t.a_slots)]
        if t.b_resident:
            b_whole = dev.array(dev.alloc(t.b_bytes), (t.k_edges[-1], t.tn_max), dtype)
            b_mem = None
        else:
            b_mem = [dev.alloc(t.b_slot_bytes) for _ in range(t.b_slots)]
        c_mem = [dev.alloc(t.c_buffer_bytes) for _ in range(t.c_buffers)]

        def b_block(slot, kb, rows, width):
            if b_mem is None:
                return b_whole[t.k_edges[kb]:t.k_edges[kb + 1]]
            return dev.array(b_mem[slot], (rows, width), dtype)
        h2d, comp, d2h = dev.stream(), dev.stream(), dev.stream()
        ring_in = self.pool.acquire_many(chunk_bytes, n_in)
        try:
            ring_out = self.pool.acquire_many(chunk_bytes, n_out)
        except BaseException:
            for buf in ring_in:
                self.pool.release(buf)
            raise
        stage_pool = _thread_pool("stage", self.host_threads)
        unstage_pool = _thread_pool("unstage", max(2, self.host_threads // 2))
        writer = _OutputWriter(self, d2h, c_mem, ring_out, unstage_pool)
        t0_ev = dev.event(self.timeline is not None)
        dev.record(t0_ev, comp)
        if self.timeline is not None:
            dev.sync_event(t0_ev)
        host_t0 = self._now()
        wall0 = host_t0
        futures: dict[int, cf.Future] = {}
        ring_ev: list = [None] * n_in
        try:
            def submit(c):
                r = c % n_in
                futures[c] = stage_pool.submit(self._stage, chunks[c], ring_in[r], ring_ev[r])

            for c in range(min(n_in, len(chunks))):
                submit(c)
            writer.start()
            a_free: list = [None] * t.a_slots
            b_free: list = [None] * t.b_slots
            a_loaded: list = [None] * t.a_slots
            b_loaded: list = [None] * t.b_slots
            c_free: list = [None] * t.c_buffers   # futures -> event of the copy-out
            c = 0
            s = dtype.itemsize
            for idx, st in enumerate(steps):
                cb = st.unit % t.c_buffers
                while c < len(chunks) and chunks[c].step == idx:
                    ch = chunks[c]
                    view = futures.pop(c).result()
                    free_ev, loaded = (a_free, a_loaded) if ch.which == "A" else (b_free, b_loaded)
                    if ch.first and free_ev[ch.slot] is not None:
                        dev.wait(h2d, free_ev[ch.slot])
                    width = ch.c1 - ch.c0
                    if ch.which == "A":
                        block = dev.array(a_mem[ch.slot], (ch.block_rows, width), dtype)
                    else:
                        block = b_block(ch.slot, st.kb, ch.block_rows, width)
                    dst = block[ch.d0:ch.d0 + (ch.r1 - ch.r0)]
                    self._timed("h2d", ch.label, h2d, lambda: dev.h2d(dst, view, h2d))
                    self.bytes_h2d += view.nbytes
                    ev = dev.event()
                    dev.record(ev, h2d)
                    ring_ev[c % n_in] = ev
                    if ch.last:
                        loaded[ch.slot] = ev
                    if c + n_in < len(chunks):
                        submit(c + n_in)
                    c += 1
                if st.first and c_free[cb] is not None:
                    dev.wait(comp, c_free[cb].result())
                dev.wait(comp, a_loaded[st.a_slot])
                dev.wait(comp, b_loaded[st.b_slot])
                r0, r1 = t.row_edges[st.i], t.row_edges[st.i + 1]
                q0, q1 = t.col_edges[st.j], t.col_edges[st.j + 1]
                k0, k1 = t.k_edges[st.kb], t.k_edges[st.kb + 1]
                a_dev = dev.array(a_mem[st.a_slot], (r1 - r0, k1 - k0), dtype)
                b_dev = b_block(st.b_slot, st.kb, k1 - k0, q1 - q0)
                c_dev = dev.array(c_mem[cb], (r1 - r0, q1 - q0), dtype)
                beta = 0.0 if st.first else 1.0
                self._timed("compute", f"C[{st.i},{st.j}] k{st.kb}", comp,
                            lambda: self.gemm(a_dev, b_dev, c_dev, alpha=1.0, beta=beta,
                                              stream=comp))
                ev = dev.event()
                dev.record(ev, comp)
                a_free[st.a_slot] = ev
                b_free[st.b_slot] = ev
                if st.last:
                    c_free[cb] = writer.submit(st.unit, st.i, st.j, cb, ev)
                if writer.error is not None:
                    raise writer.error
            writer.finish()
            dev.synchronize()
        except BaseException:
            self._cancel.set()
            writer.abort()
            try:
                dev.synchronize()
            except Exception:  # pragma: no cover - the device is already broken
                pass
            raise
        finally:
            for f in futures.values():
                f.cancel()
            cf.wait(list(futures.values()))
            cf.wait([f for f in writer.ring_futs if f is not None])
            for buf in ring_in + ring_out:
                self.pool.release(buf)
            writer.c_mem = None
        self.seconds = self._now() - wall0
        if self.timeline is not None:
            self._fill_timeline(t0_ev, host_t0)

    def _fill_timeline(self, t0_ev, host_t0) -> None:
        tl = self.timeline
        for lane, name, e0, e1 in self._gpu_ops:
            tl.add(lane, name, self.dev.elapsed_ms(t0_ev, e0), self.dev.elapsed_ms(t0_ev, e1))
        for lane, name, h0, h1 in self._host_ops:
            tl.add(lane, name, (h0 - host_t0) * 1e3, (h1 - host_t0) * 1e3)
        tl.ops.sort(key=lambda o: (o["lane"], o["start_ms"]))


class _OutputWriter(threading.Thread):
    """Copies finished C units out: device -> pinned ring (d2h stream) -> ``out``
    (unstage threads). ``submit`` returns a future for the event after which the
    unit's C buffer may be overwritten."""

    def __init__(self, run: _PipelineRun, d2h, c_mem, ring_out, unstage_pool):
        super().__init__(name="distmm-d2h", daemon=True)
        self.run_ = run
        self.d2h = d2h
        self.c_mem = c_mem
        self.ring = ring_out
        self.ring_futs: list = [None] * len(ring_out)
        self.unstage_pool = unstage_pool
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self._next = 0

    def submit(self, unit, i, j, cb, done_ev) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.jobs.put((unit, i, j, cb, done_ev, fut))
        return fut

    def run(self) -> None:
        r = self.run_
        dev, t, dtype = r.dev, r.t, r.dtype
        dev.bind_thread()
        while True:
            job = self.jobs.get()
            if job is None:
                break
            unit, i, j, cb, done_ev, fut = job
            if self.error is not None:
                fut.set_exception(self.error)
                continue
            try:
                r0, r1 = t.row_edges[i], t.row_edges[i + 1]
                q0, q1 = t.col_edges[j], t.col_edges[j + 1]
                width = q1 - q0
                c_dev = dev.array(self.c_mem[cb], (r1 - r0, width), dtype)
                rows = max(1, self.ring[0].nbytes // (width * dtype.itemsize))
                dev.wait(self.d2h, done_ev)
                for p0 in range(0, r1 - r0, rows):
                    p1 = min(p0 + rows, r1 - r0)
                    slot = self._next % len(self.ring)
                    self._next += 1
                    if self.ring_futs[slot] is not None:
                        self.ring_futs[slot].result()   # the unstage that used it is done
                    view = self.ring[slot].view((p1 - p0, width), dtype)
                    src = c_dev[p0:p1]
                    label = f"C[{i},{j}]"
                    r._timed("d2h", label, self.d2h, lambda: dev.d2h(view, src, self.d2h))
                    r.bytes_d2h += view.nbytes
                    ev = dev.event()
                    dev.record(ev, self.d2h)
                    self.ring_futs[slot] = self.unstage_pool.submit(
                        r._unstage, ev, view, r0 + p0, r0 + p1, q0, q1, label)
                free_ev = dev.event()
                dev.record(free_ev, self.d2h)
                fut.set_result(free_ev)
            except BaseException as exc:  # handed to the main thread
                self.error = exc
                fut.set_exception(exc)

    def finish(self) -> None:
        self.jobs.put(None)
        self.join()
        if self.error is not None:
            raise self.error
        for f in self.ring_futs:
            if f is not None:
                f.result()

    def abort(self) -> None:
        if self.error is None:
            self.error = _Cancelled()
        self.jobs.put(None)
        if self.is_alive():
            self.join()
        for f in self.ring_futs:
            if f is not None:
                try:
                    f.result()
                except BaseException:
                    pass


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------

def _resolve_budget(device, device_memory_limit) -> int:
    available = int(0.95 * device.available_bytes())
    if device_memory_limit is None:
        from distmm.config import get_config

        device_memory_limit = get_config().device_memory_limit
    if device_memory_limit is None:
        return int(0.9 * device.available_bytes())
    if isinstance(device_memory_limit, str):
        from dask.utils import parse_bytes

        device_memory_limit = parse_bytes(device_memory_limit)
    return min(int(device_memory_limit), available)


def _check_shapes(a, b, out, m, n, k) -> None:
    for name, x, shape in (("a", a, (m, k)), ("b", b, (k, n)), ("out", out, (m, n))):
        if len(x.shape) != 2 or tuple(x.shape) != shape:
            raise ValueError(f"pipelined matmul: {name} has shape {tuple(x.shape)}, expected {shape} "
                             f"(a {tuple(a.shape)}, b {tuple(b.shape)})")


def run_pipelined(executor, plan, a, b, out, *, device_memory_limit=None, pinned_pool=None,
                  trace: Timeline | None = None, tiles: tuple[int, int, int] | None = None,
                  info: dict | None = None, _device=None):
    """Compute ``out[...] = a @ b`` on the GPU from host-resident operands.

    Parameters
    ----------
    executor
        Any object with ``device_gemm(a_dev, b_dev, c_dev, *, alpha, beta,
        stream)`` computing into a preallocated cupy array on a stream
        (``GPUExecutor``, or ``CublasGemm``).
    plan : Plan
        Only ``m``, ``n``, ``k`` and ``dtype`` are used: the pipeline makes its
        own tiling from the device budget (the plan's tiles are for CPUs and
        clusters).
    a, b : array-like of shape (m, k), (k, n)
        numpy arrays, memmaps, zarr or h5py arrays: anything whose 2-D slices
        are numpy arrays; read tile by tile, never whole.
    out : writable array of shape (m, n)
        numpy array, memmap or zarr array; every element is written.
    device_memory_limit : int or str, optional
        Device bytes the pipeline may use. Default: ``distmm.device-memory-limit``,
        else 90% of the free device memory. Products far larger than this
        run in pieces.
    pinned_pool : PinnedPool, optional
        Staging buffers; default: the process-wide pool (``distmm.pinned-pool``).
    trace : Timeline, optional
        Filled with the start and end of every copy and kernel.
    tiles : (tm, tn, tk), optional
        Force square tiles of these sizes (mainly for tests).
    info : dict, optional
        Filled with the tiling used, the retries after out-of-memory errors,
        bytes copied each way and wall seconds.

    Returns
    -------
    out

    Raises
    ------
    TypeError
        A result dtype other than float32 / float64.
    ValueError
        Shapes that do not match the plan.
    MemoryError
        The device ran out of memory even with the smallest tiles (no partial
        result is returned).
    """
    m, n, k = int(plan.m), int(plan.n), int(plan.k)
    dtype = np.dtype(plan.dtype)
    if dtype not in FAST_DTYPES:
        raise TypeError(f"the stream pipeline computes float32 and float64 results, got {dtype}; "
                        f"use the GPU executor's tile path for this dtype")
    _check_shapes(a, b, out, m, n, k)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out[...] = 0
        return out
    if pinned_pool is None:
        from distmm.executor.pinned import default_pinned_pool

        pinned_pool = default_pinned_pool()
    device = _device if _device is not None else _CupyDevice(1 << 62)
    budget = _resolve_budget(device, device_memory_limit)
    if _device is None:
        device.pool.set_limit(size=budget)
    gemm = executor.device_gemm
    tiling = choose_tiling(m, n, k, dtype.itemsize, budget, tiles=tiles)
    retries = 0
    while True:
        run = _PipelineRun(device, gemm, tiling, a, b, out, dtype, pinned_pool,
                           Timeline() if trace is not None else None, _host_threads())
        failure = None
        try:
            run.execute()
        except device.oom_errors as exc:
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            device.release()
        if failure is None:
            break
        # The whole product starts over: every element of out is written again,
        # so no tile of the failed attempt survives.
        gc.collect()      # the failed attempt's frames are gone: free its buffers
        device.release()
        retries += 1
        smaller = _shrink(tiling, m, n, k, dtype.itemsize, budget)
        if smaller is None:
            raise MemoryError(f"the GPU ran out of memory even with {tiling.tm_max} x "
                              f"{tiling.tn_max} tiles (budget {budget} bytes): {failure}")
        log.warning("GPU out of memory with %d x %d x %d tiles (%s); retrying with %d x %d x %d",
                    tiling.tm_max, tiling.tn_max, tiling.tk_max, failure,
                    smaller.tm_max, smaller.tn_max, smaller.tk_max)
        tiling = smaller
    if trace is not None:
        trace.ops.extend(run.timeline.ops)
        trace.meta.update(m=m, n=n, k=k, dtype=dtype.name, device=getattr(device, "name", "?"),
                          tiling=tiling.describe(), retries=retries, seconds=run.seconds,
                          bytes_h2d=run.bytes_h2d, bytes_d2h=run.bytes_d2h,
                          tflops=2 * m * n * k / run.seconds / 1e12 if run.seconds else None,
                          budget=budget, pinned_limit=pinned_pool.limit)
    if info is not None:
        info.update(tiling=tiling.describe(), retries=retries, seconds=run.seconds,
                    bytes_h2d=run.bytes_h2d, bytes_d2h=run.bytes_d2h, budget=budget)
    return out


def _shrink(tiling: PipelineTiling, m, n, k, s, budget) -> PipelineTiling | None:
    """The next smaller tiling after an out-of-memory error: square tiles of half
    the size (then half the k-block, then single slots), given at most half the
    device memory the failed tiling asked for; None at the floor."""
    tm, tn, tk = tiling.tm_max, tiling.tn_max, tiling.tk_max
    base = min(tm, tn) if tiling.mode == "full-width" else max(tm, tn)
    usable = min(int(budget * _BUDGET_FRACTION), tiling.device_bytes // 2)
    if base > 64:
        nt = max(64, base // 2)
        return _fill_slots(m, n, k, s, usable, min(nt, m), min(nt, n), min(tk, nt, k), minimum=2)
    if tk > 64:
        return _fill_slots(m, n, k, s, usable, tm, tn, max(64, tk // 2), minimum=2)
    if tiling.a_slots > 1 or tiling.b_slots > 1 or tiling.c_buffers > 1:
        return PipelineTiling(tiling.row_edges, tiling.col_edges, tiling.k_edges,
                              1, 1, 1, s, "tiles")
    return None


def _gemm_executor(backend: str):
    """``CublasGemm`` for ``"cublas"`` (cuBLAS with beta, no temporaries), else the
    GPU executor with that backend."""
    if backend == "cublas":
        return CublasGemm()
    try:
        from distmm.executor.gpu import GPUExecutor
    except ImportError as exc:
        if backend == "auto":
            return CublasGemm()
        from distmm.executor.base import BackendUnavailable

        raise BackendUnavailable(f"backend {backend!r} needs distmm.executor.gpu ({exc})") from exc
    return GPUExecutor(backend=backend)


def matmul_to(a, b, out=None, *, backend: str = "cublas", device_memory_limit=None,
              trace: Timeline | None = None, pinned_pool=None, info: dict | None = None):
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
        As for ``run_pipelined``.

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
    executor = _gemm_executor(backend)
    try:
        return run_pipelined(executor, plan, a, b, out, device_memory_limit=device_memory_limit,
                             pinned_pool=pinned_pool, trace=trace, info=info)
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            close()
