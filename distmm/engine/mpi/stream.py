"""The batch product of the MPI engine: C's stripes computed and written while the next are read.

This module covers: ``run_stripes``, one rank's part of a ``BatchPlan`` (``distmm.plan_batch``)
from two readable operands to a writer:

1. B's column panel: each rank reads its own block of B (in chunks, the next read while the last
   is copied to the device), then the ranks of a grid column broadcast their pieces, so every
   rank holds ``B[:, col_j]``, kept for all stripes. Where a GPU rank gets the whole panel by
   its own copies (it reads what it needs, or its grid column is itself), B's chunks are copied
   while the first stripe multiplies: each k step of that stripe (``plan.first_panels``) waits
   only for its own rows of B;
2. for each stripe of the rank's row block, the ranks of the grid row read their pieces of A's
   stripe (a reader thread, two stripes ahead), broadcast them along the row, and every rank
   multiplies the stripe by the column panel, panel by panel in k order (so the bits never
   depend on timing, and a resumed run equals an uninterrupted one); the stripe's C goes to a
   writer thread, which writes it into the staged output while the next stripe computes (the
   one after waits until it is written: a rank holds the two C stripes ``plan_batch`` counts),
   and then calls ``on_written(stripe)``.

On a GPU the copies in, the broadcasts (NCCL), the GEMMs and the copies out each run on a
stream of their own through pinned host buffers, ordered by events, two stripes in flight; on
CPU ranks the same steps run with host buffers, MPI broadcasts and the CPU executor, the GEMM
on a thread. No wait blocks in MPI, NCCL or CUDA: each polls the rank's ``StopWatch``
(``distmm.engine.mpi.stop``), so a signal or another rank's failure stops the product within
milliseconds wherever it is. Every span (read, h2d, comm, gemm, d2h, write, sync, startup,
wait) goes to the caller's ``Phases``; GPU spans come from CUDA events.

``DISTMM_BATCH_STRIPE_PAUSE=SECONDS`` makes the writer wait that long after each stripe: a
fixed point to interrupt a run at, for tests and for trying ``--resume`` out.

It does *not* cover: planning (``distmm.plan_batch``), opening files or the staged output
(``distmm.engine.mpi.io``), what a stopped run keeps (``distmm.engine.mpi.resume``).
"""
from __future__ import annotations

import bisect
import mmap
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from distmm.engine.mpi.stop import StopWatch, poll
from distmm.fpflags import collect, object_rows
from distmm.nonfinite import as_whole_call, numpys_nonfinite, part_shape
from distmm.plan import sums_whole_k
from distmm.plan_batch import BatchPlan

__all__ = ["PanelSource", "BlockSink", "run_stripes", "k_panels", "device_memory"]

PAUSE = float(os.environ.get("DISTMM_BATCH_STRIPE_PAUSE", "0") or 0)


