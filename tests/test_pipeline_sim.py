"""The stream pipeline's schedule and ordering, checked on the CPU.

A simulated device stands in for CUDA: each stream is a thread that runs its
operations in order after a random delay, events are flags set when a stream
reaches them, and copies read their source when they run (as DMA does). A
missing event wait, a staging buffer refilled too early or a slot reloaded
while a kernel still reads it then shows as a wrong result. The same code
path runs on the GPU in ``test_gpu_pipeline.py``.
"""
from __future__ import annotations

import math
import queue
import random
import threading
import time

import dask.config
import numpy as np
import pytest

from distmm.executor.pinned import PinnedPool
from distmm.executor.pipeline.panel import panel_bytes
from distmm.executor.pipeline.product import DIRECT_KEY
from distmm.executor.pipeline import Timeline, run_pipelined
from distmm.plan_pipeline import (PipelineTiling, choose_tiling, pipeline_tiling, plan_block_loads,
                                   spare_bytes)
from distmm.plan import make_plan, result_dtype


class SimOOM(MemoryError):
    pass


class SimStream:
    def __init__(self, jitter: float):
        self.jitter = jitter
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        self.ptr = id(self)

    def _loop(self):
        rng = random.Random(id(self))
        while True:
            fn = self.q.get()
            if fn is None:
                return
            if self.jitter:
                time.sleep(rng.random() * self.jitter)
            fn()

    def enqueue(self, fn):
        self.q.put(fn)


class SimEvent:
    def __init__(self):
        self.flag = None
        self.when = None


class SimMem:
    def __init__(self, nbytes):
        self.buf = np.empty(nbytes, np.uint8)
        self.buf[:] = 0xFF  # NaN pattern for floats: stale reads show


class SimDevice:
    name = "simulated"
    oom_errors = (SimOOM,)

    def __init__(self, limit=1 << 40, jitter=0.0005):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.jitter = jitter
        self.streams: list[SimStream] = []
        self.allocs = 0
        # page-locking in place: {ptr: nbytes} locked now; the result's byte range, into
        # which every copy must find its bytes inside one locked range when it runs
        # (``unlocked_copies`` else)
        self.locked: dict[int, int] = {}
        self.lock_calls = 0
        self.lock_log: list = []  # every (ptr, nbytes) page-locked
        self.h2d_2d_calls = 0
        self.d2h_2d_calls = 0
        self.fail_lock_after: int | None = None
        self.watch: list[tuple[int, int]] = []
        self.unlocked_copies: list = []
        self._lock_guard = threading.Lock()

    def bind_thread(self):
        pass

    def available_bytes(self):
        return self.limit

    def alloc(self, nbytes):
        if self.used + nbytes > self.limit:
            raise SimOOM(f"simulated device: {nbytes} bytes asked, {self.limit - self.used} free")
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.allocs += 1
        return SimMem(nbytes)

    def release(self):
        self.used = 0

    def array(self, mem, shape, dtype):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        return mem.buf[:count * dtype.itemsize].view(dtype).reshape(shape)

    def stream(self):
        s = SimStream(self.jitter)
        self.streams.append(s)
        return s

    def event(self, timing=False):
        return SimEvent()

    def record(self, ev, stream):
        flag = threading.Event()
        ev.flag = flag

        def mark():
            ev.when = time.perf_counter()
            flag.set()
        stream.enqueue(mark)

    def wait(self, stream, ev):
        flag = ev.flag
        if flag is not None:
            stream.enqueue(flag.wait)

    def sync_event(self, ev):
        if ev.flag is not None:
            ev.flag.wait()

    def elapsed_ms(self, e0, e1):
        return (e1.when - e0.when) * 1e3

    def h2d(self, dst, src, stream):
        def run():
            self._check_locked(src)
            np.copyto(dst, src)
        stream.enqueue(run)

    def d2h(self, dst, src, stream):
        def run():
            self._check_locked(dst)
            np.copyto(dst, src)
        stream.enqueue(run)

    def _copy_2d(self, dst, src, stream, host):
        assert src.strides[1] == src.itemsize and dst.strides[1] == dst.itemsize, "rows contiguous"

        def run():
            self._check_locked(host)
            np.copyto(dst, src)
        stream.enqueue(run)

    def d2h_2d(self, dst, src, stream):
        self.d2h_2d_calls += 1
        self._copy_2d(dst, src, stream, dst)

    def h2d_2d(self, dst, src, stream):
        self.h2d_2d_calls += 1
        self._copy_2d(dst, src, stream, src)

    def _check_locked(self, host):
        """A copy touching a watched array (the result, or an operand copied straight) must
        find its bytes inside one page-locked range when it runs."""
        lo = host.ctypes.data
        hi = lo + (host.shape[0] - 1) * host.strides[0] + host.shape[1] * host.itemsize \
            if host.ndim == 2 else lo + host.nbytes
        if any(lo < b and hi > a for a, b in self.watch) and not self._covered(lo, hi):
            self.unlocked_copies.append((lo, hi))

    def host_register(self, ptr, nbytes):
        with self._lock_guard:
            if self.fail_lock_after is not None and self.lock_calls >= self.fail_lock_after:
                raise RuntimeError("simulated device: cannot page-lock this memory")
            assert all(ptr + nbytes <= p or p + n <= ptr for p, n in self.locked.items()), \
                "page-locked twice"
            self.locked[ptr] = nbytes
            self.lock_calls += 1
            self.lock_log.append((ptr, nbytes))

    def host_unregister(self, ptr):
        with self._lock_guard:
            del self.locked[ptr]

    def host_is_locked(self, ptr, nbytes):
        return self._covered(ptr, ptr + nbytes)

    def _covered(self, lo, hi):
        """Inside one page-locked range (CUDA rejects a copy across two)."""
        with self._lock_guard:
            return any(p <= lo and hi <= p + n for p, n in self.locked.items())

    def synchronize(self):
        for s in self.streams:
            ev = SimEvent()
            self.record(ev, s)
            self.sync_event(ev)

    def close(self):
        for s in self.streams:
            s.q.put(None)


