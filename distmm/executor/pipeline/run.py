"""One attempt at a pipelined product: copies and kernels on three CUDA streams.

This module covers: executing a ``PipelineTiling``'s schedule
(``distmm.plan_pipeline.plan_block_loads``) once: host threads copy operand
tiles into pinned staging buffers, the ``h2d`` stream copies them into device
block slots, the ``compute`` stream multiplies through the executor's
``device_gemm``, the ``d2h`` stream and an output-writer thread copy finished C
units back out; CUDA events order all of it. Device out-of-memory errors are
raised unchanged so that the caller can retry smaller.

It does *not* cover: choosing the tiling (``distmm.plan_pipeline``), retrying
after out-of-memory or the budget (``distmm.executor.pipeline.product``), or the
device calls themselves (``distmm.executor.pipeline.device``).

Three streams:

- ``h2d``: host staging buffer -> device block slot. Before a slot is reloaded
  the stream waits for the event recorded after the last kernel that read it.
- ``compute``: ``C_unit (+)= A_block @ B_block`` through ``device_gemm``,
  waiting for the loads of its two blocks.
- ``d2h``: finished C unit -> host staging buffer, waiting for the unit's last
  kernel; a C buffer is reused only after its copy-out is done.

Host threads copy operand tiles into pinned staging buffers (numpy releases
the GIL while copying, so several run at once) ahead of the ``h2d`` stream,
and copy results out of them into ``out``; a staging buffer is refilled only
after the event of its previous copy has completed.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from distmm.executor.pipeline.direct import PageLocked
from distmm.executor.pipeline.panel import APanels
from distmm.executor.pipeline.panel import panel_bytes as panel_bytes_of
from distmm.executor.pipeline.timeline import Timeline
from distmm.plan_pipeline import PipelineTiling, Step, plan_block_loads
from distmm.threads import submit

__all__ = ["PipelineRun", "host_threads"]

_MAX_CHUNK = 16 * (1 << 20)      # staging copy granularity
_RING_FIRST = 4                  # staging buffers pinned before the first copy starts
_RING_IN, _RING_OUT = 16, 6      # staging buffers: 352 MiB pinned at most, allocated once per
                                 # process (pinning is slow: a larger ring lengthens the
                                 # first call)


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
            try:  # start them all
                list(pool.map(lambda _: barrier.wait(timeout=10), range(threads)))
            except RuntimeError:  # no new work (the interpreter shutting down while the
                pass  # caller's thread still runs): its tasks run there (distmm.threads.submit)
            old = _pools.get(role)
            _pools[role] = pool
            if old is not None:
                old.shutdown(wait=False)
        return pool


def host_threads() -> int:
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
    block: int          # the operand's block of rows: A's row block i, B's k block kb


#: traced, a copy or GEMM call longer than this on the host shows as a ``host-wait``
_SLOW_CALL = 2e-4


class _Cancelled(Exception):
    pass


class PipelineRun:
    """One attempt at the whole product with one tiling. Raises the device's
    out-of-memory errors unchanged so that the caller can retry smaller."""

    def __init__(self, device, gemm, tiling: PipelineTiling, a, b, out, dtype, pool,
                 timeline: Timeline | None, host_threads: int, on_ready=None, in_dtype=None,
                 direct_out: bool = False, direct_in=(), panel_bytes: int = 0):
        self.dev = device
        self.gemm = gemm
        self.t = tiling
        self.a, self.b, self.out = a, b, out
        self.dtype = np.dtype(dtype)
        # what A and B cross in (``product.operand_transport``): C's dtype, or uint16 for
        # bfloat16 operands' bits (the device slots, sized for C's dtype, are half used)
        self.in_dtype = np.dtype(in_dtype if in_dtype is not None else dtype)
        self.pool = pool
        self.timeline = timeline
        self.host_threads = host_threads
        self.on_ready = on_ready  # called once the device buffers and the ring are held
        # C's row blocks copied straight into ``out``, page-locked in place (``direct``)
        self.direct_out = bool(direct_out) and (len(tiling.col_edges) == 2 or tiling.b_resident)
        # the operands ("A", "B") copied straight from the caller's arrays, as their bytes
        # cross (``in_dtype``)
        self.direct_in = tuple(direct_in)
        self.src = {w: np.asarray(x).view(self.in_dtype)
                    for w, x in (("A", a), ("B", b)) if w in self.direct_in}
        # A straight, whole rows into device panels (``panel``) where they fit the
        # ``panel_bytes`` spare and the units are full width (each row block crosses once)
        need = panel_bytes_of(tiling, self.in_dtype.itemsize)
        self.a_panel = ("A" in self.src and (len(tiling.col_edges) == 2 or tiling.b_resident)
                        and len(tiling.k_edges) > 2 and 0 < need <= panel_bytes)
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
        n_in = int(min(_RING_IN, max(2, (limit * 3 // 4) // chunk)))
        n_out = int(min(_RING_OUT, max(2, (limit - n_in * chunk) // chunk)))
        if (n_in + n_out) * chunk > limit:
            raise ValueError(f"the pinned pool ({limit} bytes, distmm.pinned-pool) cannot hold "
                             f"4 staging buffers of {chunk} bytes; raise it")
        return chunk, n_in, n_out

    def _chunks(self, steps: list[Step], chunk_bytes: int, whole=frozenset()) -> list[_Chunk]:
        t, s = self.t, self.in_dtype.itemsize
        out = []
        for idx, st in enumerate(steps):
            k0, k1 = t.k_edges[st.kb], t.k_edges[st.kb + 1]
            loads = []
            if st.load_a:
                loads.append(("A", st.a_slot, t.row_edges[st.i], t.row_edges[st.i + 1], k0, k1,
                              f"A[{st.i},{st.kb}]", st.i))
            if st.load_b:
                loads.append(("B", st.b_slot, k0, k1, t.col_edges[st.j], t.col_edges[st.j + 1],
                              f"B[{st.kb},{st.j}]", st.kb))
            for which, slot, r0, r1, c0, c1, label, block in loads:
                rows = r1 - r0 if which in whole else max(1, chunk_bytes // ((c1 - c0) * s))
                starts = list(range(r0, r1, rows))
                for n_, q0 in enumerate(starts):
                    q1 = min(q0 + rows, r1)
                    out.append(_Chunk(idx, which, slot, q0, q1, c0, c1, q0 - r0, r1 - r0,
                                      n_ == 0, n_ == len(starts) - 1, label, block))
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
        view = buf.view((chunk.r1 - chunk.r0, chunk.c1 - chunk.c0), self.in_dtype)
        part = src[chunk.r0:chunk.r1, chunk.c0:chunk.c1]
        if self.in_dtype == np.uint16:  # bfloat16 operands: their bits, as they are
            part = np.asarray(part).view(np.uint16)
        np.copyto(view, part, casting="unsafe")
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

    def _waited(self, fut: cf.Future, label: str):
        """``fut.result()``; traced, the issuing thread's wait as a ``host-wait`` span."""
        if self.timeline is None or fut.done():
            return fut.result()
        t0 = self._now()
        try:
            return fut.result()
        finally:
            with self._host_lock:
                self._host_ops.append(("host-wait", label, t0, self._now()))

    # -- GPU ops with optional timing ------------------------------------------------
    def _timed(self, lane, name, stream, fn):
        if self.timeline is None:
            fn()
            return
        e0, e1 = self.dev.event(True), self.dev.event(True)
        self.dev.record(e0, stream)
        h0 = self._now()
        fn()
        h1 = self._now()
        self.dev.record(e1, stream)
        self._gpu_ops.append((lane, name, e0, e1))
        if h1 - h0 > _SLOW_CALL:  # a call that held its thread (a driver lock, a full queue)
            with self._host_lock:
                self._host_ops.append(("host-wait", f"call: {name}", h0, h1))

    # -- the run --------------------------------------------------------------------
    def execute(self) -> None:
        dev, t = self.dev, self.t
        dtype, in_dtype = self.dtype, self.in_dtype
        steps = plan_block_loads(t)
        chunk_bytes, n_in, n_out = self._chunk_bytes()

        # Device buffers first: an out-of-memory error here costs nothing.
        p0 = self._now()
        a_mem = [dev.alloc(t.a_slot_bytes) for _ in range(t.a_slots)]
        if t.b_resident:  # all of B, each column block of units (one, or more) contiguous
            ce, kk = t.col_edges, t.k_edges[-1]
            b_cols = [dev.array(dev.alloc(kk * (q1 - q0) * t.itemsize), (kk, q1 - q0), in_dtype)
                      for q0, q1 in zip(ce, ce[1:])]
            b_mem = None
        else:
            b_mem = [dev.alloc(t.b_slot_bytes) for _ in range(t.b_slots)]
        c_mem = [dev.alloc(t.c_buffer_bytes) for _ in range(t.c_buffers)]

        def b_block(slot, kb, rows, width, j):
            if b_mem is None:
                return b_cols[j][t.k_edges[kb]:t.k_edges[kb + 1]]
            return dev.array(b_mem[slot], (rows, width), in_dtype)
        h2d, comp, d2h = dev.stream(), dev.stream(), dev.stream()
        p1 = self._now()
        # the first staging buffers now, the rest pinned while those fill (a fresh
        # process pins them all once, which the first copies need not wait for)
        ring_in = self.pool.acquire_many(chunk_bytes, n_in, first=_RING_FIRST)
        try:
            ring_out = self.pool.acquire_many(chunk_bytes, n_out, first=0)
        except BaseException:
            for buf in ring_in:
                self.pool.release(buf)
            raise
        p2 = self._now()
        if self.on_ready is not None:
            self.on_ready()
        self.phases = {"device_alloc_s": p1 - p0, "pinned_ring_s": p2 - p1,
                       "ring_bytes": (n_in + n_out) * chunk_bytes}
        stage_pool = _thread_pool("stage", self.host_threads)
        unstage_pool = _thread_pool("unstage", max(2, self.host_threads // 2))
        t0_ev = dev.event(self.timeline is not None)
        dev.record(t0_ev, comp)
        if self.timeline is not None:
            dev.sync_event(t0_ev)
        host_t0 = self._now()
        wall0 = host_t0
        futures: dict[int, cf.Future] = {}
        ring_ev: list = [None] * n_in
        direct = PageLocked(dev, self.out, t.row_edges, "direct-out") if self.direct_out else None
        # A's row blocks and B's k blocks page-locked in place: their chunks then go straight
        # to the device (once locked; the first ones, and any whose memory cannot be locked,
        # through the ring)
        locked_in = {w: PageLocked(dev, src, t.row_edges if w == "A" else t.k_edges,
                                   f"direct-{w.lower()}") for w, src in self.src.items()}
        # operands page-locked by their owner cross a block a copy: in ring-sized chunks, the
        # copy queue filled and held the issuing thread, GEMMs unissued (bench/NOTES.md)
        chunks = self._chunks(steps, chunk_bytes, {w for w, lk in locked_in.items() if lk.owned})
        last_use = {(ch.which, ch.block): n for n, ch in enumerate(chunks)}
        panels = None
        writer = _OutputWriter(self, d2h, c_mem, ring_out, unstage_pool, direct)
        try:
            if self.a_panel:
                panels = APanels(self, self.src["A"], locked_in["A"], steps)
            def stage(c):
                ch = chunks[c]
                locked = locked_in.get(ch.which)
                if locked is not None and locked.ready(ch.block, wait=False):
                    futures[c] = None  # straight from the operand
                    return
                r = c % n_in
                futures[c] = submit(stage_pool, self._stage, ch, ring_in[r], ring_ev[r])

            for c in range(min(n_in, len(chunks))):
                stage(c)
            writer.start()
            a_free: list = [None] * t.a_slots
            b_free: list = [None] * t.b_slots
            a_loaded: list = [None] * t.a_slots
            b_loaded: list = [None] * t.b_slots
            c_free: list = [None] * t.c_buffers   # futures -> event of the copy-out
            c = 0
            for idx, st in enumerate(steps):
                cb = st.unit % t.c_buffers
                while c < len(chunks) and chunks[c].step == idx:
                    ch = chunks[c]
                    staged = futures.pop(c)
                    view = self._waited(staged, ch.label) if staged is not None else None
                    free_ev, loaded = (a_free, a_loaded) if ch.which == "A" else (b_free, b_loaded)
                    # A's chunks from a panel: the rows cross into the panel (at the row
                    # block's first chunk), which the GEMMs read in place; only copies into
                    # an A slot wait for the GEMMs that read the slot before
                    from_panel = (view is None and panels is not None and ch.which == "A"
                                  and panels.take(ch.block, h2d))
                    if not from_panel and ch.first and free_ev[ch.slot] is not None:
                        dev.wait(h2d, free_ev[ch.slot])
                    width = ch.c1 - ch.c0
                    if ch.which == "A":
                        block = dev.array(a_mem[ch.slot], (ch.block_rows, width), in_dtype)
                    else:
                        block = b_block(ch.slot, st.kb, ch.block_rows, width, st.j)
                    dst = block[ch.d0:ch.d0 + (ch.r1 - ch.r0)]
                    if view is not None:
                        self._timed("h2d", ch.label, h2d, lambda: dev.h2d(dst, view, h2d))
                        self.bytes_h2d += dst.nbytes
                    elif not from_panel:  # a rectangle per page-locked range, straight
                        src = self.src[ch.which]
                        for ra, rb, qa, qb in locked_in[ch.which].rects(ch.block, ch.r0, ch.r1,
                                                                         ch.c0, ch.c1):
                            part = dst[ra - ch.r0:rb - ch.r0, qa - ch.c0:qb - ch.c0]
                            self._timed("h2d", ch.label, h2d,
                                        lambda: dev.h2d_2d(part, src[ra:rb, qa:qb], h2d))
                        self.bytes_h2d += dst.nbytes
                    ev = dev.event()
                    dev.record(ev, h2d)
                    ring_ev[c % n_in] = ev
                    if ch.which in locked_in and last_use[ch.which, ch.block] == c:
                        locked_in[ch.which].copied(ch.block, ev, unstage_pool)
                    if ch.last:
                        loaded[ch.slot] = ev
                    if c + n_in < len(chunks):
                        stage(c + n_in)
                    c += 1
                if st.first and c_free[cb] is not None:
                    dev.wait(comp, self._waited(c_free[cb], f"C buffer for C[{st.i},{st.j}]"))
                dev.wait(comp, a_loaded[st.a_slot])
                dev.wait(comp, b_loaded[st.b_slot])
                r0, r1 = t.row_edges[st.i], t.row_edges[st.i + 1]
                q0, q1 = t.col_edges[st.j], t.col_edges[st.j + 1]
                k0, k1 = t.k_edges[st.kb], t.k_edges[st.kb + 1]
                a_dev = None if panels is None else panels.read(st.i, k0, k1, r1 - r0, comp)
                if a_dev is None:
                    a_dev = dev.array(a_mem[st.a_slot], (r1 - r0, k1 - k0), in_dtype)
                b_dev = b_block(st.b_slot, st.kb, k1 - k0, q1 - q0, st.j)
                c_dev = dev.array(c_mem[cb], (r1 - r0, q1 - q0), dtype)
                beta = 0.0 if st.first else 1.0
                self._timed("compute", f"C[{st.i},{st.j}] k{st.kb}", comp,
                            lambda: self.gemm(a_dev, b_dev, c_dev, alpha=1.0, beta=beta,
                                              stream=comp))
                ev = dev.event()
                dev.record(ev, comp)
                a_free[st.a_slot] = ev
                b_free[st.b_slot] = ev
                if panels is not None:
                    panels.used(st.i, ev)
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
            pending = [f for f in futures.values() if f is not None]
            for f in pending:
                f.cancel()
            cf.wait(pending)
            cf.wait([f for f in writer.ring_futs if f is not None])
            for buf in ring_in + ring_out:
                self.pool.release(buf)
            writer.c_mem = None
            # no copy touching them is queued any more (the device is synchronized)
            for locked in [direct, *locked_in.values()]:
                if locked is not None:
                    locked.close()
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

    def __init__(self, run: PipelineRun, d2h, c_mem, ring_out, unstage_pool, direct=None):
        super().__init__(name="distmm-d2h", daemon=True)
        self.direct = direct
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
                label = f"C[{i},{j}]"
                dev.wait(self.d2h, done_ev)
                if self.direct is not None and self.direct.ready(i):
                    if width == r.out.shape[1]:
                        # whole rows of out, page-locked: a copy per page-locked range they touch
                        dst = r.out[r0:r1].reshape(-1).view(np.uint8)
                        src = c_dev.reshape(-1).view(np.uint8)
                        for p0, p1 in self.direct.pieces(i, r0, r1):
                            r._timed("d2h", label, self.d2h,
                                     lambda: dev.d2h(dst[p0:p1], src[p0:p1], self.d2h))
                    else:  # a column range of those rows: a 2-D copy per page-locked range
                        for ra, rb, qa, qb in self.direct.rects(i, r0, r1, q0, q1):
                            part = c_dev[ra - r0:rb - r0, qa - q0:qb - q0]
                            r._timed("d2h", label, self.d2h,
                                     lambda: dev.d2h_2d(r.out[ra:rb, qa:qb], part, self.d2h))
                    r.bytes_d2h += c_dev.nbytes
                else:
                    self._through_ring(c_dev, r0, r1, q0, q1, label)
                free_ev = dev.event()
                dev.record(free_ev, self.d2h)
                if self.direct is not None and j == len(t.col_edges) - 2:
                    # the row block's last unit (columns outer): its rows may be unlocked
                    self.direct.copied(i, free_ev, self.unstage_pool)
                fut.set_result(free_ev)
            except BaseException as exc:  # handed to the main thread
                self.error = exc
                fut.set_exception(exc)

    def _through_ring(self, c_dev, r0, r1, q0, q1, label) -> None:
        """C unit rows ``r0:r1`` (columns ``q0:q1``) -> pinned ring (d2h stream) -> ``out``
        (unstage threads), a ring buffer at a time."""
        r, dev, dtype = self.run_, self.run_.dev, self.run_.dtype
        width = q1 - q0
        rows = max(1, self.ring[0].nbytes // (width * dtype.itemsize))
        for p0 in range(0, r1 - r0, rows):
            p1 = min(p0 + rows, r1 - r0)
            slot = self._next % len(self.ring)
            self._next += 1
            if self.ring_futs[slot] is not None:
                self.ring_futs[slot].result()   # the unstage that used it is done
            view = self.ring[slot].view((p1 - p0, width), dtype)
            src = c_dev[p0:p1]
            r._timed("d2h", label, self.d2h, lambda: dev.d2h(view, src, self.d2h))
            r.bytes_d2h += view.nbytes
            ev = dev.event()
            dev.record(ev, self.d2h)
            self.ring_futs[slot] = submit(self.unstage_pool, r._unstage, ev, view, r0 + p0,
                                          r0 + p1, q0, q1, label)

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
