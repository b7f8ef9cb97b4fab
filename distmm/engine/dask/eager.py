"""In-memory operands on a cluster: scatter the blocks, run the graph, gather C.

This module covers: sending the blocks of numpy (or on-disk) operands to the
workers whose tasks read them (or the workers reading them from a file they
all see: ``files``; only those that were asked, a worker joining later is sent its blocks
by the client), running the product's graph over them, writing the output
blocks into the result as they arrive, or, for a staged output file every
worker sees, a write task after each block that puts it there on the worker
and sends the client only the bytes it wrote (``sink``; the writes end, on
every worker, before ``run_eager`` returns or raises), with a progress bar and an
optional ``performance_report``, and surviving worker loss: blocks lost with
a worker are sent again, output blocks not yet gathered are run again (also
those whose tasks wait for a worker that has left while nothing arrives:
``_StallWatch``), and when no worker is alive the loop waits for one. It gives up only after
``retry_timeout`` seconds of failures without one output block arriving, with
``distmm.errors.WorkersLost`` saying what was lost. A Ctrl-C (or any error) anywhere in
the call leaves no task or block of it on the cluster, also while its traceback is kept:
what was sent is always held where the cleanup finds it (``_uninterrupted``, ``_let_go``).
A stack of small matrices that the plan keeps whole (``stacks.eager_applies``) is sent
and computed in about one batch block per worker slot (``tasks.stack_block``), not one
block and task per element.
In block mode (``layout`` given: one contiguous block of C per worker unit,
``distmm.plan_blocks``) the same loop runs over the layout's cells,
and a cell whose GPU task raises ``distmm.errors.TileFailed`` is run again
with the CPU executor on a CPU worker (any worker when there is none); the
log names the cells that moved. A fallback is not a failure: it does not
count towards ``retry_timeout``.
It does *not* cover: the graph (``distmm.engine.dask.graph``) or dask
operands, whose chunks the scheduler recomputes itself
(``distmm.engine.dask.lazy``).

Scattered blocks have no task that could recompute them, which is why this
loop exists. Every task is pure and deterministic and the reduction order is
the plan's, so an output block computed again, on any worker, has the same
bits: a run with failures equals an undisturbed one bit for bit.
"""
from __future__ import annotations

import logging
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from itertools import product as iproduct

import numpy as np

from distmm.engine.dask import stacks
from distmm.engine.dask.chunks import Geometry
from distmm.engine.dask.graph import CellTasks, OperandKeys, ProductLayer, names_of
from distmm.engine.dask.placement import BlockPlacement, Placement
from distmm.engine.dask.scheduler import scheduler_address
from distmm.engine.dask.tasks import TaskPlan, pop_flags, stack_block
from distmm.errors import SchedulerLost, TileFailed, WorkersLost
from distmm.fpflags import report as report_flags
from distmm.plan import Plan

__all__ = ["run_eager"]

log = logging.getLogger("distmm.engine.dask")

#: a run is "long" (progress bar on a terminal) above this estimated duration
_LONG_RUN_SECONDS = 10.0
_ASSUMED_FLOPS_PER_SLOT = 20e9


def _transient_errors() -> tuple:
    """What a lost or restarting worker raises through the client."""
    from concurrent.futures import CancelledError

    from distributed.scheduler import KilledWorker

    return (CancelledError, KilledWorker, OSError, KeyError, TimeoutError)


class _TaskError(Exception):
    """A task of the product raised ``error`` itself: raised through the loop's handler of
    lost workers (``error`` may be an ``OSError``, which a lost worker's comm raises too)."""

    def __init__(self, error: BaseException):
        super().__init__(error)
        self.error = error