class SimGemm:
    precision = "highest"

    def __init__(self):
        self.calls = 0

    def device_gemm(self, a, b, c, *, alpha=1.0, beta=0.0, stream=None):
        self.calls += 1

        def run():
            if beta == 0:
                c[...] = alpha * (a @ b)
            else:
                c[...] = alpha * (a @ b) + beta * c
        stream.enqueue(run)


def numpy_pool(limit):
    return PinnedPool(limit, allocator=lambda n: (np.empty(n, np.uint8), None))


class SimTf32Gemm(SimGemm):
    """An executor of ``precision="tf32"`` as the pipeline's schedule sees it (its k-blocks,
    its units and A's panels); the simulated products stay exact float32 ones."""
    precision = "tf32"


class SimBf16Gemm(SimGemm):
    """An executor of ``precision="bf16"``: it takes bfloat16 bits (uint16) as they are."""
    precision = "bf16"

    def device_gemm(self, a, b, c, *, alpha=1.0, beta=0.0, stream=None):
        self.calls += 1

        def bits(x):  # read when the stream runs, as a kernel reads its operands
            return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x

        def run():
            if beta == 0:
                c[...] = alpha * (bits(a) @ bits(b))
            else:
                c[...] = alpha * (bits(a) @ bits(b)) + beta * c
        stream.enqueue(run)


def run_sim(a, b, out=None, *, device_limit=1 << 30, pinned=1 << 20, tiles=None, trace=None,
            jitter=0.0005, gemm=None, direct=None, fail_lock_after=None, owner_locked=()):
    """``owner_locked``: the names ("A", "B", "C") of arrays page-locked by their owner before
    the product, each one range (as ``cupyx.empty_pinned``'s), which must stay locked."""
    m, k = a.shape
    n = b.shape[1]
    dtype = result_dtype(a.dtype, b.dtype)
    if out is None:
        out = np.full((m, n), np.nan, dtype=dtype)
    plan = make_plan(m, n, k, dtype)
    dev = SimDevice(device_limit, jitter)
    dev.fail_lock_after = fail_lock_after
    dev.watch = [(x.ctypes.data, x.ctypes.data + x.nbytes) for x in (out, a, b)
                 if isinstance(x, np.ndarray)]
    for name, x in (("A", a), ("B", b), ("C", out)):
        if name in owner_locked:
            dev.host_register(x.ctypes.data, x.nbytes)
    owners = dict(dev.locked)
    dev.lock_calls, dev.lock_log = 0, []
    pool = numpy_pool(pinned)
    info: dict = {}
    forced = {} if direct is None else {DIRECT_KEY: direct}
    try:
        with dask.config.set(forced):
            run_pipelined(gemm or SimGemm(), plan, a, b, out, device_memory_limit=device_limit,
                          pinned_pool=pool, tiles=tiles, trace=trace, info=info, _device=dev)
    finally:
        dev.close()
    assert dev.unlocked_copies == [], "a copy into the result found its bytes not page-locked"
    assert dev.locked == owners, "page-locked after the product, or the owner's lock undone"
    assert pool.peak_bytes <= pool.limit
    pool.close()
    assert pool.held_bytes == 0
    return out, info, dev


def rand(shape, dtype, rng):
    return rng.standard_normal(shape).astype(dtype)


def check(c, a, b):
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert np.isfinite(c).all(), "unwritten (NaN) elements"
    err = np.linalg.norm(c - ref) / np.linalg.norm(ref)
    tol = 1e-5 if np.asarray(c).dtype == np.float32 else 1e-12
    assert err < tol, err


# -- the schedule -------------------------------------------------------------------

@pytest.mark.parametrize("shape,itemsize,budget", [
    ((32768, 32768, 32768), 4, 70 << 30),
    ((32768, 32768, 32768), 8, 70 << 30),
    ((32768, 32768, 32768), 4, 8 << 30),
    ((32768, 32768, 32768), 8, 8 << 30),
    ((16384, 16384, 16384), 4, 70 << 30),
    ((4097, 1023, 2049), 8, 16 << 20),
    ((65, 7000, 3), 4, 1 << 20),
    ((1, 1, 1), 8, 1 << 20),
])
def test_tiling_fits_budget(shape, itemsize, budget):
    m, n, k = shape
    t = choose_tiling(m, n, k, itemsize, budget)
    assert t.device_bytes <= budget * 0.92
    assert t.row_edges[0] == 0 and t.row_edges[-1] == m
    assert t.col_edges[-1] == n and t.k_edges[-1] == k
    assert all(x < y for x, y in zip(t.row_edges, t.row_edges[1:]))