class PanelSource:
    """Reads rectangles of a 2-D operand that may be larger than memory: a memmap, an ndarray,
    a zarr array or an h5py dataset (indices are the operand's own, minus ``origin``: a rank's
    local block of a ``DistArray`` is read with ``origin`` its block's first row and column).

    A C-ordered ``.npy`` memmap of the dtype asked for is read with ``os.preadv`` (one call for
    whole rows, one per row otherwise) instead of through its mapping: no page faults, and no
    page-table lock shared by the rank's reader threads."""

    #: row pieces shorter than this are copied through the mapping (a call per row would cost more)
    MIN_ROW_READ = 4096

    def __init__(self, array, origin: tuple[int, int] = (0, 0), name: str | None = None):
        self.array = array
        self.origin = origin
        self.name = name  # the operand's file: a read that fails names it
        self._fd = None
        self._lock = threading.Lock()

    def _file(self):
        """``(fd, data offset, row bytes)`` of a C-ordered 2-D ``.npy`` memmap, else None."""
        a = self.array
        # the mapping's own array (a slice of it carries the file's offset, not its own)
        if not (isinstance(a, np.memmap) and isinstance(a.base, mmap.mmap) and a.ndim == 2
                and a.flags.c_contiguous and getattr(a, "filename", None)
                and isinstance(getattr(a, "offset", None), int)):
            return None
        with self._lock:
            if self._fd is None:
                self._fd = os.open(a.filename, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return self._fd, a.offset, a.shape[1] * a.itemsize

    def read_into(self, out: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> None:
        if self.name is None:
            return self._read_into(out, r0, r1, c0, c1)
        try:
            return self._read_into(out, r0, r1, c0, c1)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - named: the library's message names no file
            from distmm.errors import UnreadableInput

            raise UnreadableInput(f"{self.name} cannot be read: {type(exc).__name__}: "
                                  f"{exc}") from exc

    def _read_into(self, out: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> None:
        y, x = self.origin
        r0, r1, c0, c1 = r0 - y, r1 - y, c0 - x, c1 - x
        item = np.dtype(self.array.dtype).itemsize  # zarr arrays and h5py datasets too
        whole = c0 == 0 and c1 == self.array.shape[-1]
        f = None
        if (out.dtype == self.array.dtype and out.flags.c_contiguous
                and (whole or (c1 - c0) * item >= self.MIN_ROW_READ)):
            f = self._file()
        if f is not None:
            fd, offset, row = f
            if whole:  # whole rows: one range of the file
                _pread_into(fd, memoryview(out).cast("B"), offset + r0 * row)
            else:
                for r in range(r1 - r0):
                    _pread_into(fd, memoryview(out[r]).cast("B"),
                                offset + (r0 + r) * row + c0 * item)
            return
        part = self.array[r0:r1, c0:c1]
        if isinstance(part, np.ndarray):
            np.copyto(out, part, casting="unsafe")  # a memmap's pages are read here
        else:
            out[...] = np.asarray(part)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (``os.preadv`` may read less)."""
    while view.nbytes:
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            raise OSError(f"the file ended {view.nbytes} bytes early while reading an operand")
        view, offset = view[got:], offset + got


def device_memory(on_gpu: bool, comm) -> int | None:
    """The smallest memory a rank may use for the product (GPU ranks), or None (CPU)."""
    from mpi4py import MPI

    if not on_gpu:
        return None
    import cupy

    from distmm.config import get_config

    free, _ = cupy.cuda.runtime.memGetInfo()
    free += cupy.get_default_memory_pool().free_bytes()
    limit = get_config().device_memory_limit
    mine = int(min(free * 0.85, limit) if limit else free * 0.85)
    return comm.allreduce(mine, op=MPI.MIN)


class BlockSink:
    """Stripes of C into this rank's block in memory (``origin``: its first row and column),
    for products of ``DistArray`` s; ``finish`` and ``close`` have nothing to do."""

    def __init__(self, block: np.ndarray, origin: tuple[int, int]):
        self.block, self.origin = block, origin

    def write(self, r0: int, r1: int, c0: int, c1: int, data) -> None:
        y, x = self.origin
        self.block[r0 - y:r1 - y, c0 - x:c1 - x] = data

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def k_panels(plan: BatchPlan, *, on_gpu: bool, direct: bool) -> tuple[int, ...]:
    """The k edges a stripe's product is summed over, in order: one panel over all of k where
    a CPU rank holds the whole of A's stripe (it reads every piece itself: one GEMM, and for
    float16 numpy's own single float32 sum over k), else every owner's edge of A and B."""
    if direct and not on_gpu:
        return (0, plan.grid.k)
    return plan.panels


def _owner(cuts, k0: int) -> int:
    return bisect.bisect_right(cuts, k0) - 1


class _Writer(threading.Thread):
    """Writes finished stripes in order; ``put`` hands one over, waiting while ``most``
    stripes handed over are not written yet (and let go: a stripe's memory is the writer's
    until then). CPU ranks hand over one: the rank holds the stripe being written and the one
    being computed, the two C stripes ``distmm.plan_batch`` counts; GPU ranks two, their two
    pinned slots of C."""

    def __init__(self, sink, watch: StopWatch, phases, on_written, to_result, most: int = 2):
        super().__init__(name="distmm-stripe-writer", daemon=True)
        self.sink, self.watch, self.phases = sink, watch, phases
        self.on_written, self.to_result = on_written, to_result
        self.queue: queue.Queue = queue.Queue()
        self.slots = threading.Semaphore(most)  # one taken by each stripe not yet written
        self.stopped = False
        self.error: BaseException | None = None

    def put(self, item) -> None:
        while not self.slots.acquire(timeout=0.002):
            self.watch.check()
        self.queue.put(item)

    def run(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                stripe, region, block, ready, release = item
                if ready is not None:
                    poll(lambda: ready.done or self.stopped, None)
                if self.stopped:
                    return
                start = time.perf_counter()
                data = self.to_result(block)
                self.sink.write(*region, data)
                self.phases.add("write", start, time.perf_counter(), data.nbytes)
                if release is not None:
                    release.set()
                del item, block, data  # freed before the next stripe is handed over
                self.slots.release()
                self.on_written(stripe)
                if PAUSE:
                    time.sleep(PAUSE)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread's watch
            self.error = exc
            self.watch.fail(exc)

    def drain(self) -> None:
        """Wait until every stripe handed over is written (the watch checked meanwhile)."""
        self.queue.put(None)
        poll(lambda: not self.is_alive(), self.watch)
        if self.error is not None:
            raise self.error

    def abandon(self) -> None:
        self.stopped = True
        self.queue.put_nowait(None)


def run_stripes(plan: BatchPlan, rank: int, a: PanelSource, b: PanelSource, sink, executor,
                comms, watch: StopWatch, phases, *, on_gpu: bool, todo, skip=frozenset(),
                on_written=lambda stripe: None, share_b: bool = False) -> set[str]:
    """Compute this rank's stripes ``todo`` (indices into its grid row's stripes) and write
    them through ``sink.write(r0, r1, c0, c1, block)``; the ranks of a grid row must pass the
    same ``todo``. Stripes in ``skip`` are already written by this rank: it still sends its
    pieces of A for them (the row needs them) but neither multiplies nor writes them.
    ``sink.finish()`` flushes the output at the end. ``share_b`` (GPU ranks of one host that
    read their panels, ``comms`` None): the ranks holding the same column panel of B each read
    a share of its rows and copy the others' from their GPUs (CUDA IPC); every rank must pass
    the same value. Returns the floating-point flags numpy's matmul would have reported
    (host ranks; ``distmm.fpflags``)."""
    runner = (_GPURun if on_gpu else _CPURun)(plan, rank, a, b, sink, executor, comms, watch,
                                              phases, direct=comms is None,
                                              share_b=share_b and comms is None and on_gpu)
    runner.run(list(todo), set(skip), on_written)
    return runner.flags


#: the tag of the messages ranks sharing B's panel exchange (on the stop watch's communicator,
#: whose own messages carry another)
_SHARE_TAG = 7302


def _exchange(watch: StopWatch, group, rank: int, value) -> dict:
    """``{rank: value}`` of every rank of ``group`` (this one's included), waits polling
    ``watch`` (a stopped rank stops the others here too)."""
    comm = watch.comm
    sends = [comm.isend(value, dest=p, tag=_SHARE_TAG) for p in group if p != rank]
    out = {rank: value}
    for p in group:
        if p == rank:
            continue
        request, box = comm.irecv(source=p, tag=_SHARE_TAG), []

        def arrived(request=request, box=box):
            done, got = request.test()
            if done:
                box.append(got)
            return done

        poll(arrived, watch)
        out[p] = box[0]
    for request in sends:
        poll(lambda request=request: request.test()[0], watch)
    return out


class _Run:
    """What the GPU and CPU runs share: the rank's place, its readers and its writer."""

    def __init__(self, plan, rank, a, b, sink, executor, comms, watch, phases, *, direct,
                 share_b=False):
        g = plan.grid
        self.share_b = bool(share_b)  # GPU ranks: B's panel shared over CUDA IPC (load_b)
        self.plan, self.grid, self.rank = plan, g, rank
        _, self.i, self.j = g.coords(rank)
        self.a, self.b, self.sink, self.executor = a, b, sink, executor
        self.comms, self.watch, self.phases = comms, watch, phases
        self.acc = np.dtype(g.acc_dtype)
        self.res = np.dtype(g.dtype)
        self.c0, self.c1 = g.col_edges[self.j], g.col_edges[self.j + 1]
        self.nj = self.c1 - self.c0
        self.a_cuts, self.b_cuts = g.a_k_edges[0], g.b_k_edges[0]
        self.stripes = plan.stripe_edges[self.i]
        self.hmax = max((b_ - a_ for a_, b_ in zip(self.stripes, self.stripes[1:])), default=0)
        self.widths = [self.a_cuts[j + 1] - self.a_cuts[j] for j in range(g.cols)]
        # the pieces of A's stripes and B's column panel this rank reads itself: its own (the
        # others come by broadcast), or all of them when it reads what it needs directly
        self.direct = direct
        self.a_mine = list(range(g.cols)) if direct else [self.j]
        b_mine = list(range(g.rows)) if direct else [self.i]
        self.b_range = (self.b_cuts[b_mine[0]], self.b_cuts[b_mine[-1] + 1])
        self.readers = ThreadPoolExecutor(4 if direct else 2, thread_name_prefix="distmm-reader")
        self.panels = k_panels(plan, on_gpu=isinstance(self, _GPURun), direct=direct)
        #: numpy's floating-point flags of the host products and roundings (their threads'
        #: errstate is not the caller's), for the caller to report once
        self.flags: set[str] = set()
        #: the first error this rank keeps until its last broadcast (object pieces that did not
        #: reach it, an element's error in its object product): it multiplies nothing more and
        #: raises after the broadcasts every peer waits for (``run``)
        self.held: BaseException | None = None

    def rows_of(self, stripe: int) -> tuple[int, int]:
        return self.stripes[stripe], self.stripes[stripe + 1]

    def read(self, source, out, r0, r1, c0, c1, before=None):
        """Read a rectangle on a reader thread (after ``before()`` returns); a Future."""

        def task():
            if before is not None:
                before()
            start = time.perf_counter()
            source.read_into(out, r0, r1, c0, c1)
            self.phases.add("read", start, time.perf_counter(), out.nbytes)
            return out

        return self.readers.submit(task)

    def result(self, future):
        poll(future.done, self.watch)
        return future.result()

    def to_result(self, block):
        """A stripe of C in numpy's result dtype (booleans: ``count > 0``)."""
        if self.res.kind == "b":
            return block != 0
        if block.dtype == self.res:
            return block
        with collect() as seen:  # float16's rounding
            block = block.astype(self.res)
        self.flags |= seen
        return block

    def panel_pairs(self, edges=None):
        """Per k panel (``edges``, default the stripes' panels): (owner column of A, k0, k1)."""
        p = self.panels if edges is None else edges
        return [(_owner(self.a_cuts, k0), k0, k1) for k0, k1 in zip(p, p[1:]) if k1 > k0]

    #: stripes of C handed to the writer and not yet written (``_Writer``)
    handed = 2

    def run(self, todo, skip, on_written):
        writer = _Writer(self.sink, self.watch, self.phases, on_written, self.to_result,
                         most=self.handed)
        writer.start()
        try:
            self.load_b()
            self.stripe_loop(todo, skip, writer)
            if self.held is not None:  # every broadcast done: no rank waits for this one
                self.watch.held = self.held
                raise self.held
            self.release_device()
            writer.drain()
            start = time.perf_counter()
            self.sink.finish()
            self.phases.add("sync", start, time.perf_counter())
        except BaseException:
            writer.abandon()
            raise
        finally:
            self.readers.shutdown(wait=False, cancel_futures=True)
            self.close()

    def release_device(self):
        """Give the device's memory back (GPU ranks), while the writer drains."""

    def close(self):
        pass


class _CPURun(_Run):
    handed = 1  # one C stripe written while the next is computed: the two plan_batch counts

    @property
    def on_host(self) -> bool:
        """Whether the products are numpy's matmul (the CPU executor's: its numba kernels
        take no complex dtype), whose shapes ``numpys_nonfinite`` is told (a panel one wide
        in the form of the others': ``distmm.nonfinite.as_whole_call``, ``part_shape``)."""
        from distmm.executor.cpu import CPUExecutor

        return isinstance(self.executor, CPUExecutor)

    def load_b(self):
        g = self.grid
        self.b_store = np.empty((g.k, self.nj), dtype=self.acc)
        k0, k1 = self.b_range
        if k1 > k0 and self.nj:
            self.result(self.read(self.b, self.b_store[k0:k1], k0, k1, self.c0, self.c1))
        if self.direct:
            return
        for root in range(g.rows):
            lo, hi = self.b_cuts[root], self.b_cuts[root + 1]
            self.bcast(self.comms.col, self.b_store[lo:hi], root)

    def bcast(self, broadcaster, buf, root):
        start = time.perf_counter()
        request = broadcaster.ibcast(buf, root)
        inner = getattr(request, "request", None)
        if inner is not None:
            poll(lambda: inner.Test(), self.watch)
        request.wait()
        # object pieces that did not travel: held (``self.held``)
        self.held = self.held or getattr(request, "unsent", None)
        self.phases.add("comm", start, time.perf_counter(), buf.nbytes)

    def pieces(self, h):
        """A's stripe by owner column: views of one ``h x k`` array (a whole stripe is one
        operand when this rank reads every piece), or one array per piece."""
        if self.direct:
            whole = np.empty((h, self.grid.k), dtype=self.acc)
            return [whole[:, self.a_cuts[j]:self.a_cuts[j + 1]] for j in range(self.grid.cols)]
        return [np.empty((h, w), dtype=self.acc) for w in self.widths]

    def stripe_loop(self, todo, skip, writer):
        if not todo:
            return
        gemm = ThreadPoolExecutor(1, thread_name_prefix="distmm-gemm")
        try:
            ahead = self.prefetch(todo[0])
            for t, stripe in enumerate(todo):
                self.watch.check()
                pieces, futures = ahead
                for future in futures:
                    self.result(future)
                ahead = self.prefetch(todo[t + 1]) if t + 1 < len(todo) else None
                r0, r1 = self.rows_of(stripe)
                for root in range(self.grid.cols) if not self.direct else ():
                    self.bcast(self.comms.row, pieces[root], root)
                if stripe in skip or self.held is not None:
                    continue
                start = time.perf_counter()
                future = gemm.submit(self.product, pieces, r1 - r0, r0)
                poll(future.done, self.watch)
                try:
                    c = future.result()
                except Exception as exc:  # noqa: BLE001 - an element's error: held
                    # the data's own error (numpy's, e.g. None * 1), the same on every run:
                    # telling the peers would stop the ranks of other grid rows between
                    # two of their broadcasts, at different ones
                    if self.acc.kind != "O":
                        raise
                    self.held = exc
                    continue
                self.phases.add("gemm", start, time.perf_counter())
                writer.put((stripe, (r0, r1, self.c0, self.c1), c, None, None))
        finally:
            gemm.shutdown(wait=False, cancel_futures=True)

    def prefetch(self, stripe):
        r0, r1 = self.rows_of(stripe)
        pieces = self.pieces(r1 - r0)
        futures = [self.read(self.a, pieces[jj], r0, r1, self.a_cuts[jj], self.a_cuts[jj + 1])
                   for jj in self.a_mine if pieces[jj].size]
        return pieces, futures

    def product(self, pieces, h, r0=0):
        with collect() as seen:  # a complex stripe's Inf and NaN as numpy's whole product's
            c, parts = self._product(pieces, h, r0)
            c = numpys_nonfinite(self.grid, c, parts if self.on_host else ())
        self.flags |= seen
        return c

    def _product(self, pieces, h, r0):
        """The stripe's block in the accumulation dtype and the ``(rows, columns, k)`` of
        the products summed into it."""
        whole = None
        if len(self.panels) == 2 and self.panels[1] > 0:  # the whole stripe, one operand
            whole = pieces[0].base if pieces[0].base is not None else pieces[0]
        elif sums_whole_k(self.res) and self.grid.k:
            # numpy's single sum over k (float16, long double, object): the broadcast pieces
            # joined (a copy of the stripe) into one product, not partial products added
            whole = np.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]
        if whole is not None:
            if self.acc.kind == "O":  # its elements' reports in numpy's order, from (r0, c0)
                c = object_rows(lambda x, y: self.executor.panel_product(x, y, 256), whole,
                                self.b_store, (r0, self.c0))
            else:
                c = self.executor.panel_product(whole, self.b_store, 256)
            return np.ascontiguousarray(c, dtype=self.acc), ((h, self.nj, whole.shape[1]),)
        c, parts = None, []
        for owner, k0, k1 in self.panel_pairs():
            off = self.a_cuts[owner]
            part = self.executor.panel_product(pieces[owner][:, k0 - off:k1 - off],
                                               self.b_store[k0:k1], 256)
            if k1 - k0 == 1 and self.on_host:  # numpy's own loop: the other panels' form
                part = as_whole_call(self.grid, part)
            parts.append(part_shape(self.grid, h, self.nj, k1 - k0))
            if c is None:
                c = part
            else:  # in k order: the bits do not depend on timing
                c += part
            # in place, and let go before the next panel's: the stripe's sum and one panel's
            del part  # product held at once (plan_batch._host_extra)
        if c is None:
            c = np.zeros((h, self.nj), dtype=self.acc)
        return np.ascontiguousarray(c, dtype=self.acc), tuple(parts)


class _GPURun(_Run):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import cupy

        self.cp = cupy
        start = time.perf_counter()
        self.h2d = cupy.cuda.Stream(non_blocking=True)
        self.compute = cupy.cuda.Stream(non_blocking=True)
        self.d2h = cupy.cuda.Stream(non_blocking=True)
        self.events: list[tuple[str, object, object, int]] = []
        self.owners: list = []  # keep the pinned buffers registered while the run lasts
        h, acc = self.hmax, self.acc
        self.a_dev = [[cupy.empty((h, w), dtype=acc) for w in self.widths] for _ in range(2)]
        self.c_dev = [cupy.empty((h, self.nj), dtype=acc) for _ in range(2)]
        self.a_host = [{jj: self.pinned((h, self.widths[jj])) for jj in self.a_mine}
                       for _ in range(2)]
        # C's pinned slots are first needed after the first GEMM: page-locked on a thread of
        # their own meanwhile (the stripes' reads and B's copies start without waiting for them)
        device = cupy.cuda.Device().id
        self.pinning = ThreadPoolExecutor(1, thread_name_prefix="distmm-pin")
        self.c_host_ready = self.pinning.submit(self.pinned_on, device, [(h, self.nj)] * 2)
        self.c_host = None
        self.c_free = [threading.Event() for _ in range(2)]
        for e in self.c_free:
            e.set()
        self.a_host_free = [None, None]  # the event after which a pinned A slot may be refilled
        self.gemm_done = [None, None]
        self.d2h_done = [None, None]
        cupy.cuda.Device().synchronize()
        self.ref = cupy.cuda.Event()
        self.ref.record(self.compute)
        self.ref.synchronize()
        self.ref_time = time.perf_counter()
        self.phases.add("startup", start, self.ref_time)

    def pinned_on(self, device: int, shapes):
        """``pinned`` arrays of ``shapes``, from another thread (which takes ``device``, so
        that it starts no context on another GPU)."""
        self.cp.cuda.Device(device).use()
        return [self.pinned(shape) for shape in shapes]

    def pinned(self, shape):
        """A page-locked host array (``distmm.executor.pinned.registered_allocator``)."""
        from distmm.executor.pinned import registered_allocator

        count = int(np.prod(shape))
        raw, owner = registered_allocator(max(1, count * self.acc.itemsize))
        self.owners.append(owner)
        return raw[:count * self.acc.itemsize].view(self.acc).reshape(shape)

    def span(self, phase, start_event, end_event, nbytes=0):
        self.events.append((phase, start_event, end_event, nbytes))

    def wait_event(self, event):
        if event is not None:
            poll(lambda: event.done, self.watch)

    def load_b(self):
        cp, g = self.cp, self.grid
        self.b_store = cp.empty((g.k, self.nj), dtype=self.acc)
        k0, k1 = self.b_range
        group = [g.rank_at(0, ii, self.j) for ii in range(g.rows)]  # holders of this panel
        sharing = self.share_b and len(group) > 1 and k1 > k0 and self.nj
        # the whole panel by this rank's own copies: they run while the first stripe multiplies
        # (stripe_loop calls fill_b)
        self.b_pending = not sharing and (self.direct or g.rows == 1)
        if self.b_pending:
            return
        if sharing:
            from distmm.grid import even_edges

            edges = [k0 + e for e in even_edges(k1 - k0, len(group))]
            shares = {p: (edges[n], edges[n + 1]) for n, p in enumerate(group)}
            self.upload_rows(*shares[self.rank])
            self.copy_shares(group, shares)
        else:
            self.upload_rows(k0, k1)
        if self.direct:
            self.compute.wait_event(self.h2d.record())
            return
        with self.h2d:  # NCCL waits for the uploads above, queued on this stream
            requests = [self.comms.col.ibcast(self.b_store[self.b_cuts[r]:self.b_cuts[r + 1]], r)
                        for r in range(g.rows)]
        self.note_comm(requests)
        with self.compute:
            for request in requests:
                request.wait()

    def copy_shares(self, group, shares):
        """The other ranks' shares of B's panel, copied from their devices into this rank's
        (CUDA IPC: NVLink or the same device, no host memory, no NCCL set-up). A share whose
        export cannot be opened here is read from the file instead. Two exchanges: the
        exports, then "copied" (so that no rank frees its panel, or computes with a share a
        stopped rank's device no longer holds, before every copy has ended)."""
        from distmm.executor import ipc

        self.wait_event(self.h2d.record())  # this rank's share is on its device
        try:
            mine = ipc.export(self.b_store)
        except ipc.IPCError:
            mine = None
        exports = _exchange(self.watch, group, self.rank, mine)
        mapped, missing = [], []
        try:
            for peer in group:
                lo, hi = shares[peer]
                if peer == self.rank or hi <= lo:
                    continue
                shared = exports.get(peer)
                try:
                    if shared is None:
                        raise ipc.IPCError(f"rank {peer} could not export its share of B")
                    ptr = ipc.map_export(shared)
                except ipc.IPCError:
                    missing.append((lo, hi))
                    continue
                mapped.append(ptr)
                begin = self.h2d.record()
                nbytes = ipc.copy_rect(ptr, shared, self.b_store[lo:hi], lo, 0, stream=self.h2d)
                self.span("comm", begin, self.h2d.record(), nbytes)
            self.wait_event(self.h2d.record())
        finally:
            for ptr in mapped:
                ipc.unmap(ptr)
        for lo, hi in missing:
            self.upload_rows(lo, hi)
        _exchange(self.watch, group, self.rank, True)
        self.b_export = mine  # keeps the export's record until the run ends

    def fill_b(self, first=None):
        """Copy B's column panel (rows ``b_range``) to the device; ``first``: ``(pieces, c,
        pairs)`` of the first stripe, whose GEMMs are queued as their rows of B arrive (each
        waits on the copy of its last chunk). Returns whether no GEMM was queued."""
        self.b_pending = False
        pending = list(first[2]) if first is not None else []
        none_queued = True

        def arrived(hi, event):
            nonlocal none_queued
            ready = [pair for pair in pending if pair[2] <= hi]  # k order: a prefix
            if ready:
                del pending[:len(ready)]
                self.compute.wait_event(event)
                none_queued = self.queue_gemms(first[0], first[1], ready, none_queued)

        self.upload_rows(*self.b_range, on_chunk=arrived if first is not None else None)
        self.compute.wait_event(self.h2d.record())
        if pending:  # panels outside this rank's rows of B (none where it holds all of k)
            none_queued = self.queue_gemms(first[0], first[1], pending, none_queued)
        return none_queued

    def queue_gemms(self, pieces, c, pairs, first=True):
        """Queue ``c (+)= A_piece @ B_rows`` on the compute stream for each ``(owner, k0, k1)``
        in k order (the first with ``beta = 0`` when ``first``); whether none was queued."""
        for owner, k0, k1 in pairs:
            off = self.a_cuts[owner]
            self.executor.device_gemm(pieces[owner][:, k0 - off:k1 - off], self.b_store[k0:k1],
                                      c, beta=0 if first else 1, stream=self.compute)
            first = False
        return first

    def upload_rows(self, k0, k1, on_chunk=None):
        """Read rows ``k0:k1`` of B's column panel from the file (reader threads, two pinned
        slots) and queue their copies into ``b_store`` on the h2d stream; ``on_chunk(hi,
        event)`` after each chunk's copy is queued (rows below ``hi`` are on the device once
        ``event`` has passed)."""
        if k1 > k0 and self.nj:
            rows = self.plan.chunk_rows
            slots = [self.pinned((min(rows, k1 - k0), self.nj)) for _ in range(2)]
            uploaded = [None, None]
            starts = list(range(k0, k1, rows))
            futures = {}

            def submit(n):
                lo, hi = starts[n], min(starts[n] + rows, k1)
                slot = n % 2
                futures[n] = self.read(self.b, slots[slot][:hi - lo], lo, hi, self.c0, self.c1,
                                       before=lambda s=slot: _event_wait(uploaded[s]))

            submit(0)
            if len(starts) > 1:
                submit(1)
            for n, lo in enumerate(starts):
                hi = min(lo + rows, k1)
                host = self.result(futures.pop(n))
                with self.h2d:
                    begin = self.h2d.record()
                    self.b_store[lo:hi].set(host, stream=self.h2d)
                    uploaded[n % 2] = self.h2d.record()
                self.span("h2d", begin, uploaded[n % 2], host.nbytes)
                if n + 2 < len(starts):
                    submit(n + 2)
                if on_chunk is not None:
                    on_chunk(hi, uploaded[n % 2])

    def note_comm(self, requests):
        for request in requests:
            if hasattr(request, "start"):
                self.span("comm", request.start, request.done)

    def prefetch(self, t, stripe):
        """Reads of this rank's pieces of A's stripe into pinned slot ``t % 2``: ``{piece:
        Future}`` (each waits until the slot's last copy to the device has passed)."""
        r0, r1 = self.rows_of(stripe)
        slot = t % 2
        return {jj: self.read(self.a, self.a_host[slot][jj][:r1 - r0], r0, r1, self.a_cuts[jj],
                              self.a_cuts[jj + 1],
                              before=lambda: _event_wait(self.a_host_free[slot]))
                for jj in self.a_mine if r1 > r0 and self.widths[jj]}

    def stripe_loop(self, todo, skip, writer):
        futures = {t: self.prefetch(t, s) for t, s in enumerate(todo[:2])}
        for t, stripe in enumerate(todo):
            self.watch.check()  # a stop is acted on between stripes, however the loop is paced
            slot = t % 2
            r0, r1 = self.rows_of(stripe)
            h = r1 - r0
            pieces = [p[:h] for p in self.a_dev[slot]]
            reads = futures.pop(t)
            with self.h2d:
                if self.gemm_done[slot] is not None:  # stripe t-2's GEMM has read this slot
                    self.h2d.wait_event(self.gemm_done[slot])
                for jj, future in reads.items():
                    host = self.result(future)
                    begin = self.h2d.record()
                    pieces[jj].set(host, stream=self.h2d)
                    self.a_host_free[slot] = self.h2d.record()
                    self.span("h2d", begin, self.a_host_free[slot], host.nbytes)
                uploaded = self.h2d.record()
                requests = [] if self.direct else [self.comms.row.ibcast(pieces[root], root)
                                                   for root in range(self.grid.cols)]
            self.note_comm(requests)
            if t + 2 < len(todo):
                futures[t + 2] = self.prefetch(t + 2, todo[t + 2])
            # the first stripe in finer k steps (wherever it runs: the bits stay the same)
            pairs = self.panel_pairs(self.plan.first_panels if stripe == 0 else None)
            with self.compute:
                self.compute.wait_event(uploaded)
                for request in requests:
                    request.wait()
                if stripe in skip:
                    if self.b_pending:
                        self.fill_b()
                    self.gemm_done[slot] = self.compute.record()
                    continue
                if self.d2h_done[slot] is not None:  # stripe t-2's C has left this slot
                    self.compute.wait_event(self.d2h_done[slot])
                c = self.c_dev[slot][:h]
                begin = self.compute.record()
                if self.b_pending:  # B's panel arrives while this stripe multiplies
                    first = self.fill_b((pieces, c, pairs))
                else:
                    first = self.queue_gemms(pieces, c, pairs)
                if first:
                    c.fill(0)
                self.gemm_done[slot] = self.compute.record()
                self.span("gemm", begin, self.gemm_done[slot])
            free = self.c_free[slot]
            poll(free.is_set, self.watch)  # the writer is done with this pinned slot
            free.clear()
            if self.c_host is None:
                self.c_host = self.result(self.c_host_ready)
            out = self.c_host[slot][:h]
            with self.d2h:
                self.d2h.wait_event(self.gemm_done[slot])
                begin = self.d2h.record()
                # queued, not waited for: cupy's ``get(stream=...)`` blocks until the copy ends
                # (so until the GEMM does), and a loop paced by it never polls the stop watch
                rt = self.cp.cuda.runtime
                rt.memcpyAsync(out.ctypes.data, c.data.ptr, out.nbytes, rt.memcpyDeviceToHost,
                               self.d2h.ptr)
                self.d2h_done[slot] = self.d2h.record()
                self.span("d2h", begin, self.d2h_done[slot], out.nbytes)
            writer.put((stripe, (r0, r1, self.c0, self.c1), out, self.d2h_done[slot], free))

    def release_device(self):
        """Once the last GEMM and copy out have ended, free the device buffers (A's stripes,
        C's, B's panel and its export: every peer has copied its share, ``copy_shares``) while
        the writer drains the last stripes: at the end of a job the driver frees the ranks'
        memory one process after another (4 ranks holding 8 GiB each: ~1 s more than without,
        ``open-items.sh exitprobe``)."""
        start = time.perf_counter()
        for stream in (self.h2d, self.compute, self.d2h):
            self.wait_event(stream.record())
        self.a_dev = self.c_dev = self.b_store = self.b_export = None
        self.cp.get_default_memory_pool().free_all_blocks()
        self.phases.add("release", start, time.perf_counter())

    def close(self):
        """Turn the CUDA events into spans on the host clock (only those that completed). A
        stopped run may leave copies queued from and into its pinned buffers: they stay
        registered, with the device buffers, until those copies have ended (a thread waits
        for them; the stop itself does not)."""
        self.pinning.shutdown(wait=False)
        held = (self.owners, self.a_dev, self.c_dev, getattr(self, "b_store", None))
        self.owners, self.a_dev, self.c_dev, self.b_store = [], None, None, None
        try:
            queued = [stream.record() for stream in (self.h2d, self.compute, self.d2h)]
            if not all(event.done for event in queued):
                threading.Thread(target=_hold_until, args=(queued, held), daemon=True,
                                 name="distmm-queued-copies").start()
        except Exception:  # noqa: BLE001 - a broken context: hold them until the process ends
            _HELD.append(held)
        get = self.cp.cuda.get_elapsed_time
        for phase, begin, end, nbytes in self.events:
            if begin.done and end.done:
                start = self.ref_time + get(self.ref, begin) / 1e3
                self.phases.add(phase, start, self.ref_time + get(self.ref, end) / 1e3, nbytes)
        self.events.clear()


_HELD: list = []  # buffers of runs whose queued copies could not be waited for


def _hold_until(events, held) -> None:
    """Keep ``held`` (pinned owners, device buffers) alive until ``events`` have passed."""
    for event in events:
        _event_wait(event)
    del held


def _event_wait(event) -> None:
    """On a reader thread: wait until a CUDA event has passed (None: at once)."""
    if event is not None:
        poll(lambda: event.done, None)