class _Scattered:
    """The blocks of one host operand as futures on the cluster, sent again when lost.

    Block ``(*batch, r, c)`` is ``array[batch..., row_edges[r]:row_edges[r+1],
    col_edges[c]:col_edges[c+1]]`` with the batch axes kept (length 1), as a
    dask chunk of one batch element. ``needers[idx]``: the plan owners (block
    mode: the units) whose tasks read that block. ``copies`` (block mode):
    each block goes straight to every worker reading it, one copy each, so
    that no task fetches a block from another worker; otherwise one copy, on
    the least loaded of its readers.
    """

    def __init__(self, client, array, row_edges, col_edges, needers: dict, tag: str,
                 copies: bool = False, source=None, readers=frozenset()):
        self.client = client
        self.array = array
        self.source = source  # files.FileSource: workers read their blocks from the file
        # the workers found to read it (``files.visible``): a worker that joined since may not
        # see the file or have the HDF5 filters its data needs
        self.readers = frozenset(readers) if source is not None else frozenset()
        self.row_edges = row_edges
        self.col_edges = col_edges
        self.needers = needers
        self.tag = tag
        self.copies = copies
        self.generation = 0
        self.futures: dict[tuple, dict] = {}  # idx -> {worker: future}
        self.resent = 0
        self.client_read = False  # a block of the file read by the client and sent

    def chunks(self) -> tuple:
        batch = self.array.shape[:-2]
        return tuple((1,) * s if s else (0,) for s in batch) + (
            tuple(np.diff(self.row_edges).tolist()), tuple(np.diff(self.col_edges).tolist()))

    def keys(self) -> OperandKeys:
        if self.copies:
            table = {idx: dict(by) for idx, by in self.futures.items()}
        else:
            table = {idx: next(iter(by.values())) for idx, by in self.futures.items() if by}
        return OperandKeys(tuple(self.array.shape), self.chunks(), table=table)

    def index(self, idx) -> tuple:
        lead, r, c = idx[:-2], idx[-2], idx[-1]
        return tuple(slice(x, x + 1) for x in lead) + (
            slice(self.row_edges[r], self.row_edges[r + 1]),
            slice(self.col_edges[c], self.col_edges[c + 1]))

    def block(self, idx):
        return np.asarray(self.array[self.index(idx)])

    def nbytes(self, idx) -> int:
        rows, cols = self.index(idx)[-2:]
        return (rows.stop - rows.start) * (cols.stop - cols.start) * self.array.dtype.itemsize

    def _wanted(self, idx, slots: list[str], alive: set) -> list[str]:
        wanted = {slots[o % len(slots)] for o in self.needers.get(idx, ())} & alive if slots else set()
        return sorted(wanted) or sorted(alive)

    def missing(self, slots: list[str] | None = None, alive: set | None = None) -> list:
        """``(block, worker)`` to send: blocks never sent or whose only copy
        went with a worker (worker None: the least loaded reader), and with
        ``copies``, each reader's worker lacking its own copy."""
        held: dict = {}
        futs = [f for by in self.futures.values() for f in by.values() if f.status == "finished"]
        if futs:
            where = self.client.who_has(futs)
            held = {f.key: set(where.get(f.key) or ()) for f in futs}
        for by in self.futures.values():  # blocks being read from their file: a read
            for w, f in by.items():        # whose worker is lost runs again on another
                if f.status == "pending" and (alive is None or w in alive):
                    held[f.key] = {w}
                # a read pinned to a lost worker is not counted: distributed 2024.12 can
                # leave it "no-worker" for ever (restricted, loose or not, to that worker),
                # and the product tasks of the next round would wait on it
        out = []
        for idx in self.needers:
            have = {w for w, f in self.futures.get(idx, {}).items() if held.get(f.key)}
            if not self.copies:
                if not have:
                    out.append((idx, None))
                continue
            for w in self._wanted(idx, slots or [], alive or set()):
                if w not in have:
                    out.append((idx, w))
        return out

    def scatter(self, pairs, slots: list[str], alive: set, load: dict) -> None:
        """Send blocks, each to its worker (None: the least loaded live
        worker among those whose tasks need it, any live worker when none of
        those is alive; for a file's blocks, among its live ``readers`` first). A file's
        block is read by its worker when that worker is one of ``readers`` (and by no other
        worker: ``allow_other_workers=False``), else by the client and sent."""
        if not pairs:
            return
        if not alive:
            raise OSError("no worker is alive to receive scattered blocks")
        self.generation += 1
        name = f"distmm-{self.tag}-{self.generation}"
        readers = sorted(self.readers & alive)
        reads: dict[str, dict] = defaultdict(dict)
        sends: dict[str, dict] = defaultdict(dict)
        for idx, worker in pairs:
            if worker is None:
                wanted = self._wanted(idx, slots, alive)
                worker = min([w for w in wanted if w in self.readers] or readers or wanted,
                             key=lambda w: load.get(w, 0))
            load[worker] = load.get(worker, 0) + self.nbytes(idx)
            if self.futures.get(idx):
                self.resent += 1
            key = (name,) + tuple(idx) + (worker,)
            if worker in self.readers:  # the worker reads its block from the file
                reads[worker][key] = (idx, worker)
            else:
                sends[worker][key] = (idx, worker, self.block(idx))
        if sends and self.source is not None:
            self.client_read = True  # blocks of the file read here, for workers not asked
        _uninterrupted(partial(self._send, reads, sends), partial(self._keep, reads, sends),
                       _release)

    def _keep(self, reads: dict, sends: dict, futs: dict) -> None:
        """Hold the futures of blocks just sent or read (``futs``, by key) as the blocks'."""
        for items in (*reads.values(), *sends.values()):
            for key, (idx, worker, *_) in items.items():
                by = self.futures.setdefault(idx, {})
                if not self.copies:
                    by.clear()
                by[worker] = futs[key]

    def _send(self, reads: dict, sends: dict) -> dict:
        """Submit the reads and scatter the blocks (``scatter``); their futures by key."""
        futs: dict = {}
        if reads:
            from distmm.engine.dask.files import read_block
        for worker, items in reads.items():
            futs.update({key: self.client.submit(read_block, self.source, self.index(idx),
                                                 key=key, workers=[worker],
                                                 allow_other_workers=False, pure=False)
                         for key, (idx, _) in items.items()})
        for worker, items in sends.items():
            futs.update(self.client.scatter({key: item[2] for key, item in items.items()},
                                            workers=[worker], hash=False))
        return futs