def test_the_pipeline_runs_the_planners_tiling():
    """One planner: the schedule the pipeline ran is ``pipeline_tiling(plan, budget)``."""
    rng = np.random.default_rng(11)
    a, b = rand((300, 170), np.float32, rng), rand((170, 230), np.float32, rng)
    c, info, _ = run_sim(a, b, device_limit=1 << 20)
    check(c, a, b)
    plan = make_plan(300, 230, 170, np.float32)
    assert info["tiling"] == pipeline_tiling(plan, info["budget"]).describe()
    with pytest.raises(TypeError, match="float32 and float64"):
        pipeline_tiling(make_plan(4, 4, 4, np.int32), 1 << 20)


@pytest.mark.parametrize("budget", [120 << 30, 24 << 30, 8 << 30, 1 << 30])
def test_tensor_core_precisions_take_wider_k_blocks(budget):
    """A tensor-core GEMM re-reads C's unit at every k-block at a cost that matters beside
    it: reduced precisions take k-blocks up to 8192 where they fit, "highest" stays at 2048,
    and every tiling fits the budget."""
    plan = make_plan(32768, 32768, 32768, np.float32)
    hi = pipeline_tiling(plan, budget)
    assert hi.tk_max <= 2048
    for precision in ("tf32", "bf16", "fp16"):
        t = pipeline_tiling(plan, budget, precision=precision)
        assert t.device_bytes <= budget * 0.92 and t.k_edges[-1] == 32768
        assert t.tk_max >= hi.tk_max
        if budget >= 24 << 30:
            assert t.mode == "full-width" and t.tk_max == 8192
            # units of a quarter of the widest that fits (16384 rows here), then down
            assert t.tm_max == 4096 and np.diff(t.row_edges)[0] == 4096
    assert pipeline_tiling(plan, 120 << 30).tk_max == 2048


def test_full_width_when_b_fits_and_tail_is_short():
    t = choose_tiling(32768, 32768, 32768, 4, 70 << 30)
    assert t.mode == "full-width" and t.b_slots == len(t.k_edges) - 1
    sizes = np.diff(t.row_edges)
    assert sizes[0] == sizes.max()  # the first unit is the largest (B loads amortised)
    assert sizes[-1] * 32768 * 4 <= 256 << 20  # little output left after the last kernel


@pytest.mark.parametrize("a_slots,b_slots", [(1, 1), (2, 2), (3, 5), (40, 40)])
def test_block_loads_keep_every_kernel_fed(a_slots, b_slots):
    t = PipelineTiling((0, 100, 200, 300), (0, 50, 100, 150, 160), (0, 64, 128, 130),
                       a_slots, b_slots, 2, 8)
    steps = plan_block_loads(t)
    assert len(steps) == 3 * 4 * 3
    a_res, b_res = {}, {}
    loads_a = loads_b = 0
    for st in steps:
        if st.load_a:
            a_res[st.a_slot] = (st.i, st.kb)
            loads_a += 1
        if st.load_b:
            b_res[st.b_slot] = (st.kb, st.j)
            loads_b += 1
        assert a_res.get(st.a_slot) == (st.i, st.kb)
        assert b_res.get(st.b_slot) == (st.kb, st.j)
        assert 0 <= st.a_slot < a_slots and 0 <= st.b_slot < b_slots
    # each block is loaded at least once; with room for everything, exactly once
    assert loads_a >= 3 * 3 and loads_b >= 4 * 3
    if a_slots >= 9 and b_slots >= 12:
        assert (loads_a, loads_b) == (9, 12)
    # every unit starts with beta = 0 and ends once
    assert sum(st.first for st in steps) == sum(st.last for st in steps) == 12


def test_narrow_units_lead_k_outer_while_b_first_crosses():
    """Beside tensor-core GEMMs the first ``LEAD`` units run k outer: each k-block of B, as
    it first arrives, feeds all of them; C buffers hold them and two more within the budget;
    every (unit, k-block) GEMM is issued once, each unit's first with beta = 0 and its last
    ending it; later units keep alternating k directions."""
    from distmm.plan_pipeline import LEAD

    plan = make_plan(32768, 32768, 32768, np.float32)
    budget = 130 << 30
    t = pipeline_tiling(plan, budget, precision="bf16")
    assert t.lead == LEAD == 2 and t.c_buffers == LEAD + 2
    assert t.device_bytes <= budget * 0.92
    assert pipeline_tiling(plan, budget).lead == 1  # "highest": unit by unit, as before
    for lead in (1, 2, 3, 4):
        assert pipeline_tiling(plan, budget, precision="bf16", lead=lead).lead == lead
    lead = 3
    t = pipeline_tiling(plan, budget, precision="bf16", lead=lead)
    steps = plan_block_loads(t)
    gk = len(t.k_edges) - 1
    head = [(st.unit, st.kb) for st in steps[:lead * gk]]
    # k outer, but each leading unit's last two k-blocks together, the first unit's first
    assert head == ([(u, kb) for kb in range(gk - 2) for u in range(lead)]
                    + [(u, kb) for u in range(lead) for kb in (gk - 2, gk - 1)])
    assert sorted((st.unit, st.kb) for st in steps) == [
        (u, kb) for u in range(len(t.row_edges) - 1) for kb in range(gk)]
    for u in range(len(t.row_edges) - 1):
        mine = [st for st in steps if st.unit == u]
        assert mine[0].first and mine[-1].last and sum(st.first for st in mine) == 1
        assert sum(st.last for st in mine) == 1
    after = [st.kb for st in steps[lead * gk:]]
    assert after[:gk] == list(range(gk))[::-1] and after[gk:2 * gk] == list(range(gk))