def _release(futs: dict) -> None:
    for f in futs.values():
        f.release()


def _uninterrupted(fn, keep, abandon) -> None:
    """Run ``fn()`` on a thread of its own while this thread waits, and hand what it made to
    ``keep`` on that thread, at once: where the caller's cleanup finds it. A Ctrl-C (or any
    exception) in the wait raises here at once, and what ``fn`` makes after that goes to
    ``abandon`` instead. So what ``fn`` put on the cluster is never held only by a local
    variable, which an interrupted call's traceback keeps (an interactive session keeps the
    last one): an interrupted blocking call of distributed cancels its client side only (a
    ``Client.scatter`` the scheduler was carrying out left the blocks on the workers, held
    for this client by no future that could release them), and futures made but not yet
    kept held the blocks, or a whole product's graph, on the cluster."""
    import contextlib
    import sys
    import threading

    lock, box = threading.Lock(), {}
    device = contextlib.nullcontext()
    if "cupy" in sys.modules:  # the caller's current GPU, for cupy blocks' serialisation
        try:
            device = sys.modules["cupy"].cuda.Device()
        except Exception:  # noqa: BLE001 - no GPU here: no cupy block either
            pass

    def run() -> None:
        try:
            with device:
                got, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            got, error = None, exc
        with lock:
            box["error"] = error
            if error is not None:
                return
            if not box.get("abandoned"):
                try:
                    keep(got)  # signals reach the main thread only: this runs whole
                except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
                    box["error"] = exc
                return
        abandon(got)

    thread = threading.Thread(target=run, name="distmm-send", daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
    except BaseException:
        with lock:
            box["abandoned"] = True  # what ``fn`` made is kept already, or is abandoned
        raise
    if box["error"] is not None:
        raise box["error"]


class _StackScattered(_Scattered):
    """The batch blocks of one host operand of a stack (``stacks.batch_blocks``): block
    ``(b,)`` is what output batch block ``b`` reads (``stacks.operand_index``)."""

    def __init__(self, client, array, regions, batch, tag: str, source=None,
                 readers=frozenset()):
        needers = {(b,): {b} for b in range(len(regions))}
        super().__init__(client, array, None, None, needers, tag, source=source,
                         readers=readers)
        self.indexes = [stacks.operand_index(array.shape, batch, lo, hi) for lo, hi in regions]

    def index(self, idx) -> tuple:
        return self.indexes[idx[0]]

    def held(self) -> dict:
        """Each block's future (one copy each)."""
        return {idx: next(iter(by.values())) for idx, by in self.futures.items() if by}

    def nbytes(self, idx) -> int:
        shape = np.broadcast_to(np.empty((), np.uint8), self.array.shape)[self.index(idx)].shape
        return int(np.prod(shape, dtype=np.int64)) * self.array.dtype.itemsize


@dataclass(frozen=True)
class _StackPlacement:
    """The ``workers=`` annotation of a stack's tasks: batch block ``b`` on slot ``b``."""

    name: str
    slots: tuple

    def __call__(self, key):
        if not (isinstance(key, tuple) and key and key[0] == self.name and self.slots):
            return None
        return [self.slots[key[1] % len(self.slots)]]


class _StackLayer(dict):
    """One round's tasks of a stack: ``stack_block`` of each pending batch block, as
    ``_submit`` takes a ``ProductLayer`` (``annotations``: the layer's)."""

    def __init__(self, name, regions, a_sc, b_sc, tp, backend, pending, annotations):
        from distmm.engine.dask.graph import make_task

        super().__init__()
        self.name, self.annotations, self.blocks = name, annotations, sorted(pending)
        a_keys, b_keys = a_sc.held(), b_sc.held()
        for ob, _, _ in self.blocks:
            lo, hi = regions[ob[0]]
            key = self.output_key(ob, 0, 0)
            shape = tuple(h - l for l, h in zip(lo, hi))
            self[key] = make_task(key, stack_block, tp, backend, a_keys[ob], (), b_keys[ob], (),
                                  shape, lo)

    def iter_blocks(self):
        return iter(self.blocks)

    def output_key(self, ob, bi, bj):
        return (self.name,) + tuple(ob) + (bi, bj)

    def as_layer(self):
        from dask.highlevelgraph import MaterializedLayer

        return MaterializedLayer(dict(self), annotations=self.annotations)


def _stack_regions(ops, plan, slots, layout, out) -> list | None:
    """The batch blocks ``(lo, hi)`` of a stack of small matrices computed a block per
    task (``stacks.eager_applies``), or None: one task per element (block mode, a staged
    output the workers write)."""
    from distmm.engine.dask.sink import sink_of

    if layout is not None or not stacks.eager_applies(ops, plan) or sink_of(out) is not None:
        return None
    batch = tuple(ops.batch)
    itemsize = max(ops.a2.dtype.itemsize, ops.b2.dtype.itemsize, np.dtype(ops.dtype).itemsize)
    per_element = (ops.m * ops.k + ops.k * ops.n + ops.m * ops.n) * itemsize
    need = -(-int(np.prod(batch, dtype=np.int64)) * per_element // stacks.BLOCK_BYTES)
    return stacks.batch_blocks(batch, max(len(slots), need, 1))


def _stack_region(regions, block) -> tuple:
    """Where in C the output block ``((b,), 0, 0)`` of a stack goes: its batch axes."""
    lo, hi = regions[block[0][0]]
    return tuple(slice(l, h) for l, h in zip(lo, hi))


def _file_sink(client, out, rows, cols):
    """The ``sink.FileSink`` of ``out`` when it is a staged output every worker sees (those
    workers write C there, and no other: ``sink.write_placement``), else None: the client
    writes the blocks, and says so on stderr when ``out`` is a staged file the workers do
    not see."""
    from distmm.engine.dask import files, sink

    found = sink.sink_of(out)
    if found is None:
        return None
    workers = list(client.scheduler_info(n_workers=-1)["workers"])
    if not files.visible(client, [found], workers):
        log.warning("distmm: the workers do not see the staged %s (another host, or no "
                    "shared file system): C is gathered and written by this process",
                    found.target)
        return None
    return found.for_blocks(rows, cols).for_workers(workers)


def _let_go(client, futures, scattered) -> None:
    """After a failed product (a task's error, lost workers, a Ctrl-C): cancel the round's
    tasks still queued or held, and release the operands' blocks sent or read, as dask's own
    compute lets go of its futures. Otherwise the futures, held by the error's traceback (an
    interactive session keeps the last one), keep the cluster computing blocks nobody
    gathers and holding them and the operands in the workers' memory. The blocks are
    released (``Future.release``), not cancelled: cancelling a block goes on to its
    dependents, and distributed's scheduler asserts on one that no future holds (the
    client's stream then broke, and the run's line said the scheduler was lost)."""
    for sc in scattered:
        for by in sc.futures.values():
            for f in by.values():
                f.release()  # this client's hold on the block, whatever else refers to it
        sc.futures.clear()
    if not futures or getattr(client, "status", "running") != "running":
        return  # a closed client's futures went with it
    try:
        client.cancel(list(futures))
    except Exception:  # noqa: BLE001 - the cluster in trouble: the call's own error stands
        pass


def _finish_files(client, sink, sources, *, written: bool, lost: bool) -> int:
    """After the product, in success and in failure: the workers' writes of C end
    (``sink.close``: nothing writes into the staged output once the engine returns or
    raises; after a failure its tasks still queued were cancelled first: ``_let_go``), and
    their HDF5 operand files close (``files.release``). Returns the bytes of C the workers
    wrote past the page cache."""
    from distmm.engine.dask import files

    try:
        if sink is not None:
            from distmm.engine.dask.sink import close

            return close(client, sink, ok=written, lost=lost)
        return 0
    finally:
        files.release(client, sources)


def _file_sources(client, a2, b2, what: str = "matmul"):
    """``files.FileSource`` of each operand whose file every worker sees (None: the client
    reads its blocks and sends them), and the workers that were asked (only they read the
    files: one that joins later reads none). An HDF5 dataset that some worker's HDF5 lacks a
    filter for is refused (ValueError, ``files.visible``), named as ``what``'s operand."""
    from distmm.engine.dask import files

    found = [files.source_of(x) for x in (a2, b2)]
    if not any(found):
        return None, None, frozenset()
    workers = list(client.scheduler_info(n_workers=-1)["workers"])
    if not files.visible(client, found, workers,
                         names=[f"{what}: operand {name}" for name in ("a", "b")]):
        log.info("distmm: an operand's file is not the same on every worker; the client "
                 "reads it and sends the blocks")
        return None, None, frozenset()
    return found[0], found[1], frozenset(workers)


def _needers(plan: Plan, batch, a_batch, b_batch):
    """For every block of A and B, the plan owners whose tasks read it."""
    a_need: dict = defaultdict(set)
    b_need: dict = defaultdict(set)
    for ob in iproduct(*(range(n) for n in batch)):
        a_lead = tuple(0 if s == 1 else x for s, x in zip(a_batch, ob[len(ob) - len(a_batch):]))
        b_lead = tuple(0 if s == 1 else x for s, x in zip(b_batch, ob[len(ob) - len(b_batch):]))
        for i, j in plan.tiles():
            for s in range(plan.k_splits):
                w = plan.owner_of_partial(i, j, s)
                a_need[a_lead + (i, s)].add(w)
                b_need[b_lead + (s, j)].add(w)
    return a_need, b_need


def _cell_needers(layout):
    """For every block of A (row cell, k group) and B (k group, column cell),
    the units whose tasks read it."""
    a_need: dict = defaultdict(set)
    b_need: dict = defaultdict(set)
    for bi, bj in layout.cells():
        for g in range(layout.groups):
            u = layout.unit_of_partial(bi, bj, g)
            a_need[(bi, g)].add(u)
            b_need[(g, bj)].add(u)
    return a_need, b_need


class _Blocks:
    """Block mode's state across attempts: the layout, its units, the cells
    failing on purpose, and the cells moved to CPU workers."""

    def __init__(self, layout, units, fail):
        self.layout = layout
        self.units = list(units)
        self.fail = frozenset(fail)
        self.moved: dict = {}  # cell -> the GPU worker it failed on

    def addresses(self, alive: set) -> list[str]:
        """Each unit's worker; a unit whose worker is gone goes to a live
        worker of the same kind (any live worker when there is none)."""
        gpu_alive = sorted({u.address for u in self.units if u.gpu} & alive)
        any_alive = sorted(alive)
        out = []
        for i, u in enumerate(self.units):
            if u.address in alive or not any_alive:
                out.append(u.address)
            else:
                pool = (gpu_alive if u.gpu else []) or any_alive
                out.append(pool[i % len(pool)])
        return out

    def cpu_workers(self, alive: set) -> list[str]:
        cpu = sorted({u.address for u in self.units if not u.gpu} & alive)
        return cpu or sorted(alive)

    def devices(self, alive: set) -> CellTasks:
        from distmm.plan_blocks import layout_devices

        table = {key: dev for key, dev in layout_devices(self.layout, self.units).items()
                 if key[:2] not in self.moved}
        addresses = self.addresses(alive)
        homes = {(bi, bj, g): addresses[self.layout.unit_of_partial(bi, bj, g)]
                 for bi, bj in self.layout.cells() for g in range(self.layout.groups)}
        return CellTasks(table, self.fail, homes=homes)

    def placement(self, name: str, alive: set):
        cpu = self.cpu_workers(alive)
        moved = {cell: cpu[i % len(cpu)] for i, cell in enumerate(sorted(self.moved))} if cpu else {}
        return BlockPlacement(self.layout, names_of(name), self.addresses(alive), moved)

    def cell_text(self, cell) -> str:
        bi, bj = cell
        lay = self.layout
        return (f"({bi}, {bj}) rows {lay.row_edges[bi]}:{lay.row_edges[bi + 1]} "
                f"cols {lay.col_edges[bj]}:{lay.col_edges[bj + 1]}")


def _show_progress(progress, plan: Plan, batch, slots) -> bool:
    if progress is not None:
        return bool(progress)
    count = int(np.prod(batch, dtype=np.int64)) if batch else 1
    estimate = plan.flops * count / (max(len(slots), 1) * _ASSUMED_FLOPS_PER_SLOT)
    return estimate > _LONG_RUN_SECONDS and sys.stderr.isatty()


def _alive(client) -> tuple[set, list[str]]:
    """Live workers, and the worker slots (paused workers can hold blocks but
    run nothing, so slots prefer running ones)."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    alive = set(info)
    running = {a for a, w in info.items() if w.get("status", "running") == "running"} or alive
    slots = [a for a in sorted(running) for _ in range(max(int(info[a].get("nthreads", 1)), 1))]
    return alive, slots


@dataclass
class _Round:
    """What one round of tasks gave: tiles written, GPU cells to rerun on CPU workers
    (``fell_back``), tasks lost to a worker failure and the last such error."""

    arrived: int = 0
    fell_back: list = field(default_factory=list)
    lost: int = 0
    last_error: BaseException | None = None


def _collect(got: _Round, futures, watch, out, rows, cols, pending, bar, *, fall_back: bool,
             transient, region=None) -> None:
    """Take the round's tasks as they finish, into ``got``: each tile written into
    ``out`` (a stack's batch block at ``region(block)``) and struck from ``pending``; a
    ``TileFailed`` kept for the CPU fallback (block mode; raised otherwise); a task lost
    with its worker counted (the round is retried); any other task error raised past the
    retry loop."""
    from distributed import as_completed

    if not futures:
        return
    # on the futures' own client's loop: as_completed otherwise takes the default client's,
    # and fails without one (a client made with set_as_default=False)
    for fut in as_completed(futures, loop=next(iter(futures)).client.loop):
        try:
            tile_out = fut.result()  # a block of C, or the bytes a worker wrote (out None)
        except TileFailed as exc:
            if not fall_back:
                raise
            got.fell_back.append((futures[fut], exc))
            continue
        except transient as exc:
            if fut.status == "error" and not _is_killed(exc):
                raise _TaskError(exc) from exc  # past the loss handler
            got.lost, got.last_error = got.lost + 1, exc
            continue
        watch.arrived()
        ob, i, j = futures[fut]
        if out is not None and region is not None:
            at = region(futures[fut])
            out[at] = tile_out.reshape(out[at].shape)
        elif out is not None:
            out[ob + (slice(rows[i], rows[i + 1]), slice(cols[j], cols[j + 1]))] = \
                tile_out.reshape(tile_out.shape[-2:])
        pending.discard((ob, i, j))
        got.arrived += 1
        if bar is not None:
            bar.update(1)
        fut.release()


class _StallWatch:
    """Cancels one attempt's futures when a worker its tasks were placed on has
    left the cluster and no output block has arrived for ``quiet`` seconds.

    A task restricted to a lost worker can stay unrunnable for ever: distributed
    2024.12 moves a task to "no-worker" when no worker is running (all paused at
    their memory limit, say) and later reschedules it only onto a worker its
    restrictions name, loose or not. Seen on 256 MiB workers, one of them
    restarted by its nanny: the loop waited on those blocks with both workers
    idle. The cancelled blocks come back to the loop as lost ones and run again
    on the live workers.
    """

    def __init__(self, client, futures, placed_on, *, every: float = 1.0, quiet: float = 5.0):
        import threading

        self.client, self.futures, self.placed_on = client, list(futures), set(placed_on)
        self.every, self.quiet = every, quiet
        self.last = time.monotonic()
        self.gone: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distmm-stall-watch", daemon=True)

    def arrived(self) -> None:
        self.last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if time.monotonic() - self.last < self.quiet:
                continue
            try:
                alive, _ = _alive(self.client)
            except Exception:  # the scheduler unreachable for now: the loop's own errors say so
                continue
            gone = self.placed_on - alive
            if gone:
                self.gone = gone
                log.warning("distmm: worker(s) %s left with tasks placed on them and nothing "
                            "arrived for %.0f s; running those blocks again on the live workers",
                            sorted(gone), self.quiet)
                self.client.cancel(self.futures)
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_eager(ops, plan: Plan, client, slots: list[str], backend: str, *, progress=None,
              report=None, retry_timeout: float = 60.0, layout=None, units=None, fail=(),
              stats: dict | None = None, out=None, flags: set | None = None,
              what: str = "matmul"):
    """Compute the product of host operands on the cluster; return numpy's array, or
    ``out`` filled.

    ``layout``/``units``: block mode (2-D products only); ``fail``: cells
    that raise ``TileFailed`` on the GPU on purpose; ``stats``: filled with
    what the run did (cells moved to CPU workers, tasks submitted, whether the
    workers wrote C). ``out``: where C goes (the 2-D result's shape and dtype):
    a staged output every worker sees is written by the workers themselves
    (``distmm.engine.dask.sink``), anything else by the client as blocks arrive.
    ``flags``: a set the floating-point flags the tasks raised are added to, for the caller
    to report; without it they are reported here once C is filled, as numpy's matmul does.
    ``what``: the function the user called (``"matmul"``, ``"gemm"``), which a
    ``SchedulerLost`` names.
    """
    dtype = np.dtype(ops.dtype)
    if out is None:
        out = np.empty(ops.out_shape, dtype=dtype)
    if out.size == 0:
        return out
    if plan.k == 0:
        out[...] = 0
        return out
    a2, b2 = ops.a2, ops.b2
    batch = tuple(ops.batch)
    token = uuid.uuid4().hex[:12]
    blocks = None
    regions = _stack_regions(ops, plan, slots, layout, out)
    if regions is not None:
        a_need = b_need = None
        rows, cols, ks, reduction = plan.row_edges, plan.col_edges, plan.k_edges, plan.reduction
    elif layout is not None:
        blocks = _Blocks(layout, units, fail)
        a_need, b_need = _cell_needers(layout)
        rows, cols, ks, reduction = layout.row_edges, layout.col_edges, layout.k_edges, layout.reduction
    else:
        a_need, b_need = _needers(plan, batch, a2.shape[:-2], b2.shape[:-2])
        rows, cols, ks, reduction = plan.row_edges, plan.col_edges, plan.k_edges, plan.reduction
    # float results (and object ones, whose numpy scalars raise flags too): the tasks keep
    # their floating-point flags under the token, reported here
    task_plan = TaskPlan.of(plan, flags=token if dtype.kind in "fcO" else "")
    a_src, b_src, readers = _file_sources(client, a2, b2, what)
    sink = _file_sink(client, out, rows, cols)
    if sink is not None:
        from distmm.engine.dask.sink import write_placement
    if regions is not None:
        a_sc = _StackScattered(client, a2, regions, batch, f"a-{token}", source=a_src,
                               readers=readers)
        b_sc = _StackScattered(client, b2, regions, batch, f"b-{token}", source=b_src,
                               readers=readers)
    else:
        a_sc = _Scattered(client, a2, rows, ks, a_need, f"a-{token}",
                          copies=blocks is not None, source=a_src, readers=readers)
        b_sc = _Scattered(client, b2, ks, cols, b_need, f"b-{token}",
                          copies=blocks is not None, source=b_src, readers=readers)
    if stats is not None:
        stats["token"] = token  # in the keys of this product's tasks: distmm-*-TOKEN-...
    region = None
    if regions is not None:
        pending = {((b,), 0, 0) for b in range(len(regions))}
        region = partial(_stack_region, regions)
    elif blocks is not None:
        geometry = Geometry.of_cells(rows, cols, ks, a_sc.chunks(), b_sc.chunks())
    else:
        geometry = Geometry.of(plan, a_sc.chunks(), b_sc.chunks(), follow_chunks=False)
    if regions is None:
        gm, gn = geometry.grid
        pending = {(ob, i, j) for ob in np.ndindex(*batch) for i in range(gm) for j in range(gn)}
    bar = None
    if _show_progress(progress, plan, batch, slots):
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pending), unit="tile", desc="distmm matmul", file=sys.stderr)
    transient = _transient_errors()
    address = scheduler_address(client)  # for a SchedulerLost
    ctx = _performance_report(client, report) if report else nullcontext()
    attempts, failing_since, last_error, failed_tiles = 0, None, None, 0
    submitted, written, futures, raised = 0, False, {}, set()
    client_wrote = False  # a round's blocks written into the sink's file by this process
    t0 = time.perf_counter()
    try:
        with ctx:
            while pending:
                got, outer = _Round(), None
                try:
                    alive, live_slots = _alive(client)
                    slots = live_slots or slots
                    load: dict = {}
                    targets = blocks.addresses(alive) if blocks is not None else slots
                    a_sc.scatter(a_sc.missing(targets, alive), targets, alive, load)
                    b_sc.scatter(b_sc.missing(targets, alive), targets, alive, load)
                    name = f"distmm-matmul-{token}-{attempts}-{submitted}"
                    if regions is not None:
                        placement = _StackPlacement(name, tuple(slots))
                    elif blocks is not None:
                        placement, cells = blocks.placement(name, alive), blocks.devices(alive)
                    else:
                        placement = Placement(plan, geometry, names_of(name), len(batch),
                                              reduction, slots)
                        cells = None
                    where = {"workers": placement, "allow_other_workers": True}
                    if regions is not None:
                        layer = _StackLayer(name, regions, a_sc, b_sc, task_plan, backend,
                                            pending, where)
                    else:
                        layer = ProductLayer(
                            name, geometry, a_sc.keys(), b_sc.keys(), task_plan, backend,
                            batch, reduction, blocks=pending, annotations=where, cells=cells)
                    submitted += len(layer)
                    # the workers found to see the staged output write it; none of them
                    # alive: the client writes this round's blocks
                    writes = write_placement(sink, alive) if sink is not None else None
                    client_wrote = client_wrote or (sink is not None and not writes)
                    # the round's futures, filled on the thread that sends the graph:
                    # ``_let_go`` finds them whenever a Ctrl-C comes
                    futures = {}
                    _uninterrupted(partial(_submit, client, layer, sink if writes else None,
                                           rows, cols, writes),
                                   futures.update, partial(_let_go, client, scattered=()))
                    placed = set(targets) | set(writes["workers"] if writes else ())
                    with _StallWatch(client, futures, placed) as watch:
                        _collect(got, futures, watch, None if writes else out, rows, cols,
                                 pending, bar, fall_back=blocks is not None,
                                 transient=transient, region=region)
                except transient as exc:
                    outer = exc
                # what the round gave, kept also when it ended in a lost worker's error
                fell_back, troubled = got.fell_back, bool(got.lost) or outer is not None
                failing_since = None if got.arrived else failing_since
                failed_tiles += got.lost
                last_error = outer or got.last_error or last_error
                if not pending:
                    break
                if fell_back:
                    _fall_back(blocks, fell_back, placement)
                    if not troubled:
                        continue  # a fallback is not a worker failure
                if client.status in ("closing", "closed"):
                    # closed by its owner, or by distributed when the scheduler was lost and
                    # did not come back: no worker returns through it, so no retry
                    raise SchedulerLost(client_gone(client, address, f"during {what}")
                                        + f": {len(pending)} output block(s) never arrived")
                attempts += 1
                now = time.monotonic()
                failing_since = failing_since or now
                left = retry_timeout - (now - failing_since)
                if left <= 0:
                    raise WorkersLost(_lost_message(retry_timeout, attempts, len(pending), failed_tiles,
                                                    a_sc.resent + b_sc.resent, client, last_error)
                                      ) from last_error
                log.warning("distmm: workers lost during matmul (%r); retrying %d output blocks "
                            "(attempt %d)", last_error, len(pending), attempts)
                _wait_for_a_worker(client, min(left, 5.0))
        written = True
    except _TaskError as failed:  # a task's own error (a file gone, say), not a lost worker
        raise failed.error from None
    finally:
        if bar is not None:
            bar.close()
        try:
            if not written:
                _let_go(client, futures, (a_sc, b_sc))
        finally:
            direct = _finish_files(client, sink, (a_src, b_src), written=written,
                                   lost=bool(attempts))
        if task_plan.flags:
            raised = _raised_flags(client, task_plan.flags)
    log.info("matmul %s on %d worker slot(s): %.3f s", ops.out_shape, len(slots),
             time.perf_counter() - t0)
    if stats is not None:
        if blocks is not None:
            from distmm.engine.dask.stats import estimate_eager

            stats["estimated_bytes"] = estimate_eager(
                a_sc, b_sc, a_need, b_need, blocks.addresses(alive), layout, out.nbytes,
                np.dtype(plan.acc_dtype).itemsize)
        stats["tasks"] = submitted
        # only where the workers wrote every block: no round of them was written here
        stats["written_on_workers"] = sink is not None and not client_wrote
        stats["written_direct"] = direct  # bytes of C the workers wrote past the page cache
        stats["moved"] = sorted(blocks.moved) if blocks is not None else []
        stats["resent"] = a_sc.resent + b_sc.resent
        # only where the workers read every block of the operand: none was read here
        stats["read_on_workers"] = [sc.source is not None and not sc.client_read
                                    for sc in (a_sc, b_sc)]
    if flags is None:
        report_flags(raised)  # under the caller's errstate
    else:
        flags |= raised
    return out


def client_gone(client, address: str | None, during: str) -> str:
    """The words of a ``SchedulerLost``: the client, its scheduler (``address`` where the
    client no longer knows it: a closed one), ``during`` what it was lost (``"during
    matmul"``) and its state."""
    address = scheduler_address(client) or address
    at = f" at {address}" if address else ""
    if client.status == "connecting":  # not closed (yet): distributed tries to reconnect
        return (f"distmm dask engine: the scheduler{at} of the distributed.Client was lost "
                f"{during} (the client is connecting)")
    return (f"distmm dask engine: the distributed.Client closed {during} (closed by its "
            f"caller, or its scheduler{at} was lost; the client is {client.status})")


@contextmanager
def _performance_report(client, filename):
    """distributed's ``performance_report`` of ``client``'s cluster: it reports on
    ``get_client()``'s, which is the default client unless ``client`` is made current."""
    from distributed import performance_report

    with client.as_current(), performance_report(filename=filename):
        yield


def _raised_flags(client, token: str) -> set[str]:
    """The floating-point flags the call's tasks raised, gathered from (and forgotten on)
    every worker, also after a failed call. A worker lost after its blocks arrived takes its
    flags with it; a scheduler gone gives none (the call's own outcome stands)."""
    try:
        got = client.run(pop_flags, token, on_error="return")
    except Exception:  # noqa: BLE001 - the product is done or has failed on its own
        return set()
    return set().union(*(v for v in got.values() if isinstance(v, set)))


def _fall_back(blocks: _Blocks, failed, placement) -> None:
    """Mark the cells whose GPU task raised ``TileFailed`` for the CPU, and say so."""
    lines = []
    for (ob, i, j), exc in failed:
        cell = (i, j)
        if cell in blocks.moved:
            continue
        where = placement((placement.names[0], i, j)) or ["?"]
        blocks.moved[cell] = where[0]
        lines.append(f"{blocks.cell_text(cell)} from {where[0]} ({exc})")
    if lines:
        log.warning("distmm: %d tile(s) failed on the GPU and moved to CPU workers: %s",
                    len(lines), "; ".join(lines))


def _is_killed(exc) -> bool:
    from distributed.scheduler import KilledWorker

    return isinstance(exc, KilledWorker)


def _wait_for_a_worker(client, timeout: float) -> None:
    try:
        client.wait_for_workers(1, timeout=max(timeout, 0.1))
    except (TimeoutError, OSError):
        pass
    time.sleep(0.05)


def _lost_message(timeout, attempts, pending, failed_tiles, resent, client, last_error) -> str:
    try:
        workers = len(client.scheduler_info(n_workers=-1)["workers"])
    except Exception:  # the scheduler itself may be gone
        workers = "unknown"
    return (f"distmm dask engine: gave up after {timeout:g} s of worker failures "
            f"({attempts} attempts): {pending} output block(s) never arrived, {failed_tiles} "
            f"task result(s) lost, {resent} scattered block(s) sent again; workers alive now: "
            f"{workers}; last error: {last_error!r}")


def _submit(client, layer: ProductLayer, sink=None, rows=None, cols=None,
            where: dict | None = None) -> dict:
    """Send the layer and return ``{future: (batch, i, j)}`` for its output blocks; with a
    ``sink``, a write task after each output block (``sink.write_block``, keys
    ``distmm-write-...``, annotated ``where``: ``sink.write_placement``) whose future, the
    bytes it wrote, stands for the block."""
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    as_layer = getattr(layer, "as_layer", None)
    layers, deps = {layer.name: as_layer() if as_layer else layer}, {layer.name: set()}
    blocks = list(layer.iter_blocks())
    keys = [layer.output_key(*blk) for blk in blocks]
    if sink is not None:
        from distmm.engine.dask.graph import make_task, task_ref
        from distmm.engine.dask.sink import write_block

        name = layer.name.replace("distmm-matmul", "distmm-write", 1)
        writes = {}
        for (ob, i, j), key in zip(blocks, keys):
            wkey = (name,) + tuple(ob) + (i, j)
            region = (int(rows[i]), int(rows[i + 1]), int(cols[j]), int(cols[j + 1]))
            writes[wkey] = make_task(wkey, write_block, sink, region, task_ref(key))
        layers[name] = MaterializedLayer(writes, annotations=where)
        deps[name] = {layer.name}
        keys = list(writes)
    futures = client.get(HighLevelGraph(layers, deps), keys, sync=False)
    return dict(zip(futures, blocks))