def test_serpentine_reuses_b_panels_across_sweeps():
    t = PipelineTiling((0, 64, 128), (0, 64, 128, 192), (0, 64), 4, 2, 2, 4)
    steps = plan_block_loads(t)
    # the second sweep starts on the panel the first one ended on: no reload there
    assert [s.j for s in steps] == [0, 1, 2, 2, 1, 0]
    assert not steps[3].load_b


# -- whole products on the simulated device --------------------------------------------

@pytest.mark.parametrize("m,n,k", [(300, 257, 129), (64, 1000, 70), (513, 7, 1031), (1, 1, 1)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_product_matches_numpy(m, n, k, dtype):
    rng = np.random.default_rng(m * n + k)
    a, b = rand((m, k), dtype, rng), rand((k, n), dtype, rng)
    c, info, _ = run_sim(a, b, device_limit=1 << 30, pinned=1 << 20)
    check(c, a, b)
    assert info["retries"] == 0


@pytest.mark.parametrize("m", [1, 5, 63, 64, 65])
@pytest.mark.parametrize("gemm", [SimTf32Gemm, SimBf16Gemm], ids=["tf32", "bf16"])
def test_reduced_precisions_with_fewer_rows_than_a_narrow_unit(m, gemm):
    """The reduced precisions' narrow units are at least 64 rows; fewer rows than that (a
    vector times a matrix, a short A) are one unit with its C buffers (there were none: the
    GPU run divided by zero)."""
    t = choose_tiling(m, 227, 276, 4, 1 << 30, narrow=True)
    assert t.c_buffers >= 1 and t.row_edges[0] == 0 and t.row_edges[-1] == m
    rng = np.random.default_rng(m)
    a, b = rand((m, 276), "float32", rng), rand((276, 227), "float32", rng)
    c, info, _ = run_sim(a, b, gemm=gemm())
    check(c, a, b)


@pytest.mark.slow
def test_operands_several_times_the_device_budget():
    rng = np.random.default_rng(1)
    a, b = rand((700, 600), "float64", rng), rand((600, 650), "float64", rng)
    budget = 600 * 1024  # A + B + C = 9.5 MB, about 15x the budget
    c, info, dev = run_sim(a, b, device_limit=budget, pinned=256 * 1024)
    check(c, a, b)
    assert info["tiling"]["mode"] == "tiles"
    assert dev.peak <= budget
    assert info["bytes_h2d"] > a.nbytes + b.nbytes  # blocks were reloaded


def test_full_width_mode_product():
    rng = np.random.default_rng(2)
    a, b = rand((1500, 300), "float32", rng), rand((300, 200), "float32", rng)
    c, info, _ = run_sim(a, b, device_limit=64 << 20, pinned=1 << 20)
    check(c, a, b)
    assert info["tiling"]["mode"] == "full-width"
    assert info["bytes_h2d"] == a.nbytes + b.nbytes  # each operand crosses once


def test_mixed_dtypes_cast_while_staging():
    rng = np.random.default_rng(3)
    a = rng.integers(-5, 5, (90, 80)).astype(np.int16)
    b = rand((80, 70), "float32", rng)
    c, _, _ = run_sim(a, b)
    assert c.dtype == np.matmul(a[:1], b[:, :1]).dtype == np.float32
    check(c, a, b)


@pytest.mark.parametrize("device_limit", [64 << 20, 400 * 1024], ids=["full-width", "tiles"])
def test_bfloat16_operands_cross_as_their_bits(device_limit):
    """bfloat16 operands under precision="bf16" are staged and copied as their 16-bit
    patterns (half of float32's bytes, nothing converted on the host); the product is the
    same, bit for bit, as with the operands widened to float32 while staging."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    a = rand((700, 300), "float32", rng).astype(ml_dtypes.bfloat16)
    b = rand((300, 250), "float32", rng).astype(ml_dtypes.bfloat16)
    c16, info16, _ = run_sim(a, b, device_limit=device_limit, pinned=256 * 1024,
                             gemm=SimBf16Gemm())
    # the same schedule (a tensor-core precision's k-blocks and units), float32 operands
    c32, info32, _ = run_sim(a, b, device_limit=device_limit, pinned=256 * 1024,
                             gemm=SimTf32Gemm())
    check(c16, a, b)
    assert c16.dtype == np.float32 and c16.tobytes() == c32.tobytes()
    assert (info16["operands_as"], info32["operands_as"]) == ("uint16", "float32")
    assert info16["tiling"] == info32["tiling"]
    assert info16["bytes_h2d"] * 2 == info32["bytes_h2d"] >= 2 * (a.nbytes + b.nbytes)
    assert info16["bytes_d2h"] == info32["bytes_d2h"] == c16.nbytes


def _lanes(trace):
    return {op["lane"] for op in trace.ops}


def _locked_within(dev, x) -> bool:
    lo, hi = x.ctypes.data, x.ctypes.data + x.nbytes
    return any(p < hi and p + n > lo for p, n in dev.lock_log)


@pytest.mark.parametrize("m,n,k,dtype,limit", [
    (1500, 257, 300, "float32", 64 << 20), (999, 130, 77, "float64", 64 << 20),
    pytest.param(3000, 257, 200, "float32", 4 << 20,  # row blocks of ragged bytes
                 marks=pytest.mark.slow),
    pytest.param(3001, 130, 90, "float64", 2 << 20,   # tiles mode, one column block
                 marks=pytest.mark.slow),
    pytest.param(400, 700, 600, "float32", 1 << 20,  # tiles mode, several column blocks
                 marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_direct_copies_page_locked_in_place(m, n, k, dtype, limit):
    """Copies straight between the device and the caller's arrays: each finds its bytes
    inside one page-locked range when it runs (blocks whose ends are not page-aligned share a
    segment, a row crossing a segment boundary is cut there), chunks go through the ring
    until their operand's block is locked, C never does where its blocks are whole rows, and
    nothing stays page-locked afterwards (``run_sim`` checks both)."""
    rng = np.random.default_rng(m + n)
    a, b = rand((m, k), dtype, rng), rand((k, n), dtype, rng)
    trace = Timeline()
    # a small ring: chunks of a few rows, so that most are issued after the operands are locked
    c, info, dev = run_sim(a, b, device_limit=limit, pinned=64 * 1024, trace=trace, direct=True)
    check(c, a, b)
    assert info["direct_in"] and dev.h2d_2d_calls > 0
    assert _locked_within(dev, a) and _locked_within(dev, b)
    if info["tiling"]["col_sizes"] == [n]:
        assert info["direct_out"] and _locked_within(dev, c)
        assert "host-unstage" not in _lanes(trace)
    else:
        assert not info["direct_out"] and "host-unstage" in _lanes(trace)
    assert info["bytes_d2h"] == c.nbytes


def test_direct_copies_only_where_asked():
    rng = np.random.default_rng(8)
    a, b = rand((600, 300), "float32", rng), rand((300, 250), "float32", rng)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a16, b16 = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
    for gemm in (SimBf16Gemm(), SimGemm()):
        x, y = (a16, b16) if isinstance(gemm, SimBf16Gemm) else (a, b)
        c, info, dev = run_sim(x, y, device_limit=64 << 20, gemm=gemm)
        check(c, x, y)
        assert dev.lock_calls == 0 and not info["direct_out"] and not info["direct_in"]
        c, info, dev = run_sim(x, y, device_limit=64 << 20, pinned=64 * 1024, gemm=gemm,
                               direct=True)
        check(c, x, y)
        assert info["direct_out"] and info["direct_in"]
        # asked: memory page-locked in place (C's before its copies out; which operand copies
        # go straight depends on when each block's locking ends, the first ones through the
        # ring: since A crosses into panels as whole rows, there may be no 2-D copy at all)
        assert dev.lock_calls > 0 and not dev.unlocked_copies
    # an operand cast while staging (int16 into float64) never goes straight; the other does
    c, info, dev = run_sim(a.astype(np.float64), b.astype(np.int16), device_limit=64 << 20,
                           direct=True)
    assert info["direct_out"] and info["direct_in"] == ["A"]


def test_direct_copies_fall_back_to_the_ring_where_memory_cannot_be_locked():
    rng = np.random.default_rng(9)
    a, b = rand((3000, 200), "float32", rng), rand((200, 260), "float32", rng)
    trace = Timeline()
    c, info, dev = run_sim(a, b, device_limit=4 << 20, pinned=256 * 1024, trace=trace,
                           direct=True, fail_lock_after=1)
    check(c, a, b)
    assert len(info["tiling"]["row_sizes"]) >= 3 and dev.lock_calls == 1
    assert {"host-stage", "host-unstage"} <= _lanes(trace)


@pytest.mark.parametrize("m,n,k,dtype,limit,owned", [
    (1500, 257, 300, "float32", 64 << 20, "ABC"),
    (3001, 130, 90, "float64", 2 << 20, "ABC"),    # tiles mode, one column block
    (400, 700, 600, "float32", 1 << 20, "ABC"),    # several column blocks: C through the ring
    pytest.param(3000, 257, 200, "float32", 4 << 20, "B", marks=pytest.mark.slow),
    (999, 130, 77, "float64", 64 << 20, "AC"),
    pytest.param(3000, 257, 200, "float32", 4 << 20, "AB",  # A's panel does not fit beside
                 marks=pytest.mark.slow),                     # the tiling
    pytest.param(5000, 300, 600, "float32", 16 << 20, "A", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.slow
def test_arrays_page_locked_by_their_owner_cross_straight(m, n, k, dtype, limit, owned,
                                                          tensor_cores):
    """Arrays already page-locked (``cupyx.empty_pinned``) cross straight without being asked
    and without a lock or unlock of distmm's own; the others go through the ring; the owner's
    locks stay (``run_sim`` checks every copy finds its bytes in one locked range)."""
    rng = np.random.default_rng(m * 3 + k)
    a, b = rand((m, k), dtype, rng), rand((k, n), dtype, rng)
    trace = Timeline()
    gemm = SimTf32Gemm() if tensor_cores else SimGemm()
    c, info, dev = run_sim(a, b, device_limit=limit, pinned=64 * 1024, trace=trace,
                           owner_locked=owned, gemm=gemm)
    check(c, a, b)
    assert dev.lock_calls == 0
    assert info["direct_in"] == [w for w in "AB" if w in owned]
    whole_rows = info["tiling"]["col_sizes"] == [n]
    # A's whole rows cross into a device panel where it fits, which the GEMMs read in place
    # (beside tensor-core GEMMs only): no A slot is cut from it
    t = pipeline_tiling(make_plan(m, n, k, dtype), info["budget"], precision=gemm.precision)
    assert t.describe() == info["tiling"]
    fits = panel_bytes(t, np.dtype(dtype).itemsize) <= spare_bytes(t, info["budget"])
    panel = tensor_cores and "A" in owned and whole_rows and len(t.k_edges) > 2 and fits
    assert info["a_panel"] == panel
    if whole_rows:  # each block crosses once (tiles may cross again)
        assert info["bytes_h2d"] == a.nbytes + b.nbytes
    assert info["direct_out"] == ("C" in owned and whole_rows)
    assert ("host-unstage" in _lanes(trace)) == (not info["direct_out"])
    assert ("host-stage" in _lanes(trace)) == (owned.count("A") + owned.count("B") < 2)


@pytest.mark.parametrize("how", ["ABC", pytest.param("AB", marks=pytest.mark.slow), "BC",
                                 "locked-in-place"])
@pytest.mark.parametrize("m,n,k,dtype,columns", [
    pytest.param(1500, 300, 700, "float32", 2, marks=pytest.mark.slow),
    (999, 257, 130, "float64", 3)])
@pytest.mark.slow
def test_column_blocks_where_a_b_and_c_cross_straight(monkeypatch, how, m, n, k, dtype, columns):
    """Asked (``distmm-debug.pipeline-columns``), beside tensor-core GEMMs, where A, B and C
    all cross straight (page-locked by their owner, or in place by the debug setting), C's
    units come in column blocks, in ``unit_order``'s growing order: each operand crosses once
    (A's rows held in a panel each for every block), C's blocks leave as 2-D copies into
    ``out``, and a row block's rows are unlocked only after its last block (``run_sim``
    checks every copy against the locked ranges). Elsewhere, and unasked, whole rows."""
    import distmm.plan_pipeline as plan_pipeline

    monkeypatch.setattr(plan_pipeline, "COLUMN_MIN", 64)  # column blocks at these small sizes
    rng = np.random.default_rng(m + k)
    a, b = rand((m, k), dtype, rng), rand((k, n), dtype, rng)
    trace = Timeline()
    kw = ({"direct": True} if how == "locked-in-place" else {"owner_locked": how})
    with dask.config.set({"distmm-debug.pipeline-columns": columns}):
        c, info, dev = run_sim(a, b, device_limit=64 << 20, pinned=64 * 1024, trace=trace,
                               gemm=SimTf32Gemm(), **kw)
    check(c, a, b)
    blocks = how in ("ABC", "locked-in-place")
    cols = info["tiling"]["col_sizes"]
    assert (len(cols) == columns) == blocks and sum(cols) == n
    if blocks:
        assert all(w % 64 == 0 for w in cols[:-1]) and max(cols) - min(cols) <= 64
        assert info["a_panel"] and info["direct_out"] and dev.d2h_2d_calls > 0
        assert info["bytes_d2h"] == c.nbytes and "host-unstage" not in _lanes(trace)
        if how == "ABC":  # locked by their owner from the start: each byte crosses once
            assert info["bytes_h2d"] == a.nbytes + b.nbytes and "host-stage" not in _lanes(trace)
        # every unit leaves (one copy per page-locked range it touches)
        names = {op["name"] for op in trace.ops if op["lane"] == "d2h"}
        assert len(names) == len(info["tiling"]["row_sizes"]) * columns
    c2, info2, _ = run_sim(a, b, device_limit=64 << 20, pinned=64 * 1024,  # off by default
                           gemm=SimTf32Gemm(), **kw)
    check(c2, a, b)
    assert info2["tiling"]["col_sizes"] == [n]
    with dask.config.set({"distmm-debug.pipeline-columns": "many"}):
        with pytest.raises(ValueError, match="pipeline-columns must be a positive integer"):
            run_sim(a, b, device_limit=64 << 20, pinned=64 * 1024, gemm=SimTf32Gemm(), **kw)


def test_column_blocks_grow_in_both_directions():
    """``unit_order`` with B resident in column blocks: A0 and B0 first, then whichever of the
    next row block or column block keeps the rows and columns met closest to square, each
    adding its units with those met; every unit once. ``plan_block_loads`` loads each block
    once, each k block of each column block in its own place."""
    from distmm.plan_pipeline import choose_tiling, unit_order

    t = choose_tiling(32768, 32768, 32768, 4, 130 << 30, tk_max=8192, narrow=True, columns=4)
    order = unit_order(t)
    gm, gn = len(t.row_edges) - 1, len(t.col_edges) - 1
    assert gn == 4 and sorted(order) == [(i, j) for i in range(gm) for j in range(gn)]
    # 4096-row units, 8192-column blocks: two row blocks a column block
    assert order[:10] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (3, 1), (4, 0),
                          (4, 1)]
    met_rows, met_cols = set(), set()
    for i, j in order:  # a unit comes only with a new row or column block, or both met
        assert (i in met_rows or j in met_cols) or not met_rows
        met_rows.add(i)
        met_cols.add(j)
    steps = plan_block_loads(t)
    places = [st.b_slot for st in steps if st.load_b]
    gk = len(t.k_edges) - 1
    assert len(places) == len(set(places)) == gn * gk and max(places) < t.b_slots
    seen = set()
    for st in steps:  # B's block loaded at its first use, and only there
        assert st.load_b == ((st.kb, st.j) not in seen)
        seen.add((st.kb, st.j))
    assert unit_order(choose_tiling(32768, 32768, 32768, 4, 130 << 30, tk_max=8192,
                                    narrow=True)) == [(i, 0) for i in range(gm)]


def test_a_panel_is_reloaded_only_after_the_last_gemm_reading_it():
    """``APanels``: a row block whose panel still holds a row block with GEMMs not yet issued
    goes as 2-D copies instead (the pipeline's schedule issues every load at its GEMM's step,
    so this guards a schedule that would load further ahead); once those GEMMs are issued the
    panel is reloaded after the last one's event."""
    from types import SimpleNamespace

    from distmm.executor.pipeline.direct import PageLocked
    from distmm.executor.pipeline.panel import APanels
    from distmm.plan_pipeline import Step

    dev = SimDevice()
    a = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    dev.host_register(a.ctypes.data, a.nbytes)
    t = PipelineTiling((0, 4, 8, 12), (0, 3), (0, 2, 5), 2, 2, 2, 4)
    steps = [Step(i, i, 0, kb, kb == 0, kb == 1, 0, 0, True, True) for i in range(3)
             for kb in range(2)]
    run = SimpleNamespace(dev=dev, t=t, bytes_h2d=0, _timed=lambda lane, name, s, fn: fn())
    stream = dev.stream()
    try:
        panels = APanels(run, a, PageLocked(dev, a, t.row_edges), steps)
        assert panels.take(0, stream) and panels.take(1, stream)
        assert not panels.take(2, stream)  # panel 0 still read by row block 0's GEMMs
        assert not panels.take(2, stream) and panels.take(1, stream)  # decided once a block

        panels = APanels(run, a, PageLocked(dev, a, t.row_edges), steps)
        assert panels.take(0, stream) and panels.take(1, stream)
        for _ in range(2):  # row block 0's two GEMMs issued
            ev = dev.event()
            dev.record(ev, stream)
            panels.used(0, ev)
        assert panels.take(2, stream)  # into panel 0, after the last GEMM's event
        dev.synchronize()
        np.testing.assert_array_equal(panels.bufs[0][:4], a[8:12])
        np.testing.assert_array_equal(panels.bufs[1][:4], a[4:8])
        assert run.bytes_h2d == (2 + 3) * a[:4].nbytes
    finally:
        dev.close()


def test_direct_copies_never_lock_a_files_pages(tmp_path):
    rng = np.random.default_rng(10)
    a = np.lib.format.open_memmap(tmp_path / "a.npy", "w+", np.float32, (500, 100))
    a[...] = rand((500, 100), "float32", rng)
    b = rand((100, 120), "float32", rng)
    out = np.lib.format.open_memmap(tmp_path / "c.npy", "w+", np.float32, (500, 120))
    c, info, dev = run_sim(a, b, out, device_limit=64 << 20, direct=True)
    check(np.asarray(c), a, b)
    assert not info["direct_out"] and info["direct_in"] == ["B"]  # B is the process's own
    assert not _locked_within(dev, out) and not _locked_within(dev, a)


@pytest.mark.slow
def test_out_of_memory_shrinks_tiles_and_retries():
    rng = np.random.default_rng(4)
    a, b = rand((512, 512), "float32", rng), rand((512, 512), "float32", rng)
    # 256-tiles need 2*256 KiB of C plus slots: far over a 300 KiB device
    c, info, dev = run_sim(a, b, device_limit=300 * 1024, tiles=(256, 256, 256))
    check(c, a, b)
    assert info["retries"] >= 1
    assert info["tiling"]["tm_max"] < 256


@pytest.mark.slow
def test_out_of_memory_at_the_floor_raises_memory_error():
    rng = np.random.default_rng(5)
    a, b = rand((128, 128), "float64", rng), rand((128, 128), "float64", rng)
    out = np.full((128, 128), np.nan)
    dev = SimDevice(limit=4096, jitter=0)
    pool = numpy_pool(1 << 20)
    with pytest.raises(MemoryError):
        run_pipelined(SimGemm(), make_plan(128, 128, 128, "float64"), a, b, out,
                      device_memory_limit=1 << 30, pinned_pool=pool, tiles=(128, 128, 128),
                      _device=dev)
    dev.close()
    assert pool.in_use_bytes == 0


def test_memmap_and_zarr_operands_and_outputs(tmp_path):
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(6)
    a, b = rand((333, 222), "float32", rng), rand((222, 111), "float32", rng)
    np.save(tmp_path / "a.npy", a)
    a_mm = np.load(tmp_path / "a.npy", mmap_mode="r")
    b_z = zarr.open_array(str(tmp_path / "b.zarr"), mode="w", shape=b.shape, dtype=b.dtype,
                          chunks=(50, 40))
    b_z[...] = b
    out_mm = np.lib.format.open_memmap(tmp_path / "c.npy", mode="w+", dtype=np.float32,
                                       shape=(333, 111))
    out_mm[...] = np.nan
    run_sim(a_mm, b_z, out_mm, device_limit=200 * 1024, pinned=128 * 1024)
    out_mm.flush()
    check(np.load(tmp_path / "c.npy"), a, b)
    out_z = zarr.open_array(str(tmp_path / "c.zarr"), mode="w", shape=(333, 111),
                            dtype=np.float32, chunks=(64, 64), fill_value=np.nan)
    run_sim(a_mm, b_z, out_z, device_limit=200 * 1024, pinned=128 * 1024)
    check(out_z[...], a, b)


def test_zero_sizes():
    a, b = np.ones((3, 0)), np.ones((0, 4))
    c, _, _ = run_sim(a, b)
    assert (c == 0).all() and c.shape == (3, 4)
    c, _, _ = run_sim(np.ones((0, 5)), np.ones((5, 4)))
    assert c.shape == (0, 4)


def test_unsupported_dtype_is_a_type_error():
    a = np.ones((4, 4), np.int32)
    with pytest.raises(TypeError, match="float32 and float64"):
        run_sim(a, a)


def test_pinned_pool_pins_the_first_buffers_now_and_the_rest_behind():
    """acquire_many(first=k) returns once k new buffers are pinned; the others are
    counted at once (all or none) and pinned on a thread, their view waiting for it;
    a failure there is raised by that buffer's view; closing waits for them."""
    import threading

    gate, lock = threading.Event(), threading.Lock()
    made = []

    def alloc(n):
        with lock:
            made.append(n)
            index = len(made)
        if index > 2:
            gate.wait(30)  # the later buffers are still being pinned
        if index == 5:
            raise MemoryError("no more pinned memory")
        return np.full(n, 7, np.uint8), None

    pool = PinnedPool(64 << 20, allocator=alloc)
    bufs = pool.acquire_many(1 << 20, 6, first=2)
    assert len(bufs) == 6 and bufs[0]._ready is None and bufs[1]._ready is None
    assert pool.held_bytes == 6 << 20 and pool.in_use_bytes == 6 << 20
    assert bufs[0].view((4,), np.uint8).tolist() == [7] * 4  # pinned now, no wait
    waiter = threading.Thread(target=lambda: bufs[2].view((4,), np.uint8))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # its memory is not there yet
    gate.set()
    waiter.join(30)
    assert not waiter.is_alive()
    outcomes = []
    for b in bufs[2:]:
        try:
            outcomes.append(b.view((4,), np.uint8).tolist())
        except MemoryError as exc:
            outcomes.append(str(exc))
    assert outcomes.count("no more pinned memory") == 1 and outcomes.count([7] * 4) == 3
    for b in bufs:
        pool.release(b)
    pool.close()
    assert pool.held_bytes == 0


@pytest.mark.slow
def test_trace_records_every_lane():
    rng = np.random.default_rng(7)
    a, b = rand((400, 300), "float64", rng), rand((300, 200), "float64", rng)
    tl = Timeline()
    c, _, _ = run_sim(a, b, device_limit=400 * 1024, pinned=128 * 1024, trace=tl)
    check(c, a, b)
    lanes = {o["lane"] for o in tl.ops}
    assert {"h2d", "compute", "d2h", "host-stage", "host-unstage"} <= lanes
    assert all(o["end_ms"] >= o["start_ms"] >= -1.0 for o in tl.ops)
    assert tl.meta["m"] == 400 and tl.meta["bytes_d2h"] == c.nbytes
    assert math.isfinite(tl.busy_ms("compute"))


def test_pinned_pool_makes_several_new_buffers_on_threads_all_or_none():
    """acquire_many makes the buffers it lacks on up to eight threads (faulting fresh
    pages in is CPU work); when one allocation fails, none is handed out and the pool
    holds nothing of that call."""
    import threading
    import time

    seen, lock = set(), threading.Lock()

    def alloc(n):
        with lock:
            seen.add(threading.current_thread().name)
        time.sleep(0.05)  # as long as faulting a 17 MiB buffer in: the threads overlap
        return np.zeros(n, np.uint8), None

    pool = PinnedPool(64 << 20, allocator=alloc)
    bufs = pool.acquire_many(1 << 20, 8)
    assert len(bufs) == 8 and len({b.ptr for b in bufs}) == 8
    assert all(name.startswith("distmm-pin") for name in seen) and 1 < len(seen) <= 8
    for b in bufs:
        pool.release(b)
    calls = []

    def failing(n):
        with lock:
            calls.append(n)
            if len(calls) == 3:
                raise MemoryError("no more pinned memory")
        return np.zeros(n, np.uint8), None

    pool2 = PinnedPool(64 << 20, allocator=failing)
    with pytest.raises(MemoryError, match="no more pinned"):
        pool2.acquire_many(1 << 20, 6)
    assert pool2.held_bytes == 0 and pool2.in_use_bytes == 0
    pool.close()
    pool2.close()
